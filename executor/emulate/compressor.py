"""kernels.compressor on the host: the projection GEMV and the ring / record publish
(`kernels/compressor_ref.py`, `kernels/compressor_kernel_ref.py`).

proj:    kv_score [rows, 512 r] f32 = x @ w^T (compressor_ref.project); nothing else written.
publish: ck.publish_ref on views of the launch's memory: the ring rows of real rows (r = 2), and
         the 584-byte record and 132-byte key of each publishing row at its slot. The sequences,
         ring lines and slots a launch touches are only known from its metadata, so the ring is
         viewed up to the highest line used and the record caches are written row by row through
         `_SlotRows` (an access past a buffer's region raises OutOfBounds).
"""
from __future__ import annotations

import numpy as np

from executor.emulate import NoEmulator
from executor.hostmem import OutOfBounds
from kernels import compressor_kernel_ref as ck
from kernels import compressor_ref, kvrecord_ref, rope_ref
from kernels.common_ref import BF16


def emulate(record, grid, args, space) -> None:
    kind = record.spec.get("kind")
    if kind == "proj":
        _projection(record, grid, args, space)
    elif kind == "publish":
        _publish(record, grid, args, space)
    else:
        raise NoEmulator(f"no CPU emulator for compressor kernel {record.name!r} (kind {kind!r})")


def _spec_of(record) -> ck.CompressorSpec:
    s = record.spec
    variant = s.get("variant", "")      # round 9's bulk / staged: the same results
    if variant not in (ck.PROJ_VARIANTS if s["kind"] == "proj" else ck.PUBLISH_VARIANTS):
        raise NoEmulator(f"compressor kernel {record.name!r}: unknown variant {variant!r}")
    spec = (ck.make_proj_spec(s["ratio"], s["hidden"], variant) if s["kind"] == "proj"
            else ck.make_publish_spec(s["ratio"], variant))
    if spec.name != record.name:
        raise NoEmulator(f"compressor kernel {record.name!r} is not the {spec.name!r} its spec "
                         "describes (an unknown variant)")
    return spec


def _check_grid(spec: ck.CompressorSpec, grid, rows: int) -> None:
    want = spec.grid(rows)
    if tuple(grid) != want:
        raise ValueError(f"{spec.name}: grid {tuple(grid)} for {rows} rows; the kernel covers "
                         f"exactly its rows with grid {want}")


def _projection(record, grid, args, space) -> None:
    spec = _spec_of(record)
    rows = args["rows"]
    _check_grid(spec, grid, rows)
    wdtype = np.float32 if spec.ratio == 2 else BF16
    x = space.array(args["x"], BF16, (rows, spec.hidden))
    w = space.array(args["w"], wdtype, (spec.out_cols, spec.hidden))
    kv_score = compressor_ref.project(x, w)
    space.array(args["out"], np.float32, (rows, spec.out_cols))[...] = kv_score


class _SlotRows:
    """Rows of `width` bytes at `ptr` written by index arrays (cache[slots] = values), each row
    resolved in the address space on its own: the buffer's length is not in the ABI."""

    def __init__(self, space, ptr: int, width: int, name: str):
        self.space, self.ptr, self.width, self.name = space, ptr, width, name

    def __setitem__(self, slots, values) -> None:
        values = np.asarray(values, np.uint8).reshape(-1, self.width)
        for slot, value in zip(np.asarray(slots, np.int64).reshape(-1), values):
            if slot < 0:                # the kernel would write before the buffer
                raise OutOfBounds(f"{self.name}: slot {slot} at {self.space.name_of(self.ptr)}")
            self.space.array(self.ptr + int(slot) * self.width, np.uint8, self.width)[...] = value


def _publish(record, grid, args, space) -> None:
    spec = _spec_of(record)
    rows, ratio = args["rows"], spec.ratio
    _check_grid(spec, grid, rows)
    positions = space.array(args["positions"], np.int32, rows).copy()
    seq_index = space.array(args["seq_index"], np.int32, rows).copy()
    real = seq_index >= 0
    seqs = int(seq_index[real].max()) + 1 if real.any() else 0
    lines = space.array(args["state_lines"], np.int32, seqs).copy()
    tables = space.array(args["block_tables"], np.int32, (seqs, args["pages_per_seq"])).copy()
    kv_score = space.array(args["kv_score"], np.float32, (rows, spec.out_cols)).copy()
    ring = np.zeros((0, ck.RING_ROWS, ck.RING_WIDTH), np.float32)      # r = 1 never touches it
    if ratio == 2 and real.any():
        used = lines[seq_index[real]]
        if used.min() < 0:
            raise ValueError(f"{spec.name}: a real row's sequence has state line {used.min()}")
        ring = space.array(args["ring"], np.float32,
                           (int(used.max()) + 1, ck.RING_ROWS, ck.RING_WIDTH))
    state = ck.PublishState(
        ring, _SlotRows(space, args["cache"], kvrecord_ref.KV_RECORD_BYTES, "cache"),
        _SlotRows(space, args["keys"], kvrecord_ref.INDEX_RECORD_BYTES, "keys"))
    cos_sin = space.array(args["table"], np.float32, (args["num_positions"], rope_ref.PAIRS, 2))
    # The kernel reads only the (cos, sin) rows; inv_freq is not part of the launch.
    table = rope_ref.RopeTable("device", np.full(rope_ref.PAIRS, np.nan, np.float32),
                               cos_sin.copy())
    ck.publish_ref(state, kv_score, positions, seq_index, lines, tables, args["page_size"],
                   space.array(args["norm_w"], np.float32, ck.HEAD_DIM).copy(),
                   space.array(args["wk"], BF16, (ck.INDEX_DIM, ck.HEAD_DIM)).copy(),
                   space.array(args["k_norm"], np.float32, ck.INDEX_DIM).copy(),
                   args["eps"], table, ratio)
