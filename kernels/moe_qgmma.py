"""The work-queue self-routed MoE pair on native FP8 wgmma (QGMMA): w13sr "bulkqg", w2sr "earlyqg".

Why (docs/notes/moe-design.md, "What limits the MoE now"): from R = 6 on the routed MoE is held by
the SMs, not by HBM. Hopper has no native `mma.sync ... e4m3`: ptxas expands each k-step into 12
F2FP unpacks (A and B to f16), 2 HMMA and 4 FADD, ~50 SASS a warp with the FP4 decode. Here the
decoded E4M3 registers (the mma.m16n8k32 A layout, which is also a warp's slice of wgmma
m64nNk32's A) go to `wgmma.mma_async.m64n8k32.f32.e4m3.e4m3` as they are, with B (the E4M3
activations) from shared memory by descriptor: decode + 1/4 of a QGMMA issue + the fold, ~30 SASS
a k-step.

B layout (both kernels): per k32 step a 256-byte block, K-major without swizzle, [k half][column
n][16 B] (two 8 x 16 B core matrices, LBO = SBO = 128: kernels/dense_qgmma_ref.descriptor), with
the TRUE k order inside a block (the decode's A registers hold k 4t..4t+3 and 16+4t.. of the
true k; xq's fragment order is undone word by word when x is staged).

w13sr "bulkqg" (w13sr "bulkq" otherwise: its items of 16 rows x K split over 4 warps, bulk-copy
parts, claimed items, cross-warp sum, SwiGLU): a wgmma is one warpgroup = the CTA's 4 warps, and
each warp works on its own K slice, so B's 8 columns are (slice s, token j) = 2 s + j for the
chunk's 2 tokens: warp w's rows times slice s's x. Only s = w is wanted: lane (g, t = w) of
warp w holds (rows g, g+8) x (tokens 0, 1) of its slice; the rest is discarded. The chunk's x
(2 tokens x K) is staged in shared memory (10 KB at v41) before the first wgmma; chunks are 2
tokens (QG_CHUNK_TOKENS), so an expert with 3+ tokens decodes its weights again per chunk: the
pair is for R where experts have 1-2 tokens (executor/launches/moe.py STEP_QG_ROWS).
w2sr "earlyqg" (w2sr "earlyq" otherwise): each warpgroup (warps 0-3, 4-7) is 64 rows (4 tiles),
K = I whole, B = the chunk's quantized h (8 tokens), written by the quantizer straight into the
B layout.

Numerics: moe_ref's W4A8 (per-128-group fp32 partials x activation scale, folded with mul.rn /
add.rn in group order), except that a group's 4 k-steps are accumulated by the tensor core,
whose FP8 accumulator keeps ~14 bits (DeepSeek-V3 report): h and y are NOT bitwise the mma.sync
chain's. docs/notes/moe-tolerance.md showed the test's two-stage bound holding with a 13-bit
accumulator model (tc13); the GPU tests check these kernels against it.
"""
from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, Int64, cute
from cutlass.cutlass_dsl import T

from kernels import moe_kernel_ref as mk
from kernels import moe_ptx as mp
from kernels.dense_qgmma import fence_proxy_async, wgmma_wait
from kernels.dense_qgmma_ref import descriptor
from kernels.moe_queue import MoeW2QueuedSm90, MoeW13QueuedSm90, atom_add_gpu_if, sts_u32_if
from kernels.moe_selfroute_routing import lds_u32_if
from kernels.ptx import (
    asm,
    ld_f32_if,
    lds_f32,
    lds_u32,
    lds_v4_u32,
    round_bf16,
    st_bf16,
    sts_f32,
    sts_u32,
    void,
)

B_STEP = 256                       # bytes of B per k32 step: [k half][8 columns][16 B]


