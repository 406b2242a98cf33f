"""kernels.split_norm on the host: a row's head RMSNormed into out, its tail copied (split_norm_ref).

Reads x bf16 [rows, W + T] and the fp32 weight [W]; writes out bf16 [rows, W] and tail bf16
[rows, T], nothing past `rows`. As on the GPU, the grid must be the spec's grid for `rows` and the
outputs must not overlap x (a thread group reads its next row while others write theirs).
"""
from __future__ import annotations

import numpy as np

from executor.emulate import NoEmulator
from executor.emulate.dense import check_disjoint, check_grid
from kernels import split_norm_ref as sr
from kernels.common_ref import BF16


def spec_of(record) -> sr.SplitNormSpec:
    """The SplitNormSpec a manifest record was built from (NoEmulator for one not rebuilt)."""
    sp = record.spec or {}
    try:
        spec = sr.make_spec(sp["width"], sp["tail"])
    except (KeyError, TypeError, ValueError) as exc:
        raise NoEmulator(f"kernels.split_norm kernel {record.name!r}: no emulator for its spec "
                         f"({exc})") from None
    if spec.name != record.name or spec.to_dict() != sp:
        raise NoEmulator(f"kernels.split_norm kernel {record.name!r}: its spec rebuilds as "
                         f"{spec.name!r}, a kernel the emulator does not know")
    return spec


def emulate(record, grid, args, space) -> None:
    spec = spec_of(record)
    rows, width, tail = args["rows"], spec.width, spec.tail
    check_grid(spec, grid, rows)
    check_disjoint(spec.name, {"out": (args["out"], rows * width * 2),
                               "tail": (args["tail"], rows * tail * 2)},
                   {"x": (args["x"], rows * spec.row_stride * 2)})
    x = space.array(args["x"], BF16, (rows, spec.row_stride)).copy()
    w = space.array(args["weight"], np.float32, (width,)).copy()
    head, rest = sr.split_norm_ref(x, w, width, args["eps"])
    space.array(args["out"], BF16, (rows, width))[...] = head
    space.array(args["tail"], BF16, (rows, tail))[...] = rest
