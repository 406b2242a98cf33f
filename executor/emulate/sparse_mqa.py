"""kernels.sparse_mqa on the host: out [rows, H, 512] bf16 of one launch (`kernels/sparse_mqa_ref.py`:
`gather` from the cache bytes, then `sparse_mqa_ref`).

Covers the SWA-only kernel and every top-k kernel whose outputs count (split balanced or fixed,
pull or push exchange, any QK load order: one reference); the timing-only ablations (`skip`) raise NoEmulator.
Bad input reads as the kernel writes it: a row whose top-k entry is on an unallocated page or
whose SWA range is wider than the kernel's, or that reads a record never written (poison), is NaN
(a bf16 NaN; the GPU tests check isnan, not the bits); a position outside the RoPE table gives NaN
rope dims (sparse_mqa_ref does that itself). The cluster shape is not part of an emulated launch
(`emulate` sees the grid, not the LaunchSpec): a launch without it, NaN on the GPU, is not caught.
"""
from __future__ import annotations

import numpy as np

from executor.emulate import NoEmulator
from executor.hostmem import OutOfBounds
from executor.launches.sparse_mqa import spec_of
from kernels import rope_ref
from kernels import sparse_mqa_ref as ref
from kernels.common_ref import BF16

_BF16_NAN = np.uint16(0x7FC0)


class _Records:
    """Rows of 584-byte records at `ptr`, read by index (an int or an int array) and resolved in
    the address space one row at a time: a cache's length is not in the kernel's ABI."""

    def __init__(self, space, ptr: int, name: str):
        self.space, self.ptr, self.name = space, ptr, name

    def _row(self, index: int) -> np.ndarray:
        if index < 0:                   # the kernel would read before the buffer
            raise OutOfBounds(f"{self.name}: record {index} at {self.space.name_of(self.ptr)}")
        return self.space.array(self.ptr + index * ref.RECORD_BYTES, np.uint8, ref.RECORD_BYTES)

    def __getitem__(self, index):
        if np.ndim(index) == 0:
            return self._row(int(index))
        rows = [self._row(int(i)) for i in np.asarray(index).reshape(-1)]
        return np.stack(rows) if rows else np.zeros((0, ref.RECORD_BYTES), np.uint8)


def emulate(record, grid, args, space) -> None:
    spec = spec_of(record.spec)
    if spec.name != record.name or spec.ablation:
        raise NoEmulator(f"no CPU emulator for sparse MQA kernel {record.name!r} (a timing-only "
                         f"ablation skipping {list(spec.skip)}, or an unknown variant)")
    rows = args["rows"]
    if tuple(grid) != spec.grid(rows):
        raise ValueError(f"{spec.name}: grid {tuple(grid)} for {rows} rows; the kernel takes "
                         f"grid {spec.grid(rows)} (one cluster per row)")
    h = spec.heads
    q = space.array(args["q"], BF16, (rows, h, ref.HEAD_DIM)).copy()
    info = space.array(args["row_info"], np.int32, (rows, ref.INFO_FIELDS)).copy()
    seqs = int(info[:, 3].max()) + 1            # 0 when every row is padding
    lines = space.array(args["state_lines"], np.int32, seqs).copy()
    topk = tables = compressed = None
    if spec.topk:
        topk = space.array(args["topk"], np.int32, (rows, spec.topk)).copy()
        tables = space.array(args["block_tables"], np.int32,
                             (seqs, args["pages_per_seq"])).copy()
        compressed = _Records(space, args["compressed"], "compressed")
    swa = _Records(space, args["swa"], "swa")

    def gather(sel):
        return ref.gather(spec, swa, compressed, None if topk is None else topk[sel], tables,
                          info[sel], lines, args["page_size"])

    bad = np.zeros(rows, bool)
    try:
        gathered = gather(slice(None))
    except ValueError:                  # bad input: find the rows the kernel writes as NaN
        for i in range(rows):
            try:
                gather(slice(i, i + 1))
            except ValueError:
                bad[i] = True
        info[bad, 3] = -1               # gathered as padding rows, then written NaN
        gathered = gather(slice(None))
    sink = space.array(args["sink"], np.float32, h).copy()
    cos_sin = space.array(args["rope_table"], np.float32,
                          (args["num_positions"], rope_ref.PAIRS, 2)).copy()
    # The kernel reads only the (cos, sin) rows; inv_freq is not part of the launch.
    table = rope_ref.RopeTable("device", np.full(rope_ref.PAIRS, np.nan, np.float32), cos_sin)
    out = ref.sparse_mqa_ref(spec, q, gathered, sink, info, table).view(np.uint16)
    out[bad] = _BF16_NAN
    space.array(args["out"], np.uint16, (rows, h, ref.HEAD_DIM))[...] = out

