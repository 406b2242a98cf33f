"""moe_w13 / moe_w2 with one cp.async commit group per 128-group, awaited group by group.

Same work items, ring, numerics and ABI as `kernels/moe.py` (y is bitwise the default chain's);
only the copy/wait granularity changes. The default kernels commit an item's weights as one
group and wait for all of it before the first decode: with one item per CTA (R <= 2) the SM
then loads ~150 KB doing nothing, and decodes + multiplies (~2000 instructions per warp and
item, issue-bound) doing nothing else. Here each thread commits its share of every 128-group
separately (w13: 2 code columns + 1 offset word; w2: the same, the 64-wide tail group 1 column)
and waits only for the group it is about to use, so the math on the first groups overlaps the
arrival of the rest. The wait count is static: an iteration has `stages - 1` items of
`groups` commit groups each issued ahead of this one, so group g of the current item is done
when at most `(stages - 1) * groups + groups - 1 - g` groups are pending
(`mk.group_wait_pending`; tests/test_moe_kernel_cpu.py replays the schedule). Past the last item
`issue` still commits `groups` empty groups, so the counts stay uniform. Each thread reads back
only the bytes it copied, so the per-thread wait is the whole synchronisation (as before).
"""
from __future__ import annotations

import cutlass
from cuda.bindings import driver as cuda
from cutlass import Float32, Int32, Int64, cute

from kernels import moe_kernel_ref as mk
from kernels.moe import MoeW2Sm90, MoeW13Sm90
from kernels.moe_ptx import (
    _addr,
    cp_async_8,
    cp_async_16,
    cp_async_commit,
    cp_async_wait,
    ctz,
    fmul_add,
    group_mma,
    ld_relaxed_u32,
    lds_v2,
    popc,
)
from kernels.moe_selfroute import MoeW13EarlyRefillSm90
from kernels.ptx import asm, ld_f32_if, lds_v4_u32


