"""executor.stages.ffn on four emulated ranks (tiny, CPU): router, routed MoE and shared expert
from `xn` to each rank's `ffn.partial`, against the model reference (kernels/moe_ref.py).

Per case (fresh random bf16 xn; rows 1, 6 (a verify block's size), 13 real rows in a bucket of
16 whose 3 padding rows hold zeros, 48), two backbone layers, every rank:
- router: ids, weights and logits bitwise `moe_ref.route` / `matmul_t` (the emulator runs the
  reference's arithmetic), and bitwise equal across ranks (replicated);
- routed sum `ffn.moe.y`: bitwise `moe_ref.routed_experts` on the reference's dequantized expert
  slices (so the fused-E8M0 packing of every expert decodes to the reference's weights);
- shared expert, stage by stage on the emulator's own inputs. Two launches (ffn.SHARED_EXPERT_FUSED):
  h within `dense_ref.epilogue_expectation`'s "swiglu" bound of SwiGLU of the float64 x·W13ᵀ;
  with plan.SHARED_ON_SIDE (round 8) ffn.shared_out within the "bf16" bound of h·W2ᵀ and
  ffn.partial bitwise bf16(routed + shared_out) (the shared combine; the routed sum is
  moe_ref's bits, no longer stored), else ffn.partial within the "add_f32" bound of h·W2ᵀ + y
  (fp32 summation order, then each rounding); and the two arrangements bitwise equal;
  Four launches (reverted): h13 and the w2 output within 2 x `dense_tolerance` of bf16(x·Wᵀ)
  (both sides are within one such bound of the exact product: fp32 summation order + one bf16
  rounding), h bitwise `swiglu_ref`, ffn.partial bitwise bf16(y + shared) (the f32 + bf16 add);
- end to end: ffn.partial against `moe_ref.moe_partial` (quantize_acts=True) within the bound
  those stage errors propagate to (`_partial_bound`);
- nothing written at or past the bucket's last row in any buffer of the group.
The FFN is row-independent (no row metadata, no cache): which sequence a row belongs to plays no
part, so a row count stands for any mix of sequences.
"""
from __future__ import annotations

import numpy as np
import pytest
from stage_checks import within_bound
from tiny_checkpoint import tiny_checkpoint

from executor import plan as plan_mod
from executor.bench_step import overrides
from executor.emulate.ranks import EmulatedRanks
from executor.reference.kvcache import KVCaches
from executor.reference.weights import rank_weights_from_checkpoint
from executor.stages import ffn
from kernels import dense_ref as dr
from kernels import moe_ref
from kernels.common_ref import BF16
from kernels.elementwise_ref import residual_add_ref
from kernels.swiglu_ref import swiglu_ref
from loader.checkpoint import Checkpoint

TP = 4
ROLES = {"ffn.shared_w13", "ffn.router", "ffn.moe_routed", "ffn.moe_combine",
         "ffn.shared_expert"}
# router; MoE chain + combine; w1|w3 + SwiGLU, w2 (reverted: w1|w3, SwiGLU, w2, and the add
# where the combine does not add: not plan.SHARED_ON_SIDE)
SHARED_LAUNCHES = 2 if ffn.SHARED_EXPERT_FUSED else 3 + (not plan_mod.SHARED_ON_SIDE)
LAUNCHES_PER_RANK = 1 + 4 + SHARED_LAUNCHES
CASES = [(1, 1), (6, 6), (13, 16), (48, 48)]          # (real rows, bucket)
POISONED = ("ffn.partial", "ffn.router_logits", "ffn.topk_ids", "ffn.topk_weights",
            "ffn.moe.meta", "ffn.moe.pairs", "ffn.moe.xq", "ffn.moe.xs", "ffn.moe.h",
            "ffn.moe.ye", "ffn.moe.y", "ffn.shared_h13", "ffn.shared_h", "ffn.shared_out")
ROW_BUFFERS = ("ffn.partial", "ffn.router_logits", "ffn.topk_ids", "ffn.topk_weights",
               "ffn.moe.xq", "ffn.moe.xs", "ffn.moe.y", "ffn.shared_h13", "ffn.shared_h",
               "ffn.shared_out")


