"""Embedding lookup kernel: spec, grid rule, byte formula and the reference of what it writes.

One launch turns R token ids (int32) into R BF16 rows of width D from this rank's table:

  out[r, :] = table[id_r - vocab_offset, :]   if vocab_offset <= id_r < vocab_offset + table_rows
  out[r, :] = 0                               otherwise

Vocab-parallel (model doc §2.1 item 1): each rank holds `vocab / tp` rows starting at its
`vocab_offset`; exactly one rank owns a valid id, so the all-reduce AR-0 of the ranks' outputs is
the embedding, exactly (`executor.reference.step.embed`). Replicated variant (§2.1, the
alternative): the same kernel on the whole table (`table_rows = vocab`, `vocab_offset = 0`) writes
the embedding itself and removes AR-0. An id outside the whole vocabulary gives zeros on every
rank; the caller validates ids (the kernel cannot raise).

How: one thread per 16-byte vector of output (D/8 per row), grid-stride over R * D/8 vectors. Each
thread reads its row's id (an L1 hit after the row's first thread), then copies or zero-fills.

PTX ABI: (u64 token_ids, u64 table, u64 out, u32 rows, u32 vocab_offset); table and out 16-byte
aligned, token_ids int32 [rows], vocab_offset < 2**31.
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
)

CTA_THREADS = 128
CTAS_PER_SM = 4                   # one wave covers 67584 vectors: R = 105 rows of D = 5120
PARAMS = (("token_ids", "u64"), ("table", "u64"), ("out", "u64"), ("rows", "u32"),
          ("vocab_offset", "u32"))


@dataclass(frozen=True)
class EmbedSpec:
    """One compiled embedding lookup: width and table rows are baked in, the offset is not."""

    name: str
    width: int
    table_rows: int
    params: tuple[tuple[str, str], ...] = PARAMS
    block: tuple[int, int, int] = (CTA_THREADS, 1, 1)
    smem_bytes: int = 0

    @property
    def vectors_per_row(self) -> int:
        return self.width // BF16_PER_VECTOR

    @property
    def max_ctas(self) -> int:
        return H200_NUM_SMS * CTAS_PER_SM

    def grid(self, rows: int) -> tuple[int, int, int]:
        check_rows(rows, self.name)
        return persistent_grid(rows * self.vectors_per_row, CTA_THREADS, self.max_ctas)

    def bytes_moved(self, rows: int) -> int:
        return embed_bytes(rows, self.width)

    def to_dict(self) -> dict:
        return {"family": "embed", "name": self.name, "width": self.width,
                "table_rows": self.table_rows, "params": params_dict(self.params),
                "block": list(self.block), "smem_bytes": self.smem_bytes,
                "max_ctas": self.max_ctas}


def make_spec(width: int, table_rows: int) -> EmbedSpec:
    if width <= 0 or width % BF16_PER_VECTOR:
        raise ValueError(f"embed width {width} must be a positive multiple of {BF16_PER_VECTOR}")
    if table_rows < 1 or table_rows * width >= 2**31:
        raise ValueError(f"embed table of {table_rows} rows x {width} exceeds the kernel's i32 "
                         "element offsets")
    return EmbedSpec(f"embed_bf16_d{width}_v{table_rows}", width, table_rows)


def embed_specs(cfg, tp: int) -> list[EmbedSpec]:
    """The vocab-parallel lookup (vocab/tp rows) and, for tp > 1, the replicated one (vocab rows)."""
    rows = {cfg.vocab_size // tp, cfg.vocab_size}
    return [make_spec(cfg.hidden_size, r) for r in sorted(rows)]


def embed_bytes(rows: int, width: int) -> int:
    """Bytes that must move: ids, R table rows read, R rows written (zero rows still written)."""
    return rows * 4 + 2 * rows * width * 2


def embed_ref(token_ids: np.ndarray, table: np.ndarray, vocab_offset: int) -> np.ndarray:
    """What the kernel writes: BF16 [R, D], this rank's rows or zeros."""
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or ids.dtype != np.int32:
        raise TypeError(f"embed token_ids must be int32 [R], got {ids.dtype} {ids.shape}")
    if table.ndim != 2 or table.dtype != BF16:
        raise TypeError(f"embed table must be bf16 [rows, D], got {table.dtype} {table.shape}")
    local = ids.astype(np.int64) - int(vocab_offset)
    mine = (local >= 0) & (local < table.shape[0])
    out = np.zeros((ids.shape[0], table.shape[1]), BF16)
    out[mine] = table[local[mine]]
    return out


def launch_check(spec: EmbedSpec, rows: int, vocab_offset: int) -> None:
    """Host-side checks before a launch (the kernel cannot raise)."""
    check_rows(rows, spec.name)
    if not 0 <= vocab_offset < 2**31:
        raise ValueError(f"{spec.name}: vocab_offset {vocab_offset} must be in [0, 2**31)")


def predicted_us(rows: int, width: int = 5120) -> float:
    """HBM floor of the bytes plus ~2 us of launch and latency (a copy of R rows)."""
    return 2.0 + embed_bytes(rows, width) / 4.8e6
