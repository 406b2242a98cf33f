"""Shared-memory routing lists of the self-routed MoE chain (`kernels/moe_selfroute.py`).

Each `moe_w13sr` / `moe_w2sr` CTA builds, from the <= 192 x k top-k ids, the same lists as
`moe_prep` (row bitmap per expert, popcounts, one block scan; rows ascending) in its own shared
memory; `SmemRouting` holds that layout and the `@cute.jit` phases that build and read it.
"""
from __future__ import annotations

import cutlass
from cutlass import Int32, Int64, cute

from kernels import moe_kernel_ref as mk
from kernels import moe_ptx as mp
from kernels.block_scan import block_scan
from kernels.ptx import lds_u32, sts_u32


def lds_u32_if(saddr: Int32, pred: Int32):
    """A shared word where pred != 0, else 0."""
    return Int32(mp._asm(1, [Int32(saddr), Int32(pred)],
                         "{ .reg .pred p; setp.ne.s32 p, $2, 0; mov.b32 $0, 0;\n"
                         "@p ld.shared.u32 $0, [$1]; }", "=r,r,r", side_effects=True))


class SmemRouting:
    """The routing lists of one CTA in shared memory, `moe_prep`'s format without the header:
    experts ascending, per entry its first pair and pair count, pairs = row * k + slot.

    scratch (the weight ring's space, dead once the lists exist): bitmap [E][6] + the ids.
    lists: totals [warps] | distinct count (byte 32) | experts [E] | first [E] | count [E] | pairs.
    """

    def __init__(self, shape: mk.MoeShape, threads: int):
        self.experts, self.topk = shape.num_experts, shape.topk
        self.threads = threads
        self.warps = threads // mk.LANES
        self.per_thread = mk.ceil_div(self.experts, threads)
        self.bitmap_words = self.experts * mk.BITMAP_WORDS
        self.ids_per_thread = mk.ceil_div(mk.MAX_ROWS * self.topk, threads)
        e4 = 4 * self.experts
        self.experts_at = mk.ROUTING_HEADER
        self.first_at = self.experts_at + e4
        self.count_at = self.first_at + e4
        self.pairs_at = self.count_at + e4

    @cute.jit
    def build(self, ids: Int64, rows: Int32, scratch: Int32, lists: Int32, tidx: Int32):
        """Every thread of the CTA; ends with a barrier (the scratch may be overwritten after)."""
        ids_s = scratch + self.bitmap_words * 4
        i = tidx
        while i < self.bitmap_words:
            sts_u32(scratch + 4 * i, Int32(0))
            i += self.threads
        cute.arch.sync_threads()
        # Every id this thread handles is loaded before the first is used: one round trip,
        # not one per id (the loads are volatile asm and stay in source order).
        n = rows * self.topk
        got = [mp.ld_relaxed_u32(ids + Int64(tidx + c * self.threads) * 4,
                                 Int32(1) if tidx + c * self.threads < n else Int32(0))
               for c in range(self.ids_per_thread)]
        for c in cutlass.range_constexpr(self.ids_per_thread):
            i = tidx + c * self.threads
            e = got[c]
            if i < n:
                row = i // self.topk
                sts_u32(ids_s + 4 * i, e)
                if e >= 0 and e < self.experts:
                    mp.atom_or_shared(scratch + 4 * (e * mk.BITMAP_WORDS + row // 32),
                                      Int32(1) << (row % 32))
        cute.arch.sync_threads()
        counts = self.count_rows(scratch, tidx)
        local = Int32(0)
        for k in cutlass.range_constexpr(self.per_thread):
            local = local + counts[k] + (Int32(1 << 16) if counts[k] > 0 else Int32(0))
        exclusive, total = block_scan(local, lists, tidx, self.warps)
        pair_off = exclusive & 0xFFFF
        entry = exclusive >> 16
        for k in cutlass.range_constexpr(self.per_thread):
            e = tidx * self.per_thread + k
            if counts[k] > 0:
                sts_u32(lists + self.experts_at + 4 * entry, e)
                sts_u32(lists + self.first_at + 4 * entry, pair_off)
                sts_u32(lists + self.count_at + 4 * entry, counts[k])
                self.list_rows(ids_s, lists + self.pairs_at, scratch, e, pair_off)
                entry = entry + 1
                pair_off = pair_off + counts[k]
        if tidx == self.threads - 1:
            sts_u32(lists + 32, total >> 16)
        cute.arch.sync_threads()

    @cute.jit
    def count_rows(self, bitmap: Int32, tidx: Int32):
        counts = []
        for k in cutlass.range_constexpr(self.per_thread):
            e = tidx * self.per_thread + k
            c = Int32(0)
            if e < self.experts:
                for w in cutlass.range_constexpr(mk.BITMAP_WORDS):
                    c = c + mp.popc(lds_u32(bitmap + 4 * (e * mk.BITMAP_WORDS + w)))
            counts.append(c)
        return counts

    @cute.jit
    def list_rows(self, ids_s: Int32, pairs: Int32, bitmap: Int32, e: Int32, pair_off: Int32):
        n = pair_off
        for w in cutlass.range_constexpr(mk.BITMAP_WORDS):
            bits = lds_u32(bitmap + 4 * (e * mk.BITMAP_WORDS + w))
            while bits != 0:
                row = w * 32 + mp.ctz(bits)
                bits = bits & (bits - 1)
                slot = Int32(0)
                for s in cutlass.range_constexpr(self.topk):
                    if lds_u32(ids_s + 4 * (row * self.topk + s)) == e:
                        slot = Int32(s)
                sts_u32(pairs + 4 * n, row * self.topk + slot)
                n = n + 1

    @cute.jit
    def distinct(self, lists: Int32):
        return lds_u32(lists + 32)

    @cute.jit
    def entry(self, lists: Int32, j: Int32):
        """(expert, first pair, pair count) of distinct entry j."""
        return (lds_u32(lists + self.experts_at + 4 * j),
                lds_u32(lists + self.first_at + 4 * j),
                lds_u32(lists + self.count_at + 4 * j))

    @cute.jit
    def expert_of_item(self, lists: Int32, item: Int32, per_expert: int, total: Int32):
        """The expert of work item `item` (0 past the last item: the caller issues nothing)."""
        valid = Int32(1) if item < total else Int32(0)
        j = item // per_expert if item < total else Int32(0)
        return lds_u32_if(lists + self.experts_at + 4 * j, valid)
