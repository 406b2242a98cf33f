"""Shared, DSL-free helpers of the kernel families: ABI types, grid rules, bf16 rounding, byte sizes."""
from __future__ import annotations

import ml_dtypes
import numpy as np

H200_NUM_SMS = 132
H200_HBM_BYTES_PER_S = 4.8e12
VECTOR_BYTES = 16                   # one ld/st.global.v4.b32
BF16_PER_VECTOR = VECTOR_BYTES // 2
ABI_TYPES = ("u64", "u32", "i32", "f32")
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPE_BYTES = {"bf16": 2, "f32": 4, "i32": 4}
NUMPY_DTYPES = {"bf16": BF16, "f32": np.dtype(np.float32), "i32": np.dtype(np.int32)}


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def check_rows(rows: int, who: str) -> int:
    """A launch needs at least one row; an empty batch launches nothing (the caller skips it)."""
    if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows < 1:
        raise ValueError(f"{who}: rows must be a positive integer, got {rows!r}")
    if rows >= 2**31:
        raise ValueError(f"{who}: rows={rows} exceeds the kernel's i32 row index")
    return int(rows)


def persistent_grid(work_items: int, items_per_cta: int, max_ctas: int) -> tuple[int, int, int]:
    """Grid of a grid-stride kernel: one CTA per `items_per_cta` items, capped at `max_ctas`."""
    return (min(ceil_div(work_items, items_per_cta), max_ctas), 1, 1)


def to_bf16(x: np.ndarray) -> np.ndarray:
    """Round to bf16 with round-to-nearest-even (what cvt.rn.bf16x2.f32 does)."""
    return np.asarray(x, dtype=np.float32).astype(BF16)


def as_f32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


def bf16_ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| in units of bf16 ulps, counted on the ordered integer line (0 and -0 are 0 apart)."""
    def ordered(x):
        bits = np.asarray(x, dtype=BF16).view(np.uint16).astype(np.int32)
        return np.where(bits & 0x8000, 0x8000 - bits, bits)   # monotone map of the sign-magnitude bits
    return np.abs(ordered(a) - ordered(b))


def params_dict(params: tuple[tuple[str, str], ...]) -> list[list[str]]:
    for name, kind in params:
        if kind not in ABI_TYPES:
            raise ValueError(f"parameter {name!r} has ABI type {kind!r}; expected one of {ABI_TYPES}")
    return [[name, kind] for name, kind in params]
