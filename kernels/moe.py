"""Routed-expert MoE (MXFP4 x FP8, one TP rank) for SM90 in the CuTe DSL: prep, w13, w2, combine.

What each kernel computes, the weight layout and the exact reference are in
`kernels/moe_kernel_ref.py`; the design, the predictions and the measurements in
`docs/notes/moe-design.md`. In short: routing is device data; `moe_prep` turns the top-k ids into
the list of distinct experts and their (row, slot) pairs and quantizes x to FP8 once; `moe_w13` and
`moe_w2` walk (expert, tile) work items with a persistent grid (several CTAs per SM), each thread
copying its share of an item's weights, `stages - 1` items ahead of the one it computes (the
default rings hold one item), into shared memory with `cp.async` (16-byte codes,
8-byte offsets; a thread reads back only the bytes it copied, so `cp.async.wait_group` alone
orders producer and consumer: no barrier, no registers held), expanding FP4 + UE8M0 offset to
E4M3 with two `prmt` per 8 codes, and multiplying with `mma.sync.m16n8k32.e4m3` (weights = M, up
to 8 token rows = N); `moe_combine` sums the six expert outputs of each row in slot order.

PDL: every kernel waits (`griddepcontrol.wait`) before reading what its predecessor wrote and then
triggers its dependents at once, so the next kernel's CTAs are resident early. `moe_w2` uses that:
before its wait it reads the routing list (written by `moe_prep`, two kernels back, complete before
`moe_w13` passed its own wait; read with ld.relaxed.gpu so no stale L1 line is used) and fills
its ring with its first items' weights, overlapping w13's tail.

    prep   |wait|trigger| route (CTA 0) + quantize x (CTAs 1..)         |
    w13           |wait|trigger| ring: stream w13 of the distinct experts |
    w2            |fill ring|wait|trigger| h -> FP8, mma, ye              |
    combine                           |wait| y = sum_s w * ye           |

Constraints: pointers 16-byte aligned, rows <= 192, topk ids in [0, E) and distinct per row (a bad
id is counted in meta[1] and its pair skipped; its ye rows are then not written).

The inline PTX helpers and the fragment math (`decode_row`, `quantize_quad`, `group_mma`, ...) are
in `kernels/moe_ptx.py`; moe_prep in `kernels/moe_prep.py`; the per-group-commit and warp-routed
variants in `kernels/moe_pipelined.py`; the self-routed chain in `kernels/moe_selfroute.py`; the
bulk-copy (TMA engine) variants in `kernels/moe_bulk.py`.
"""
from __future__ import annotations

import cutlass
from cuda.bindings import driver as cuda
from cutlass import Float32, Int32, Int64, cute

from kernels import moe_kernel_ref as mk
from kernels.moe_prep import MoePrepSm90
from kernels.moe_ptx import (
    _addr,
    cp_async_8,
    cp_async_16,
    cp_async_commit,
    cp_async_wait,
    fadd_rn,
    fmul_add,
    fragment_position,
    group_mma,
    ld_relaxed_u32,
    ld_u32,
    ld_v2,
    lds_v2,
    quantize_quad,
    swiglu,
)
from kernels.ptx import (
    bf16_pair,
    ld_f32_if,
    lds_f32,
    lds_u32,
    lds_v4_u32,
    pack_bf16x2,
    round_bf16,
    st_bf16,
    st_v2_b32,
    st_v4_f32,
    sts_f32,
    sts_u32,
)


