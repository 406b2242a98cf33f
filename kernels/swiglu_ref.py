"""Clamped SwiGLU of a fused [gate | up] row: spec, grid rule, byte formula and NumPy reference.

    h[r, i] = bf16( silu(min(g, L)) * clip(u, -L, L) ),   g = h13[r, i], u = h13[r, I + i]

h13 is BF16 [rows, 2I] (the shared expert's fused w1|w3 output: gate columns first, then up), h
is BF16 [rows, I]; L = swiglu_limit. I and L are compile-time constants, rows a runtime u32. This
is model doc §2.2 F3's activation (`moe_ref.shared_expert`: bf16 h13 in, bf16 h out), between the
two W8A16 launches of the shared expert.

PTX ABI: (u64 h13, u64 out, u32 rows); both 16-byte aligned, out must not overlap h13 (a thread
reads gate and up from two halves of a row that other threads' outputs would cover).
Bytes moved: rows * I * (4 + 2).

Numerics: the kernel computes silu as g / (1 + 2^(-g * log2 e)) with ex2.approx (the routed
experts' `kernels.moe_ptx.swiglu`, the same instructions), the reference as g / (1 + exp(-g)) in
float32. The two fp32 results differ by a few fp32 ulps (ex2.approx: 2^-22 relative), far below
bf16's half ulp (2^-9 relative), so the bf16 outputs are equal except where the fp32 value lies
within those few ulps of a bf16 rounding boundary: there they differ by one bf16 ulp
(`swiglu_tolerance`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.common_ref import (
    BF16,
    BF16_PER_VECTOR,
    H200_NUM_SMS,
    check_rows,
    params_dict,
    persistent_grid,
    to_bf16,
)
from kernels.moe_ref import swiglu_clamped

CTA_THREADS = 256
CTAS_PER_SM = 2048 // CTA_THREADS
PARAMS = (("h13", "u64"), ("out", "u64"), ("rows", "u32"))


@dataclass(frozen=True)
class SwigluSpec:
    """One compiled SwiGLU: the intermediate width I and the clamp L are baked in."""

    name: str
    inter: int
    limit: float
    params: tuple[tuple[str, str], ...] = PARAMS
    block: tuple[int, int, int] = (CTA_THREADS, 1, 1)
    smem_bytes: int = 0

    @property
    def chunks_per_row(self) -> int:
        return self.inter // BF16_PER_VECTOR      # 8 outputs per thread per step

    @property
    def max_ctas(self) -> int:
        return H200_NUM_SMS * CTAS_PER_SM

    def grid(self, rows: int) -> tuple[int, int, int]:
        check_rows(rows, self.name)
        if rows * 2 * self.inter >= 2**31:
            raise ValueError(f"{self.name}: rows * 2I = {rows * 2 * self.inter} exceeds i32 "
                             "indexing")
        return persistent_grid(rows * self.chunks_per_row, CTA_THREADS, self.max_ctas)

    def bytes_moved(self, rows: int) -> int:
        return swiglu_bytes(rows, self.inter)

    def to_dict(self) -> dict:
        return {"family": "swiglu", "name": self.name, "inter": self.inter,
                "limit": self.limit, "params": params_dict(self.params),
                "block": list(self.block), "smem_bytes": self.smem_bytes,
                "max_ctas": self.max_ctas}


def make_spec(inter: int, limit: float) -> SwigluSpec:
    if inter <= 0 or inter % BF16_PER_VECTOR:
        raise ValueError(f"swiglu: intermediate width {inter} must be a positive multiple of "
                         f"{BF16_PER_VECTOR}")
    limit = float(np.float32(limit))
    if not (np.isfinite(limit) and limit > 0):
        raise ValueError(f"swiglu: clamp limit {limit} must be finite and positive")
    tag = f"{limit:g}".replace(".", "p").replace("+", "")
    return SwigluSpec(f"swiglu_bf16_i{inter}_l{tag}", inter, limit)


def specs_for(cfg, tp: int) -> list[SwigluSpec]:
    """The shared experts' SwiGLU at this rank's widths (backbone; DSpark when it differs)."""
    rs = cfg.rank_shapes(tp)
    return [make_spec(inter, cfg.swiglu_limit)
            for inter in sorted({rs.shared_inter, rs.dspark_moe_inter})]


def swiglu_bytes(rows: int, inter: int) -> int:
    """Read gate and up (bf16), write h (bf16)."""
    return rows * inter * (4 + 2)


def swiglu_ref(h13: np.ndarray, limit: float) -> np.ndarray:
    """bf16 [rows, I] from bf16 [rows, 2I]: `moe_ref.shared_expert`'s activation, rounded once."""
    if h13.dtype != BF16 or h13.ndim != 2 or h13.shape[1] % 2:
        raise TypeError(f"swiglu: h13 must be bf16 [rows, 2I], got {h13.dtype} {h13.shape}")
    inter = h13.shape[1] // 2
    return to_bf16(swiglu_clamped(h13[:, :inter], h13[:, inter:], limit))


def swiglu_tolerance(want: np.ndarray) -> np.ndarray:
    """Per element |kernel - reference|: one bf16 ulp of the reference (module docstring), i.e.
    2^-7 |want| (an ulp is at most 2^-7 of the value), plus the smallest bf16 subnormal."""
    return 2.0**-7 * np.abs(want.astype(np.float64)) + 2.0**-133
