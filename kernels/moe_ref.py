"""NumPy reference of the V4.1 MoE sublayer: fp32 router, W4A8 routed experts, W8A16 shared expert.

Model doc §2.2 F1-F4 with the stock SM90 (Humming) numerics of humming-formats §2.1-§3:

  F1  router     logits = x·W_gᵀ in fp32; s = sqrt(softplus(logits)); the top-k of s + bias (bias is
                 for selection only, ties to the lower expert index); w = s[idx] / (Σ s[idx] + 1e-20)
                 · routed_scaling_factor.
  F2  expert e   x is quantized to FP8 E4M3 per 128-group (fp32 scale amax/448) once per row;
                 h13 = bf16(x_q · W13ᵀ) with W13 = [w1 (gate); w3 (up)] (fused-E8M0 MXFP4, dequantized);
                 h = bf16(silu(min(gate, L)) · clip(up, -L, L)); h is quantized again per 128-group
                 along this rank's I_l (so the last group of a 576- or 96-wide shard is partial);
                 y_e = bf16(h_q · W2ᵀ). The route weight is applied at the combine, in fp32, in top-k
                 slot order (vLLM's `moe_fused_mul_sum`).
  F3  shared     W8A16: the same SwiGLU with BF16 activations and BF16 outputs, no route weight.
  F4  partial    bf16(Σ_k w_k·y_k + shared): this rank's partial, summed over ranks by AR-2.

Weights arrive dequantized to float32 (exact: FP4/FP8 code x power of two), per rank: the rank's
slice of I for every expert. The W4A8 arithmetic is that of `loader.formats.w4a8_linear`, with the
per-group partials summed in float64 so that results do not depend on the batch's row count.
"exact" mode (`quantize_acts=False`) skips the FP8 activation rounding.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loader.formats import bf16_round as round_bf16
from loader.formats import quantize_act_fp8

ACT_GROUP = 128


@dataclass(frozen=True)
class RouterOutput:
    """Per row: the chosen experts [R, k] (best first) and their combine weights [R, k] float32."""

    experts: np.ndarray
    weights: np.ndarray


@dataclass(frozen=True)
class ExpertShard:
    """One rank's slice of one SwiGLU expert, dequantized: w13 [2·I_l, D] = [gate; up], w2 [D, I_l]."""

    w13: np.ndarray
    w2: np.ndarray


def route(x: np.ndarray, gate_weight: np.ndarray, gate_bias: np.ndarray, topk: int,
          routed_scaling_factor: float) -> RouterOutput:
    """F1: x [R, D] (BF16 values) -> the top-k experts and their normalised, scaled weights."""
    num_experts = gate_weight.shape[0]
    if gate_bias.shape != (num_experts,) or not 0 < topk <= num_experts:
        raise ValueError(f"router: weight {gate_weight.shape}, bias {gate_bias.shape}, topk {topk}")
    logits = matmul_t(x, gate_weight)
    scores = np.sqrt(np.logaddexp(np.float32(0.0), logits)).astype(np.float32)
    selection = scores + gate_bias.astype(np.float32)
    # A stable sort of -selection keeps the lower expert index first among equal scores.
    experts = np.argsort(-selection, axis=1, kind="stable")[:, :topk]
    chosen = np.take_along_axis(scores, experts, axis=1)
    weights = chosen / (chosen.sum(axis=1, keepdims=True) + np.float32(1e-20))
    return RouterOutput(experts=experts.astype(np.int64),
                        weights=(weights * np.float32(routed_scaling_factor)).astype(np.float32))


def swiglu_clamped(gate: np.ndarray, up: np.ndarray, limit: float) -> np.ndarray:
    """silu(min(gate, limit)) · clip(up, -limit, limit), float32."""
    gate = np.minimum(gate.astype(np.float32), np.float32(limit))
    up = np.clip(up.astype(np.float32), -limit, limit)
    return (gate / (1.0 + np.exp(-gate)) * up).astype(np.float32)