class Setup:
    def __init__(self, ckpt, bundle_dir):
        self.cfg = cfg = ckpt.config
        caches = KVCaches.allocate(cfg, max_seqs=2, max_context=64, page_size=16)
        self.ranks = EmulatedRanks(ckpt, bundle_dir, TP, caches, modules=("executor.stages.ffn",))
        self.refs = [rank_weights_from_checkpoint(ckpt, TP, r) for r in range(TP)]
        backbone = [s.index for s in cfg.layers if not s.is_dspark]
        self.layers = (backbone[0], backbone[-1])
        self.d, self.k = cfg.hidden_size, cfg.num_experts_per_tok

    def read(self, rank, name, dtype, rows, width):
        return self.ranks.read(rank, name, dtype, (rows, width))

    def run(self, x: np.ndarray, layer: int, ranks=None,
            launches: int = LAUNCHES_PER_RANK) -> None:
        ranks = self.ranks if ranks is None else ranks
        for arena in ranks.arenas:
            for name in POISONED:
                arena.fill(name, 0xFF)
        ranks.write("xn", x)
        launched = ranks.run(x.shape[0], roles=ROLES, layers={layer})
        assert launched == TP * launches


@pytest.fixture(scope="module")
def setup(tiny_bundle_dir):
    with Checkpoint.open(tiny_checkpoint(), progress=False) as ckpt:
        yield Setup(ckpt, tiny_bundle_dir)


@pytest.fixture(scope="module")
def setup_w2_main(tiny_bundle_dir):
    """The 62f9948 arrangement (plan.SHARED_ON_SIDE = False), wired under the override (the
    builders keep the arrangement they were wired with; the override ends before the tests)."""
    with Checkpoint.open(tiny_checkpoint(), progress=False) as ckpt:
        with overrides({("executor.plan", "SHARED_ON_SIDE"): False}):
            st = Setup(ckpt, tiny_bundle_dir)
        yield st


def _xn(rng, real: int, bucket: int, d: int) -> np.ndarray:
    x = np.zeros((bucket, d), BF16)                 # padding rows: what a zero stream norms to
    x[:real] = rng.standard_normal((real, d)).astype(BF16)
    return x


def _check_router(s: Setup, x32, layer: int, bucket: int) -> moe_ref.RouterOutput:
    lw = s.refs[0].layer(layer)
    gate = lw.vector("ffn.gate.weight")
    routing = moe_ref.route(x32, gate, lw.vector("ffn.gate.bias"), lw.topk,
                            s.cfg.routed_scaling_factor)
    logits = moe_ref.matmul_t(x32, gate)
    e = s.cfg.n_routed_experts
    for r in range(TP):
        ids = s.read(r, "ffn.topk_ids", np.int32, bucket, s.k)
        weights = s.read(r, "ffn.topk_weights", np.float32, bucket, s.k)
        np.testing.assert_array_equal(ids, routing.experts, err_msg=f"rank {r} ids")
        np.testing.assert_array_equal(weights, routing.weights, err_msg=f"rank {r} weights")
        np.testing.assert_array_equal(s.read(r, "ffn.router_logits", np.float32, bucket, e),
                                      logits, err_msg=f"rank {r} logits")
    return routing


def _partial_bound(y, h, h_ref, w2, shared, shared_ref):
    """|bf16(y + shared) - bf16(y + shared_ref)|, shared = bf16(h·W2ᵀ) (emulated),
    shared_ref = bf16(h_ref·W2ᵀ) (reference): each within dense_tolerance of its exact product,
    the exact products |W2|·|h - h_ref| apart; then each side's f32 add and bf16 rounding
    (2^-24 + 2^-8 relative)."""
    shared_gap = (dr.dense_tolerance(h, w2, "bf16") + dr.dense_tolerance(h_ref, w2, "bf16")
                  + np.abs(h.astype(np.float64) - h_ref) @ np.abs(w2.astype(np.float64)).T)
    sums = (np.abs(y.astype(np.float64) + shared) + np.abs(y.astype(np.float64) + shared_ref)
            + shared_gap)                        # shared may be an estimate of the kernel's
    return shared_gap + (2.0**-8 + 2.0**-24) * sums + 2.0**-133


