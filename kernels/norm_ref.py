"""RMSNorm: specs, grid rule, byte formula and the NumPy reference of exactly what the kernel computes.

    y[r, :] = bf16( (x[r, :] * rstd[r]) * w ),   rstd[r] = 1 / sqrt( sum_i x[r, i]^2 / D + eps )

x is BF16 [rows, D], w is BF16 or FP32 [D] (the checkpoint's norm-weight dtype is not settled, so
both are built), y is BF16 [rows, D] and may alias x. D is a compile-time constant, rows a runtime
u32, eps a runtime f32 that must be > 0 (V4.1 uses 1e-20).

PTX ABI: (u64 x, u64 weight, u64 out, u32 rows, f32 eps).

How the kernel sums, which `rmsnorm_ref` replays operation by operation (so the two agree bitwise):
- A group of `threads_per_row` threads owns a row; thread t holds the 16-byte vectors
  k * threads_per_row + t (k = 0..vecs_per_thread-1) and sums their squares in that order, element
  by element, with fp32 fma. A bf16 square has at most 16 significant bits, so x*x is exact in fp32
  and `acc + x*x` in NumPy rounds exactly as `fma(x, x, acc)` does (x below ~1e-19, whose square
  is subnormal, is the exception; tests draw from normal ranges).
- The partial sums meet in a butterfly over the group's lanes (offsets 16, 8, .., 1 within a warp),
  then, for rows wider than a warp, warp totals are added in warp order through shared memory.
- mean = total / D (div.rn), rstd = 1 / sqrt(mean + eps) (sqrt.rn, rcp.rn), y = (x * rstd) * w:
  IEEE-rounded operations with no add to contract, so NumPy float32 reproduces them.

All-zero row: mean = 0, rstd = 1/sqrt(eps) (1e10 at eps = 1e-20, finite), y = 0 exactly. eps = 0
would give 0 * inf = NaN there, which is why eps must be positive.

Bytes moved per launch: rows * D * 2 (x) + rows * D * 2 (y) + D * sizeof(w).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.common_ref import (
    BF16,
    BF16_PER_VECTOR,
    DTYPE_BYTES,
    H200_NUM_SMS,
    ceil_div,
    check_rows,
    params_dict,
    persistent_grid,
    to_bf16,
)

WARP = 32
CTA_THREADS = 128                 # 4 warps: one row of D=5120, or 4..8 narrower rows per CTA
MAX_VECS_PER_THREAD = 8           # 8 x 16-byte loads in flight per thread per row at most
REGISTERS_PER_SM = 65536
MAX_THREADS_PER_SM = 2048
SMEM_PER_SM = 228 * 1024          # shared memory per SM, 1 KB of it reserved per resident CTA
WEIGHT_DTYPES = ("bf16", "f32")
PARAMS = (("x", "u64"), ("weight", "u64"), ("out", "u64"), ("rows", "u32"), ("eps", "f32"))


def row_geometry(width: int) -> tuple[int, int]:
    """(threads_per_row, vecs_per_thread) for a row of `width` bf16 values.

    Narrow rows take a power-of-two group of <= 32 lanes (a butterfly stays inside it); wide rows
    take whole warps, with at most MAX_VECS_PER_THREAD vectors per thread.
    """
    if width <= 0 or width % BF16_PER_VECTOR:
        raise ValueError(f"RMSNorm width {width} must be a positive multiple of {BF16_PER_VECTOR}")
    vecs = width // BF16_PER_VECTOR
    if vecs <= WARP:
        if vecs & (vecs - 1):
            raise ValueError(f"RMSNorm width {width}: {vecs} vectors is not a power of two")
        return vecs, 1
    for warps in range(1, CTA_THREADS // WARP + 1):
        threads = warps * WARP
        if vecs % threads == 0 and vecs // threads <= MAX_VECS_PER_THREAD:
            return threads, vecs // threads
    raise ValueError(f"RMSNorm width {width} has no row geometry of <= {CTA_THREADS} threads "
                     f"x <= {MAX_VECS_PER_THREAD} vectors")


def default_ctas_per_sm(width: int) -> int:
    """Resident CTAs per SM the kernel is compiled for (`.minnctapersm`: ptxas caps registers to
    fit them, and the build fails on a spill rather than run slowly). The grid of a large launch
    is exactly this many CTAs per SM, so no CTA waits for a second wave. A thread holds two rows
    of x as packed bf16 (4 registers per vector) plus up to 32 registers of addresses, sums and
    temporaries: D=5120/1280 -> 72 registers, 7 CTAs; D=512 -> 48, 10; D<=256 -> 40, 12."""
    _, vecs = row_geometry(width)
    regs = ceil_div(2 * 4 * vecs + 32, 8) * 8
    return max(1, min(REGISTERS_PER_SM // (regs * CTA_THREADS), MAX_THREADS_PER_SM // CTA_THREADS))


@dataclass(frozen=True)
class RmsNormSpec:
    """One compiled RMSNorm kernel: width, weight dtype and occupancy are baked in.

    A CTA holds `rows_per_cta` thread groups, one row each at a time; groups walk rows with a
    grid stride and issue the loads of their next row before normalising the current one.
    """

    name: str
    width: int
    weight_dtype: str                       # "bf16" | "f32"
    threads_per_row: int
    vecs_per_thread: int
    ctas_per_sm: int = 1
    params: tuple[tuple[str, str], ...] = PARAMS
    block: tuple[int, int, int] = (CTA_THREADS, 1, 1)
    smem_bytes: int = 0                     # dynamic shared memory (weight, cross-warp totals)

    @property
    def rows_per_cta(self) -> int:
        return max(1, self.block[0] // self.threads_per_row)

    @property
    def max_ctas(self) -> int:
        return H200_NUM_SMS * self.ctas_per_sm

    def grid(self, rows: int) -> tuple[int, int, int]:
        check_rows(rows, self.name)
        return persistent_grid(rows, self.rows_per_cta, self.max_ctas)

    def bytes_moved(self, rows: int) -> int:
        return rmsnorm_bytes(rows, self.width, self.weight_dtype)

    def to_dict(self) -> dict:
        return {"family": "norm", "name": self.name, "width": self.width,
                "weight_dtype": self.weight_dtype, "threads_per_row": self.threads_per_row,
                "vecs_per_thread": self.vecs_per_thread, "ctas_per_sm": self.ctas_per_sm,
                "params": params_dict(self.params), "block": list(self.block),
                "smem_bytes": self.smem_bytes, "rows_per_cta": self.rows_per_cta,
                "max_ctas": self.max_ctas}


def make_spec(width: int, weight_dtype: str, ctas_per_sm: int | None = None) -> RmsNormSpec:
    """The kernel of (width, weight dtype); `ctas_per_sm` overrides the occupancy (experiments)."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"RMSNorm weight dtype {weight_dtype!r}; expected one of {WEIGHT_DTYPES}")
    threads, vecs = row_geometry(width)
    if CTA_THREADS % threads:
        raise ValueError(f"RMSNorm width {width}: {threads} threads per row do not tile a CTA")
    ctas = default_ctas_per_sm(width) if ctas_per_sm is None else ctas_per_sm
    # Dynamic smem: the weight as fp32, then (rows wider than a warp) 2 slots x warps fp32 totals.
    smem = 4 * width + (2 * 4 * (threads // WARP) if threads > WARP else 0)
    if not 1 <= ctas <= MAX_THREADS_PER_SM // CTA_THREADS or ctas * (smem + 1024) > SMEM_PER_SM:
        raise ValueError(f"RMSNorm width {width}: {ctas} CTAs per SM of {CTA_THREADS} threads and "
                         f"{smem} B shared memory do not fit one SM")
    return RmsNormSpec(f"rmsnorm_bf16_d{width}_w{weight_dtype}", width, weight_dtype, threads,
                       vecs, ctas, smem_bytes=smem)


def norm_widths(cfg) -> tuple[int, ...]:
    """Every RMSNorm width one decode step uses (model doc §2.2), sorted, without repeats.

    hidden (attn_norm, ffn_norm, final norm, Engram's normalised x and keys), q_lora (q_norm),
    head_dim (kv_norm, compressor.norm), index_head_dim (indexer k_norm).
    """
    return tuple(sorted({cfg.hidden_size, cfg.q_lora_rank, cfg.head_dim, cfg.index_head_dim}))


def built_widths(cfg) -> tuple[int, ...]:
    """The widths the bundle builds (both weight dtypes, the checkpoint's being unsettled): hidden
    only, the one the step launches (attn/ffn norm where not fused into mHC, the final norm,
    DSpark's). q_norm runs in attn_prep or split_norm, kv_norm in the SWA insert, compressor.norm
    and k_norm in the compressor's publish; the other norm_widths stay buildable (make_spec)."""
    return (cfg.hidden_size,)


def rmsnorm_bytes(rows: int, width: int, weight_dtype: str = "bf16") -> int:
    """Bytes the kernel must move: read x, write y, read the weight once."""
    return 2 * rows * width * 2 + width * DTYPE_BYTES[weight_dtype]


def check_eps(eps: float) -> np.float32:
    e = np.float32(eps)
    if not np.isfinite(e) or e <= 0:
        raise ValueError(f"RMSNorm eps must be a finite positive float32, got {eps!r}")
    return e


def _check_inputs(x: np.ndarray, w: np.ndarray) -> None:
    if x.ndim != 2 or x.dtype != BF16:
        raise TypeError(f"RMSNorm x must be bf16 [rows, D], got {x.dtype} {x.shape}")
    if w.shape != (x.shape[1],) or w.dtype not in (BF16, np.float32):
        raise TypeError(f"RMSNorm weight must be bf16/f32 [{x.shape[1]}], got {w.dtype} {w.shape}")


def _group_sum(partials: np.ndarray, lanes: int) -> np.ndarray:
    """Butterfly over `lanes` lanes: lane i adds lane i^o for o = lanes/2..1 (fp32, as shfl.bfly)."""
    p = partials
    idx = np.arange(p.shape[1])
    o = lanes // 2
    while o:
        p = p + p[:, idx ^ o]
        o //= 2
    return p


def row_sum_of_squares(x: np.ndarray) -> np.ndarray:
    """fp32 sum of x^2 per row, in the kernel's exact order (see the module docstring)."""
    rows, width = x.shape
    threads, vecs = row_geometry(width)
    sq = np.square(x.astype(np.float32))
    sq = sq.reshape(rows, vecs, threads, BF16_PER_VECTOR)       # [row, k, thread, element]
    acc = np.zeros((rows, threads), np.float32)
    for k in range(vecs):
        for e in range(BF16_PER_VECTOR):
            acc = acc + sq[:, k, :, e]
    lanes = min(threads, WARP)
    acc = np.concatenate([_group_sum(acc[:, w:w + lanes], lanes)
                          for w in range(0, threads, lanes)], axis=1)
    total = acc[:, 0]
    for warp in range(1, ceil_div(threads, WARP)):
        total = total + acc[:, warp * WARP]
    return total


def rmsnorm_ref(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Exactly what the kernel computes: bf16 [rows, D]."""
    _check_inputs(x, w)
    e = check_eps(eps)
    total = row_sum_of_squares(x)
    mean = total / np.float32(x.shape[1])
    rstd = np.float32(1.0) / np.sqrt(mean + e)
    y = (x.astype(np.float32) * rstd[:, None]) * w.astype(np.float32)[None, :]
    return to_bf16(y)


def rmsnorm_f64(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Float64 ground truth of the same formula (not rounded)."""
    _check_inputs(x, w)
    xd = x.astype(np.float64)
    rstd = 1.0 / np.sqrt(np.mean(xd * xd, axis=1) + float(check_eps(eps)))
    return xd * rstd[:, None] * w.astype(np.float64)[None, :]
