"""W8A16 linear with q_norm folded into its x prologue: spec, grid rule and the NumPy reference.

    xn[r, :]   = bf16( (q[r, :] * rstd[r]) * w_norm ),  rstd[r] = 1 / sqrt( sum q[r, :]^2 / K + eps )
    out[r, n]  = bf16( sum_k xn[r, k] * W[n, k] ),      W = e4m3(w) * 2^(s[n/32, k/32] - 127)

q is the q half of the fused wq_a|wkv output `attn.qkv`: bf16 [rows, K] at row stride
`x_stride` = K + head_dim (the kv half follows each row and is not read), w_norm is q_norm's fp32
weight [K], eps a runtime f32 > 0. The consumers are the attention's wq_b and the indexer's
query projection (both read q_norm(q), model doc §2.2 A3), so the step needs no separate q_norm
launch between wq_a|wkv and wq_b (docs/notes/attn-fusion.md, "q_norm folded").

xn is bitwise `norm_ref.rmsnorm_ref` (the bytes attn_prep / split_rmsnorm write to attn.qr): the
kernel's norm warps sum a row's squares in split_norm's lane order (lane l: vectors l, l + 32, ..,
fma.rn of exact bf16 squares, then a shfl.bfly butterfly 16..1 with add.rn), then div.rn by K,
add.rn eps, sqrt.rn, rcp.rn, and each thread scales its own x with mul.rn (x * rstd) * w and
cvt.rn.bf16x2: the instructions attn_prep's q warps execute (its PTX). The product is then
kernels/dense_tile.py's resident-x tile kernel on xn, so `out` is `dense_ref.dense_ref(base, xn,
..)` up to the fp32 summation order, and bitwise equal to the step's own wq_b kernel of the same
variant run on attn.qr (same B fragments, same mma order).

Built for R <= 8 (one n8 row tile, the streamed tile variants with x resident: K <= 2048) and
K a multiple of 256 (32 lanes x 8 per vector: a row is one warp's, as split_norm's geometry).
Above 8 rows the step keeps q_norm as its own launch (split_rmsnorm) and the r32 mma kernel.

PTX ABI: (u64 x, u64 weight, u64 scales, u64 norm_weight, u64 out, u32 rows, f32 eps).
Bytes that must move: the base linear's weights and scales + rows * K * 2 (q, read twice: by the
norm warps and the fragment loads; L2) + 4 K (norm weight, per CTA from L2) + rows * N * 2.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels import dense_ref as dr
from kernels import norm_ref
from kernels.common_ref import BF16, params_dict

PREFIX = "dense_qnorm"
LABELS = ("wq_b", "indexer_wq_b")               # the readers of q_norm(q)
VARIANT = "stream_xtwp"                         # the step's wq_b R <= 8 variant (round 7)
PARAMS = (("x", "u64"), ("weight", "u64"), ("scales", "u64"), ("norm_weight", "u64"),
          ("out", "u64"), ("rows", "u32"), ("eps", "f32"))
NORM_LANES = 32                                 # a row's norm is one warp's (split_norm)
MAX_NORM_ROWS = dr.ROW_TILE                     # rows whose rstd a CTA computes: warps 0..7


@dataclass(frozen=True)
class DenseQNormSpec(dr.DenseSpec):
    """A resident-x tile DenseSpec whose x is q_norm(the q half of rows of stride x_stride)."""

    x_stride: int = 0                           # elements between two rows of q

    @property
    def params(self) -> tuple[tuple[str, str], ...]:
        return PARAMS

    @property
    def norm_vecs(self) -> int:
        """16-byte vectors of a row each norm lane sums (split_norm's vecs_per_thread)."""
        return norm_ref.row_geometry(self.k)[1]

    @property
    def smem_bytes(self) -> int:
        """The base kernel's, plus q_norm's fp32 weight and the rows' rstd (16-aligned each)."""
        return super().smem_bytes + 4 * self.k + 4 * MAX_NORM_ROWS + 32

    def base(self) -> dr.DenseSpec:
        """The plain tile spec this kernel multiplies with (dense_ref.make_spec's)."""
        return dr.DenseSpec.from_dict(super().to_dict())

    def bytes_moved(self, rows: int) -> int:
        return super().bytes_moved(rows) + rows * self.k * 2 + 4 * self.k

    def to_dict(self) -> dict:
        return super().to_dict() | {"family": "dense_qnorm", "x_stride": self.x_stride,
                                    "params": params_dict(self.params),
                                    "smem_bytes": self.smem_bytes}

    @classmethod
    def from_dict(cls, d: dict) -> DenseQNormSpec:
        base = dr.DenseSpec.from_dict(d)
        return cls(**{f: getattr(base, f) for f in base.__dataclass_fields__},
                   x_stride=d["x_stride"])


def make_spec(label: str, n: int, k: int, x_stride: int,
              variant: str = VARIANT) -> DenseQNormSpec:
    """The folded kernel of `label` (N, K as dense_ref.dense_shapes) reading rows of x_stride."""
    base = dr.make_spec(label, n, k, prefix=PREFIX, variant=variant)
    if not base.x_resident or base.epilogue != "bf16":
        raise ValueError(f"{base.name}: the q_norm prologue needs a tile variant with x resident "
                         f"(K <= 2048, one group), got variant {variant!r}, K {k}")
    threads, _ = norm_ref.row_geometry(k)
    if threads != NORM_LANES or base.warps < MAX_NORM_ROWS:
        raise ValueError(f"{base.name}: K = {k} gives {threads} lanes a row (need a whole warp "
                         f"per row: K % 256 == 0) or {base.warps} warps < 8")
    if x_stride < k or x_stride % 8:
        raise ValueError(f"{base.name}: x row stride {x_stride} must be >= K and 16-byte aligned")
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
    return DenseQNormSpec(**fields | {"name": base.name}, x_stride=x_stride)


def specs_for(cfg, tp: int) -> list[DenseQNormSpec]:
    """wq_b and the indexer's wq_b (where the model has an indexer), R <= 8."""
    shapes = dr.dense_shapes(cfg, tp)
    stride = cfg.q_lora_rank + cfg.head_dim
    labels = [lb for lb in LABELS if lb != "indexer_wq_b" or cfg.index_n_heads]
    return [make_spec(lb, *shapes[lb][:2], x_stride=stride) for lb in labels]


def spec_for(specs: list[DenseQNormSpec], label: str) -> DenseQNormSpec:
    """The spec of `label` among a bundle's / specs_for's."""
    hits = [s for s in specs if s.name.startswith(f"{PREFIX}_{label}_n")]
    if len(hits) != 1:
        raise LookupError(f"{len(hits)} dense_qnorm kernels for {label!r}: "
                          f"{[s.name for s in hits]}")
    return hits[0]


# ---- reference ---------------------------------------------------------------------------------

def q_half(spec: DenseQNormSpec, x: np.ndarray) -> np.ndarray:
    """The q half [rows, K] of x [rows, x_stride] (bf16)."""
    if x.ndim != 2 or x.dtype != BF16 or x.shape[1] != spec.x_stride:
        raise TypeError(f"{spec.name}: x must be bf16 [rows, {spec.x_stride}], got {x.dtype} "
                        f"{x.shape}")
    return np.ascontiguousarray(x[:, :spec.k])


def normalized_x(spec: DenseQNormSpec, x: np.ndarray, norm_w: np.ndarray,
                 eps: float) -> np.ndarray:
    """xn: bitwise what the kernel multiplies (and what attn_prep writes to attn.qr)."""
    return norm_ref.rmsnorm_ref(q_half(spec, x), np.asarray(norm_w, np.float32), eps)


def dense_qnorm_ref(spec: DenseQNormSpec, x: np.ndarray, norm_w: np.ndarray, eps: float,
                    w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """What the kernel writes, up to the fp32 summation order of the product: bf16 [rows, N]."""
    return dr.dense_ref(spec.base(), normalized_x(spec, x, norm_w, eps), w, s)
