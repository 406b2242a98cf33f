"""moe_w13w "bulk": the warp-routed w13 fed by bulk (TMA-engine) copies instead of per-thread cp.async.

Same items, routing, math and ABI as `moe_w13w` (`kernels/moe_pipelined.py`), so h (and y) is
bitwise the same; only how an item's weights reach shared memory changes. Round 4 measured w13 at
~1.5 TB/s at R = 1 however its cp.async ring was pipelined: 128 threads issuing 16-byte LDGSTS
(11.5 K copy instructions per SM and round, plus 4x-duplicated 8-byte offset copies) capped the
bytes in flight. Here each warp's K slice of an item is already contiguous in the packed layout
(`cols_per_warp` columns x 512 B of codes, `groups_per_warp` x 64 B of offsets), so lane 0 of the
warp fetches it with `parts` pairs of `cp.async.bulk` (multi-KB codes + the part's offsets),
each pair counted on its own mbarrier. Shared memory mirrors the global slice:

    stage = [warp 0: codes (cols_per_warp x 512 B) | offsets (groups_per_warp x 64 B)] [warp 1 ...]
    then the cross-warp reduction area (threads x 16 B), then the mbarriers [warp][part] x 8 B

A lane reads its 16-byte words at column * 512 + lane * 16 (a warp reads 512 contiguous bytes: no
bank conflict) and its offset word at group * 64 + (lane / 4) * 8 (quad broadcast).

Synchronisation: a warp's barriers are used by that warp only. Item n of the CTA (n = 0, 1, ..)
completes phase n of each barrier, so the consumer waits with parity n & 1 before a part's first
group. The next item's part is issued by lane 0 in the item's last token chunk right after the
warp's mma on that part's last group: mma.sync needs every lane's operands, so all lanes'
shared-memory reads of the part have completed ("early" refill, per part). The first item is
issued before griddepcontrol.wait (the ids are the router's, complete before moe_prep passed its
own wait: w13w's routing reads them with ld.relaxed.gpu).
"""
from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, Int64, cute

from kernels import moe_kernel_ref as mk
from kernels.moe import MoeW2Sm90
from kernels.moe_pipelined import MoeW13WarpRoutedSm90
from kernels.moe_ptx import (
    _addr,
    bulk_copy_g2s,
    decode_group,
    fmul_add,
    group_mma,
    group_mma_decoded,
    ld_relaxed_u32,
    ld_u32,
    lds_v2,
    mark,
    mbar_arrive_expect_tx,
    mbar_init,
    mbar_init_fence,
    mbar_wait,
    syncwarp,
    timeline_of,
)
from kernels.moe_selfroute import MoeW2SelfRoutedSm90, MoeW13EarlyRefillSm90
from kernels.ptx import ld_f32_if, lds_f32, lds_v4_u32


