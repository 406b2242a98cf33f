"""Launches of the routed-MoE chains (kernels/moe.py, kernels/moe_selfroute.py) from device
addresses of any arena.

Pure functions: a bundle (anything with `kernel(name)` and `names()`: a loaded `Bundle`, or a
`ManifestBundle` on a CPU), the rank's `MoeShape`, a mapping of pointer keys to addresses and the
launch's rows (<= mk.MAX_ROWS = 192) give validated LaunchSpecs (PDL on). Nothing is allocated or
launched here. Buffers by pointer key (R = rows, k = top-k, D = hidden, I = this rank's
intermediate, E = experts; every activation buffer holds at least R rows):

  inputs   ids            int32 [R, k]    the router's expert ids (distinct per row, in [0, E))
           route_weights  f32   [R, k]    their combine weights
           x              bf16  [R, D]    the normed FFN input
  weights  codes13, offsets13, scales13   every expert's w13 ([gate; up] [2I, D]) as
           codes2, offsets2, scales2      mk.pack_experts lays it out: uint8 [E, per-expert
                                          bytes] codes and offsets, f32 [E] scales
  scratch  meta   int32 [4 + 3E]   routing lists (default chain only; prep writes [0], [1] and
                                   the first `distinct` words of each list)
           pairs  int32 [R*k]      (row*k + slot) grouped by expert (default chain only)
           xq     uint8 [R, D]     x as E4M3, fragment order;  xs f32 [R, D/128] its scales
           h      bf16  [R*k, I]   SwiGLU output per (row, slot) pair
           ye     bf16  [R*k, D]   expert output per pair
           sched  u32   [4]        the work-queue counters of w13sr "bulkq" / w2sr "earlyq"
                                   (kernels/moe_queue.py): zero before the first launch (the
                                   step's arena is zeroed), zero again after every queued launch
  output   y      f32   [R, D]     sum over slots of route_weights * ye: the rank's routed
                                   partial (fp32, for the all-reduce epilogue)
  or (moe_combine_<tag>_shared, `combine_launch(shared=True)`):
           shared bf16  [R, D]     the shared expert's output (input)
           out    bf16  [R, D]     bf16(y + shared): the rank's FFN partial

Chains (each kernel waits on its predecessor with griddepcontrol):
  default      prep(ids, x -> meta, pairs, xq, xs) -> w13(meta, pairs, xq, xs, w13 -> h)
               -> w2(meta, pairs, h, w2 -> ye) -> combine(route_weights, ye -> y)
  self-routed  xquant(x -> xq, xs) -> w13sr(ids, xq, xs, w13 -> h) -> w2sr(ids, h, w2 -> ye)
               -> combine (the default one)
  warp-routed  the default chain with w13w(ids, xq, xs, w13 -> h) for w13 (rows * k <= 64)
  bulk         prep -> w13w "bulk" (rows * k <= 64) or w13sr "bulk" -> w2 "bulk" -> combine
               (kernels/moe_bulk.py: weights by cp.async.bulk): the step's chain (STEP_BULK)
  queued       xquant -> w13sr "bulkq" -> w2sr "earlyq" -> combine: the self-routed chain with
               claimed items (kernels/moe_queue.py; STEP_QUEUE from 3 rows). "bulkq" claims
               before its wait, so it must never directly follow itself in a stream.
`step_launches` picks what the step runs (docs/perf.md run 17): the default chain's kernels below
SELFROUTED_FROM_ROWS (w13 / w2 variants by STEP_VARIANTS, w2 by rows), the self-routed "early"
chain from there on. `requests` / `weight_requests` give the (name, nbytes, comment) slices for `Arena` or
`HostArena`; `scratch_buffers` the step's family scratch (executor/wiring.py FAMILY_BUFFERS
form, "moe." + pointer key). `executor/moe_chain.py` builds its launches here.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from executor.launch import LaunchSpec
from executor.wiring import Buffer
from kernels import moe_kernel_ref as mk
from kernels.common_ref import BF16

DEFAULT_CHAIN = ("prep", "w13", "w2", "combine")
# Pointer keys of each kernel's pointer parameters, in ABI order (the last parameter is rows).
POINTER_KEYS = {
    "prep": ("ids", "x", "meta", "pairs", "xq", "xs"),
    "w13": ("meta", "pairs", "xq", "xs", "codes13", "offsets13", "scales13", "h"),
    "w2": ("meta", "pairs", "h", "codes2", "offsets2", "scales2", "ye"),
    "combine": ("route_weights", "ye", "y"),
    "combine_shared": ("route_weights", "ye", "shared", "out"),
    "xquant": ("x", "xq", "xs"),
    "w13sr": ("ids", "xq", "xs", "codes13", "offsets13", "scales13", "h"),
    "w2sr": ("ids", "h", "codes2", "offsets2", "scales2", "ye"),
    "w13w": ("ids", "xq", "xs", "codes13", "offsets13", "scales13", "h"),
}
# docs/perf.md run 17 (us, uniform routing): R=1 default 26.08 / self-routed early 27.14;
# R=6 84.19 / 76.29; R=8 104.6 / 94.7; R=192 729 / 689. Run 15:55 (moe-design.md Round 4): R=2
# w13w early 38.05 / self-routed early 38.50, R=4 59.42 / 56.46: self-routed early from R = 3.
SELFROUTED_FROM_ROWS = 3
SELFROUTED_EARLY = "early"
# Round 5, run r5a: from SELFROUTED_FROM_ROWS on the step's self-routed chain takes w13sr "bulk"
# (bulk copies) with w2sr "early": R = 4 / 6 / 8 / 16 / 64 / 192 57.1 / 74.1 / 98.0 / 174.2 /
# 442.2 / 664.5 us vs w13sr early's 58.0 / 76.6 / 101.8 / 182.2 / 467.8 / 686.3. Revert:
# STEP_SELFROUTED_W13 = SELFROUTED_EARLY
STEP_SELFROUTED_W13 = "bulk"
# The default chain's w13 / w2 the step launches below SELFROUTED_FROM_ROWS ("w2_one_row" at
# R = 1). Round 4: the per-group-commit kernels (kernels/moe_pipelined.py, bitwise the same y).
# "w13w": the moe_w13w variant ("" or "early") that replaces w13 where rows * topk <=
# mk.WARP_ROUTED_MAX_PAIRS (its weights go out before its wait, overlapping moe_prep); None: off.
# Revert to the round-2 kernels:
# STEP_VARIANTS = {"w13": "", "w2": "", "w2_one_row": mk.W2_SINGLE_ROW_VARIANT, "w13w": None}
# (w13 "g" and the plain w13w were deleted in round 5: they measured the same as the defaults.)
STEP_VARIANTS = {"w13": "", "w2": "g", "w2_one_row": "gr2x2", "w13w": "early"}
# Round 5 (moe-design.md): below SELFROUTED_FROM_ROWS the step runs `bulk_launches` (weights by
# cp.async.bulk on mbarriers, bitwise the same y), ahead of the selections above. Revert to
# round 4: STEP_BULK = False. STEP_BULK_W2: its w2 ("bulkp" = list reads ahead); BULK_W13W: its w13w
# ("bulk": all parts of an item at once, measured no faster than round 4 (run r5a: R = 1 25.9 us);
# "bulkw": 2 KB parts kept 2 ahead of the math, so the math overlaps the stream). If bulkw
# fails its GPU tests: BULK_W13W = "bulk".
STEP_BULK = True
# Run r6a (us): bulkp chain R = 1 24.05 vs bulk 25.04, R = 2 36.85 vs 37.07 (r6e: 24.18 / 37.10
# vs 24.88 / 36.90); the timeline put 2 us of list / scale / h round trips between w2's wait and
# its first mma at R = 1, which bulkp's read-ahead shortens. Run r7b (round 7): "bulkpd" (bulkp
# with 3 of 5 groups of its first tile decoded before griddepcontrol.wait) with w13w lean4: R = 1
# 22.26 vs 22.91 us, R = 2 35.28 vs 36.05; bitwise bulkp's in r7b's GPU tests. Revert:
# STEP_BULK_W2 = "bulkp" (or "bulk").
STEP_BULK_W2 = "bulkpd"
BULK_W13W = "bulkw"
# The bulk chain's w13w by rows where it is not BULK_W13W. Run r6e's timeline: at R = 1 w13 ends
# at 11.8 us though a CTA's life is 7.2 us median: 432 items on 396 CTAs leave 36 with two.
# "bulkw_lean4" runs 528 CTAs (one item each; 128 registers, B fragments 4 groups ahead, which
# r6e measured neutral at R = 1 and slower from R = 2). Run r6a (bulk chain, us): R = 1 lean4
# 23.78 vs bulkw 25.04, R = 2 36.69 vs 37.07. Revert: STEP_W13W_BY_ROWS = {}.
STEP_W13W_BY_ROWS = {1: "bulkw_lean4", 2: "bulkw_lean4"}
# Round 9 (moe-design.md): from SELFROUTED_FROM_ROWS the step's self-routed pair claims its items
# from a work queue (w13sr "bulkq" -> w2sr "earlyq": "bulk" / "early" whose CTAs take items
# as they finish, bitwise the same y) where the caller's pointers include "sched". Runs r9b /
# r9d (H100, the step against bench_step variant "moe_static", which runs it off): -128 / -119
# us a step at R = 6, -589 / -633 at R = 48, nothing at R = 1.
STEP_QUEUE = True  # revert: False
QUEUED_PAIR = ("bulkq", "earlyq")


def step_w13_variants(rows: int) -> tuple[str, str]:
    """(w13w, w13sr) variants the step launches at `rows` (STEP_W13W_BY_ROWS the bulk chain's
    w13w by rows). Round 6's "_co" w13 (2 CTAs/SM) measured slower at every R: deleted."""
    return STEP_W13W_BY_ROWS.get(rows, BULK_W13W), STEP_SELFROUTED_W13


