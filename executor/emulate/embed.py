"""kernels.embed on the host: `rows` token ids -> this rank's BF16 table rows or zeros
(kernels/embed_ref.py)."""
from __future__ import annotations

import numpy as np

from executor.emulate import NoEmulator
from kernels.common_ref import BF16
from kernels.embed_ref import embed_ref


def emulate(record, grid, args, space) -> None:
    spec = record.spec
    if not record.name.startswith("embed_bf16_"):
        raise NoEmulator(f"no CPU emulator for embed kernel {record.name!r}")
    # Grid-stride over every (row, vector): the output does not depend on the grid.
    rows, width = args["rows"], spec["width"]
    ids = space.array(args["token_ids"], np.int32, (rows,))
    table = space.array(args["table"], BF16, (spec["table_rows"], width))
    space.array(args["out"], BF16, (rows, width))[...] = embed_ref(ids.copy(), table,
                                                                   args["vocab_offset"])
