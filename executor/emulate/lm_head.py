"""kernels.lm_head on the host: this rank's fp32 logits, or their split-vocabulary argmax pairs.

Both variants ("mma", "stream") compute `kernels/lm_head_ref` up to fp32 summation order. The
logits kernel writes f32 [rows, V_l]; the argmax kernel writes int32 [rows, 2] (f32 bits of the
row max, argmax + vocab_offset, ties to the lower index) and needs its keys and counters zero
when it runs (it leaves them zero again, so the emulator does not touch them).
"""
from __future__ import annotations

import numpy as np

from executor.emulate import NoEmulator
from executor.emulate.dense import check_disjoint, check_grid, check_zero
from kernels import lm_head_ref as lr
from kernels.common_ref import BF16


def emulate(record, grid, args, space) -> None:
    if record.spec.get("family") != "lm_head":
        raise NoEmulator(f"{record.name}: spec family {record.spec.get('family')!r} is not "
                         f"lm_head")
    spec = lr.spec_from_dict(record.spec)
    if spec.variant not in lr.VARIANTS or spec.mode not in lr.MODES:
        raise NoEmulator(f"{record.name}: lm_head variant {spec.variant!r} / mode "
                         f"{spec.mode!r} has no emulator")
    rows, v, d = args["rows"], spec.vocab, spec.hidden
    check_grid(spec, grid, rows)
    argmax = spec.mode == "argmax"
    read = {"x": (args["x"], rows * d * 2), "weight": (args["weight"], v * d * 2)}
    written = {"out": (args["out"], rows * 8 if argmax else rows * v * 4)}
    if argmax:
        written["keys"] = (args["keys"], spec.keys_bytes())
        written["counters"] = (args["counters"], spec.counters_bytes())
        check_zero(record.name, space, "keys", *written["keys"])
        check_zero(record.name, space, "counters", *written["counters"])
    for ptr, nbytes in {**read, **written}.values():
        space.bytes(ptr, nbytes)                       # every buffer at its documented size
    check_disjoint(record.name, written, read)

    x = space.array(args["x"], BF16, (rows, d)).copy()
    head = space.array(args["weight"], BF16, (v, d)).copy()
    logits = lr.lm_head_logits_ref(x, head)
    if argmax:
        pairs = lr.lm_head_argmax_ref(logits, args["vocab_offset"])
        space.array(args["out"], np.int32, (rows, 2))[...] = pairs
    else:
        space.array(args["out"], np.float32, (rows, v))[...] = logits