def shape_of(spec: Mapping) -> mk.MoeShape:
    """The MoeShape of a manifest record's spec dict (any kernel of the family)."""
    return mk.MoeShape(spec["num_experts"], spec["topk"], spec["hidden"], spec["inter"],
                       spec["swiglu_limit"])


def shape_from_bundle(bundle) -> mk.MoeShape:
    name = next((n for n in bundle.names() if n.startswith("moe_w13_")), None)
    if name is None:
        raise LookupError("the bundle has no moe_w13_ kernel (no routed MoE)")
    return shape_of(bundle.manifest.kernels[name].spec)


def available_specs(bundle, shape: mk.MoeShape) -> dict[tuple[str, str], mk.MoeSpec]:
    """(kind, variant) -> spec of every MoE kernel of this shape the bundle holds."""
    names = set(bundle.names())
    every = (mk.make_specs(shape) + [mk.combine_shared_spec(shape)] + mk.variant_specs(shape)
             + mk.warp_routed_specs(shape) + mk.selfrouted_specs(shape))
    return {(s.kind, s.variant): s for s in every if s.name in names}


def variant_names(available, kind: str) -> list[str]:
    """The variants of kind in `available` ("" = the default), in mk's spec order."""
    return [v for (k, v) in available if k == kind]


def has_selfrouted(available) -> bool:
    return {("xquant", ""), ("w13sr", ""), ("w2sr", "")} <= set(available)