class MoeW13Sm90:
    """moe_w13: (expert, 16-row [gate; up] tile) per item, K split over the CTA's warps, the
    items' weights streamed through a per-thread cp.async ring `spec.stages` deep."""

    def __init__(self, spec: mk.MoeSpec):
        self.spec = spec
        s = spec.shape
        self.shape = s
        self.threads = spec.block[0]
        self.warps = self.threads // mk.LANES
        self.cols = s.k13 // mk.COL_K
        self.cols_per_warp = self.cols // self.warps
        self.groups_per_warp = self.cols_per_warp // 2
        self.groups = s.groups(s.k13)
        self.tiles = s.tiles13
        self.stages = spec.stages
        self.stage_bytes = mk.ring_stage_bytes(s, "w13")
        self.offsets_at = self.cols_per_warp * self.threads * 16   # offset words after the codes

    @cute.jit
    def __call__(self, meta: cute.Pointer, pairs: cute.Pointer, xq: cute.Pointer,
                 xs: cute.Pointer, codes: cute.Pointer, offsets: cute.Pointer,
                 scales: cute.Pointer, h: cute.Pointer, rows: Int32, stream: cuda.CUstream):
        self.kernel(meta, pairs, xq, xs, codes, offsets, scales, h, rows).launch(
            grid=[2, 1, 1], block=list(self.spec.block), smem=self.spec.smem_bytes,
            stream=stream, use_pdl=True)

    @cute.jit
    def issue(self, stage: Int32, e: Int32, codes: Int64, offsets: Int64, item: Int32,
              total: Int32, warp: Int32, lane: Int32, tidx: Int32):
        """cp.async this thread's share of item's weights (expert e, read by the caller with
        the item's other scalars: one round trip) into a ring stage; one commit group per call
        (empty past the last item) so wait_group counts stay uniform."""
        if item < total:
            tile_id = Int64(e * self.tiles + item % self.tiles)
            wbase = (codes + (tile_id * self.cols + warp * self.cols_per_warp) * mk.COL_BYTES
                     + lane * 16)
            for c in cutlass.range_constexpr(self.cols_per_warp):
                cp_async_16(stage + (c * self.threads + tidx) * 16, wbase + c * mk.COL_BYTES)
            obase = (offsets + (tile_id * self.groups + warp * self.groups_per_warp)
                     * mk.GROUP_OFFSET_BYTES + (lane // 4) * 8)
            for gi in cutlass.range_constexpr(self.groups_per_warp):
                cp_async_8(stage + self.offsets_at + (gi * self.threads + tidx) * 8,
                           obase + gi * mk.GROUP_OFFSET_BYTES)
        cp_async_commit()

    @cute.kernel
    def kernel(self, meta: cute.Pointer, pairs: cute.Pointer, xq: cute.Pointer,
               xs: cute.Pointer, codes: cute.Pointer, offsets: cute.Pointer,
               scales: cute.Pointer, h: cute.Pointer, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp = tidx // mk.LANES
        lane = tidx % mk.LANES
        smem = cutlass.memory.SmemAllocator()
        ring = smem.allocate(self.spec.smem_bytes, byte_alignment=16).toint()
        red = ring + self.stages * self.stage_bytes
        cute.arch.griddepcontrol_wait()          # meta, pairs, xq, xs come from moe_prep
        cute.arch.griddepcontrol_launch_dependents()
        m = _addr(meta)
        e_count = self.shape.num_experts
        total = ld_u32(m, Int32(1)) * self.tiles
        first_items = [bidx + s * gdim for s in range(self.stages - 1)]
        first_experts = [self.expert_of(m, i, total) for i in first_items]
        for s in cutlass.range_constexpr(self.stages - 1):
            self.issue(ring + s * self.stage_bytes, first_experts[s], _addr(codes),
                       _addr(offsets), first_items[s], total, warp, lane, tidx)
        item = bidx
        it = Int32(0)
        while item < total:
            # One round trip for every scalar of this iteration, then the weights of the item
            # stages-1 ahead go out before this item's pair ids and activations are read.
            ahead_item = item + (self.stages - 1) * gdim
            ahead_e = self.expert_of(m, ahead_item, total)
            j = item // self.tiles
            tile = item % self.tiles
            e = ld_u32(m + 4 * (mk.META_HEADER + j), Int32(1))
            first = ld_u32(m + 4 * (mk.META_HEADER + e_count + j), Int32(1))
            count = ld_u32(m + 4 * (mk.META_HEADER + 2 * e_count + j), Int32(1))
            ahead = (it + self.stages - 1) % self.stages
            self.issue(ring + ahead * self.stage_bytes, ahead_e, _addr(codes), _addr(offsets),
                       ahead_item, total, warp, lane, tidx)
            scale = ld_f32_if(_addr(scales) + Int64(e) * 4, Int32(1))
            stage = ring + (it % self.stages) * self.stage_bytes
            pair_list = _addr(pairs) + Int64(first) * 4
            # The first chunk's activations are fetched before the weights are awaited.
            ins = self.chunk_inputs(pair_list, _addr(xq), _addr(xs), count, Int32(0), warp, lane)
            self.await_item()
            self.chunk_math(stage, ins, _addr(h), tile, scale, red, warp, lane, tidx)
            chunk = Int32(mk.CHUNK_TOKENS)
            while chunk < count:
                ins = self.chunk_inputs(pair_list, _addr(xq), _addr(xs), count - chunk, chunk,
                                        warp, lane)
                self.chunk_math(stage, ins, _addr(h), tile, scale, red, warp, lane, tidx)
                chunk += mk.CHUNK_TOKENS
            item += gdim
            it += 1

    def await_item(self):
        """Before an item's math: its ring stage (one commit group per item here)."""
        cp_async_wait(self.stages - 1)

    def await_group(self, gi: int):
        """Before a 128-group's math: nothing here (`await_item` waited for the whole item)."""

    @cute.jit
    def expert_of(self, m: Int64, item: Int32, total: Int32):
        valid = Int32(1) if item < total else Int32(0)
        return ld_u32(m + 4 * (mk.META_HEADER + item // self.tiles), valid)

    @cute.jit
    def chunk_inputs(self, pair_list: Int64, xq: Int64, xs: Int64, left: Int32, chunk: Int32,
                     warp: Int32, lane: Int32):
        """Up to 8 token rows of one expert: pair ids, B fragments of this warp's K slice and
        the activation scales of its groups (zeros for absent tokens)."""
        g, t = lane // 4, lane % 4
        topk = self.shape.topk
        vb = Int32(1) if g < left else Int32(0)
        rb = ld_u32(pair_list + Int64(chunk + g) * 4, vb) // topk
        v0 = Int32(1) if 2 * t < left else Int32(0)
        v1 = Int32(1) if 2 * t + 1 < left else Int32(0)
        p0 = ld_u32(pair_list + Int64(chunk + 2 * t) * 4, v0)
        p1 = ld_u32(pair_list + Int64(chunk + 2 * t + 1) * 4, v1)
        b_regs, sc = self.slice_inputs(xq + Int64(rb) * self.shape.k13 + 8 * t, vb, xs, p0, p1,
                                       v0, v1, warp)
        return b_regs, sc, p0, p1, v0, v1

    @cute.jit
    def slice_inputs(self, xrow: Int64, vb: Int32, xs: Int64, p0: Int32, p1: Int32, v0: Int32,
                     v1: Int32, warp: Int32):
        """(B fragments, activation scales) of this warp's K slice for a chunk: lane's token row
        xrow (valid where vb), its pairs p0 / p1 (valid where v0 / v1); zeros where absent."""
        topk = self.shape.topk
        b_regs, sc = [], []
        for gi in cutlass.range_constexpr(self.groups_per_warp):
            grp = warp * self.groups_per_warp + gi
            b_regs.append(self.b_fragments(xrow, vb, grp))
            sc.append((ld_f32_if(xs + Int64((p0 // topk) * self.groups + grp) * 4, v0),
                       ld_f32_if(xs + Int64((p1 // topk) * self.groups + grp) * 4, v1)))
        return b_regs, sc

    def b_fragments(self, xrow: Int64, vb: Int32, grp):
        """The 4 k-steps' B fragments of 128-group grp (8 bytes a lane each)."""
        return [ld_v2(xrow + (grp * 4 + s4) * mk.KSTEP, vb) for s4 in range(4)]

    @cute.jit
    def chunk_math(self, stage: Int32, ins, h: Int64, tile: Int32, scale: Float32, red: Int32,
                   warp: Int32, lane: Int32, tidx: Int32):
        """This warp's K slice from the ring stage, then warp 0 sums the slices in warp order
        and applies the weight scale, bf16, SwiGLU, bf16."""
        b_regs, sc, p0, p1, v0, v1 = ins
        g = lane // 4
        acc = [Float32(0.0)] * 4
        for gi in cutlass.range_constexpr(self.groups_per_warp):
            self.await_group(gi)
            words = (lds_v4_u32(stage + ((2 * gi) * self.threads + tidx) * 16)
                     + lds_v4_u32(stage + ((2 * gi + 1) * self.threads + tidx) * 16))
            offs = lds_v2(stage + self.offsets_at + (gi * self.threads + tidx) * 8)
            part = group_mma(words, offs, 4, b_regs[gi])
            sc0, sc1 = sc[gi]
            acc = [fmul_add(acc[0], part[0], sc0), fmul_add(acc[1], part[1], sc1),
                   fmul_add(acc[2], part[2], sc0), fmul_add(acc[3], part[3], sc1)]
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
                y0 = swiglu(round_bf16(tot[0] * scale), round_bf16(tot[2] * scale), limit)
                st_bf16(h + Int64(p0 * inter + n) * 2, y0)
            if v1 != 0:
                y1 = swiglu(round_bf16(tot[1] * scale), round_bf16(tot[3] * scale), limit)
                st_bf16(h + Int64(p1 * inter + n) * 2, y1)
        cute.arch.sync_threads()


class MoeW2Sm90:
    """moe_w2: (expert, 8 tiles of 16 rows of w2) per item, one tile per warp, K = I whole, the
    items' weights streamed through a per-thread cp.async ring `spec.stages` deep."""

    def __init__(self, spec: mk.MoeSpec):
        self.spec = spec
        s = spec.shape
        self.shape = s
        self.threads = spec.block[0]
        self.cols = s.k2 // mk.COL_K
        self.groups = s.groups(s.k2)
        self.blocks = s.tiles2 // mk.W2_WARPS
        self.q_bytes = mk.CHUNK_TOKENS * s.k2
        self.s_bytes = mk.CHUNK_TOKENS * self.groups * 4
        self.stages = spec.stages
        self.stage_bytes = mk.ring_stage_bytes(s, "w2")
        self.offsets_at = self.cols * self.threads * 16

    def ksteps(self, grp: int) -> int:
        return min(4, (self.shape.k2 - grp * mk.ACT_GROUP) // mk.KSTEP)

    def await_item(self):
        """Before an item's math: its ring stage (one commit group per item here)."""
        cp_async_wait(self.stages - 1)

    def await_group(self, grp: int):
        """Before a 128-group's math: nothing here (`await_item` waited for the whole item)."""

    @cute.jit
    def __call__(self, meta: cute.Pointer, pairs: cute.Pointer, h: cute.Pointer,
                 codes: cute.Pointer, offsets: cute.Pointer, scales: cute.Pointer,
                 ye: cute.Pointer, rows: Int32, stream: cuda.CUstream):
        self.kernel(meta, pairs, h, codes, offsets, scales, ye, rows).launch(
            grid=[2, 1, 1], block=list(self.spec.block), smem=self.spec.smem_bytes,
            stream=stream, use_pdl=True)

    @cute.jit
    def expert_of(self, m: Int64, item: Int32, total: Int32):
        """ld.relaxed.gpu: this also runs before griddepcontrol.wait (meta is two kernels old)."""
        valid = Int32(1) if item < total else Int32(0)
        return ld_relaxed_u32(m + 4 * (mk.META_HEADER + item // self.blocks), valid)

    @cute.jit
    def issue(self, stage: Int32, e: Int32, codes: Int64, offsets: Int64, item: Int32,
              total: Int32, warp: Int32, lane: Int32, tidx: Int32):
        """cp.async this warp's tile of item (expert e) into a ring stage; one commit group per
        call (empty past the last item)."""
        if item < total:
            tile_id = Int64(e * self.shape.tiles2 + (item % self.blocks) * mk.W2_WARPS + warp)
            wbase = codes + tile_id * self.cols * mk.COL_BYTES + lane * 16
            for c in cutlass.range_constexpr(self.cols):
                cp_async_16(stage + (c * self.threads + tidx) * 16, wbase + c * mk.COL_BYTES)
            obase = offsets + tile_id * self.groups * mk.GROUP_OFFSET_BYTES + (lane // 4) * 8
            for gi in cutlass.range_constexpr(self.groups):
                cp_async_8(stage + self.offsets_at + (gi * self.threads + tidx) * 8,
                           obase + gi * mk.GROUP_OFFSET_BYTES)
        cp_async_commit()

    @cute.kernel
    def kernel(self, meta: cute.Pointer, pairs: cute.Pointer, h: cute.Pointer,
               codes: cute.Pointer, offsets: cute.Pointer, scales: cute.Pointer,
               ye: cute.Pointer, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp = tidx // mk.LANES
        lane = tidx % mk.LANES
        smem = cutlass.memory.SmemAllocator()
        ring = smem.allocate(self.spec.smem_bytes, byte_alignment=16).toint()
        sq = ring + self.stages * self.stage_bytes
        m = _addr(meta)
        e_count = self.shape.num_experts
        # Before the wait: moe_prep (two kernels back) has completed, so its routing list is
        # final; the ring fills while moe_w13 streams.
        total = ld_relaxed_u32(m, Int32(1)) * self.blocks
        first_items = [bidx + s * gdim for s in range(self.stages - 1)]
        first_experts = [self.expert_of(m, i, total) for i in first_items]
        for s in cutlass.range_constexpr(self.stages - 1):
            self.issue(ring + s * self.stage_bytes, first_experts[s], _addr(codes),
                       _addr(offsets), first_items[s], total, warp, lane, tidx)
        cute.arch.griddepcontrol_wait()          # h comes from moe_w13
        cute.arch.griddepcontrol_launch_dependents()
        item = bidx
        it = Int32(0)
        while item < total:
            ahead_item = item + (self.stages - 1) * gdim
            ahead_e = self.expert_of(m, ahead_item, total)
            j = item // self.blocks
            first = ld_u32(m + 4 * (mk.META_HEADER + e_count + j), Int32(1))
            count = ld_u32(m + 4 * (mk.META_HEADER + 2 * e_count + j), Int32(1))
            e = ld_u32(m + 4 * (mk.META_HEADER + j), Int32(1))
            ahead = (it + self.stages - 1) % self.stages
            self.issue(ring + ahead * self.stage_bytes, ahead_e, _addr(codes), _addr(offsets),
                       ahead_item, total, warp, lane, tidx)
            scale = ld_f32_if(_addr(scales) + Int64(e) * 4, Int32(1))
            tile = (item % self.blocks) * mk.W2_WARPS + warp
            stage = ring + (it % self.stages) * self.stage_bytes
            chunk = Int32(0)
            while chunk < count:
                self.quantize_chunk(_addr(pairs) + Int64(first) * 4, _addr(h), count - chunk,
                                    chunk, sq, warp, lane)
                self.await_item()                # this item's weights (a no-op after chunk 0)
                cute.arch.sync_threads()
                self.chunk_mma(stage, _addr(ye), tile, scale, sq, lane, tidx)
                cute.arch.sync_threads()
                chunk += mk.CHUNK_TOKENS
            item += gdim
            it += 1

    @cute.jit
    def quantize_chunk(self, pair_list: Int64, h: Int64, left: Int32, chunk: Int32, sq: Int32,
                       warp: Int32, lane: Int32):
        """Warp w re-quantizes token w of the chunk: h per 128 along I (tail group shorter),
        into shared memory in fragment order, with its scales and pair id (-1: no token)."""
        inter, k_pad = self.shape.inter, self.shape.k2
        valid = Int32(1) if warp < left else Int32(0)
        pair = ld_u32(pair_list + Int64(chunk + warp) * 4, valid)
        for grp in cutlass.range_constexpr(self.groups):
            k = grp * mk.ACT_GROUP + 4 * lane
            inside = Int32(1) if k < inter else Int32(0)
            w = ld_v2(h + Int64(pair * inter + k) * 2, valid * inside)
            q, scale = quantize_quad(w[0], w[1])
            if k < k_pad:
                sts_u32(sq + warp * k_pad + fragment_position(grp * 4 + lane // 8, lane), q)
            if lane == 0:
                sts_f32(sq + self.q_bytes + 4 * (warp * self.groups + grp), scale)
        if lane == 0:
            sts_u32(sq + self.q_bytes + self.s_bytes + 4 * warp, pair if valid != 0 else -1)

    @cute.jit
    def chunk_mma(self, stage: Int32, ye: Int64, tile: Int32, scale: Float32, sq: Int32,
                  lane: Int32, tidx: Int32):
        g, t = lane // 4, lane % 4
        k_pad = self.shape.k2
        acc = [Float32(0.0)] * 4
        for grp in cutlass.range_constexpr(self.groups):
            n_steps = self.ksteps(grp)
            self.await_group(grp)
            words = [w for c in range(2 * grp, min(2 * grp + 2, self.cols))
                     for w in lds_v4_u32(stage + (c * self.threads + tidx) * 16)]
            offs = lds_v2(stage + self.offsets_at + (grp * self.threads + tidx) * 8)
            b_regs = []
            for s4 in cutlass.range_constexpr(n_steps):
                b_regs.append(lds_v2(sq + g * k_pad + (grp * 4 + s4) * mk.KSTEP + 8 * t))
            part = group_mma(words, offs, n_steps, b_regs)
            sc0 = lds_f32(sq + self.q_bytes + 4 * ((2 * t) * self.groups + grp))
            sc1 = lds_f32(sq + self.q_bytes + 4 * ((2 * t + 1) * self.groups + grp))
            acc = [fmul_add(acc[0], part[0], sc0), fmul_add(acc[1], part[1], sc1),
                   fmul_add(acc[2], part[2], sc0), fmul_add(acc[3], part[3], sc1)]
        self.store_ye(acc, ye, tile, scale, sq, lane)

    @cute.jit
    def store_ye(self, acc, ye: Int64, tile: Int32, scale: Float32, sq: Int32, lane: Int32):
        """A chunk's 4 accumulators x the route-independent weight scale into ye (bf16) at the
        chunk's pair rows (sq's pair ids; -1 = no token), this lane's two rows of the tile."""
        g, t = lane // 4, lane % 4
        hidden = self.shape.hidden
        p0 = lds_u32(sq + self.q_bytes + self.s_bytes + 4 * (2 * t))
        p1 = lds_u32(sq + self.q_bytes + self.s_bytes + 4 * (2 * t + 1))
        n = tile * mk.TILE_ROWS + g
        if p0 >= 0:
            st_bf16(ye + Int64(p0 * hidden + n) * 2, acc[0] * scale)
            st_bf16(ye + Int64(p0 * hidden + n + 8) * 2, acc[2] * scale)
        if p1 >= 0:
            st_bf16(ye + Int64(p1 * hidden + n) * 2, acc[1] * scale)
            st_bf16(ye + Int64(p1 * hidden + n + 8) * 2, acc[3] * scale)


def _slot_sum(route_weights, ye, row, n, topk: int, hidden: int) -> list:
    """The combine's four fp32 sums at (row, n..n+3): w[row, s] * ye[row*k + s] accumulated by
    fmul_add in slot order. Plain Python traced inline into each combine kernel: `topk` is a
    Python int, so the loop unrolls as range_constexpr's does inside a kernel."""
    acc = [Float32(0.0)] * 4
    for s in range(topk):
        w = ld_f32_if(_addr(route_weights) + Int64(row * topk + s) * 4, Int32(1))
        v = ld_v2(_addr(ye) + Int64((row * topk + s) * hidden + n) * 2, Int32(1))
        x0, x1 = bf16_pair(v[0])
        x2, x3 = bf16_pair(v[1])
        acc = [fmul_add(acc[0], w, x0), fmul_add(acc[1], w, x1),
               fmul_add(acc[2], w, x2), fmul_add(acc[3], w, x3)]
    return acc


class MoeCombineSm90:
    """moe_combine: y[r, n..n+3] = sum over slots (in order) of w[r, s] * ye[r*k + s, n..n+3]."""

    def __init__(self, spec: mk.MoeSpec):
        self.spec = spec
        self.shape = spec.shape
        self.quads = spec.shape.hidden // mk.COMBINE_VEC

    @cute.jit
    def __call__(self, route_weights: cute.Pointer, ye: cute.Pointer, y: cute.Pointer,
                 rows: Int32, stream: cuda.CUstream):
        self.kernel(route_weights, ye, y, rows).launch(
            grid=[2, 1, 1], block=list(self.spec.block), stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, route_weights: cute.Pointer, ye: cute.Pointer, y: cute.Pointer,
               rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        cute.arch.griddepcontrol_wait()          # ye comes from moe_w2
        cute.arch.griddepcontrol_launch_dependents()
        topk, hidden = self.shape.topk, self.shape.hidden
        idx = bidx * mk.COMBINE_THREADS + tidx
        while idx < rows * self.quads:
            row = idx // self.quads
            n = (idx % self.quads) * mk.COMBINE_VEC
            acc = _slot_sum(route_weights, ye, row, n, topk, hidden)
            st_v4_f32(_addr(y) + Int64(row * hidden + n) * 4, acc[0], acc[1], acc[2], acc[3])
            idx += gdim * mk.COMBINE_THREADS


class MoeCombineSharedSm90:
    """moe_combine_<tag>_shared: out[r, n..n+3] = bf16(y + f32(shared[r, n..n+3])), y the plain
    combine's sum (same loads, same fmul_add per slot in slot order), then one add.rn and one
    cvt.rn per element (mk.combine_shared_reference: bitwise the shared w2's old "add_f32"
    epilogue over the routed sum). `shared` (bf16, the shared expert's w2 on the side stream) is
    read after the wait: the step joins the side branch before this launch."""

    def __init__(self, spec: mk.MoeSpec):
        self.spec = spec
        self.shape = spec.shape
        self.quads = spec.shape.hidden // mk.COMBINE_VEC

    @cute.jit
    def __call__(self, route_weights: cute.Pointer, ye: cute.Pointer, shared: cute.Pointer,
                 out: cute.Pointer, rows: Int32, stream: cuda.CUstream):
        self.kernel(route_weights, ye, shared, out, rows).launch(
            grid=[2, 1, 1], block=list(self.spec.block), stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, route_weights: cute.Pointer, ye: cute.Pointer, shared: cute.Pointer,
               out: cute.Pointer, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        cute.arch.griddepcontrol_wait()          # ye comes from moe_w2, shared from the branch
        cute.arch.griddepcontrol_launch_dependents()
        topk, hidden = self.shape.topk, self.shape.hidden
        idx = bidx * mk.COMBINE_THREADS + tidx
        while idx < rows * self.quads:
            row = idx // self.quads
            n = (idx % self.quads) * mk.COMBINE_VEC
            acc = _slot_sum(route_weights, ye, row, n, topk, hidden)
            at = Int64(row * hidden + n) * 2
            h = ld_v2(_addr(shared) + at, Int32(1))
            s0, s1 = bf16_pair(h[0])
            s2, s3 = bf16_pair(h[1])
            st_v2_b32(_addr(out) + at,
                      pack_bf16x2(fadd_rn(acc[0], s0), fadd_rn(acc[1], s1)),
                      pack_bf16x2(fadd_rn(acc[2], s2), fadd_rn(acc[3], s3)))
            idx += gdim * mk.COMBINE_THREADS


_KERNEL_CLASSES = {"prep": MoePrepSm90, "w13": MoeW13Sm90, "w2": MoeW2Sm90,
                   "combine": MoeCombineSm90, "combine_shared": MoeCombineSharedSm90}


def _kernel_class(spec: mk.MoeSpec):
    """The default chain's classes here; the per-group-commit w13 / w2 in kernels/moe_pipelined.py
    and the self-routed chain's in kernels/moe_selfroute.py (imported late: both build on this
    module)."""
    if spec.queued:              # round 9: claimed items (w13sr bulkq, w2sr earlyq, their _tl)
        from kernels import moe_queue
        return moe_queue.kernel_class(spec)
    if spec.timeline:                        # diagnostic builds with per-CTA stamps
        from kernels import moe_timeline
        return moe_timeline.kernel_class(spec)
    if spec.variant.startswith("bulk"):      # w13w / w13sr / w2 fed by bulk copies
        from kernels import moe_bulk
        return moe_bulk.kernel_class(spec)
    if spec.group_commits:                   # the "g" w13 / w2 and moe_w13w
        from kernels import moe_pipelined
        return moe_pipelined.kernel_class(spec)
    if spec.kind in _KERNEL_CLASSES:
        return _KERNEL_CLASSES[spec.kind]
    from kernels import moe_selfroute
    return moe_selfroute.kernel_class(spec)


def kernel_function(spec: mk.MoeSpec):
    """The @cute.kernel whose Python signature the build checks against spec.params."""
    return _kernel_class(spec).kernel


def specs(cfg, tp: int) -> list[mk.MoeSpec]:
    """The four kernels of the routed MoE at this config's rank shape, then the candidate
    w13 / w2 variants (`mk.variant_specs`: the step launches some, launches/moe.py
    STEP_VARIANTS) and the self-routed chain (`mk.selfrouted_specs`); the same for the DSpark
    stages' shape when it differs; the step's w13 / w2 as timeline builds of each shape
    (`mk.timeline_specs`)."""
    shape, *others = mk.moe_shapes(cfg, tp)
    out = []
    for one in (shape, *others):
        out += (mk.make_specs(one) + [mk.combine_shared_spec(one)] + mk.variant_specs(one)
                + mk.warp_routed_specs(one) + mk.selfrouted_specs(one)
                + mk.timeline_specs(one))
    return out


def compile_spec(spec: mk.MoeSpec, options: str = "--gpu-arch sm_90a"):
    """cute.compile one kernel of the chain with pointer / Int32 arguments only."""
    from cutlass.cute.runtime import make_ptr

    def ptr():
        return make_ptr(cutlass.Uint8, 0, cute.AddressSpace.gmem, assumed_align=16)

    n_ptrs = len(spec.params) - 1
    args = [ptr() for _ in range(n_ptrs)] + [Int32(1), cuda.CUstream(0)]
    return cute.compile(_kernel_class(spec)(spec), *args, options=options)
