"""Work-queue item claiming in the self-routed MoE chain (round 9): w13sr "bulkq", w2sr "earlyq".

The static kernels ("bulk", "early") give CTA b the items b, b + grid, b + 2 grid, ..; the SMs
stream at different rates (r6a timeline at R = 6: w13 CTAs 23..32 us p10..p90 for 6-7 items), so
the kernel ends with its slowest CTA. Here a CTA's FIRST item stays static (b: its weights are
issued before griddepcontrol.wait, as before); every later one is claimed,
`next = grid + atomicAdd(claim, 1)` by thread 0, and handed to the CTA through shared memory
(`mk.QUEUE_SLOTS_AT`, free words of the routing lists' header) across a CTA barrier the item loop
already has; a CTA stops at the first claim >= the item count. Items, their math and their
output addresses are the static kernels' (h / ye depend on the item only, never on the CTA), so
y is bitwise the static chain's.

When the claim is made (the one-item ring refills the NEXT item's weights during the current
item, so the next item must be known early in the current one):
- w2sr "earlyq": each chunk of an item already has a CTA barrier between its h loads and its mma
  (where the refill is issued): the claim for the next item is made at the current item's top,
  stored before that barrier (its round trip overlaps the h loads') and read after it.
- w13sr "bulkq": no CTA barrier lies between an item's top and its first refill (the warps' K
  slices run free until the cross-warp sum), and a new one there, or waiting for the atomic at
  the item's top, would stall the stream. So a claim is made one item earlier: at the top of
  item n, the item after item n + 1; stored before item n's cross-warp-sum barrier, read at item
  n + 1's top (two slots, alternating). The CTA's second item is claimed at its entry, before
  griddepcontrol.wait (its round trip hidden under the routing lists' build), and published by
  one more CTA barrier before the wait. A CTA thus holds two items ahead instead of one: the
  tail is about half an item longer than the brief's scheme would give.

Counters (`sched`, u32 [mk.SCHED_WORDS]; this kind's pair at mk.SCHED_AT[kind]: claim, done):
after its last item (or none) thread 0 adds 1 to `done`; the CTA that gets grid - 1 stores 0 to
`claim` and `done` (relaxed, GPU scope). No fence: the only data published are the counters.
Each CTA's done-add is issued after its last claim returned (the loop's exit depends on that
value; a CTA with no item stored its entry claim's value to shared memory before the add, and a
warp issues in order), so when `done` reaches grid - 1 every claim of the launch has been
performed at L2 and the resetting stores come after all of them.

Why the next launch sees zeros and never races this one: a grid completes only after its
griddepcontrol.wait returned, i.e. after the grid before it completed; every kernel of the step
executes one (tests/test_moe_queue_cpu.py checks the bundle's manifest), so completion is
transitive: once a grid's wait returns, every earlier grid of the stream has completed and
flushed, the previous launch of this kernel and its last CTA's reset included.
- w2sr "earlyq" touches sched only after its wait.
- w13sr "bulkq" claims its second item BEFORE its wait. It starts only once every CTA of the
  kernel before it has executed launch_dependents, which moe_xquant does after its own wait: the
  grid before xquant, and every grid before that (the previous "bulkq" launch is at least two
  back), has completed. So it is safe in the chain (xquant -> bulkq), and wherever the kernel
  before "bulkq" triggers its dependents after its wait and is not "bulkq" itself; never launch
  "bulkq" directly after itself (two launches with PDL could overlap their claims).

ABI: the static kernel's with (u64 sched) inserted before (u32 rows); the timeline builds
(`_tl`, mk.timeline_specs) then (u64 stamps), as kernels/moe_timeline.py's.
"""
from __future__ import annotations

import cutlass
from cuda.bindings import driver as cuda
from cutlass import Int32, Int64, cute

from kernels import moe_kernel_ref as mk
from kernels import moe_ptx as mp
from kernels.moe_bulk import MoeW13SelfRoutedBulkSm90
from kernels.moe_selfroute import MoeW2EarlyRefillSm90
from kernels.moe_timeline import launch_w2, launch_w13, w2_ptrs, w13_ptrs
from kernels.ptx import ld_f32_if, lds_u32, void


def atom_add_gpu_if(addr: Int64, pred: Int32):
    """Where pred != 0: the u32 at addr before +1 (relaxed, GPU scope); else 0."""
    return Int32(mp._asm(1, [Int64(addr), Int32(pred)],
                         "{ .reg .pred p; setp.ne.s32 p, $2, 0; mov.b32 $0, 0;\n"
                         "@p atom.relaxed.gpu.global.add.u32 $0, [$1], 1; }", "=r,l,r,~{memory}",
                         side_effects=True))


