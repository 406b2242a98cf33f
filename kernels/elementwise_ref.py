"""Elementwise kernels: specs, grid rules, byte formulas and NumPy references (all exact).

Two kinds: the residual add, and the stream broadcast that starts the mHC residual streams.

Residual add (one fp32 add, RNE):

    out[r, :] = bf16( float(a[r, :]) + float(b[r, :]) )

a is FP32 (all-reduce partials) or BF16 [rows, D], b is BF16 [rows, D] (the residual), out is BF16
[rows, D] and may alias b (or a when a is bf16): every element is read before it is written by
the same thread. D is a compile-time constant, rows a runtime u32.

PTX ABI: (u64 a, u64 b, u64 out, u32 rows). Bytes moved: rows * D * (sizeof(a) + 2 + 2).
The kernel does one fp32 add and one round-to-nearest-even per element, as does the reference, so
the two agree bitwise.

Stream broadcast (a copy): out[r, s, :] = x[r, :] for s < S, x BF16 [rows, D], out BF16 [rows, S, D]
(not aliasing x). The step's first layer needs the residual streams X = S copies of the embedding
(model doc §2.1): the 1-stream mHC kernel reads the embedding itself, but the FFN's mHC (or the
Engram gate) of that layer reads all S streams. PTX ABI: (u64 x, u64 out, u32 rows). Bytes moved:
rows * D * 2 * (1 + S).
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
BROADCAST_PARAMS = (("x", "u64"), ("out", "u64"), ("rows", "u32"))


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


# ---- stream broadcast ----------------------------------------------------------------------------

@dataclass(frozen=True)
class BroadcastSpec:
    """One compiled stream broadcast: the row width and the stream count are baked in."""

    name: str
    width: int
    streams: int
    params: tuple[tuple[str, str], ...] = BROADCAST_PARAMS
    block: tuple[int, int, int] = (CTA_THREADS, 1, 1)
    smem_bytes: int = 0

    @property
    def chunks_per_row(self) -> int:
        return self.width // BF16_PER_VECTOR      # one 16-byte load, `streams` 16-byte stores

    @property
    def max_ctas(self) -> int:
        return H200_NUM_SMS * CTAS_PER_SM

    def grid(self, rows: int) -> tuple[int, int, int]:
        check_rows(rows, self.name)
        if rows * self.streams * self.width >= 2**31:
            raise ValueError(f"{self.name}: rows * streams * width exceeds i32 indexing")
        return persistent_grid(rows * self.chunks_per_row, CTA_THREADS, self.max_ctas)

    def bytes_moved(self, rows: int) -> int:
        return broadcast_bytes(rows, self.width, self.streams)

    def to_dict(self) -> dict:
        return {"family": "elementwise", "name": self.name, "kind": "broadcast",
                "width": self.width, "streams": self.streams, "params": params_dict(self.params),
                "block": list(self.block), "smem_bytes": self.smem_bytes,
                "max_ctas": self.max_ctas}


def make_broadcast_spec(width: int, streams: int) -> BroadcastSpec:
    if width <= 0 or width % BF16_PER_VECTOR:
        raise ValueError(f"stream broadcast: width {width} must be a positive multiple of 8")
    if streams < 1:
        raise ValueError(f"stream broadcast: streams must be >= 1, got {streams}")
    return BroadcastSpec(f"broadcast_streams_bf16_d{width}_s{streams}", width, streams)


def broadcast_bytes(rows: int, width: int, streams: int) -> int:
    """Bytes the kernel must move: read x once, write it `streams` times."""
    return rows * width * 2 * (1 + streams)


def broadcast_ref(x: np.ndarray, streams: int) -> np.ndarray:
    """Exactly what the kernel writes: [rows, streams, D], every stream a bitwise copy of x."""
    if x.dtype != BF16 or x.ndim != 2:
        raise TypeError(f"stream broadcast: x must be bf16 [rows, D], got {x.dtype} {x.shape}")
    return np.repeat(x[:, None, :], streams, axis=1)
