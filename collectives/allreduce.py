"""Rank-uniform all-reduce path choice (one-shot vs NCCL by rows, as a table) and the facade.

Every rank must issue the same collective sequence: a rank that took NCCL while another took the
one-shot kernel would leave both waiting forever. The choice therefore depends only on the row
count, which every TP rank sees identically (same scheduler batch, same padded bucket), and on a
table that `PathTable.agree` checks is identical on every rank at set-up.

Measured crossover (issue 11, run 35, 4 x H200 NV18, graph-captured, slowest rank): the one-shot
kernel beats NCCL (NVLS off) at every R of 1..192 rows of 5120 bf16: 3.9 vs 11.1 us at R = 1,
9.0 vs 13.9 at R = 48, 23.6 vs 24.7 at R = 192 (docs/perf.md, "TP4 on four H200s"). So the
default table is one-shot throughout; NCCL stays selectable for another topology or world.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from kernels.allreduce_ref import MAX_ROWS

PATHS = ("oneshot", "nccl")
DEFAULT_TABLE = ((MAX_ROWS, "oneshot"),)


@dataclass(frozen=True)
class PathTable:
    """((max_rows, path), ...) in increasing max_rows: rows <= max_rows of the first entry that
    holds them take its path. Covers 1..max_rows of the last entry."""

    entries: tuple[tuple[int, str], ...] = DEFAULT_TABLE

    def __post_init__(self):
        last = 0
        if not self.entries:
            raise ValueError("all-reduce path table is empty")
        for entry in self.entries:
            if (not isinstance(entry, tuple) or len(entry) != 2 or not isinstance(entry[0], int)
                    or isinstance(entry[0], bool)):
                raise ValueError(f"all-reduce path table entry {entry!r}: expected "
                                 "(max_rows: int, path)")
            max_rows, path = entry
            if max_rows <= last:
                raise ValueError(f"all-reduce path table: max_rows must increase, got "
                                 f"{max_rows} after {last}")
            if path not in PATHS:
                raise ValueError(f"all-reduce path table: path {path!r}, expected one of {PATHS}")
            last = max_rows
        table = [""]
        for max_rows, path in self.entries:
            table.extend([path] * (max_rows - len(table) + 1))
        object.__setattr__(self, "_by_rows", tuple(table))

    @property
    def max_rows(self) -> int:
        return self.entries[-1][0]

    def path(self, rows: int) -> str:
        """'oneshot' or 'nccl' for a step of `rows` rows (a tuple lookup)."""
        if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= self.max_rows:
            raise ValueError(f"all-reduce: rows={rows!r} outside the path table's 1.."
                             f"{self.max_rows}")
        return self._by_rows[rows]

    def paths_used(self) -> set[str]:
        return {p for _, p in self.entries}

    def fingerprint(self) -> bytes:
        """32 bytes identifying the table: equal on every rank or the ranks would diverge."""
        return hashlib.sha256(json.dumps(self.entries).encode()).digest()

    def agree(self, exchange, rank: int) -> None:
        """Collective: raise on every rank unless every rank holds this very table."""
        prints = [bytes(p) for p in exchange(self.fingerprint())]
        differ = [src for src, p in enumerate(prints) if p != self.fingerprint()]
        if differ:
            raise ValueError(f"rank {rank}: all-reduce path table differs on rank(s) {differ}; "
                             f"every rank must take the same path for the same rows")


class AllReduce:
    """The executor's all-reduce of bf16 [rows, width]: one-shot or NCCL by the table.

    `record(rows, inp, out, stream, residual=None)` issues the launches for one call (eagerly or
    into a capture). With `residual`, out = bf16(residual + sum): fused in the one-shot kernel;
    on the NCCL path NCCL reduces in place into inp and `residual_add` (a LaunchSpec factory
    `(rows, a, b, out) -> LaunchSpec` over kernels.elementwise's bf16 + bf16 add) finishes, which
    rounds twice (bf16 sum, then bf16 add) where the fused kernel rounds once.
    """

    def __init__(self, table: PathTable, width: int, oneshot=None, nccl=None, residual_add=None):
        need = table.paths_used()
        if "oneshot" in need and oneshot is None:
            raise ValueError("all-reduce table uses the one-shot path but no OneShotAllReduce "
                             "was given")
        if "nccl" in need and nccl is None:
            raise ValueError("all-reduce table uses the NCCL path but no NcclComm was given")
        if oneshot is not None and table.max_rows > oneshot.max_rows and "nccl" not in need:
            raise ValueError(f"all-reduce table covers {table.max_rows} rows, the one-shot "
                             f"buffers only {oneshot.max_rows}")
        self.table, self.width = table, width
        self.oneshot, self.nccl, self.residual_add = oneshot, nccl, residual_add

    def record(self, rows: int, inp: int, out: int, stream, residual: int | None = None) -> str:
        """Launch one all-reduce on `stream` (a runtime Stream); returns the path taken."""
        path = self.table.path(rows)
        if path == "oneshot":
            if rows > self.oneshot.max_rows:
                raise ValueError(f"all-reduce: {rows} rows exceed the one-shot capacity "
                                 f"{self.oneshot.max_rows}")
            self.oneshot.launch_spec(rows, inp, out, residual).launch(stream)
            return path
        if residual is None:
            self.nccl.all_reduce_rows(inp, out, rows, self.width, "bf16", stream.handle)
            return path
        if self.residual_add is None:
            raise ValueError("all-reduce with a residual on the NCCL path needs residual_add")
        self.nccl.all_reduce_rows(inp, inp, rows, self.width, "bf16", stream.handle)
        self.residual_add(rows, inp, residual, out).launch(stream)
        return path
