"""Routed-expert MoE kernels (W4A8, one TP rank): specs, weight repack, routing lists, exact reference.

Four kernels chained with PDL (`kernels/moe.py`), all on device data, no host routing work:

  moe_prep     topk_ids [R, k] i32, x [R, D] bf16 -> meta (distinct experts, their pair lists),
               pairs [R*k] i32 (pair = row*k + slot, grouped by expert, rows ascending),
               xq [R, D] e4m3 (fragment order) + xs [R, D/128] f32: x quantized once per row.
  moe_w13      per (distinct expert j, 16-row tile of [gate; up]): FP8 mma.sync over K = D split
               across the CTA's warps, per-128-group fp32 partials x activation scale, fixed-order
               cross-warp sum, x 2^(lo-122), bf16, clamped SwiGLU, bf16 -> h [R*k, I] bf16.
  moe_w2       per (j, 128 rows of w2): h of the expert's pairs re-quantized per 128 along I (the
               64-wide tail of I = 576 is its own group), mma over K = I -> ye [R*k, D] bf16.
  moe_combine  y [R, D] f32 = sum over slots, in slot order, of w[r, s] * ye[r*k + s] (fp32 mul
               then add, as moe_ref): the rank's routed partial, fp32 for the all-reduce epilogue.
               moe_combine_<tag>_shared (round 8, the step's): the same y plus the shared expert's
               bf16 output, rounded once -> bf16 [R, D] (`combine_shared_reference`).

Weight layout (load-time repack of the fused-E8M0 MXFP4 weights; the only copy). A sublayer
[N, K] of one expert is cut in tiles of 16 rows x 64 K ("columns"); each column is 32 lanes x 16
bytes, exactly the A fragments of two m16n8k32 k-steps for lane (g = lane/4, t = lane%4): word
2s+h (s = k-step, h = 0 for row g, 1 for row g+8) holds 8 E2M1 codes: the magnitudes (3 bits) of
the lo register (k = 32s+4t+i) in nibble i, of the hi register (k = 32s+16+4t+i) in nibble 4+i,
the lo signs at bits 8i+7 and the hi signs at bits 8i+3. The kernel expands a word with
    sel = w & 0x77777777
    lo  = prmt(L0, L1, sel)       | (w & 0x80808080)
    hi  = prmt(L0, L1, sel >> 16) | ((w << 4) & 0x80808080)
where L0/L1 = the 8-byte table [0, o8, o8+8, o8+12, o8+16, o8+20, o8+24, o8+28] and o8 =
offset << 3: the E4M3 byte of fp4(c) * 2^(offset-6), exactly Humming's fused expansion.
Offsets: per tile and 128-K group, 8 lanes-groups x 8 bytes (o8 of rows g, g+8 for the group's
4 k-steps: byte 2*s4 + h). w13 tiles interleave gate and up: tile i = gate rows 8i..8i+7 then up
rows 8i..8i+7, so the thread holding gate(n) also holds up(n) and SwiGLU stays in registers.
K is zero-padded to a multiple of 64; padded offsets are 1. Per expert fp32 scale 2^(lo-122)
(= 2^6 * weight_scale_2). Bytes equal the checkpoint's except w2's tail-group offsets (+0.7%).
`MoeShape` and the layout constants live in `kernels/moe_shape_ref.py`, the repack and its exact
decode in `kernels/moe_pack_ref.py` (both imported here).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from kernels.common_ref import BF16, H200_NUM_SMS, ceil_div, check_rows, params_dict
from kernels.moe_pack_ref import (  # noqa: F401 (re-exported: callers use mk.<name>)
    E4M3,
    PackedExperts,
    PackedSublayer,
    _w13_row_order,
    decode_e4m3,
    effective_weights,
    expert_shards,
    pack_experts,
    pack_sublayer,
    reference_e4m3,
    unpacked_e4m3,
)
from kernels.moe_ref import RouterOutput, routed_experts
from kernels.moe_shape_ref import (
    ACT_GROUP,
    BITMAP_WORDS,
    CHUNK_TOKENS,
    COL_BYTES,
    COL_K,
    GROUP_OFFSET_BYTES,
    KSTEP,
    LANES,
    LUT_HI_BASE,  # noqa: F401 (re-exported)
    LUT_LO_BASE,  # noqa: F401 (re-exported)
    MAX_ROWS,
    META_HEADER,
    TILE_ROWS,  # noqa: F401 (re-exported)
    MoeShape,
    round_up,
)
from loader.formats import quantize_act_fp8

# The packed layout's source (this file, the repack and the shape constants), in every spec.
_SOURCE_SHA = hashlib.sha256(b"".join(
    Path(__file__).with_name(name).read_bytes()
    for name in ("moe_kernel_ref.py", "moe_pack_ref.py", "moe_shape_ref.py"))).hexdigest()


def moe_shape(cfg, tp: int, dspark: bool = False) -> MoeShape:
    """The routed MoE of the backbone layers, or (dspark=True) of the DSpark stages (their own
    expert count, top-k and intermediate: the dspark_* config keys)."""
    if dspark:
        return MoeShape(cfg.dspark_n_routed_experts, cfg.dspark_num_experts_per_tok,
                        cfg.hidden_size, cfg.dspark_moe_intermediate_size // tp,
                        float(cfg.swiglu_limit))
    return MoeShape(cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                    cfg.moe_intermediate_size // tp, float(cfg.swiglu_limit))


def moe_shapes(cfg, tp: int) -> list[MoeShape]:
    """Every distinct routed-MoE shape of the model: the backbone's, then the DSpark stages'
    when the config has stages that differ."""
    shapes = [moe_shape(cfg, tp)]
    if any(spec.is_dspark for spec in cfg.layers) and moe_shape(cfg, tp, True) != shapes[0]:
        shapes.append(moe_shape(cfg, tp, True))
    return shapes


# ---- kernel specs -------------------------------------------------------------------------------

PARAMS = {
    "prep": (("topk_ids", "u64"), ("x", "u64"), ("meta", "u64"), ("pairs", "u64"), ("xq", "u64"),
             ("xs", "u64"), ("rows", "u32")),
    "w13": (("meta", "u64"), ("pairs", "u64"), ("xq", "u64"), ("xs", "u64"), ("codes", "u64"),
            ("offsets", "u64"), ("scales", "u64"), ("h", "u64"), ("rows", "u32")),
    "w2": (("meta", "u64"), ("pairs", "u64"), ("h", "u64"), ("codes", "u64"), ("offsets", "u64"),
           ("scales", "u64"), ("ye", "u64"), ("rows", "u32")),
    "combine": (("route_weights", "u64"), ("ye", "u64"), ("y", "u64"), ("rows", "u32")),
    # Round 8: the combine that adds the shared expert's bf16 output and rounds, so the shared
    # expert's w2 can run beside the routed chain (`combine_shared_reference`).
    "combine_shared": (("route_weights", "u64"), ("ye", "u64"), ("shared", "u64"),
                       ("out", "u64"), ("rows", "u32")),
    # The self-routed chain (kernels/moe_selfroute.py): x quantized alone, w13 / w2 rebuild the
    # routing lists from the ids in shared memory.
    "xquant": (("x", "u64"), ("xq", "u64"), ("xs", "u64"), ("rows", "u32")),
    "w13sr": (("topk_ids", "u64"), ("xq", "u64"), ("xs", "u64"), ("codes", "u64"),
              ("offsets", "u64"), ("scales", "u64"), ("h", "u64"), ("rows", "u32")),
    "w2sr": (("topk_ids", "u64"), ("h", "u64"), ("codes", "u64"), ("offsets", "u64"),
             ("scales", "u64"), ("ye", "u64"), ("rows", "u32")),
}
# moe_w13w (kernels/moe_pipelined.py): w13 after moe_prep that routes itself in registers (one
# warp, <= 64 pairs) to issue its weights before griddepcontrol.wait; w13sr's ABI.
PARAMS["w13w"] = PARAMS["w13sr"]
WARP_ROUTED_MAX_PAIRS = 64
# "early": the next item's weights refilled mid-math; "bulk": per-warp bulk copies on mbarriers
# (kernels/moe_bulk.py), "bulk1" the same with one copy pair per warp slice (no part split),
# "bulkw" with 2-group parts kept BULK_WINDOW parts ahead of the math (not all at once).
# Round 4's plain w13w ("") brought nothing measurable: deleted in round 5.
# "bulkw_lean4" (round 6): "bulkw" at 4 CTAs/SM and 128 registers (B fragments LEAN_B_WINDOW
# groups ahead): 528 CTAs, one item each at R = 1, where 396 leave 36 CTAs with two. Round 6's
# "_co" (2 CTAs/SM) and "bulkw_lean" (3 CTAs/SM) measured slower and were deleted in round 7.
W13W_VARIANTS = ("early", "bulk", "bulk1", "bulkw", "bulkw_lean4")
LEAN_B_WINDOW = 4
LEAN_LAUNCH_BOUND = 4       # CTAs per SM as the launch bound: 64 K / (4 x 128) = 128 registers
# (grid CTAs per SM, launch-bound CTAs per SM or 0) of the w13w variants that differ from w13's
W13W_OCCUPANCY = {"bulkw_lean4": (4, LEAN_LAUNCH_BOUND)}
PREP_THREADS = 256
W2_WARPS = 8
COMBINE_THREADS = 256
COMBINE_VEC = 4
XQUANT_THREADS = 256


def w13_split(shape: MoeShape) -> int:
    """Warps per w13 CTA (split-K): the largest of 8, 4, 2, 1 giving whole 128-groups per warp."""
    cols = shape.k13 // COL_K
    for warps in (8, 4, 2, 1):
        if cols % (2 * warps) == 0:
            return warps
    raise ValueError(f"w13 K {shape.k13} has no whole-group split")


@dataclass(frozen=True)
class MoeSpec:
    """One compiled kernel of the MoE chain; `kind` is prep | w13 | w2 | combine, or one of the
    self-routed chain's xquant | w13sr | w2sr."""

    name: str
    kind: str
    shape: MoeShape
    block: tuple[int, int, int]
    smem_bytes: int = 0
    ctas_per_sm: int = 2
    stages: int = 0          # w13 / w2: depth of the per-thread cp.async weight ring
    variant: str = ""        # "" = the chain's default; else a candidate benchmarked beside it
    # w13 / w2: one cp.async commit group per 128-group of an item, awaited group by group, so
    # the math starts on the first group while the rest is in flight (kernels/moe_pipelined.py).
    group_commits: bool = False
    # Diagnostic build (kernels/moe_timeline.py): one more pointer, `stamps`, before rows; thread
    # 0 of each CTA writes TIMELINE_EVENTS there. Never launched by the step.
    timeline: bool = False
    # The launch bound's CTAs per SM where it differs from the grid's (0: ctas_per_sm).
    launch_bound_ctas: int = 0

    @property
    def launch_bound(self) -> int:
        """CTAs per SM the compiler must fit (registers): launch_bound_ctas or ctas_per_sm."""
        return self.launch_bound_ctas or self.ctas_per_sm

    @property
    def queued(self) -> bool:
        """A work-queue variant (kernels/moe_queue.py): one more pointer, `sched`, before rows
        (before `stamps` in a timeline build)."""
        return (self.kind, self.variant) in QUEUED_VARIANTS

    @property
    def params(self) -> tuple[tuple[str, str], ...]:
        extra = ((("sched", "u64"),) if self.queued else ()) + (
            (("stamps", "u64"),) if self.timeline else ())
        return (*PARAMS[self.kind][:-1], *extra, PARAMS[self.kind][-1])

    def work_items(self, rows: int) -> int:
        """Upper bound of the CTAs with work (distinct experts <= min(rows * k, E))."""
        s = self.shape
        distinct = min(rows * s.topk, s.num_experts)
        if self.kind == "prep":
            return 1 + ceil_div(rows * s.groups(s.k13), PREP_THREADS // LANES)
        if self.kind == "xquant":
            return ceil_div(rows * s.groups(s.k13), XQUANT_THREADS // LANES)
        if self.kind in ("w13", "w13sr", "w13w"):
            return distinct * s.tiles13
        if self.kind in ("w2", "w2sr"):
            return distinct * ceil_div(s.tiles2, W2_WARPS)
        return ceil_div(rows * s.hidden, COMBINE_THREADS * COMBINE_VEC)   # either combine

    def grid(self, rows: int) -> tuple[int, int, int]:
        check_rows(rows, self.name)
        if rows > MAX_ROWS:
            raise ValueError(f"{self.name}: rows={rows} exceeds the MoE's {MAX_ROWS}")
        if self.kind == "w13w" and rows * self.shape.topk > WARP_ROUTED_MAX_PAIRS:
            raise ValueError(f"{self.name}: rows={rows} gives more than {WARP_ROUTED_MAX_PAIRS} "
                             "(row, slot) pairs, which one warp routes")
        cap = H200_NUM_SMS * self.ctas_per_sm
        if self.kind in ("combine", "combine_shared"):
            cap = self.work_items(MAX_ROWS)
        return (max(1, min(self.work_items(rows), cap)), 1, 1)

    def to_dict(self) -> dict:
        s = self.shape
        return {"family": "moe", "name": self.name, "kind": self.kind,
                "num_experts": s.num_experts, "topk": s.topk, "hidden": s.hidden,
                "inter": s.inter, "swiglu_limit": s.swiglu_limit,
                "params": params_dict(self.params), "block": list(self.block),
                "smem_bytes": self.smem_bytes, "ctas_per_sm": self.ctas_per_sm,
                "stages": self.stages, "variant": self.variant,
                "group_commits": self.group_commits,
                "layout_source_sha256": _SOURCE_SHA} | ({"timeline": True} if self.timeline
                                                        else {}) | (
            {"queued": True} if self.queued else {}) | (
            {"launch_bound_ctas": self.launch_bound_ctas} if self.launch_bound_ctas else {})


# ---- per-CTA timeline (diagnostic builds: kernels/moe_timeline.py, executor/moe_timeline.py) ----
# A CTA's record: [smid u32, 12 B pad] then per event (%globaltimer ns u64, %clock64 u64), written
# by thread 0. first/last_landed: warp 0's first weight stage of the CTA's first item / last stage
# of its last item; epilogue: the start of the last chunk's epilogue (w13: cross-warp sum, SwiGLU,
# h store; w2: its mma + ye store, which are one loop).
TIMELINE_EVENTS = ("entry", "wait_begin", "wait_end", "first_landed", "last_landed", "epilogue",
                   "exit")
TIMELINE_RECORD_BYTES = 16 * (1 + len(TIMELINE_EVENTS))
# The bulk chain's w13 / w2 below 3 rows and the step's self-routed w13 / w2 from 3 rows: the
# static pair and the work-queue pair (round 9).
TIMELINE_KERNELS = (("w13w", "bulkw"), ("w2", "bulk"), ("w13sr", "bulk"), ("w2sr", "early"),
                    ("w13sr", "bulkq"), ("w2sr", "earlyq"))


def timeline_event(name: str) -> int:
    return TIMELINE_EVENTS.index(name)


def timeline_specs(shape: MoeShape) -> list[MoeSpec]:
    """The TIMELINE_KERNELS of this shape as timeline builds (name + "_tl")."""
    every = {(s.kind, s.variant): s for s in variant_specs(shape) + warp_routed_specs(shape)
             + selfrouted_specs(shape)}
    return [replace(every[key], name=every[key].name + "_tl", timeline=True)
            for key in TIMELINE_KERNELS if key in every]


def w2_smem_bytes(shape: MoeShape) -> int:
    """Quantized h of one token chunk (fragment order) + its group scales + the pair ids."""
    return CHUNK_TOKENS * shape.k2 + CHUNK_TOKENS * shape.groups(shape.k2) * 4 + CHUNK_TOKENS * 4


def prep_smem_bytes(shape: MoeShape) -> int:
    """Row bitmap per expert + per-warp scan totals + the bad-id count + the ids themselves."""
    return (shape.num_experts * BITMAP_WORDS * 4 + (PREP_THREADS // LANES) * 4 + 16
            + MAX_ROWS * shape.topk * 4)


def ring_stage_bytes(shape: MoeShape, kind: str) -> int:
    """One work item's weights in a CTA's cp.async ring: every lane's 16-byte code words (one per
    64-K column) and 8-byte offset words (one per 128-group; lanes of one row pair copy the same
    8 bytes, so each lane reads back only what it copied). w13 (one 16-row tile, K split over
    the warps) is then 640 B per column whatever the split."""
    if kind == "w13":
        cols = shape.k13 // COL_K
        return cols * COL_BYTES + (cols // 2) * LANES * 8
    cols = shape.k2 // COL_K
    return W2_WARPS * (cols * COL_BYTES + shape.groups(shape.k2) * LANES * 8)


# (variant, warps wanted (w13), ring stages, CTAs per SM, group commits): the default first,
# then candidates. Measured (docs/notes/moe-design.md, round 2): each item's serial chain (meta ->
# pair ids -> activations, L2 round trips under load) dominates, so more CTAs per SM with a
# one-item ring beat deeper rings: w13 = 4 warps, 1 stage, 3 CTAs/SM; w2 = 1 stage, 4 CTAs/SM.
# At R = 1 the w2 "r2x2" (2 stages, 2 CTAs/SM) is faster (fewer, fuller CTAs for 240 items).
# Round 4: "g*" = the same kernels with per-group commit groups (math overlaps the item's load);
# w2 "g" / "gr2x2" are the round-4 step's at R <= 2; w13 "g" brought nothing (deleted, round 5).
W13_VARIANTS = (("", 4, 1, 3, False),)
W2_VARIANTS = (("", 1, 4, False), ("r2x2", 2, 2, False), ("g", 1, 4, True),
               ("gr2x2", 2, 2, True))
W2_SINGLE_ROW_VARIANT = "r2x2"


def group_wait_pending(stages: int, groups: int, group: int) -> int:
    """cp.async.wait_group count before `group` of the current item when every item is committed
    as `groups` commit groups and `stages - 1` items were issued after it (group commits)."""
    if not 0 <= group < groups or stages < 1:
        raise ValueError(f"group {group} of {groups}, stages {stages}")
    return (stages - 1) * groups + groups - 1 - group


def _w13_spec(shape: MoeShape, variant: str, warps: int, stages: int, ctas: int,
              group_commits: bool = False) -> MoeSpec:
    split = min(warps, w13_split(shape))
    suffix = f"_{variant}" if variant else ""
    return MoeSpec(f"moe_w13_{shape.tag()}{suffix}", "w13", shape, (split * LANES, 1, 1),
                   smem_bytes=stages * ring_stage_bytes(shape, "w13") + split * LANES * 16,
                   ctas_per_sm=ctas, stages=stages, variant=variant, group_commits=group_commits)


def _w2_spec(shape: MoeShape, variant: str, stages: int, ctas: int,
             group_commits: bool = False) -> MoeSpec:
    suffix = f"_{variant}" if variant else ""
    return MoeSpec(f"moe_w2_{shape.tag()}{suffix}", "w2", shape, (W2_WARPS * LANES, 1, 1),
                   smem_bytes=stages * ring_stage_bytes(shape, "w2") + w2_smem_bytes(shape),
                   ctas_per_sm=ctas, stages=stages, variant=variant, group_commits=group_commits)


def make_specs(shape: MoeShape) -> list[MoeSpec]:
    """The default chain: prep, w13, w2, combine."""
    tag = shape.tag()
    return [
        MoeSpec(f"moe_prep_{tag}", "prep", shape, (PREP_THREADS, 1, 1),
                smem_bytes=prep_smem_bytes(shape), ctas_per_sm=2),
        _w13_spec(shape, *W13_VARIANTS[0]),
        _w2_spec(shape, *W2_VARIANTS[0]),
        MoeSpec(f"moe_combine_{tag}", "combine", shape, (COMBINE_THREADS, 1, 1)),
    ]


def combine_shared_spec(shape: MoeShape) -> MoeSpec:
    """moe_combine_<tag>_shared: the combine's threads and work split, plus the shared expert's
    bf16 output added before one bf16 rounding (`combine_shared_reference`)."""
    return MoeSpec(f"moe_combine_{shape.tag()}_shared", "combine_shared", shape,
                   (COMBINE_THREADS, 1, 1))


def combine_shared_reference(route_weights: np.ndarray, ye: np.ndarray,
                             shared: np.ndarray) -> np.ndarray:
    """What moe_combine_<tag>_shared writes, bit for bit: bf16 [R, D] =
    bf16_rn(y + f32(shared)), y = the plain combine's fp32 sum over slots in slot order of
    w * ye (mul.rn then add.rn per slot, moe_ref.combine), shared bf16 [R, D], one fp32 add.rn.

    This equals the round-7 step's ffn.partial bit for bit: the shared w2's "add_f32" epilogue
    wrote bf16_rn(f32(bf16_rn(t)) + y) (kernels/dense.py / dense_stream.py: st_bf16(round_bf16(t)
    + routed), one add.rn; dense_ref.dense_ref the same), and its "bf16" epilogue writes
    bf16_rn(t) of the same fp32 total t (a spec's split and order do not depend on its epilogue:
    dense_ref.make_spec), which is `shared` here; fp32 addition commutes. moe_ref.moe_partial's
    round_bf16(routed + shared_expert(...)) is the same formula."""
    from kernels.moe_ref import combine
    rows, topk = route_weights.shape
    y = combine(np.asarray(route_weights, np.float32),
                np.asarray(ye).astype(np.float32).reshape(rows * topk, -1))
    total = (y + np.asarray(shared).astype(np.float32)).astype(np.float32)
    return total.astype(BF16)                       # ml_dtypes: round to nearest even


def warp_routed_specs(shape: MoeShape) -> list[MoeSpec]:
    """moe_w13w: the default w13's block, one-item ring and 3 CTAs/SM, with group commits
    (kernels/moe_pipelined.py) and routing itself, for the default chain at rows * topk <=
    WARP_ROUTED_MAX_PAIRS; W13W_VARIANTS."""
    if shape.num_experts > LANES * 32:
        return []                                   # the expert bitmap is one word per lane
    base = _w13_spec(shape, *W13_VARIANTS[0])
    warps = base.block[0] // LANES
    return [MoeSpec(f"moe_w13w_{shape.tag()}" + (f"_{v}" if v else ""), "w13w", shape,
                    base.block, stages=1, variant=v,
                    ctas_per_sm=W13W_OCCUPANCY.get(v, (base.ctas_per_sm, 0))[0],
                    launch_bound_ctas=W13W_OCCUPANCY.get(v, (base.ctas_per_sm, 0))[1],
                    group_commits=True,
                    smem_bytes=(bulk_smem_bytes(shape, warps, v) if v.startswith("bulk")
                                else base.smem_bytes))
            for v in W13W_VARIANTS]


def is_lean(variant: str) -> bool:
    """B fragments loaded LEAN_B_WINDOW groups ahead (kernels/moe_bulk.py MoeW13BulkLeanSm90)."""
    return "_lean" in variant


def bulk_scheme(variant: str) -> str:
    """The copy scheme of a bulk variant ("bulkw_lean4" copies as "bulkw", "bulkq" as "bulk")."""
    return QUEUE_BASE.get(variant, variant).split("_")[0]


def bulk_parts(shape: MoeShape, warps: int, variant: str = "bulk") -> int:
    """Bulk-copy pairs (codes + offsets, one mbarrier each) per warp slice of a w13 item: two
    halves where the slice has an even number of 128-groups (v41: 2 x 5 KB), else one; one
    for "bulk1"; parts of two groups for "bulkw" (v41: 5 x 2 KB)."""
    variant = bulk_scheme(variant)
    groups = shape.k13 // COL_K // warps // 2
    if variant == "bulkw":
        return groups // 2 if groups % 2 == 0 else groups
    return 2 if variant == "bulk" and groups % 2 == 0 else 1


BULK_WINDOW = 2       # "bulkw": parts of a warp in flight ahead of the one its math is on


def bulk_window(shape: MoeShape, warps: int, variant: str = "bulk") -> int:
    """Parts issued ahead of the math: all of an item (bulk, bulk1), or BULK_WINDOW (bulkw)."""
    parts = bulk_parts(shape, warps, variant)
    return min(BULK_WINDOW, parts) if bulk_scheme(variant) == "bulkw" else parts


def bulk_warp_bytes(shape: MoeShape, warps: int) -> int:
    """One warp's K slice of a w13 item as moe_w13w "bulk" stores it: codes, then offsets."""
    cols = shape.k13 // COL_K // warps
    return cols * COL_BYTES + (cols // 2) * GROUP_OFFSET_BYTES


def bulk_smem_bytes(shape: MoeShape, warps: int, variant: str = "bulk") -> int:
    """The one-item stage, the cross-warp reduction (16 B a thread), an mbarrier per part."""
    return (warps * bulk_warp_bytes(shape, warps) + warps * LANES * 16
            + warps * bulk_parts(shape, warps, variant) * 8)


def bulk_bars_bytes(shape: MoeShape, warps: int, variant: str = "bulk") -> int:
    """moe_w13sr "bulk": its mbarriers (one per warp and part), padded to 16 bytes."""
    return round_up(warps * bulk_parts(shape, warps, variant) * 8, 16)


def bulk_sr_ring_region(shape: MoeShape, warps: int) -> int:
    """moe_w13sr "bulk": the stage, which first holds the routing scratch."""
    return round_up(max(warps * bulk_warp_bytes(shape, warps), routing_scratch_bytes(shape)), 16)


def bulk_w2_stage_bytes(shape: MoeShape) -> int:
    """moe_w2 "bulk": the 8 warps' tiles (codes, then offsets: the packed layout) + a barrier
    per warp."""
    cols = shape.k2 // COL_K
    return W2_WARPS * (cols * COL_BYTES + shape.groups(shape.k2) * GROUP_OFFSET_BYTES + 8)


W2_BULK_STAGES, W2_BULK_CTAS = 2, 2     # the next item in flight behind the math, 2 CTAs/SM
# "bulkp": per-item scalars read ahead; "bulkpd" (round 7): "bulkp" with its first item's
# decode before griddepcontrol.wait (kernels/moe_predecode.py)
W2_BULK_VARIANTS = ("bulk", "bulkp", "bulkpd")


def variant_specs(shape: MoeShape) -> list[MoeSpec]:
    """Candidate w13 / w2 kernels (other ring depths and occupancies, bulk copies), built beside
    the default."""
    # "bulkp": the same with the per-item scalars read one item ahead (kernels/moe_bulk.py)
    bulk = [MoeSpec(f"moe_w2_{shape.tag()}_{v}", "w2", shape, (W2_WARPS * LANES, 1, 1),
                    smem_bytes=W2_BULK_STAGES * bulk_w2_stage_bytes(shape) + w2_smem_bytes(shape),
                    ctas_per_sm=W2_BULK_CTAS, stages=W2_BULK_STAGES, variant=v)
            for v in W2_BULK_VARIANTS]
    return ([_w13_spec(shape, *v) for v in W13_VARIANTS[1:]]
            + [_w2_spec(shape, *v) for v in W2_VARIANTS[1:]] + bulk)


# The self-routed chain: moe_xquant -> moe_w13sr -> moe_w2sr -> moe_combine (no moe_prep). Each
# w13sr / w2sr CTA rebuilds the routing lists from the ids in shared memory before its
# griddepcontrol.wait and fills its whole ring then. Same work split as the defaults (w13: 4 warps,
# w2: 8 warps); the lists cost 9 KB more per CTA, so w2 fits 3 CTAs per SM, not 4.
# "early": the stage refilled mid-math; "bulk": moe_w13w "bulk"'s copies (kernels/moe_bulk.py)
W13SR_VARIANTS = (("", 4, 1, 3), ("early", 4, 1, 3), ("bulk", 4, 1, 3), ("bulkw", 4, 1, 3),
                  ("bulkq", 4, 1, 3))
W2SR_VARIANTS = (("", 1, 3), ("r2x2", 2, 2), ("early", 1, 3), ("earlyq", 1, 3))
W2SR_SINGLE_ROW_VARIANT = "r2x2"
# Round 9 (kernels/moe_queue.py): w13sr "bulkq" / w2sr "earlyq" are "bulk" / "early" (same block,
# shared memory, occupancy, grid, items and per-item math: h / ye bitwise) whose CTAs claim every
# item after their first from a counter in `sched` instead of striding by the grid. sched: u32
# [SCHED_WORDS] = w13 (claim, done), w2 (claim, done), zero before the first launch; each queued
# launch leaves its two words zero again (its last CTA resets them).
QUEUED_VARIANTS = {("w13sr", "bulkq"): "bulk", ("w2sr", "earlyq"): "early"}
QUEUE_BASE = {v: base for (_, v), base in QUEUED_VARIANTS.items()}
SCHED_WORDS = 4
SCHED_AT = {"w13sr": 0, "w2sr": 2}         # first word (claim; done follows) of each kind
# Shared-memory words of the item hand-off: bytes 36..43 of the routing lists' header (free:
# the scan totals end at byte 32, the distinct count is byte 32..35).
QUEUE_SLOTS_AT = 36


def routing_scratch_bytes(shape: MoeShape) -> int:
    """Row bitmap per expert + the ids: dead once the lists are built (the ring reuses them)."""
    return shape.num_experts * BITMAP_WORDS * 4 + MAX_ROWS * shape.topk * 4


ROUTING_HEADER = 48     # per-warp scan totals (<= 8 words), the distinct count at byte 32


def routing_lists_bytes(shape: MoeShape) -> int:
    """Header + experts, first pair, pair count [E] + the pairs (+ one chunk of slack: the
    predicated reads of a chunk's absent tokens stay inside the array)."""
    return (ROUTING_HEADER + 3 * 4 * shape.num_experts
            + 4 * (MAX_ROWS * shape.topk + CHUNK_TOKENS))


def ring_region_bytes(shape: MoeShape, kind: str, stages: int) -> int:
    """A self-routed kernel's ring, which first holds the routing scratch."""
    return max(stages * ring_stage_bytes(shape, kind), routing_scratch_bytes(shape))


def selfrouted_specs(shape: MoeShape) -> list[MoeSpec]:
    """The self-routed chain's kernels: xquant, the w13sr variants, the w2sr variants."""
    tag = shape.tag()
    out = [MoeSpec(f"moe_xquant_{tag}", "xquant", shape, (XQUANT_THREADS, 1, 1), ctas_per_sm=8)]
    for variant, warps, stages, ctas in W13SR_VARIANTS:
        split = min(warps, w13_split(shape))
        suffix = f"_{variant}" if variant else ""
        ring = (bulk_sr_ring_region(shape, split) + bulk_bars_bytes(shape, split, variant)
                if variant.startswith("bulk") else ring_region_bytes(shape, "w13", stages))
        smem = ring + split * LANES * 16 + routing_lists_bytes(shape)
        out.append(MoeSpec(f"moe_w13sr_{tag}{suffix}", "w13sr", shape, (split * LANES, 1, 1),
                           smem_bytes=smem, ctas_per_sm=ctas, stages=stages, variant=variant))
    for variant, stages, ctas in W2SR_VARIANTS:
        suffix = f"_{variant}" if variant else ""
        smem = (ring_region_bytes(shape, "w2", stages) + w2_smem_bytes(shape)
                + routing_lists_bytes(shape))
        out.append(MoeSpec(f"moe_w2sr_{tag}{suffix}", "w2sr", shape, (W2_WARPS * LANES, 1, 1),
                           smem_bytes=smem, ctas_per_sm=ctas, stages=stages, variant=variant))
    return out


# ---- routing lists and activations (what moe_prep writes) ---------------------------------------

@dataclass(frozen=True)
class RoutingLists:
    """distinct experts ascending; per entry: first pair, pair count; pairs = row*k + slot."""

    experts: np.ndarray
    offsets: np.ndarray
    counts: np.ndarray
    pairs: np.ndarray

    def meta(self, num_experts: int) -> np.ndarray:
        """The int32 meta buffer: [D, bad ids, 0, 0, experts[E], offsets[E], counts[E]]."""
        m = np.zeros(META_HEADER + 3 * num_experts, np.int32)
        d = len(self.experts)
        m[0] = d
        m[META_HEADER:META_HEADER + d] = self.experts
        m[META_HEADER + num_experts:META_HEADER + num_experts + d] = self.offsets
        m[META_HEADER + 2 * num_experts:META_HEADER + 2 * num_experts + d] = self.counts
        return m


def meta_words(num_experts: int) -> int:
    return META_HEADER + 3 * num_experts


def check_topk_ids(topk_ids: np.ndarray, num_experts: int) -> np.ndarray:
    ids = np.asarray(topk_ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"topk_ids must be an integer [R, k] array, got {ids.dtype} {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
        raise ValueError(f"topk_ids must be in [0, {num_experts}), got [{ids.min()}, {ids.max()}]")
    for r, row in enumerate(ids):
        if len(set(row.tolist())) != len(row):
            raise ValueError(f"topk_ids row {r} repeats an expert: {row.tolist()}")
    return ids.astype(np.int32)


def routing_lists(topk_ids: np.ndarray, num_experts: int) -> RoutingLists:
    ids = check_topk_ids(topk_ids, num_experts)
    topk = ids.shape[1]
    experts, offsets, counts, pairs = [], [], [], []
    for e in range(num_experts):
        r, s = np.nonzero(ids == e)            # row-major: rows ascending
        if len(r):
            experts.append(e)
            offsets.append(len(pairs))
            counts.append(len(r))
            pairs.extend((r * topk + s).tolist())
    as32 = lambda v: np.asarray(v, np.int32)
    return RoutingLists(as32(experts), as32(offsets), as32(counts), as32(pairs))


def fragment_order(k: int) -> np.ndarray:
    """Source column of each byte of the fragment-ordered activation (per 32: lane t's b0, b1)."""
    pos = np.arange(k)
    step, within = pos // KSTEP, pos % KSTEP
    t, half, i = within // 8, (within % 8) // 4, within % 4
    return step * KSTEP + half * 16 + 4 * t + i


def quantize_fragments(a: np.ndarray, k_pad: int) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 [M, k_pad] E4M3 in fragment order, f32 [M, k_pad/128 groups]) of a [M, K]."""
    q, s = quantize_act_fp8(a)
    qb = np.zeros((a.shape[0], k_pad), np.uint8)
    qb[:, :a.shape[1]] = q.view(np.uint8)
    scales = np.zeros((a.shape[0], ceil_div(k_pad, ACT_GROUP)), np.float32)
    scales[:, :s.shape[1]] = s
    return qb[:, fragment_order(k_pad)], scales


# ---- the exact reference of the chain -----------------------------------------------------------

def routed_reference(x: np.ndarray, topk_ids: np.ndarray, route_weights: np.ndarray,
                     packed: PackedExperts, shape: MoeShape) -> np.ndarray:
    """fp32 [R, D]: moe_ref.routed_experts on the weights decoded from the packed bytes."""
    ids = check_topk_ids(topk_ids, shape.num_experts)
    routing = RouterOutput(ids.astype(np.int64), np.asarray(route_weights, np.float32))
    return routed_experts(np.asarray(x, np.float32), routing, expert_shards(packed, shape),
                          shape.swiglu_limit)


def moe_bytes(shape: MoeShape, distinct: int, rows: int) -> int:
    """Bytes that must move: checkpoint bytes of the distinct experts + x (bf16) + y (fp32)."""
    return distinct * shape.checkpoint_expert_bytes() + rows * shape.hidden * (2 + 4)


def check_spec_rows(spec: MoeSpec, rows: int) -> int:
    check_rows(rows, spec.name)
    if rows > MAX_ROWS:
        raise ValueError(f"{spec.name}: rows={rows} exceeds {MAX_ROWS}")
    return rows


def check_routed_close(y: np.ndarray, y_ref: np.ndarray, what: str = "y") -> None:
    """The kernel's y against the exact-layout reference, every element.

    Tolerance, per element: 2^-7 |ref| + 2^-5 rms(ref row); and 2^-7 relative Frobenius overall.
    Why: the kernel adds each 128-group's products in the tensor core's order (and w13's K
    slices in warp order), not NumPy's: h13 and ye then land 1 bf16 ulp (2^-8 relative) away
    near rounding ties, and a moved h element can flip its E4M3 rounding on re-quantization
    (one step = 2^-3 relative to that element), so y moves by a few random-sign terms of
    2^-4 |h_k W2[n,k]|: well under 2^-5 of the row's rms for I >= 96 (tests/test_moe_kernel_cpu
    checks that a reference with float64 accumulation stays inside this, and a wrong expert not).
    """
    y = np.asarray(y, np.float32)
    if y.shape != y_ref.shape:
        raise AssertionError(f"{what}: shape {y.shape}, expected {y_ref.shape}")
    bad = ~np.isfinite(y)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(f"{what}: non-finite {y[idx]} at {idx} (NaN poison not overwritten?)")
    rms = np.sqrt(np.mean(np.square(y_ref.astype(np.float64)), axis=1, keepdims=True))
    limit = 2.0**-7 * np.abs(y_ref) + 2.0**-5 * rms
    err = np.abs(y.astype(np.float64) - y_ref)
    over = err > limit
    if over.any():
        idx = tuple(int(i) for i in np.argwhere(over)[0])
        raise AssertionError(f"{what}: {int(over.sum())} elements out of tolerance; first at {idx}: "
                             f"{y[idx]} vs {y_ref[idx]} (limit {limit[idx]:.3g})")
    rel = np.linalg.norm(err) / max(np.linalg.norm(y_ref), 1e-30)
    if rel > 2.0**-7:
        raise AssertionError(f"{what}: relative Frobenius error {rel:.3g} > 2^-7")
