"""Self-routed MoE chain (SM90 CuTe DSL): w13 / w2 that build their routing lists from the ids.

The default chain (`kernels/moe.py`) pays, before any weight byte moves, for `moe_prep` (a launch,
the ids from HBM, three CTA barriers on one CTA) and then, per work item, for global metadata
reads (expert -> first pair, count -> pair ids -> activations: dependent L2 round trips of ~1 us
under load). Here every `moe_w13sr` / `moe_w2sr` CTA reads the <= 192 x k ids itself, builds the
same lists as `moe_prep` (row bitmap per expert, popcounts, one block scan; rows ascending) in
shared memory, and issues its first items' weights at once, all before `griddepcontrol.wait`;
an item's expert, pair count and pair ids are then shared-memory reads. x is quantized by
`moe_xquant` (no routing dependency: in the model it runs beside the router).

    xquant |wait|trigger| x -> FP8 (one warp per row group)                          |
    w13sr  |ids -> lists in smem, fill ring|wait|trigger| mma -> h                   |
    w2sr          |ids -> lists in smem, fill ring|wait|trigger| h -> FP8, mma -> ye |
    combine (kernels/moe.py, unchanged)                               |wait| y       |

Why reading the ids before the wait is safe: they come from the router, which precedes
`moe_xquant`; a kernel is launched only once its predecessor's CTAs have all passed their own
wait (which completed and flushed the kernel before them), so the ids are final; they are read
with ld.relaxed.gpu (no stale L1 line). The chain order is therefore router -> xquant -> w13sr.

Numerics and work split are the defaults' (the same `chunk_math`, `group_mma`, `chunk_mma`, the
same weight ring), so y is bitwise the default chain's. Bad ids (outside [0, E)) are skipped: their
pairs get no h / ye (the default chain counts them in meta[1]; here there is no meta).
The lists' layout and the phases that build them: `kernels/moe_selfroute_routing.py`.
"""
from __future__ import annotations

import cutlass
from cuda.bindings import driver as cuda
from cutlass import Float32, Int32, Int64, cute

from kernels import moe as mo
from kernels import moe_kernel_ref as mk
from kernels import moe_ptx as mp
from kernels.moe_selfroute_routing import SmemRouting, lds_u32_if
from kernels.ptx import (
    ld_f32_if,
    lds_f32,
    lds_v4_u32,
    round_bf16,
    st_bf16,
    st_f32,
    sts_f32,
    sts_u32,
)


