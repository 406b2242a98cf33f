"""KV publish kernels (A1 kv half, A5-A6): specs, byte formula and the reference of what they write.

`kv_swa_insert_d512`: per real row (slot >= 0), the SWA record of its kv latent (model doc §2.2):

    y     = RMSNorm(kv) (bf16)                      kv = wkv output, bf16 [R, 512]
    entry = y with dims 448..511 RoPE'd at the row's position, rounded to bf16
    cache[slot] = encode_kv_record(entry)           (584 bytes, kernels/kvrecord_ref.py)

exactly as `executor.reference.attention.insert_swa` composes it; padding rows (slot -1) write
nothing. The kernel replays `norm_ref.rmsnorm_ref`'s summation order (one warp per row, the width-512
geometry: lane l holds dims 8l.. and 256 + 8l..), rotates in float64 (exact products, one rounding,
then fp32 and bf16 as `rope_ref.apply_rope` + `bf16_round`), and encodes with the record's ceil
power-of-two rule and RNE E4M3 casts, so its bytes equal the reference's bit for bit.
A position outside [0, num_positions) writes NaN rope values (visible, never an out-of-bounds read).

PTX ABI: (u64 kv, u64 weight, u64 table, u64 positions, u64 slots, u64 cache, u32 rows,
u32 num_positions, f32 eps); kv bf16 [R, 512] 16-byte aligned, weight f32 [512], table f32
[num_positions, 32, 2], positions i32 [R], slots i64 [R], cache u8 [slots, 584].
Bytes moved: R * (512 * 2 + 4 + 8 + 256) read + 584 written per real row + 2 KB weight.

`attn_prep_q{W}_d512` (docs/notes/attn-fusion.md): the fused wq_a|wkv output [R, W + 512] in one
launch, two warps a row: warp 0 is `split_norm`'s q head (qr = RMSNorm(qkv[:, :W]) * q_norm, the
same instructions as kernels/norm.py, so `norm_ref.rmsnorm_ref` replays it bitwise), warp 1 the
SWA insert above on the kv tail (the same code as kv_swa_insert, with the fused row stride). It
replaces split_rmsnorm + kv_swa_insert; nothing writes the raw kv copy any more.
PTX ABI: (u64 qkv, u64 q_weight, u64 kv_weight, u64 table, u64 positions, u64 slots, u64 qr,
u64 cache, u32 rows, u32 num_positions, f32 eps); qkv, qr 16-byte aligned, W a multiple of 256
(one warp of 16-byte vectors), qr disjoint from qkv.
Bytes moved: R * ((W + 512) * 2 + W * 2 + 4 + 8 + 256) + 584 per real row + 4 (W + 512) weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels import kvrecord_ref, rope_ref
from kernels.common_ref import BF16, ceil_div, check_rows, params_dict
from kernels.norm_ref import rmsnorm_ref
from loader.formats import bf16_round

HEAD_DIM = kvrecord_ref.HEAD_DIM
ROWS_PER_CTA = 4                 # one warp per row
PREP_ROWS_PER_CTA = 2            # attn_prep: two warps (q norm, kv insert) per row
PREP_Q_LANES = 32                # attn_prep: the q head is one warp of 16-byte vectors per row
PREP_PARAMS = (("qkv", "u64"), ("q_weight", "u64"), ("kv_weight", "u64"), ("table", "u64"),
               ("positions", "u64"), ("slots", "u64"), ("qr", "u64"), ("cache", "u64"),
               ("rows", "u32"), ("num_positions", "u32"), ("eps", "f32"))
SWA_PARAMS = (("kv", "u64"), ("weight", "u64"), ("table", "u64"), ("positions", "u64"),
              ("slots", "u64"), ("cache", "u64"), ("rows", "u32"), ("num_positions", "u32"),
              ("eps", "f32"))


@dataclass(frozen=True)
class KvPublishSpec:
    name: str
    kind: str
    head_dim: int
    params: tuple[tuple[str, str], ...]
    block: tuple[int, int, int] = (32 * ROWS_PER_CTA, 1, 1)
    smem_bytes: int = 0
    kv_row_stride: int = HEAD_DIM   # elements between rows' kv (q_lora + 512: read in attn.qkv)

    def grid(self, rows: int) -> tuple[int, int, int]:
        check_rows(rows, self.name)
        return (ceil_div(rows, ROWS_PER_CTA), 1, 1)

    def bytes_moved(self, rows: int) -> int:
        return rows * (HEAD_DIM * 2 + 4 + 8 + rope_ref.TABLE_BYTES_PER_POSITION
                       + kvrecord_ref.KV_RECORD_BYTES) + HEAD_DIM * 4

    def to_dict(self) -> dict:
        strided = {"kv_row_stride": self.kv_row_stride} if self.kv_row_stride != HEAD_DIM else {}
        return {"family": "kv_publish", "name": self.name, "kind": self.kind,
                "head_dim": self.head_dim, "params": params_dict(self.params),
                "block": list(self.block), "smem_bytes": self.smem_bytes} | strided


@dataclass(frozen=True)
class AttnPrepSpec:
    """The fused q_norm | kv_norm + RoPE + SWA insert over the wq_a|wkv rows [R, q_width + 512]."""

    name: str
    q_width: int
    head_dim: int
    params: tuple[tuple[str, str], ...] = PREP_PARAMS
    block: tuple[int, int, int] = (64 * PREP_ROWS_PER_CTA, 1, 1)
    kind: str = "attn_prep"

    @property
    def row_stride(self) -> int:
        return self.q_width + self.head_dim

    @property
    def smem_bytes(self) -> int:
        return 4 * self.q_width                    # q_norm's weight as fp32, staged per CTA

    def grid(self, rows: int) -> tuple[int, int, int]:
        check_rows(rows, self.name)
        if rows * self.row_stride >= 2**31:
            raise ValueError(f"{self.name}: {rows} rows exceed i32 element indexing")
        return (ceil_div(rows, PREP_ROWS_PER_CTA), 1, 1)

    def bytes_moved(self, rows: int) -> int:
        per_row = (self.row_stride * 2 + self.q_width * 2 + 4 + 8
                   + rope_ref.TABLE_BYTES_PER_POSITION + kvrecord_ref.KV_RECORD_BYTES)
        return rows * per_row + 4 * self.row_stride

    def to_dict(self) -> dict:
        return {"family": "kv_publish", "name": self.name, "kind": self.kind,
                "q_width": self.q_width, "head_dim": self.head_dim,
                "params": params_dict(self.params), "block": list(self.block),
                "smem_bytes": self.smem_bytes}


def make_attn_prep_spec(q_width: int, head_dim: int = HEAD_DIM) -> AttnPrepSpec:
    """The fused kernel for q latents of `q_width` (a whole number of one-warp 16-byte passes)."""
    if head_dim != HEAD_DIM:
        raise ValueError(f"attn_prep: head_dim {head_dim}; the 584-byte record needs 512")
    if q_width <= 0 or q_width % (PREP_Q_LANES * 8) or q_width // (PREP_Q_LANES * 8) > 8:
        raise ValueError(f"attn_prep: q width {q_width}; one warp normalises it in 16-byte "
                         f"vectors, so it must be a multiple of 256 up to 2048")
    return AttnPrepSpec(f"attn_prep_q{q_width}_d{head_dim}", q_width, head_dim)


def make_swa_spec(head_dim: int = HEAD_DIM, kv_row_stride: int = HEAD_DIM) -> KvPublishSpec:
    """kv_swa_insert over rows of kv_row_stride elements (suffix `_s<stride>` unless 512: the
    fused wq_a|wkv row, the kv half read in place when q_norm is folded into wq_b)."""
    if head_dim != HEAD_DIM:
        raise ValueError(f"kv_swa_insert: head_dim {head_dim}; the 584-byte record needs 512")
    if kv_row_stride < head_dim or kv_row_stride % 8:
        raise ValueError(f"kv_swa_insert: kv row stride {kv_row_stride} must be >= {head_dim} "
                         f"and a multiple of 8 (16-byte loads)")
    name = f"kv_swa_insert_d{head_dim}" + (f"_s{kv_row_stride}" if kv_row_stride != head_dim
                                           else "")
    return KvPublishSpec(name, "swa_insert", head_dim, SWA_PARAMS, kv_row_stride=kv_row_stride)


def swa_entries(kv: np.ndarray, weight: np.ndarray, eps: float, table: rope_ref.RopeTable,
                positions: np.ndarray) -> np.ndarray:
    """[R, 512] float32 entries (bf16 values) the records encode: norm, RoPE, bf16."""
    y = rmsnorm_ref(kv, weight, eps).astype(np.float32)
    return bf16_round(rope_ref.apply_rope(y, np.asarray(positions), table))


def swa_insert_ref(cache: np.ndarray, kv: np.ndarray, weight: np.ndarray, eps: float,
                   table: rope_ref.RopeTable, positions: np.ndarray, slots: np.ndarray) -> None:
    """Write the records of the real rows (slot >= 0) into `cache` [num_slots, 584] in place."""
    slots = np.asarray(slots, np.int64)
    real = slots >= 0
    if np.any(slots >= cache.shape[0]):
        raise ValueError(f"kv_swa_insert: slots {slots[slots >= cache.shape[0]].tolist()} beyond "
                         f"the cache's {cache.shape[0]} records")
    if real.any():
        entries = swa_entries(kv[real], weight, eps, table, np.asarray(positions)[real])
        cache[slots[real]] = kvrecord_ref.encode_kv_record(entries)


def attn_prep_ref(cache: np.ndarray, qkv: np.ndarray, q_weight: np.ndarray,
                  kv_weight: np.ndarray, eps: float, table: rope_ref.RopeTable,
                  positions: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """What attn_prep writes: returns qr bf16 [R, W] (split_norm's head) and writes the records of
    the real rows into `cache` in place (swa_insert_ref of the kv tail)."""
    if qkv.ndim != 2 or qkv.dtype != BF16 or qkv.shape[1] <= HEAD_DIM:
        raise TypeError(f"attn_prep: qkv must be bf16 [rows, W + {HEAD_DIM}], got {qkv.dtype} "
                        f"{qkv.shape}")
    width = qkv.shape[1] - HEAD_DIM
    qr = rmsnorm_ref(np.ascontiguousarray(qkv[:, :width]), q_weight, eps)
    swa_insert_ref(cache, np.ascontiguousarray(qkv[:, width:]), kv_weight, eps, table, positions,
                   slots)
    return qr
