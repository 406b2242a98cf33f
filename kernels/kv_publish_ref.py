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
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels import kvrecord_ref, rope_ref
from kernels.common_ref import ceil_div, check_rows, params_dict
from kernels.norm_ref import rmsnorm_ref
from loader.formats import bf16_round

HEAD_DIM = kvrecord_ref.HEAD_DIM
ROWS_PER_CTA = 4                 # one warp per row
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

    def grid(self, rows: int) -> tuple[int, int, int]:
        check_rows(rows, self.name)
        return (ceil_div(rows, ROWS_PER_CTA), 1, 1)

    def bytes_moved(self, rows: int) -> int:
        return rows * (HEAD_DIM * 2 + 4 + 8 + rope_ref.TABLE_BYTES_PER_POSITION
                       + kvrecord_ref.KV_RECORD_BYTES) + HEAD_DIM * 4

    def to_dict(self) -> dict:
        return {"family": "kv_publish", "name": self.name, "kind": self.kind,
                "head_dim": self.head_dim, "params": params_dict(self.params),
                "block": list(self.block), "smem_bytes": self.smem_bytes}


def make_swa_spec(head_dim: int = HEAD_DIM) -> KvPublishSpec:
    if head_dim != HEAD_DIM:
        raise ValueError(f"kv_swa_insert: head_dim {head_dim}; the 584-byte record needs 512")
    return KvPublishSpec(f"kv_swa_insert_d{head_dim}", "swa_insert", head_dim, SWA_PARAMS)


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