def _launch(bundle, spec: mk.MoeSpec, ptrs: Mapping[str, int], rows: int) -> LaunchSpec:
    keys = (POINTER_KEYS[spec.kind] + (("sched",) if spec.queued else ())
            + (("stamps",) if spec.timeline else ()))
    missing = [key for key in keys if key not in ptrs]
    if missing:
        raise KeyError(f"{spec.name}: no address for {missing} (it takes {list(keys)})")
    return LaunchSpec(bundle.kernel(spec.name), spec.grid(rows),
                      (*(ptrs[key] for key in keys), rows))


def chain_launches(bundle, shape: mk.MoeShape, ptrs: Mapping[str, int], rows: int,
                   w13: str = "", w2: str | None = None,
                   kinds=DEFAULT_CHAIN, available=None) -> list[LaunchSpec]:
    """The default chain: prep -> w13 -> w2 -> combine. w13 / w2 = a variant name ("" the
    default); w2 None = mk.W2_SINGLE_ROW_VARIANT at R = 1 when the bundle has it, else the
    default; `kinds` a prefix of the chain (the benchmark's per-stage breakdown). `available`:
    `available_specs(bundle, shape)`, passed by callers that build many lists."""
    available = available_specs(bundle, shape) if available is None else available
    if w2 is None:
        single = ("w2", mk.W2_SINGLE_ROW_VARIANT)
        w2 = single[1] if rows == 1 and single in available else ""
    chosen = {"w13": w13, "w2": w2}
    out = []
    for kind in kinds:
        key = (kind, chosen.get(kind, ""))
        if key not in available:
            raise KeyError(f"no {kind} variant {key[1]!r} in the bundle "
                           f"(have {variant_names(available, kind)})")
        out.append(_launch(bundle, available[key], ptrs, rows))
    return out


