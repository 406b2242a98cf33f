"""kernels/moe_kernel_ref: repack round trips, kernel-order decode, routing lists, specs and ABI,
the chain's exact reference against kernels/moe_ref, and the GPU test's tolerance."""
import numpy as np
import pytest

from kernels import moe_kernel_ref as mk
from kernels import moe_ref
from kernels.common_ref import BF16
from loader import formats as f
from loader.config import ModelConfig

TINY = mk.MoeShape(16, 6, 256, 96, 10.0)


def random_fused(rng, experts, n, k, spread=16):
    """MXFP4 weights whose scales span `spread` binades, through the fused-E8M0 step (so some
    groups are re-rounded when spread > 11)."""
    w = rng.normal(0, 1, (experts, n, k)) * np.exp2(rng.integers(0, spread, (experts, n, k // 32))
                                                    .repeat(32, axis=2) - spread + 2)
    packed, scales = f.mxfp4_quantize(w.astype(np.float32) * 0.01)
    return f.fused_e8m0(packed, scales)


def tiny_experts(rng, shape=TINY):
    w13 = random_fused(rng, shape.num_experts, 2 * shape.inter, shape.hidden)
    w2 = random_fused(rng, shape.num_experts, shape.hidden, shape.inter)
    return w13, w2


def uniform_routing(rng, rows, experts, topk):
    return np.stack([rng.choice(experts, topk, replace=False) for _ in range(rows)]).astype(np.int32)


def test_repack_round_trips_to_the_fused_e4m3_bytes_and_weights():
    rng = np.random.default_rng()
    w13, w2 = tiny_experts(rng)
    packed = mk.pack_experts(w13, w2, TINY)
    got13, got2 = mk.unpacked_e4m3(packed, TINY)
    want13, want2 = mk.reference_e4m3(w13, w2)
    np.testing.assert_array_equal(got13, want13)
    np.testing.assert_array_equal(got2, want2)
    shards = mk.expert_shards(packed, TINY)
    d13, d2 = f.fused_e8m0_dequantize(w13), f.fused_e8m0_dequantize(w2)
    for e in range(TINY.num_experts):
        np.testing.assert_array_equal(shards[e].w13, d13[e])
        np.testing.assert_array_equal(shards[e].w2, d2[e])


def test_repack_at_the_real_rank_shape_and_byte_counts():
    rng = np.random.default_rng()
    shape = mk.moe_shape(ModelConfig.preset("v41-flash"), 4)
    assert (shape.hidden, shape.inter, shape.num_experts) == (5120, 576, 384)
    assert shape.checkpoint_expert_bytes() == 3_133_440 + 1_566_720   # anchors.md's count
    assert sum(shape.w13_bytes) == 3_133_440
    assert sum(shape.w2_bytes) == 1_474_560 + 320 * 5 * 64            # tail group padded
    one = mk.MoeShape(1, 1, 5120, 576, 10.0)
    w13 = random_fused(rng, 1, 1152, 5120)
    w2 = random_fused(rng, 1, 5120, 576)
    packed = mk.pack_experts(w13, w2, one)
    assert packed.w13.codes.nbytes + packed.w13.offsets.nbytes == sum(shape.w13_bytes)
    assert packed.w2.codes.nbytes + packed.w2.offsets.nbytes == sum(shape.w2_bytes)
    got13, got2 = mk.unpacked_e4m3(packed, one)
    want13, want2 = mk.reference_e4m3(w13, w2)
    np.testing.assert_array_equal(got13, want13)
    np.testing.assert_array_equal(got2, want2)


def test_decode_table_is_humming_expansion_for_every_code_and_offset():
    # One expert, one tile: every (code, offset) pair through the kernel's prmt arithmetic.
    codes = np.tile(np.arange(16, dtype=np.uint8), (16, 4))          # [16, 64]
    for offset in range(1, 13):
        fused = f.FusedE8M0(f.mxfp4_pack(codes)[None], np.full((1, 16, 2), offset, np.uint8),
                            np.float32([1.0]), np.int32([127]))
        got = mk.decode_e4m3(mk.pack_sublayer(fused))[0]
        np.testing.assert_array_equal(got, f.fused_e8m0_e4m3_bytes(fused)[0])


def test_pack_rejects_bad_offsets_and_shapes():
    rng = np.random.default_rng()
    w13, w2 = tiny_experts(rng)
    bad = f.FusedE8M0(w13.packed, np.zeros_like(w13.offsets), w13.weight_scale_2, w13.lo)
    with pytest.raises(ValueError, match="offsets must be in"):
        mk.pack_sublayer(bad)
    with pytest.raises(ValueError, match="w13 packed"):
        mk.pack_experts(w2, w2, TINY)


@pytest.mark.parametrize("kind", ["uniform", "one_expert", "distinct"])
def test_routing_lists_cover_every_pair_once_in_order(kind):
    rng = np.random.default_rng()
    rows = {"uniform": 37, "one_expert": 29, "distinct": 2}[kind]
    if kind == "uniform":
        ids = uniform_routing(rng, rows, 16, 6)
    elif kind == "one_expert":
        ids = np.tile(rng.choice(16, 6, replace=False), (rows, 1)).astype(np.int32)
    else:
        ids = rng.permutation(16)[:12].reshape(2, 6).astype(np.int32)
    lists = mk.routing_lists(ids, 16)
    assert list(lists.experts) == sorted(set(ids.ravel().tolist()))
    assert sorted(lists.pairs.tolist()) == list(range(rows * 6))
    for e, off, cnt in zip(lists.experts, lists.offsets, lists.counts):
        pairs = lists.pairs[off:off + cnt]
        assert (ids.ravel()[pairs] == e).all()
        assert (np.diff(pairs // 6) > 0).all(), "rows ascend within an expert"
    meta = lists.meta(16)
    assert meta[0] == len(lists.experts) and meta.shape == (mk.meta_words(16),)


def test_routing_rejects_bad_ids():
    with pytest.raises(ValueError, match="repeats"):
        mk.routing_lists(np.array([[1, 1, 2, 3, 4, 5]]), 16)
    with pytest.raises(ValueError, match=r"\[0, 16\)"):
        mk.routing_lists(np.array([[16, 1, 2, 3, 4, 5]]), 16)


def test_fragment_order_is_the_mma_b_layout():
    order = mk.fragment_order(96)
    assert sorted(order.tolist()) == list(range(96))
    # lane t of k-step s reads bytes [8t, 8t+8): b0 = k 4t..4t+3, b1 = k 16+4t..16+4t+3
    assert order[:8].tolist() == [0, 1, 2, 3, 16, 17, 18, 19]
    assert order[32 + 24:32 + 32].tolist() == [32 + 12, 32 + 13, 32 + 14, 32 + 15,
                                               32 + 28, 32 + 29, 32 + 30, 32 + 31]
    rng = np.random.default_rng()
    a = moe_ref.round_bf16(rng.normal(0, 3, (5, 96)))
    q, s = mk.quantize_fragments(a, 128)
    want_q, want_s = f.quantize_act_fp8(a)
    inverse = np.empty(128, np.intp)
    inverse[mk.fragment_order(128)] = np.arange(128)
    np.testing.assert_array_equal(q[:, inverse][:, :96], want_q.view(np.uint8))
    assert (q[:, inverse][:, 96:] == 0).all()
    np.testing.assert_array_equal(s[:, :1], want_s)


def test_routed_reference_reads_the_packed_bytes_and_equals_moe_ref():
    rng = np.random.default_rng()
    w13, w2 = tiny_experts(rng)
    packed = mk.pack_experts(w13, w2, TINY)
    x = moe_ref.round_bf16(rng.normal(0, 1, (7, 256)))
    ids = uniform_routing(rng, 7, 16, 6)
    weights = rng.random((7, 6)).astype(np.float32)
    got = mk.routed_reference(x, ids, weights, packed, TINY)
    d13, d2 = f.fused_e8m0_dequantize(w13), f.fused_e8m0_dequantize(w2)
    shards = [moe_ref.ExpertShard(d13[e], d2[e]) for e in range(16)]
    want = moe_ref.routed_experts(x, moe_ref.RouterOutput(ids.astype(np.int64), weights), shards,
                                  10.0)
    np.testing.assert_array_equal(got, want)


def _reference_float64_partials(x, ids, weights, shards, limit):
    """moe_ref's chain with each group partial summed in float64 (another accumulation order)."""
    def linear(a, w):
        q, s = f.quantize_act_fp8(a)
        qf = np.zeros((a.shape[0], s.shape[1] * 128))
        qf[:, :a.shape[1]] = q.astype(np.float64)
        wf = np.zeros((w.shape[0], s.shape[1] * 128))
        wf[:, :w.shape[1]] = w
        y = np.zeros((a.shape[0], w.shape[0]), np.float32)
        for j in range(s.shape[1]):
            part = (qf[:, 128 * j:128 * (j + 1)] @ wf[:, 128 * j:128 * (j + 1)].T).astype(np.float32)
            y += s[:, j, None] * part
        return moe_ref.round_bf16(y)
    out = np.zeros((x.shape[0], 6, x.shape[1]), np.float32)
    for e in np.unique(ids):
        r, slot = np.nonzero(ids == e)
        h13 = linear(x[r], shards[e].w13)
        inter = shards[e].w2.shape[1]
        h = moe_ref.round_bf16(moe_ref.swiglu_clamped(h13[:, :inter], h13[:, inter:], limit))
        out[r, slot] = linear(h, shards[e].w2)
    y = np.zeros(x.shape, np.float32)
    for k in range(6):
        y += weights[:, k:k + 1] * out[:, k]
    return y


def test_gpu_tolerance_accepts_another_summation_order_and_rejects_a_wrong_expert():
    rng = np.random.default_rng()
    w13, w2 = tiny_experts(rng)
    d13, d2 = f.fused_e8m0_dequantize(w13), f.fused_e8m0_dequantize(w2)
    shards = [moe_ref.ExpertShard(d13[e], d2[e]) for e in range(16)]
    x = moe_ref.round_bf16(rng.normal(0, 1, (24, 256)))
    ids = uniform_routing(rng, 24, 16, 6)
    weights = rng.random((24, 6)).astype(np.float32)
    weights[5, 2] = 1.0     # the slot swapped below weighs fully (a tiny weight could hide it)
    routing = moe_ref.RouterOutput(ids.astype(np.int64), weights)
    want = moe_ref.routed_experts(x, routing, shards, 10.0)
    mk.check_routed_close(_reference_float64_partials(x, ids, weights, shards, 10.0), want)
    wrong = ids.copy()
    wrong[5, 2] = next(e for e in range(16) if e not in ids[5])
    broken = moe_ref.routed_experts(x, moe_ref.RouterOutput(wrong.astype(np.int64), weights),
                                    shards, 10.0)
    with pytest.raises(AssertionError, match="out of tolerance"):
        mk.check_routed_close(broken, want)
    poisoned = want.copy()
    poisoned[3, 7] = np.nan
    with pytest.raises(AssertionError, match="non-finite"):
        mk.check_routed_close(poisoned, want)


@pytest.mark.parametrize("config", ["tiny", "v41-flash"])
def test_specs_grid_and_abi(config):
    shape = mk.moe_shape(ModelConfig.preset(config), 4)
    specs = mk.make_specs(shape)
    assert [s.kind for s in specs] == ["prep", "w13", "w2", "combine"]
    for spec in specs:
        d = spec.to_dict()
        assert d["params"][-1] == ["rows", "u32"]
        assert all(kind == "u64" for _, kind in d["params"][:-1])
        for rows in (1, 8, 192):
            grid = spec.grid(rows)
            assert 1 <= grid[0] <= max(132 * spec.ctas_per_sm, spec.work_items(192))
        with pytest.raises(ValueError):
            spec.grid(193)
        with pytest.raises(ValueError):
            spec.grid(0)
    w13 = specs[1]
    assert w13.block[0] % 32 == 0 and (shape.k13 // 64) % (2 * w13.block[0] // 32) == 0


def test_kernel_signatures_match_the_spec_abi():
    pytest.importorskip("cutlass")
    from kernels import build, moe
    for spec in moe.specs(ModelConfig.preset("tiny"), 4):
        sig = build.signature_abi(moe.kernel_function(spec))
        assert [n for n, _ in sig] == [n for n, _ in spec.params]
        assert all(kind in allowed for (_, allowed), (_, kind) in zip(sig, spec.params))


@pytest.mark.parametrize("config", ["tiny", "v41-flash"])
def test_selfrouted_specs_abi_grid_and_shared_memory(config):
    """xquant / w13sr / w2sr: pointer ABI, grids that cover the items, and shared memory that
    fits ctas_per_sm CTAs on an SM (228 KB, 1 KB reserved per CTA) with the routing scratch
    inside the ring and the lists after it."""
    shape = mk.moe_shape(ModelConfig.preset(config), 4)
    specs = mk.selfrouted_specs(shape)
    assert [s.kind for s in specs] == (["xquant"] + ["w13sr"] * len(mk.W13SR_VARIANTS)
                                       + ["w2sr"] * len(mk.W2SR_VARIANTS))
    assert len({s.name for s in specs}) == len(specs)
    for spec in specs:
        d = spec.to_dict()
        assert d["params"][-1] == ["rows", "u32"]
        assert all(kind == "u64" for _, kind in d["params"][:-1])
        assert spec.ctas_per_sm * (spec.smem_bytes + 1024) <= 228 * 1024, spec.name
        for rows in (1, 8, 192):
            assert 1 <= spec.grid(rows)[0] <= max(132 * spec.ctas_per_sm, spec.work_items(192))
        with pytest.raises(ValueError):
            spec.grid(193)
    xq = specs[0]
    assert xq.grid(192)[0] * (xq.block[0] // 32) >= 192 * shape.groups(shape.k13)
    for spec in specs[1:]:
        kind = spec.kind[:-2]
        warps = spec.block[0] // 32
        if spec.variant.startswith("bulk"):  # kernels/moe_bulk.py: stage, then its barriers
            ring = mk.bulk_sr_ring_region(shape, warps)
            assert ring >= warps * mk.bulk_warp_bytes(shape, warps) and ring % 16 == 0
            ring += mk.bulk_bars_bytes(shape, warps, spec.variant)
        else:
            ring = mk.ring_region_bytes(shape, kind, spec.stages)
            assert ring >= spec.stages * mk.ring_stage_bytes(shape, kind)
        assert ring >= mk.routing_scratch_bytes(shape)
        assert spec.smem_bytes >= ring + mk.routing_lists_bytes(shape)
        assert warps <= 8                    # the lists header holds 8 warp totals


def _replay_group_commits(stages: int, groups: int, items: int) -> None:
    """The group-commit schedule of kernels/moe_pipelined.py on a model of cp.async groups:
    `stages - 1` items issued ahead, then per item: issue the item `stages - 1` ahead (empty
    groups past the last), and before each group's math wait_group(group_wait_pending). Every
    group must be complete when its math starts; wait_group N completes all but the newest N."""
    committed, done = [], set()

    def issue(item):
        for g in range(groups):
            committed.append((item, g) if item < items else None)

    def wait(pending):
        done.update(c for c in committed[:max(len(committed) - pending, 0)] if c is not None)

    for item in range(stages - 1):
        issue(item)
    for item in range(items):
        issue(item + stages - 1)
        for g in range(groups):
            wait(mk.group_wait_pending(stages, groups, g))
            assert (item, g) in done, (stages, groups, item, g)
            # and the wait is not stronger than needed: the next group may still be in flight
            if g + 1 < groups:
                assert (item, g + 1) not in done, (stages, groups, item, g)


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("groups", [1, 5, 10])
def test_group_commit_waits_cover_each_group_and_no_more(stages, groups):
    _replay_group_commits(stages, groups, items=4)
    with pytest.raises(ValueError):
        mk.group_wait_pending(stages, groups, groups)


@pytest.mark.parametrize("config", ["tiny", "v41-flash"])
def test_variant_specs_fit_and_group_commit_twins(config):
    """Candidate w13 / w2 kernels: unique names, shared memory for ctas_per_sm CTAs, and every
    group-commit ("g") variant the twin of a measured one (same ring, block, occupancy)."""
    shape = mk.moe_shape(ModelConfig.preset(config), 4)
    specs = mk.make_specs(shape) + mk.variant_specs(shape)
    assert len({s.name for s in specs}) == len(specs)
    by_key = {(s.kind, s.variant): s for s in specs}
    twins = 0
    for spec in specs:
        assert spec.ctas_per_sm * (spec.smem_bytes + 1024) <= 228 * 1024, spec.name
        assert spec.to_dict()["group_commits"] == spec.group_commits
        if spec.group_commits:
            twin = by_key[(spec.kind, spec.variant[1:])]
            assert not twin.group_commits
            assert (spec.block, spec.smem_bytes, spec.stages, spec.ctas_per_sm) == (
                twin.block, twin.smem_bytes, twin.stages, twin.ctas_per_sm)
            twins += 1
    assert twins == 2


def test_step_variants_pick_the_group_commit_pair_when_present():
    from executor.launches import moe as ml
    every = {("w13", ""), ("w2", ""), ("w2", "r2x2"), ("w2", "g"), ("w2", "gr2x2")}
    assert ml.step_variants(every, 1) == ("", "gr2x2")
    assert ml.step_variants(every, 5) == ("", "g")
    assert ml.step_variants({("w13", ""), ("w2", "")}, 3) == ("", None)
    shape = mk.moe_shape(ModelConfig.preset("v41-flash"), 4)
    assert ml.warp_routed_fits(every | {("w13w", "early")}, shape, 10)
    assert not ml.warp_routed_fits(every | {("w13w", "early")}, shape, 11)
    assert not ml.warp_routed_fits(every | {("w13w", "early")}, shape, 1, "bulk")
    assert not ml.warp_routed_fits(every, shape, 1)
    bulk = {("w13w", ml.BULK_W13W), ("w2", "bulk")}
    assert ml.bulk_fits(every | bulk, shape, 10)
    assert not ml.bulk_fits(every | bulk, shape, 11)
    assert ml.bulk_fits(every | bulk | {("w13sr", "bulk")}, shape, 11)
    assert not ml.bulk_fits(every | {("w13w", ml.BULK_W13W)}, shape, 1)


@pytest.mark.parametrize("config", ["tiny", "v41-flash"])
def test_warp_routed_w13_spec_limits_its_rows(config):
    """moe_w13w: w13sr's pointer ABI, the default w13's block / ring / occupancy ("bulk": its
    own shared memory), and a grid only for rows * topk <= 64 (one warp's two ids per lane)."""
    shape = mk.moe_shape(ModelConfig.preset(config), 4)
    specs = mk.warp_routed_specs(shape)
    assert [s.variant for s in specs] == list(mk.W13W_VARIANTS)
    g = next(s for s in mk.make_specs(shape) if s.kind == "w13")
    top = mk.WARP_ROUTED_MAX_PAIRS // shape.topk
    for spec in specs:
        assert spec.params == mk.PARAMS["w13sr"]
        smem = (mk.bulk_smem_bytes(shape, g.block[0] // mk.LANES, spec.variant)
                if spec.variant.startswith("bulk") else g.smem_bytes)
        ctas = mk.W13W_OCCUPANCY.get(spec.variant, (g.ctas_per_sm, 0))[0]
        assert (spec.block, spec.smem_bytes, spec.ctas_per_sm, spec.stages) == (
            g.block, smem, ctas, g.stages)
        assert spec.grid(top)[0] == min(g.work_items(top), 132 * ctas)
        with pytest.raises(ValueError, match="pairs"):
            spec.grid(top + 1)


@pytest.mark.parametrize("config", ["tiny", "v41-flash"])
@pytest.mark.parametrize("variant", ["bulk", "bulk1", "bulkw"])
def test_bulk_w13_slices_are_contiguous_and_fit(config, variant):
    """moe_w13w "bulk" / "bulk1" copy a warp's K slice of an item as `parts` (codes, offsets)
    ranges: they must tile the warp's slice of the packed tile exactly, be 16-byte multiples at
    16-byte aligned addresses (cp.async.bulk), and the stage + reduction + barriers fit 3 CTAs
    per SM."""
    shape = mk.moe_shape(ModelConfig.preset(config), 4)
    spec = next(s for s in mk.warp_routed_specs(shape) if s.variant == variant)
    warps = spec.block[0] // mk.LANES
    cols = shape.k13 // mk.COL_K
    per_warp_cols = cols // warps
    parts = mk.bulk_parts(shape, warps, variant)
    want = {"bulk": 2, "bulk1": 1, "bulkw": 5} if config == "v41-flash" else {}
    assert parts == want.get(variant, 1)
    window = mk.bulk_window(shape, warps, variant)
    assert 1 <= window <= parts and (window == parts) == (variant != "bulkw" or parts == 1)
    part_groups = per_warp_cols // 2 // parts
    assert part_groups * parts * 2 == per_warp_cols
    code_ranges, offset_ranges = [], []
    for warp in range(warps):
        for part in range(parts):
            col = warp * per_warp_cols + 2 * part_groups * part
            grp = warp * per_warp_cols // 2 + part_groups * part
            code_ranges.append((col * mk.COL_BYTES, 2 * part_groups * mk.COL_BYTES))
            offset_ranges.append((grp * mk.GROUP_OFFSET_BYTES,
                                  part_groups * mk.GROUP_OFFSET_BYTES))
    for ranges, total in ((code_ranges, cols * mk.COL_BYTES),
                          (offset_ranges, cols // 2 * mk.GROUP_OFFSET_BYTES)):
        assert all(start % 16 == 0 and size % 16 == 0 and size > 0 for start, size in ranges)
        covered = np.zeros(total, np.int32)
        for start, size in ranges:
            covered[start:start + size] += 1
        np.testing.assert_array_equal(covered, 1)      # every byte of the tile exactly once
    tile_codes, tile_offsets = shape.w13_bytes[0] // shape.tiles13, shape.w13_bytes[1] // \
        shape.tiles13
    assert (tile_codes, tile_offsets) == (cols * mk.COL_BYTES, cols // 2 * mk.GROUP_OFFSET_BYTES)
    assert mk.bulk_warp_bytes(shape, warps) * warps == tile_codes + tile_offsets
    assert spec.ctas_per_sm * (spec.smem_bytes + 1024) <= 228 * 1024


@pytest.mark.parametrize("config", ["tiny", "v41-flash"])
@pytest.mark.parametrize(("variant", "ctas"), [("bulkw_lean4", 4)])
def test_lean_w13w_runs_at_a_128_register_bound(config, variant, ctas):
    """Round 6: w13w "bulkw_lean4" is "bulkw"'s stage at 4 CTAs/SM compiled for
    LEAN_LAUNCH_BOUND CTAs (64 K / (4 x 128): 128 registers, the build checks no spill): 4 fill
    the SM (one item per CTA at R = 1). Shared memory within 228 KB (1 KB a CTA)."""
    shape = mk.moe_shape(ModelConfig.preset(config), 4)
    every = {(s.kind, s.variant): s for s in mk.warp_routed_specs(shape) + mk.variant_specs(shape)}
    lean, base = every[("w13w", variant)], every[("w13w", "bulkw")]
    assert mk.bulk_scheme(lean.variant) == "bulkw" and mk.is_lean(lean.variant)
    assert not mk.is_lean(base.variant)
    assert (lean.block, lean.smem_bytes) == (base.block, base.smem_bytes)
    assert lean.ctas_per_sm == ctas and lean.launch_bound == mk.LEAN_LAUNCH_BOUND
    assert lean.grid(8)[0] == min(lean.work_items(8), 132 * ctas)
    assert base.launch_bound == base.ctas_per_sm and "launch_bound_ctas" not in base.to_dict()
    regs = min(255, 65536 // (lean.launch_bound * lean.block[0]))     # v41 (128 threads): 128
    assert ctas * lean.block[0] * regs <= 65536
    assert ctas * (lean.smem_bytes + 1024) <= 228 * 1024
    groups = shape.k13 // mk.COL_K // (lean.block[0] // mk.LANES) // 2     # per warp slice
    assert mk.LEAN_B_WINDOW >= 1 and (groups == 1 or mk.LEAN_B_WINDOW < groups)  # v41: 4 of 10


# ---- round 8: the combine that adds the shared expert (moe_combine_<tag>_shared) ---------------

def _bf16_rne_bits(total: np.ndarray) -> np.ndarray:
    """f32 -> bf16 bits, round to nearest even by integer arithmetic (no ml_dtypes; finite)."""
    bits = total.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


@pytest.mark.parametrize("rows", [1, 6, 48])
def test_combine_shared_reference_is_the_add_f32_arithmetic_bitwise(rows):
    """mk.combine_shared_reference == bf16_rn(f32 add.rn(y, f32(shared))), y the plain combine's
    fp32 slot-order sum, == the shared w2's old "add_f32" epilogue bf16(f32(bf16(t)) + y) with
    shared = bf16(t) (the "bf16" epilogue of the same total t), == round 4's f32 + bf16 residual
    add; bitwise, on random data with a third of the elements pushed onto or next to a bf16
    rounding tie of y + shared (exact f32 ties among them, checked, so round-to-even is
    exercised)."""
    from kernels.dense_ref import to_bf16 as dense_to_bf16
    from kernels.elementwise_ref import residual_add_ref

    rng = np.random.default_rng(rows)
    k, d = 6, 256
    w = (rng.random((rows, k)) * 0.5).astype(np.float32)
    w[:, 0] = 1.0
    ye = rng.standard_normal((rows * k, d)).astype(BF16)
    t = (rng.standard_normal((rows, d)) * 0.3).astype(np.float32)
    shared = t.astype(BF16)
    # Ties: where picked, y = ye of slot 0 (a bf16 value a: the other slots' ye are 0) and
    # shared = (1, 3, 1 + 2^-7 or 1 - 2^-8) x half an ulp of a, either sign: a + shared is a
    # bf16 rounding tie (exact in f32) or next to one.
    pick = rng.random((rows, d)) < 1 / 3
    grid = ye.reshape(rows, k, d)
    grid[:, 1:][np.broadcast_to(pick[:, None], (rows, k - 1, d))] = 0
    a = grid[:, 0].astype(np.float32)
    half = np.ldexp(np.float32(1), np.frexp(a)[1] - 9).astype(np.float32)
    factor = rng.choice(np.float32([1, 3, 1 + 2.0**-7, 1 - 2.0**-8]), (rows, d))
    sign = rng.choice(np.float32([-1, 1]), (rows, d))
    shared = np.where(pick & (a != 0), (sign * factor * half).astype(BF16), shared)
    y = moe_ref.combine(w, ye.astype(np.float32))
    got = mk.combine_shared_reference(w, ye, shared)
    assert got.dtype == BF16 and got.shape == (rows, d)
    total = (y + shared.astype(np.float32)).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint16), _bf16_rne_bits(total))
    add_f32 = dense_to_bf16(dense_to_bf16(t).astype(np.float32) + y)          # old epilogue
    np.testing.assert_array_equal(mk.combine_shared_reference(w, ye, t.astype(BF16))
                                  .view(np.uint16), add_f32.view(np.uint16))
    np.testing.assert_array_equal(got.view(np.uint16),
                                  residual_add_ref(y, shared).view(np.uint16))
    low = _bf16_rne_bits(total).astype(np.uint32) << 16           # the ties were exercised
    ties = (total.view(np.uint32) & 0xFFFF) == 0x8000
    assert ties.sum() >= pick.sum() // 8, (int(ties.sum()), int(pick.sum()))
    assert (low.view(np.float32)[ties] != total[ties]).all()


def test_combine_shared_spec_and_bundle_list():
    """Its ABI is the combine's plus shared / out, its grid the combine's; kernels/moe.py builds
    it for every MoE shape (the step's and the revert's combine both in the bundle)."""
    for shape in (mk.MoeShape(16, 6, 256, 96, 10.0), mk.MoeShape(384, 6, 5120, 768, 10.0)):
        plain, shared = mk.make_specs(shape)[-1], mk.combine_shared_spec(shape)
        assert shared.name == plain.name + "_shared" and shared.block == plain.block
        assert [p for p, _ in shared.params] == ["route_weights", "ye", "shared", "out", "rows"]
        for rows in (1, 2, 3, 5, 6, 8, 12, 16, 48, 96, 192):
            assert shared.grid(rows) == plain.grid(rows)


def test_shared_w2_bf16_and_add_f32_kernels_share_their_sum():
    """The bitwise argument's premise: the shared w2's "bf16" and "add_f32" kernels have the
    same variant, split and unit layout at every row tiling (the fp32 total t is the same
    bits; only the epilogue differs)."""
    from kernels import dense_ref as dr
    from loader.config import ModelConfig

    for preset in ("tiny", "v41-flash"):
        n, k, epilogues = dr.dense_shapes(ModelConfig.preset(preset), 4)["shared_w2"]
        assert {"bf16", "add_f32"} <= set(epilogues)
        for rt in dr.ROW_TILE_CHOICES:
            a = dr.make_spec("shared_w2", n, k, row_tiles=rt, epilogue="bf16").to_dict()
            b = dr.make_spec("shared_w2", n, k, row_tiles=rt, epilogue="add_f32").to_dict()
            diff = {key for key in a if a[key] != b[key]}
            assert diff <= {"name", "epilogue"}, (preset, rt, diff)
