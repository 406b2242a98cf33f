"""kernels.rows on the host: the caller's int64 rows as the kernels' int32 rows (kernels/rows_ref.py)."""
from __future__ import annotations

import numpy as np

from kernels.rows_ref import INFO_FIELDS, make_spec, row_info_ref, rows_prep_ref


def emulate(record, grid, args, space) -> None:
    spec = make_spec(record.spec["history_cols"], record.spec["window"])
    rows = args["rows"]
    if tuple(grid) != spec.grid(rows):
        raise ValueError(f"{record.name}: grid {grid}, expected {spec.grid(rows)}")
    cols = spec.history_cols
    history = (space.array(args["token_history"], np.int64, (rows, cols - 1)) if cols else None)
    tokens, positions, hist32 = rows_prep_ref(space.array(args["token_ids"], np.int64, rows),
                                              space.array(args["positions"], np.int64, rows),
                                              history)
    space.array(args["tokens32"], np.int32, rows)[...] = tokens
    space.array(args["positions32"], np.int32, rows)[...] = positions
    if cols:
        space.array(args["history32"], np.int32, (rows, cols))[...] = hist32
    info = row_info_ref(space.array(args["positions"], np.int64, rows),
                        space.array(args["seq_index"], np.int32, rows),
                        space.array(args["block_kind"], np.int8, rows), spec.window)
    space.array(args["row_info"], np.int32, (rows, INFO_FIELDS))[...] = info
