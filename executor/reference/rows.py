"""The rows of one decode step: per-row token, position, sequence, KV slot, block; per sequence.

A step holds R rows. The rows of one sequence form one block of consecutive positions:
- `decode`: one row (plain decode);
- `verify`: DSpark verify rows (or prefill chunks), causal inside the block: row j sees what
  rows < j of the same step wrote;
- `draft`: DSpark draft rows, non-causal: every row sees the whole block.
Padding rows (bucket fill) carry slot -1 and sequence -1: they write nothing and read nothing.

Per sequence (indexed by `seq_index`, in block order):
- `state_lines[s]`: the sequence's line in the fixed-size per-sequence state (SWA rings, compressor
  rings); a row's `slot_mapping` is the SWA slot it writes:
  `state_line * ring_slots + p % ring_slots`.
- `block_tables[s]`: pages of the paged compressed caches and index keys; entry e lives at
  `block_tables[s, e // page_size] * page_size + e % page_size`; -1 = no page.
- `context_lens[s]`: positions with KV after this step's writes = last row position + 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK_KINDS = ("decode", "verify", "draft")
KIND_DECODE, KIND_VERIFY, KIND_DRAFT = range(3)


@dataclass(frozen=True)
class RowBlock:
    """One sequence's rows in a step: consecutive positions from `start`."""

    state_line: int
    start: int
    token_ids: tuple[int, ...]
    kind: str = "decode"


@dataclass(frozen=True, eq=False)
class RowBatch:
    """Validated row and sequence metadata of one step (numpy arrays, the GPU's bound buffers)."""

    token_ids: np.ndarray     # [R] int64
    positions: np.ndarray     # [R] int64
    seq_index: np.ndarray     # [R] int32, -1 for padding
    slot_mapping: np.ndarray  # [R] int64 SWA slot written by the row, -1 for padding
    block_kind: np.ndarray    # [R] int8, KIND_* (padding rows: KIND_DECODE)
    state_lines: np.ndarray   # [S] int32
    block_tables: np.ndarray  # [S, max_pages] int32
    context_lens: np.ndarray  # [S] int64

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def num_rows(self) -> int:
        return int(self.positions.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.state_lines.shape[0])

    @property
    def real(self) -> np.ndarray:
        """[R] bool: rows that are not padding."""
        return self.slot_mapping >= 0

    def seq_rows(self, s: int) -> np.ndarray:
        """Row indices of sequence `s` (contiguous, ascending positions)."""
        return np.flatnonzero(self.seq_index == s)

    @classmethod
    def from_blocks(cls, blocks: list[RowBlock], block_tables: np.ndarray, ring_slots: int,
                    pad_to: int | None = None) -> RowBatch:
        """Rows for `blocks` (one per sequence), SWA slots from a ring of `ring_slots` per line.

        `block_tables[line]` is the page list of state line `line` (KVCaches.block_tables).
        """
        toks, pos, seq, kind = [], [], [], []
        for s, b in enumerate(blocks):
            if b.kind not in BLOCK_KINDS:
                raise ValueError(f"block {s}: kind {b.kind!r}; expected one of {BLOCK_KINDS}")
            n = len(b.token_ids)
            toks += list(b.token_ids)
            pos += list(range(b.start, b.start + n))
            seq += [s] * n
            kind += [BLOCK_KINDS.index(b.kind)] * n
        lines = np.array([b.state_line for b in blocks], np.int32)
        positions = np.array(pos, np.int64)
        seq_index = np.array(seq, np.int32)
        slots = lines[seq_index].astype(np.int64) * ring_slots + positions % ring_slots
        pad = 0 if pad_to is None else pad_to - len(pos)
        if pad < 0:
            raise ValueError(f"{len(pos)} rows do not fit pad_to={pad_to}")
        ends = [b.start + len(b.token_ids) for b in blocks]
        return cls(
            token_ids=np.concatenate([np.array(toks, np.int64), np.zeros(pad, np.int64)]),
            positions=np.concatenate([positions, np.zeros(pad, np.int64)]),
            seq_index=np.concatenate([seq_index, np.full(pad, -1, np.int32)]),
            slot_mapping=np.concatenate([slots, np.full(pad, -1, np.int64)]),
            block_kind=np.concatenate([np.array(kind, np.int8), np.zeros(pad, np.int8)]),
            state_lines=lines,
            block_tables=np.asarray(block_tables)[lines].astype(np.int32),
            context_lens=np.array(ends, np.int64),
        )


def _expect(arr: np.ndarray, name: str, dtype, shape: tuple) -> None:
    if not isinstance(arr, np.ndarray) or arr.dtype != dtype or arr.shape != shape:
        got = f"{arr.dtype} {arr.shape}" if isinstance(arr, np.ndarray) else type(arr).__name__
        raise ValueError(f"RowBatch.{name}: expected {np.dtype(dtype).name} {shape}, got {got}")


def _validate(rb: RowBatch) -> None:
    r = rb.positions.shape[0] if isinstance(rb.positions, np.ndarray) else -1
    s = rb.state_lines.shape[0] if isinstance(rb.state_lines, np.ndarray) else -1
    for name, dtype in (("token_ids", np.int64), ("positions", np.int64), ("seq_index", np.int32),
                        ("slot_mapping", np.int64), ("block_kind", np.int8)):
        _expect(getattr(rb, name), name, dtype, (r,))
    _expect(rb.state_lines, "state_lines", np.int32, (s,))
    _expect(rb.context_lens, "context_lens", np.int64, (s,))
    if rb.block_tables.ndim != 2 or rb.block_tables.shape[0] != s:
        raise ValueError(
            f"RowBatch.block_tables: expected [{s}, max_pages], got {rb.block_tables.shape}")
    real = rb.slot_mapping >= 0
    if np.any(real != (rb.seq_index >= 0)):
        bad = np.flatnonzero(real != (rb.seq_index >= 0))
        raise ValueError(
            f"RowBatch: rows {bad.tolist()} mix padding (slot -1 / sequence -1) with real")
    if np.any(rb.seq_index >= s):
        raise ValueError(f"RowBatch.seq_index: values must be < {s} sequences")
    if np.any(rb.block_kind < 0) or np.any(rb.block_kind >= len(BLOCK_KINDS)):
        raise ValueError(f"RowBatch.block_kind: values must be in 0..{len(BLOCK_KINDS) - 1}")
    if np.any(rb.positions[real] < 0):
        raise ValueError("RowBatch.positions: real rows need positions >= 0")
    if len(np.unique(rb.state_lines)) != s:
        raise ValueError(
            f"RowBatch.state_lines {rb.state_lines.tolist()}: a sequence appears twice")
    for q in range(s):
        idx = np.flatnonzero(rb.seq_index == q)
        if idx.size == 0:
            raise ValueError(f"RowBatch: sequence {q} has no rows")
        pos = rb.positions[idx]
        if np.any(np.diff(idx) != 1) or np.any(np.diff(pos) != 1):
            raise ValueError(
                f"RowBatch: sequence {q} rows {idx.tolist()} at positions {pos.tolist()} are not "
                f"one contiguous block of consecutive positions"
            )
        kinds = np.unique(rb.block_kind[idx])
        if kinds.size != 1 or (kinds[0] == KIND_DECODE and idx.size != 1):
            raise ValueError(
                f"RowBatch: sequence {q} block kinds {kinds.tolist()} for {idx.size} rows")
        if rb.context_lens[q] != pos[-1] + 1:
            raise ValueError(
                f"RowBatch.context_lens[{q}] = {rb.context_lens[q]}; expected last position + 1 = "
                f"{pos[-1] + 1}"
            )
