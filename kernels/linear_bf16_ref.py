"""BF16-weight linear with few outputs: specs, grid rule, byte formula, reference and tolerance.

    out[r, n] = bf16( sum_k x[r, k] * w[n, k] )        x bf16 [R, K], w bf16 [N, K], out bf16 [R, N]

The step's one such linear is the indexer's head weights (model doc §2.2 A3, `weights_proj`
[n_heads, D] bf16, replicated): too narrow for the W8A16 dense kernels and BF16 in the checkpoint.
N and K are compile-time constants, rows a runtime u32.

Launch: one warp per output column and PROJ_ROW_TILE rows (the compressor projection's walk,
kernels/compressor.py); COLS_PER_CTA warps per CTA, grid (N / COLS_PER_CTA, ceil(R / 8), 1).
PTX ABI: (u64 x, u64 w, u64 out, u32 rows); all 8-byte aligned, out does not overlap x or w.

Numerics: products of bf16 values are exact in fp32; the kernel sums them with fp32 fma in its own
order (per lane over K/128 chunks of 4, then a 5-step butterfly) and rounds once to bf16. The
reference sums exactly (float64) and rounds to fp32 then bf16, as executor/reference/attention.py
`_linear` does, so `linear_tolerance` bounds the kernel's distance to it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.common_ref import BF16, ceil_div, check_rows, params_dict, to_bf16

LANES = 32
COLS_PER_CTA = 4                 # warps (output columns) per CTA
ROW_TILE = 8                     # rows per warp
CHUNK = 4 * LANES                # K values one warp covers per step (8 bytes per lane)
MAX_ROWS = 4096
PARAMS = (("x", "u64"), ("w", "u64"), ("out", "u64"), ("rows", "u32"))


@dataclass(frozen=True)
class LinearBf16Spec:
    """One compiled linear: the output count N and the reduction K are baked in."""

    name: str
    n: int
    k: int
    params: tuple[tuple[str, str], ...] = PARAMS
    block: tuple[int, int, int] = (LANES * COLS_PER_CTA, 1, 1)
    smem_bytes: int = 0

    def grid(self, rows: int) -> tuple[int, int, int]:
        check_rows(rows, self.name)
        if rows > MAX_ROWS:
            raise ValueError(f"{self.name}: {rows} rows, at most {MAX_ROWS}")
        return (self.n // COLS_PER_CTA, ceil_div(rows, ROW_TILE), 1)

    def bytes_moved(self, rows: int) -> int:
        """HBM floor: the weight once, x once, out once."""
        return 2 * (self.n * self.k + rows * self.k + rows * self.n)

    def to_dict(self) -> dict:
        return {"family": "linear_bf16", "name": self.name, "n": self.n, "k": self.k,
                "params": params_dict(self.params), "block": list(self.block),
                "smem_bytes": self.smem_bytes}


def make_spec(n: int, k: int) -> LinearBf16Spec:
    if n <= 0 or n % COLS_PER_CTA or k <= 0 or k % CHUNK:
        raise ValueError(f"linear_bf16: N {n} must be a positive multiple of {COLS_PER_CTA}, "
                         f"K {k} a positive multiple of {CHUNK}")
    return LinearBf16Spec(f"linear_bf16_n{n}_k{k}", n, k)


def spec_of(record_spec: dict) -> LinearBf16Spec:
    """The spec a manifest record's `spec` dict describes (name-checked)."""
    spec = make_spec(record_spec["n"], record_spec["k"])
    if spec.name != record_spec["name"]:
        raise ValueError(f"linear_bf16: manifest record {record_spec['name']!r} is not "
                         f"{spec.name!r}")
    return spec


def indexer_weights_spec(cfg) -> LinearBf16Spec:
    """The indexer's head-weights linear (`attn.indexer.weights_proj`, [n_heads, D])."""
    return make_spec(cfg.index_n_heads, cfg.hidden_size)


def linear_bf16_ref(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """bf16 [R, N]: exact products summed in float64, rounded to fp32, then to bf16."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear_bf16_ref: x {x.shape} and w {w.shape} must be [R, K], [N, K]")
    if x.dtype != BF16 or w.dtype != BF16:
        raise TypeError(f"linear_bf16_ref: x and w must be bf16, got {x.dtype}, {w.dtype}")
    y = x.astype(np.float64) @ w.astype(np.float64).T
    return to_bf16(y.astype(np.float32))


def linear_tolerance(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """|kernel - linear_bf16_ref| bound per element (float64 [R, N]).

    fp32 sums of K exact products in any order: <= (K - 1) 2^-24 sum_k |x_k w_k| (gamma_K); the
    reference's fp32 rounding adds 2^-24 |y|; both then round to bf16, which can split two values
    across a rounding boundary: one bf16 ulp of |y| (2^-7 |y|) plus the smallest subnormal.
    """
    k = x.shape[1]
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    y = np.abs(x64 @ w64.T)
    fp32 = (k - 1) * 2.0**-24 * (np.abs(x64) @ np.abs(w64).T) + 2.0**-24 * y
    return fp32 + 2.0**-7 * (y + fp32) + 2.0**-133
