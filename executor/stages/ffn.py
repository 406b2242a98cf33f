"""The FFN sublayer's stages on one rank: router, routed experts, shared expert -> `ffn.partial`.

Model doc §2.2 F1-F4 with `kernels/moe_ref.py`'s roundings (`route`, `moe_partial`), from the
boundary buffer `xn` (bf16 [R, D], the normed FFN input) to `ffn.partial` (bf16 [R, D], this
rank's partial, which the FFN all-reduce sums over ranks in fp32):

  ffn.shared_w13     dense w1|w3 +   xn -> ffn.shared_h bf16 [R, I]      (bf16(SwiGLU(bf16(x·W13ᵀ))))
                     swiglu epilogue (a side stage: beside the router and the routed experts,
                                     executor/branches.py)
  ffn.shared_expert  dense w2, bf16  ffn.shared_h -> ffn.shared_out bf16 [R, D]  (bf16(h·W2ᵀ);
                     epilogue        side, after w1|w3 on the side stream)
  ffn.router         router          xn -> ffn.router_logits, ffn.topk_ids, ffn.topk_weights
                                     (replicated: every rank computes the same bits)
  ffn.moe_routed     moe chain       xn, ids, weights -> ffn.moe.ye (executor/launches/moe.py
                                     `step_launches` without its combine: below 3 rows prep,
                                     w13w "bulkw_lean4", w2 "bulkp"; from 3 xquant, w13sr
                                     "bulk", w2sr "early")
  ffn.moe_combine    combine +       weights, ffn.moe.ye, ffn.shared_out -> ffn.partial (joins
                     shared          the branch; moe_combine_<tag>_shared: bf16(y + shared), y
                                     the routed sum in slot order: F4's rounding)

Round 8 (executor.plan.SHARED_ON_SIDE): the whole shared expert beside the routed chain; the
combine adds its output. Bitwise what the 62f9948 arrangement computed (ffn.shared_expert =
w2 with the "add_f32" epilogue after the plain combine: bf16(f32(bf16(t)) + y), one add.rn;
the "bf16" epilogue writes bf16(t) of the same total t, and the combine adds it with one add.rn:
mk.combine_shared_reference says why). Revert: SHARED_ON_SIDE = False: ffn.moe_combine is the
plain combine (-> ffn.moe.y f32) and ffn.shared_expert, after it, the "add_f32" w2 joining the
branch.

Two launches for the shared expert (SHARED_EXPERT_FUSED), each rounding where
`moe_ref.shared_expert` / `moe_partial` round: the w1|w3 kernel's "swiglu" epilogue (its weight
rows interleaved by 8, dense_ref.interleave_gate_up, so one thread holds a gate and its up) and
the w2 kernel's. Revert: SHARED_EXPERT_FUSED = False gives the four launches of round 4
(w1|w3 -> ffn.shared_h13, swiglu, w2 -> ffn.shared_out, and the sum: with SHARED_ON_SIDE the
shared combine, the same bf16(y + f32(shared_out)) as round 4's f32 + bf16 residual add of
kernels/elementwise.py, else that residual add) and the checkpoint's [w1; w3] row order. The
dense launches pick their kernel by rows (8 rows per pass up to 8 rows, 32 above). Padding rows
(past the real ones in a bucket) run like any row: the FFN writes no cache, and rows >= the
bucket are never touched.

Scratch is shared by every layer (layers run one after another; each launch reads its
predecessor's output only after griddepcontrol.wait). The split-K dense workspace and counters
are shared by the two shared-expert linears, which never overlap: both run in order on the side
stream (SHARED_ON_SIDE), or w2 starts after the branch joins, so after w1|w3 has finished (the
router and the routed experts, which run beside them, touch neither). `ffn.router_counters` and
`ffn.dense_counters` must be ZERO before the first launch (every launch leaves them zero): the
HostArena is zeroed at creation; on the GPU the Executor must zero the arena (cuMemAlloc does
not) before the first step.

Weights per backbone layer l (names after the checkpoint; repacked forms with a clear suffix):
  layers.{l}.ffn.gate.weight          bf16 [E, D]     (replicated)
  layers.{l}.ffn.gate.bias            f32 [E]
  layers.{l}.ffn.shared_experts.w13.weight / .w13.scale   e4m3 [2I_s, D] / ue8m0 [2I_s/32, D/32]
                                      (the rank's w1 rows, then its w3 rows, the weight rows
                                      interleaved by 8 when SHARED_EXPERT_FUSED; dense_shapes
                                      "shared_w13")
  layers.{l}.ffn.shared_experts.w2.weight / .w2.scale     e4m3 [D, I_s] / ue8m0 [D/32, I_s/32]
  layers.{l}.ffn.experts.{codes13, offsets13, scales13, codes2, offsets2, scales2}
                                      every expert's rank slice, Humming-padded, fused-E8M0
                                      (as executor/reference/weights.py) and packed by
                                      `moe_kernel_ref.pack_experts`: uint8 [E, per-expert bytes],
                                      f32 [E]
DSpark stage s (layer L + s) has the same weights under `mtp.{s}.ffn.` (wiring.weight_prefix),
with its own expert count and top-k (the dspark_* config keys: kernels of their shape, and the
scratch above sized for the larger of the two).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from executor import plan
from executor.launches import dense as dl
from executor.launches import moe as ml
from executor.launches.mhc import router_launch
from executor.launches.small import kernel_for, residual_add_launches
from executor.launches.swiglu import swiglu_launch
from executor.wiring import Buffer, byte_tensor, packed_layers, weight_prefix
from kernels import dense_ref as dr
from kernels import elementwise_ref, swiglu_ref
from kernels import moe_kernel_ref as mk
from kernels import router_ref as rk
from kernels.common_ref import BF16
from loader import formats

# The router's 16-row block; a 32-row variant (`_rb32`, deleted) lost at every bucket
# (docs/devicecheck run 17: R = 48 41.2 vs 93.1 us, R = 192 78.7 vs 108.3 us).
ROUTER_ROWS_PER_CTA = rk.ROWS_PER_CTA
# Buckets of at most this many rows take the one-pass router (kernels/router_tile.py), its polled
# `_tile8p` while ROUTER_TILE_POLLED, else `_tile8`. Run 15:55, us a launch in the step: 5.1 / 6.6
# / 22.5 / 72.3 at R = 1 / 6 / 48 / 192 vs the default's 6.2 / 10.3 / 28.5 / 63: the lines cross
# near R = 105, so the default keeps R > 96. Revert: ROUTER_TILE_POLLED = False (the counter-based
# one-pass kernel), ROUTER_TILE_MAX_ROWS = 0 (the default kernel everywhere).
ROUTER_TILE_MAX_ROWS = 96
ROUTER_TILE_POLLED = True
SHARED_LABELS = ("shared_w13", "shared_w2")
# The shared expert in 2 launches (w1|w3 + SwiGLU epilogue, w2 + routed-sum epilogue) instead of
# 4. Revert: False (also restores the checkpoint's w13 row order; rebind the weights).
SHARED_EXPERT_FUSED = True
SHARED_EPILOGUES = ({"shared_w13": "swiglu", "shared_w2": "add_f32"} if SHARED_EXPERT_FUSED
                    else {"shared_w13": "bf16", "shared_w2": "bf16"})
EXPERT_KEYS = ("codes13", "offsets13", "scales13", "codes2", "offsets2", "scales2")


def _w2_epilogue() -> str:
    """The shared w2's epilogue in the plans built now: bf16 into ffn.shared_out where the
    combine adds it (plan.SHARED_ON_SIDE), else SHARED_EPILOGUES's."""
    return "bf16" if plan.SHARED_ON_SIDE else SHARED_EPILOGUES["shared_w2"]