def matmul_t(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """fp32 x @ weightᵀ summed in float64 and rounded once: batch-invariant (see mhc_ref)."""
    return (x.astype(np.float64) @ weight.astype(np.float64).T).astype(np.float32)


def _matmul_t(x: np.ndarray, weight: np.ndarray, f64=None) -> np.ndarray:
    """matmul_t, over `f64`'s cached float64 copy of weight where given (the same operands, so
    the same bytes: executor/reference/float64_weights.py, tests/test_ref_float64_weights.py)."""
    return matmul_t(x, weight) if f64 is None else f64.matmul_t(x, weight)


def w4a8_matmul(x: np.ndarray, weight: np.ndarray, f64=None) -> np.ndarray:
    """SM90 W4A8 as loader.formats.w4a8_linear computes it, but batch-invariant.

    x is quantized per 128-group (loader.formats.quantize_act_fp8, short tail group allowed);
    each group's partial P_j = xq_j · W_jᵀ is one fp32 number (the WGMMA segment, summed here in
    float64 and rounded once); y += as_j · P_j in fp32, groups in order. `f64`: cached float64
    copies of the weight's groups (a speed-only option of the reference, same bytes).
    """
    q, scales = quantize_act_fp8(x, ACT_GROUP)
    q = q.astype(np.float32)
    y = np.zeros((x.shape[0], weight.shape[0]), np.float32)
    groups = None if f64 is None else f64.groups(weight, ACT_GROUP)
    for j, start in enumerate(range(0, x.shape[1], ACT_GROUP)):
        qj = q[:, start:start + ACT_GROUP]
        if groups is None:
            part = matmul_t(qj, weight[:, start:start + ACT_GROUP])
        else:
            part = (qj.astype(np.float64) @ groups[j].T).astype(np.float32)
        y += scales[:, j:j + 1] * part
    return y


def _linear(x: np.ndarray, weight: np.ndarray, quantize_acts: bool, f64=None) -> np.ndarray:
    """W4A8 (FP8 activations) or, in exact mode, the plain product; rounded to BF16 (c_dtype)."""
    if quantize_acts:
        return round_bf16(w4a8_matmul(x, weight, f64))
    return round_bf16(_matmul_t(x, weight, f64))


def expert_gate_up(x: np.ndarray, shard: ExpertShard, quantize_acts: bool,
                   f64=None) -> np.ndarray:
    """F2's first GEMM: x [r, D] BF16 values -> h13 = [gate | up] [r, 2·I_l] BF16 values."""
    if shard.w13.shape[0] != 2 * shard.w2.shape[1]:
        raise ValueError(f"expert w13 has {shard.w13.shape[0]} rows, w2 implies "
                         f"2·{shard.w2.shape[1]}")
    return _linear(x, shard.w13, quantize_acts, f64)


def expert_hidden(h13: np.ndarray, swiglu_limit: float) -> np.ndarray:
    """F2's activation: h13 [r, 2·I] -> h = bf16(SwiGLU(gate, up)) [r, I]."""
    inter = h13.shape[1] // 2
    return round_bf16(swiglu_clamped(h13[:, :inter], h13[:, inter:], swiglu_limit))


def expert_forward(x: np.ndarray, shard: ExpertShard, swiglu_limit: float,
                   quantize_acts: bool, f64=None) -> np.ndarray:
    """F2 for one expert: x [r, D] BF16 values -> y [r, D] BF16 values."""
    h = expert_hidden(expert_gate_up(x, shard, quantize_acts, f64), swiglu_limit)
    return _linear(h, shard.w2, quantize_acts, f64)


@dataclass(frozen=True)
class RoutedParts:
    """F2's intermediates per (row, slot) pair p = row·k + slot (the kernels' h / ye layout):
    h13 [R·k, 2·I], h [R·k, I], ye [R·k, D] (BF16 values), and the combined y [R, D] fp32."""

    h13: np.ndarray
    h: np.ndarray
    ye: np.ndarray
    y: np.ndarray


def _pairs_by_shard(routing: RouterOutput, experts: list[ExpertShard]):
    """(shard, pair ids) per distinct shard object, pairs ascending. A row's result does not
    depend on the other rows (every sum is rounded once), so experts that share one shard (the
    real-dimension slice test aliases 384 experts onto 4) share one call."""
    shards: dict[int, tuple[ExpertShard, list[int]]] = {}
    for e in np.unique(routing.experts):
        shard = experts[int(e)]
        shards.setdefault(id(shard), (shard, []))[1].append(int(e))
    flat = routing.experts.reshape(-1)
    return [(shard, np.nonzero(np.isin(flat, ids))[0]) for shard, ids in shards.values()]


def combine(weights: np.ndarray, ye: np.ndarray) -> np.ndarray:
    """y [R, D] fp32 = Σ_k w_k · ye_k in top-k slot order (ye [R·k, D] by pair)."""
    rows, topk = weights.shape
    ye = ye.reshape(rows, topk, -1)
    combined = np.zeros((rows, ye.shape[2]), dtype=np.float32)
    for k in range(topk):
        combined += weights[:, k:k + 1] * ye[:, k]
    return combined


def routed_parts(x: np.ndarray, routing: RouterOutput, experts: list[ExpertShard],
                 swiglu_limit: float, quantize_acts: bool = True, f64=None) -> RoutedParts:
    """F2 + combine for one rank, keeping every pair's h13, h and ye (`f64`: _matmul_t's)."""
    rows, topk = routing.experts.shape
    pairs = rows * topk
    if pairs == 0:
        empty = np.zeros((0, 0), np.float32)
        return RoutedParts(empty, empty, np.zeros((0, x.shape[1]), np.float32),
                           np.zeros((rows, x.shape[1]), np.float32))
    h13 = h = ye = None
    for shard, p in _pairs_by_shard(routing, experts):
        if h13 is None:
            inter = shard.w2.shape[1]
            h13 = np.zeros((pairs, 2 * inter), np.float32)
            h = np.zeros((pairs, inter), np.float32)
            ye = np.zeros((pairs, x.shape[1]), np.float32)
        h13[p] = expert_gate_up(x[p // topk], shard, quantize_acts, f64)
        h[p] = expert_hidden(h13[p], swiglu_limit)
        ye[p] = _linear(h[p], shard.w2, quantize_acts, f64)
    return RoutedParts(h13, h, ye, combine(routing.weights, ye))


def routed_from_hidden(h: np.ndarray, routing: RouterOutput, experts: list[ExpertShard],
                       quantize_acts: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """F2's second GEMM + combine from a given h [R·k, I] (by pair): (ye [R·k, D], y [R, D]).
    With the device's h this is the exact reference of what moe_w2 + moe_combine compute."""
    rows, topk = routing.experts.shape
    if h.shape[0] != rows * topk:
        raise ValueError(f"routed_from_hidden: h has {h.shape[0]} rows, routing implies "
                         f"{rows}·{topk} pairs")
    ye = None
    for shard, p in _pairs_by_shard(routing, experts):
        if h.shape[1] != shard.w2.shape[1]:
            raise ValueError(f"routed_from_hidden: h is {h.shape[1]} wide, w2 is "
                             f"{shard.w2.shape}")
        if ye is None:
            ye = np.zeros((h.shape[0], shard.w2.shape[0]), np.float32)
        ye[p] = _linear(np.asarray(h[p], np.float32), shard.w2, quantize_acts)
    return ye, combine(routing.weights, ye)


def routed_experts(x: np.ndarray, routing: RouterOutput, experts: list[ExpertShard],
                   swiglu_limit: float, quantize_acts: bool = True, f64=None) -> np.ndarray:
    """F2 + combine for one rank: [R, D] -> fp32 [R, D] = Σ_k w_k · y_{e_k} (slot order)."""
    return routed_parts(x, routing, experts, swiglu_limit, quantize_acts, f64).y


def shared_expert(x: np.ndarray, shard: ExpertShard, swiglu_limit: float,
                  f64=None) -> np.ndarray:
    """F3, W8A16: [R, D] BF16 values -> this rank's partial [R, D] BF16 values."""
    inter = shard.w2.shape[1]
    h13 = round_bf16(_matmul_t(x, shard.w13, f64))
    h = round_bf16(swiglu_clamped(h13[:, :inter], h13[:, inter:], swiglu_limit))
    return round_bf16(_matmul_t(h, shard.w2, f64))


def moe_partial(x: np.ndarray, routing: RouterOutput, experts: list[ExpertShard],
                shared: ExpertShard, swiglu_limit: float, quantize_acts: bool = True,
                f64=None) -> np.ndarray:
    """F4: this rank's MoE partial bf16(routed + shared), to be summed over ranks (AR-2).
    `f64` (executor/reference/float64_weights.Float64Weights or None): cached float64 weight
    copies for the products instead of a conversion per call; the same bytes either way."""
    routed = routed_experts(x, routing, experts, swiglu_limit, quantize_acts, f64)
    return round_bf16(routed + shared_expert(x, shared, swiglu_limit, f64))


# ---- bounds of the device tests (docs/notes/moe-tolerance.md) --------------------------------
# A kernel sums the same exact products as this reference in another order (fp32 accumulators,
# tensor-core k-steps, K split across warps), so each BF16 sum it rounds (h13, ye) lies within
# SUM_ULPS BF16 ulps of the reference's, or within SUM_FLOOR x the row's rms where the sum
# cancels; everything else (FP8 quantization of x and h, SwiGLU's clamps, the combine) is the
# same arithmetic on the same inputs. No such bound exists for y against x alone: one h element
# moved by one ulp can move its 128-group's FP8 scale and with it ~10 codes, each by up to 1/14
# of the group's largest element, which moves y by several % of its row's rms. So a device test
# checks h against `hidden_envelope` and then y against `routed_from_hidden` on ITS h.

SUM_ULPS = 2
SUM_FLOOR = 2.0**-10
SWIGLU_REL = 2.0**-20          # ex2.approx + div.rn + mul.rn against NumPy's exp, relative
COMBINE_REL = 2.0**-20         # three fp32 fma-free steps of the combine, relative to Σ|w·ye|
SILU_ARGMIN = -1.2784645427610738   # silu'(g) = 0: silu falls below it, rises above


def bf16_ulp(v: np.ndarray) -> np.ndarray:
    """float64 BF16 spacing just above |v| (2^(floor(log2 |v|) - 7)); 0 where v == 0."""
    _, exponent = np.frexp(np.abs(np.asarray(v, np.float64)))
    return np.where(v == 0, 0.0, np.ldexp(1.0, exponent - 8))


def sum_slack(ref: np.ndarray) -> np.ndarray:
    """How far a BF16 sum rounded in another order may land from `ref` [rows, n], float64."""
    ref = np.asarray(ref, np.float64)
    rms = np.sqrt(np.mean(np.square(ref), axis=1, keepdims=True))
    return SUM_ULPS * bf16_ulp(ref) + SUM_FLOOR * rms


def _swiglu64(gate: np.ndarray, up: np.ndarray, limit: float) -> np.ndarray:
    gate = np.minimum(gate, limit)
    return gate / (1.0 + np.exp(-gate)) * np.clip(up, -limit, limit)


def hidden_envelope(h13_ref: np.ndarray, swiglu_limit: float) -> tuple[np.ndarray, np.ndarray]:
    """[lo, hi] float64 [P, I] that a device's h must lie in, given the reference's h13 [P, 2·I].

    Exact extremes of SwiGLU over the box gate ± sum_slack, up ± sum_slack (linear in clip(up);
    silu monotone on either side of SILU_ARGMIN, so the corners and that point are enough),
    widened by the kernel's SwiGLU error and one BF16 ulp for its final rounding.
    """
    inter = h13_ref.shape[1] // 2
    slack = sum_slack(h13_ref)
    g, u = (np.asarray(h13_ref[:, :inter], np.float64), np.asarray(h13_ref[:, inter:], np.float64))
    dg, du = slack[:, :inter], slack[:, inter:]
    corners = [_swiglu64(g + sg * dg, u + su * du, swiglu_limit)
               for sg in (-1, 1) for su in (-1, 1)]
    inside = (g - dg < SILU_ARGMIN) & (SILU_ARGMIN < g + dg)
    corners += [np.where(inside, _swiglu64(np.full_like(g, SILU_ARGMIN), u + su * du,
                                           swiglu_limit), corners[0]) for su in (-1, 1)]
    lo, hi = np.min(corners, axis=0), np.max(corners, axis=0)
    lo -= bf16_ulp(lo) + SWIGLU_REL * np.abs(lo)
    hi += bf16_ulp(hi) + SWIGLU_REL * np.abs(hi)
    return lo, hi


def _first(mask: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(mask)[0])


def check_hidden_close(h: np.ndarray, h13_ref: np.ndarray, swiglu_limit: float,
                       what: str = "h") -> None:
    """A device's h [P, I] (BF16 values, by pair) against `hidden_envelope`, every element."""
    h = np.asarray(h, np.float32)
    inter = h13_ref.shape[1] // 2
    if h.shape != (h13_ref.shape[0], inter):
        raise AssertionError(f"{what}: shape {h.shape}, expected {(h13_ref.shape[0], inter)}")
    if not np.isfinite(h).all():
        idx = _first(~np.isfinite(h))
        raise AssertionError(f"{what}: non-finite {h[idx]} at (pair, column) {idx}")
    lo, hi = hidden_envelope(h13_ref, swiglu_limit)
    out = (h < lo) | (h > hi)
    if out.any():
        idx = _first(out)
        raise AssertionError(
            f"{what}: {int(out.sum())} elements outside the envelope; first at (pair, column) "
            f"{idx}: {h[idx]!r} not in [{lo[idx]:.6g}, {hi[idx]:.6g}] (gate {h13_ref[idx]!r}, "
            f"up {h13_ref[idx[0], inter + idx[1]]!r})")


def routed_allowance(ye_ref: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """|y - y_ref| allowed [R, D] float64 when both come from the same h: each ye within
    sum_slack of ye_ref, weighted as the combine weights it, plus the combine's fp32 rounding."""
    rows, topk = weights.shape
    w = np.asarray(weights, np.float64)[:, :, None]
    ye = np.asarray(ye_ref, np.float64)
    slack = sum_slack(ye).reshape(rows, topk, -1)
    return (w * slack).sum(axis=1) + COMBINE_REL * (w * np.abs(ye.reshape(rows, topk, -1))).sum(1)


def check_routed_given_hidden(y: np.ndarray, y_ref: np.ndarray, ye_ref: np.ndarray,
                              weights: np.ndarray, what: str = "y") -> None:
    """A device's y [R, D] against `routed_from_hidden` on the device's own h, every element."""
    y = np.asarray(y, np.float32)
    if y.shape != y_ref.shape:
        raise AssertionError(f"{what}: shape {y.shape}, expected {y_ref.shape}")
    if not np.isfinite(y).all():
        idx = _first(~np.isfinite(y))
        raise AssertionError(f"{what}: non-finite {y[idx]} at {idx} (NaN poison not overwritten?)")
    allow = routed_allowance(ye_ref, weights)
    err = np.abs(y.astype(np.float64) - y_ref)
    over = err > allow
    if over.any():
        idx = _first(over)
        raise AssertionError(f"{what}: {int(over.sum())} elements out of tolerance; first at "
                             f"{idx}: {y[idx]!r} vs {y_ref[idx]!r} (allowed {allow[idx]:.3g})")


def check_two_stage(y: np.ndarray, h: np.ndarray, parts: RoutedParts, routing: RouterOutput,
                    experts: list[ExpertShard], swiglu_limit: float, what: str = "y") -> None:
    """A device's h [R·k, I] and y [R, D] against the reference `parts` of the same inputs:
    `check_hidden_close`, then `check_routed_given_hidden` on the reference's w2 + combine of
    the device's own h."""
    check_hidden_close(h, parts.h13, swiglu_limit, f"h of {what}")
    ye_ref, y_ref = routed_from_hidden(h, routing, experts)
    check_routed_given_hidden(y, y_ref, ye_ref, routing.weights, what)
