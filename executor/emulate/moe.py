"""kernels.moe on the host: the routed-MoE kernels (kernels/moe.py, kernels/moe_selfroute.py) by
kernels/moe_kernel_ref.py and kernels/moe_ref.py, through their exact ABI.

What each kind reads and writes (R = rows, k = top-k; buffers as executor/launches/moe.py lists):
  prep     ids, x -> meta ([0], [1] = 0 bad ids, the first `distinct` words of each list),
           pairs [R*k], and (CTAs 1.. of the grid: none when the grid is 1) xq, xs
  xquant   x -> xq, xs
  w13      meta, pairs, xq, xs, w13 weights -> h rows of the listed pairs
  w13sr    ids (its own lists), xq, xs, w13 weights -> h rows of every pair (w13w the same)
  w2, w2sr as w13 / w13sr with h and the w2 weights -> ye rows
  combine  route_weights, ye -> y [R, D] f32
  combine_shared  route_weights, ye, shared bf16 -> out [R, D] bf16 (mk.combine_shared_reference)
  queued   w13sr "bulkq" / w2sr "earlyq" (kernels/moe_queue.py) as w13sr / w2sr; their pair of
           sched words must be zero at the launch (else the GPU kernel would skip items:
           raised here) and is zero after it
Weights are decoded from the packed bytes at the experts' addresses (mk.effective_weights: the
kernel's prmt arithmetic). The GEMMs are moe_ref's W4A8 (per-128-group partials), so an emulated
chain equals moe_ref.routed_experts on the dequantized checkpoint weights bit for bit; the kernels
differ from it by their summation order only (mk.check_routed_close says how much). Variants of a
kind (ring depth, occupancy, refill timing) compute the same bytes; an unknown one raises
NoEmulator. Ids outside [0, E) or repeated in a row (which the kernels skip or fold) raise.
"""
from __future__ import annotations

import numpy as np

from executor.emulate import NoEmulator
from executor.launches.moe import shape_of
from kernels import moe_kernel_ref as mk
from kernels import moe_ref
from kernels.common_ref import BF16, check_rows

KNOWN_VARIANTS = {
    "prep": ("",), "combine": ("",), "combine_shared": ("",), "xquant": ("",),
    "w13": tuple(v[0] for v in mk.W13_VARIANTS), "w2": (*(v[0] for v in mk.W2_VARIANTS), *mk.W2_BULK_VARIANTS),
    "w13sr": tuple(v[0] for v in mk.W13SR_VARIANTS), "w13w": mk.W13W_VARIANTS,
    "w2sr": tuple(v[0] for v in mk.W2SR_VARIANTS),
}


def emulate(record, grid, args, space) -> None:
    spec = record.spec
    kind, variant = spec["kind"], spec.get("variant", "")
    if spec.get("timeline"):
        raise NoEmulator(f"{record.name}: a timeline build (per-CTA clock stamps) has no CPU "
                         "emulator; the step never launches it")
    if variant not in KNOWN_VARIANTS.get(kind, ()):
        raise NoEmulator(f"{record.name}: no CPU emulator for MoE kernel kind {kind!r} "
                         f"variant {variant!r}")
    shape = shape_of(spec)
    rows = check_rows(args["rows"], record.name)
    if rows > mk.MAX_ROWS:
        raise ValueError(f"{record.name}: rows={rows} exceeds the MoE's {mk.MAX_ROWS}")
    name = record.name
    if kind == "prep":
        lists = _lists_from_ids(name, shape, space, args["topk_ids"], rows)
        _write_lists(shape, space, args, lists, rows)
        if grid[0] >= 2:                    # CTA 0 routes, CTAs 1.. quantize x
            _quantize_x(name, shape, space, args, rows)
    elif kind == "xquant":
        _quantize_x(name, shape, space, args, rows)
    elif kind in ("w13", "w2"):
        experts = _lists_from_meta(name, shape, space, args, rows)
        (_w13 if kind == "w13" else _w2)(name, shape, space, args, rows, experts)
    elif kind in ("w13sr", "w2sr", "w13w"):
        if spec.get("queued"):
            _check_sched(name, space, args["sched"], kind)
        lists = _lists_from_ids(name, shape, space, args["topk_ids"], rows)
        experts = _by_expert(lists)
        (_w2 if kind == "w2sr" else _w13)(name, shape, space, args, rows, experts)
    elif kind == "combine_shared":
        _combine_shared(shape, space, args, rows)
    else:
        _combine(shape, space, args, rows)


# ---- routing ------------------------------------------------------------------------------------

