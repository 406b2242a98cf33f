"""kernels.dense_qnorm on the host: q_norm of the q half of attn.qkv rows, then the W8A16 linear
(`kernels/dense_qnorm_ref.py`): the normalized x is bitwise the kernel's (and attn.qr's), the
product dense_ref's, as executor.emulate.dense writes it for the plain kernel. Checks the grid,
the buffers at their documented sizes and that out overlaps no input.
"""
from __future__ import annotations

import numpy as np

from executor.emulate import NoEmulator
from executor.emulate.dense import E4M3, check_disjoint, check_grid
from kernels import dense_qnorm_ref as qr
from kernels import dense_ref as dr
from kernels.common_ref import BF16


def emulate(record, grid, args, space) -> None:
    if record.spec.get("family") != "dense_qnorm":
        raise NoEmulator(f"{record.name}: spec family {record.spec.get('family')!r} is not "
                         f"dense_qnorm")
    spec = qr.DenseQNormSpec.from_dict(record.spec)
    rows = args["rows"]
    check_grid(spec, grid, rows)
    n, k, stride = spec.n, spec.k, spec.x_stride
    x_bytes = ((rows - 1) * stride + k) * 2                 # the last row's kv half is not read
    read = {"x": (args["x"], x_bytes), "weight": (args["weight"], n * k),
            "scales": (args["scales"], (n // dr.FP8_BLOCK) * (k // dr.FP8_BLOCK)),
            "norm_weight": (args["norm_weight"], 4 * k)}
    written = {"out": (args["out"], rows * n * 2)}
    for ptr, nbytes in {**read, **written}.values():
        space.bytes(ptr, nbytes)
    check_disjoint(record.name, written, read)
    flat = space.array(args["x"], BF16, (x_bytes // 2,))
    x = np.stack([np.concatenate([flat[r * stride:r * stride + k],
                                  np.zeros(stride - k, BF16)]) for r in range(rows)])
    w = space.array(args["weight"], E4M3, (1, n, k)).copy()
    s = space.array(args["scales"], np.uint8, (1, n // dr.FP8_BLOCK, k // dr.FP8_BLOCK)).copy()
    norm_w = space.array(args["norm_weight"], np.float32, (k,)).copy()
    y = qr.dense_qnorm_ref(spec, x, norm_w, args["eps"], w, s)
    space.array(args["out"], BF16, (rows, n))[...] = y
