"""RoPE (plain and YaRN, forward and inverse): tables, specs, byte formula and the NumPy reference.

Model doc §2.2 A5/A14: interleaved pairs (GPT-J style) on the LAST 64 dims of each head: pair i is
(x[nope + 2i], x[nope + 2i + 1]), rotated by angle pos * inv_freq[i], i = 0..31. Forward:
    y0 = x0*cos - x1*sin,   y1 = x0*sin + x1*cos
inverse (A14, on attention outputs) rotates by -angle:
    y0 = x0*cos + x1*sin,   y1 = x1*cos - x0*sin
The other dims pass through unchanged (copied when out-of-place).

Angles come from a host-built table, so the kernel and this reference read the same numbers:
`RopeTable.cos_sin` is fp32 [num_positions, 32, 2] = (cos, sin) per pair, angle = fp32(pos *
inv_freq) rounded once as DeepSeek's `precompute_freqs_cis` (torch.outer in fp32) does, cos/sin of
that fp32 angle computed in float64 and rounded to fp32. 256 bytes per position: at the V4.1
maximum of 1,048,576 positions one table is 268,435,456 bytes (256 MiB); decode needs two (plain
theta 1e4 for ratio-0 layers, YaRN theta 1.6e5 for compressed layers).

inv_freq: plain `theta ** (-2i/64)`; YaRN (compressed layers; applied on every compressed layer,
mscale disabled) blends `inv_freq / factor` and `inv_freq` with DeepSeek's linear ramp between the
correction dims of beta_fast and beta_slow at `original_max_position_embeddings`.

Kernel PTX ABI: in place (u64 x, u64 table, u64 positions, u32 rows, u32 num_positions);
out of place (u64 x, u64 out, u64 table, u64 positions, u32 rows, u32 num_positions).
x is BF16 [rows, heads, head_dim], positions int32 [rows]. A position outside [0, num_positions)
yields NaN in that row's rotated dims (never an out-of-bounds read).
Numerics: fp32 math, bf16 out. The compiler picks which product of each output it fuses into an
fma (seen in PTX: y0 = mul, mul, sub; y1 = fma(x0, s, x1*c)), so the kernel rounds 1 or 2 of the
products in fp32 where this reference keeps both exact (float64) and rounds once; an output may
then differ by up to 2**-23 * (|x0| + |x1|) before its bf16 rounding, which cancellation can
make several bf16 ulps of a small result (the GPU test states that bound).
Bytes moved: in place rows*heads*64*2*2 + rows*(4 + 256); out of place rows*heads*head_dim*2*2 +
rows*(4 + 256) (x, y, the position and its table row).
"""
from __future__ import annotations

import math
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

ROPE_DIM = 64
PAIRS = ROPE_DIM // 2
TABLE_BYTES_PER_POSITION = PAIRS * 2 * 4
CTA_THREADS = 256
CTAS_PER_SM = 2048 // CTA_THREADS


# ---- frequencies and tables ------------------------------------------------------------------------

def plain_inv_freq(theta: float, dim: int = ROPE_DIM) -> np.ndarray:
    """theta ** (-2i/dim), i = 0..dim/2-1, in fp32 (as torch computes it)."""
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    return (np.float32(1.0) / np.power(np.float32(theta), exponents)).astype(np.float32)


def yarn_correction_range(beta_fast: float, beta_slow: float, dim: int, theta: float,
                          original_max_pos: int) -> tuple[int, int]:
    """DeepSeek's find_correction_range: the dims rotating beta_fast / beta_slow times over the
    original context, floored / ceiled and clamped to [0, dim-1]."""
    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original_max_pos / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))
    low = math.floor(correction_dim(beta_fast))
    high = math.ceil(correction_dim(beta_slow))
    return max(low, 0), min(high, dim - 1)


def yarn_inv_freq(theta: float, factor: float, original_max_pos: int, beta_fast: float,
                  beta_slow: float, dim: int = ROPE_DIM) -> np.ndarray:
    """DeepSeek-V3/V4 precompute_freqs_cis with YaRN: fp32 inv_freq blended by a linear ramp."""
    freqs = plain_inv_freq(theta, dim)
    low, high = yarn_correction_range(beta_fast, beta_slow, dim, theta, original_max_pos)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                   / np.float32(high - low), 0, 1).astype(np.float32)
    smooth = np.float32(1) - ramp
    return (freqs / np.float32(factor) * (np.float32(1) - smooth) + freqs * smooth).astype(
        np.float32)


