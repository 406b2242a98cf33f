"""moe_w2 "bulkpd": w2 "bulkp" with its first item's FP4 -> E4M3 decode done before griddepcontrol.wait.

Run r6a's timeline at R = 1: w2 runs ~6 us past w13's last exit; after its wait, ~2 us of round
trips (bulkp's read-ahead shortened those) and then ~3 us from the first mma to the CTA's exit for
its one chunk: 8 warps each decoding and multiplying a 16 x 576 tile, latency-bound chains of
~50 SASS a k-step of which the decode (two 13-op `decode_row`) is about half. The decode needs the
weights only, which "bulkp" already has in shared memory before its wait (one bulk copy per
warp). So here each warp waits for its first tile's barrier, decodes the tile's first
PREDECODED_GROUPS 128-groups into registers (3 x 4 k-steps x 4 words = 48 a lane; 2 CTAs/SM x
256 threads leave 128 registers a thread: the whole tile's 72 spilled 8 bytes, four groups 24),
then waits on w13; after the wait h's load, its quantization, the mmas and the decode of the last
two groups (6 of 18 k-steps at I = 576) remain for the first item. The first item is peeled off the loop so that the 72 registers
die after it; later items decode from the stage as "bulkp" does.

Same items, same decode and mma instructions in the same order: y is bitwise "bulkp"'s (the GPU
test asserts it). A CTA without an item decodes whatever its stage holds and never uses it (its
barrier is not awaited: nothing was issued).
"""
from __future__ import annotations

from cuda.bindings import driver as cuda
from cutlass import Int32, cute

from kernels.moe_bulk import MoeW2BulkPrefetchSm90
from kernels.moe_ptx import _addr, ld_relaxed_u32, mbar_wait

PREDECODED_GROUPS = 3      # of the tile's 5 (I = 576): 48 registers a lane; 4 spilled at 128


class MoeW2BulkDecodedSm90(MoeW2BulkPrefetchSm90):
    """moe_w2 "bulkpd": (meta, pairs, h, codes, offsets, scales, ye, rows) as moe_w2."""

    @cute.jit
    def __call__(self, meta: cute.Pointer, pairs: cute.Pointer, h: cute.Pointer,
                 codes: cute.Pointer, offsets: cute.Pointer, scales: cute.Pointer,
                 ye: cute.Pointer, rows: Int32, stream: cuda.CUstream):
        # ctas_per_sm as the launch bound: 2 x 256 threads leave ptxas 128 registers (without
        # it, 129: one CTA per SM).
        self.kernel(meta, pairs, h, codes, offsets, scales, ye, rows).launch(
            grid=[2, 1, 1], block=list(self.spec.block), smem=self.spec.smem_bytes,
            stream=stream, use_pdl=True, min_blocks_per_mp=self.spec.ctas_per_sm,
            preferred_smem_carveout=100)

    @cute.kernel
    def kernel(self, meta: cute.Pointer, pairs: cute.Pointer, h: cute.Pointer,
               codes: cute.Pointer, offsets: cute.Pointer, scales: cute.Pointer,
               ye: cute.Pointer, rows: Int32):
        tidx, bidx, gdim, warp, lane, ring = self.enter()
        sq = ring + self.stages * self.stage_bytes
        m = _addr(meta)
        ptrs = (_addr(pairs), _addr(h), _addr(ye), _addr(codes), _addr(offsets), _addr(scales))
        total = ld_relaxed_u32(m, Int32(1)) * self.blocks
        item = bidx
        e = self.expert_of(m, item, total)
        self.issue(ring, e, _addr(codes), _addr(offsets), item, total, warp, lane, tidx)
        # As "bulkp": this item's scalars and pair, the next's scalars, the expert after.
        first, count, scale = self.item_scalars(m, _addr(scales), item, e, total)
        pair = self.warp_pair(_addr(pairs), first, count, warp)
        e_next = self.expert_of(m, item + gdim, total)
        nxt_first, nxt_count, nxt_scale = self.item_scalars(m, _addr(scales), item + gdim,
                                                            e_next, total)
        e_after = self.expert_of(m, item + 2 * gdim, total)
        if item < total:                         # the first tile landed (stage 0, phase 0)
            mbar_wait(ring + self.bars_at + warp * 8, Int32(0))
        decoded = self.decode_tile(ring + warp * self.warp_bytes, lane,
                                   min(PREDECODED_GROUPS, self.groups))
        cute.arch.griddepcontrol_wait()          # h comes from moe_w13
        cute.arch.griddepcontrol_launch_dependents()
        (first, count, scale, pair, nxt_first, nxt_count, nxt_scale, e_next, e_after) = self.step(
            m, ptrs, ring, sq, item, Int32(0), gdim, total,
            (first, count, scale, pair, nxt_first, nxt_count, nxt_scale, e_next, e_after),
            warp, lane, tidx, decoded)
        item += gdim
        it = Int32(1)
        while item < total:
            (first, count, scale, pair, nxt_first, nxt_count, nxt_scale, e_next,
             e_after) = self.step(
                m, ptrs, ring, sq, item, it, gdim, total,
                (first, count, scale, pair, nxt_first, nxt_count, nxt_scale, e_next, e_after),
                warp, lane, tidx)
            item += gdim
            it += 1

    @cute.jit
    def step(self, m, ptrs, ring: Int32, sq: Int32, item: Int32, it: Int32, gdim: Int32,
             total: Int32, state, warp: Int32, lane: Int32, tidx: Int32, decoded=None):
        """"bulkp"'s loop body for the CTA's it-th item (decoded: its A fragments, or None):
        the next item's weights issued, the scalars one item further read ahead, the item's
        chunks; returns the state rotated by one item."""
        pairs, h, ye, codes, offsets, scales = ptrs
        first, count, scale, pair, nxt_first, nxt_count, nxt_scale, e_next, e_after = state
        nxt = item + gdim
        # The other stage was last read in the previous item, before its final barrier.
        self.issue(ring + ((it + 1) % 2) * self.stage_bytes, e_next, codes, offsets, nxt, total,
                   warp, lane, tidx)
        nxt_pair = self.warp_pair(pairs, nxt_first, nxt_count, warp)
        far_first, far_count, far_scale = self.item_scalars(m, scales, nxt + gdim, e_after,
                                                            total)
        e_far = self.expert_of(m, nxt + 2 * gdim, total)
        self.item_chunks(ring, it, item, first, count, scale, (pairs, h, ye), sq, warp, lane,
                         tidx, pair, None, decoded)
        return (nxt_first, nxt_count, nxt_scale, nxt_pair, far_first, far_count, far_scale,
                e_after, e_far)