class MoeW13PipelinedSm90(MoeW13Sm90):
    """moe_w13 with per-128-group commit groups and waits: the base of moe_w13w (its own "g"
    spec measured the same as the default and was deleted in round 5)."""

    def await_item(self):
        """Nothing: each group is awaited just before its math (`await_group`)."""

    def await_group(self, gi: int):
        cp_async_wait(mk.group_wait_pending(self.stages, self.groups_per_warp, gi))

    @cute.jit
    def issue(self, stage: Int32, e: Int32, codes: Int64, offsets: Int64, item: Int32,
              total: Int32, warp: Int32, lane: Int32, tidx: Int32):
        """This thread's share of item's weights (expert e), one commit group per 128-group
        of the warp's K slice (empty groups past the last item)."""
        tile_id = Int64(e * self.tiles + item % self.tiles)
        wbase = (codes + (tile_id * self.cols + warp * self.cols_per_warp) * mk.COL_BYTES
                 + lane * 16)
        obase = (offsets + (tile_id * self.groups + warp * self.groups_per_warp)
                 * mk.GROUP_OFFSET_BYTES + (lane // 4) * 8)
        for gi in cutlass.range_constexpr(self.groups_per_warp):
            if item < total:
                for c in cutlass.range_constexpr(2 * gi, 2 * gi + 2):
                    cp_async_16(stage + (c * self.threads + tidx) * 16, wbase + c * mk.COL_BYTES)
                cp_async_8(stage + self.offsets_at + (gi * self.threads + tidx) * 8,
                           obase + gi * mk.GROUP_OFFSET_BYTES)
            cp_async_commit()


class MoeW2PipelinedSm90(MoeW2Sm90):
    """moe_w2 ("g" variants): per-128-group commit groups and waits (the 64-wide tail group of
    I = 576 is one column)."""

    def await_item(self):
        """Nothing: each group is awaited just before its math (`await_group`)."""

    def await_group(self, grp: int):
        cp_async_wait(mk.group_wait_pending(self.stages, self.groups, grp))

    @cute.jit
    def issue(self, stage: Int32, e: Int32, codes: Int64, offsets: Int64, item: Int32,
              total: Int32, warp: Int32, lane: Int32, tidx: Int32):
        """This warp's tile of item (expert e), one commit group per 128-group of K = I (empty
        groups past the last item)."""
        tile_id = Int64(e * self.shape.tiles2 + (item % self.blocks) * mk.W2_WARPS + warp)
        wbase = codes + tile_id * self.cols * mk.COL_BYTES + lane * 16
        obase = offsets + tile_id * self.groups * mk.GROUP_OFFSET_BYTES + (lane // 4) * 8
        for grp in cutlass.range_constexpr(self.groups):
            if item < total:
                for c in cutlass.range_constexpr(2 * grp, min(2 * grp + 2, self.cols)):
                    cp_async_16(stage + (c * self.threads + tidx) * 16, wbase + c * mk.COL_BYTES)
                cp_async_8(stage + self.offsets_at + (grp * self.threads + tidx) * 8,
                           obase + grp * mk.GROUP_OFFSET_BYTES)
            cp_async_commit()


# ---- moe_w13w: the "g" w13 routing itself in registers, its weights issued before the wait ----

_SENTINEL = 0x7FFFFFFF            # an absent or bad id: never an expert, (id >> 5) never a lane


def _shfl_idx(v: Int32, src) -> Int32:
    return Int32(asm(1, [Int32(v), Int32(src)], "shfl.sync.idx.b32 $0, $1, $2, 0x1f, -1;",
                     "=r,r,r", side_effects=True))


def _shfl_up(v: Int32, delta: int) -> Int32:
    return Int32(asm(1, [Int32(v)], f"shfl.sync.up.b32 $0, $1, {delta}, 0, -1;", "=r,r",
                     side_effects=True))


def _ballot(pred: Int32) -> Int32:
    return Int32(asm(1, [Int32(pred)], "{ .reg .pred p; setp.ne.s32 p, $1, 0;\n"
                     "vote.sync.ballot.b32 $0, p, -1; }", "=r,r", side_effects=True))


@cute.jit
def _nth_set_bit(mask: Int32, n: Int32):
    """Position of the n-th (from 0) set bit of mask, lowest first (32 when there is none)."""
    m = mask
    k = Int32(0)
    while k < n:
        m = m & (m - 1)
        k += 1
    return ctz(m)


class WarpRouting:
    """moe_prep's lists for <= 64 (row, slot) pairs, computed by every warp in registers: lane l
    holds the ids of pairs l and l + 32, and (l < E/32) the bitmap word of experts 32l..32l+31
    with its exclusive prefix of set bits. Distinct entry j (experts ascending) is the j-th set
    bit; the pairs of expert e (rows ascending) are the set bits of two ballots."""

    def __init__(self, shape: mk.MoeShape):
        self.shape = shape

    @cute.jit
    def build(self, ids: Int64, rows: Int32, lane: Int32):
        """(id0, id1, bits, excl, incl, distinct). ids are read with ld.relaxed.gpu before
        griddepcontrol.wait: they come from the kernel before moe_prep, complete by then."""
        n = rows * self.shape.topk
        raw = [ld_relaxed_u32(ids + Int64(lane + 32 * c) * 4,
                              Int32(1) if lane + 32 * c < n else Int32(0)) for c in range(2)]
        got = []
        for c in cutlass.range_constexpr(2):
            ok = lane + 32 * c < n and raw[c] >= 0 and raw[c] < self.shape.num_experts
            got.append(raw[c] if ok else Int32(_SENTINEL))
        bits = Int32(0)
        for src in cutlass.range_constexpr(32):
            for c in cutlass.range_constexpr(2):
                e = _shfl_idx(got[c], Int32(src))
                bits = bits | ((Int32(1) << (e & 31)) if (e >> 5) == lane else Int32(0))
        count = popc(bits)
        incl = count
        for d in cutlass.range_constexpr(5):
            up = _shfl_up(incl, 1 << d)
            incl = incl + (up if lane >= (1 << d) else Int32(0))
        return got[0], got[1], bits, incl - count, incl, _shfl_idx(incl, Int32(31))

    @cute.jit
    def expert(self, state, j: Int32):
        """Distinct entry j's expert (warp-uniform j < distinct)."""
        _, _, bits, excl, incl, _ = state
        owner = ctz(_ballot(Int32(1) if j >= excl and j < incl else Int32(0))) & 31
        word = _shfl_idx(bits, owner)
        return owner * 32 + _nth_set_bit(word, j - _shfl_idx(excl, owner))

    @cute.jit
    def pairs(self, state, e: Int32):
        """(mask of pairs 0..31, mask of pairs 32..63, count) of expert e."""
        id0, id1, _, _, _, _ = state
        m0 = _ballot(Int32(1) if id0 == e else Int32(0))
        m1 = _ballot(Int32(1) if id1 == e else Int32(0))
        return m0, m1, popc(m0) + popc(m1)

    @cute.jit
    def nth_pair(self, masks, c: Int32):
        m0, m1, _ = masks
        low = popc(m0)
        return (_nth_set_bit(m0, c) if c < low else 32 + _nth_set_bit(m1, c - low))


class MoeW13WarpRoutedSm90(MoeW13PipelinedSm90):
    """moe_w13w: in the default chain after moe_prep, at rows * topk <= 64. Each warp routes
    from the ids (WarpRouting) and the CTA issues its first item's weights before
    griddepcontrol.wait, so that load overlaps moe_prep (xq, xs are read after the wait; the
    lists are not read at all). Items, ring (one item) and math are the "g" w13's: bitwise the
    same h."""

    def __init__(self, spec: mk.MoeSpec):
        super().__init__(spec)
        self.routing = WarpRouting(spec.shape)

    @cute.jit
    def __call__(self, topk_ids: cute.Pointer, xq: cute.Pointer, xs: cute.Pointer,
                 codes: cute.Pointer, offsets: cute.Pointer, scales: cute.Pointer,
                 h: cute.Pointer, rows: Int32, stream: cuda.CUstream):
        # ctas_per_sm as a launch bound: without it ptxas capped this kernel at 128 registers
        # and spilled (the "g" w13 it extends uses 168, i.e. 3 CTAs of 128 threads per SM).
        self.kernel(topk_ids, xq, xs, codes, offsets, scales, h, rows).launch(
            grid=[2, 1, 1], block=list(self.spec.block), smem=self.spec.smem_bytes,
            stream=stream, use_pdl=True, min_blocks_per_mp=self.spec.launch_bound,
            preferred_smem_carveout=100)   # given, so the DSL does not query a GPU at compile

    @cute.jit
    def expert_of_item(self, state, item: Int32, total: Int32):
        e = self.routing.expert(state, item // self.tiles if item < total else Int32(0))
        return e if item < total else Int32(0)

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
        red = ring + self.stage_bytes
        state = self.routing.build(_addr(topk_ids), rows, lane)
        total = state[5] * self.tiles
        item = bidx
        self.issue(ring, self.expert_of_item(state, item, total), _addr(codes), _addr(offsets),
                   item, total, warp, lane, tidx)
        cute.arch.griddepcontrol_wait()          # xq, xs come from moe_prep
        cute.arch.griddepcontrol_launch_dependents()
        while item < total:
            e = self.routing.expert(state, item // self.tiles)
            tile = item % self.tiles
            masks = self.routing.pairs(state, e)
            count = masks[2]
            scale = ld_f32_if(_addr(scales) + Int64(e) * 4, Int32(1))
            chunk = Int32(0)
            while chunk < count:
                ins = self.chunk_inputs_warp(masks, _addr(xq), _addr(xs), count - chunk, chunk,
                                             warp, lane)
                self.chunk_math(ring, ins, _addr(h), tile, scale, red, warp, lane, tidx)
                chunk += mk.CHUNK_TOKENS
            # chunk_math ended with a barrier (and each thread rewrites only its own words).
            item += gdim
            self.issue(ring, self.expert_of_item(state, item, total), _addr(codes),
                       _addr(offsets), item, total, warp, lane, tidx)

    @cute.jit
    def chunk_inputs_warp(self, masks, xq: Int64, xs: Int64, left: Int32, chunk: Int32,
                          warp: Int32, lane: Int32):
        """`chunk_inputs` with the pair ids from the expert's ballots."""
        g, t = lane // 4, lane % 4
        topk = self.shape.topk
        vb = Int32(1) if g < left else Int32(0)
        v0 = Int32(1) if 2 * t < left else Int32(0)
        v1 = Int32(1) if 2 * t + 1 < left else Int32(0)
        rb = self.routing.nth_pair(masks, chunk + g) // topk if vb != 0 else Int32(0)
        p0 = self.routing.nth_pair(masks, chunk + 2 * t) if v0 != 0 else Int32(0)
        p1 = self.routing.nth_pair(masks, chunk + 2 * t + 1) if v1 != 0 else Int32(0)
        b_regs, sc = self.slice_inputs(xq + Int64(rb) * self.shape.k13 + 8 * t, vb, xs, p0, p1,
                                       v0, v1, warp)
        return b_regs, sc, p0, p1, v0, v1


class MoeW13WarpRoutedEarlySm90(MoeW13WarpRoutedSm90):
    """moe_w13w "early": in an item's last token chunk each thread re-issues the cp.async of a
    128-group's weights for the CTA's next item right after the mma that consumed that group
    (as moe_w13sr "early"), so the next item's load overlaps this item's math and epilogue.
    Every group of every chunk commits exactly one cp.async group (empty when there is nothing
    to refill), so group g is always awaited with wait_group(groups - 1): the groups committed
    after it are the item's later groups plus this chunk's commits for the earlier ones."""

    weight_addresses = MoeW13EarlyRefillSm90.weight_addresses
    reduce_and_store = MoeW13EarlyRefillSm90.reduce_and_store

    def await_group(self, gi: int):
        cp_async_wait(self.groups_per_warp - 1)

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
        red = ring + self.stage_bytes
        state = self.routing.build(_addr(topk_ids), rows, lane)
        total = state[5] * self.tiles
        item = bidx
        self.issue(ring, self.expert_of_item(state, item, total), _addr(codes), _addr(offsets),
                   item, total, warp, lane, tidx)
        cute.arch.griddepcontrol_wait()          # xq, xs come from moe_prep
        cute.arch.griddepcontrol_launch_dependents()
        while item < total:
            e = self.routing.expert(state, item // self.tiles)
            tile = item % self.tiles
            masks = self.routing.pairs(state, e)
            count = masks[2]
            scale = ld_f32_if(_addr(scales) + Int64(e) * 4, Int32(1))
            nxt = item + gdim
            refill = self.weight_addresses(self.expert_of_item(state, nxt, total), nxt,
                                           _addr(codes), _addr(offsets), warp, lane)
            more = Int32(1) if nxt < total else Int32(0)
            chunk = Int32(0)
            while chunk < count:
                ins = self.chunk_inputs_warp(masks, _addr(xq), _addr(xs), count - chunk, chunk,
                                             warp, lane)
                last = Int32(1) if chunk + mk.CHUNK_TOKENS >= count else Int32(0)
                self.chunk_math_refill(ring, ins, _addr(h), tile, scale, red, warp, lane, tidx,
                                       refill, more * last)
                chunk += mk.CHUNK_TOKENS
            item = nxt

    @cute.jit
    def chunk_math_refill(self, stage: Int32, ins, h: Int64, tile: Int32, scale: Float32,
                          red: Int32, warp: Int32, lane: Int32, tidx: Int32, refill,
                          do_refill: Int32):
        """`chunk_math`, re-issuing each group's weight copies for the next item (when
        do_refill) right after that group's mma; one commit per group either way."""
        b_regs, sc, p0, p1, v0, v1 = ins
        wbase, obase = refill
        acc = [Float32(0.0)] * 4
        for gi in cutlass.range_constexpr(self.groups_per_warp):
            self.await_group(gi)
            words = (lds_v4_u32(stage + ((2 * gi) * self.threads + tidx) * 16)
                     + lds_v4_u32(stage + ((2 * gi + 1) * self.threads + tidx) * 16))
            offs = lds_v2(stage + self.offsets_at + (gi * self.threads + tidx) * 8)
            part = group_mma(words, offs, 4, b_regs[gi])
            if do_refill != 0:
                for c in cutlass.range_constexpr(2 * gi, 2 * gi + 2):
                    cp_async_16(stage + (c * self.threads + tidx) * 16, wbase + c * mk.COL_BYTES)
                cp_async_8(stage + self.offsets_at + (gi * self.threads + tidx) * 8,
                           obase + gi * mk.GROUP_OFFSET_BYTES)
            cp_async_commit()
            sc0, sc1 = sc[gi]
            acc = [fmul_add(acc[0], part[0], sc0), fmul_add(acc[1], part[1], sc1),
                   fmul_add(acc[2], part[2], sc0), fmul_add(acc[3], part[3], sc1)]
        self.reduce_and_store(acc, h, tile, scale, red, warp, lane, tidx, p0, p1, v0, v1)


def kernel_class(spec: mk.MoeSpec):
    """The class compiling a group-commit spec (w2 or a w13w variant)."""
    if spec.kind == "w13w" and spec.variant == "early":
        return MoeW13WarpRoutedEarlySm90
    if spec.kind != "w2":
        raise ValueError(f"{spec.name}: group commits exist for w2 and w13w \"early\" only, not "
                         f"{spec.kind} {spec.variant!r}")
    return MoeW2PipelinedSm90