@dataclass(frozen=True)
class RopeTable:
    """fp32 (cos, sin) per position and pair: [num_positions, 32, 2], what the kernel reads."""

    kind: str                          # "plain" | "yarn"
    inv_freq: np.ndarray               # fp32 [32]
    cos_sin: np.ndarray                # fp32 [num_positions, 32, 2]

    @property
    def num_positions(self) -> int:
        return self.cos_sin.shape[0]

    @property
    def nbytes(self) -> int:
        return self.cos_sin.nbytes

    @classmethod
    def build(cls, kind: str, inv_freq: np.ndarray, num_positions: int) -> RopeTable:
        if num_positions < 1 or num_positions >= 2**31:
            raise ValueError(f"RoPE table: num_positions {num_positions} outside [1, 2**31)")
        t = np.arange(num_positions, dtype=np.float32)
        angle = (t[:, None] * inv_freq[None, :].astype(np.float32)).astype(np.float64)
        cos_sin = np.stack([np.cos(angle), np.sin(angle)], axis=-1).astype(np.float32)
        return cls(kind, inv_freq.astype(np.float32), np.ascontiguousarray(cos_sin))

    @classmethod
    def plain(cls, cfg, num_positions: int | None = None) -> RopeTable:
        """Ratio-0 layers: theta = rope_theta, no YaRN."""
        return cls.build("plain", plain_inv_freq(cfg.rope_theta),
                         num_positions or cfg.max_position_embeddings)

    @classmethod
    def yarn(cls, cfg, num_positions: int | None = None) -> RopeTable:
        """Compressed (ratio > 0) layers: theta = compress_rope_theta with the config's YaRN."""
        s = cfg.rope_scaling
        inv = yarn_inv_freq(cfg.compress_rope_theta, s.factor, s.original_max_position_embeddings,
                            s.beta_fast, s.beta_slow)
        return cls.build("yarn", inv, num_positions or cfg.max_position_embeddings)

    @classmethod
    def for_ratio(cls, cfg, ratio: int, num_positions: int | None = None) -> RopeTable:
        return cls.yarn(cfg, num_positions) if ratio > 0 else cls.plain(cfg, num_positions)


def table_bytes(num_positions: int) -> int:
    return num_positions * TABLE_BYTES_PER_POSITION


# ---- kernel specs ------------------------------------------------------------------------------

@dataclass(frozen=True)
class RopeSpec:
    """One compiled RoPE kernel: heads, head_dim, direction and in/out-of-place are baked in."""

    name: str
    heads: int
    head_dim: int
    inverse: bool
    in_place: bool
    params: tuple[tuple[str, str], ...]
    block: tuple[int, int, int] = (CTA_THREADS, 1, 1)
    smem_bytes: int = 0

    @property
    def chunks_per_head(self) -> int:
        """8-element chunks a thread step covers per head: the rope dims only, or the whole head."""
        width = ROPE_DIM if self.in_place else self.head_dim
        return width // BF16_PER_VECTOR

    @property
    def max_ctas(self) -> int:
        return H200_NUM_SMS * CTAS_PER_SM

    def grid(self, rows: int) -> tuple[int, int, int]:
        check_rows(rows, self.name)
        if rows * self.heads * self.head_dim >= 2**31:
            raise ValueError(f"{self.name}: {rows} rows exceed i32 element indexing")
        return persistent_grid(rows * self.heads * self.chunks_per_head, CTA_THREADS,
                               self.max_ctas)

    def bytes_moved(self, rows: int) -> int:
        return rope_bytes(rows, self.heads, self.head_dim, self.in_place)

    def to_dict(self) -> dict:
        return {"family": "rope", "name": self.name, "heads": self.heads,
                "head_dim": self.head_dim, "inverse": self.inverse, "in_place": self.in_place,
                "params": params_dict(self.params), "block": list(self.block),
                "smem_bytes": self.smem_bytes, "max_ctas": self.max_ctas}


def make_spec(heads: int, head_dim: int, inverse: bool, in_place: bool) -> RopeSpec:
    if heads < 1 or head_dim < ROPE_DIM or head_dim % BF16_PER_VECTOR:
        raise ValueError(f"RoPE: {heads} heads of {head_dim} dims; need >= 1 head of a multiple "
                         f"of 8 dims >= {ROPE_DIM}")
    io = (("x", "u64"),) if in_place else (("x", "u64"), ("out", "u64"))
    params = io + (("table", "u64"), ("positions", "u64"), ("rows", "u32"),
                   ("num_positions", "u32"))
    name = (f"rope_{'inv' if inverse else 'fwd'}_{'inplace' if in_place else 'copy'}"
            f"_h{heads}_d{head_dim}")
    return RopeSpec(name, heads, head_dim, inverse, in_place, params)


