"""CPU tests of the embedding and Engram kernel specs and references (kernels/embed_ref.py,
kernels/engram_kernel_ref.py): ABI and geometry, the references against the model reference
(`executor.reference.step.embed`, `kernels.engram_ref`), the hash against a Python-int loop, the
lookup's bit-level FP8 -> BF16 conversion trick, and the gate's error bound (it holds for the
model reference and fails for a gate off by 2e-2)."""
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from executor.reference import step
from kernels import embed_ref as er
from kernels import engram_kernel_ref as ek
from kernels import engram_ref
from kernels.common_ref import BF16, to_bf16
from loader.config import ModelConfig

RNG = np.random.default_rng()
CONFIGS = ("tiny", "v41-flash")


# ---- specs and ABI -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_specs_geometry_and_abi(name, tp):
    cfg = ModelConfig.preset(name)
    embeds = er.embed_specs(cfg, tp)
    assert [s.table_rows for s in embeds] == sorted({cfg.vocab_size // tp, cfg.vocab_size})
    engram = ek.engram_specs(cfg, tp)
    names = [s.name for s in embeds + engram]
    assert len(names) == len(set(names))
    hashes = [s for s in engram if isinstance(s, ek.EngramHashSpec)]
    assert [h.layer for h in hashes] == list(cfg.engram_layer_ids)
    for h in hashes:
        assert h.cols == cfg.engram_num_hash_cols == 24
        assert h.offsets[-1] + h.primes[-1] == cfg.engram_num_embeddings_of(h.layer)
        assert all(m % 2 == 1 for m in h.multipliers) and h.pad_id == cfg.engram_pad_token_id
        assert h.grid(192) == (3, 1, 1) and h.params == ek.HASH_PARAMS
    (lookup,) = [s for s in engram if isinstance(s, ek.EngramLookupSpec)]
    assert (lookup.cols, lookup.total_cols) == (24 // tp, 24)
    assert lookup.threads_per_head * ek.CODES_PER_THREAD == cfg.engram_head_dim
    (gate,) = [s for s in engram if isinstance(s, ek.EngramGateSpec)]
    assert gate.threads_per_row * gate.vecs_per_thread * 8 == cfg.hidden_size
    assert gate.grid(5) == (5, 1, 1) and gate.grid(1000) == (gate.max_ctas, 1, 1)
    for spec in embeds + engram:
        d = spec.to_dict()
        assert d["name"] == spec.name and d["block"] == list(spec.block)
        assert all(kind in ("u64", "u32", "f32") for _, kind in spec.params)


def test_byte_formulas():
    # Real widths: R = 6 rows, 6 heads of 256 FP8 codes per rank, D = 5120.
    assert er.embed_bytes(6, 5120) == 6 * 4 + 2 * 6 * 5120 * 2
    assert ek.lookup_bytes(6, 6, 256) == 36 * (8 + 256 + 8 + 512)
    assert ek.gate_bytes(6, 4, 5120) == 6 * 5120 * 2 * 13 + 4 * 4 * 5120


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="multiple of 32"):
        ek.make_lookup_spec(48, 6, 24)
    with pytest.raises(TypeError, match="int32"):
        er.embed_ref(np.zeros(3, np.int64), np.zeros((4, 8), BF16), 0)
    spec = er.make_spec(8, 4)
    with pytest.raises(ValueError, match="vocab_offset"):
        er.launch_check(spec, 3, -1)
    codes = np.zeros((4, 32), np.uint8)
    with pytest.raises(ValueError, match="byte 135"):
        ek.check_lookup_table(codes, np.full((4, 1), 135, np.uint8), 32)


# ---- embedding -----------------------------------------------------------------------------------

@pytest.mark.parametrize("tp", [1, 2, 4])
def test_embed_partials_sum_to_the_reference_embedding(tp):
    vocab, dim, rows = 64, 32, 11
    full = to_bf16(RNG.standard_normal((vocab, dim)))
    shards = np.split(full, tp)
    ids = RNG.integers(0, vocab, rows).astype(np.int32)
    ranks = [SimpleNamespace(vocab_offset=r * vocab // tp, embed=s) for r, s in enumerate(shards)]
    model = SimpleNamespace(cfg=SimpleNamespace(vocab_size=vocab, hidden_size=dim), ranks=ranks)
    want = step.embed(model, ids.astype(np.int64))
    partials = [er.embed_ref(ids, r.embed, r.vocab_offset) for r in ranks]
    # Exactly one rank owns each id: the other partials are exact zeros and AR-0 is exact.
    nonzero_ranks = sum((np.abs(p.astype(np.float32)).sum(axis=1) > 0) for p in partials)
    assert np.array_equal(nonzero_ranks, np.ones(rows))
    total = np.sum([p.astype(np.float32) for p in partials], axis=0)
    assert np.array_equal(to_bf16(total).view(np.uint16), to_bf16(want).view(np.uint16))
    # The replicated table at offset 0 is the embedding itself.
    assert np.array_equal(er.embed_ref(ids, full, 0).view(np.uint16), full[ids].view(np.uint16))


# ---- hash ids ------------------------------------------------------------------------------------

def _python_hash(spec: ek.EngramHashSpec, tokens, positions, vocab_map) -> np.ndarray:
    """The model doc's formula with unbounded Python ints: no int64 anywhere. The raw pad id
    (p - k < 0, or a token off the map) goes in before the map, as DeepSeek's pad_id =
    lookup_table[pad_id]."""
    orders = spec.max_ngram - 1
    out = np.empty((len(positions), spec.cols), np.int64)
    for r, p in enumerate(positions):
        raw = [int(tokens[r][k]) if p - k >= 0 and 0 <= tokens[r][k] < spec.vocab_size
               else spec.pad_id for k in range(spec.max_ngram)]
        hist = [int(vocab_map[t]) for t in raw]
        for order in range(orders):
            mix = 0
            for k in range(order + 2):
                mix ^= hist[k] * spec.multipliers[k]
            for h in range(spec.heads):
                c = order * spec.heads + h
                out[r, c] = mix % spec.primes[c] + spec.offsets[c]
    return out


def _random_map(cfg) -> np.ndarray:
    """Surjective onto [0, compressed), not the identity."""
    return (RNG.permutation(cfg.vocab_size) % cfg.engram_compressed_vocab_size).astype(np.int32)


@pytest.mark.parametrize("name", CONFIGS)
def test_hash_ids_equal_a_python_int_loop(name):
    cfg = ModelConfig.preset(name)
    for layer in cfg.engram_layer_ids:
        spec = ek.make_hash_spec(cfg, layer)
        assert spec.mapped and spec.vocab_size == cfg.vocab_size
        rows = 40
        tokens = RNG.integers(0, cfg.vocab_size, (rows, spec.max_ngram)).astype(np.int32)
        vocab_map = _random_map(cfg)
        vocab_map[tokens[0]] = cfg.engram_compressed_vocab_size - 1    # the largest product
        positions = RNG.integers(0, 10_000, rows).astype(np.int32)
        positions[1:5] = [0, 1, 2, 3]                              # pad for k > p
        tokens[6, :3] = (-1, cfg.vocab_size, np.iinfo(np.int32).min)   # off the map: pad
        got = ek.hash_ref(spec, tokens, positions, vocab_map)
        assert np.array_equal(got, _python_hash(spec, tokens, positions, vocab_map))
        assert got.min() >= 0 and got.max() < cfg.engram_num_embeddings_of(layer)
        # the map matters: the same tokens through the identity hash differently
        identity = np.arange(cfg.vocab_size, dtype=np.int32)
        assert not np.array_equal(got, ek.hash_ref(spec, tokens, positions, identity))


def test_hash_ids_follow_the_reference_steps_history():
    """The kernel's reference (raw tokens + map) equals executor.reference.step's history:
    ngram_lookback, raw pad before position 0, then the map."""
    from executor.reference.rows import RowBatch, RowBlock
    cfg = ModelConfig.preset("v41-flash")
    layer = cfg.engram_layer_ids[0]
    spec = ek.make_hash_spec(cfg, layer)
    vocab_map = _random_map(cfg)
    seq = RNG.integers(0, cfg.vocab_size, 9)
    rows = RowBatch.from_blocks([RowBlock(0, 3, tuple(int(t) for t in seq[3:]), "verify")],
                                np.zeros((1, 4), np.int32), 128)
    model = SimpleNamespace(cfg=cfg, vocab_map=vocab_map)
    history = step.engram_history(model, rows, [seq[:3]])
    raw = step.ngram_lookback(rows, [seq[:3]], spec.max_ngram).astype(np.int32)
    positions = rows.positions.astype(np.int32)
    primes = np.array(cfg.engram_primes_flat(layer)).reshape(spec.max_ngram - 1, -1)
    want = engram_ref.hash_ids(history, np.array(cfg.engram_hash_multipliers(layer)), primes)
    assert np.array_equal(ek.hash_ref(spec, raw, positions, vocab_map), want)


def test_unmapped_hash_spec_reads_raw_ids():
    """HASH_READS_MAP = False (the revert switch): raw ids hashed, whatever the map holds."""
    cfg = ModelConfig.preset("tiny")
    spec = ek.make_hash_spec(cfg, cfg.engram_layer_ids[0], mapped=False)
    assert not spec.name.endswith("_map")
    tokens = RNG.integers(0, cfg.vocab_size, (7, spec.max_ngram)).astype(np.int32)
    positions = np.arange(7, dtype=np.int32)
    identity = np.arange(cfg.vocab_size, dtype=np.int32)
    got = ek.hash_ref(spec, tokens, positions, _random_map(cfg))
    assert np.array_equal(got, _python_hash(spec, tokens, positions, identity))


# ---- lookup --------------------------------------------------------------------------------------

def _kernel_conversion(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The lookup kernel's arithmetic in NumPy: E4M3 byte -> bf16 bits s.0000eeee.mmm0000, times
    the bf16 2^(s-7), one bf16 rounding of the exact product (as mul.rn.bf16x2)."""
    c = codes.astype(np.uint16)
    bits = ((c & 0x7F) << 4) | ((c & 0x80) << 8)
    placed = bits.view(BF16).astype(np.float32)
    scale = ((scales.astype(np.uint32) + 120) << 23).view(np.float32)     # bf16 bits << 16
    return to_bf16(placed * np.repeat(scale, 32, axis=-1))   # product of two bf16: exact in fp32


def test_fp8_conversion_trick_is_bitwise_the_reference():
    finite = np.array([b for b in range(256) if b & 0x7F != 0x7F], np.uint8)   # no E4M3 NaN
    codes = np.tile(finite, (ek.MAX_SCALE_BYTE + 1, 1))[:, :224]
    scales = np.repeat(np.arange(ek.MAX_SCALE_BYTE + 1, dtype=np.uint8)[:, None], 7, axis=1)
    want = to_bf16(engram_ref.lookup(np.arange(codes.shape[0])[:, None], codes, scales)[:, 0])
    got = _kernel_conversion(codes, scales)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    # ... and the reference's fp32 product is exact in BF16 from s = 3 (the smallest E4M3
    # subnormal 2^-9 times 2^(3-127) is BF16's smallest subnormal); below, both round alike.
    exact = engram_ref.lookup(np.arange(codes.shape[0])[:, None], codes, scales)[:, 0]
    assert np.array_equal(want.astype(np.float32)[3:], exact[3:])
    assert not np.array_equal(want.astype(np.float32)[:3], exact[:3])


def test_lookup_ref_reads_this_ranks_columns_and_poisons_off_table_ids():
    head_dim, cols, total, rows = 64, 6, 24, 7
    spec = ek.make_lookup_spec(head_dim, cols, total)
    table_rows, row_offset, first_col = 50, 1000, 12
    codes = RNG.integers(0, 256, (table_rows, head_dim)).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x11
    scales = RNG.integers(100, 135, (table_rows, head_dim // 32)).astype(np.uint8)
    ids = RNG.integers(row_offset, row_offset + table_rows, (rows, total))
    ids[2, first_col + 1] = row_offset - 1
    ids[4, first_col + 5] = row_offset + table_rows
    got = ek.lookup_ref(spec, ids, codes, scales, first_col, row_offset)
    assert got.shape == (rows, cols, head_dim) and got.dtype == BF16
    bad = np.zeros((rows, cols), bool)
    bad[2, 1] = bad[4, 5] = True
    assert np.isnan(got.astype(np.float32)[bad]).all()
    mine = ids[:, first_col:first_col + cols]
    for r, c in zip(*np.nonzero(~bad)):
        local = mine[r, c] - row_offset
        want = codes[local].view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.repeat(
            np.ldexp(np.float32(1), scales[local].astype(np.int32) - 127), 32)
        assert np.array_equal(got[r, c].astype(np.float32), want)


# ---- gate ----------------------------------------------------------------------------------------

def _gate_inputs(rows, n, dim):
    scale = RNG.uniform(0.1, 10)            # |v| ~ |X|: the gate shows in the output
    x = to_bf16(RNG.standard_normal((rows, n, dim)) * scale)
    kv = to_bf16(RNG.standard_normal((rows, (n + 1) * dim)) * scale)
    qw = to_bf16(RNG.uniform(0.5, 1.5, (n, dim)))
    kw = to_bf16(RNG.uniform(0.5, 1.5, (n, dim)))
    return x, kv, qw, kw


@pytest.mark.parametrize("dim", [256, 5120])
def test_gate_bound_holds_for_the_reference_and_catches_a_wrong_gate(dim):
    n, rows, eps = 4, 9, 1e-20
    x, kv, qw, kw = _gate_inputs(rows, n, dim)
    kv[0, :n * dim] = to_bf16(x[0].reshape(-1) * 3)     # keys ∝ streams: d large and positive
    kv[1, :dim] = to_bf16(-x[1, 0])                     # d < 0 for row 1 stream 0
    exact, bound = ek.gate_error_bound(x, kv, qw, kw, eps, ek.make_gate_spec(dim, n))
    got = ek.gate_ref(x, kv, qw, kw, eps).astype(np.float64)
    assert (np.abs(got - exact) <= bound).all()
    # The bound is no wider than ~1.5 bf16 ulps where v is small against X ...
    assert np.median(bound / ek.bf16_ulp(exact)) < 1.5
    # ... and a gate off by 2e-2 breaks it (|v| ~ |X|: the error is ~5 bf16 ulps of a typical
    # element; elements where |v| << |X + g·v| hide it).
    _, d, _, value = ek.gate_exact(x, kv, qw, kw, eps)
    g = 1 / (1 + np.exp(-np.sign(d) * np.sqrt(np.maximum(np.abs(d), 1e-6)))) + 2e-2
    wrong = to_bf16(x.astype(np.float64) + g[:, :, None] * value).astype(np.float64)
    assert (np.abs(wrong - exact) > bound).mean() > 0.5


def test_gate_of_zero_dot_is_one_half():
    n, dim = 4, 256
    x = np.zeros((1, n, dim), BF16)
    kv = to_bf16(RNG.standard_normal((1, (n + 1) * dim)))
    out = ek.gate_ref(x, kv, np.ones((n, dim), BF16), np.ones((n, dim), BF16), 1e-20)
    assert np.array_equal(out[0, 2].view(np.uint16), to_bf16(0.5 * kv[0, n * dim:].astype(
        np.float32)).view(np.uint16))


def _gate_in_kernel_order(x, kv, qw, kw, eps, spec: ek.EngramGateSpec) -> np.ndarray:
    """The gate kernel's fp32 arithmetic replayed in NumPy: per thread, vectors k·T + t in order
    (8 values each, product rounded then added: within the bound's fma allowance), butterfly over
    32 lanes, warp totals in order; then the scalar tail and X + g·v in fp32, rounded to BF16."""
    rows, n, dim = x.shape
    t, vecs, f32 = spec.threads_per_row, spec.vecs_per_thread, np.float32
    xs = x.astype(f32)
    keys = kv[:, :n * dim].reshape(rows, n, dim).astype(f32)
    value = kv[:, n * dim:].astype(f32)
    lay = (rows, n, vecs, t, 8)                              # element (k·T + t)·8 + j
    xq, kk = xs * qw.astype(f32), keys * kw.astype(f32)
    sums = []
    for a, b in ((xs, xs), (keys, keys), (xq, kk)):
        prod = (a * b).reshape(lay)
        acc = np.zeros((rows, n, t), f32)
        for k in range(vecs):
            for j in range(8):
                acc = acc + prod[:, :, k, :, j]
        lanes = min(t, 32)
        idx = np.arange(t)
        o = lanes // 2
        while o:
            acc = acc + acc[:, :, idx ^ o]
            o //= 2
        total = acc[:, :, 0]
        for w in range(1, spec.warps):
            total = total + acc[:, :, w * 32]
        sums.append(total)
    sxx, skk, sxk = sums
    rx = f32(1) / np.sqrt(sxx / f32(dim) + f32(eps))
    rk = f32(1) / np.sqrt(skk / f32(dim) + f32(eps))
    d = sxk * rx * rk / f32(np.sqrt(dim))
    root = np.sqrt(np.maximum(np.abs(d), f32(1e-6)))
    s = np.where(d > 0, root, np.where(d < 0, -root, f32(0)))
    g = f32(1) / (f32(1) + np.exp(-s))
    return to_bf16(xs + g[:, :, None] * value[:, None, :])


@pytest.mark.parametrize("dim", [256, 5120])
def test_gate_bound_holds_for_the_kernels_summation_order(dim):
    n, rows, eps = 4, 7, 1e-20
    spec = ek.make_gate_spec(dim, n)
    x, kv, qw, kw = _gate_inputs(rows, n, dim)
    kv[0, :n * dim] = to_bf16(x[0].reshape(-1) * 3)
    exact, bound = ek.gate_error_bound(x, kv, qw, kw, eps, spec)
    got = _gate_in_kernel_order(x, kv, qw, kw, eps, spec).astype(np.float64)
    assert (np.abs(got - exact) <= bound).all()
    # And it is the model reference bitwise except where their fp32 values straddle a BF16
    # rounding midpoint (the two sum in different orders).
    ref = ek.gate_ref(x, kv, qw, kw, eps).astype(np.float64)
    assert np.mean(got == ref) > 0.99