def selfrouted_launches(bundle, shape: mk.MoeShape, ptrs: Mapping[str, int], rows: int,
                        w13: str = "", w2: str | None = None,
                        available=None) -> list[LaunchSpec]:
    """xquant -> w13sr -> w2sr -> combine (no prep, no meta / pairs); w2 None =
    mk.W2SR_SINGLE_ROW_VARIANT at R = 1 when the bundle has it, else the default."""
    available = available_specs(bundle, shape) if available is None else available
    if not has_selfrouted(available):
        raise KeyError("the bundle has no self-routed MoE chain (moe_xquant_/moe_w13sr_/"
                       f"moe_w2sr_); it has "
                       f"{sorted(k for k in available if k[0] in ('xquant', 'w13sr', 'w2sr'))}")
    if w2 is None:
        single = ("w2sr", mk.W2SR_SINGLE_ROW_VARIANT)
        w2 = single[1] if rows == 1 and single in available else ""
    for key in (("w13sr", w13), ("w2sr", w2)):
        if key not in available:
            raise KeyError(f"no {key[0]} variant {key[1]!r} in the bundle "
                           f"(have {variant_names(available, key[0])})")
    keys = [("xquant", ""), ("w13sr", w13), ("w2sr", w2), ("combine", "")]
    return [_launch(bundle, available[key], ptrs, rows) for key in keys]


def selfrouted_w13w_launches(bundle, shape: mk.MoeShape, ptrs: Mapping[str, int], rows: int,
                             w13w: str, w2: str = SELFROUTED_EARLY,
                             available=None) -> list[LaunchSpec]:
    """xquant -> w13w `w13w` -> w2sr `w2` -> combine: the self-routed chain with the
    register-routed w13 (rows * topk <= mk.WARP_ROUTED_MAX_PAIRS; the same ABI and y as w13sr),
    e.g. "bulkw_lean4" at 4 CTAs/SM where w13sr's lists keep it at 3."""
    available = available_specs(bundle, shape) if available is None else available
    if not warp_routed_fits(available, shape, rows, w13w):
        raise KeyError(f"no moe_w13w {w13w!r} of {shape.tag()} for rows={rows} (have "
                       f"{variant_names(available, 'w13w')}; rows * topk <= "
                       f"{mk.WARP_ROUTED_MAX_PAIRS})")
    xquant, _, w2_spec, combine = selfrouted_launches(bundle, shape, ptrs, rows, "", w2,
                                                      available)
    return [xquant, _launch(bundle, available[("w13w", w13w)], ptrs, rows), w2_spec, combine]


def warp_routed_launches(bundle, shape: mk.MoeShape, ptrs: Mapping[str, int], rows: int,
                         w2: str | None = None, available=None,
                         w13w: str = "early") -> list[LaunchSpec]:
    """prep -> w13w (variant `w13w`) -> w2 -> combine (rows * topk <=
    mk.WARP_ROUTED_MAX_PAIRS); w2 as in `chain_launches`."""
    available = available_specs(bundle, shape) if available is None else available
    if ("w13w", w13w) not in available:
        raise KeyError(f"the bundle has no moe_w13w variant {w13w!r} of {shape.tag()} (have "
                       f"{variant_names(available, 'w13w')})")
    prep, w2_spec, combine = chain_launches(bundle, shape, ptrs, rows, "", w2,
                                            ("prep", "w2", "combine"), available)
    return [prep, _launch(bundle, available[("w13w", w13w)], ptrs, rows), w2_spec, combine]


