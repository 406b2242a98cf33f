"""kernels.norm on the host: RMSNorm of `rows` BF16 rows of x into out (kernels/norm_ref.py)."""
from __future__ import annotations

import numpy as np

from kernels.common_ref import BF16
from kernels.norm_ref import rmsnorm_ref

_WEIGHT = {"bf16": BF16, "f32": np.float32}


def emulate(record, grid, args, space) -> None:
    spec = record.spec
    rows, width = args["rows"], spec["width"]
    x = space.array(args["x"], BF16, (rows, width))
    w = space.array(args["weight"], _WEIGHT[spec["weight_dtype"]], (width,))
    y = rmsnorm_ref(x.copy(), w.copy(), args["eps"])    # out may alias x
    space.array(args["out"], BF16, (rows, width))[...] = y
