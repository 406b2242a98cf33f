"""NumPy reference of V4.1 sparse MQA decode: one shared 512-d latent (K = V), an attention sink.

What the attention kernel computes for R rows and H local heads (model doc §2.2 A13):

    q      [R, H, 512]   query (rope dims rotated), BF16 values
    kv     [R, N, 512]   the row's gathered entries: SWA window then selected compressed entries,
                         dequantized from their records; K = V = the whole entry
    valid  [R, N]        which gathered entries exist (window edge, -1 top-k padding, causality)
    sink   [H]           float32, enters the denominator unscaled

    logit[r, h, n] = q[r, h] . kv[r, n] / sqrt(512)                 (float32)
    m = max(max_n logit, sink_h);  e = exp(logit - m) (0 where invalid)
    P = e / (sum_n e + exp(sink_h - m))  -> rounded to BF16
    o[r, h] = bf16( sum_n P[r, h, n] * kv[r, n] )                   (float32 accumulation)

A row with no valid entry gets o = 0 (only the sink). Invalid entries are zeroed before the
products, so poison (NaN) in unused cache memory never reaches the output.

Which SWA positions a row sees (`swa_positions`): causal rows (decode, verify) see p - W + 1 .. p;
draft rows see the W positions before their block plus every row of the block.
"""
from __future__ import annotations

import numpy as np

from kernels.common_ref import to_bf16

HEAD_DIM = 512
SOFTMAX_SCALE = HEAD_DIM ** -0.5


def swa_positions(positions: np.ndarray, block_start: np.ndarray, block_end: np.ndarray,
                  draft: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """([R, C] positions, [R, C] valid) of the SWA entries each row attends to.

    Causal rows: p - W + 1 .. p. Draft rows: block_start - W .. block_end (W + block rows).
    # uncertain: the draft window is the W positions before the block (pypto's
    # VISIBLE_ROWS = WIN + S); it could instead end at each row's own position minus one.
    """
    positions = np.asarray(positions, np.int64)
    lo = np.where(draft, block_start - window, positions - window + 1)
    hi = np.where(draft, block_end, positions)
    width = int((hi - lo).max()) + 1 if positions.size else window
    cols = lo[:, None] + np.arange(width)[None, :]
    valid = (cols >= 0) & (cols <= hi[:, None])
    return np.where(valid, cols, 0), valid


def sparse_mqa(q: np.ndarray, kv: np.ndarray, valid: np.ndarray, sink: np.ndarray,
               round_probs: bool = True) -> np.ndarray:
    """o [R, H, 512] float32 holding BF16 values; see the module docstring.

    Sums run in float64 (exact enough to be order-independent) and the results are rounded where the
    kernel rounds: P to BF16, o to BF16. The kernel's fp32 sums differ from this by ~1e-6 relative.
    """
    r, h, d = q.shape
    if kv.ndim != 3 or kv.shape[0] != r or kv.shape[2] != d or valid.shape != kv.shape[:2]:
        raise ValueError(f"sparse_mqa: q {q.shape}, kv {kv.shape}, valid {valid.shape} disagree")
    if sink.shape != (h,):
        raise ValueError(f"sparse_mqa: sink {sink.shape}; expected [{h}]")
    kv = np.where(valid[:, :, None], kv, 0).astype(np.float64)
    logits = np.matmul(q.astype(np.float64), kv.transpose(0, 2, 1)) * SOFTMAX_SCALE
    logits = np.where(valid[:, None, :], logits, -np.inf)
    sink = sink.astype(np.float64)[None, :, None]
    m = np.maximum(logits.max(axis=2, keepdims=True), sink)
    e = np.exp(logits - m)
    probs = e / (e.sum(axis=2, keepdims=True) + np.exp(sink - m))
    if round_probs:
        # uncertain: the normalized probabilities are rounded (the official reference's
        # softmax(...).to(bf16)); a flash-style kernel rounds exp(l - m) and divides o by the fp32
        # sum instead. The two differ by BF16 rounding only (<= 2^-8 relative per weight).
        probs = to_bf16(probs.astype(np.float32)).astype(np.float64)
    return to_bf16(np.matmul(probs, kv).astype(np.float32)).astype(np.float32)


def sparse_mqa_f64(q: np.ndarray, kv: np.ndarray, valid: np.ndarray,
                   sink: np.ndarray) -> np.ndarray:
    """Float64 ground truth of the same formula (no roundings), for tolerance checks."""
    kv = np.where(valid[:, :, None], kv, 0).astype(np.float64)
    logits = np.matmul(q.astype(np.float64), kv.transpose(0, 2, 1)) * SOFTMAX_SCALE
    logits = np.where(valid[:, None, :], logits, -np.inf)
    sink = sink.astype(np.float64)[None, :, None]
    m = np.maximum(logits.max(axis=2, keepdims=True), sink)
    e = np.exp(logits - m)
    return np.matmul(e / (e.sum(axis=2, keepdims=True) + np.exp(sink - m)), kv)
