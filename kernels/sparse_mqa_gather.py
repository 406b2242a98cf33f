"""Phases A/B of the sparse MQA decode kernel (`kernels/sparse_mqa.py`): addresses, q, records.

Each CTA resolves the record addresses of its share of the row's entries (SWA ring slot or
compressed block; masked -> 0, bad -> 1), stages q (and, with `split="fixed"`, the sink and RoPE
row) in shared memory and copies every record with 8-byte `cp.async`. `SparseMqaSm90` inherits
these `@cute.jit` phases and sets the attributes they read; the kernel itself stays in
`kernels/sparse_mqa.py` (the DSL names the cubin's entry after the kernel's module).
"""
from __future__ import annotations

import cutlass
from cutlass import Int32, Int64, cute

from kernels import sparse_mqa_ref as ref
from kernels.ptx import (
    cp_async_4,
    cp_async_8,
    cp_async_16,
    ld_s32,
    ld_v4_s32,
    lds_s64,
    sts_s64,
    sts_v2_u32,
)

REC = ref.RECORD_BYTES
REC_WORDS = REC // 8                # 73 8-byte words per record


class SparseMqaGather:
    """Phases A/B; the kernel class sets `spec`, `lay`, `S`, `E`, `H`, `topk`."""

    @cute.jit
    def _addresses_balanced(self, q: cute.Pointer, swa: cute.Pointer, compressed: cute.Pointer,
                            topk: cute.Pointer, block_tables: cute.Pointer,
                            row_info: cute.Pointer, state_lines: cute.Pointer, base: Int32,
                            tidx: Int32, s: Int32, r: Int32, rows: Int32, pages_per_seq: Int32,
                            page_size: Int32):
        """Split by the row's count: row_info -> top-k id -> block table -> record (4 hops).
        Leaves the CTA's record addresses in smem; returns (position, seq, padded count)."""
        info = cute.make_rmem_tensor((4,), Int32)
        info.fill(-1)
        info[0] = 0
        if r < rows:
            words = ld_v4_s32(row_info.toint() + Int64(r) * 16)
            for i in cutlass.range_constexpr(4):
                info[i] = words[i]
        pos, lo, hi, seq = info[0], info[1], info[2], info[3]
        # The row's entry count C, this CTA's share [first, first + count), padded to 16.
        nswa = cutlass.max(hi - lo + 1, 0)
        bad_row = (lo < 0) | (nswa > self.spec.swa_cols)
        nswa = cutlass.min(nswa, self.spec.swa_cols)
        total = Int32(0)
        line = Int32(0)
        if seq >= 0:
            total = nswa + self.topk
            line = ld_s32(state_lines.toint() + Int64(seq) * 4)
        per = ((total + self.S - 1) // self.S + 15) // 16 * 16
        first = s * per
        count = cutlass.min(cutlass.max(total - first, 0), per)
        n_pad = (count + 15) // 16 * 16

        if r < rows:
            self._load_q(q, base, r, tidx)
        if tidx < n_pad:
            addr = self._record_address(swa, compressed, topk, block_tables, r, seq, line, lo,
                                        nswa, first + tidx, tidx < count, bad_row,
                                        pages_per_seq, page_size)
            sts_s64(base + self.lay.addresses + tidx * 8, addr)
        cute.arch.sync_threads()
        return pos, seq, n_pad

    @cute.jit
    def _addresses_fixed(self, q: cute.Pointer, swa: cute.Pointer, compressed: cute.Pointer,
                         topk: cute.Pointer, block_tables: cute.Pointer, row_info: cute.Pointer,
                         state_lines: cute.Pointer, rope_table: cute.Pointer, base: Int32,
                         tidx: Int32, s: Int32, r: Int32, rows: Int32, pages_per_seq: Int32,
                         page_size: Int32, num_positions: Int32):
        """Split fixed by slot: thread t < sw takes SWA slot s*sw + t, thread sw + i top-k slot
        s*tk + i. The top-k id loads in the same wave as row_info, so the chain is 3 hops
        (top-k id | row_info -> block table | state line -> record); the row's RoPE row is
        prefetched with the second wave. Returns (position, seq)."""
        sw, tk = self.spec.swa_share, self.spec.topk_share
        k = s * tk + (tidx - sw)
        e = Int32(-1)
        if (r < rows) & (tidx >= sw) & (tidx < sw + tk) & (k < self.topk):
            e = ld_s32(topk.toint() + (Int64(r) * self.topk + Int64(k)) * 4)
        info = cute.make_rmem_tensor((4,), Int32)
        info.fill(-1)
        info[0] = 0
        if r < rows:
            words = ld_v4_s32(row_info.toint() + Int64(r) * 16)
            for i in cutlass.range_constexpr(4):
                info[i] = words[i]
            if cutlass.const_expr(not self.early):     # early: q after the PDL wait
                self._load_q(q, base, r, tidx)
        pos, lo, hi, seq = info[0], info[1], info[2], info[3]
        if (tidx < 16) & (pos >= 0) & (pos < num_positions):    # 256 B: 16 x 16 B
            cp_async_16(base + self.lay.consts + ref.MMA_M * 4 + tidx * 16,
                        rope_table.toint() + Int64(pos) * 256 + tidx * 16)
        nswa = cutlass.max(hi - lo + 1, 0)
        bad_row = (lo < 0) | (nswa > self.spec.swa_cols)
        j = s * sw + tidx
        addr = Int64(0)
        if seq >= 0:
            if bad_row:
                addr = Int64(1)
            elif tidx < sw:
                if j < nswa:
                    line = ld_s32(state_lines.toint() + Int64(seq) * 4)
                    slot = line * self.spec.ring_slots + ((lo + j) & (self.spec.ring_slots - 1))
                    addr = swa.toint() + Int64(slot) * REC
            elif e >= 0:
                page = e // page_size
                block = Int32(-1)
                if page < pages_per_seq:
                    block = ld_s32(block_tables.toint()
                                    + (Int64(seq) * pages_per_seq + Int64(page)) * 4)
                addr = Int64(1)
                if block >= 0:
                    addr = compressed.toint() + (Int64(block) * page_size
                                                 + Int64(e % page_size)) * REC
        if tidx < self.E:
            sts_s64(base + self.lay.addresses + tidx * 8, addr)
        cute.arch.sync_threads()
        return pos, seq

    @cute.jit
    def _prefetch_sink(self, base: Int32, tidx: Int32, sink: cute.Pointer):
        if tidx < self.H:
            cp_async_4(base + self.lay.consts + tidx * 4, sink.toint() + Int64(tidx) * 4)

    @cute.jit
    def _zero_pad_heads(self, base: Int32, tidx: Int32):
        """q rows H..15 of the mma tile are zero (a model constant: before the PDL wait)."""
        if cutlass.const_expr(self.H < ref.MMA_M):
            words = (ref.MMA_M - self.H) * ref.Q_ROW_BYTES // 8
            for i in cutlass.range_constexpr(0, words, ref.CTA_THREADS):
                if tidx + i < words:
                    sts_v2_u32(base + self.lay.q + self.H * ref.Q_ROW_BYTES + (tidx + i) * 8,
                               Int32(0), Int32(0))

    @cute.jit
    def _load_q(self, q: cute.Pointer, base: Int32, r: Int32, tidx: Int32):
        chunks = self.H * ref.HEAD_DIM // 8               # 16-byte chunks of the row's q
        per_head = ref.HEAD_DIM // 8
        for i in cutlass.range_constexpr(0, chunks, ref.CTA_THREADS):
            c = tidx + i
            if c < chunks:
                h, k = c // per_head, c % per_head
                cp_async_16(base + self.lay.q + h * ref.Q_ROW_BYTES + k * 16,
                            q.toint() + (Int64(r) * self.H * ref.HEAD_DIM + c * 8) * 2)

    @cute.jit
    def _record_address(self, swa: cute.Pointer, compressed: cute.Pointer, topk: cute.Pointer,
                        block_tables: cute.Pointer, r: Int32, seq: Int32, line: Int32, lo: Int32,
                        nswa: Int32, j: Int32, in_range, bad_row, pages_per_seq: Int32,
                        page_size: Int32) -> Int64:
        """Global address of entry j of the row: 0 = masked (zeros, -inf), 1 = bad input (NaN)."""
        addr = Int64(0)
        if in_range:
            if bad_row:
                addr = Int64(1)
            elif j < nswa:
                slot = line * self.spec.ring_slots + ((lo + j) & (self.spec.ring_slots - 1))
                addr = swa.toint() + Int64(slot) * REC
            else:
                if cutlass.const_expr(self.topk > 0):
                    e = ld_s32(topk.toint() + (Int64(r) * self.topk + Int64(j - nswa)) * 4)
                    if e >= 0:
                        page = e // page_size
                        block = Int32(-1)
                        if page < pages_per_seq:
                            block = ld_s32(block_tables.toint()
                                            + (Int64(seq) * pages_per_seq + Int64(page)) * 4)
                        addr = Int64(1)
                        if block >= 0:
                            phys = Int64(block) * page_size + Int64(e % page_size)
                            addr = compressed.toint() + phys * REC
        return addr

    @cute.jit
    def _load_records(self, base: Int32, tidx: Int32, n_pad: Int32):
        """cp.async every 8-byte word of the CTA's records; masked and padding entries get zeros
        (P is 0 there, and 0 x NaN would still poison the PV product)."""
        idx = tidx
        while idx < n_pad * REC_WORDS:
            i, w = idx // REC_WORDS, idx % REC_WORDS
            addr = lds_s64(base + self.lay.addresses + i * 8)
            dst = base + self.lay.records + i * REC + w * 8
            if addr > 1:
                cp_async_8(dst, addr + Int64(w * 8))
            else:
                sts_v2_u32(dst, Int32(0), Int32(0))
            idx += ref.CTA_THREADS