def warp_routed_fits(available, shape: mk.MoeShape, rows: int, w13w: str = "early") -> bool:
    return ("w13w", w13w) in available and rows * shape.topk <= mk.WARP_ROUTED_MAX_PAIRS


def bulk_fits(available, shape: mk.MoeShape, rows: int, w13w: str = BULK_W13W,
              w13sr: str = "bulk") -> bool:
    """The bulk-copy chain's kernels for `rows` are in the bundle (`bulk_launches`)."""
    return ("w2", "bulk") in available and (warp_routed_fits(available, shape, rows, w13w)
                                            or ("w13sr", w13sr) in available)


def bulk_launches(bundle, shape: mk.MoeShape, ptrs: Mapping[str, int], rows: int,
                  available=None, w2: str = "bulk", w13w: str = BULK_W13W,
                  w13sr: str = "bulk") -> list[LaunchSpec]:
    """prep -> w13w `w13w` (rows * topk <= mk.WARP_ROUTED_MAX_PAIRS) or w13sr `w13sr` (its
    routing lists in shared memory; prep's xq / xs) -> w2 `w2` ("bulk" or "bulkp": prep's
    lists) -> combine."""
    available = available_specs(bundle, shape) if available is None else available
    if not bulk_fits(available, shape, rows, w13w, w13sr):
        raise KeyError(f"the bundle lacks the bulk-copy MoE kernels of {shape.tag()} for "
                       f"rows={rows} (w2 'bulk' and w13w {w13w!r} / w13sr {w13sr!r})")
    w13 = (("w13w", w13w) if warp_routed_fits(available, shape, rows, w13w)
           else ("w13sr", w13sr))
    prep, w2_spec, combine = chain_launches(bundle, shape, ptrs, rows, "", w2,
                                            ("prep", "w2", "combine"), available)
    return [prep, _launch(bundle, available[w13], ptrs, rows), w2_spec, combine]


def step_variants(available, rows: int) -> tuple[str, str | None]:
    """(w13, w2) of the default chain the step launches at `rows`: STEP_VARIANTS when the bundle
    has both, else the defaults (w2 None = by rows)."""
    w13, w2 = STEP_VARIANTS["w13"], STEP_VARIANTS["w2_one_row" if rows == 1 else "w2"]
    if {("w13", w13), ("w2", w2)} <= set(available):
        return w13, w2
    return "", None


def step_launches(bundle, shape: mk.MoeShape, ptrs: Mapping[str, int],
                  rows: int, combine: bool = True) -> list[LaunchSpec]:
    """What the decode step runs for `rows`: from SELFROUTED_FROM_ROWS rows on the self-routed
    chain (`step_selfrouted_pair`: the queued pair with STEP_QUEUE where ptrs has "sched", else
    w13sr from `step_w13_variants` and w2sr early) when the bundle has it; below, with
    STEP_BULK, the bulk-copy chain (`bulk_launches`, its w13w from `step_w13_variants`); else
    the default chain with `step_variants` (its w13 moe_w13w where that fits). All write the same
    y (bitwise, tests/gpu/test_moe_kernel.py); only the default and bulk ones write meta /
    pairs. combine=False: without the chain's last launch, the combine (every chain ends with
    it; the step launches it as its own stage, `combine_launch`)."""
    chain = _step_chain(bundle, shape, ptrs, rows)
    return chain if combine else chain[:-1]


def combine_launch(bundle, shape: mk.MoeShape, ptrs: Mapping[str, int], rows: int,
                   shared: bool = False) -> LaunchSpec:
    """The combine after the step's chain: moe_combine (route_weights, ye -> y f32) or, shared,
    moe_combine_<tag>_shared (route_weights, ye, shared bf16 -> out bf16 = bf16(y + shared))."""
    spec = mk.combine_shared_spec(shape) if shared else mk.make_specs(shape)[-1]
    if spec.name not in set(bundle.names()):
        raise KeyError(f"the bundle has no {spec.name} (rebuild it: kernels/moe.py specs)")
    return _launch(bundle, spec, ptrs, rows)


