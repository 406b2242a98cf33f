"""One rank's MoE partial of the reference step over cached float64 weights (speed only).

`kernels.moe_ref.moe_partial`'s arithmetic, step for step (its docstring has the numerics), with
every weight product taken over a `Float64Weights` copy instead of a fresh float64 conversion
per call: the same BLAS calls on the same operands, so the same bytes
(tests/test_ref_float64_weights.py checks them against moe_ref, W4A8 and exact, experts shared
and distinct). The router stays moe_ref.route (its weight is small).
"""
from __future__ import annotations

import numpy as np

from executor.reference.float64_weights import Float64Weights
from kernels.moe_ref import ACT_GROUP, ExpertShard, RouterOutput, swiglu_clamped
from loader.formats import bf16_round, quantize_act_fp8


def w4a8_matmul(x: np.ndarray, weight: np.ndarray, f64: Float64Weights) -> np.ndarray:
    """moe_ref.w4a8_matmul: per 128-group partials summed in float64, y += scale · partial."""
    q, scales = quantize_act_fp8(x, ACT_GROUP)
    q = q.astype(np.float32)
    y = np.zeros((x.shape[0], weight.shape[0]), np.float32)
    for j, w64 in enumerate(f64.groups(weight, ACT_GROUP)):
        start = j * ACT_GROUP
        part = (q[:, start:start + ACT_GROUP].astype(np.float64) @ w64.T).astype(np.float32)
        y += scales[:, j:j + 1] * part
    return y


def _linear(x: np.ndarray, weight: np.ndarray, quantize_acts: bool,
            f64: Float64Weights) -> np.ndarray:
    if quantize_acts:
        return bf16_round(w4a8_matmul(x, weight, f64))
    return bf16_round(f64.matmul_t(x, weight))


def expert_forward(x: np.ndarray, shard: ExpertShard, swiglu_limit: float, quantize_acts: bool,
                   f64: Float64Weights) -> np.ndarray:
    """moe_ref.expert_forward: x [r, D] BF16 values -> y [r, D] BF16 values."""
    inter = shard.w2.shape[1]
    if shard.w13.shape[0] != 2 * inter:
        raise ValueError(f"expert w13 has {shard.w13.shape[0]} rows, w2 implies 2·{inter}")
    h13 = _linear(x, shard.w13, quantize_acts, f64)
    h = bf16_round(swiglu_clamped(h13[:, :inter], h13[:, inter:], swiglu_limit))
    return _linear(h, shard.w2, quantize_acts, f64)


def routed_experts(x: np.ndarray, routing: RouterOutput, experts, swiglu_limit: float,
                   quantize_acts: bool, f64: Float64Weights) -> np.ndarray:
    """moe_ref.routed_experts: one call per distinct shard object, combined in slot order."""
    rows, topk = routing.experts.shape
    expert_out = np.zeros((rows, topk, x.shape[1]), dtype=np.float32)
    shards: dict[int, tuple[ExpertShard, list[int]]] = {}
    for e in np.unique(routing.experts):
        shard = experts[int(e)]
        shards.setdefault(id(shard), (shard, []))[1].append(int(e))
    for shard, ids in shards.values():
        row_idx, slot_idx = np.nonzero(np.isin(routing.experts, ids))
        expert_out[row_idx, slot_idx] = expert_forward(x[row_idx], shard, swiglu_limit,
                                                       quantize_acts, f64)
    combined = np.zeros((rows, x.shape[1]), dtype=np.float32)
    for k in range(topk):
        combined += routing.weights[:, k:k + 1] * expert_out[:, k]
    return combined


def shared_expert(x: np.ndarray, shard: ExpertShard, swiglu_limit: float,
                  f64: Float64Weights) -> np.ndarray:
    """moe_ref.shared_expert (W8A16): [R, D] BF16 values -> [R, D] BF16 values."""
    inter = shard.w2.shape[1]
    h13 = bf16_round(f64.matmul_t(x, shard.w13))
    h = bf16_round(swiglu_clamped(h13[:, :inter], h13[:, inter:], swiglu_limit))
    return bf16_round(f64.matmul_t(h, shard.w2))


def moe_partial(x: np.ndarray, routing: RouterOutput, experts, shared: ExpertShard,
                swiglu_limit: float, quantize_acts: bool, f64: Float64Weights) -> np.ndarray:
    """moe_ref.moe_partial: this rank's bf16(routed + shared), summed over ranks by AR-2."""
    routed = routed_experts(x, routing, experts, swiglu_limit, quantize_acts, f64)
    return bf16_round(routed + shared_expert(x, shared, swiglu_limit, f64))
