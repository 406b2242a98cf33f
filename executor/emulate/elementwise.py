"""kernels.elementwise on the host: the residual add out = bf16(a + b) and the stream broadcast
out[r, s] = x[r] of `rows` rows."""
from __future__ import annotations

import numpy as np

from executor.emulate import NoEmulator
from kernels.common_ref import BF16
from kernels.elementwise_ref import broadcast_ref, make_broadcast_spec, residual_add_ref

_A_DTYPES = {"f32": np.float32, "bf16": BF16}


def _broadcast(record, grid, args, space) -> None:
    spec = make_broadcast_spec(record.spec["width"], record.spec["streams"])
    if spec.name != record.name:
        raise NoEmulator(f"kernels.elementwise: kernel {record.name!r} rebuilds as {spec.name!r}")
    rows = args["rows"]
    if tuple(grid) != spec.grid(rows):
        raise ValueError(f"{spec.name}: launched with grid {tuple(grid)}, the kernel needs "
                         f"{spec.grid(rows)}")
    x = space.array(args["x"], BF16, (rows, spec.width))
    out = space.array(args["out"], BF16, (rows, spec.streams, spec.width))
    if np.shares_memory(x, out):
        raise ValueError(f"{spec.name}: out overlaps x (the kernel does not broadcast in place)")
    out[...] = broadcast_ref(x.copy(), spec.streams)


def emulate(record, grid, args, space) -> None:
    spec = record.spec
    if record.name.startswith("broadcast_streams_"):
        _broadcast(record, grid, args, space)
        return
    if not record.name.startswith("residual_add_") or spec.get("a_dtype") not in _A_DTYPES:
        raise NoEmulator(f"kernels.elementwise: no emulator for kernel {record.name!r}")
    rows, width = args["rows"], spec["width"]
    a = space.array(args["a"], _A_DTYPES[spec["a_dtype"]], (rows, width))
    b = space.array(args["b"], BF16, (rows, width))
    out = residual_add_ref(a.copy(), b.copy())           # out may alias a or b
    space.array(args["out"], BF16, (rows, width))[...] = out
