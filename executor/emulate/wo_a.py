"""kernels.wo_a on the host: the grouped FP8 wo_a, i.e. the dense W8A16 emulator with G groups and
`kernels/wo_a_ref.wo_a_ref` (bf16 epilogue only, the one kernels/wo_a_ref.py builds)."""
from __future__ import annotations

from executor.emulate import NoEmulator
from executor.emulate.dense import emulate_with
from kernels.wo_a_ref import wo_a_ref


def _reference(spec, o, weight, scales, residual):
    return wo_a_ref(spec, o, weight, scales)


def emulate(record, grid, args, space) -> None:
    spec = record.spec
    if spec.get("family") != "dense" or spec.get("epilogue") != "bf16":
        raise NoEmulator(f"{record.name}: wo_a emulates the grouped dense kernel with the bf16 "
                         f"epilogue, got family {spec.get('family')!r} epilogue "
                         f"{spec.get('epilogue')!r}")
    emulate_with(_reference, record, grid, args, space)
