"""KV records (584 B / 132 B), the reference caches, row metadata, the compressor-ring rollback."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from executor.reference.kvcache import KVCaches
from executor.reference.rows import RowBatch, RowBlock
from kernels import kvrecord_ref as rec
from loader.config import ModelConfig

TINY = ModelConfig.preset("tiny")


def _wide_range(rng, shape):
    """Normal values with a per-64-group magnitude spread of 2^-12..2^12, plus exact zeros."""
    groups = (shape[0], shape[1] // 64, 64)
    x = rng.standard_normal(groups) * np.exp2(rng.integers(-12, 13, (shape[0], shape[1] // 64, 1)))
    x = x.reshape(shape).astype(np.float32)
    x[0, :64] = 0.0
    return x


def test_kv_record_layout_and_round_trip():
    rng = np.random.default_rng()
    x = _wide_range(rng, (33, 512))
    r = rec.encode_kv_record(x)
    assert r.shape == (33, 584) and r.dtype == np.uint8
    assert (r[:, 583] == 0).all()
    # rope dims: the BF16 bits of x, little endian, at bytes 448..575
    bits = x[:, 448:].astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(r[:, 448:576].view("<u2"), bits)
    # scales: 2^ceil(log2(amax/448)), amax floored at 1e-4 -> the smallest power of two that fits
    amax = np.maximum(np.abs(x[:, :448]).reshape(33, 7, 64).max(axis=2), 1e-4)
    k = r[:, 576:583].astype(np.int64) - 127
    assert (amax / np.exp2(k) <= 448).all() and (amax / np.exp2(k - 1) > 448).all()
    # nope dims: FP8 of x / scale, round to nearest even: relative error <= 2^-4 for FP8 normals,
    # absolute <= 2^-10 * scale in the FP8 subnormal range (|x / s| < 2^-6).
    y = rec.decode_kv_record(r)
    s = np.repeat(np.exp2(k), 64, axis=1)
    err = np.abs(y[:, :448] - x[:, :448])
    assert (err <= np.maximum(2.0**-4 * np.abs(x[:, :448]), 2.0**-10 * s)).all()
    rope = x[:, 448:].astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(y[:, 448:], rope)
    np.testing.assert_array_equal(y[0, :64], 0.0)
    # decode(encode(y)) == y: the record is a fixed point once quantized
    np.testing.assert_array_equal(rec.quantize_kv(y), y)


def test_index_key_layout_and_round_trip():
    rng = np.random.default_rng()
    x = rng.standard_normal((20, 128)) * np.exp2(rng.integers(-10, 10, (20, 1)))
    x = x.astype(np.float32)
    r = rec.encode_index_key(x)
    assert r.shape == (20, 132)
    scale = r[:, 128:].copy().view("<f4")[:, 0]
    np.testing.assert_array_equal(np.log2(scale), np.round(np.log2(scale)))  # powers of two
    y = rec.decode_index_key(r)
    err = np.abs(y - x)
    assert (err <= np.maximum(2.0**-4 * np.abs(x), 2.0**-10 * scale[:, None])).all()
    np.testing.assert_array_equal(rec.quantize_index_key(y), y)


def test_records_reject_bad_input():
    with pytest.raises(ValueError, match=r"kv entries: expected a float32 array \[N, 512\]"):
        rec.encode_kv_record(np.zeros((2, 511), np.float32))
    with pytest.raises(ValueError, match="non-finite"):
        rec.encode_kv_record(np.full((1, 512), np.inf, np.float32))
    with pytest.raises(ValueError, match="kv records"):
        rec.decode_kv_record(np.zeros((2, 584), np.int8))
    with pytest.raises(ValueError, match="index key records"):
        rec.decode_index_key(np.zeros((2, 131), np.uint8))


def test_poisoned_memory_decodes_to_nan():
    caches = KVCaches.allocate(TINY, max_seqs=2, max_context=64, page_size=8)
    assert np.isnan(caches.load_kv(caches.swa[0], np.array([0, 5]))).all()
    assert np.isnan(caches.load_keys(6, np.array([3]))).all()


def test_allocation_shapes_and_paging():
    caches = KVCaches.allocate(TINY, max_seqs=3, max_context=50, page_size=8, seed=1)
    assert caches.ring_slots == 32 and caches.ring_rows == 8  # pow2 >= 16 + 6, pow2 >= 6 + 2
    assert set(caches.swa) == set(range(13)) and set(caches.compressed) == {2, 4, 6}
    assert set(caches.ring) == {2, 4}
    assert caches.swa[10].shape == (3 * 32, 584) and caches.index_keys[6].shape == (3 * 7 * 8, 132)
    pages = caches.block_tables
    assert pages.shape == (3, 7) and sorted(pages.ravel()) == list(range(21))
    rows = caches.entry_rows(pages[1], np.arange(50))
    np.testing.assert_array_equal(rows, pages[1][np.arange(50) // 8] * 8 + np.arange(50) % 8)
    with pytest.raises(ValueError, match="beyond the block table"):
        caches.entry_rows(pages[1], np.array([56]))


def test_row_batch_from_blocks_and_validation():
    caches = KVCaches.allocate(TINY, max_seqs=4, max_context=64, page_size=8)
    blocks = [RowBlock(2, 10, (5, 6, 7, 8, 9, 10), "verify"), RowBlock(0, 3, (1,)),
              RowBlock(3, 20, (4, 4, 4, 4, 4), "draft")]
    rb = RowBatch.from_blocks(blocks, caches.block_tables, caches.ring_slots, pad_to=16)
    assert rb.num_rows == 16 and rb.num_seqs == 3 and rb.real.sum() == 12
    np.testing.assert_array_equal(rb.context_lens, [16, 4, 25])
    np.testing.assert_array_equal(rb.slot_mapping[:6], 2 * 32 + np.arange(10, 16))
    assert (rb.slot_mapping[12:] == -1).all() and (rb.seq_index[12:] == -1).all()
    with pytest.raises(ValueError, match="not one contiguous block"):
        RowBatch(**{**rb.__dict__, "positions": rb.positions[[1, 0] + list(range(2, 16))]})
    with pytest.raises(ValueError, match=r"context_lens\[1\]"):
        RowBatch(**{**rb.__dict__, "context_lens": np.array([16, 5, 25], np.int64)})
    with pytest.raises(ValueError, match="mix padding"):
        seq = np.where(rb.real, rb.seq_index, 0).astype(np.int32)
        RowBatch(**{**rb.__dict__, "seq_index": seq})
    with pytest.raises(ValueError, match="positions: expected int64"):
        RowBatch(**{**rb.__dict__, "positions": rb.positions.astype(np.int32)})


def test_rollback_forgets_only_rejected_positions():
    caches = KVCaches.allocate(TINY, max_seqs=2, max_context=64, page_size=8)
    rng = np.random.default_rng()
    for layer in (2, 4):
        caches.ring[layer][1] = rng.standard_normal((8, 1024)).astype(np.float32)
        positions = np.arange(10, 18)
        caches.ring_pos[layer][1][positions % 8] = positions
    before = {k: v.copy() for k, v in caches.ring.items()}
    caches.rollback_compressor_rings(1, accepted_len=13)
    for layer in (2, 4):
        pos = caches.ring_pos[layer][1]
        kept = pos >= 0
        assert sorted(pos[kept]) == [10, 11, 12]
        np.testing.assert_array_equal(caches.ring[layer][1][kept], before[layer][1][kept])
        assert np.isnan(caches.ring[layer][1][~kept]).all()
        assert np.isnan(caches.ring[layer][0]).all()  # the other line is untouched (still poison)
    with pytest.raises(ValueError, match="state line 2"):
        caches.rollback_compressor_rings(2, 5)
