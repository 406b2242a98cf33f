"""CPU checks of the compressor kernels' reference, partner rule, tolerances and specs.

Fresh random inputs every run. Exact: the kernel's ratio-2 partner rule (previous row of the same
sequence from this launch, the ring otherwise) gives bit for bit the pooled values and ring of a
one-row-at-a-time replay (both call the same float32 `pool_pairs`), for verify blocks starting at
even and odd positions, several sequences, padding rows. Tolerances: the projection bound
gamma_n sum |x||w| holds for a float32 model of the kernel's lane order (fma: exact products,
one rounding per addition); the record tolerances accept records of values perturbed by the fp32
pipeline's error and reject a wrong RoPE position or a wrong row.
"""
from __future__ import annotations

import compressor_cases as cases
import numpy as np
import pytest

from kernels import compressor_kernel_ref as ck
from kernels import compressor_ref, kvrecord_ref, rope_ref
from loader.config import ModelConfig

RNG = np.random.default_rng()
W = ck.RING_WIDTH


def random_batch(blocks, lines_total: int = 12, padding: int = 2):
    pos, seq = [], []
    for q, (start, n) in enumerate(blocks):
        pos += list(range(start, start + n))
        seq += [q] * n
    pos += [3] * padding
    seq += [-1] * padding
    lines = RNG.permutation(lines_total)[:len(blocks)].astype(np.int32)
    ring = cases.rings_before(RNG, blocks, lines, lines_total)
    kv_score = RNG.standard_normal((len(pos), W)).astype(np.float32)
    return np.array(pos, np.int32), np.array(seq, np.int32), lines, ring, kv_score


def sequential_replay(kv_score, ring, positions, seq_index, lines):
    """One row at a time: ring write, then (odd p) pool the ring's rows p-1 and p."""
    out = []
    for r in np.flatnonzero(seq_index >= 0):
        p, line = int(positions[r]), lines[seq_index[r]]
        ring[line, p % ck.RING_ROWS] = kv_score[r]
        if p % 2:
            pair = np.stack([ring[line, (p - 1) % ck.RING_ROWS], ring[line, p % ck.RING_ROWS]])
            out.append(compressor_ref.pool_pairs(pair[None, :, :512], pair[None, :, 512:])[0])
    return np.array(out, np.float32).reshape(-1, 512)


BLOCKS = [[(1000, 6)], [(1001, 6)], [(0, 6)], [(1, 1)], [(2, 1)],
          [(1001, 6), (1000, 6), (77, 1), (500, 5), (1, 1), (31, 6), (999, 5)]]


@pytest.mark.parametrize("blocks", BLOCKS)
def test_partner_rule_equals_sequential_replay(blocks):
    positions, seq_index, lines, ring, kv_score = random_batch(blocks)
    ring_seq = ring.copy()
    want = sequential_replay(kv_score, ring_seq, positions, seq_index, lines)
    rows, got = ck.pooled_rows(kv_score, ring, positions, seq_index, lines, 2)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(ring.view(np.uint32), ring_seq.view(np.uint32))
    assert list(rows) == [r for r in range(positions.size)
                          if seq_index[r] >= 0 and positions[r] % 2]
    assert np.isfinite(got).all(), "a partner came from an empty ring row"


def test_ring_only_partner_would_be_wrong():
    """A block starting even needs this launch's rows: the ring holds the step before."""
    positions, seq_index, lines, ring, kv_score = random_batch([(1000, 6)])
    before = ring.copy()
    _, got = ck.pooled_rows(kv_score, ring, positions, seq_index, lines, 2)
    stale = before[lines[0], (positions[1:6:2] - 1) % ck.RING_ROWS]
    pair = np.stack([stale, kv_score[1:6:2]], axis=1)
    wrong = compressor_ref.pool_pairs(pair[:, :, :512], pair[:, :, 512:])
    assert not np.allclose(wrong, got)