def _prefix(cfg, layer) -> str:
    return weight_prefix(cfg, layer) + "ffn."


def _shape(cfg, tp: int, layer) -> mk.MoeShape:
    return mk.moe_shape(cfg, tp, dspark=layer.is_dspark)


# ---- buffers --------------------------------------------------------------------------------

def _router_spec(cfg, layer, rows: int = rk.MAX_ROWS) -> rk.RouterSpec:
    """The router launched for a bucket of `rows` rows (`_tile8` up to ROUTER_TILE_MAX_ROWS)."""
    shape = _shape(cfg, 1, layer)
    args = (cfg.hidden_size, shape.num_experts, shape.topk, cfg.routed_scaling_factor)
    if rows <= ROUTER_TILE_MAX_ROWS:
        return rk.make_spec(*args, rk.ONE_PASS_ROWS, one_pass=True, polled=ROUTER_TILE_POLLED)
    return rk.make_spec(*args, ROUTER_ROWS_PER_CTA)


def _router_scratch_bytes(cfg, rows: int, experts: int) -> int:
    """The router scratch every kernel the step may pick needs (`spec.scratch_bytes`)."""
    args = (cfg.hidden_size, experts, 1, cfg.routed_scaling_factor)
    return max(rk.make_spec(*args, ROUTER_ROWS_PER_CTA).scratch_bytes(rows),
               rk.make_spec(*args, rk.ONE_PASS_ROWS, one_pass=True,
                            polled=ROUTER_TILE_POLLED).scratch_bytes(rows))


