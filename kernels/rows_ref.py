"""Row metadata prep: the caller's int64 row tensors -> the int32 forms the step's kernels read.

    tokens32[r]      = int32(token_ids[r])
    positions32[r]   = int32(positions[r])
    history32[r, 0]  = int32(token_ids[r]),  history32[r, k] = int32(token_history[r, k-1])  (k >= 1)
    row_info[r]      = (position, swa_lo, swa_hi, seq)   (kernels.sparse_mqa_ref.row_info)

row_info follows the attention block rules: causal rows (decode, verify) see p - W + 1 .. p, the
rows of a draft block all see block_start - W .. block_end (their sequence's first and last
positions in this step: a thread scans the step's rows for them), lo clamped at 0; padding rows
(seq_index -1) get (0, 0, -1, -1).

The caller binds vLLM's dtypes (token ids, positions and the Engram lookback as int64,
executor/bind.py); the embedding, Engram hash, indexer and attention kernels take int32 rows (ids <
2^31, positions < 2^31), and the Engram hash takes the newest-first history [R, max_ngram] with
the row's own token first. One launch at the head of the step converts them, so no kernel reads
two layouts. `history_cols` = 0 (a model without Engram) drops the history. Values are truncated
to their low 32 bits, as `cvt.u32.u64` does (the binding's contract keeps them in range).

PTX ABI: (u64 token_ids, u64 positions, u64 token_history, u64 seq_index, u64 block_kind,
u64 tokens32, u64 positions32, u64 history32, u64 row_info, u32 rows); with history_cols = 0
token_history and history32 are not touched.
One thread per row, grid-stride over rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.common_ref import check_rows, params_dict

CTA_THREADS = 256
MAX_CTAS = 8
KIND_DRAFT = 2                      # executor.reference.rows.KIND_DRAFT
INFO_FIELDS = 4
PARAMS = (("token_ids", "u64"), ("positions", "u64"), ("token_history", "u64"),
          ("seq_index", "u64"), ("block_kind", "u64"), ("tokens32", "u64"),
          ("positions32", "u64"), ("history32", "u64"), ("row_info", "u64"), ("rows", "u32"))


@dataclass(frozen=True)
class RowsPrepSpec:
    name: str
    history_cols: int                   # max_ngram (0: no Engram)
    window: int                         # the sliding window W
    params: tuple[tuple[str, str], ...] = PARAMS
    block: tuple[int, int, int] = (CTA_THREADS, 1, 1)
    smem_bytes: int = 0

    def grid(self, rows: int) -> tuple[int, int, int]:
        check_rows(rows, self.name)
        return (min(-(-rows // CTA_THREADS), MAX_CTAS), 1, 1)

    def to_dict(self) -> dict:
        return {"family": "rows", "name": self.name, "history_cols": self.history_cols,
                "window": self.window,
                "params": params_dict(self.params), "block": list(self.block),
                "smem_bytes": self.smem_bytes}


def make_spec(history_cols: int, window: int) -> RowsPrepSpec:
    if isinstance(history_cols, bool) or not isinstance(history_cols, int) or history_cols < 0 \
            or history_cols == 1:
        raise ValueError(f"rows prep: history_cols must be 0 or >= 2, got {history_cols!r}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"rows prep: window must be a positive int, got {window!r}")
    return RowsPrepSpec(f"rows_prep_h{history_cols}_w{window}", history_cols, window)


def spec_for(cfg) -> RowsPrepSpec:
    return make_spec(cfg.engram_max_ngram_size if cfg.engram_layer_ids else 0,
                     cfg.sliding_window)


def row_info_ref(positions, seq_index, block_kind, window: int) -> np.ndarray:
    """int32 [R, 4] (position, swa_lo, swa_hi, seq), exactly what the kernel writes."""
    pos = np.asarray(positions, np.int64).astype(np.int32)
    seq = np.asarray(seq_index, np.int32)
    kind = np.asarray(block_kind, np.int8)
    info = np.zeros((pos.shape[0], INFO_FIELDS), np.int32)
    info[:, 2:] = -1
    for r in np.flatnonzero(seq >= 0):
        if kind[r] == KIND_DRAFT:
            mine = pos[seq == seq[r]]
            lo, hi = int(mine.min()) - window, int(mine.max())
        else:
            lo, hi = int(pos[r]) - window + 1, int(pos[r])
        info[r] = (pos[r], max(lo, 0), hi, seq[r])
    return info


def rows_prep_ref(token_ids, positions, token_history=None):
    """Exactly what the kernel writes: (tokens32 [R], positions32 [R], history32 [R, n] or None)."""
    low = (lambda a: np.asarray(a, np.int64).astype(np.uint64).astype(np.uint32).view(np.int32))
    tokens32, positions32 = low(token_ids), low(positions)
    if token_history is None:
        return tokens32, positions32, None
    history = np.concatenate([np.asarray(token_ids, np.int64)[:, None],
                              np.asarray(token_history, np.int64)], axis=1)
    return tokens32, positions32, low(history)
