"""Split RMSNorm: the head of each row normed, its tail copied out (spec, grid rule, reference).

    y[r, :]    = bf16( (x[r, :W] * rstd[r]) * w ),   rstd[r] = 1 / sqrt( sum x[r, :W]^2 / W + eps )
    tail[r, :] = x[r, W:W+T]                         (copied bit for bit)

x is BF16 [rows, W + T] (row stride W + T), w FP32 [W], y BF16 [rows, W], tail BF16 [rows, T].
The attention's fused wq_a|wkv linear writes [R, q_lora | 512]: this one launch turns it into the
q latent after q_norm (model doc §2.2 A3: the indexer's and wq_b's input) and the raw kv latent
[R, 512] the SWA insert reads (that kernel applies kv_norm itself). W, T are compile-time
constants, rows a runtime u32, eps a runtime f32 > 0.

The normed head is `kernels/norm.py`'s RMSNorm of width W (the same thread groups, summation order
and instructions; only its loads use the row stride W + T), so `rmsnorm_ref` replays it bitwise.
Each thread group also copies its row's tail, T / 8 / threads_per_row 16-byte vectors per thread.

PTX ABI: (u64 x, u64 weight, u64 out, u64 tail, u32 rows, f32 eps); every pointer 16-byte
aligned, out and tail disjoint from x, rows * (W + T) < 2**31.
Bytes moved: rows * (W + T) * 2 read + rows * (W + T) * 2 written + 4 W (weight).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels import norm_ref
from kernels.common_ref import (
    BF16,
    BF16_PER_VECTOR,
    H200_NUM_SMS,
    check_rows,
    params_dict,
    persistent_grid,
)

PARAMS = (("x", "u64"), ("weight", "u64"), ("out", "u64"), ("tail", "u64"), ("rows", "u32"),
          ("eps", "f32"))
TAIL_REGISTERS = 8          # a tail vector in flight (4) plus its addresses, per thread


@dataclass(frozen=True)
class SplitNormSpec:
    """One compiled split RMSNorm: head width W (normed), tail width T (copied), fp32 weight."""

    name: str
    width: int
    tail: int
    threads_per_row: int
    vecs_per_thread: int
    ctas_per_sm: int
    params: tuple[tuple[str, str], ...] = PARAMS
    block: tuple[int, int, int] = (norm_ref.CTA_THREADS, 1, 1)
    smem_bytes: int = 0
    weight_dtype: str = "f32"

    @property
    def row_stride(self) -> int:
        return self.width + self.tail

    @property
    def tail_vecs_per_thread(self) -> int:
        return self.tail // BF16_PER_VECTOR // self.threads_per_row

    @property
    def rows_per_cta(self) -> int:
        return max(1, self.block[0] // self.threads_per_row)

    @property
    def max_ctas(self) -> int:
        return H200_NUM_SMS * self.ctas_per_sm

    def norm_spec(self) -> norm_ref.RmsNormSpec:
        """The RMSNorm of the head (what the kernel's shared code is parameterised by)."""
        return norm_ref.RmsNormSpec(self.name, self.width, self.weight_dtype,
                                    self.threads_per_row, self.vecs_per_thread, self.ctas_per_sm,
                                    self.params, self.block, self.smem_bytes)

    def grid(self, rows: int) -> tuple[int, int, int]:
        check_rows(rows, self.name)
        if rows * self.row_stride >= 2**31:
            raise ValueError(f"{self.name}: {rows} rows exceed i32 element indexing")
        return persistent_grid(rows, self.rows_per_cta, self.max_ctas)

    def bytes_moved(self, rows: int) -> int:
        return 2 * rows * self.row_stride * 2 + 4 * self.width

    def to_dict(self) -> dict:
        return {"family": "split_norm", "name": self.name, "width": self.width,
                "tail": self.tail, "weight_dtype": self.weight_dtype,
                "threads_per_row": self.threads_per_row,
                "vecs_per_thread": self.vecs_per_thread, "ctas_per_sm": self.ctas_per_sm,
                "params": params_dict(self.params), "block": list(self.block),
                "smem_bytes": self.smem_bytes, "rows_per_cta": self.rows_per_cta,
                "max_ctas": self.max_ctas}


def make_spec(width: int, tail: int) -> SplitNormSpec:
    """The kernel normalising `width` head columns and copying `tail` columns of each row."""
    threads, vecs = norm_ref.row_geometry(width)
    if threads > norm_ref.WARP:
        raise ValueError(f"split RMSNorm width {width}: {threads} threads per row; the split "
                         f"kernel takes rows a warp or less wide (width <= 2048)")
    if tail <= 0 or tail % (BF16_PER_VECTOR * threads):
        raise ValueError(f"split RMSNorm tail {tail}: must be a positive multiple of "
                         f"{BF16_PER_VECTOR * threads} ({threads} threads of 16-byte vectors)")
    # The RMSNorm's register budget plus a tail vector; ptxas caps registers to fit this many.
    regs = -(-(2 * 4 * vecs + 32 + TAIL_REGISTERS) // 8) * 8
    ctas = max(1, min(norm_ref.REGISTERS_PER_SM // (regs * norm_ref.CTA_THREADS),
                      norm_ref.MAX_THREADS_PER_SM // norm_ref.CTA_THREADS))
    smem = 4 * width                               # the weight as fp32
    return SplitNormSpec(f"split_rmsnorm_d{width}_t{tail}_wf32", width, tail, threads, vecs,
                         ctas, smem_bytes=smem)


def specs_for(cfg) -> list[SplitNormSpec]:
    """The attention's q_norm | kv split of the fused wq_a|wkv output (model doc §2.2 A1, A3)."""
    return [make_spec(cfg.q_lora_rank, cfg.head_dim)]


def split_norm_ref(x: np.ndarray, w: np.ndarray, width: int,
                   eps: float) -> tuple[np.ndarray, np.ndarray]:
    """Exactly what the kernel writes: (bf16 [rows, width] normed head, bf16 [rows, T] tail)."""
    if x.ndim != 2 or x.dtype != BF16 or not 0 < width < x.shape[1]:
        raise TypeError(f"split RMSNorm x must be bf16 [rows, W + T] with 0 < W={width} < its "
                        f"width, got {x.dtype} {x.shape}")
    w = np.asarray(w)
    if w.dtype != np.float32:
        raise TypeError(f"split RMSNorm weight must be f32 [{width}], got {w.dtype} {w.shape}")
    return norm_ref.rmsnorm_ref(np.ascontiguousarray(x[:, :width]), w, eps), x[:, width:].copy()