def _shared_dense_specs(cfg, tp: int) -> list[dr.DenseSpec]:
    """Every shared-expert linear the step may launch (SHARED_EPILOGUES, both row tilings)."""
    shapes = dr.dense_shapes(cfg, tp)
    pairs = [(label, SHARED_EPILOGUES[label]) for label in SHARED_LABELS] + [("shared_w2", "bf16")]
    return [dr.make_spec(label, *shapes[label][:2], row_tiles=rt, epilogue=epi,
                         swiglu_limit=cfg.swiglu_limit if epi == "swiglu" else 0.0)
            for label, epi in dict.fromkeys(pairs) for rt in dr.ROW_TILE_CHOICES]


def buffers(cfg, tp: int, max_rows: int) -> list[Buffer]:
    """The group's scratch, sized for max_rows (the MoE scratch as `launches.moe` lays it out)."""
    r, d = max_rows, cfg.hidden_size
    shapes = mk.moe_shapes(cfg, tp)
    e, k = max(s.num_experts for s in shapes), max(s.topk for s in shapes)
    inter = cfg.rank_shapes(tp).shared_inter
    dense = _shared_dense_specs(cfg, tp)
    workspace = max(s.workspace_bytes() for s in dense)
    counters = max(s.counters_bytes() for s in dense)
    moe = [dataclasses.replace(b, name="ffn." + b.name) for b in ml.scratch_buffers(cfg, tp, r)]
    return [
        Buffer("ffn.router_logits", np.float32, (r, e), "router logits"),
        Buffer("ffn.topk_ids", np.int32, (r, k), "routed experts, best first (replicated)"),
        Buffer("ffn.topk_weights", np.float32, (r, k), "their combine weights (replicated)"),
        Buffer("ffn.router_counters", np.int32, (_router_scratch_bytes(cfg, r, e) // 4,),
               "router row-block counters (+ `_tile8p` exchange): zero before the first launch"),
        *moe,
        Buffer("ffn.shared_h13", BF16, (r, 2 * inter), "shared expert gate | up"),
        Buffer("ffn.shared_h", BF16, (r, inter), "shared expert SwiGLU"),
        Buffer("ffn.shared_out", BF16, (r, d), "shared expert output"),
        Buffer("ffn.dense_workspace", np.float32, (max(workspace // 4, 1),),
               "split-K partials of the shared-expert linears"),
        Buffer("ffn.dense_counters", np.uint32, (max(counters // 4, 1),),
               "split-K counters: zero before the first launch"),
    ]


# ---- weights --------------------------------------------------------------------------------

def _shared_weights(cfg, tp: int, fetch, layer) -> list[tuple[str, np.ndarray]]:
    """The shared expert in the dense kernels' format: w13 = [w1; w3] rows, w2 as stored."""
    base = _prefix(cfg, layer) + "shared_experts."
    shapes = dr.dense_shapes(cfg, tp)
    parts = {w: (np.asarray(fetch(f"{base}{w}.weight")),
                 byte_tensor(fetch(f"{base}{w}.scale"), f"{base}{w}.scale"))
             for w in ("w1", "w3", "w2")}
    for w in ("w1", "w3"):
        dr.check_weight(parts[w][0][None], parts[w][1][None], 1, shapes["shared_w13"][0] // 2,
                        shapes["shared_w13"][1], f"{base}{w}")
    dr.check_weight(parts["w2"][0][None], parts["w2"][1][None], 1, *shapes["shared_w2"][:2],
                    f"{base}w2")
    w13 = np.concatenate([parts["w1"][0], parts["w3"][0]])
    s13 = np.concatenate([parts["w1"][1], parts["w3"][1]])
    if SHARED_EXPERT_FUSED:                 # the swiglu epilogue's row order (scales unchanged)
        w13 = dr.interleave_gate_up(w13)
    return [(f"{base}w13.weight", w13), (f"{base}w13.scale", s13),
            (f"{base}w2.weight", parts["w2"][0]), (f"{base}w2.scale", parts["w2"][1])]


def _mxfp4(fetch, base: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """One expert sublayer [n, k] as the checkpoint stores it: packed E2M1 pairs and one scale
    byte per 32 along k (checked: pack_experts' errors would not name the tensor)."""
    codes = np.asarray(fetch(base + ".weight"))
    scales = byte_tensor(fetch(base + ".scale"), base + ".scale")
    if codes.dtype.itemsize != 1 or codes.shape != (n, k // 2):
        raise TypeError(f"{base}.weight: expected packed MXFP4 bytes [{n}, {k // 2}], got "
                        f"{codes.dtype} {codes.shape}")
    if scales.shape != (n, k // formats.MXFP4_GROUP):
        raise TypeError(f"{base}.scale: expected [{n}, {k // formats.MXFP4_GROUP}], got "
                        f"{scales.shape}")
    return codes, scales


def _fused(packed: np.ndarray, scales: np.ndarray, name: str) -> formats.FusedE8M0:
    """Every expert's sublayer [E, N, K/2] through Humming's padding and fused-E8M0 step, sliced
    back to N x K (what executor/reference/weights.py dequantizes, expert by expert)."""
    n, half_k = packed.shape[-2:]
    fused = formats.fused_e8m0(*formats.humming_pad_sublayer(packed, scales), name=name)
    return formats.FusedE8M0(fused.packed[:, :n, :half_k],
                             fused.offsets[:, :n, :half_k * 2 // formats.MXFP4_GROUP],
                             fused.weight_scale_2, fused.lo)


def _expert_weights(cfg, tp: int, fetch, layer) -> list[tuple[str, np.ndarray]]:
    """This rank's slice of every routed expert of one layer, packed for the MoE kernels."""
    shape = _shape(cfg, tp, layer)
    base = _prefix(cfg, layer) + "experts"
    p13, s13, p2, s2 = [], [], [], []
    for e in range(shape.num_experts):
        c1, b1 = _mxfp4(fetch, f"{base}.{e}.w1", shape.inter, shape.hidden)
        c3, b3 = _mxfp4(fetch, f"{base}.{e}.w3", shape.inter, shape.hidden)
        c2, b2 = _mxfp4(fetch, f"{base}.{e}.w2", shape.hidden, shape.inter)
        p13.append(np.concatenate([c1, c3]))           # w13 = [gate; up], as the reference
        s13.append(np.concatenate([b1, b3]))
        p2.append(c2)
        s2.append(b2)
    packed = mk.pack_experts(_fused(np.stack(p13), np.stack(s13), f"{base} w13"),
                             _fused(np.stack(p2), np.stack(s2), f"{base} w2"), shape)
    parts = {"codes13": packed.w13.codes, "offsets13": packed.w13.offsets,
             "scales13": packed.w13.scales, "codes2": packed.w2.codes,
             "offsets2": packed.w2.offsets, "scales2": packed.w2.scales}
    return [(f"{base}.{key}", np.ascontiguousarray(parts[key]).reshape(shape.num_experts, -1))
            for key in EXPERT_KEYS]


def _gate_weights(cfg, fetch, layer) -> list[tuple[str, np.ndarray]]:
    base = _prefix(cfg, layer) + "gate."
    e, d = _shape(cfg, 1, layer).num_experts, cfg.hidden_size
    weight, bias = np.asarray(fetch(base + "weight")), np.asarray(fetch(base + "bias"))
    if weight.dtype != BF16 or weight.shape != (e, d):
        raise TypeError(f"{base}weight: the router reads bf16 [{e}, {d}], got {weight.dtype} "
                        f"{weight.shape}")
    if bias.shape != (e,) or not (bias.dtype.kind == "f" or bias.dtype == BF16):
        raise TypeError(f"{base}bias: expected a float [{e}] vector, got {bias.dtype} "
                        f"{bias.shape}")
    return [(base + "weight", weight), (base + "bias", bias.astype(np.float32))]  # exact


def weights(cfg, tp: int, rank: int, fetch, layers=None):
    """The FFN weights on this rank of `layers` (None: every backbone layer and the DSpark
    stages, wiring.packed_layers), one layer's experts packed at a time."""
    del rank                            # fetch already cuts this rank's slices
    for spec in packed_layers(cfg, layers):
        yield from _gate_weights(cfg, fetch, spec)
        yield from _shared_weights(cfg, tp, fetch, spec)
        yield from _expert_weights(cfg, tp, fetch, spec)


# ---- builders -------------------------------------------------------------------------------

def _router(ctx, layer):
    specs = {spec.name: spec for spec in (_router_spec(ctx.cfg, layer, rows)
                                          for rows in (1, rk.MAX_ROWS))}
    for spec in specs.values():
        kernel_for(ctx.bundle, spec)                   # in the bundle, built for this shape
    base = _prefix(ctx.cfg, layer) + "gate."
    ptrs = {"x": ctx.ptr("xn"), "weight": ctx.ptr(base + "weight"),
            "bias": ctx.ptr(base + "bias"), "logits": ctx.ptr("ffn.router_logits"),
            "ids": ctx.ptr("ffn.topk_ids"), "weights": ctx.ptr("ffn.topk_weights"),
            "counters": ctx.ptr("ffn.router_counters")}

    def build(rows):
        return [router_launch(ctx.bundle, _router_spec(ctx.cfg, layer, rows), ptrs, rows)]
    return build


def _moe_ptrs(ctx, layer):
    shape = _shape(ctx.cfg, ctx.tp, layer)
    if not ml.available_specs(ctx.bundle, shape):
        raise LookupError(f"the bundle has no MoE kernels of shape {shape.tag()}")
    base = _prefix(ctx.cfg, layer) + "experts."
    return shape, {"ids": ctx.ptr("ffn.topk_ids"), "route_weights": ctx.ptr("ffn.topk_weights"),
                   "x": ctx.ptr("xn"), **{key: ctx.ptr(base + key) for key in EXPERT_KEYS},
                   **{key: ctx.ptr("ffn.moe." + key)
                      for key in ("meta", "pairs", "xq", "xs", "h", "ye", "y", "sched")},
                   "shared": ctx.ptr("ffn.shared_out"), "out": ctx.ptr("ffn.partial")}


def _moe_routed(ctx, layer):
    """The step's MoE chain up to its w2 (-> ffn.moe.ye); the combine is ffn.moe_combine."""
    shape, ptrs = _moe_ptrs(ctx, layer)

    def build(rows):
        return ml.step_launches(ctx.bundle, shape, ptrs, rows, combine=False)
    return build


def _moe_combine(ctx, layer):
    """SHARED_ON_SIDE: moe_combine_<tag>_shared (+ ffn.shared_out -> ffn.partial), else the
    plain combine (-> ffn.moe.y, which the shared w2's "add_f32" epilogue reads)."""
    shape, ptrs = _moe_ptrs(ctx, layer)
    shared = plan.SHARED_ON_SIDE
    ml.combine_launch(ctx.bundle, shape, ptrs, 1, shared)      # in the bundle: fail at wiring

    def build(rows):
        return [ml.combine_launch(ctx.bundle, shape, ptrs, rows, shared)]
    return build


def _dense_by_row_tiles(ctx, label: str, epilogue: str = "bf16") -> dict[int, dr.DenseSpec]:
    """row_tiles -> the bundle's spec of `label`, checked against the arena's scratch."""
    out = {}
    for rows in (1, ctx.max_rows):
        spec = dl.dense_spec(ctx.bundle, label, rows, epilogue)
        for name, need in (("ffn.dense_workspace", spec.workspace_bytes()),
                           ("ffn.dense_counters", spec.counters_bytes())):
            if need > ctx.arena.nbytes(name):
                raise ValueError(f"{spec.name} needs {need} bytes of {name}; the arena has "
                                 f"{ctx.arena.nbytes(name)} (buffers() built for another shape?)")
        out[dl.row_tiles_for(rows)] = spec
    return out


def _shared_w13(ctx, layer):
    return _shared_expert_fused(ctx, layer)[0] if SHARED_EXPERT_FUSED else \
        _shared_expert_4(ctx, layer)[0]


def _shared_expert(ctx, layer):
    return _shared_expert_fused(ctx, layer)[1] if SHARED_EXPERT_FUSED else \
        _shared_expert_4(ctx, layer)[1]


def _shared_expert_fused(ctx, layer):
    """The builders of ffn.shared_w13 (w1|w3, SwiGLU epilogue -> ffn.shared_h) and
    ffn.shared_expert (w2: bf16 -> ffn.shared_out for the shared combine, or without
    SHARED_ON_SIDE "add_f32" over the routed sum -> ffn.partial)."""
    base = _prefix(ctx.cfg, layer) + "shared_experts."
    epilogue = _w2_epilogue()                   # bf16 -> shared_out, or add_f32 -> partial
    w13 = _dense_by_row_tiles(ctx, "shared_w13", "swiglu")
    w2 = _dense_by_row_tiles(ctx, "shared_w2", epilogue)
    scratch = {"workspace": ctx.ptr("ffn.dense_workspace"),
               "counters": ctx.ptr("ffn.dense_counters")}
    p13 = {"x": ctx.ptr("xn"), "weight": ctx.ptr(base + "w13.weight"),
           "scales": ctx.ptr(base + "w13.scale"), "out": ctx.ptr("ffn.shared_h"), **scratch}
    p2 = {"x": ctx.ptr("ffn.shared_h"), "weight": ctx.ptr(base + "w2.weight"),
          "scales": ctx.ptr(base + "w2.scale"), **scratch,
          **({"residual": ctx.ptr("ffn.moe.y"), "out": ctx.ptr("ffn.partial")}
             if epilogue == "add_f32" else {"out": ctx.ptr("ffn.shared_out")})}

    def build_w13(rows):
        return [dl.dense_launch(ctx.bundle, w13[dl.row_tiles_for(rows)], p13, rows)]

    def build_w2(rows):
        return [dl.dense_launch(ctx.bundle, w2[dl.row_tiles_for(rows)], p2, rows)]
    return build_w13, build_w2


def _shared_expert_4(ctx, layer):
    """Round 4's four launches: ([w1|w3], [swiglu, w2, the f32 + bf16 residual add]); with
    SHARED_ON_SIDE ([w1|w3], [swiglu, w2]): the shared combine adds ffn.shared_out."""
    cfg = ctx.cfg
    base = _prefix(cfg, layer) + "shared_experts."
    act = swiglu_ref.make_spec(ctx.shapes.shared_inter, cfg.swiglu_limit)
    add = elementwise_ref.make_spec(cfg.hidden_size, "f32")
    kernel_for(ctx.bundle, act)
    kernel_for(ctx.bundle, add)
    w13, w2 = _dense_by_row_tiles(ctx, "shared_w13"), _dense_by_row_tiles(ctx, "shared_w2")
    scratch = {"workspace": ctx.ptr("ffn.dense_workspace"),
               "counters": ctx.ptr("ffn.dense_counters")}
    p13 = {"x": ctx.ptr("xn"), "weight": ctx.ptr(base + "w13.weight"),
           "scales": ctx.ptr(base + "w13.scale"), "out": ctx.ptr("ffn.shared_h13"), **scratch}
    p_act = {"h13": ctx.ptr("ffn.shared_h13"), "out": ctx.ptr("ffn.shared_h")}
    p2 = {"x": ctx.ptr("ffn.shared_h"), "weight": ctx.ptr(base + "w2.weight"),
          "scales": ctx.ptr(base + "w2.scale"), "out": ctx.ptr("ffn.shared_out"), **scratch}
    p_add = {"a": ctx.ptr("ffn.moe.y"), "b": ctx.ptr("ffn.shared_out"),
             "out": ctx.ptr("ffn.partial")}

    def build_w13(rows):
        return [dl.dense_launch(ctx.bundle, w13[dl.row_tiles_for(rows)], p13, rows)]

    on_side = plan.SHARED_ON_SIDE

    def build_rest(rows):
        tiles = dl.row_tiles_for(rows)
        return [swiglu_launch(ctx.bundle, act, p_act, rows),
                dl.dense_launch(ctx.bundle, w2[tiles], p2, rows),
                *([] if on_side else residual_add_launches(ctx.bundle, add, p_add, rows))]
    return build_w13, build_rest


BUILDERS = {"ffn.router": _router, "ffn.moe_routed": _moe_routed,
            "ffn.moe_combine": _moe_combine, "ffn.shared_w13": _shared_w13,
            "ffn.shared_expert": _shared_expert}
