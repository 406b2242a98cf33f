"""kernels.rope on the host: RoPE of `rows` rows of heads x head_dim, in place or into a copy.

In place the kernel writes only the last 64 dims of each head; the copy writes every dim of out.
A position outside [0, num_positions) gives NaN rotated dims, as on the GPU (the reference's NaN
is 0x7FC0, the GPU's cvt gives 0x7FFF: the GPU test compares NaN positions, not their bits).
"""
from __future__ import annotations

import numpy as np

from executor.emulate import NoEmulator
from kernels.common_ref import BF16
from kernels.rope_ref import PAIRS, ROPE_DIM, RopeTable, rope_ref


def device_table(space, ptr: int, num_positions: int) -> RopeTable:
    """The fp32 [num_positions, 32, 2] (cos, sin) table at `ptr` as a RopeTable."""
    if num_positions < 1:
        raise ValueError(f"RoPE table at {space.name_of(ptr)}: num_positions {num_positions}; "
                         "the kernel reads row 0 even for an invalid position, so it needs >= 1")
    cos_sin = space.array(ptr, np.float32, (num_positions, PAIRS, 2))   # a view: read only
    return RopeTable("device", np.full(PAIRS, np.nan, np.float32), cos_sin)


def emulate(record, grid, args, space) -> None:
    spec = record.spec
    if not record.name.startswith("rope_") or not {"heads", "head_dim", "inverse",
                                                   "in_place"} <= set(spec):
        raise NoEmulator(f"kernels.rope: no emulator for kernel {record.name!r}")
    rows, shape = args["rows"], (args["rows"], spec["heads"], spec["head_dim"])
    x = space.array(args["x"], BF16, shape).copy()
    positions = space.array(args["positions"], np.int32, rows).copy()
    table = device_table(space, args["table"], args["num_positions"])
    y = rope_ref(x, positions, table, spec["inverse"])
    if spec["in_place"]:
        space.array(args["x"], BF16, shape)[..., -ROPE_DIM:] = y[..., -ROPE_DIM:]
    else:
        space.array(args["out"], BF16, shape)[...] = y
