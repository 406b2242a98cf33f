"""NumPy reference of manifold-constrained hyper-connections (mHC) for V4.1's 4-stream residual.

What one mHC kernel family computes (model doc §2.2 M1-M4, §2.3), all in float32:

  M1  mixes  = (X · fnᵀ) · rsqrt(mean(X²) + eps)        X = the n streams flattened to [R, n·D]
  M2  pre    = σ(mixes[0:n]·s0 + b[0:n]) + hc_eps                                   [R, n]
      post   = 2·σ(mixes[n:2n]·s1 + b[n:2n])                                        [R, n]
      comb   = Sinkhorn(mixes[2n:]·s2 + b[2n:]) viewed [n, n] (row j = source stream) [R, n, n]
  M3  collapse: x = Σ_i pre_in[i]·X_i, rounded to BF16 (the official hc_pre returns the model dtype)
  M4  post:     X'_k = post_k·a + Σ_j comb[j, k]·X_j, rounded to BF16 (the residual is stored BF16)

V4.1 "delayed" mHC: a sublayer collapses its input with the `pre` of the *previous* sublayer and carries
its own `pre` forward (layer 0's attention uses the one-hot (1, 0, 0, 0), i.e. the embedding itself).
Layer 0's streams are four copies of the embedding, so its attention mixes are computed from the
embedding with `fn` summed over the four stream blocks (`sum_fn_over_streams`), as vLLM's
`finalize_mhc_broadcast_weights` does.

Sums are taken in float64 and rounded once (to fp32, or to BF16 where the model stores BF16), so a
row's numbers never depend on the other rows of the step (the oracle is batch-invariant).

Sinkhorn, exactly as the official `hc_split_sinkhorn`: row-softmax, +eps, column-normalize, then
(iters - 1) times (row-normalize, column-normalize), every denominator + eps. Rows index the source
stream j, columns the destination stream k, so the final column normalisation makes Σ_j comb[j, k] = 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loader.formats import bf16_round as round_bf16


@dataclass(frozen=True)
class HcCoefficients:
    """The three outputs of M2 for R rows: pre [R, n], post [R, n], comb [R, n, n] (comb[r, j, k])."""

    pre: np.ndarray
    post: np.ndarray
    comb: np.ndarray


def hc_mixes(streams: np.ndarray, fn: np.ndarray, norm_eps: float) -> np.ndarray:
    """M1: [R, n, D] streams (BF16 values) x fn [n²+2n, n·D] -> mixes [R, n²+2n] float32."""
    rows = streams.shape[0]
    flat = streams.reshape(rows, -1).astype(np.float32)
    if fn.shape[1] != flat.shape[1]:
        raise ValueError(f"hc fn has {fn.shape[1]} columns, the streams flatten to {flat.shape[1]}")
    return _scaled_gemv(flat, fn.astype(np.float32), norm_eps)


def sum_fn_over_streams(fn: np.ndarray, n_streams: int) -> np.ndarray:
    """Layer 0: fn [m, n·D] -> [m, D], the sum of its n stream blocks (X is n copies of one vector)."""
    m, width = fn.shape
    return fn.astype(np.float32).reshape(m, n_streams, width // n_streams).sum(axis=1)


def hc_mixes_broadcast(embedding: np.ndarray, fn_summed: np.ndarray, norm_eps: float) -> np.ndarray:
    """M1 for layer 0: mixes of n identical copies of `embedding` [R, D] from the summed fn [m, D].

    mean(X²) over the n copies equals mean(e²), and X·fnᵀ equals e·(Σ_i fn_i)ᵀ.
    """
    return _scaled_gemv(embedding.astype(np.float32), fn_summed.astype(np.float32), norm_eps)


def _scaled_gemv(flat: np.ndarray, fn: np.ndarray, norm_eps: float) -> np.ndarray:
    # Float64 sums rounded once to fp32: a row's result does not depend on the other rows of the
    # batch (BLAS fp32 kernels sum in an M-dependent order), so R = 1 and R = 6 agree bit for bit.
    flat64 = flat.astype(np.float64)
    inv_rms = 1.0 / np.sqrt(np.mean(flat64 * flat64, axis=1, keepdims=True).astype(np.float32)
                            + np.float32(norm_eps))
    return ((flat64 @ fn.astype(np.float64).T).astype(np.float32) * inv_rms).astype(np.float32)


def sinkhorn(logits: np.ndarray, iters: int, eps: float) -> np.ndarray:
    """[..., n, n] logits -> [..., n, n] (near) doubly stochastic matrix, `iters` normalisation rounds."""
    if iters < 1:
        raise ValueError(f"Sinkhorn needs at least one iteration, got {iters}")
    eps = np.float32(eps)
    logits = logits.astype(np.float32)
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    comb = shifted / shifted.sum(axis=-1, keepdims=True) + eps
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    return comb.astype(np.float32)


def _sigmoid(v: np.ndarray) -> np.ndarray:
    return (1.0 / (1.0 + np.exp(-v))).astype(np.float32)


def hc_coefficients(mixes: np.ndarray, scale: np.ndarray, base: np.ndarray, n_streams: int,
                    sinkhorn_iters: int, hc_eps: float) -> HcCoefficients:
    """M2: mixes [R, n²+2n], scale [3], base [n²+2n] -> pre, post, comb."""
    n = n_streams
    if mixes.shape[1] != n * n + 2 * n or base.shape != (n * n + 2 * n,) or scale.shape != (3,):
        raise ValueError(f"mHC coefficient shapes: mixes {mixes.shape}, scale {scale.shape}, "
                         f"base {base.shape}; expected [R, {n * n + 2 * n}], [3], [{n * n + 2 * n}]")
    mixes = mixes.astype(np.float32)
    scale = scale.astype(np.float32)
    base = base.astype(np.float32)
    pre = _sigmoid(mixes[:, :n] * scale[0] + base[:n]) + np.float32(hc_eps)
    post = 2.0 * _sigmoid(mixes[:, n:2 * n] * scale[1] + base[n:2 * n])
    comb_logits = (mixes[:, 2 * n:] * scale[2] + base[2 * n:]).reshape(-1, n, n)
    comb = sinkhorn(comb_logits, sinkhorn_iters, hc_eps)
    return HcCoefficients(pre=pre.astype(np.float32), post=post.astype(np.float32), comb=comb)


def hc_collapse(streams: np.ndarray, pre: np.ndarray) -> np.ndarray:
    """M3 (before the norm): Σ_i pre[:, i]·X_i -> [R, D], rounded to BF16."""
    return round_bf16(np.einsum("rn,rnd->rd", pre.astype(np.float64), streams.astype(np.float64)))


def hc_post(sublayer_out: np.ndarray, streams: np.ndarray, coeffs: HcCoefficients) -> np.ndarray:
    """M4: X'_k = post_k·a + Σ_j comb[j, k]·X_j -> [R, n, D], rounded to BF16."""
    out = coeffs.post[:, :, None].astype(np.float64) * sublayer_out.astype(np.float64)[:, None, :]
    out = out + np.einsum("rjk,rjd->rkd", coeffs.comb.astype(np.float64), streams.astype(np.float64))
    return round_bf16(out)


def one_hot_pre(rows: int, n_streams: int) -> np.ndarray:
    """The carried pre-mix before layer 0: (1, 0, ..., 0) per row, so layer 0 reads the embedding."""
    pre = np.zeros((rows, n_streams), dtype=np.float32)
    pre[:, 0] = 1.0
    return pre
