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


def w4a8_matmul(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """SM90 W4A8 as loader.formats.w4a8_linear computes it, but batch-invariant.

    x is quantized per 128-group (loader.formats.quantize_act_fp8, short tail group allowed);
    each group's partial P_j = xq_j · W_jᵀ is one fp32 number (the WGMMA segment, summed here in
    float64 and rounded once); y += as_j · P_j in fp32, groups in order.
    """
    q, scales = quantize_act_fp8(x, ACT_GROUP)
    q = q.astype(np.float32)
    y = np.zeros((x.shape[0], weight.shape[0]), np.float32)
    for j, start in enumerate(range(0, x.shape[1], ACT_GROUP)):
        part = matmul_t(q[:, start:start + ACT_GROUP], weight[:, start:start + ACT_GROUP])
        y += scales[:, j:j + 1] * part
    return y


def _linear(x: np.ndarray, weight: np.ndarray, quantize_acts: bool) -> np.ndarray:
    """W4A8 (FP8 activations) or, in exact mode, the plain product; rounded to BF16 (c_dtype)."""
    if quantize_acts:
        return round_bf16(w4a8_matmul(x, weight))
    return round_bf16(matmul_t(x, weight))


def expert_forward(x: np.ndarray, shard: ExpertShard, swiglu_limit: float,
                   quantize_acts: bool) -> np.ndarray:
    """F2 for one expert: x [r, D] BF16 values -> y [r, D] BF16 values."""
    inter = shard.w2.shape[1]
    if shard.w13.shape[0] != 2 * inter:
        raise ValueError(f"expert w13 has {shard.w13.shape[0]} rows, w2 implies 2·{inter}")
    h13 = _linear(x, shard.w13, quantize_acts)
    h = round_bf16(swiglu_clamped(h13[:, :inter], h13[:, inter:], swiglu_limit))
    return _linear(h, shard.w2, quantize_acts)


def routed_experts(x: np.ndarray, routing: RouterOutput, experts: list[ExpertShard],
                   swiglu_limit: float, quantize_acts: bool = True) -> np.ndarray:
    """F2 + combine for one rank: [R, D] -> fp32 [R, D] = Σ_k w_k · y_{e_k} (slot order)."""
    rows, topk = routing.experts.shape
    expert_out = np.zeros((rows, topk, x.shape[1]), dtype=np.float32)
    # One call per distinct shard object: a row's result does not depend on the other rows (every
    # sum is rounded once), so experts that share one shard (the real-dimension slice test
    # aliases 384 experts onto 4) share one call; distinct experts are called one by one.
    shards: dict[int, tuple[ExpertShard, list[int]]] = {}
    for e in np.unique(routing.experts):
        shard = experts[int(e)]
        shards.setdefault(id(shard), (shard, []))[1].append(int(e))
    for shard, ids in shards.values():
        row_idx, slot_idx = np.nonzero(np.isin(routing.experts, ids))
        expert_out[row_idx, slot_idx] = expert_forward(x[row_idx], shard, swiglu_limit,
                                                       quantize_acts)
    combined = np.zeros((rows, x.shape[1]), dtype=np.float32)
    for k in range(topk):
        combined += routing.weights[:, k:k + 1] * expert_out[:, k]
    return combined


def shared_expert(x: np.ndarray, shard: ExpertShard, swiglu_limit: float) -> np.ndarray:
    """F3, W8A16: [R, D] BF16 values -> this rank's partial [R, D] BF16 values."""
    inter = shard.w2.shape[1]
    h13 = round_bf16(matmul_t(x, shard.w13))
    h = round_bf16(swiglu_clamped(h13[:, :inter], h13[:, inter:], swiglu_limit))
    return round_bf16(matmul_t(h, shard.w2))


def moe_partial(x: np.ndarray, routing: RouterOutput, experts: list[ExpertShard],
                shared: ExpertShard, swiglu_limit: float, quantize_acts: bool = True) -> np.ndarray:
    """F4: this rank's MoE partial bf16(routed + shared), to be summed over ranks (AR-2)."""
    routed = routed_experts(x, routing, experts, swiglu_limit, quantize_acts)
    return round_bf16(routed + shared_expert(x, shared, swiglu_limit))