def _step_chain(bundle, shape: mk.MoeShape, ptrs: Mapping[str, int],
                rows: int) -> list[LaunchSpec]:
    available = available_specs(bundle, shape)
    w13w, w13sr = step_w13_variants(rows)
    w13sr, w2sr = step_selfrouted_pair(available, ptrs, w13sr)
    chosen = {("w13sr", w13sr), ("w2sr", w2sr)}
    if rows >= SELFROUTED_FROM_ROWS and has_selfrouted(available) and chosen <= set(available):
        return selfrouted_launches(bundle, shape, ptrs, rows, w13sr, w2sr, available)
    if (STEP_BULK and bulk_fits(available, shape, rows, w13w)
            and ("w2", STEP_BULK_W2) in available):
        return bulk_launches(bundle, shape, ptrs, rows, available, STEP_BULK_W2, w13w)
    w13, w2 = step_variants(available, rows)
    w13w = STEP_VARIANTS["w13w"]
    if w13w is not None and warp_routed_fits(available, shape, rows, w13w):
        return warp_routed_launches(bundle, shape, ptrs, rows, w2, available, w13w)
    return chain_launches(bundle, shape, ptrs, rows, w13, w2, available=available)


def has_queued(available) -> bool:
    return {("w13sr", QUEUED_PAIR[0]), ("w2sr", QUEUED_PAIR[1])} <= set(available)


def step_selfrouted_pair(available, ptrs: Mapping[str, int], w13sr: str) -> tuple[str, str]:
    """(w13sr, w2sr) of the step's self-routed chain: QUEUED_PAIR with STEP_QUEUE where the
    bundle has it and ptrs has "sched", else (w13sr, SELFROUTED_EARLY)."""
    if STEP_QUEUE and "sched" in ptrs and has_queued(available):
        return QUEUED_PAIR
    return w13sr, SELFROUTED_EARLY


def timeline_launches(bundle, shape: mk.MoeShape, ptrs: Mapping[str, int], rows: int,
                      stamps: tuple[int, int], static: bool = False) -> list[LaunchSpec]:
    """The step's chain at `rows` (the bulk chain with w13w BULK_W13W and w2 "bulk" below
    SELFROUTED_FROM_ROWS; from there the self-routed one, its pair `step_selfrouted_pair`'s, or
    with `static` w13sr STEP_SELFROUTED_W13 and w2sr early) with its w13 and w2 replaced by
    their timeline builds (mk.timeline_specs), writing per-CTA records at stamps = (w13's,
    w2's) addresses, each at least grid x mk.TIMELINE_RECORD_BYTES."""
    available = available_specs(bundle, shape)
    timeline = {(s.kind, s.variant): s for s in mk.timeline_specs(shape)
                if s.name in set(bundle.names())}
    if rows >= SELFROUTED_FROM_ROWS:
        pair = ((STEP_SELFROUTED_W13, SELFROUTED_EARLY) if static
                else step_selfrouted_pair(available, ptrs, STEP_SELFROUTED_W13))
        w13, w2 = ("w13sr", pair[0]), ("w2sr", pair[1])
        chain = selfrouted_launches(bundle, shape, ptrs, rows, w13[1], w2[1], available)
    else:
        w13, w2 = ("w13w", BULK_W13W), ("w2", "bulk")
        if not warp_routed_fits(available, shape, rows, w13[1]):
            raise ValueError(f"timeline below {SELFROUTED_FROM_ROWS} rows needs w13w {w13[1]!r} "
                             f"to fit rows={rows}")
        chain = bulk_launches(bundle, shape, ptrs, rows, available, w2[1], w13[1])
    missing = [key for key in (w13, w2) if key not in timeline]
    if missing:
        raise KeyError(f"the bundle has no timeline build of {missing} ({shape.tag()}; "
                       f"mk.timeline_specs)")
    chain[1] = _launch(bundle, timeline[w13], {**ptrs, "stamps": stamps[0]}, rows)
    chain[2] = _launch(bundle, timeline[w2], {**ptrs, "stamps": stamps[1]}, rows)
    return chain


# ---- the buffers an arena needs ------------------------------------------------------------------

