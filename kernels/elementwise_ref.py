"""Residual add: specs, grid rule, byte formula and the NumPy reference (exact: one fp32 add, RNE).

    out[r, :] = bf16( float(a[r, :]) + float(b[r, :]) )

a is FP32 (all-reduce partials) or BF16 [rows, D], b is BF16 [rows, D] (the residual), out is BF16
[rows, D] and may alias b (or a when a is bf16): every element is read before it is written by
the same thread. D is a compile-time constant, rows a runtime u32.

PTX ABI: (u64 a, u64 b, u64 out, u32 rows). Bytes moved: rows * D * (sizeof(a) + 2 + 2).
The kernel does one fp32 add and one round-to-nearest-even per element, as does the reference, so
the two agree bitwise.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.common_ref import (
    BF16,
    BF16_PER_VECTOR,
    DTYPE_BYTES,
    H200_NUM_SMS,
    check_rows,
    params_dict,
    persistent_grid,
    to_bf16,
)

CTA_THREADS = 256
CTAS_PER_SM = 2048 // CTA_THREADS
A_DTYPES = ("f32", "bf16")
PARAMS = (("a", "u64"), ("b", "u64"), ("out", "u64"), ("rows", "u32"))


@dataclass(frozen=True)
class ResidualAddSpec:
    """One compiled residual add: the row width and the dtype of `a` are baked in."""

    name: str
    width: int
    a_dtype: str                        # "f32" | "bf16"
    params: tuple[tuple[str, str], ...] = PARAMS
    block: tuple[int, int, int] = (CTA_THREADS, 1, 1)
    smem_bytes: int = 0

    @property
    def chunks_per_row(self) -> int:
        return self.width // BF16_PER_VECTOR      # 8 elements per thread per step

    @property
    def max_ctas(self) -> int:
        return H200_NUM_SMS * CTAS_PER_SM

    def grid(self, rows: int) -> tuple[int, int, int]:
        check_rows(rows, self.name)
        if rows * self.width >= 2**31:
            raise ValueError(f"{self.name}: rows * width = {rows * self.width} exceeds i32 indexing")
        return persistent_grid(rows * self.chunks_per_row, CTA_THREADS, self.max_ctas)

    def bytes_moved(self, rows: int) -> int:
        return residual_add_bytes(rows, self.width, self.a_dtype)

    def to_dict(self) -> dict:
        return {"family": "elementwise", "name": self.name, "width": self.width,
                "a_dtype": self.a_dtype, "params": params_dict(self.params),
                "block": list(self.block), "smem_bytes": self.smem_bytes,
                "max_ctas": self.max_ctas}


def make_spec(width: int, a_dtype: str) -> ResidualAddSpec:
    if a_dtype not in A_DTYPES:
        raise ValueError(f"residual add: a dtype {a_dtype!r}, expected one of {A_DTYPES}")
    if width <= 0 or width % BF16_PER_VECTOR:
        raise ValueError(f"residual add: width {width} must be a positive multiple of 8")
    return ResidualAddSpec(f"residual_add_{a_dtype}_bf16_d{width}", width, a_dtype)


def residual_add_bytes(rows: int, width: int, a_dtype: str = "f32") -> int:
    """Bytes the kernel must move: read a and b, write out."""
    return rows * width * (DTYPE_BYTES[a_dtype] + 2 + 2)


def residual_add_ref(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Exactly what the kernel computes: bf16(float32(a) + float32(b))."""
    if a.dtype not in (np.float32, BF16) or b.dtype != BF16 or a.shape != b.shape or a.ndim != 2:
        raise TypeError(f"residual add: a f32/bf16 and b bf16 of one [rows, D] shape expected, got "
                        f"a {a.dtype} {a.shape}, b {b.dtype} {b.shape}")
    return to_bf16(a.astype(np.float32) + b.astype(np.float32))


def residual_add_f64(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Float64 ground truth (the add is exact in float64 for these inputs; only bf16 rounds)."""
    return a.astype(np.float64) + b.astype(np.float64)
