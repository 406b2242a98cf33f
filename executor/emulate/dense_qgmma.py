"""kernels.dense_qgmma on the host: y = bf16(x~ @ W^T), W8A16 on FP8 wgmma, R <= 8, bf16 epilogue.

x~ is the kernel's hi + lo E4M3 split of x (`dense_qgmma_ref.split_x`, bitwise the kernel's
arithmetic), so the emulated step carries the split's error (<= 2^-17 of a row slice's max |x|
per element) as the GPU does; the product is `dense_qgmma_ref.dense_qgmma_ref` (float64, exact),
rounded once to bf16. The tensor core's reduced-precision FP8 accumulation (qgmma_tolerance's
2^-11 term) is not modelled: its direction depends on the hardware's alignment, which the GPU test
bounds, not this. Checks as executor.emulate.dense: the grid for `rows`, every buffer at its
documented size, split-K counters zero, no written buffer overlapping another; the workspace
(split > 1: fp32 slice partials) is clobbered with 0xFF, as its contents are unspecified.
"""
from __future__ import annotations

import numpy as np

from executor.emulate import NoEmulator
from executor.emulate.dense import E4M3, check_disjoint, check_grid, check_zero
from kernels import dense_qgmma_ref as qr
from kernels import dense_ref as dr
from kernels.common_ref import BF16, to_bf16
from loader.formats import fp8_block_dequantize


def emulate(record, grid, args, space) -> None:
    if record.family != "kernels.dense_qgmma":
        raise NoEmulator(f"{record.name}: family {record.family!r} is not kernels.dense_qgmma")
    spec = qr.QgSpec.from_dict(record.spec)
    if spec.variant not in qr.WARPGROUPS or spec.epilogue != "bf16" or spec.groups != 1:
        raise NoEmulator(f"{record.name}: QGMMA variant {spec.variant!r} / epilogue "
                         f"{spec.epilogue!r} / {spec.groups} groups has no emulator")
    rows = args["rows"]
    check_grid(spec, grid, rows)
    n, k = spec.n, spec.k
    read = {"x": (args["x"], rows * k * 2), "weight": (args["weight"], n * k),
            "scales": (args["scales"], (n // dr.FP8_BLOCK) * (k // dr.FP8_BLOCK))}
    written = {"out": (args["out"], rows * n * 2)}
    if spec.workspace_bytes():
        written["workspace"] = (args["workspace"], spec.workspace_bytes())
    if spec.counters_bytes():
        written["counters"] = (args["counters"], spec.counters_bytes())
        check_zero(record.name, space, "counters", *written["counters"])
    for ptr, nbytes in {**read, **written}.values():
        space.bytes(ptr, nbytes)                       # every buffer at its documented size
    check_disjoint(record.name, written, read)

    x = space.array(args["x"], BF16, (rows, k)).copy()
    w = space.array(args["weight"], E4M3, (n, k)).copy()
    s = space.array(args["scales"], np.uint8, (n // dr.FP8_BLOCK, k // dr.FP8_BLOCK)).copy()
    qr.check_scales(s)
    y = qr.dense_qgmma_ref(spec, x, fp8_block_dequantize(w, s).astype(np.float64))
    space.array(args["out"], BF16, (rows, n))[...] = to_bf16(y)     # fp32 acc, cvt.rn
    if "workspace" in written:
        space.array(args["workspace"], np.uint32, spec.workspace_bytes() // 4)[...] = 0xFFFFFFFF