def _check_fused(x, h, y, partial, w13, w2, limit: float, what: str):
    """The two-launch shared expert: h = the w1|w3 kernel's SwiGLU epilogue, partial = the w2
    kernel's routed-sum epilogue, each within its dense_ref.epilogue_expectation bound of the
    float64 product of its own inputs. Returns the errors and bf16(h·W2ᵀ) (for the end-to-end
    bound: the kernel keeps its own in registers)."""
    inter, d = w2.shape[1], w2.shape[0]
    spec13 = dr.make_spec("shared_w13", 2 * inter, x.shape[1], epilogue="swiglu",
                          swiglu_limit=limit)
    want, bound = dr.epilogue_expectation(
        spec13, x.astype(np.float64) @ w13.astype(np.float64).T,
        dr.dense_tolerance(x, w13, "f32"))
    errs = {"h": within_bound(h, want, bound, f"{what}: h (w1|w3 + SwiGLU epilogue)")}
    spec2 = dr.make_spec("shared_w2", d, inter, epilogue="add_f32")
    want, bound = dr.epilogue_expectation(
        spec2, h.astype(np.float64) @ w2.astype(np.float64).T,
        dr.dense_tolerance(h, w2, "f32"), y)
    if partial is not None:             # None: w2 writes shared_out (plan.SHARED_ON_SIDE)
        errs["partial_stage"] = within_bound(partial, want, bound,
                                             f"{what}: ffn.partial (w2 + routed)")
    return errs, moe_ref.round_bf16(moe_ref.matmul_t(h.astype(np.float32), w2))


def _check_rank(s: Setup, r: int, x, routing, layer: int, bucket: int) -> dict:
    lw, cfg, d = s.refs[r].layer(layer), s.cfg, s.d
    x32, limit = x.astype(np.float32), cfg.swiglu_limit
    inter = lw.shared.w2.shape[1]
    y_ref = moe_ref.routed_experts(x32, routing, lw.experts, limit, True)
    w13, w2 = lw.shared.w13, lw.shared.w2
    h13_ref = moe_ref.round_bf16(moe_ref.matmul_t(x32, w13))
    h = s.read(r, "ffn.shared_h", BF16, bucket, inter)
    partial = s.read(r, "ffn.partial", BF16, bucket, d)
    if plan_mod.SHARED_ON_SIDE:         # the combine adds shared_out: y never stored
        y = y_ref
        shared = s.read(r, "ffn.shared_out", BF16, bucket, d)
        np.testing.assert_array_equal(
            partial, (y_ref + shared.astype(np.float32)).astype(BF16),
            err_msg=f"rank {r} layer {layer}: partial is not bf16(moe_ref's routed sum + "
                    "shared_out)")
    else:
        y = s.read(r, "ffn.moe.y", np.float32, bucket, d)
        np.testing.assert_array_equal(
            y, y_ref, err_msg=f"rank {r} layer {layer}: routed sum is not moe_ref's bits")
    if ffn.SHARED_EXPERT_FUSED and plan_mod.SHARED_ON_SIDE:
        errs, _ = _check_fused(x, h, y, None, w13, w2, limit, f"rank {r} layer {layer}")
        spec2 = dr.make_spec("shared_w2", d, inter, epilogue="bf16")
        want, bound = dr.epilogue_expectation(
            spec2, h.astype(np.float64) @ w2.astype(np.float64).T,
            dr.dense_tolerance(h, w2, "f32"))
        errs["shared"] = within_bound(shared, want, bound, f"rank {r}: shared_out (w2 bf16)")
    elif ffn.SHARED_EXPERT_FUSED:
        errs, shared = _check_fused(x, h, y, partial, w13, w2, limit, f"rank {r} layer {layer}")
    else:
        h13 = s.read(r, "ffn.shared_h13", BF16, bucket, 2 * inter)
        errs = {"h13": within_bound(h13, h13_ref, 2 * dr.dense_tolerance(x, w13, "bf16"), "h13")}
        np.testing.assert_array_equal(h, swiglu_ref(h13, limit), err_msg=f"rank {r}: SwiGLU")
        shared = s.read(r, "ffn.shared_out", BF16, bucket, d)
        errs["shared"] = within_bound(shared, moe_ref.round_bf16(moe_ref.matmul_t(h, w2)),
                                      2 * dr.dense_tolerance(h, w2, "bf16"), "shared w2")
        np.testing.assert_array_equal(partial, residual_add_ref(y, shared),
                                      err_msg=f"rank {r}: partial is not bf16(y + shared)")
        shared = shared.astype(np.float32)
    # End to end: the reference's own shared-expert path, then moe_partial itself.
    h_ref = moe_ref.round_bf16(moe_ref.swiglu_clamped(h13_ref[:, :inter], h13_ref[:, inter:],
                                                      limit))
    shared_ref = moe_ref.round_bf16(moe_ref.matmul_t(h_ref, w2))
    want = moe_ref.moe_partial(x32, routing, lw.experts, lw.shared, limit, quantize_acts=True)
    bound = _partial_bound(y, h, h_ref, w2, shared.astype(np.float32), shared_ref)
    errs["partial"] = within_bound(partial, want, bound, f"rank {r} layer {layer}: ffn.partial")
    return errs