class MoeW13BulkSm90(MoeW13WarpRoutedSm90):
    """moe_w13w "bulk": a one-item ring per CTA filled by per-warp bulk copies on mbarriers."""

    reduce_and_store = MoeW13EarlyRefillSm90.reduce_and_store

    def __init__(self, spec: mk.MoeSpec):
        super().__init__(spec)
        self.bulk_layout(spec)
        self.bars_at = self.stage_bytes + self.threads * 16

    def bulk_layout(self, spec: mk.MoeSpec):
        """The sizes of the stage and its parts (shared with moe_w13sr "bulk")."""
        self.parts = mk.bulk_parts(spec.shape, self.warps, spec.variant)
        self.window = mk.bulk_window(spec.shape, self.warps, spec.variant)
        self.part_groups = self.groups_per_warp // self.parts
        self.part_code_bytes = 2 * self.part_groups * mk.COL_BYTES
        self.part_offset_bytes = self.part_groups * mk.GROUP_OFFSET_BYTES
        self.slice_code_bytes = self.cols_per_warp * mk.COL_BYTES
        self.warp_bytes = mk.bulk_warp_bytes(spec.shape, self.warps)
        self.stage_bytes = self.warps * self.warp_bytes

    def bar(self, ring: Int32, warp: Int32, part: int) -> Int32:
        return ring + self.bars_at + (warp * self.parts + part) * 8

    @cute.jit
    def enter(self):
        """(tidx, bidx, gdim, warp, lane, ring): the shared memory allocated, each warp's
        barriers (one per part, one arrival: the warp's own expect_tx) initialised by lane 0 and
        made visible to the bulk-copy engine, the warp synchronised."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp = tidx // mk.LANES
        lane = tidx % mk.LANES
        smem = cutlass.memory.SmemAllocator()
        ring = smem.allocate(self.spec.smem_bytes, byte_alignment=16).toint()
        if lane == 0:
            for part in cutlass.range_constexpr(self.parts):
                mbar_init(self.bar(ring, warp, part), 1)
            mbar_init_fence()
        syncwarp()
        return tidx, bidx, gdim, warp, lane, ring

    @cute.jit
    def issue_part(self, ring: Int32, e: Int32, codes: Int64, offsets: Int64, item: Int32,
                   total: Int32, warp: Int32, lane: Int32, part: int):
        """Lane 0: one part of this warp's K slice of item (expert e), codes then offsets, on the
        part's barrier (nothing past the last item)."""
        if lane == 0 and item < total:
            tile_id = Int64(e * self.tiles + item % self.tiles)
            col = warp * self.cols_per_warp + 2 * self.part_groups * part
            grp = warp * self.groups_per_warp + self.part_groups * part
            dst = ring + warp * self.warp_bytes
            bar = self.bar(ring, warp, part)
            mbar_arrive_expect_tx(bar, self.part_code_bytes + self.part_offset_bytes)
            bulk_copy_g2s(dst + part * self.part_code_bytes,
                          codes + (tile_id * self.cols + col) * mk.COL_BYTES,
                          self.part_code_bytes, bar)
            bulk_copy_g2s(dst + self.slice_code_bytes + part * self.part_offset_bytes,
                          offsets + (tile_id * self.groups + grp) * mk.GROUP_OFFSET_BYTES,
                          self.part_offset_bytes, bar)

    @cute.jit
    def issue_item(self, ring: Int32, e: Int32, codes: Int64, offsets: Int64, item: Int32,
                   total: Int32, warp: Int32, lane: Int32):
        """The first `window` parts of the CTA's first item."""
        for part in cutlass.range_constexpr(self.window):
            self.issue_part(ring, e, codes, offsets, item, total, warp, lane, part)

    @cute.jit
    def refill_part(self, ring: Int32, refill, warp: Int32, lane: Int32, done: int,
                    first_chunk: Int32, last_chunk: Int32):
        """After the math on part `done`: the part `window` later in (item, part) order. Within
        the item it is issued in the item's first chunk (later chunks find it there); past the
        item's end it is the next item's, into a slot this warp has just finished reading for
        the last time, so only in the item's last chunk."""
        e, item, nxt_e, nxt, total, codes, offsets = refill
        ahead = done + self.window
        if cutlass.const_expr(ahead < self.parts):
            if first_chunk != 0:
                self.issue_part(ring, e, codes, offsets, item, total, warp, lane, ahead)
        else:
            if last_chunk != 0:
                syncwarp()         # every lane's reads of the slot are done (warp-uniform)
                self.issue_part(ring, nxt_e, codes, offsets, nxt, total, warp, lane,
                                ahead - self.parts)

    @cute.kernel
    def kernel(self, topk_ids: cute.Pointer, xq: cute.Pointer, xs: cute.Pointer,
               codes: cute.Pointer, offsets: cute.Pointer, scales: cute.Pointer,
               h: cute.Pointer, rows: Int32):
        self.run(_addr(topk_ids), (_addr(xq), _addr(xs), _addr(codes), _addr(offsets),
                                   _addr(scales), _addr(h)), rows)

    @cute.jit
    def run(self, topk_ids: Int64, ptrs, rows: Int32, stamps=None):
        """The kernel's body (moe_w13sr "bulk" too: `route` and `next_expert` differ); stamps:
        the timeline build's record array (None in production)."""
        tidx, bidx, gdim, warp, lane, ring = self.enter()
        tl = timeline_of(stamps, bidx, tidx)
        mark(tl, "entry")
        _, _, codes, offsets, _, _ = ptrs
        red, state, total = self.route(topk_ids, rows, ring, lane, tidx)
        item = bidx
        self.issue_item(ring, self.next_expert(state, item, total), codes, offsets, item, total,
                        warp, lane)
        mark(tl, "wait_begin")
        cute.arch.griddepcontrol_wait()          # xq, xs come from the previous kernel
        cute.arch.griddepcontrol_launch_dependents()
        mark(tl, "wait_end")
        self.stream_items(ring, red, state, item, gdim, total, ptrs, warp, lane, tidx, tl)
        mark(tl, "exit")

    @cute.jit
    def route(self, topk_ids: Int64, rows: Int32, ring: Int32, lane: Int32, tidx: Int32):
        """(reduction area, routing state, items): the distinct experts in registers."""
        state = self.routing.build(topk_ids, rows, lane)
        return ring + self.stage_bytes, state, state[5] * self.tiles

    # The routing source (registers here, shared-memory lists in moe_w13sr "bulk"): an item's
    # expert, its pair count and the handle its chunks read their pairs through.
    @cute.jit
    def item_entry(self, state, item: Int32):
        e = self.routing.expert(state, item // self.tiles)
        masks = self.routing.pairs(state, e)
        return e, masks[2], masks

    @cute.jit
    def next_expert(self, state, item: Int32, total: Int32):
        return self.expert_of_item(state, item, total)

    @cute.jit
    def chunk_pairs(self, pairs, xq: Int64, xs: Int64, left: Int32, chunk: Int32, warp: Int32,
                    lane: Int32):
        return self.chunk_inputs_warp(pairs, xq, xs, left, chunk, warp, lane)

    @cute.jit
    def stream_items(self, ring: Int32, red: Int32, state, item: Int32, gdim: Int32,
                     total: Int32, ptrs, warp: Int32, lane: Int32, tidx: Int32, tl=None):
        """The CTA's items from `item` on (the first already issued): each token chunk's slice
        math, then the cross-warp sum and SwiGLU; the next item refilled part by part in the
        last chunk. Item n of the CTA completes phase n of every barrier."""
        xq, xs, codes, offsets, scales, h = ptrs
        phase = Int32(0)
        while item < total:
            e, count, pairs = self.item_entry(state, item)
            tile = item % self.tiles
            scale = ld_f32_if(scales + Int64(e) * 4, Int32(1))
            nxt = item + gdim
            refill = (e, item, self.next_expert(state, nxt, total), nxt, total, codes, offsets)
            chunk = Int32(0)
            while chunk < count:
                ins = self.chunk_pairs(pairs, xq, xs, count - chunk, chunk, warp, lane)
                first = Int32(1) if chunk == 0 else Int32(0)
                last = Int32(1) if chunk + mk.CHUNK_TOKENS >= count else Int32(0)
                acc = self.slice_math(ring, ins, warp, lane, phase, refill, first, last, tl,
                                      item < gdim)
                _, _, p0, p1, v0, v1 = ins
                mark(tl, "epilogue")
                self.reduce_and_store(acc, h, tile, scale, red, warp, lane, tidx, p0, p1, v0,
                                      v1)
                chunk += mk.CHUNK_TOKENS
            item = nxt
            phase = phase ^ 1

    def b_group(self, b_regs, gi: int):
        """Group gi's B fragments (all of the slice's are in registers here)."""
        return b_regs[gi]

    @cute.jit
    def slice_math(self, ring: Int32, ins, warp: Int32, lane: Int32, phase: Int32, refill,
                   first_chunk: Int32, last_chunk: Int32, tl=None, first_item=None):
        """This warp's K slice against one token chunk: each part awaited on its barrier before
        its first group; right after the mma of a part's last group, the part `window` ahead
        issued (`refill_part`). Returns the 4 fp32 accumulators (chunk_math's order exactly).
        tl (timeline builds): the first part of the CTA's first item (first_item: a boolean)
        and every item's last part stamped as they land."""
        b_regs, sc, _, _, _, _ = ins
        base = ring + warp * self.warp_bytes
        acc = [Float32(0.0)] * 4
        for gi in cutlass.range_constexpr(self.groups_per_warp):
            part = gi // self.part_groups
            if gi % self.part_groups == 0:
                mbar_wait(self.bar(ring, warp, part), phase)
                if cutlass.const_expr(gi == 0):
                    mark(tl, "first_landed", lambda: Int32(first_item) & first_chunk)
                if cutlass.const_expr(part == self.parts - 1):
                    mark(tl, "last_landed")
            words = (lds_v4_u32(base + (2 * gi) * mk.COL_BYTES + lane * 16)
                     + lds_v4_u32(base + (2 * gi + 1) * mk.COL_BYTES + lane * 16))
            offs = lds_v2(base + self.slice_code_bytes + gi * mk.GROUP_OFFSET_BYTES
                          + (lane // 4) * 8)
            group = group_mma(words, offs, 4, self.b_group(b_regs, gi))
            if gi % self.part_groups == self.part_groups - 1:
                self.refill_part(ring, refill, warp, lane, part, first_chunk, last_chunk)
            sc0, sc1 = sc[gi]
            acc = [fmul_add(acc[0], group[0], sc0), fmul_add(acc[1], group[1], sc1),
                   fmul_add(acc[2], group[2], sc0), fmul_add(acc[3], group[3], sc1)]
        return acc


class MoeW13BulkLeanSm90(MoeW13BulkSm90):
    """moe_w13w "bulkw_lean4": "bulkw" with a chunk's B fragments loaded
    mk.LEAN_B_WINDOW groups ahead of the math instead of the whole slice at once (32-40
    registers of fragments in flight instead of 80), so it compiles at 128 registers without
    spilling (launch bound mk.LEAN_LAUNCH_BOUND): 4 CTAs fit an SM's 64 K registers. Same
    values, same math order: y bitwise "bulkw"'s."""

    @cute.jit
    def slice_inputs(self, xrow: Int64, vb: Int32, xs: Int64, p0: Int32, p1: Int32, v0: Int32,
                     v1: Int32, warp: Int32):
        """(the lazy B state: row, validity, first group, fragments of the first
        LEAN_B_WINDOW groups; every group's scales)."""
        topk = self.shape.topk
        first = warp * self.groups_per_warp
        loaded, sc = [], []
        for gi in cutlass.range_constexpr(self.groups_per_warp):
            grp = first + gi
            if cutlass.const_expr(gi < mk.LEAN_B_WINDOW):
                loaded.append(self.b_fragments(xrow, vb, grp))
            sc.append((ld_f32_if(xs + Int64((p0 // topk) * self.groups + grp) * 4, v0),
                       ld_f32_if(xs + Int64((p1 // topk) * self.groups + grp) * 4, v1)))
        return (xrow, vb, first, loaded), sc

    def b_group(self, b_regs, gi: int):
        """Group gi's fragments; group gi + LEAN_B_WINDOW's loads issued now."""
        xrow, vb, first, loaded = b_regs
        if gi + mk.LEAN_B_WINDOW < self.groups_per_warp:
            loaded.append(self.b_fragments(xrow, vb, first + gi + mk.LEAN_B_WINDOW))
        return loaded[gi]


class MoeW13SelfRoutedBulkSm90(MoeW13EarlyRefillSm90):
    """moe_w13sr "bulk": moe_w13sr's shared-memory routing lists (any R) with moe_w13w "bulk"'s
    stage, parts, barriers and part refill. Shared memory: [ring region: the routing scratch,
    then the stage] [mbarriers, 16-aligned] [cross-warp reduction] [lists]."""

    __call__ = MoeW13BulkSm90.__call__      # the w13w launch: ctas_per_sm as a launch bound
    bar = MoeW13BulkSm90.bar
    enter = MoeW13BulkSm90.enter
    issue_part = MoeW13BulkSm90.issue_part
    issue_item = MoeW13BulkSm90.issue_item
    refill_part = MoeW13BulkSm90.refill_part
    slice_math = MoeW13BulkSm90.slice_math
    b_group = MoeW13BulkSm90.b_group
    stream_items = MoeW13BulkSm90.stream_items

    def __init__(self, spec: mk.MoeSpec):
        super().__init__(spec)
        MoeW13BulkSm90.bulk_layout(self, spec)
        self.ring_region = mk.bulk_sr_ring_region(spec.shape, self.warps)
        self.bars_at = self.ring_region
        self.red_at = self.ring_region + mk.bulk_bars_bytes(spec.shape, self.warps, spec.variant)

    kernel = MoeW13BulkSm90.kernel
    run = MoeW13BulkSm90.run

    @cute.jit
    def route(self, topk_ids: Int64, rows: Int32, ring: Int32, lane: Int32, tidx: Int32):
        """(reduction area, lists, items): the lists built in shared memory after the
        reduction area; build ends with a CTA barrier, so the scratch (in the ring region) is
        dead after it."""
        red = ring + self.red_at
        lists = red + self.threads * 16
        self.routing.build(topk_ids, rows, ring, lists, tidx)
        return red, lists, self.routing.distinct(lists) * self.tiles

    @cute.jit
    def item_entry(self, lists: Int32, item: Int32):
        e, first, count = self.routing.entry(lists, item // self.tiles)
        return e, count, lists + self.routing.pairs_at + 4 * first

    @cute.jit
    def next_expert(self, lists: Int32, item: Int32, total: Int32):
        return self.routing.expert_of_item(lists, item, self.tiles, total)

    @cute.jit
    def chunk_pairs(self, pair_list: Int32, xq: Int64, xs: Int64, left: Int32, chunk: Int32,
                    warp: Int32, lane: Int32):
        return self.chunk_inputs_smem(pair_list, xq, xs, left, chunk, warp, lane)


class MoeW2BulkSm90(MoeW2Sm90):
    """moe_w2 "bulk": moe_w2's items, routing lists and math with a `stages`-deep ring filled by
    one bulk copy pair per warp and item (the warp's 16-row tile: K = I whole, codes then
    offsets, contiguous in the packed layout). Each stage ends with one mbarrier per warp; item n
    of the CTA lands in stage n % stages and completes that barrier's phase n // stages."""

    def __init__(self, spec: mk.MoeSpec):
        super().__init__(spec)
        self.tile_code_bytes = self.cols * mk.COL_BYTES
        self.tile_offset_bytes = self.groups * mk.GROUP_OFFSET_BYTES
        self.warp_bytes = self.tile_code_bytes + self.tile_offset_bytes
        self.bars_at = mk.W2_WARPS * self.warp_bytes
        self.stage_bytes = mk.bulk_w2_stage_bytes(spec.shape)

    @cute.jit
    def enter(self):
        """(tidx, bidx, gdim, warp, lane, ring): the ring allocated, each warp's barriers (one per
        stage, one arrival: the warp's own expect_tx) initialised and made visible to the bulk
        copies."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp = tidx // mk.LANES
        lane = tidx % mk.LANES
        smem = cutlass.memory.SmemAllocator()
        ring = smem.allocate(self.spec.smem_bytes, byte_alignment=16).toint()
        if lane == 0:
            for s in cutlass.range_constexpr(self.stages):
                mbar_init(ring + s * self.stage_bytes + self.bars_at + warp * 8, 1)
            mbar_init_fence()
        syncwarp()
        return tidx, bidx, gdim, warp, lane, ring

    @cute.jit
    def issue(self, stage: Int32, e: Int32, codes: Int64, offsets: Int64, item: Int32,
              total: Int32, warp: Int32, lane: Int32, tidx: Int32):
        """Lane 0: this warp's tile of item (expert e) into the stage, on the stage's barrier
        of the warp (nothing past the last item)."""
        if lane == 0 and item < total:
            tile_id = Int64(e * self.shape.tiles2 + (item % self.blocks) * mk.W2_WARPS + warp)
            dst = stage + warp * self.warp_bytes
            bar = stage + self.bars_at + warp * 8
            mbar_arrive_expect_tx(bar, self.warp_bytes)
            bulk_copy_g2s(dst, codes + tile_id * self.tile_code_bytes, self.tile_code_bytes, bar)
            bulk_copy_g2s(dst + self.tile_code_bytes,
                          offsets + tile_id * self.tile_offset_bytes, self.tile_offset_bytes,
                          bar)

    @cute.kernel
    def kernel(self, meta: cute.Pointer, pairs: cute.Pointer, h: cute.Pointer,
               codes: cute.Pointer, offsets: cute.Pointer, scales: cute.Pointer,
               ye: cute.Pointer, rows: Int32):
        self.run(_addr(meta), (_addr(pairs), _addr(h), _addr(codes), _addr(offsets),
                               _addr(scales), _addr(ye)))

    @cute.jit
    def run(self, m: Int64, ptrs, stamps=None):
        """The kernel's body; stamps: the timeline build's record array (None in production)."""
        pairs, h, codes, offsets, scales, ye = ptrs
        tidx, bidx, gdim, warp, lane, ring = self.enter()
        tl = timeline_of(stamps, bidx, tidx)
        mark(tl, "entry")
        sq = ring + self.stages * self.stage_bytes
        e_count = self.shape.num_experts
        # Before the wait, as moe_w2: prep's lists are final (two kernels back).
        total = ld_relaxed_u32(m, Int32(1)) * self.blocks
        for s in cutlass.range_constexpr(self.stages - 1):
            first = bidx + s * gdim
            self.issue(ring + s * self.stage_bytes, self.expert_of(m, first, total),
                       codes, offsets, first, total, warp, lane, tidx)
        mark(tl, "wait_begin")
        cute.arch.griddepcontrol_wait()          # h comes from moe_w13
        cute.arch.griddepcontrol_launch_dependents()
        mark(tl, "wait_end")
        item = bidx
        it = Int32(0)
        while item < total:
            ahead_item = item + (self.stages - 1) * gdim
            ahead_e = self.expert_of(m, ahead_item, total)
            j = item // self.blocks
            first = ld_u32(m + 4 * (mk.META_HEADER + e_count + j), Int32(1))
            count = ld_u32(m + 4 * (mk.META_HEADER + 2 * e_count + j), Int32(1))
            e = ld_u32(m + 4 * (mk.META_HEADER + j), Int32(1))
            # The stage ahead was last read in the previous iteration, before its final barrier.
            self.issue(ring + ((it + self.stages - 1) % self.stages) * self.stage_bytes, ahead_e,
                       codes, offsets, ahead_item, total, warp, lane, tidx)
            scale = ld_f32_if(scales + Int64(e) * 4, Int32(1))
            self.item_chunks(ring, it, item, first, count, scale, (pairs, h, ye), sq, warp, lane,
                             tidx, None, tl)
            item += gdim
            it += 1
        mark(tl, "exit")

    quantize_pair = MoeW2SelfRoutedSm90.quantize_pair

    @cute.jit
    def item_chunks(self, ring: Int32, it: Int32, item: Int32, first: Int32, count: Int32,
                    scale: Float32, ptrs, sq: Int32, warp: Int32, lane: Int32, tidx: Int32,
                    first_pair=None, tl=None, decoded=None):
        """The CTA's it-th item (pairs first.., count of them): per token chunk, h re-quantized
        into sq (all five groups of a token loaded before the first is quantized: one L2 round
        trip, as moe_w2sr), the warp's tile awaited on its barrier, the mma, ye. first_pair:
        the first chunk's pair id of this warp, already loaded (else read here); decoded: the
        warp's tile as A fragments already (`decode_tile`; else decoded from the stage)."""
        pairs, h, ye = ptrs
        tile = (item % self.blocks) * mk.W2_WARPS + warp
        stage = ring + (it % self.stages) * self.stage_bytes
        phase = (it // self.stages) % 2
        chunk = Int32(0)
        while chunk < count:
            valid = Int32(1) if warp < count - chunk else Int32(0)
            at = pairs + Int64(first + chunk + warp) * 4
            if cutlass.const_expr(first_pair is None):
                pair = ld_u32(at, valid)
            else:
                later = ld_u32(at, valid if chunk > 0 else Int32(0))
                pair = first_pair if chunk == 0 else later
            self.quantize_pair(pair, valid, h, sq, warp, lane)
            mbar_wait(stage + self.bars_at + warp * 8, phase)
            mark(tl, "first_landed", lambda c=chunk: Int32(it == 0) & Int32(c == 0))
            mark(tl, "last_landed")
            cute.arch.sync_threads()
            mark(tl, "epilogue")
            self.chunk_mma(stage + warp * self.warp_bytes, ye, tile, scale, sq, lane, tidx,
                           decoded)
            cute.arch.sync_threads()
            chunk += mk.CHUNK_TOKENS

    @cute.jit
    def chunk_mma(self, tile_at: Int32, ye: Int64, tile: Int32, scale: Float32, sq: Int32,
                  lane: Int32, tidx: Int32, decoded=None):
        """moe_w2's chunk_mma on the warp's tile as the bulk copy laid it out (the source's
        layout: column c of lane l at c * 512 + l * 16, group offsets at 64 B each); its first
        len(decoded) groups from A fragments decoded already (the same mmas in the same
        order)."""
        g, t = lane // 4, lane % 4
        k_pad = self.shape.k2
        acc = [Float32(0.0)] * 4
        for grp in cutlass.range_constexpr(self.groups):
            n_steps = self.ksteps(grp)
            frags = decoded[grp] if decoded is not None and grp < len(decoded) else None
            if cutlass.const_expr(frags is None):
                words, offs = self.group_words(tile_at, grp, lane)
            b_regs = []
            for s4 in cutlass.range_constexpr(n_steps):
                b_regs.append(lds_v2(sq + g * k_pad + (grp * 4 + s4) * mk.KSTEP + 8 * t))
            if cutlass.const_expr(frags is None):
                part = group_mma(words, offs, n_steps, b_regs)
            else:
                part = group_mma_decoded(frags, b_regs)
            sc0 = lds_f32(sq + self.q_bytes + 4 * ((2 * t) * self.groups + grp))
            sc1 = lds_f32(sq + self.q_bytes + 4 * ((2 * t + 1) * self.groups + grp))
            acc = [fmul_add(acc[0], part[0], sc0), fmul_add(acc[1], part[1], sc1),
                   fmul_add(acc[2], part[2], sc0), fmul_add(acc[3], part[3], sc1)]
        self.store_ye(acc, ye, tile, scale, sq, lane)


    def group_words(self, tile_at: Int32, grp: int, lane: Int32):
        """(code words, offset words) of this lane for 128-group grp of the warp's tile."""
        words = [w for c in range(2 * grp, min(2 * grp + 2, self.cols))
                 for w in lds_v4_u32(tile_at + c * mk.COL_BYTES + lane * 16)]
        offs = lds_v2(tile_at + self.tile_code_bytes + grp * mk.GROUP_OFFSET_BYTES
                      + (lane // 4) * 8)
        return words, offs

    def decode_tile(self, tile_at: Int32, lane: Int32, groups: int):
        """The warp's tile's first `groups` 128-groups as A fragments: [group][k-step][4 words]
        (16 registers a lane per whole group)."""
        return [decode_group(*self.group_words(tile_at, grp, lane), self.ksteps(grp))
                for grp in range(groups)]


class MoeW2BulkPrefetchSm90(MoeW2BulkSm90):
    """moe_w2 "bulkp": moe_w2 "bulk" (2 stages) whose per-item list reads never wait on an L2
    round trip after griddepcontrol.wait. moe_prep's lists are final before this kernel starts
    (it is two kernels back), so they are read with ld.relaxed.gpu ahead of use: the next item's
    first pair, pair count and weight scale and this warp's pair id in its first chunk one item
    ahead, experts two items ahead (the first items' before the wait). The loop's top issues the
    next item's weights from an expert already in registers, and an item's first h load needs
    no list read (ncu r5: 18% of moe_w2's stalls sat on the list read after the wait)."""

    def __init__(self, spec: mk.MoeSpec):
        super().__init__(spec)
        if self.stages != 2:
            raise ValueError(f"{spec.name}: the scalar prefetch keeps exactly one item ahead "
                             f"(2 stages), got {self.stages}")

    @cute.jit
    def item_scalars(self, m: Int64, scales: Int64, item: Int32, e: Int32, total: Int32):
        """(first pair, pair count, weight scale) of item (expert e); zeros past the last."""
        valid = Int32(1) if item < total else Int32(0)
        j = item // self.blocks
        e_count = self.shape.num_experts
        first = ld_relaxed_u32(m + 4 * (mk.META_HEADER + e_count + j), valid)
        count = ld_relaxed_u32(m + 4 * (mk.META_HEADER + 2 * e_count + j), valid)
        return first, count, ld_f32_if(scales + Int64(e) * 4, valid)

    @cute.kernel
    def kernel(self, meta: cute.Pointer, pairs: cute.Pointer, h: cute.Pointer,
               codes: cute.Pointer, offsets: cute.Pointer, scales: cute.Pointer,
               ye: cute.Pointer, rows: Int32):
        tidx, bidx, gdim, warp, lane, ring = self.enter()
        sq = ring + self.stages * self.stage_bytes
        m = _addr(meta)
        total = ld_relaxed_u32(m, Int32(1)) * self.blocks
        item = bidx
        e = self.expert_of(m, item, total)
        self.issue(ring, e, _addr(codes), _addr(offsets), item, total, warp, lane, tidx)
        # Two items ahead: this item's scalars and pair, the next's scalars, the expert after.
        first, count, scale = self.item_scalars(m, _addr(scales), item, e, total)
        pair = self.warp_pair(_addr(pairs), first, count, warp)
        e_next = self.expert_of(m, item + gdim, total)
        nxt_first, nxt_count, nxt_scale = self.item_scalars(m, _addr(scales), item + gdim,
                                                            e_next, total)
        e_after = self.expert_of(m, item + 2 * gdim, total)
        cute.arch.griddepcontrol_wait()          # h comes from moe_w13
        cute.arch.griddepcontrol_launch_dependents()
        it = Int32(0)
        while item < total:
            nxt = item + gdim
            # The other stage was last read in the previous iteration, before its final barrier.
            self.issue(ring + ((it + 1) % 2) * self.stage_bytes, e_next, _addr(codes),
                       _addr(offsets), nxt, total, warp, lane, tidx)
            nxt_pair = self.warp_pair(_addr(pairs), nxt_first, nxt_count, warp)
            far_first, far_count, far_scale = self.item_scalars(m, _addr(scales), nxt + gdim,
                                                                e_after, total)
            e_far = self.expert_of(m, nxt + 2 * gdim, total)
            self.item_chunks(ring, it, item, first, count, scale, (_addr(pairs), _addr(h),
                             _addr(ye)), sq, warp, lane, tidx, pair)
            item = nxt
            it += 1
            first, count, scale, pair = nxt_first, nxt_count, nxt_scale, nxt_pair
            nxt_first, nxt_count, nxt_scale = far_first, far_count, far_scale
            e_next, e_after = e_after, e_far

    @cute.jit
    def warp_pair(self, pairs: Int64, first: Int32, count: Int32, warp: Int32):
        """This warp's pair id in an item's first chunk (token `warp`), 0 where there is none."""
        return ld_relaxed_u32(pairs + Int64(first + warp) * 4,
                              Int32(1) if warp < count else Int32(0))


def kernel_class(spec: mk.MoeSpec):
    """The class compiling a bulk-copy spec (w13w "bulk" / "bulk1", w13sr "bulk", w2 "bulk" /
    "bulkp" / "bulkpd")."""
    classes = {("w13w", "bulk"): MoeW13BulkSm90, ("w13w", "bulk1"): MoeW13BulkSm90,
               ("w13w", "bulkw"): MoeW13BulkSm90, ("w13w", "bulkw_lean4"): MoeW13BulkLeanSm90,
               ("w13sr", "bulk"): MoeW13SelfRoutedBulkSm90,
               ("w13sr", "bulkw"): MoeW13SelfRoutedBulkSm90,
               ("w2", "bulk"): MoeW2BulkSm90, ("w2", "bulkp"): MoeW2BulkPrefetchSm90}
    if (spec.kind, spec.variant) == ("w2", "bulkpd"):
        from kernels.moe_predecode import MoeW2BulkDecodedSm90  # builds on this module
        return MoeW2BulkDecodedSm90
    if (spec.kind, spec.variant) not in classes:
        raise ValueError(f"{spec.name}: no bulk-copy kernel for {spec.kind} {spec.variant!r} "
                         f"(have {sorted(classes)})")
    return classes[(spec.kind, spec.variant)]
