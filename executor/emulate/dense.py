"""kernels.dense on the host: y = x @ W^T, W8A16, with its bf16 / f32 / residual / swiglu / add_f32
epilogue (`kernels/dense_ref.py`: swiglu writes [rows, N/2], add_f32 reads an f32 residual).

Both variants (register-prefetch "mma", smem-streamed "stream") compute `kernels/dense_ref.dense_ref`
up to fp32 summation order; the emulator writes its result to out[:rows] and, as the kernel does,
checks nothing but what the GPU would get wrong silently: the grid must be the spec's grid for
`rows`, the scratch buffers must be their documented size with the counters zero, and no buffer
the kernel writes may overlap another it reads (out may be the residual itself: each element is
read before it is written by the same thread). The workspace bytes the kernel writes (fp32
partials of the tiles it splits) are clobbered with 0xFF, so a wiring that reads them as data
fails here as on the GPU. `executor.emulate.wo_a` reuses `emulate_with` with its own reference.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from executor.emulate import NoEmulator
from kernels import dense_ref as dr
from kernels.common_ref import BF16

E4M3 = ml_dtypes.float8_e4m3fn
PARTIAL_FLOATS = dr.TILE_N * dr.ROW_TILE      # one tile's 16 x 8 fp32 partial (stream slot)


def check_grid(spec, grid, rows: int) -> None:
    want = spec.grid(rows)
    if tuple(grid) != want:
        raise ValueError(f"{spec.name}: launched with grid {tuple(grid)}, the kernel needs {want} "
                         f"at rows={rows}")


def check_disjoint(who: str, written: dict, read: dict, may_alias=()) -> None:
    """No written (ptr, nbytes) range overlaps another buffer's, except pairs in may_alias that
    start at the same address with the same size (elementwise in place)."""
    ranges = {**read, **written}
    for wname, (wp, wn) in written.items():
        for name, (p, n) in ranges.items():
            if name == wname or not (wp < p + n and p < wp + wn):
                continue
            if {wname, name} in [set(pair) for pair in may_alias] and (wp, wn) == (p, n):
                continue
            raise ValueError(f"{who}: buffer {wname!r} [{wp:#x}, +{wn}) overlaps {name!r} "
                             f"[{p:#x}, +{n})")


def check_zero(who: str, space, name: str, ptr: int, nbytes: int) -> None:
    """A counter buffer the kernel expects zeroed at bind time (it leaves it zero again)."""
    raw = space.bytes(ptr, nbytes)
    if raw.any():
        raise ValueError(f"{who}: {name} must be zero when the kernel runs; byte "
                         f"{int(np.flatnonzero(raw)[0])} of {nbytes} is {int(raw[raw != 0][0])}")


def workspace_written(spec: dr.DenseSpec, rows: int) -> list[slice]:
    """The fp32 workspace elements one launch writes (kernels/dense.py, kernels/dense_stream.py)."""
    if spec.streamed:                       # slot (cta, first/last) of every tile CTAs share
        slots = []
        for tile in range(spec.tiles):
            first = tile * spec.ksteps
            lo, hi = spec.cta_of_unit(first), spec.cta_of_unit(first + spec.ksteps - 1)
            for cta in range(lo, hi + 1) if lo != hi else ():
                slot = 2 * cta + int(tile != spec.unit_range(cta)[0] // spec.ksteps)
                slots.append(slice(slot * PARTIAL_FLOATS, (slot + 1) * PARTIAL_FLOATS))
        return slots
    if spec.split_k == 1:
        return []
    per_pass = spec.split_k * spec.tiles * dr.TILE_N * spec.rows_per_pass
    return [slice(0, spec.passes(rows) * per_pass)]


def emulate_with(reference, record, grid, args, space) -> None:
    """One dense-kernel launch; reference(spec, x, w, s, residual) -> out values [rows, G*N]."""
    spec = dr.DenseSpec.from_dict(record.spec)
    if spec.variant not in dr.VARIANTS or spec.epilogue not in dr.EPILOGUES:
        raise NoEmulator(f"{record.name}: dense variant {spec.variant!r} / epilogue "
                         f"{spec.epilogue!r} has no emulator")
    rows = args["rows"]
    check_grid(spec, grid, rows)
    g, n, k = spec.groups, spec.n, spec.k
    out_dtype = np.float32 if spec.out_dtype == "f32" else BF16
    read = {"x": (args["x"], rows * g * k * 2), "weight": (args["weight"], g * n * k),
            "scales": (args["scales"], g * (n // dr.FP8_BLOCK) * (k // dr.FP8_BLOCK))}
    width = spec.out_width
    written = {"out": (args["out"], rows * width * np.dtype(out_dtype).itemsize)}
    res_dtype = {"residual": BF16, "add_f32": np.float32}.get(spec.epilogue)
    if res_dtype is not None:
        read["residual"] = (args["residual"], rows * g * n * np.dtype(res_dtype).itemsize)
    if spec.workspace_bytes():
        written["workspace"] = (args["workspace"], spec.workspace_bytes())
    if spec.counters_bytes():
        written["counters"] = (args["counters"], spec.counters_bytes())
        check_zero(record.name, space, "counters", *written["counters"])
    for ptr, nbytes in {**read, **written}.values():
        space.bytes(ptr, nbytes)                       # every buffer at its documented size
    check_disjoint(record.name, written, read, may_alias=[("out", "residual")])

    x = space.array(args["x"], BF16, (rows, g * k)).copy()
    w = space.array(args["weight"], E4M3, (g, n, k)).copy()
    s = space.array(args["scales"], np.uint8, (g, n // dr.FP8_BLOCK, k // dr.FP8_BLOCK)).copy()
    residual = (space.array(args["residual"], res_dtype, (rows, g * n)).copy()
                if res_dtype is not None else None)
    y = reference(spec, x, w, s, residual)
    space.array(args["out"], out_dtype, (rows, width))[...] = y
    if "workspace" in written:
        partials = space.array(args["workspace"], np.uint32, spec.workspace_bytes() // 4)
        for part in workspace_written(spec, rows):
            partials[part] = 0xFFFFFFFF                # scratch: contents unspecified (NaN)


def emulate(record, grid, args, space) -> None:
    if record.spec.get("family") != "dense":
        raise NoEmulator(f"{record.name}: spec family {record.spec.get('family')!r} is not dense")
    emulate_with(dr.dense_ref, record, grid, args, space)