def st_zero_gpu_if(addr: Int64, pred: Int32):
    void([Int64(addr), Int32(pred)], "{ .reg .pred p; setp.ne.s32 p, $1, 0;\n"
         "@p st.relaxed.gpu.global.u32 [$0], 0; }", "l,r,~{memory}")


def sts_u32_if(saddr: Int32, value: Int32, pred: Int32):
    void([Int32(saddr), Int32(value), Int32(pred)], "{ .reg .pred p; setp.ne.s32 p, $2, 0;\n"
         "@p st.shared.u32 [$0], $1; }", "r,r,r,~{memory}")


@cute.jit
def finish(sched: Int64, gdim: Int32, claimer: Int32):
    """After the CTA's last item: done + 1; the CTA whose add completes the grid zeroes both
    counters for the next launch (see the module docstring for the ordering)."""
    old = atom_add_gpu_if(sched + 4, claimer)
    last = claimer * Int32(old == gdim - 1)
    st_zero_gpu_if(sched, last)
    st_zero_gpu_if(sched + 4, last)


class MoeW13QueuedSm90(MoeW13SelfRoutedBulkSm90):
    """moe_w13sr "bulkq": w13sr "bulk" with claimed items (ids, xq, xs, codes, offsets, scales,
    h, sched, rows)."""

    @cute.jit
    def __call__(self, topk_ids: cute.Pointer, xq: cute.Pointer, xs: cute.Pointer,
                 codes: cute.Pointer, offsets: cute.Pointer, scales: cute.Pointer,
                 h: cute.Pointer, sched: cute.Pointer, rows: Int32, stream: cuda.CUstream):
        launch_w13(self, self.kernel(topk_ids, xq, xs, codes, offsets, scales, h, sched, rows),
                   stream)

    @cute.kernel
    def kernel(self, topk_ids: cute.Pointer, xq: cute.Pointer, xs: cute.Pointer,
               codes: cute.Pointer, offsets: cute.Pointer, scales: cute.Pointer,
               h: cute.Pointer, sched: cute.Pointer, rows: Int32):
        self.run_claimed(mp._addr(topk_ids), w13_ptrs(xq, xs, codes, offsets, scales, h),
                         mp._addr(sched) + 4 * mk.SCHED_AT["w13sr"], rows)

    @cute.jit
    def run_claimed(self, topk_ids: Int64, ptrs, counters: Int64, rows: Int32, stamps=None):
        """The kernel's body; stamps: the timeline build's record array (None in production:
        `mark` then emits nothing)."""
        tidx, bidx, gdim, warp, lane, ring = self.enter()
        tl = mp.timeline_of(stamps, bidx, tidx)
        mp.mark(tl, "entry")
        claimer = Int32(tidx == 0)
        # The CTA's second item, claimed before the wait (safe: module docstring); its round
        # trip runs under the lists' build.
        second = gdim + atom_add_gpu_if(counters, claimer)
        red, lists, total = self.route(topk_ids, rows, ring, lane, tidx)
        item = bidx
        self.issue_item(ring, self.next_expert(lists, item, total), ptrs[2], ptrs[3], item,
                        total, warp, lane)
        slots = lists + mk.QUEUE_SLOTS_AT
        sts_u32_if(slots + 4, second, claimer)
        cute.arch.sync_threads()
        mp.mark(tl, "wait_begin")
        cute.arch.griddepcontrol_wait()          # xq, xs come from moe_xquant
        cute.arch.griddepcontrol_launch_dependents()
        mp.mark(tl, "wait_end")
        self.stream_claimed(ring, red, lists, item, gdim, total, ptrs, counters, slots, warp,
                            lane, tidx, claimer, tl)
        finish(counters, gdim, claimer)
        mp.mark(tl, "exit")

    @cute.jit
    def stream_claimed(self, ring: Int32, red: Int32, lists: Int32, item: Int32, gdim: Int32,
                       total: Int32, ptrs, counters: Int64, slots: Int32, warp: Int32,
                       lane: Int32, tidx: Int32, claimer: Int32, tl=None):
        """`stream_items` with the next item read from slot[phase ^ 1] at each item's top and
        the one after it claimed there, stored to slot[phase] before the first chunk's
        cross-warp-sum barrier (slot[phase] was last read at the previous item's top, before
        that item's barriers)."""
        xq, xs, codes, offsets, scales, h = ptrs
        phase = Int32(0)
        while item < total:
            nxt = lds_u32(slots + 4 * (phase ^ 1))
            more = Int32(nxt < total)
            after = gdim + atom_add_gpu_if(counters, claimer * more)
            e, count, pairs = self.item_entry(lists, item)
            tile = item % self.tiles
            scale = ld_f32_if(scales + Int64(e) * 4, Int32(1))
            refill = (e, item, self.next_expert(lists, nxt, total), nxt, total, codes, offsets)
            chunk = Int32(0)
            while chunk < count:
                ins = self.chunk_pairs(pairs, xq, xs, count - chunk, chunk, warp, lane)
                first = Int32(1) if chunk == 0 else Int32(0)
                last = Int32(1) if chunk + mk.CHUNK_TOKENS >= count else Int32(0)
                acc = self.slice_math(ring, ins, warp, lane, phase, refill, first, last, tl,
                                      item < gdim)
                _, _, p0, p1, v0, v1 = ins
                # After the math, so the atomic's round trip is hidden by it.
                sts_u32_if(slots + 4 * phase, after, claimer * more * first)
                mp.mark(tl, "epilogue")
                self.reduce_and_store(acc, h, tile, scale, red, warp, lane, tidx, p0, p1, v0,
                                      v1)
                chunk += mk.CHUNK_TOKENS
            item = nxt
            phase = phase ^ 1


