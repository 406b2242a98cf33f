"""moe_prep: the default MoE chain's first kernel: routing lists (CTA 0) and x as FP8 (CTAs 1..).

What it writes and the exact reference: `kernels/moe_kernel_ref.py` (`routing_lists`,
`quantize_fragments`); compiled and dispatched by `kernels/moe.py` (the family module).
"""
from __future__ import annotations

import cutlass
from cuda.bindings import driver as cuda
from cutlass import Int32, Int64, cute

from kernels import moe_kernel_ref as mk
from kernels.block_scan import block_scan
from kernels.moe_ptx import (
    _addr,
    atom_or_shared,
    ctz,
    fragment_position,
    ld_u32,
    ld_v2,
    popc,
    quantize_quad,
    st_u32,
)
from kernels.ptx import lds_u32, st_f32, sts_u32


class MoePrepSm90:
    """moe_prep: CTA 0 builds the routing lists, CTAs 1.. quantize x (one warp per row group)."""

    def __init__(self, spec: mk.MoeSpec):
        self.spec = spec
        s = spec.shape
        self.experts, self.topk, self.hidden = s.num_experts, s.topk, s.hidden
        self.groups = s.groups(s.k13)
        self.k_pad = s.k13
        self.per_thread = mk.ceil_div(self.experts, mk.PREP_THREADS)
        self.bitmap_words = self.experts * mk.BITMAP_WORDS
        self.warps = mk.PREP_THREADS // mk.LANES

    @cute.jit
    def __call__(self, topk_ids: cute.Pointer, x: cute.Pointer, meta: cute.Pointer,
                 pairs: cute.Pointer, xq: cute.Pointer, xs: cute.Pointer, rows: Int32,
                 stream: cuda.CUstream):
        self.kernel(topk_ids, x, meta, pairs, xq, xs, rows).launch(
            grid=[2, 1, 1], block=list(self.spec.block), smem=self.spec.smem_bytes,
            stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, topk_ids: cute.Pointer, x: cute.Pointer, meta: cute.Pointer,
               pairs: cute.Pointer, xq: cute.Pointer, xs: cute.Pointer, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        smem = cutlass.memory.SmemAllocator()
        base = smem.allocate(self.spec.smem_bytes, byte_alignment=16).toint()
        cute.arch.griddepcontrol_wait()          # topk ids and x come from the router
        cute.arch.griddepcontrol_launch_dependents()
        if bidx == 0:
            self.route(_addr(topk_ids), _addr(meta), _addr(pairs), rows, base, tidx)
        else:
            self.quantize_rows(_addr(x), _addr(xq), _addr(xs), rows, tidx, bidx, gdim)

    @cute.jit
    def quantize_rows(self, x: Int64, xq: Int64, xs: Int64, rows: Int32, tidx: Int32,
                      bidx: Int32, gdim: Int32):
        lane = tidx % mk.LANES
        item = (bidx - 1) * self.warps + tidx // mk.LANES
        while item < rows * self.groups:
            row = item // self.groups
            grp = item % self.groups
            k = grp * mk.ACT_GROUP + 4 * lane
            w = ld_v2(x + Int64(row * self.hidden + k) * 2, Int32(1))
            q, scale = quantize_quad(w[0], w[1])
            pos = fragment_position(grp * 4 + lane // 8, lane)
            st_u32(xq + Int64(row) * self.k_pad + pos, q)
            if lane == 0:
                st_f32(xs + Int64(row * self.groups + grp) * 4, scale)
            item += (gdim - 1) * self.warps

    @cute.jit
    def route(self, ids: Int64, meta: Int64, pairs: Int64, rows: Int32, base: Int32,
              tidx: Int32):
        """Bitmap of rows per expert (red.or), popcounts, one block scan, then each thread lists
        its experts' rows in ascending order: deterministic, no float atomics."""
        totals = base + self.bitmap_words * 4          # [warps] scan totals, then the bad count
        bad = totals + self.warps * 4
        ids_s = bad + 16                               # the ids, read back by list_rows
        i = tidx
        while i < self.bitmap_words:
            sts_u32(base + 4 * i, Int32(0))
            i += mk.PREP_THREADS
        if tidx == 0:
            sts_u32(bad, Int32(0))
        cute.arch.sync_threads()
        i = tidx
        while i < rows * self.topk:
            e = ld_u32(ids + Int64(i) * 4, Int32(1))
            row = i // self.topk
            sts_u32(ids_s + 4 * i, e)
            if e >= 0 and e < self.experts:
                atom_or_shared(base + 4 * (e * mk.BITMAP_WORDS + row // 32),
                               Int32(1) << (row % 32))
            else:
                atom_or_shared(bad, Int32(1))
            i += mk.PREP_THREADS
        cute.arch.sync_threads()
        counts = self.count_rows(base, tidx)
        local = Int32(0)
        for k in cutlass.range_constexpr(self.per_thread):
            local = local + counts[k] + (Int32(1 << 16) if counts[k] > 0 else Int32(0))
        exclusive, total = block_scan(local, totals, tidx, self.warps)
        pair_off = exclusive & 0xFFFF
        entry = exclusive >> 16
        for k in cutlass.range_constexpr(self.per_thread):
            e = tidx * self.per_thread + k
            if counts[k] > 0:
                st_u32(meta + 4 * (mk.META_HEADER + entry), e)
                st_u32(meta + 4 * (mk.META_HEADER + self.experts + entry), pair_off)
                st_u32(meta + 4 * (mk.META_HEADER + 2 * self.experts + entry), counts[k])
                self.list_rows(ids_s, pairs, base, e, pair_off)
                entry = entry + 1
                pair_off = pair_off + counts[k]
        if tidx == mk.PREP_THREADS - 1:
            st_u32(meta, total >> 16)
            st_u32(meta + 4, lds_u32(bad))

    @cute.jit
    def count_rows(self, base: Int32, tidx: Int32):
        counts = []
        for k in cutlass.range_constexpr(self.per_thread):
            e = tidx * self.per_thread + k
            c = Int32(0)
            if e < self.experts:
                for w in cutlass.range_constexpr(mk.BITMAP_WORDS):
                    c = c + popc(lds_u32(base + 4 * (e * mk.BITMAP_WORDS + w)))
            counts.append(c)
        return counts

    @cute.jit
    def list_rows(self, ids_s: Int32, pairs: Int64, base: Int32, e: Int32, pair_off: Int32):
        """Pairs of expert e, rows ascending; the slot from the ids in shared memory (a global
        read here would cost one round trip per row: 192 serial ones when one expert has all)."""
        n = pair_off
        for w in cutlass.range_constexpr(mk.BITMAP_WORDS):
            bits = lds_u32(base + 4 * (e * mk.BITMAP_WORDS + w))
            while bits != 0:
                row = w * 32 + ctz(bits)
                bits = bits & (bits - 1)
                slot = Int32(0)
                for s in cutlass.range_constexpr(self.topk):
                    if lds_u32(ids_s + 4 * (row * self.topk + s)) == e:
                        slot = Int32(s)
                st_u32(pairs + Int64(n) * 4, row * self.topk + slot)
                n = n + 1