def qgmma_steps(frags, descs):
    """One wgmma group: D = sum over the steps of A_s . B_s (the first from zero), committed.
    frags[s] = the 4 A registers of step s, descs[s] its B descriptor. D is valid only after a
    wgmma_wait that covers this group (the registers are written asynchronously)."""
    n = len(frags)
    lines = ["wgmma.fence.sync.aligned;"]
    for s in range(n):
        a = ", ".join(f"${4 + 4 * s + i}" for i in range(4))
        lines.append("wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {$0, $1, $2, $3}, "
                     f"{{{a}}}, ${4 + 4 * n + s}, {0 if s == 0 else 1}, 1, 1;")
    lines.append("wgmma.commit_group.sync.aligned;")
    operands = [Int32(r) for f in frags for r in f] + [Int64(d) for d in descs]
    v = asm(4, operands, "\n".join(lines), "=f,=f,=f,=f," + ",".join(["r"] * (4 * n) + ["l"] * n),
            kind=T.f32(), side_effects=True)
    return [Float32(r) for r in v]


def b_desc(saddr) -> Int64:
    """The descriptor of the B block at shared address saddr (16-aligned)."""
    return Int64(descriptor(0)) + Int64(Int32(saddr) // 16)


def ld_v4_if(addr: Int64, pred: Int32):
    """16 bytes written by an earlier kernel; zeros where pred == 0."""
    v = mp._asm(4, [Int64(addr), Int32(pred)],
                "{ .reg .pred p; setp.ne.s32 p, $5, 0;\n"
                "mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0;\n"
                "@p ld.global.v4.u32 {$0, $1, $2, $3}, [$4]; }", "=r,=r,=r,=r,l,r",
                side_effects=True)
    return [Int32(x) for x in v]


def sts_v4(saddr: Int32, w):
    void([Int32(saddr)] + [Int32(x) for x in w], "st.shared.v4.u32 [$0], {$1, $2, $3, $4};",
         "r,r,r,r,r")


@cute.jit
def fold(acc, part, sc0: Float32, sc1: Float32):
    """acc += part x the activation scale of token column 0 / 1 (moe_ref's group fold)."""
    return [mp.fmul_add(acc[0], part[0], sc0), mp.fmul_add(acc[1], part[1], sc1),
            mp.fmul_add(acc[2], part[2], sc0), mp.fmul_add(acc[3], part[3], sc1)]


class MoeW13QgSm90(MoeW13QueuedSm90):
    """moe_w13sr "bulkqg": ids, xq, xs, codes, offsets, scales, h, sched, rows (bulkq's ABI,
    bulkq's items, parts, barriers and claims; chunks of QG_CHUNK_TOKENS tokens)."""

    def __init__(self, spec: mk.MoeSpec):
        super().__init__(spec)
        if self.warps != 4:
            raise ValueError(f"{spec.name}: the QGMMA w13 needs 4 warps (one warpgroup), the "
                             f"shape splits K over {self.warps}")
        self.xstage_at = mk.qg_xstage_at(spec.shape, self.warps)
        self.steps = self.groups_per_warp * mk.ACT_GROUP // mk.KSTEP   # k-steps of a slice
        self.row_blocks = self.shape.k13 // mk.KSTEP
        self.x_blocks = mk.QG_CHUNK_TOKENS * self.row_blocks
        self.xscale_at = mk.QG_CHUNK_TOKENS * self.shape.k13

    @cute.jit
    def stream_claimed(self, ring: Int32, red: Int32, lists: Int32, item: Int32, gdim: Int32,
                       total: Int32, ptrs, counters: Int64, slots: Int32, warp: Int32,
                       lane: Int32, tidx: Int32, claimer: Int32, tl=None):
        """bulkq's item loop (claims, refill tuple, slot hand-off: MoeW13QueuedSm90's) over
        chunks of QG_CHUNK_TOKENS tokens, each staged in shared memory first."""
        xq, xs, codes, offsets, scales, h = ptrs
        xstage = ring + self.xstage_at
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
                ins = self.stage_chunk(xstage, pairs, xq, xs, count - chunk, chunk, warp, tidx)
                first = Int32(1) if chunk == 0 else Int32(0)
                last = Int32(1) if chunk + mk.QG_CHUNK_TOKENS >= count else Int32(0)
                acc = self.slice_math(ring, ins, warp, lane, phase, refill, first, last, tl,
                                      item < gdim)
                sts_u32_if(slots + 4 * phase, after, claimer * more * first)
                mp.mark(tl, "epilogue")
                self.reduce_and_store_qg(acc, h, tile, scale, red, ins, warp, lane, tidx)
                chunk += mk.QG_CHUNK_TOKENS
            item = nxt
            phase = phase ^ 1

    @cute.jit
    def stage_chunk(self, xstage: Int32, pairs: Int32, xq: Int64, xs: Int64, left: Int32,
                    chunk: Int32, warp: Int32, tidx: Int32):
        """x of the chunk's tokens (j = 0, 1; zeros past `left`) into the B layout, column
        2 s + j = token j's K slice s, and their activation scales after it. Returns (xstage,
        the shared address of this warp's first scale, p0, p1, v0, v1). At a chunk's top every earlier wgmma of the CTA has
        completed (the previous chunk's fold waited, and its cross-warp sum ends with a CTA
        barrier), so the stage is free."""
        topk = self.shape.topk
        v0 = Int32(1) if left > 0 else Int32(0)
        v1 = Int32(1) if left > 1 else Int32(0)
        p0 = lds_u32_if(pairs + 4 * chunk, v0)
        p1 = lds_u32_if(pairs + 4 * (chunk + 1), v1)
        for i in cutlass.range_constexpr(-(-self.x_blocks // self.threads)):
            blk = tidx + self.threads * i
            if blk < self.x_blocks:
                j = blk // self.row_blocks
                kb = blk % self.row_blocks
                valid = Int32(1) if j < left else Int32(0)
                pair = lds_u32_if(pairs + 4 * (chunk + j), valid)
                src = xq + Int64(pair // topk) * self.shape.k13 + kb * mk.KSTEP
                f = ld_v4_if(src, valid) + ld_v4_if(src + 16, valid)
                at = xstage + (kb % self.steps) * B_STEP + (2 * (kb // self.steps) + j) * 16
                # xq's fragment order holds k 0-3, 16-19, 4-7, 20-23, 8-11, 24-27, 12-15, 28-31
                sts_v4(at, [f[0], f[2], f[4], f[6]])
                sts_v4(at + 128, [f[1], f[3], f[5], f[7]])
        # the chunk's activation scales, [token][group], after its x
        if tidx < mk.QG_CHUNK_TOKENS * self.groups:
            j = tidx // self.groups
            valid = Int32(1) if j < left else Int32(0)
            pair = lds_u32_if(pairs + 4 * (chunk + j), valid)
            sts_f32(xstage + self.xscale_at + 4 * tidx,
                    ld_f32_if(xs + Int64((pair // topk) * self.groups + tidx % self.groups) * 4,
                              valid))
        fence_proxy_async()
        cute.arch.sync_threads()
        sc = xstage + self.xscale_at + 4 * warp * self.groups_per_warp
        return xstage, sc, p0, p1, v0, v1

    @cute.jit
    def slice_math(self, ring: Int32, ins, warp: Int32, lane: Int32, phase: Int32, refill,
                   first_chunk: Int32, last_chunk: Int32, tl=None, first_item=None):
        """bulkq's slice loop (part barriers, refill after a part's last group) with each
        group's 4 k-steps on QGMMA, waited and folded in group order. Lane (g, w) of warp w
        returns (rows g, g+8) x (tokens 0, 1)."""
        xstage, sc, _, _, _, _ = ins
        base = ring + warp * self.warp_bytes
        acc = [Float32(0.0)] * 4
        for gi in cutlass.range_constexpr(self.groups_per_warp):
            part = gi // self.part_groups
            if cutlass.const_expr(gi % self.part_groups == 0):
                mp.mbar_wait(self.bar(ring, warp, part), phase)
                if cutlass.const_expr(gi == 0):
                    mp.mark(tl, "first_landed", lambda: Int32(first_item) & first_chunk)
                if cutlass.const_expr(part == self.parts - 1):
                    mp.mark(tl, "last_landed")
            words = (lds_v4_u32(base + (2 * gi) * mk.COL_BYTES + lane * 16)
                     + lds_v4_u32(base + (2 * gi + 1) * mk.COL_BYTES + lane * 16))
            offs = mp.lds_v2(base + self.slice_code_bytes + gi * mk.GROUP_OFFSET_BYTES
                             + (lane // 4) * 8)
            d = qgmma_steps(mp.decode_group(words, offs, 4),
                            [b_desc(xstage + (4 * gi + s) * B_STEP) for s in range(4)])
            if cutlass.const_expr(gi % self.part_groups == self.part_groups - 1):
                self.refill_part(ring, refill, warp, lane, part, first_chunk, last_chunk)
            # Waited at once: keeping a group in flight under the next one's decode needs ~10
            # more registers than bulkq's 3 CTAs / SM allow (ptxas spilled 24 bytes at 168).
            acc = fold(acc, wgmma_wait(0, d), *self.scales_of(sc, gi))
        return acc

    @cute.jit
    def scales_of(self, sc: Int32, gi: int):
        """Tokens 0 and 1's activation scales of the warp's group gi (staged by stage_chunk)."""
        return lds_f32(sc + 4 * gi), lds_f32(sc + 4 * (self.groups + gi))

    @cute.jit
    def reduce_and_store_qg(self, acc, h: Int64, tile: Int32, scale: Float32, red: Int32, ins,
                            warp: Int32, lane: Int32, tidx: Int32):
        """The slices summed in warp order from lane (g, w) of each warp w; lane (g, t < 2) of
        warp 0 then stores token t's SwiGLU of (gate row g, up row g + 8) x scale."""
        _, _, p0, p1, v0, v1 = ins
        g, t = lane // 4, lane % 4
        slot = red + 16 * tidx
        for i in cutlass.range_constexpr(4):
            sts_f32(slot + 4 * i, acc[i])
        cute.arch.sync_threads()
        if warp == 0 and t < 2:
            gate = lds_f32(red + 16 * (4 * g) + 4 * t)
            up = lds_f32(red + 16 * (4 * g) + 4 * (2 + t))
            for w in cutlass.range_constexpr(1, self.warps):
                at = red + 16 * (w * mk.LANES + 4 * g + w)
                gate = gate + lds_f32(at + 4 * t)
                up = up + lds_f32(at + 4 * (2 + t))
            pair = p0
            valid = v0
            if t == 1:
                pair = p1
                valid = v1
            if valid != 0:
                y = mp.swiglu(round_bf16(gate * scale), round_bf16(up * scale),
                              self.shape.swiglu_limit)
                st_bf16(h + Int64(pair * self.shape.inter + 8 * tile + g) * 2, y)
        cute.arch.sync_threads()


class MoeW2QgSm90(MoeW2QueuedSm90):
    """moe_w2sr "earlyqg": ids, h, codes, offsets, scales, ye, sched, rows (earlyq's ABI, items,
    claims and refill); quantized h in the B layout, each warpgroup's 4 tiles on QGMMA."""

    def __init__(self, spec: mk.MoeSpec):
        super().__init__(spec)
        if self.ring_region % 16:
            raise ValueError(f"{spec.name}: B (sq) must be 16-byte aligned, the ring region is "
                             f"{self.ring_region} bytes")

    @cute.jit
    def quantize_pair(self, pair: Int32, valid: Int32, h: Int64, sq: Int32, warp: Int32,
                      lane: Int32):
        """earlyq's quantizer (token `warp` of the chunk) writing column `warp` of the B layout
        (true k order), then fence.proxy.async: the caller's CTA barrier publishes sq to the
        tensor cores."""
        inter, k_pad = self.shape.inter, self.shape.k2
        loaded = []
        for grp in cutlass.range_constexpr(self.groups):
            k = grp * mk.ACT_GROUP + 4 * lane
            inside = Int32(1) if k < inter else Int32(0)
            loaded.append(mp.ld_v2(h + Int64(pair * inter + k) * 2, valid * inside))
        quad = lane % 8                                      # k 4 quad .. 4 quad + 3 of a step
        column = sq + warp * 16 + (quad // 4) * 128 + 4 * (quad % 4)
        for grp in cutlass.range_constexpr(self.groups):
            k = grp * mk.ACT_GROUP + 4 * lane
            w = loaded[grp]
            q, scale = mp.quantize_quad(w[0], w[1])
            if k < k_pad:
                sts_u32(column + (grp * 4 + lane // 8) * B_STEP, q)
            if lane == 0:
                sts_f32(sq + self.q_bytes + 4 * (warp * self.groups + grp), scale)
        if lane == 0:
            sts_u32(sq + self.q_bytes + self.s_bytes + 4 * warp, pair if valid != 0 else -1)
        fence_proxy_async()

    @cute.jit
    def chunk_mma_refill(self, stage: Int32, ye: Int64, tile: Int32, scale: Float32, sq: Int32,
                         lane: Int32, tidx: Int32, refill, do_refill: Int32):
        """earlyq's chunk_mma_refill with each group's k-steps on QGMMA (one group in flight
        while the next is decoded; folded in group order)."""
        wbase, obase = refill
        t = lane % 4
        acc = [Float32(0.0)] * 4
        prev = None
        for grp in cutlass.range_constexpr(self.groups):
            n_steps = self.ksteps(grp)
            cols = range(2 * grp, min(2 * grp + 2, self.cols))
            words = [w for c in cols for w in lds_v4_u32(stage + (c * self.threads + tidx) * 16)]
            offs = mp.lds_v2(stage + self.offsets_at + (grp * self.threads + tidx) * 8)
            frags = mp.decode_group(words, offs, n_steps)
            d = qgmma_steps(frags, [b_desc(sq + (4 * grp + s) * B_STEP)
                                    for s in range(n_steps)])
            if do_refill != 0:
                for c in cutlass.range_constexpr(2 * grp, min(2 * grp + 2, self.cols)):
                    mp.cp_async_16(stage + (c * self.threads + tidx) * 16,
                                   wbase + c * mk.COL_BYTES)
                mp.cp_async_8(stage + self.offsets_at + (grp * self.threads + tidx) * 8,
                              obase + grp * mk.GROUP_OFFSET_BYTES)
            if cutlass.const_expr(grp > 0):
                acc = fold(acc, wgmma_wait(1, prev), *self.scales_of(sq, t, grp - 1))
            prev = d
        acc = fold(acc, wgmma_wait(0, prev), *self.scales_of(sq, t, self.groups - 1))
        if do_refill != 0:
            mp.cp_async_commit()
        self.store_ye(acc, ye, tile, scale, sq, lane)

    @cute.jit
    def scales_of(self, sq: Int32, t: Int32, grp: int):
        """The activation scales of tokens 2t, 2t + 1 for group grp."""
        return (lds_f32(sq + self.q_bytes + 4 * ((2 * t) * self.groups + grp)),
                lds_f32(sq + self.q_bytes + 4 * ((2 * t + 1) * self.groups + grp)))


KERNEL_CLASSES = {("w13sr", "bulkqg"): MoeW13QgSm90, ("w2sr", "earlyqg"): MoeW2QgSm90}
