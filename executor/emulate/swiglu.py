"""kernels.swiglu on the host: h = bf16(silu(min(g, L)) * clip(u, -L, L)) of `rows` rows.

Reads h13 bf16 [rows, 2I] (gate | up), writes out bf16 [rows, I] by `swiglu_ref` (the model
reference's arithmetic; the kernel is within one bf16 ulp of it). As on the GPU, the grid must be
the spec's grid for `rows` and out must not overlap h13.
"""
from __future__ import annotations

from executor.emulate import NoEmulator
from executor.emulate.dense import check_disjoint, check_grid
from kernels import swiglu_ref as sr
from kernels.common_ref import BF16


def spec_of(record) -> sr.SwigluSpec:
    """The SwigluSpec a manifest record was built from (NoEmulator for a kind not rebuilt)."""
    sp = record.spec or {}
    try:
        spec = sr.make_spec(sp["inter"], sp["limit"])
    except (KeyError, TypeError, ValueError) as exc:
        raise NoEmulator(f"kernels.swiglu kernel {record.name!r}: no emulator for its spec "
                         f"({exc})") from None
    if spec.name != record.name:
        raise NoEmulator(f"kernels.swiglu kernel {record.name!r}: its spec rebuilds as "
                         f"{spec.name!r}, a kernel the emulator does not know")
    return spec


def emulate(record, grid, args, space) -> None:
    spec = spec_of(record)
    rows, inter = args["rows"], spec.inter
    check_grid(spec, grid, rows)
    check_disjoint(spec.name, {"out": (args["out"], rows * inter * 2)},
                   {"h13": (args["h13"], rows * 2 * inter * 2)})
    h13 = space.array(args["h13"], BF16, (rows, 2 * inter)).copy()
    space.array(args["out"], BF16, (rows, inter))[...] = sr.swiglu_ref(h13, spec.limit)