def _lists_from_ids(name, shape: mk.MoeShape, space, ptr: int, rows: int) -> mk.RoutingLists:
    ids = space.array(ptr, np.int32, (rows, shape.topk)).copy()
    try:
        return mk.routing_lists(ids, shape.num_experts)
    except ValueError as exc:
        raise ValueError(f"{name}: topk_ids at {space.name_of(ptr)}: {exc}") from None


def _by_expert(lists: mk.RoutingLists) -> list[tuple[int, np.ndarray]]:
    return [(int(e), lists.pairs[off:off + cnt])
            for e, off, cnt in zip(lists.experts, lists.offsets, lists.counts)]


def _write_lists(shape: mk.MoeShape, space, args, lists: mk.RoutingLists, rows: int) -> None:
    """meta's header words 0 and 1 and each list's first `distinct` words; pairs [R*k]."""
    e, d = shape.num_experts, len(lists.experts)
    want = lists.meta(e)
    meta = space.array(args["meta"], np.int32, (mk.meta_words(e),))
    meta[:2] = want[:2]
    for part in range(3):
        lo = mk.META_HEADER + part * e
        meta[lo:lo + d] = want[lo:lo + d]
    space.array(args["pairs"], np.int32, (rows * shape.topk,))[...] = lists.pairs


def _lists_from_meta(name, shape: mk.MoeShape, space, args, rows: int):
    """(expert, its pairs) per list entry, as w13 / w2 read them from meta and pairs; anything a
    kernel would turn into wild addresses raises."""
    e, n = shape.num_experts, rows * shape.topk
    meta = space.array(args["meta"], np.int32, (mk.meta_words(e),))
    pairs = space.array(args["pairs"], np.int32, (n,))
    d = int(meta[0])
    if not 0 <= d <= min(e, n):
        raise ValueError(f"{name}: meta[0] (distinct experts) = {d} at "
                         f"{space.name_of(args['meta'])}, expected [0, {min(e, n)}]")
    h = mk.META_HEADER
    out = []
    for j in range(d):
        expert, first, count = (int(meta[h + j]), int(meta[h + e + j]), int(meta[h + 2 * e + j]))
        listed = pairs[first:first + count] if 0 <= first and first + count <= n else None
        if (not 0 <= expert < e or count < 1 or listed is None
                or listed.min() < 0 or listed.max() >= n):
            raise ValueError(f"{name}: meta entry {j} (expert {expert}, first pair {first}, "
                             f"{count} pairs) does not fit {e} experts and {n} pairs")
        out.append((expert, listed.copy()))
    return out


def _check_sched(name, space, ptr: int, kind: str) -> None:
    """A queued kernel's (claim, done) words: zero when it starts; its last CTA leaves them
    zero, which is all the emulation has to do."""
    sched = space.array(ptr, np.uint32, (mk.SCHED_WORDS,))
    at = mk.SCHED_AT[kind]
    if sched[at:at + 2].any():
        raise ValueError(f"{name}: sched at {space.name_of(ptr)} holds (claim, done) = "
                         f"{sched[at:at + 2].tolist()}, expected zeros (not zeroed before the "
                         "first launch, or a launch of this kernel did not finish)")


# ---- activations --------------------------------------------------------------------------------

def _quantize_x(name, shape: mk.MoeShape, space, args, rows: int) -> None:
    x = space.array(args["x"], BF16, (rows, shape.hidden)).astype(np.float32)
    try:
        q, s = mk.quantize_fragments(x, shape.k13)
    except ValueError as exc:
        raise ValueError(f"{name}: x at {space.name_of(args['x'])}: {exc}") from None
    space.array(args["xq"], np.uint8, q.shape)[...] = q
    space.array(args["xs"], np.float32, s.shape)[...] = s


def _quantized_x(shape: mk.MoeShape, space, args, rows: int):
    """(E4M3 values as f32 [R, K], scales [R, groups]) from xq (fragment order) and xs."""
    k = shape.k13
    frag = space.array(args["xq"], np.uint8, (rows, k))
    natural = np.empty(k, np.intp)
    natural[mk.fragment_order(k)] = np.arange(k)
    q = frag[:, natural].view(mk.E4M3).astype(np.float32)
    return q, space.array(args["xs"], np.float32, (rows, shape.groups(k))).copy()


