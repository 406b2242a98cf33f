"""kernels.elementwise on the host: the residual add out = bf16(a + b) of `rows` rows."""
from __future__ import annotations

import numpy as np

from executor.emulate import NoEmulator
from kernels.common_ref import BF16
from kernels.elementwise_ref import residual_add_ref

_A_DTYPES = {"f32": np.float32, "bf16": BF16}


def emulate(record, grid, args, space) -> None:
    spec = record.spec
    if not record.name.startswith("residual_add_") or spec.get("a_dtype") not in _A_DTYPES:
        raise NoEmulator(f"kernels.elementwise: no emulator for kernel {record.name!r}")
    rows, width = args["rows"], spec["width"]
    a = space.array(args["a"], _A_DTYPES[spec["a_dtype"]], (rows, width))
    b = space.array(args["b"], BF16, (rows, width))
    out = residual_add_ref(a.copy(), b.copy())           # out may alias a or b
    space.array(args["out"], BF16, (rows, width))[...] = out