def _check_untouched_past(s: Setup, bucket: int) -> None:
    rows = s.ranks.max_rows
    row_bytes = {b.name: b.nbytes // rows for b in ffn.buffers(s.cfg, TP, rows)}
    row_bytes["ffn.partial"] = 2 * s.d
    for r, arena in enumerate(s.ranks.arenas):
        for name in ROW_BUFFERS:
            past = arena.view(name, np.uint8)[row_bytes[name] * bucket:row_bytes[name] * rows]
            assert (past == 0xFF).all(), f"rank {r}: {name} written past row {bucket}"


@pytest.mark.parametrize(("real", "bucket"), CASES)
@pytest.mark.parametrize("which", [0, 1])
def test_ffn_partial_matches_the_reference(setup, which, real, bucket):
    s, rng = setup, np.random.default_rng()
    layer = s.layers[which]
    x = _xn(rng, real, bucket, s.d)
    s.run(x, layer)
    routing = _check_router(s, x.astype(np.float32), layer, bucket)
    for r in range(TP):
        _check_rank(s, r, x, routing, layer, bucket)
    _check_untouched_past(s, bucket)


@pytest.mark.parametrize(("rows", "dense", "moe_first"), [(1, "r8", "moe_prep_"),
                                                          (6, "r8", "moe_xquant_"),
                                                          (48, "r32", "moe_xquant_")])
def test_launch_lists_follow_the_bucket(setup, rows, dense, moe_first):
    s = setup
    plan = s.ranks.plans[0]
    layer = s.layers[0]

    def names(role):
        return [spec.kernel.name for spec in plan.stage(f"layer{layer:02d}.{role}").build(rows)]
    tile = ("_tile8" + "p" * ffn.ROUTER_TILE_POLLED) if rows <= ffn.ROUTER_TILE_MAX_ROWS else ""
    assert names("ffn.router") == [f"router_e{s.cfg.n_routed_experts}_d{s.d}_k{s.k}{tile}"]
    moe = names("ffn.moe_routed")
    assert moe[0].startswith(moe_first) and len(moe) == 3
    assert not any(n.startswith("moe_combine_") for n in moe)
    tag = f"e{s.cfg.n_routed_experts}_k{s.k}"
    combine = names("ffn.moe_combine")
    assert len(combine) == 1 and combine[0].startswith(f"moe_combine_{tag}")
    assert combine[0].endswith("_shared") == plan_mod.SHARED_ON_SIDE
    shared = names("ffn.shared_w13") + names("ffn.shared_expert")
    assert len(shared) == SHARED_LAUNCHES
    w2_epilogue = "bf16" if plan_mod.SHARED_ON_SIDE else "add_f32"
    if ffn.SHARED_EXPERT_FUSED:
        assert shared[0].startswith("dense_w8a16_shared_w13_")
        assert shared[0].endswith(f"_{dense}_swiglu")
        assert shared[1].startswith("dense_w8a16_shared_w2_")
        assert shared[1].endswith(f"_{dense}_{w2_epilogue}")
        return
    assert shared[0].startswith("dense_w8a16_shared_w13_") and shared[0].endswith(f"_{dense}_bf16")
    assert shared[1].startswith("swiglu_bf16_i")
    assert shared[2].startswith("dense_w8a16_shared_w2_") and shared[2].endswith(f"_{dense}_bf16")
    assert shared[3:] == ([] if plan_mod.SHARED_ON_SIDE else [f"residual_add_f32_bf16_d{s.d}"])


@pytest.mark.parametrize("rows", [1, 6, 48])
def test_shared_on_side_matches_the_w2_main_arrangement_bitwise(setup, setup_w2_main, rows):
    """plan.SHARED_ON_SIDE (w2 bf16 -> shared_out, the shared combine adds it) and the 62f9948
    arrangement (w2's add_f32 epilogue over the plain combine's y) write the same ffn.partial
    bytes on every rank (mk.combine_shared_reference's argument, on the emulated step)."""
    s, rng = setup, np.random.default_rng()
    assert plan_mod.SHARED_ON_SIDE, "this test compares the round-8 default with its revert"
    names = [st.name for st in setup_w2_main.ranks.plans[0].stages
             if st.name.startswith("layer00.ffn.")]
    assert names.index("layer00.ffn.shared_expert") > names.index("layer00.ffn.moe_combine")
    x = _xn(rng, rows, rows, s.d)
    layer = s.layers[0]
    w2_main = 1 + 4 + (2 if ffn.SHARED_EXPERT_FUSED else 4)
    outs = []
    for ranks, launches in ((s.ranks, LAUNCHES_PER_RANK), (setup_w2_main.ranks, w2_main)):
        s.run(x, layer, ranks, launches)
        outs.append([ranks.read(r, "ffn.partial", np.uint16, (rows, s.d)) for r in range(TP)])
    for r in range(TP):
        np.testing.assert_array_equal(outs[0][r], outs[1][r], err_msg=f"rank {r}")


def test_buffers_and_weights_declared(setup):
    s = setup
    names = {b.name for b in ffn.buffers(s.cfg, TP, 192)}
    assert set(POISONED) - {"ffn.partial"} <= names and all(n.startswith("ffn.") for n in names)
    arena = s.ranks.arenas[1]
    for layer in s.layers:
        for key in ffn.EXPERT_KEYS:
            assert f"layers.{layer}.ffn.experts.{key}" in arena.slices
        w13 = arena.view(f"layers.{layer}.ffn.shared_experts.w13.weight", np.uint8)
        w1 = s.refs[1].layer(layer).raw("ffn.shared_experts.w1.weight").view(np.uint8)
        w3 = s.refs[1].layer(layer).raw("ffn.shared_experts.w3.weight").view(np.uint8)
        rows = np.concatenate([w1.reshape(w1.shape[0], -1), w3.reshape(w3.shape[0], -1)])
        if ffn.SHARED_EXPERT_FUSED:                    # the swiglu epilogue's row order
            rows = dr.interleave_gate_up(rows)
        np.testing.assert_array_equal(w13[:rows.size], rows.reshape(-1))
    # The router counters and split-K counters start (and, after the runs above, stay) zero.
    for name in ("ffn.router_counters", "ffn.dense_counters"):
        assert not arena.view(name, np.uint8).any(), name


def _fetch_with(ckpt, override: dict):
    from loader.sharding import shard

    def fetch(name):
        if name in override:
            return override[name]
        return shard(ckpt, ckpt.spec(name), TP, 0)
    return fetch


def test_bad_weights_name_the_tensor():
    with Checkpoint.open(tiny_checkpoint(), progress=False) as ckpt:
        cfg = ckpt.config
        gate = "layers.0.ffn.gate.weight"
        bad = {gate: np.zeros((cfg.n_routed_experts, cfg.hidden_size), np.float32)}
        with pytest.raises(TypeError, match=gate):
            list(ffn.weights(cfg, TP, 0, _fetch_with(ckpt, bad)))
        scale = "layers.0.ffn.shared_experts.w1.scale"
        wrong = np.zeros((1, 1), np.uint8)
        with pytest.raises(TypeError, match="layers.0.ffn.shared_experts.w1"):
            list(ffn.weights(cfg, TP, 0, _fetch_with(ckpt, {scale: wrong})))
        expert = "layers.0.ffn.experts.3.w2.scale"
        with pytest.raises(TypeError, match=expert):
            list(ffn.weights(cfg, TP, 0, _fetch_with(ckpt, {expert: np.zeros((4, 4),
                                                                              np.float32)})))
        codes = "layers.0.ffn.experts.5.w1.weight"
        short = np.zeros((8, cfg.hidden_size // 2), np.int8)
        with pytest.raises(TypeError, match=codes + r": expected packed MXFP4 bytes \[96, 128\]"):
            list(ffn.weights(cfg, TP, 0, _fetch_with(ckpt, {codes: short})))