def step_specs(cfg, tp: int) -> list[RopeSpec]:
    """The RoPE kernels the decode step launches at tensor parallelism tp, i.e. the bundle's
    (model doc §2.2): q [R, H/tp, 512] forward in place (A5, after wq_b) and the indexer q
    [R, index_heads, 128] (A10, all index heads on every rank). The others run inside other
    kernels: kv's in the SWA insert (kernels/kv_publish.py), the compressed entries' and index
    keys' in the compressor's publish, A14's inverse in sparse MQA; the inverse and out-of-place
    forms stay buildable (make_spec)."""
    heads = cfg.rank_shapes(tp).heads
    return [make_spec(heads, cfg.head_dim, False, True),
            make_spec(cfg.index_n_heads, cfg.index_head_dim, False, True)]


def rope_bytes(rows: int, heads: int, head_dim: int = 512, in_place: bool = True) -> int:
    """Bytes the kernel must move: x read and written (rope dims only in place), positions, table rows."""
    width = ROPE_DIM if in_place else head_dim
    return rows * heads * width * 2 * 2 + rows * (4 + TABLE_BYTES_PER_POSITION)


# ---- references --------------------------------------------------------------------------------

def _cos_sin_at(table: RopeTable, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp32 cos, sin [rows, 32]; NaN for a position outside the table (as the kernel writes)."""
    pos = np.asarray(positions)
    if pos.ndim != 1 or not np.issubdtype(pos.dtype, np.integer):
        raise TypeError(f"RoPE positions must be a 1-d integer array, got {pos.dtype} {pos.shape}")
    valid = (pos >= 0) & (pos < table.num_positions)
    cs = table.cos_sin[np.where(valid, pos, 0)]
    cs = np.where(valid[:, None, None], cs, np.float32(np.nan))
    return cs[..., 0], cs[..., 1]


def _rotate(x0, x1, cos, sin, inverse: bool):
    """fp32 rotation; float64 intermediates (exact products, one rounding as the kernel's fma)."""
    x0, x1 = x0.astype(np.float64), x1.astype(np.float64)
    c, s = cos.astype(np.float64), sin.astype(np.float64)
    if inverse:
        return (x0 * c + x1 * s).astype(np.float32), (x1 * c - x0 * s).astype(np.float32)
    return (x0 * c - x1 * s).astype(np.float32), (x0 * s + x1 * c).astype(np.float32)


def apply_rope(x: np.ndarray, positions: np.ndarray, table: RopeTable,
               inverse: bool = False) -> np.ndarray:
    """fp32 RoPE on the last 64 dims of x [rows, ..., head_dim] (for fp32 reference pipelines)."""
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] < ROPE_DIM or x.shape[0] != np.asarray(positions).shape[0]:
        raise ValueError(f"RoPE: x {x.shape} needs a last dim >= {ROPE_DIM} and one position per "
                         f"row, got {np.asarray(positions).shape}")
    cos, sin = _cos_sin_at(table, positions)
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (PAIRS,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    out = x.copy()
    pairs = x[..., -ROPE_DIM:].reshape(x.shape[:-1] + (PAIRS, 2))
    y0, y1 = _rotate(pairs[..., 0], pairs[..., 1], cos, sin, inverse)
    out[..., -ROPE_DIM:] = np.stack([y0, y1], axis=-1).reshape(x.shape[:-1] + (ROPE_DIM,))
    return out


def rope_ref(x: np.ndarray, positions: np.ndarray, table: RopeTable,
             inverse: bool = False) -> np.ndarray:
    """Exactly what the kernel computes on bf16 x [rows, heads, head_dim]: bf16 out."""
    if x.dtype != BF16 or x.ndim != 3:
        raise TypeError(f"RoPE kernel input must be bf16 [rows, heads, head_dim], got {x.dtype} "
                        f"{x.shape}")
    out = x.copy()
    out[..., -ROPE_DIM:] = to_bf16(apply_rope(x, positions, table, inverse)[..., -ROPE_DIM:])
    return out


def rope_f64(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray,
             inverse: bool = False) -> np.ndarray:
    """Float64 ground truth from the frequencies (angle pos * inv_freq in float64, no table)."""
    xd = np.asarray(x, dtype=np.float64)
    angle = np.asarray(positions, np.float64)[:, None] * inv_freq.astype(np.float64)[None, :]
    sign = -1.0 if inverse else 1.0
    cos = np.cos(angle)[:, None, :]
    sin = sign * np.sin(angle)[:, None, :]
    out = xd.copy()
    x0, x1 = xd[..., -ROPE_DIM::2], xd[..., -ROPE_DIM + 1::2]
    out[..., -ROPE_DIM::2] = x0 * cos - x1 * sin
    out[..., -ROPE_DIM + 1::2] = x0 * sin + x1 * cos
    return out
