"""The rows-prep launch on pointers: the caller's int64 row tensors -> the step's int32 rows.

Reads `token_ids` int64 [R], `positions` int64 [R], `token_history` int64 [R, n-1] (Engram models),
`seq_index` int32 [R], `block_kind` int8 [R]; writes `tokens32` int32 [R], `positions32` int32
[R], `history32` int32 [R, n], `row_info` int32 [R, 4] (kernels/rows_ref.py).
"""
from __future__ import annotations

from collections.abc import Mapping

from executor.launch import LaunchSpec
from kernels.rows_ref import RowsPrepSpec


def rows_prep_requests(spec: RowsPrepSpec, max_rows: int) -> list[tuple[str, int, str]]:
    out = [("tokens32", 4 * max_rows, "int32 [R] token ids"),
           ("positions32", 4 * max_rows, "int32 [R] positions"),
           ("row_info", 16 * max_rows, "int32 [R, 4] position, swa_lo, swa_hi, seq")]
    if spec.history_cols:
        out.append(("history32", 4 * max_rows * spec.history_cols,
                    f"int32 [R, {spec.history_cols}] newest-first token history"))
    return out


def rows_prep_launch(bundle, spec: RowsPrepSpec, ptrs: Mapping[str, int], rows: int) -> LaunchSpec:
    """One launch; without Engram, token_history / history32 default to token_ids (unread)."""
    args = []
    for name, _ in spec.params[:-1]:
        if name in ptrs:
            args.append(ptrs[name])
        elif not spec.history_cols and name in ("token_history", "history32"):
            args.append(ptrs["token_ids"])
        else:
            raise KeyError(f"{spec.name}: no pointer for {name!r}")
    return LaunchSpec(bundle.kernel(spec.name), spec.grid(rows), (*args, rows))
