"""The routed-MoE weight repack (load time, the kernels' only copy) and its exact decode.

The layout is described in `kernels/moe_kernel_ref.py`'s docstring (which re-exports these
names); the constants live in `kernels/moe_shape_ref.py`. NumPy only.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from kernels.common_ref import ceil_div
from kernels.moe_ref import ExpertShard
from kernels.moe_shape_ref import (
    COL_K,
    KSTEP,
    LANES,
    LUT_HI_BASE,
    LUT_LO_BASE,
    TILE_ROWS,
    MoeShape,
    round_up,
)
from loader.formats import FusedE8M0, fused_e8m0_e4m3_bytes, mxfp4_unpack

E4M3 = ml_dtypes.float8_e4m3fn


# ---- weight repack ------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class PackedSublayer:
    """codes uint8 [E, tiles, cols, 32, 16]; offsets uint8 [E, tiles, groups, 8, 8] (o8 bytes);
    scales float32 [E] (2^(lo-122)): the kernel's only copy of one sublayer of every expert."""

    codes: np.ndarray
    offsets: np.ndarray
    scales: np.ndarray
    rows: int
    k: int


def _w13_row_order(inter: int) -> np.ndarray:
    """Source row of each packed row: tile i = gate 8i..8i+7, then up (I + 8i)..(I + 8i + 7)."""
    tiles = np.arange(inter // 8)[:, None]
    r = np.arange(8)[None, :]
    return np.concatenate([8 * tiles + r, inter + 8 * tiles + r], axis=1).reshape(-1)


def _pack_words(codes: np.ndarray) -> np.ndarray:
    """[E, T, 16, Kp] codes -> [E, T, Kp/64, 32 lanes, 4 words] uint32 (module docstring)."""
    e, t, _, kp = codes.shape
    c = codes.reshape(e, t, 2, 8, kp // COL_K, 2, 2, 4, 4)   # h, g, col, s, half, t, i
    c = c.transpose(0, 1, 4, 3, 7, 5, 2, 6, 8).astype(np.uint32)  # e t col g t s h half i
    mag, sign = c & 7, c >> 3
    i = np.arange(4, dtype=np.uint32)
    lo, hi = (slice(None),) * 7 + (0,), (slice(None),) * 7 + (1,)     # the `half` axis
    word = ((mag[lo] << (4 * i)) | (mag[hi] << (16 + 4 * i))
            | (sign[lo] << (8 * i + 7)) | (sign[hi] << (8 * i + 3))).sum(axis=-1, dtype=np.uint32)
    return word.reshape(e, t, kp // COL_K, LANES, 4)        # word index = 2s + h


def _pack_offsets(offsets: np.ndarray) -> np.ndarray:
    """[E, T, 16, Kp/32] offsets -> [E, T, groups, 8, 8] o8 bytes (byte 2*s4 + h), pad = 1."""
    e, t, _, ksteps = offsets.shape
    groups = ceil_div(ksteps, 4)
    full = np.ones((e, t, 16, groups * 4), np.uint8)
    full[..., :ksteps] = offsets
    o = full.reshape(e, t, 2, 8, groups, 4).transpose(0, 1, 4, 3, 5, 2)   # e t grp g s4 h
    return (o.astype(np.uint16) << 3).astype(np.uint8).reshape(e, t, groups, 8, 8)


def pack_sublayer(fused: FusedE8M0, row_order: np.ndarray | None = None,
                  name: str = "sublayer") -> PackedSublayer:
    """Repack one fused-E8M0 sublayer of all experts ([E, N, K/2] codes, [E, N, K/32] offsets)."""
    codes = mxfp4_unpack(fused.packed, name=f"{name} packed")
    offsets = np.asarray(fused.offsets)
    if codes.ndim != 3 or offsets.shape != (*codes.shape[:2], codes.shape[2] // KSTEP):
        raise ValueError(f"{name}: expected codes [E, N, K] and offsets [E, N, K/32], got "
                         f"{codes.shape} and {offsets.shape}")
    if offsets.size and (offsets.min() < 1 or offsets.max() > 12):
        raise ValueError(f"{name}: fused-E8M0 offsets must be in [1, 12], got "
                         f"[{offsets.min()}, {offsets.max()}]")
    e, n, k = codes.shape
    if n % TILE_ROWS:
        raise ValueError(f"{name}: {n} rows is not a multiple of {TILE_ROWS}")
    if row_order is not None:
        codes, offsets = codes[:, row_order], offsets[:, row_order]
    kp = round_up(k, COL_K)
    codes = np.pad(codes, ((0, 0), (0, 0), (0, kp - k)))
    offsets = np.pad(offsets, ((0, 0), (0, 0), (0, (kp - k) // KSTEP)), constant_values=1)
    t = n // TILE_ROWS
    words = _pack_words(codes.reshape(e, t, TILE_ROWS, kp))
    lo = np.asarray(fused.lo, dtype=np.int64).reshape(e)
    return PackedSublayer(
        codes=words.view(np.uint8).reshape(e, t, kp // COL_K, LANES, 16),
        offsets=_pack_offsets(offsets.reshape(e, t, TILE_ROWS, kp // KSTEP)),
        scales=np.ldexp(np.float32(1.0), lo - 122).astype(np.float32), rows=n, k=k)


@dataclass(frozen=True, eq=False)
class PackedExperts:
    w13: PackedSublayer
    w2: PackedSublayer


def pack_experts(w13: FusedE8M0, w2: FusedE8M0, shape: MoeShape) -> PackedExperts:
    """Both sublayers of every expert; w13 = [gate; up] [E, 2I, D/2], w2 [E, D, I/2]."""
    e, inter, hidden = shape.num_experts, shape.inter, shape.hidden
    if w13.packed.shape != (e, 2 * inter, hidden // 2):
        raise ValueError(f"w13 packed {w13.packed.shape}, expected {(e, 2 * inter, hidden // 2)}")
    if w2.packed.shape != (e, hidden, inter // 2):
        raise ValueError(f"w2 packed {w2.packed.shape}, expected {(e, hidden, inter // 2)}")
    return PackedExperts(pack_sublayer(w13, _w13_row_order(inter), "w13"),
                         pack_sublayer(w2, None, "w2"))


# ---- decode (what the kernel computes from the packed bytes) ------------------------------------

def _prmt(lo: np.ndarray, hi: np.ndarray, sel: np.ndarray) -> np.ndarray:
    """prmt.b32 (default mode) with selector nibbles < 8: byte j = table[(sel >> 4j) & 7]."""
    table = np.stack([(lo >> (8 * b)) & 0xFF for b in range(4)]
                     + [(hi >> (8 * b)) & 0xFF for b in range(4)], axis=-1)
    out = np.zeros(sel.shape, np.uint32)
    for j in range(4):
        idx = ((sel >> (4 * j)) & 7).astype(np.intp)
        out |= np.take_along_axis(table, idx[..., None], axis=-1)[..., 0] << (8 * j)
    return out


def decode_e4m3(packed: PackedSublayer) -> np.ndarray:
    """uint8 E4M3 bytes [E, N, Kp] of a packed sublayer, by the kernel's prmt arithmetic, rows
    in packed order (w13: tile-interleaved gate/up)."""
    e, t, cols = packed.codes.shape[:3]
    words = np.ascontiguousarray(packed.codes).view(np.uint32)       # e t col lane word
    groups = packed.offsets.shape[2]
    o8 = packed.offsets.reshape(e, t, groups, 8, 4, 2).astype(np.uint32)    # e t grp g s4 h
    out = np.zeros((e, t, 2, 8, cols, 2, 2, 4, 4), np.uint8)                # e t h g col s half t i
    for col in range(cols):
        for s in range(2):
            for h in range(2):
                w = words[:, :, col, :, 2 * s + h].reshape(e, t, 8, 4)     # e t g t
                o = o8[:, :, col // 2, :, 2 * (col % 2) + s, h][..., None]  # e t g 1
                lut_lo = (o * 0x01010100 + LUT_LO_BASE) & 0xFFFFFFFF
                lut_hi = (o * 0x01010101 + LUT_HI_BASE) & 0xFFFFFFFF
                sel = w & 0x77777777
                lo = _prmt(lut_lo, lut_hi, sel) | (w & 0x80808080)
                hi = _prmt(lut_lo, lut_hi, sel >> 16) | ((w << 4) & 0x80808080)
                for half, reg in ((0, lo), (1, hi)):
                    for i in range(4):
                        out[:, :, h, :, col, s, half, :, i] = (reg >> (8 * i)) & 0xFF
    return out.reshape(e, t * TILE_ROWS, cols * COL_K)


def effective_weights(packed: PackedSublayer) -> np.ndarray:
    """float32 [E, N, K] = E4M3(decoded byte) * 2^(lo-122), rows in checkpoint order (exact)."""
    values = decode_e4m3(packed).view(E4M3).astype(np.float32)[..., :packed.k]
    values *= packed.scales[:, None, None]
    return values


def expert_shards(packed: PackedExperts, shape: MoeShape) -> list[ExpertShard]:
    """moe_ref's per-expert float32 weights, read back from the packed bytes."""
    w13 = np.empty((shape.num_experts, 2 * shape.inter, shape.hidden), np.float32)
    w13[:, _w13_row_order(shape.inter)] = effective_weights(packed.w13)
    w2 = effective_weights(packed.w2)
    return [ExpertShard(w13[e], w2[e]) for e in range(shape.num_experts)]


def unpacked_e4m3(packed: PackedExperts, shape: MoeShape) -> tuple[np.ndarray, np.ndarray]:
    """(w13 [E, 2I, D], w2 [E, D, I]) E4M3 bytes in checkpoint row order (round-trip checks)."""
    w13 = np.empty((shape.num_experts, 2 * shape.inter, shape.k13), np.uint8)
    w13[:, _w13_row_order(shape.inter)] = decode_e4m3(packed.w13)
    return w13[..., :shape.hidden], decode_e4m3(packed.w2)[..., :shape.inter]


def reference_e4m3(w13: FusedE8M0, w2: FusedE8M0) -> tuple[np.ndarray, np.ndarray]:
    return fused_e8m0_e4m3_bytes(w13), fused_e8m0_e4m3_bytes(w2)
