"""kernels.linear_bf16 on the host: out [rows, N] bf16 = x @ w^T by `linear_bf16_ref`.

The reference sums exactly and rounds to fp32 then bf16 (the kernel: fp32 fma in its own order,
within `linear_tolerance`). Writes out[:rows] only; checks the grid and that out overlaps neither
input (the kernel reads x after other warps have stored rows of out).
"""
from __future__ import annotations

import numpy as np

from executor.emulate.dense import check_disjoint
from kernels import linear_bf16_ref as lr
from kernels.common_ref import BF16


def emulate(record, grid, args, space) -> None:
    spec = lr.spec_of(record.spec)
    rows = args["rows"]
    if tuple(grid) != spec.grid(rows):
        raise ValueError(f"{spec.name}: grid {tuple(grid)} for {rows} rows; the kernel covers "
                         f"its rows only with grid {spec.grid(rows)}")
    n, k = spec.n, spec.k
    check_disjoint(spec.name, {"out": (args["out"], rows * n * 2)},
                   {"x": (args["x"], rows * k * 2), "w": (args["w"], n * k * 2)})
    x = space.array(args["x"], BF16, (rows, k)).copy()
    w = space.array(args["w"], BF16, (n, k)).copy()
    space.array(args["out"], np.uint16, (rows, n))[...] = lr.linear_bf16_ref(x, w).view(np.uint16)