class MoeXQuantSm90:
    """moe_xquant: x [R, D] bf16 -> xq (E4M3, fragment order) + xs (f32 per 128), one warp per
    (row, group), exactly `moe_prep`'s quantizer."""

    def __init__(self, spec: mk.MoeSpec):
        self.spec = spec
        s = spec.shape
        self.hidden, self.k_pad = s.hidden, s.k13
        self.groups = s.groups(s.k13)
        self.warps = spec.block[0] // mk.LANES

    @cute.jit
    def __call__(self, x: cute.Pointer, xq: cute.Pointer, xs: cute.Pointer, rows: Int32,
                 stream: cuda.CUstream):
        self.kernel(x, xq, xs, rows).launch(grid=[2, 1, 1], block=list(self.spec.block),
                                            stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, x: cute.Pointer, xq: cute.Pointer, xs: cute.Pointer, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        cute.arch.griddepcontrol_wait()          # x comes from the previous sublayer
        cute.arch.griddepcontrol_launch_dependents()
        lane = tidx % mk.LANES
        xa, qa, sa = mp._addr(x), mp._addr(xq), mp._addr(xs)
        item = bidx * self.warps + tidx // mk.LANES
        while item < rows * self.groups:
            row = item // self.groups
            grp = item % self.groups
            k = grp * mk.ACT_GROUP + 4 * lane
            w = mp.ld_v2(xa + Int64(row * self.hidden + k) * 2, Int32(1))
            q, scale = mp.quantize_quad(w[0], w[1])
            pos = mp.fragment_position(grp * 4 + lane // 8, lane)
            mp.st_u32(qa + Int64(row) * self.k_pad + pos, q)
            if lane == 0:
                st_f32(sa + Int64(row * self.groups + grp) * 4, scale)
            item += gdim * self.warps


class MoeW13SelfRoutedSm90(mo.MoeW13Sm90):
    """moe_w13sr: moe_w13's items and math; routing lists in shared memory, ring filled before
    the wait, the stage just consumed refilled with the item `stages` ahead."""

    def __init__(self, spec: mk.MoeSpec):
        super().__init__(spec)
        self.routing = SmemRouting(spec.shape, self.threads)
        self.ring_region = mk.ring_region_bytes(spec.shape, "w13", self.stages)

    @cute.jit
    def __call__(self, topk_ids: cute.Pointer, xq: cute.Pointer, xs: cute.Pointer,
                 codes: cute.Pointer, offsets: cute.Pointer, scales: cute.Pointer,
                 h: cute.Pointer, rows: Int32, stream: cuda.CUstream):
        self.kernel(topk_ids, xq, xs, codes, offsets, scales, h, rows).launch(
            grid=[2, 1, 1], block=list(self.spec.block), smem=self.spec.smem_bytes,
            stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, topk_ids: cute.Pointer, xq: cute.Pointer, xs: cute.Pointer,
               codes: cute.Pointer, offsets: cute.Pointer, scales: cute.Pointer,
               h: cute.Pointer, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp = tidx // mk.LANES
        lane = tidx % mk.LANES
        smem = cutlass.memory.SmemAllocator()
        ring = smem.allocate(self.spec.smem_bytes, byte_alignment=16).toint()
        red = ring + self.ring_region
        lists = red + self.threads * 16
        self.routing.build(mp._addr(topk_ids), rows, ring, lists, tidx)
        total = self.routing.distinct(lists) * self.tiles
        for s in cutlass.range_constexpr(self.stages):
            first_item = bidx + s * gdim
            first_e = self.routing.expert_of_item(lists, first_item, self.tiles, total)
            self.issue(ring + s * self.stage_bytes, first_e, mp._addr(codes), mp._addr(offsets),
                       first_item, total, warp, lane, tidx)
        cute.arch.griddepcontrol_wait()          # xq, xs come from moe_xquant
        cute.arch.griddepcontrol_launch_dependents()
        item = bidx
        it = Int32(0)
        while item < total:
            e, first, count = self.routing.entry(lists, item // self.tiles)
            tile = item % self.tiles
            scale = ld_f32_if(mp._addr(scales) + Int64(e) * 4, Int32(1))
            stage = ring + (it % self.stages) * self.stage_bytes
            pair_list = lists + self.routing.pairs_at + 4 * first
            ins = self.chunk_inputs_smem(pair_list, mp._addr(xq), mp._addr(xs), count, Int32(0),
                                         warp, lane)
            mp.cp_async_wait(self.stages - 1)
            self.chunk_math(stage, ins, mp._addr(h), tile, scale, red, warp, lane, tidx)
            chunk = Int32(mk.CHUNK_TOKENS)
            while chunk < count:
                ins = self.chunk_inputs_smem(pair_list, mp._addr(xq), mp._addr(xs),
                                             count - chunk, chunk, warp, lane)
                self.chunk_math(stage, ins, mp._addr(h), tile, scale, red, warp, lane, tidx)
                chunk += mk.CHUNK_TOKENS
            # chunk_math ended with a barrier: this stage is free for the item `stages` ahead.
            refill = item + self.stages * gdim
            self.issue(stage, self.routing.expert_of_item(lists, refill, self.tiles, total),
                       mp._addr(codes), mp._addr(offsets), refill, total, warp, lane, tidx)
            item += gdim
            it += 1

    @cute.jit
    def chunk_inputs_smem(self, pair_list: Int32, xq: Int64, xs: Int64, left: Int32,
                          chunk: Int32, warp: Int32, lane: Int32):
        """`chunk_inputs` with the pair ids read from the shared-memory list."""
        g, t = lane // 4, lane % 4
        topk = self.shape.topk
        vb = Int32(1) if g < left else Int32(0)
        rb = lds_u32_if(pair_list + 4 * (chunk + g), vb) // topk
        v0 = Int32(1) if 2 * t < left else Int32(0)
        v1 = Int32(1) if 2 * t + 1 < left else Int32(0)
        p0 = lds_u32_if(pair_list + 4 * (chunk + 2 * t), v0)
        p1 = lds_u32_if(pair_list + 4 * (chunk + 2 * t + 1), v1)
        b_regs, sc = self.slice_inputs(xq + Int64(rb) * self.shape.k13 + 8 * t, vb, xs, p0, p1,
                                       v0, v1, warp)
        return b_regs, sc, p0, p1, v0, v1


class MoeW13EarlyRefillSm90(MoeW13SelfRoutedSm90):
    """moe_w13sr "early": a one-item ring whose stage is refilled with the CTA's next item while
    the current one is still being computed: each thread re-issues the cp.async of a 128-group's
    weights right after the mma that consumed them (it reads back only what it copied, and the
    mma's operands come from those reads, so the overwrite cannot pass them). The next item's
    latency then overlaps this item's math, cross-warp sum and epilogue, which the plain ring
    serialises. Only in an item's last token chunk (earlier chunks re-read the stage)."""

    @cute.kernel
    def kernel(self, topk_ids: cute.Pointer, xq: cute.Pointer, xs: cute.Pointer,
               codes: cute.Pointer, offsets: cute.Pointer, scales: cute.Pointer,
               h: cute.Pointer, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp = tidx // mk.LANES
        lane = tidx % mk.LANES
        smem = cutlass.memory.SmemAllocator()
        ring = smem.allocate(self.spec.smem_bytes, byte_alignment=16).toint()
        red = ring + self.ring_region
        lists = red + self.threads * 16
        self.routing.build(mp._addr(topk_ids), rows, ring, lists, tidx)
        total = self.routing.distinct(lists) * self.tiles
        self.issue(ring, self.routing.expert_of_item(lists, bidx, self.tiles, total),
                   mp._addr(codes), mp._addr(offsets), bidx, total, warp, lane, tidx)
        cute.arch.griddepcontrol_wait()          # xq, xs come from moe_xquant
        cute.arch.griddepcontrol_launch_dependents()
        item = bidx
        while item < total:
            e, first, count = self.routing.entry(lists, item // self.tiles)
            tile = item % self.tiles
            scale = ld_f32_if(mp._addr(scales) + Int64(e) * 4, Int32(1))
            nxt = item + gdim
            nxt_e = self.routing.expert_of_item(lists, nxt, self.tiles, total)
            refill = self.weight_addresses(nxt_e, nxt, mp._addr(codes), mp._addr(offsets), warp,
                                           lane)
            more = Int32(1) if nxt < total else Int32(0)
            pair_list = lists + self.routing.pairs_at + 4 * first
            ins = self.chunk_inputs_smem(pair_list, mp._addr(xq), mp._addr(xs), count, Int32(0),
                                         warp, lane)
            mp.cp_async_wait(0)
            last = Int32(1) if count <= mk.CHUNK_TOKENS else Int32(0)
            self.chunk_math_refill(ring, ins, mp._addr(h), tile, scale, red, warp, lane, tidx,
                                   refill, more * last)
            chunk = Int32(mk.CHUNK_TOKENS)
            while chunk < count:
                ins = self.chunk_inputs_smem(pair_list, mp._addr(xq), mp._addr(xs),
                                             count - chunk, chunk, warp, lane)
                last = Int32(1) if chunk + mk.CHUNK_TOKENS >= count else Int32(0)
                self.chunk_math_refill(ring, ins, mp._addr(h), tile, scale, red, warp, lane,
                                       tidx, refill, more * last)
                chunk += mk.CHUNK_TOKENS
            item += gdim

    @cute.jit
    def weight_addresses(self, e: Int32, item: Int32, codes: Int64, offsets: Int64, warp: Int32,
                         lane: Int32):
        """(code, offset) addresses of this thread's first column / group of item's weights, as
        `issue` computes them."""
        tile_id = Int64(e * self.tiles + item % self.tiles)
        wbase = (codes + (tile_id * self.cols + warp * self.cols_per_warp) * mk.COL_BYTES
                 + lane * 16)
        obase = (offsets + (tile_id * self.groups + warp * self.groups_per_warp)
                 * mk.GROUP_OFFSET_BYTES + (lane // 4) * 8)
        return wbase, obase

    @cute.jit
    def chunk_math_refill(self, stage: Int32, ins, h: Int64, tile: Int32, scale: Float32,
                          red: Int32, warp: Int32, lane: Int32, tidx: Int32, refill,
                          do_refill: Int32):
        """`chunk_math`, re-issuing each group's weight copies for the next item (when
        do_refill) right after that group's mma; one commit group per refilling call."""
        b_regs, sc, p0, p1, v0, v1 = ins
        wbase, obase = refill
        acc = [Float32(0.0)] * 4
        for gi in cutlass.range_constexpr(self.groups_per_warp):
            words = (lds_v4_u32(stage + ((2 * gi) * self.threads + tidx) * 16)
                     + lds_v4_u32(stage + ((2 * gi + 1) * self.threads + tidx) * 16))
            offs = mp.lds_v2(stage + self.offsets_at + (gi * self.threads + tidx) * 8)
            part = mp.group_mma(words, offs, 4, b_regs[gi])
            if do_refill != 0:
                for c in cutlass.range_constexpr(2 * gi, 2 * gi + 2):
                    mp.cp_async_16(stage + (c * self.threads + tidx) * 16,
                                   wbase + c * mk.COL_BYTES)
                mp.cp_async_8(stage + self.offsets_at + (gi * self.threads + tidx) * 8,
                              obase + gi * mk.GROUP_OFFSET_BYTES)
            sc0, sc1 = sc[gi]
            acc = [mp.fmul_add(acc[0], part[0], sc0), mp.fmul_add(acc[1], part[1], sc1),
                   mp.fmul_add(acc[2], part[2], sc0), mp.fmul_add(acc[3], part[3], sc1)]
        if do_refill != 0:
            mp.cp_async_commit()
        self.reduce_and_store(acc, h, tile, scale, red, warp, lane, tidx, p0, p1, v0, v1)

    @cute.jit
    def reduce_and_store(self, acc, h: Int64, tile: Int32, scale: Float32, red: Int32,
                         warp: Int32, lane: Int32, tidx: Int32, p0: Int32, p1: Int32, v0: Int32,
                         v1: Int32):
        """`chunk_math`'s tail: warp 0 sums the K slices in warp order, scale, bf16, SwiGLU."""
        g = lane // 4
        slot = red + 16 * tidx
        for i in cutlass.range_constexpr(4):
            sts_f32(slot + 4 * i, acc[i])
        cute.arch.sync_threads()
        if warp == 0:
            tot = [lds_f32(red + 16 * lane + 4 * i) for i in range(4)]
            for w in cutlass.range_constexpr(1, self.warps):
                for i in cutlass.range_constexpr(4):
                    tot[i] = tot[i] + lds_f32(red + 16 * (w * mk.LANES + lane) + 4 * i)
            limit = self.shape.swiglu_limit
            n = 8 * tile + g
            inter = self.shape.inter
            if v0 != 0:
                y0 = mp.swiglu(round_bf16(tot[0] * scale), round_bf16(tot[2] * scale),
                               limit)
                st_bf16(h + Int64(p0 * inter + n) * 2, y0)
            if v1 != 0:
                y1 = mp.swiglu(round_bf16(tot[1] * scale), round_bf16(tot[3] * scale),
                               limit)
                st_bf16(h + Int64(p1 * inter + n) * 2, y1)
        cute.arch.sync_threads()


class MoeW2SelfRoutedSm90(mo.MoeW2Sm90):
    """moe_w2sr: moe_w2's items and math; routing lists in shared memory, ring filled before
    the wait, the stage just consumed refilled with the item `stages` ahead."""

    def __init__(self, spec: mk.MoeSpec):
        super().__init__(spec)
        self.routing = SmemRouting(spec.shape, self.threads)
        self.ring_region = mk.ring_region_bytes(spec.shape, "w2", self.stages)

    @cute.jit
    def __call__(self, topk_ids: cute.Pointer, h: cute.Pointer, codes: cute.Pointer,
                 offsets: cute.Pointer, scales: cute.Pointer, ye: cute.Pointer, rows: Int32,
                 stream: cuda.CUstream):
        self.kernel(topk_ids, h, codes, offsets, scales, ye, rows).launch(
            grid=[2, 1, 1], block=list(self.spec.block), smem=self.spec.smem_bytes,
            stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, topk_ids: cute.Pointer, h: cute.Pointer, codes: cute.Pointer,
               offsets: cute.Pointer, scales: cute.Pointer, ye: cute.Pointer, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp = tidx // mk.LANES
        lane = tidx % mk.LANES
        smem = cutlass.memory.SmemAllocator()
        ring = smem.allocate(self.spec.smem_bytes, byte_alignment=16).toint()
        sq = ring + self.ring_region
        lists = sq + mk.w2_smem_bytes(self.shape)
        self.routing.build(mp._addr(topk_ids), rows, ring, lists, tidx)
        total = self.routing.distinct(lists) * self.blocks
        for s in cutlass.range_constexpr(self.stages):
            first_item = bidx + s * gdim
            self.issue(ring + s * self.stage_bytes,
                       self.routing.expert_of_item(lists, first_item, self.blocks, total),
                       mp._addr(codes), mp._addr(offsets), first_item, total, warp, lane, tidx)
        cute.arch.griddepcontrol_wait()          # h comes from moe_w13sr
        cute.arch.griddepcontrol_launch_dependents()
        item = bidx
        it = Int32(0)
        while item < total:
            e, first, count = self.routing.entry(lists, item // self.blocks)
            scale = ld_f32_if(mp._addr(scales) + Int64(e) * 4, Int32(1))
            tile = (item % self.blocks) * mk.W2_WARPS + warp
            stage = ring + (it % self.stages) * self.stage_bytes
            pair_list = lists + self.routing.pairs_at + 4 * first
            chunk = Int32(0)
            while chunk < count:
                self.quantize_chunk_smem(pair_list, mp._addr(h), count - chunk, chunk, sq, warp,
                                         lane)
                mp.cp_async_wait(self.stages - 1)   # this item's weights (no-op after chunk 0)
                cute.arch.sync_threads()
                self.chunk_mma(stage, mp._addr(ye), tile, scale, sq, lane, tidx)
                cute.arch.sync_threads()
                chunk += mk.CHUNK_TOKENS
            refill = item + self.stages * gdim
            self.issue(stage, self.routing.expert_of_item(lists, refill, self.blocks, total),
                       mp._addr(codes), mp._addr(offsets), refill, total, warp, lane, tidx)
            item += gdim
            it += 1

    @cute.jit
    def quantize_chunk_smem(self, pair_list: Int32, h: Int64, left: Int32, chunk: Int32,
                            sq: Int32, warp: Int32, lane: Int32):
        """`quantize_chunk` with the pair id read from the shared-memory list and every group's
        h loaded before the first is quantized: one L2 round trip per chunk, not one per group
        (the loads and shuffles are volatile asm, so the compiler keeps them in source order)."""
        valid = Int32(1) if warp < left else Int32(0)
        pair = lds_u32_if(pair_list + 4 * (chunk + warp), valid)
        self.quantize_pair(pair, valid, h, sq, warp, lane)

    @cute.jit
    def quantize_pair(self, pair: Int32, valid: Int32, h: Int64, sq: Int32, warp: Int32,
                      lane: Int32):
        """Token `warp` of the chunk (pair, or none where valid == 0): its five h groups loaded,
        then quantized into sq (moe_w2's layout), its pair id stored (-1: no token)."""
        inter, k_pad = self.shape.inter, self.shape.k2
        loaded = []
        for grp in cutlass.range_constexpr(self.groups):
            k = grp * mk.ACT_GROUP + 4 * lane
            inside = Int32(1) if k < inter else Int32(0)
            loaded.append(mp.ld_v2(h + Int64(pair * inter + k) * 2, valid * inside))
        for grp in cutlass.range_constexpr(self.groups):
            k = grp * mk.ACT_GROUP + 4 * lane
            w = loaded[grp]
            q, scale = mp.quantize_quad(w[0], w[1])
            if k < k_pad:
                sts_u32(sq + warp * k_pad + mp.fragment_position(grp * 4 + lane // 8, lane), q)
            if lane == 0:
                sts_f32(sq + self.q_bytes + 4 * (warp * self.groups + grp), scale)
        if lane == 0:
            sts_u32(sq + self.q_bytes + self.s_bytes + 4 * warp, pair if valid != 0 else -1)


class MoeW2EarlyRefillSm90(MoeW2SelfRoutedSm90):
    """moe_w2sr "early": as MoeW13EarlyRefillSm90, for w2: the one-item ring's stage is refilled
    with the CTA's next item group by group, right after the mma that consumed each group, in the
    item's last token chunk."""

    @cute.kernel
    def kernel(self, topk_ids: cute.Pointer, h: cute.Pointer, codes: cute.Pointer,
               offsets: cute.Pointer, scales: cute.Pointer, ye: cute.Pointer, rows: Int32):
        self.run(mp._addr(topk_ids), (mp._addr(h), mp._addr(codes), mp._addr(offsets),
                                      mp._addr(scales), mp._addr(ye)), rows)

    @cute.jit
    def run(self, topk_ids: Int64, ptrs, rows: Int32, stamps=None):
        """The kernel's body; stamps: the timeline build's record array (None in production)."""
        h, codes, offsets, scales, ye = ptrs
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        tl = mp.timeline_of(stamps, bidx, tidx)
        mp.mark(tl, "entry")
        warp = tidx // mk.LANES
        lane = tidx % mk.LANES
        smem = cutlass.memory.SmemAllocator()
        ring = smem.allocate(self.spec.smem_bytes, byte_alignment=16).toint()
        sq = ring + self.ring_region
        lists = sq + mk.w2_smem_bytes(self.shape)
        self.routing.build(topk_ids, rows, ring, lists, tidx)
        total = self.routing.distinct(lists) * self.blocks
        self.issue(ring, self.routing.expert_of_item(lists, bidx, self.blocks, total),
                   codes, offsets, bidx, total, warp, lane, tidx)
        mp.mark(tl, "wait_begin")
        cute.arch.griddepcontrol_wait()          # h comes from moe_w13sr
        cute.arch.griddepcontrol_launch_dependents()
        mp.mark(tl, "wait_end")
        item = bidx
        while item < total:
            e, first, count = self.routing.entry(lists, item // self.blocks)
            scale = ld_f32_if(scales + Int64(e) * 4, Int32(1))
            tile = (item % self.blocks) * mk.W2_WARPS + warp
            nxt = item + gdim
            nxt_e = self.routing.expert_of_item(lists, nxt, self.blocks, total)
            refill = self.weight_addresses(nxt_e, nxt, codes, offsets, warp, lane)
            more = Int32(1) if nxt < total else Int32(0)
            pair_list = lists + self.routing.pairs_at + 4 * first
            chunk = Int32(0)
            while chunk < count:
                self.quantize_chunk_smem(pair_list, h, count - chunk, chunk, sq, warp, lane)
                mp.cp_async_wait(0)              # this item's weights (no-op after chunk 0)
                cute.arch.sync_threads()
                mp.mark(tl, "first_landed",
                        lambda i=item, c=chunk: Int32(i < gdim) & Int32(c == 0))
                mp.mark(tl, "last_landed")
                last = Int32(1) if chunk + mk.CHUNK_TOKENS >= count else Int32(0)
                mp.mark(tl, "epilogue")
                self.chunk_mma_refill(ring, ye, tile, scale, sq, lane, tidx, refill, more * last)
                cute.arch.sync_threads()
                chunk += mk.CHUNK_TOKENS
            item += gdim
        mp.mark(tl, "exit")

    @cute.jit
    def weight_addresses(self, e: Int32, item: Int32, codes: Int64, offsets: Int64, warp: Int32,
                         lane: Int32):
        """(code, offset) addresses of this thread's first column / group, as `issue`'s."""
        tile_id = Int64(e * self.shape.tiles2 + (item % self.blocks) * mk.W2_WARPS + warp)
        return (codes + tile_id * self.cols * mk.COL_BYTES + lane * 16,
                offsets + tile_id * self.groups * mk.GROUP_OFFSET_BYTES + (lane // 4) * 8)

    @cute.jit
    def chunk_mma_refill(self, stage: Int32, ye: Int64, tile: Int32, scale: Float32, sq: Int32,
                         lane: Int32, tidx: Int32, refill, do_refill: Int32):
        """`chunk_mma`, re-issuing each group's weight copies for the next item (when
        do_refill) right after that group's mma; one commit group per refilling call."""
        wbase, obase = refill
        g, t = lane // 4, lane % 4
        k_pad = self.shape.k2
        acc = [Float32(0.0)] * 4
        for grp in cutlass.range_constexpr(self.groups):
            n_steps = self.ksteps(grp)
            cols = range(2 * grp, min(2 * grp + 2, self.cols))
            words = [w for c in cols for w in lds_v4_u32(stage + (c * self.threads + tidx) * 16)]
            offs = mp.lds_v2(stage + self.offsets_at + (grp * self.threads + tidx) * 8)
            b_regs = []
            for s4 in cutlass.range_constexpr(n_steps):
                b_regs.append(mp.lds_v2(sq + g * k_pad + (grp * 4 + s4) * mk.KSTEP + 8 * t))
            part = mp.group_mma(words, offs, n_steps, b_regs)
            if do_refill != 0:
                for c in cutlass.range_constexpr(2 * grp, min(2 * grp + 2, self.cols)):
                    mp.cp_async_16(stage + (c * self.threads + tidx) * 16,
                                   wbase + c * mk.COL_BYTES)
                mp.cp_async_8(stage + self.offsets_at + (grp * self.threads + tidx) * 8,
                              obase + grp * mk.GROUP_OFFSET_BYTES)
            sc0 = lds_f32(sq + self.q_bytes + 4 * ((2 * t) * self.groups + grp))
            sc1 = lds_f32(sq + self.q_bytes + 4 * ((2 * t + 1) * self.groups + grp))
            acc = [mp.fmul_add(acc[0], part[0], sc0), mp.fmul_add(acc[1], part[1], sc1),
                   mp.fmul_add(acc[2], part[2], sc0), mp.fmul_add(acc[3], part[3], sc1)]
        if do_refill != 0:
            mp.cp_async_commit()
        self.store_ye(acc, ye, tile, scale, sq, lane)


KERNEL_CLASSES = {"xquant": MoeXQuantSm90, "w13sr": MoeW13SelfRoutedSm90,
                  "w2sr": MoeW2SelfRoutedSm90}
EARLY_REFILL_CLASSES = {"w13sr": MoeW13EarlyRefillSm90, "w2sr": MoeW2EarlyRefillSm90}


def kernel_class(spec: mk.MoeSpec):
    """The class compiling spec: the "early" variants have their own loop."""
    if spec.variant == "early":
        return EARLY_REFILL_CLASSES[spec.kind]
    return KERNEL_CLASSES[spec.kind]
