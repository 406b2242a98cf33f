"""kernels.kv_publish on the host: the 584-byte SWA records of the real rows at their slots, and
attn_prep (the q head RMSNormed into qr, the kv tail inserted as kv_swa_insert does).

A real row (slot >= 0) whose position is outside [0, num_positions) gets, as on the GPU, its
record with NaN rope dims (bf16 0x7FFF, the canonical NaN of the kernel's cvt): the nope bytes
and scales do not depend on the position, so they come from the reference at position 0.
"""
from __future__ import annotations

import numpy as np

from executor.emulate import NoEmulator
from executor.emulate.dense import check_disjoint
from executor.emulate.rope import device_table
from kernels import kv_publish_ref as kp
from kernels.common_ref import BF16
from kernels.kvrecord_ref import KV_RECORD_BYTES, KV_ROPE_OFFSET, KV_SCALE_OFFSET
from kernels.norm_ref import rmsnorm_ref

GPU_NAN_BF16 = 0x7FFF


def _insert(name: str, kv: np.ndarray, args, space) -> None:
    """The records of kv bf16 [rows, 512] (rows = args['rows']) at args['slots'] of the cache."""
    rows, width = kv.shape
    slots = space.array(args["slots"], np.int64, rows).copy()
    real = np.flatnonzero(slots >= 0)
    if len(np.unique(slots[real])) != len(real):
        raise ValueError(f"{name}: two real rows share a slot (slots {slots.tolist()}): "
                         "a race on the GPU")
    if not len(real):
        return
    weight_ptr = args["weight"] if "weight" in args else args["kv_weight"]
    weight = space.array(weight_ptr, np.float32, width).copy()
    positions = space.array(args["positions"], np.int32, rows)[real]
    table = device_table(space, args["table"], args["num_positions"])
    invalid = (positions < 0) | (positions >= table.num_positions)
    records = np.empty((len(real), KV_RECORD_BYTES), np.uint8)
    kp.swa_insert_ref(records, np.ascontiguousarray(kv[real]), weight,
                      float(np.float32(args["eps"])), table, np.where(invalid, 0, positions),
                      np.arange(len(real)))
    rope = records[:, KV_ROPE_OFFSET:KV_SCALE_OFFSET].view(np.uint16)
    rope[invalid] = GPU_NAN_BF16
    for record_bytes, slot in zip(records, slots[real]):
        space.bytes(args["cache"] + int(slot) * KV_RECORD_BYTES, KV_RECORD_BYTES)[...] = (
            record_bytes)


def _check_grid(name: str, grid, rows: int, rows_per_cta: int) -> None:
    if grid[0] * rows_per_cta < rows:
        raise ValueError(f"{name}: grid {grid} covers {grid[0] * rows_per_cta} rows of {rows}; "
                         "rows past it would write nothing")


def _attn_prep(record, grid, args, space) -> None:
    spec = record.spec
    try:
        rebuilt = kp.make_attn_prep_spec(spec["q_width"], spec["head_dim"])
    except (KeyError, TypeError, ValueError) as exc:
        raise NoEmulator(f"kernels.kv_publish kernel {record.name!r}: no emulator for its spec "
                         f"({exc})") from None
    if rebuilt.name != record.name or rebuilt.to_dict() != spec:
        raise NoEmulator(f"kernels.kv_publish kernel {record.name!r}: its spec rebuilds as "
                         f"{rebuilt.name!r}, a kernel the emulator does not know")
    rows, width = args["rows"], rebuilt.q_width
    _check_grid(record.name, grid, rows, kp.PREP_ROWS_PER_CTA)
    # A warp reads its row while others write theirs: qr must not overlap qkv.
    check_disjoint(record.name, {"qr": (args["qr"], rows * width * 2)},
                   {"qkv": (args["qkv"], rows * rebuilt.row_stride * 2)})
    qkv = space.array(args["qkv"], BF16, (rows, rebuilt.row_stride)).copy()
    w = space.array(args["q_weight"], np.float32, (width,)).copy()
    qr = rmsnorm_ref(np.ascontiguousarray(qkv[:, :width]), w, float(np.float32(args["eps"])))
    space.array(args["qr"], BF16, (rows, width))[...] = qr
    _insert(record.name, qkv[:, width:], args, space)


def emulate(record, grid, args, space) -> None:
    spec = record.spec
    if spec.get("kind") == "attn_prep":
        return _attn_prep(record, grid, args, space)
    if spec.get("kind") != "swa_insert":
        raise NoEmulator(f"kernels.kv_publish: no emulator for kernel {record.name!r} "
                         f"(kind {spec.get('kind')!r})")
    rows, width = args["rows"], spec["head_dim"]
    stride = spec.get("kv_row_stride", width)   # the kv half of attn.qkv: rows stride apart
    _check_grid(record.name, grid, rows, kp.ROWS_PER_CTA)
    flat = space.array(args["kv"], BF16, ((rows - 1) * stride + width,))
    kv = np.stack([flat[r * stride:r * stride + width] for r in range(rows)])
    _insert(record.name, kv, args, space)