def weight_requests(shape: mk.MoeShape) -> list[tuple[str, int, str]]:
    """One layer's packed experts (keys = pointer keys), as mk.pack_experts lays them out."""
    e = shape.num_experts
    c13, o13 = shape.w13_bytes
    c2, o2 = shape.w2_bytes
    return [("codes13", e * c13, f"uint8 [{e}, {c13}] w13 E2M1 code words"),
            ("offsets13", e * o13, f"uint8 [{e}, {o13}] w13 o8 offsets"),
            ("codes2", e * c2, f"uint8 [{e}, {c2}] w2 E2M1 code words"),
            ("offsets2", e * o2, f"uint8 [{e}, {o2}] w2 o8 offsets"),
            ("scales13", 4 * e, f"f32 [{e}] w13 2^(lo-122)"),
            ("scales2", 4 * e, f"f32 [{e}] w2 2^(lo-122)")]


def requests(shape: mk.MoeShape, max_rows: int = mk.MAX_ROWS) -> list[tuple[str, int, str]]:
    """Inputs, scratch and output of either chain at up to `max_rows` rows (keys = pointer
    keys; meta and pairs only the default chain uses; shared and out only the shared
    combine)."""
    if not 1 <= max_rows <= mk.MAX_ROWS:
        raise ValueError(f"MoE max_rows {max_rows} must be in [1, {mk.MAX_ROWS}]")
    r, k, d, i = max_rows, shape.topk, shape.hidden, shape.inter
    g = shape.groups(shape.k13)
    meta = mk.meta_words(shape.num_experts)
    return [("ids", 4 * r * k, f"int32 [{r}, {k}] expert ids"),
            ("route_weights", 4 * r * k, f"f32 [{r}, {k}] combine weights"),
            ("x", 2 * r * d, f"bf16 [{r}, {d}] input"),
            ("meta", 4 * meta, f"int32 [{meta}] routing lists"),
            ("pairs", 4 * r * k, f"int32 [{r * k}] pairs by expert"),
            ("xq", r * shape.k13, f"e4m3 [{r}, {shape.k13}] x, fragment order"),
            ("xs", 4 * r * g, f"f32 [{r}, {g}] x group scales"),
            ("h", 2 * r * k * i, f"bf16 [{r * k}, {i}] SwiGLU per pair"),
            ("ye", 2 * r * k * d, f"bf16 [{r * k}, {d}] expert output per pair"),
            ("y", 4 * r * d, f"f32 [{r}, {d}] routed partial"),
            ("shared", 2 * r * d, f"bf16 [{r}, {d}] shared expert output (shared combine)"),
            ("out", 2 * r * d, f"bf16 [{r}, {d}] y + shared (shared combine)"),
            ("sched", 4 * mk.SCHED_WORDS,
             f"u32 [{mk.SCHED_WORDS}] work-queue counters: zero before the first launch")]


def scratch_buffers(cfg, tp: int, max_rows: int):
    """The step's MoE scratch and routed output as executor.wiring Buffers, "moe." + pointer key,
    shared by every layer (the same bytes as `requests`). ids, route_weights and x are other
    families' outputs and the weights are per layer: the step maps those keys itself. Sized for
    the largest of the model's MoE shapes (the DSpark stages' experts may differ: mk.moe_shapes)."""
    shapes = mk.moe_shapes(cfg, tp)
    shape = shapes[0]
    r, k, g = max_rows, max(s.topk for s in shapes), shape.groups(shape.k13)
    inter = max(s.inter for s in shapes)
    return [Buffer("moe.meta", np.int32, (max(mk.meta_words(s.num_experts) for s in shapes),),
                   "routing lists (default chain)"),
            Buffer("moe.pairs", np.int32, (r * k,), "pairs by expert (default chain)"),
            Buffer("moe.xq", np.uint8, (r, shape.k13), "x as E4M3, fragment order"),
            Buffer("moe.xs", np.float32, (r, g), "x group scales"),
            Buffer("moe.h", BF16, (r * k, inter), "SwiGLU per pair"),
            Buffer("moe.ye", BF16, (r * k, shape.hidden), "expert output per pair"),
            Buffer("moe.y", np.float32, (r, shape.hidden), "routed partial"),
            Buffer("moe.sched", np.uint32, (mk.SCHED_WORDS,),
                   "work-queue counters (w13sr bulkq / w2sr earlyq): zero before the first "
                   "launch, left zero by each")]
