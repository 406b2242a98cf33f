"""kernels.kv_publish on the host: the 584-byte SWA records of the real rows at their slots.

A real row (slot >= 0) whose position is outside [0, num_positions) gets, as on the GPU, its
record with NaN rope dims (bf16 0x7FFF, the canonical NaN of the kernel's cvt): the nope bytes
and scales do not depend on the position, so they come from the reference at position 0.
"""
from __future__ import annotations

import numpy as np

from executor.emulate import NoEmulator
from executor.emulate.rope import device_table
from kernels import kv_publish_ref as kp
from kernels.common_ref import BF16
from kernels.kvrecord_ref import KV_RECORD_BYTES, KV_ROPE_OFFSET, KV_SCALE_OFFSET

GPU_NAN_BF16 = 0x7FFF


def emulate(record, grid, args, space) -> None:
    spec = record.spec
    if spec.get("kind") != "swa_insert":
        raise NoEmulator(f"kernels.kv_publish: no emulator for kernel {record.name!r} "
                         f"(kind {spec.get('kind')!r})")
    rows, width = args["rows"], spec["head_dim"]
    if grid[0] * kp.ROWS_PER_CTA < rows:
        raise ValueError(f"{record.name}: grid {grid} covers {grid[0] * kp.ROWS_PER_CTA} rows "
                         f"of {rows}; rows past it would write nothing")
    slots = space.array(args["slots"], np.int64, rows).copy()
    real = np.flatnonzero(slots >= 0)
    if len(np.unique(slots[real])) != len(real):
        raise ValueError(f"{record.name}: two real rows share a slot (slots {slots.tolist()}): "
                         "a race on the GPU")
    if not len(real):
        return
    kv = space.array(args["kv"], BF16, (rows, width))[real]
    weight = space.array(args["weight"], np.float32, width).copy()
    positions = space.array(args["positions"], np.int32, rows)[real]
    table = device_table(space, args["table"], args["num_positions"])
    invalid = (positions < 0) | (positions >= table.num_positions)
    records = np.empty((len(real), KV_RECORD_BYTES), np.uint8)
    kp.swa_insert_ref(records, kv, weight, float(np.float32(args["eps"])), table,
                      np.where(invalid, 0, positions), np.arange(len(real)))
    rope = records[:, KV_ROPE_OFFSET:KV_SCALE_OFFSET].view(np.uint16)
    rope[invalid] = GPU_NAN_BF16
    for record_bytes, slot in zip(records, slots[real]):
        space.bytes(args["cache"] + int(slot) * KV_RECORD_BYTES, KV_RECORD_BYTES)[...] = (
            record_bytes)