def _w4a8_quantized(q: np.ndarray, scales: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """moe_ref.w4a8_matmul past its quantize step (these kernels read x already quantized): per
    128-group partial by moe_ref.matmul_t, y += scale * partial in fp32, groups in order."""
    y = np.zeros((q.shape[0], weight.shape[0]), np.float32)
    for j, start in enumerate(range(0, weight.shape[1], moe_ref.ACT_GROUP)):
        cols = slice(start, start + moe_ref.ACT_GROUP)
        y += scales[:, j:j + 1] * moe_ref.matmul_t(q[:, cols], weight[:, cols])
    return y


# ---- weights and GEMMs --------------------------------------------------------------------------

def _weights(shape: mk.MoeShape, space, args, experts, sublayer: str) -> np.ndarray:
    """f32 [len(experts), N, K] effective weights of the listed experts, checkpoint row order."""
    n, k = (2 * shape.inter, shape.hidden) if sublayer == "w13" else (shape.hidden, shape.inter)
    kp = mk.round_up(k, mk.COL_K)
    e, tiles = shape.num_experts, n // mk.TILE_ROWS
    codes = space.array(args["codes"], np.uint8, (e, tiles, kp // mk.COL_K, mk.LANES, 16))
    offsets = space.array(args["offsets"], np.uint8, (e, tiles, shape.groups(kp), 8, 8))
    scales = space.array(args["scales"], np.float32, (e,))
    ids = np.asarray(experts, np.intp)
    packed = mk.PackedSublayer(codes[ids], offsets[ids], scales[ids], rows=n, k=k)
    values = mk.effective_weights(packed)
    if sublayer == "w2":
        return values
    ordered = np.empty_like(values)
    ordered[:, mk._w13_row_order(shape.inter)] = values     # packed tiles interleave gate / up
    return ordered


def _w13(name, shape: mk.MoeShape, space, args, rows: int, experts) -> None:
    if not experts:
        return
    q, s = _quantized_x(shape, space, args, rows)
    w13 = _weights(shape, space, args, [e for e, _ in experts], "w13")
    h = space.array(args["h"], BF16, (rows * shape.topk, shape.inter))
    inter = shape.inter
    for (expert, pairs), w in zip(experts, w13):
        r = pairs // shape.topk
        if not (np.isfinite(q[r]).all() and np.isfinite(s[r]).all()):
            raise ValueError(f"{name}: xq / xs rows {sorted(set(r.tolist()))} of expert {expert} "
                             f"at {space.name_of(args['xq'])} hold NaN (never written?)")
        h13 = moe_ref.round_bf16(_w4a8_quantized(q[r], s[r], w))
        act = moe_ref.swiglu_clamped(h13[:, :inter], h13[:, inter:], shape.swiglu_limit)
        h[pairs] = act.astype(BF16)


def _w2(name, shape: mk.MoeShape, space, args, rows: int, experts) -> None:
    if not experts:
        return
    n = rows * shape.topk
    h = space.array(args["h"], BF16, (n, shape.inter))
    ye = space.array(args["ye"], BF16, (n, shape.hidden))
    w2 = _weights(shape, space, args, [e for e, _ in experts], "w2")
    for (expert, pairs), w in zip(experts, w2):
        try:                                # h re-quantized per 128 along I, as the kernel does
            out = moe_ref.w4a8_matmul(h[pairs].astype(np.float32), w)
        except ValueError as exc:
            raise ValueError(f"{name}: h rows of expert {expert} at "
                             f"{space.name_of(args['h'])}: {exc}") from None
        ye[pairs] = out.astype(BF16)


def _combine(shape: mk.MoeShape, space, args, rows: int) -> None:
    """moe_ref.routed_experts' combine: y = sum over slots, in order, of w * ye (fp32)."""
    k, d = shape.topk, shape.hidden
    weights = space.array(args["route_weights"], np.float32, (rows, k))
    ye = space.array(args["ye"], BF16, (rows, k, d)).astype(np.float32)
    y = np.zeros((rows, d), np.float32)
    for slot in range(k):
        y += weights[:, slot:slot + 1] * ye[:, slot]
    space.array(args["y"], np.float32, (rows, d))[...] = y


def _combine_shared(shape: mk.MoeShape, space, args, rows: int) -> None:
    """The combine plus the shared expert's bf16 output, one bf16 rounding."""
    k, d = shape.topk, shape.hidden
    weights = space.array(args["route_weights"], np.float32, (rows, k)).copy()
    ye = space.array(args["ye"], BF16, (rows * k, d)).copy()
    shared = space.array(args["shared"], BF16, (rows, d)).copy()
    space.array(args["out"], BF16, (rows, d))[...] = mk.combine_shared_reference(weights, ye,
                                                                                 shared)
