"""kernels/head_ref (split-vocab greedy argmax) and kernels/engram_ref (hash ids, lookup, gate)."""
import ml_dtypes
import numpy as np
import pytest

from kernels import engram_ref, head_ref
from loader.config import ModelConfig


def _bf16(x):
    return engram_ref.round_bf16(x)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_split_vocab_argmax_equals_full_argmax(tp):
    rng = np.random.default_rng()
    vocab, dim, rows = 1024, 256, 13
    x = _bf16(rng.normal(0, 1, (rows, dim)))
    head = _bf16(rng.normal(0, 0.05, (vocab, dim)))
    shards = np.split(head, tp)
    got = head_ref.greedy_tokens(x, shards)
    # The per-shard logits are the full logits' columns; argmax over their concatenation (first
    # maximum) is the definition the split pick must reproduce bit for bit.
    full = np.concatenate([head_ref.head_logits(x, s) for s in shards], axis=1)
    assert np.array_equal(got, np.argmax(full, axis=1))
    # And against float64: fp32 dot products of 256 terms differ by < 1e-4 here, so any row whose
    # top-2 float64 gap exceeds 1e-3 must pick the float64 argmax.
    exact = x.astype(np.float64) @ head.T.astype(np.float64)
    top2 = -np.sort(-exact, axis=1)[:, :2]
    clear = top2[:, 0] - top2[:, 1] > 1e-3
    assert np.array_equal(got[clear], np.argmax(exact, axis=1)[clear])


def test_ties_go_to_the_lower_index_across_and_within_ranks():
    rng = np.random.default_rng()
    dim = 64
    x = _bf16(rng.normal(0, 1, (3, dim)))
    head = _bf16(rng.normal(0, 0.01, (16, dim)))
    head[13] = head[6] = head[5] = _bf16(x[0] * 0.5)  # the best row for token 0, three times
    got = head_ref.greedy_tokens(x[:1], np.split(head, 4))  # 5 and 6 in rank 1, 13 in rank 3
    assert got[0] == 5
    vals = np.array([[1.0, 2.0], [1.0, 2.0]], np.float32)
    idx = np.array([[7, 3], [9, 1]], np.int64)
    assert head_ref.pick_across_ranks(vals, idx).tolist() == [7, 1]
    with pytest.raises(ValueError, match="per-rank pairs"):
        head_ref.pick_across_ranks(vals, idx[:1])


def test_hash_ids_match_a_python_int_loop_with_padding():
    cfg = ModelConfig.preset("tiny")
    rng = np.random.default_rng()
    orders, heads = cfg.engram_max_ngram_size - 1, cfg.engram_n_heads
    for layer in cfg.engram_layer_ids:
        mult = np.array(cfg.engram_hash_multipliers(layer), np.int64)
        primes = np.array(cfg.engram_primes_flat(layer), np.int64).reshape(orders, heads)
        positions = np.array([0, 1, 2, 3, 4, 57])
        raw = rng.integers(0, cfg.engram_compressed_vocab_size, (6, orders + 1))
        hist = engram_ref.ngram_history(raw, positions, orders + 1, cfg.engram_pad_token_id)
        ids = engram_ref.hash_ids(hist, mult, primes)
        offsets = cfg.engram_offsets(layer)
        for r, p in enumerate(positions):
            toks = [int(raw[r, k]) if p - k >= 0 else cfg.engram_pad_token_id
                    for k in range(orders + 1)]
            for o in range(orders):
                mix = 0
                for k in range(o + 2):
                    mix ^= toks[k] * int(mult[k])
                for h in range(heads):
                    col = o * heads + h
                    assert ids[r, col] == mix % int(primes[o, h]) + offsets[col]
        assert ids.max() < cfg.engram_num_embeddings_of(layer)


def test_lookup_dequantizes_fp8_rows_with_ue8m0_scales():
    rng = np.random.default_rng()
    rows, head_dim = 300, 64
    codes = rng.integers(0, 256, (rows, head_dim), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # E4M3FN NaN codes do not occur in a table
    scales = rng.integers(110, 140, (rows, head_dim // 32), dtype=np.uint8)
    ids = rng.integers(100, 100 + rows, (5, 6))
    got = engram_ref.lookup(ids, codes, scales, row_offset=100)
    for r in range(5):
        for c in range(6):
            row = ids[r, c] - 100
            vals = codes[row].view(ml_dtypes.float8_e4m3fn).astype(np.float64)
            want = vals * 2.0 ** (np.repeat(scales[row].astype(np.int64), 32) - 127)
            assert np.array_equal(got[r, c], want)
    assert np.array_equal(got, _bf16(got)), "FP8 x power of two is exact in BF16"
    for bad in (99, 100 + rows):  # one row below, one row past this rank's rows
        with pytest.raises(ValueError, match="out of this rank"):
            engram_ref.lookup(np.array([[bad]]), codes, scales, row_offset=100)


def test_gate_matches_float64_and_stays_in_zero_one():
    rng = np.random.default_rng()
    rows, n, dim = 7, 4, 256
    streams = _bf16(rng.normal(0, 1, (rows, n, dim)))
    kv = _bf16(rng.normal(0, 1, (rows, (n + 1) * dim)))
    qw = _bf16(rng.normal(1, 0.2, (n, dim)))
    kw = _bf16(rng.normal(1, 0.2, (n, dim)))
    got = engram_ref.gate_update(streams, kv, qw, kw, 1e-20)
    s64, kv64 = streams.astype(np.float64), kv.astype(np.float64)
    keys, value = kv64[:, :n * dim].reshape(rows, n, dim), kv64[:, n * dim:]
    norm = lambda v: v / np.sqrt((v ** 2).mean(-1, keepdims=True) + 1e-20)
    d = (norm(s64) * qw * norm(keys) * kw).sum(-1) / np.sqrt(dim)
    g = 1 / (1 + np.exp(-np.sign(d) * np.sqrt(np.maximum(np.abs(d), 1e-6))))
    want = s64 + g[:, :, None] * value[:, None, :]
    # One BF16 rounding of the result (≤ 2^-8 relative) plus fp32 gate error (~1e-6 relative of v).
    assert (np.abs(got - want) <= 2.0 ** -8 * np.abs(want) + 1e-5 * np.abs(value)[:, None]).all()
    assert ((g > 0) & (g < 1)).all()
    with pytest.raises(ValueError, match="engram gate"):
        engram_ref.gate_update(streams, kv[:, :dim], qw, kw, 1e-20)