def test_ratio1_every_real_row_pools_itself():
    positions, seq_index, lines, ring, kv_score = random_batch([(10, 3), (7, 1)])
    kv = kv_score[:, :512].copy()
    rows, got = ck.pooled_rows(kv, ring.copy(), positions, seq_index, lines, 1)
    np.testing.assert_array_equal(rows, [0, 1, 2, 3])
    np.testing.assert_array_equal(got, kv[:4])


def _publish_inputs(ratio):
    table = rope_ref.RopeTable.for_ratio(ModelConfig.preset("v41-flash"), ratio, 4096)
    norm_w = (RNG.random(512) * 2).astype(np.float32)
    wk = (RNG.standard_normal((128, 512)) / 22.6).astype(np.float32)
    k_norm = (RNG.random(128) * 2).astype(np.float32)
    return table, norm_w, wk, k_norm


@pytest.mark.parametrize("ratio", [2, 1])
def test_publish_ref_writes_exactly_the_publishing_rows(ratio):
    table, norm_w, wk, k_norm = _publish_inputs(ratio)
    positions, seq_index, lines, ring, kv_score = random_batch([(1000, 6), (1001, 5), (64, 1)])
    kv_score = kv_score[:, :512 * ratio]
    tables = RNG.permutation(64)[:3 * 16].reshape(3, 16).astype(np.int32)
    tables[2, (64 // ratio) // 64] = -1                 # sequence 2's entry page: unallocated
    state = ck.PublishState(ring, np.full((64 * 64, 584), 0xFF, np.uint8),
                            np.full((64 * 64, 132), 0xFF, np.uint8))
    slots, entries, keys = ck.publish_ref(state, kv_score, positions, seq_index, lines, tables,
                                          64, norm_w, wk, k_norm, 1e-20, table, ratio)
    real = seq_index >= 0
    assert slots.size == int(np.sum(real & (positions % ratio == ratio - 1)))
    ok = slots >= 0
    assert ok.sum() == slots.size - (1 if ratio == 1 else 0)
    untouched = np.ones(64 * 64, bool)
    untouched[slots[ok]] = False
    assert (state.cache[untouched] == 0xFF).all() and (state.keys[untouched] == 0xFF).all()
    np.testing.assert_array_equal(kvrecord_ref.decode_kv_record(state.cache[slots[ok]]),
                                  kvrecord_ref.quantize_kv(entries[ok]))
    np.testing.assert_array_equal(kvrecord_ref.decode_index_key(state.keys[slots[ok]]),
                                  kvrecord_ref.quantize_index_key(keys[ok]))


def test_entries_past_the_block_table_write_nothing():
    tables = np.arange(6, dtype=np.int32).reshape(2, 3)
    slots = ck.entry_slots(np.array([191, 192, 5]), np.array([0, 0, 1]), np.arange(3), tables,
                           64, 1)
    np.testing.assert_array_equal(slots, [2 * 64 + 63, -1, 3 * 64 + 5])


def test_projection_tolerance_holds_for_the_lane_order():
    d, n, rows = 5120, 24, 3
    x = (RNG.standard_normal((rows, d)).astype(np.float32).view(np.uint32)
         & 0xFFFF0000).view(np.float32)
    w = (RNG.standard_normal((n, d)) * 0.02).astype(np.float32)
    got = np.zeros((rows, n), np.float32)
    lanes = np.zeros((rows, n, 32), np.float32)
    xc = x.reshape(rows, d // 128, 32, 4).astype(np.float64)
    wc = w.reshape(n, d // 128, 32, 4).astype(np.float64)
    for c in range(d // 128):                      # lane l: chunks l, l + 32, ... with fma
        for k in range(4):
            prod = xc[:, None, c, :, k] * wc[None, :, c, :, k]       # exact in float64
            lanes = (lanes.astype(np.float64) + prod).astype(np.float32)
    for k in range(5):                             # xor butterfly
        lanes = (lanes + lanes[..., np.arange(32) ^ (16 >> k)]).astype(np.float32)
    got = lanes[..., 0]
    want = x.astype(np.float64) @ w.astype(np.float64).T
    tol = ck.proj_tolerance(x, w)
    assert (np.abs(got - want) <= tol).all()
    assert not (np.abs(got[:, ::-1] - want) <= tol).all(), "a wrong column must fail"


@pytest.mark.parametrize("ratio", [2, 1])
def test_record_tolerances_accept_fp32_noise_and_reject_wrong_values(ratio):
    table, norm_w, wk, k_norm = _publish_inputs(ratio)
    pooled = (RNG.standard_normal((16, 512)) * np.exp2(RNG.integers(-8, 8, (16, 1)))).astype(
        np.float32)
    pos = RNG.integers(0, 4096, 16)
    entries, keys = ck.publish_values(pooled, pos, norm_w, wk, k_norm, 1e-20, table, ratio)
    noisy = entries * (1 + RNG.uniform(-2.0 ** -18, 2.0 ** -18, entries.shape)).astype(np.float32)
    got = kvrecord_ref.quantize_kv(noisy.astype(np.float32))
    assert (np.abs(got - entries) <= ck.entry_tolerance(entries)).all()
    knoisy = (keys * (1 + RNG.uniform(-2.0 ** -16, 2.0 ** -16, keys.shape))).astype(np.float32)
    assert (np.abs(kvrecord_ref.quantize_index_key(knoisy) - keys)
            <= ck.key_tolerance(keys)).all()
    shifted, kshift = ck.publish_values(pooled, (pos + 1) % 4096, norm_w, wk, k_norm, 1e-20,
                                        table, ratio)
    assert not (np.abs(kvrecord_ref.quantize_kv(shifted) - entries)
                <= ck.entry_tolerance(entries)).all(), "a wrong RoPE position must fail"
    assert not (np.abs(kvrecord_ref.quantize_index_key(kshift) - keys)
                <= ck.key_tolerance(keys)).all()
    assert not (np.abs(kvrecord_ref.quantize_kv(entries[::-1]) - entries)
                <= ck.entry_tolerance(entries)).all(), "a wrong row must fail"


def test_specs_grids_and_bytes():
    from kernels import compressor
    names = [s.name for s in compressor.specs(ModelConfig.preset("v41-flash"), 4)]
    assert names == ["compressor_proj_r1_k5120", "compressor_publish_r1_d512",
                     "compressor_proj_r2_k5120", "compressor_publish_r2_d512",
                     "compressor_proj_r1_k5120_bulk", "compressor_proj_r1_k5120_bulkr",
                     "compressor_publish_r1_d512_staged",
                     "compressor_proj_r2_k5120_bulk", "compressor_proj_r2_k5120_bulkr",
                     "compressor_proj_r2_k5120_bulk16", "compressor_publish_r2_d512_staged"]
    tiny = [s.name for s in compressor.specs(ModelConfig.preset("tiny"), 4)]
    assert "compressor_proj_r2_k256" in tiny and "compressor_publish_r1_d512" in tiny
    proj = ck.make_proj_spec(2, 5120)
    assert proj.grid(6) == (256, 1, 1) and proj.grid(48) == (256, 6, 1)
    assert proj.bytes_moved(6) == 1024 * 5120 * 4 + 6 * 5120 * 2 + 6 * 1024 * 4
    assert ck.make_proj_spec(1, 5120).bytes_moved(1) == 512 * 5120 * 2 + 5120 * 2 + 512 * 4
    pub = ck.make_publish_spec(2)
    assert pub.grid(7) == (7, 1, 1) and pub.smem_bytes == ck.PUBLISH_SMEM


@pytest.mark.parametrize("bad", [(3, 5120), (2, 5000), (0, 256)])
def test_bad_projection_specs_are_refused(bad):
    with pytest.raises(ValueError, match="compressor projection"):
        ck.make_proj_spec(*bad)


def test_bad_rows_are_refused():
    with pytest.raises(ValueError):
        ck.make_publish_spec(2).grid(0)
    with pytest.raises(ValueError, match="at most"):
        ck.make_proj_spec(2, 5120).grid(ck.MAX_ROWS + 1)
    with pytest.raises(ValueError, match="ratio 3"):
        ck.make_publish_spec(3)


def test_round9_specs_grids_and_layouts():
    """Bulk projection: one CTA per 4 columns at every R (it loops over the row tiles), the ring
    fits two CTAs an SM (r = 2) and one (r = 1) beside nothing else; staged publish: at most
    PUBLISH_STAGED_CTAS CTAs, wk after the session-1 shared memory and a 16-aligned mbarrier."""
    proj = ck.make_proj_spec(2, 5120, "bulk")
    assert proj.name == "compressor_proj_r2_k5120_bulk" and proj.block == (128, 1, 1)
    assert proj.grid(1) == proj.grid(192) == (256, 1, 1)
    assert proj.bytes_moved(6) == ck.make_proj_spec(2, 5120).bytes_moved(6)
    for ratio, per_sm in ((2, 2), (1, 1)):
        lay = ck.proj_bulk_layout(ratio, 5120)
        assert lay.stages == 10 and lay.threads == 128 and lay.slot_bytes % 128 == 0
        assert per_sm * ck.make_proj_spec(ratio, 5120, "bulk").smem_bytes <= 227 * 1024
        assert lay.bars_at % 8 == 0 and lay.smem_bytes == lay.bars_at + 8 * lay.slots
    tiny = ck.proj_bulk_layout(2, 256)
    assert (tiny.threads, tiny.stages, tiny.warps) == (64, 1, 2)
    wide = ck.make_proj_spec(2, 5120, "bulk16")
    assert wide.grid(48) == (256, 1, 1) and 2 * wide.smem_bytes <= 227 * 1024
    assert ck.proj_bulk_layout(2, 5120, 16).x_bytes == 16 * 512 * 2
    with pytest.raises(ValueError, match="ratio 2 only"):
        ck.make_proj_spec(1, 5120, "bulk16")
    pub = ck.make_publish_spec(2, "staged")
    assert pub.grid(7) == (7, 1, 1) and pub.grid(192) == (ck.PUBLISH_STAGED_CTAS, 1, 1)
    assert ck.PUBLISH_STAGED_WK_AT >= ck.PUBLISH_SMEM + 8 and ck.PUBLISH_STAGED_WK_AT % 16 == 0
    assert pub.smem_bytes == ck.PUBLISH_STAGED_WK_AT + ck.INDEX_DIM * ck.HEAD_DIM * 2
    assert pub.to_dict()["variant"] == "staged" and "variant" not in ck.make_publish_spec(
        2).to_dict()
    with pytest.raises(ValueError, match="variant"):
        ck.make_proj_spec(2, 5120, "staged")
    with pytest.raises(ValueError, match="multiple of 512"):
        ck.make_proj_spec(2, 640, "bulk")


def test_projection_tolerance_holds_for_the_bulk_order():
    """The bulk kernel's order: thread t adds dims 512 s + 4t .. + 3 of every stage s in order
    (fma), a warp butterfly, then the 4 warp partials in warp order: n = D/128 + 5 + 3 roundings,
    inside proj_tolerance's n = D/32 + 6."""
    d, n, rows = 5120, 24, 3
    x = (RNG.standard_normal((rows, d)).astype(np.float32).view(np.uint32)
         & 0xFFFF0000).view(np.float32)
    w = (RNG.standard_normal((n, d)) * 0.02).astype(np.float32)
    xc = x.reshape(rows, d // 512, 4, 32, 4).astype(np.float64)     # [stage, warp, lane, k]
    wc = w.reshape(n, d // 512, 4, 32, 4).astype(np.float64)
    th = np.zeros((rows, n, 4, 32), np.float32)
    for s in range(d // 512):
        for k in range(4):
            prod = xc[:, None, s, :, :, k] * wc[None, :, s, :, :, k]
            th = (th.astype(np.float64) + prod).astype(np.float32)
    for k in range(5):
        th = (th + th[..., np.arange(32) ^ (16 >> k)]).astype(np.float32)
    got = th[..., 0, 0]
    for wi in range(1, 4):
        got = (got + th[..., wi, 0]).astype(np.float32)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    tol = ck.proj_tolerance(x, w)
    assert (np.abs(got - want) <= tol).all()
    assert not (np.abs(got[:, ::-1] - want) <= tol).all(), "a wrong column must fail"
