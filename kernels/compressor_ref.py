"""NumPy reference of the V4.1 KV compressors (ratio 2 and ratio 1) and the index-key publisher.

What the compressor kernels compute (model doc §2.2 A2, A7-A9), all in float32 (dot products are
summed in float64 and rounded once, an order-independent stand-in for fp32 accumulation):

    kv_score = x @ W^T                              x [R, D] (bf16 values); W [512*r, D]
      ratio 2: W = [wkv; wgate] (fp32 weights): kv = kv_score[:, :512], score = kv_score[:, 512:]
      ratio 1: W = wkv (bf16 weights): kv = kv_score, no gate
    ratio 2: each row's (kv, score) goes to the fp32 ring (row p % ring_rows of its sequence);
             at odd p, per channel, over the pair:
             pooled = sum_{t in {p-1, p}} softmax_t(score)[t] * kv[t]
    ratio 1: pooled = kv for every p
    latent   = RMSNorm_c(pooled)                      (compressor.norm, fp32 throughout)
    entry e = p // r  <-  RoPE(latent, position r * (p // r))   (compress rope: theta 160000 + YaRN)
    index key (kv sources) = RoPE(RMSNorm_k(latent @ wk^T), same position)     (un-rotated latent)

The entry then goes through the 584-byte record and the key through the 132-byte record
(`kernels.kvrecord_ref`); the ring keeps (kv | score) rows of 1024 fp32 values.
"""
from __future__ import annotations

import numpy as np

from kernels import rope_ref

HEAD_DIM = 512


def project(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """kv_score [R, 512 * r] float32 = x @ w^T (products summed in float64, rounded once)."""
    if x.ndim != 2 or w.ndim != 2 or w.shape[1] != x.shape[1] or w.shape[0] % HEAD_DIM:
        raise ValueError(
            f"compressor projection: x {x.shape} and weight {w.shape} do not agree "
            f"(expected weight [512 * ratio, {x.shape[1] if x.ndim == 2 else 'D'}])"
        )
    return (x.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32)


def pool_pairs(kv: np.ndarray, score: np.ndarray) -> np.ndarray:
    """[N, 2, 512] kv and score of positions (p-1, p) -> [N, 512] per-channel softmax pooling."""
    if kv.shape != score.shape or kv.ndim != 3 or kv.shape[1] != 2:
        raise ValueError(f"pool_pairs: kv {kv.shape} and score {score.shape}; expected [N, 2, 512]")
    m = np.maximum(score[:, 0], score[:, 1])
    e = np.exp(score - m[:, None, :])
    return (e[:, 0] * kv[:, 0] + e[:, 1] * kv[:, 1]) / (e[:, 0] + e[:, 1])


def rmsnorm_f32(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of float32 rows, kept in float32 (the compressor kernels fuse it; no bf16 step).

    # uncertain: the stock fused compress-and-quantize kernel normalizes in fp32 and rounds only in
    # the record; a bf16 rounding of the latent before RoPE/quantization would be the other reading.
    """
    x = x.astype(np.float32)
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))
    return (x * rstd.astype(np.float32)) * w.astype(np.float32)


def entry_positions(positions: np.ndarray, ratio: int) -> np.ndarray:
    """RoPE position of the entry a row at position p publishes: r * (p // r)."""
    return ratio * (np.asarray(positions, np.int64) // ratio)


def publishes(positions: np.ndarray, ratio: int) -> np.ndarray:
    """bool per row: ratio 1 publishes at every position, ratio 2 at odd positions."""
    return (np.asarray(positions, np.int64) % ratio) == ratio - 1


def rotate(x: np.ndarray, positions: np.ndarray, table: rope_ref.RopeTable) -> np.ndarray:
    """Rotate the last 64 dims of x at `positions` (fp32) with the layer's RoPE table."""
    return rope_ref.apply_rope(x, positions, table)


def index_key(latent: np.ndarray, wk: np.ndarray, k_norm: np.ndarray, eps: float,
              positions: np.ndarray, table: rope_ref.RopeTable) -> np.ndarray:
    """[N, 128] = RoPE(RMSNorm_k(latent @ wk^T)); latent is the un-rotated compressed latent."""
    k = (latent.astype(np.float64) @ wk.astype(np.float64).T).astype(np.float32)
    return rotate(rmsnorm_f32(k, k_norm, eps), positions, table)