class MoeW2QueuedSm90(MoeW2EarlyRefillSm90):
    """moe_w2sr "earlyq": w2sr "early" with claimed items (ids, h, codes, offsets, scales, ye,
    sched, rows)."""

    @cute.jit
    def __call__(self, topk_ids: cute.Pointer, h: cute.Pointer, codes: cute.Pointer,
                 offsets: cute.Pointer, scales: cute.Pointer, ye: cute.Pointer,
                 sched: cute.Pointer, rows: Int32, stream: cuda.CUstream):
        launch_w2(self, self.kernel(topk_ids, h, codes, offsets, scales, ye, sched, rows), stream)

    @cute.kernel
    def kernel(self, topk_ids: cute.Pointer, h: cute.Pointer, codes: cute.Pointer,
               offsets: cute.Pointer, scales: cute.Pointer, ye: cute.Pointer,
               sched: cute.Pointer, rows: Int32):
        self.run_claimed(mp._addr(topk_ids), w2_ptrs(h, codes, offsets, scales, ye),
                         mp._addr(sched) + 4 * mk.SCHED_AT["w2sr"], rows)

    @cute.jit
    def run_claimed(self, topk_ids: Int64, ptrs, counters: Int64, rows: Int32, stamps=None):
        """`run` with the next item claimed at each item's top and read after the first
        chunk's barrier (every chunk re-reads the slot, which changes only at the next item's
        first chunk, after this item's last barrier); stamps as MoeW13QueuedSm90's."""
        h, codes, offsets, scales, ye = ptrs
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        tl = mp.timeline_of(stamps, bidx, tidx)
        mp.mark(tl, "entry")
        warp = tidx // mk.LANES
        lane = tidx % mk.LANES
        claimer = Int32(tidx == 0)
        smem = cutlass.memory.SmemAllocator()
        ring = smem.allocate(self.spec.smem_bytes, byte_alignment=16).toint()
        sq = ring + self.ring_region
        lists = sq + mk.w2_smem_bytes(self.shape)
        slot = lists + mk.QUEUE_SLOTS_AT
        self.routing.build(topk_ids, rows, ring, lists, tidx)
        total = self.routing.distinct(lists) * self.blocks
        self.issue(ring, self.routing.expert_of_item(lists, bidx, self.blocks, total),
                   codes, offsets, bidx, total, warp, lane, tidx)
        mp.mark(tl, "wait_begin")
        cute.arch.griddepcontrol_wait()          # h comes from moe_w13sr; sched: docstring
        cute.arch.griddepcontrol_launch_dependents()
        mp.mark(tl, "wait_end")
        item = bidx
        while item < total:
            claimed = gdim + atom_add_gpu_if(counters, claimer)
            e, first, count = self.routing.entry(lists, item // self.blocks)
            scale = ld_f32_if(scales + Int64(e) * 4, Int32(1))
            tile = (item % self.blocks) * mk.W2_WARPS + warp
            pair_list = lists + self.routing.pairs_at + 4 * first
            nxt = total
            chunk = Int32(0)
            while chunk < count:
                self.quantize_chunk_smem(pair_list, h, count - chunk, chunk, sq, warp, lane)
                sts_u32_if(slot, claimed, claimer * Int32(chunk == 0))
                mp.cp_async_wait(0)              # this item's weights (no-op after chunk 0)
                cute.arch.sync_threads()
                mp.mark(tl, "first_landed",
                        lambda i=item, c=chunk: Int32(i == bidx) & Int32(c == 0))
                mp.mark(tl, "last_landed")
                nxt = lds_u32(slot)
                nxt_e = self.routing.expert_of_item(lists, nxt, self.blocks, total)
                refill = self.weight_addresses(nxt_e, nxt, codes, offsets, warp, lane)
                more = Int32(1) if nxt < total else Int32(0)
                last = Int32(1) if chunk + mk.CHUNK_TOKENS >= count else Int32(0)
                mp.mark(tl, "epilogue")
                self.chunk_mma_refill(ring, ye, tile, scale, sq, lane, tidx, refill, more * last)
                cute.arch.sync_threads()
                chunk += mk.CHUNK_TOKENS
            item = nxt
        finish(counters, gdim, claimer)
        mp.mark(tl, "exit")


class MoeW13QueuedTimelineSm90(MoeW13QueuedSm90):
    """moe_w13sr "bulkq" with stamps (kernels/moe_timeline.py): (ids, xq, xs, codes, offsets,
    scales, h, sched, stamps, rows)."""

    @cute.jit
    def __call__(self, topk_ids: cute.Pointer, xq: cute.Pointer, xs: cute.Pointer,
                 codes: cute.Pointer, offsets: cute.Pointer, scales: cute.Pointer,
                 h: cute.Pointer, sched: cute.Pointer, stamps: cute.Pointer, rows: Int32,
                 stream: cuda.CUstream):
        launch_w13(self, self.kernel(topk_ids, xq, xs, codes, offsets, scales, h, sched, stamps,
                                     rows), stream)

    @cute.kernel
    def kernel(self, topk_ids: cute.Pointer, xq: cute.Pointer, xs: cute.Pointer,
               codes: cute.Pointer, offsets: cute.Pointer, scales: cute.Pointer,
               h: cute.Pointer, sched: cute.Pointer, stamps: cute.Pointer, rows: Int32):
        self.run_claimed(mp._addr(topk_ids), w13_ptrs(xq, xs, codes, offsets, scales, h),
                         mp._addr(sched) + 4 * mk.SCHED_AT["w13sr"], rows, mp._addr(stamps))


class MoeW2QueuedTimelineSm90(MoeW2QueuedSm90):
    """moe_w2sr "earlyq" with stamps: (ids, h, codes, offsets, scales, ye, sched, stamps,
    rows)."""

    @cute.jit
    def __call__(self, topk_ids: cute.Pointer, h: cute.Pointer, codes: cute.Pointer,
                 offsets: cute.Pointer, scales: cute.Pointer, ye: cute.Pointer,
                 sched: cute.Pointer, stamps: cute.Pointer, rows: Int32, stream: cuda.CUstream):
        launch_w2(self, self.kernel(topk_ids, h, codes, offsets, scales, ye, sched, stamps, rows),
                  stream)

    @cute.kernel
    def kernel(self, topk_ids: cute.Pointer, h: cute.Pointer, codes: cute.Pointer,
               offsets: cute.Pointer, scales: cute.Pointer, ye: cute.Pointer,
               sched: cute.Pointer, stamps: cute.Pointer, rows: Int32):
        self.run_claimed(mp._addr(topk_ids), w2_ptrs(h, codes, offsets, scales, ye),
                         mp._addr(sched) + 4 * mk.SCHED_AT["w2sr"], rows, mp._addr(stamps))


def kernel_class(spec: mk.MoeSpec):
    """The class compiling a queued spec (its timeline build's where spec.timeline)."""
    classes = {("w13sr", "bulkq"): (MoeW13QueuedSm90, MoeW13QueuedTimelineSm90),
               ("w2sr", "earlyq"): (MoeW2QueuedSm90, MoeW2QueuedTimelineSm90)}
    if (spec.kind, spec.variant) not in classes:
        raise ValueError(f"{spec.name}: no work-queue kernel for {spec.kind} {spec.variant!r} "
                         f"(have {sorted(classes)})")
    return classes[(spec.kind, spec.variant)][int(spec.timeline)]
