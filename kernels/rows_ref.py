"""Row metadata prep: the caller's int64 row tensors -> the int32 forms the step's kernels read.

    tokens32[r]      = int32(token_ids[r])
    positions32[r]   = int32(positions[r])
    history32[r, 0]  = int32(token_ids[r]),  history32[r, k] = int32(token_history[r, k-1])  (k >= 1)

The caller binds vLLM's dtypes (token ids, positions and the Engram lookback as int64,
executor/bind.py); the embedding, Engram hash, indexer and attention kernels take int32 rows (ids <
2^31, positions < 2^31), and the Engram hash takes the newest-first history [R, max_ngram] with
the row's own token first. One launch at the head of the step converts them, so no kernel reads
two layouts. `history_cols` = 0 (a model without Engram) drops the history. Values are truncated
to their low 32 bits, as `cvt.u32.u64` does (the binding's contract keeps them in range).

PTX ABI: (u64 token_ids, u64 positions, u64 token_history, u64 tokens32, u64 positions32,
u64 history32, u32 rows); with history_cols = 0 token_history and history32 are not touched.
One thread per row, grid-stride over rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.common_ref import check_rows, params_dict

CTA_THREADS = 256
MAX_CTAS = 8
PARAMS = (("token_ids", "u64"), ("positions", "u64"), ("token_history", "u64"),
          ("tokens32", "u64"), ("positions32", "u64"), ("history32", "u64"), ("rows", "u32"))


@dataclass(frozen=True)
class RowsPrepSpec:
    name: str
    history_cols: int                   # max_ngram (0: no Engram)
    params: tuple[tuple[str, str], ...] = PARAMS
    block: tuple[int, int, int] = (CTA_THREADS, 1, 1)
    smem_bytes: int = 0

    def grid(self, rows: int) -> tuple[int, int, int]:
        check_rows(rows, self.name)
        return (min(-(-rows // CTA_THREADS), MAX_CTAS), 1, 1)

    def to_dict(self) -> dict:
        return {"family": "rows", "name": self.name, "history_cols": self.history_cols,
                "params": params_dict(self.params), "block": list(self.block),
                "smem_bytes": self.smem_bytes}


def make_spec(history_cols: int) -> RowsPrepSpec:
    if isinstance(history_cols, bool) or not isinstance(history_cols, int) or history_cols < 0 \
            or history_cols == 1:
        raise ValueError(f"rows prep: history_cols must be 0 or >= 2, got {history_cols!r}")
    return RowsPrepSpec(f"rows_prep_h{history_cols}", history_cols)


def spec_for(cfg) -> RowsPrepSpec:
    return make_spec(cfg.engram_max_ngram_size if cfg.engram_layer_ids else 0)


def rows_prep_ref(token_ids, positions, token_history=None):
    """Exactly what the kernel writes: (tokens32 [R], positions32 [R], history32 [R, n] or None)."""
    low = (lambda a: np.asarray(a, np.int64).astype(np.uint64).astype(np.uint32).view(np.int32))
    tokens32, positions32 = low(token_ids), low(positions)
    if token_history is None:
        return tokens32, positions32, None
    history = np.concatenate([np.asarray(token_ids, np.int64)[:, None],
                              np.asarray(token_history, np.int64)], axis=1)
    return tokens32, positions32, low(history)
