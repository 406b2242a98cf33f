"""kernels.router on the host: logits, biased top-k and route weights by the router reference.

Every variant (row blocks of 16, the one-pass `_tile8` / `_tile8p`) computes the same values.
Written, as the kernel writes them: logits [rows, E], ids [rows, k] (best first, ties to the lower
index), weights [rows, k], and the row-block counters (zero before, zero after:
`executor.emulate.mhc.claim_counters`; `_tile8p`'s first i32 is its timeout flag, which must be
clear, and its exchange words are left zero).
"""
from __future__ import annotations

import numpy as np

from executor.emulate import NoEmulator
from executor.emulate.mhc import check_grid, claim_counters
from kernels import moe_ref
from kernels import router_ref as rk
from kernels.common_ref import BF16


def spec_of(record) -> rk.RouterSpec:
    """The RouterSpec a manifest record was built from (NoEmulator for a kind not rebuilt)."""
    sp = record.spec
    try:
        spec = rk.spec_from_dict(sp)
    except (KeyError, ValueError) as exc:
        raise NoEmulator(f"kernels.router kernel {record.name!r}: no emulator for its spec "
                         f"({exc})") from None
    if spec.name != record.name:
        raise NoEmulator(f"kernels.router kernel {record.name!r}: its spec rebuilds as "
                         f"{spec.name!r}, a variant the emulator does not know")
    return spec


def emulate(record, grid, args, space) -> None:
    spec = spec_of(record)
    rows, d, e, k = args["rows"], spec.hidden, spec.experts, spec.topk
    check_grid(spec.name, grid, spec.grid(rows))
    x = space.array(args["x"], BF16, (rows, d)).copy()
    weight = space.array(args["weight"], BF16, (e, d)).copy()
    bias = space.array(args["bias"], np.float32, e).copy()
    claim_counters(spec.name, space, args["counters"], spec.grid(rows)[1])
    logits = moe_ref.matmul_t(x, weight)          # fp32 logits, summed in float64
    routed = rk.select_from_logits(logits, bias, k, spec.scaling)
    space.array(args["logits"], np.float32, (rows, e))[...] = logits
    space.array(args["ids"], np.int32, (rows, k))[...] = routed.ids
    space.array(args["weights"], np.float32, (rows, k))[...] = routed.weights
