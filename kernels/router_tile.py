"""The MoE router's one-pass `_tile8` kernel (decode buckets, R <= 8 a tile) for SM90, CuTe DSL.

Spec, reference and bounds: `kernels/router_ref.py` (`one_pass` specs); the two-rows-a-step
kernel it stands beside: `kernels/router.py`. Same ABI, counters, outputs and tie rule.

Where the default spends its time at R <= 8 (one x round trip, one barrier and one warp-shuffle
reduction per 2 rows; the last CTA's warps selecting up to 4 rows each in sequence, 15 dependent
shuffles an arg-max round), this kernel:
- owns 3 experts a CTA where E allows (128 CTAs at E = 384: one wave, one CTA per SM) with D / 16
  threads (320 at D = 5120: 2 vectors of 8 a thread), weight rows in registers before the PDL wait;
- loads x for all 8 rows of its tile at once (clamped to the last row: one round trip), fma's the
  rows that exist, then reduces the EPC x 8 totals in one reduce-scatter over the warp (halving at
  xor 16, 8, 4, full butterfly at 2, 1: the same pairing tree as a full butterfly, 27 shuffles
  instead of 120) and the warps in order through shared memory: one barrier for the tile;
- triggers its dependents once it has counted itself in (they still wait for the whole grid);
- the last CTA selects the tile's rows on separate warps: each arg-max round is a lane-local best
  (strict >, lower index), `redux.sync.max` of the order-preserving int keys, `redux.sync.min` of
  the indices holding it (ties to the lower index), the owner masks it.

`_tile8p` (`polled`) replaces the fence + counter atomic + logits reload (three L2 round trips
between the slowest CTA's logits and the selection) by tagged words: every CTA also stores, for
each of its logits, the score s = sqrt(softplus) and the key of s + bias as one 64-bit word (the
key in the low half, s with its free sign bit set as the tag in the high half: one
single-copy-atomic store, so no fence orders it; the 384 scores are computed by 128 CTAs, not by
the selecting warp); CTA 0 of the row block polls its rows' words until every tag is set
(bounded by %globaltimer; a timeout sets the sticky flag at the scratch's first i32, which the
host reads), zeroes them for the next launch (which writes only after its griddepcontrol.wait,
i.e. after this grid) and ranks the polled keys.
CTA 0 spins while others may not yet run: at most one spinning CTA per row block (<= 32), and
the dependents launch only once every CTA has triggered, so every producer gets an SM.
"""
from __future__ import annotations

import cutlass
from cuda.bindings import driver as cuda
from cutlass import BFloat16, Float32, Int32, Int64, cute
from cutlass.cutlass_dsl import T

from kernels.ptx import (
    asm,
    atomic_add_acq_rel,
    bf16x2_to_f32,
    fence_gpu,
    ld_f32,
    ld_f32_gpu,
    ld_v4_u32,
    lds_f32,
    lds_s32,
    shfl_xor_f32,
    st_f32,
    st_s32,
    sts_f32,
    sts_s32,
    void,
)
from kernels.router_ref import EXCHANGE_OFFSET, POLL_TIMEOUT_NS, WARP, RouterSpec

MASKED = -(2**31)                    # below every float's key (-inf's is 0x807FFFFF)
NO_INDEX = 2**31 - 1


def order_key(v: Float32) -> Int32:
    """An int32 whose signed order is v's float order: negative floats get their magnitude bits
    flipped (pure)."""
    return Int32(asm(1, [Float32(v)], "{ .reg .b32 b, t; mov.b32 b, $1; shr.s32 t, b, 31;\n"
                     "and.b32 t, t, 0x7FFFFFFF; xor.b32 $0, b, t; }", "=r,f",
                     side_effects=False))


def redux_max_s32(v: Int32) -> Int32:
    return Int32(asm(1, [Int32(v)], "redux.sync.max.s32 $0, $1, 0xffffffff;", "=r,r",
                     side_effects=True))


def redux_min_s32(v: Int32) -> Int32:
    return Int32(asm(1, [Int32(v)], "redux.sync.min.s32 $0, $1, 0xffffffff;", "=r,r",
                     side_effects=True))


def st_scored(addr: Int64, score: Float32, key: Int32):
    """(key, bits(score) | 1 << 31) as one relaxed 64-bit store: a score is >= +0 or NaN, so its
    sign bit is free to tag the word (a zeroed word is empty); key and score land together."""
    void([Int64(addr), Float32(score), Int32(key)], "{ .reg .b32 b; .reg .b64 v;\n"
         "mov.b32 b, $1; or.b32 b, b, 0x80000000; mov.b64 v, {$2, b};\n"
         "st.relaxed.gpu.global.b64 [$0], v; }", "l,f,r")


def ld_scored(addr: Int64):
    """(score, key, tagged) of a scored word, one relaxed 64-bit load at L2."""
    key, hi = asm(2, [Int64(addr)], "{ .reg .b64 v; ld.relaxed.gpu.global.b64 v, [$2];\n"
                  "mov.b64 {$0, $1}, v; }", "=r,=r,l", side_effects=True)
    score = Float32(asm(1, [Int32(hi)], "{ .reg .b32 b; and.b32 b, $1, 0x7FFFFFFF;\n"
                        "mov.b32 $0, b; }", "=f,r", kind=T.f32(), side_effects=False))
    return score, Int32(key), Int32(hi)


@cute.jit
def score_of(logit: Float32) -> Float32:
    """sqrt(softplus(l)), softplus = max(l, 0) + log1p(exp(-|l|))."""
    softplus = cutlass.max(logit, Float32(0.0)) + cute.math.log1p(
        cute.math.exp(-cute.math.absf(logit)))
    return cute.math.sqrt(softplus)


def st_zero_u64(addr: Int64):
    void([Int64(addr)], "st.relaxed.gpu.global.b64 [$0], 0;", "l")


def vote_all(pred: Int32) -> Int32:
    return Int32(asm(1, [Int32(pred)], "{ .reg .pred p, q; setp.ne.s32 p, $1, 0;\n"
                     "vote.sync.all.pred q, p, 0xffffffff; selp.s32 $0, 1, 0, q; }", "=r,r",
                     side_effects=True))


def shfl_idx_f32(v: Float32, lane: Int32) -> Float32:
    return Float32(asm(1, [Float32(v), Int32(lane)],
                       "shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;", "=f,f,r",
                       kind=T.f32(), side_effects=True))


class RouterTileSm90:
    """Kernel object for one one-pass RouterSpec (config-only __init__, jit launcher, kernel)."""

    def __init__(self, spec: RouterSpec):
        if not spec.one_pass:
            raise ValueError(f"{spec.name}: RouterTileSm90 builds one_pass specs only")
        self.spec = spec
        self.T, self.V, self.W = spec.threads, spec.vecs_per_thread, spec.warps
        self.EPC, self.RT = spec.experts_per_cta, spec.rows_per_cta
        self.N = self.EPC * self.RT                        # totals a thread reduces
        if self.N % 8:
            raise ValueError(f"{spec.name}: {self.N} totals a thread; the reduce-scatter "
                             "halves 3 times")
        self.lanes_e = -(-spec.experts // WARP)            # experts per lane in the selection
        self.flag_offset = 4 * self.W * self.N
        self.bias_offset = self.flag_offset + 16
        self.polled = spec.polled

    @cute.jit
    def __call__(self, x: cute.Pointer, weight: cute.Pointer, bias: cute.Pointer,
                 logits: cute.Pointer, ids: cute.Pointer, weights: cute.Pointer,
                 counters: cute.Pointer, rows: Int32, stream: cuda.CUstream):
        self.kernel(x, weight, bias, logits, ids, weights, counters, rows).launch(
            grid=[self.spec.experts // self.EPC, 1, 1], block=list(self.spec.block),
            stream=stream, smem=self.spec.smem_bytes, use_pdl=True)

    @cute.kernel
    def kernel(self, x: cute.Pointer, weight: cute.Pointer, bias: cute.Pointer,
               logits: cute.Pointer, ids: cute.Pointer, weights: cute.Pointer,
               counters: cute.Pointer, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta_e, block_row, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        sbase = Int32(smem.allocate(self.spec.smem_bytes, byte_alignment=16).toint())
        E, D = self.spec.experts, self.spec.hidden
        e0 = cta_e * self.EPC
        wreg = cute.make_rmem_tensor((4, self.V, self.EPC), Int32)
        for e in cutlass.range_constexpr(self.EPC):
            for i in cutlass.range_constexpr(self.V):
                w = ld_v4_u32(weight.toint() + Int64(((e0 + e) * D + (tidx + i * self.T) * 8)
                                                     * 2), streaming=True)
                for q in cutlass.range_constexpr(4):
                    wreg[q, i, e] = w[q]
        for j in cutlass.range_constexpr(-(-E // self.T)):     # the bias, for the last CTA
            idx = cutlass.min(tidx + j * self.T, E - 1)          # the tail rewrites E - 1
            sts_f32(sbase + self.bias_offset + idx * 4, ld_f32(bias.toint() + Int64(idx * 4)))
        cute.arch.griddepcontrol_wait()     # x is an earlier kernel's output

        first = block_row * self.RT
        exchange = counters.toint() + Int64(EXCHANGE_OFFSET)
        self._tile_logits(x, logits, exchange, wreg, sbase, tidx, e0, first, rows)
        if cutlass.const_expr(self.polled):
            cute.arch.griddepcontrol_launch_dependents()
            if cta_e == 0:
                warp, lane = tidx // WARP, tidx % WARP
                for it in cutlass.range_constexpr(-(-self.RT // self.W)):
                    slot = warp + it * self.W
                    if (slot < self.RT) & (first + slot < rows):   # uniform over the warp
                        score, key = self._poll_row(exchange, first + slot, lane)
                        self._rank(score, key, ids, weights, first + slot, lane)
        else:
            self._count_and_select(logits, ids, weights, counters, sbase, tidx, block_row,
                                   first, rows)

    @cute.jit
    def _count_and_select(self, logits: cute.Pointer, ids: cute.Pointer, weights: cute.Pointer,
                          counters: cute.Pointer, sbase: Int32, tidx: Int32, block_row: Int32,
                          first: Int32, rows: Int32):
        """Count this CTA in; the last of the row block reloads the logits and selects."""
        E = self.spec.experts
        fence_gpu()
        cute.arch.sync_threads()
        counter = counters.toint() + Int64(block_row) * 4
        if tidx == 0:
            old = atomic_add_acq_rel(counter, Int32(1))
            sts_s32(sbase + self.flag_offset, Int32(old == E // self.EPC - 1))
        cute.arch.sync_threads()
        cute.arch.griddepcontrol_launch_dependents()
        if lds_s32(sbase + self.flag_offset) != 0:
            fence_gpu()
            warp, lane = tidx // WARP, tidx % WARP
            for it in cutlass.range_constexpr(-(-self.RT // self.W)):
                slot = warp + it * self.W
                if (slot < self.RT) & (first + slot < rows):       # uniform over the warp
                    row = first + slot
                    lgs = cute.make_rmem_tensor((self.lanes_e,), Float32)
                    for c in cutlass.range_constexpr(self.lanes_e):
                        e = cutlass.min(lane + c * WARP, E - 1)
                        lgs[c] = ld_f32_gpu(logits.toint() + Int64((row * E + e) * 4))
                    score, key = self._scores(sbase + self.bias_offset, lgs, lane)
                    self._rank(score, key, ids, weights, row, lane)
            if tidx == 0:
                st_s32(counter, Int32(0))

    @cute.jit
    def _poll_row(self, exchange: Int64, row: Int32, lane: Int32):
        """One warp: the row's logits from the tagged words, once every tag is set (or after
        POLL_TIMEOUT_NS: then the scratch's first i32, the timeout flag, is set and whatever is
        there is used); the words are zeroed for the next launch."""
        E = self.spec.experts
        score = cute.make_rmem_tensor((self.lanes_e,), Float32)
        key = cute.make_rmem_tensor((self.lanes_e,), Int32)
        start = cute.arch.globaltimer()
        waiting = Int32(1)
        while waiting != 0:
            ready = Int32(1)
            for c in cutlass.range_constexpr(self.lanes_e):
                e = cutlass.min(lane + c * WARP, E - 1)
                s, k, tag = ld_scored(exchange + Int64((row * E + e) * 8))
                score[c] = s
                key[c] = k
                if tag == 0:
                    ready = Int32(0)
            waiting = Int32(1) - vote_all(ready)
            if (waiting != 0) & (cute.arch.globaltimer() - start > Int64(POLL_TIMEOUT_NS)):
                st_s32(exchange - Int64(EXCHANGE_OFFSET), Int32(1))   # the sticky timeout flag
                waiting = Int32(0)
        for c in cutlass.range_constexpr(self.lanes_e):
            if lane + c * WARP < E:
                st_zero_u64(exchange + Int64((row * E + lane + c * WARP) * 8))
            else:
                key[c] = Int32(MASKED)
        return score, key

    @cute.jit
    def _tile_logits(self, x: cute.Pointer, logits: cute.Pointer, exchange: Int64, wreg,
                     sbase: Int32, tidx: Int32, e0: Int32, first: Int32, rows: Int32):
        """Logits of (EPC experts) x (the tile's rows): one x round trip, one barrier."""
        D, RT = self.spec.hidden, self.RT
        xreg = cute.make_rmem_tensor((4, self.V, RT), Int32)
        for r in cutlass.range_constexpr(RT):
            row = cutlass.min(first + r, rows - 1)
            for i in cutlass.range_constexpr(self.V):
                xw = ld_v4_u32(x.toint() + Int64((row * D + (tidx + i * self.T) * 8) * 2))
                for q in cutlass.range_constexpr(4):
                    xreg[q, i, r] = xw[q]
        wf = cute.make_rmem_tensor((8, self.V, self.EPC), Float32)   # unpacked once, not a row
        for q in cutlass.range_constexpr(4):
            for i in cutlass.range_constexpr(self.V):
                for e in cutlass.range_constexpr(self.EPC):
                    w_lo, w_hi = bf16x2_to_f32(wreg[q, i, e])
                    wf[2 * q, i, e] = w_lo
                    wf[2 * q + 1, i, e] = w_hi
        acc = cute.make_rmem_tensor((self.N,), Float32)
        acc.fill(0.0)
        for r in cutlass.range_constexpr(RT):
            if first + r < rows:                                   # uniform over the CTA
                for i in cutlass.range_constexpr(self.V):
                    for q in cutlass.range_constexpr(4):
                        x_lo, x_hi = bf16x2_to_f32(xreg[q, i, r])
                        for e in cutlass.range_constexpr(self.EPC):
                            acc[e * RT + r] = acc[e * RT + r] + x_lo * wf[2 * q, i, e]
                            acc[e * RT + r] = acc[e * RT + r] + x_hi * wf[2 * q + 1, i, e]
        warp, lane = tidx // WARP, tidx % WARP
        vals = []
        for j in cutlass.range_constexpr(self.N):
            vals.append(acc[j])
        base = Int32(0)
        for step in cutlass.range_constexpr(3):    # reduce-scatter: keep a half, add the partner's
            off, h = 16 >> step, len(vals) // 2
            upper = (lane & off) != 0
            halved = []
            for j in cutlass.range_constexpr(h):
                keep = vals[j]
                send = vals[j + h]
                if upper:
                    keep = vals[j + h]
                    send = vals[j]
                halved.append(keep + shfl_xor_f32(send, off))
            vals = halved
            if upper:
                base = base + h
        for step in cutlass.range_constexpr(2):
            for m in cutlass.range_constexpr(len(vals)):
                vals[m] = vals[m] + shfl_xor_f32(vals[m], 2 >> step)
        if lane % 4 == 0:
            for m in cutlass.range_constexpr(len(vals)):
                sts_f32(sbase + (warp * self.N + base + m) * 4, vals[m])
        cute.arch.sync_threads()
        if tidx < self.N:
            total = lds_f32(sbase + tidx * 4)
            for w in cutlass.range_constexpr(1, self.W):
                total = total + lds_f32(sbase + (w * self.N + tidx) * 4)
            e, r = tidx // RT, tidx % RT
            if first + r < rows:
                at = (first + r) * self.spec.experts + e0 + e
                st_f32(logits.toint() + Int64(at * 4), total)
                if cutlass.const_expr(self.polled):     # the consumer's score work, spread out
                    s = score_of(total)
                    st_scored(exchange + Int64(at * 8), s,
                              order_key(s + lds_f32(sbase + self.bias_offset + (e0 + e) * 4)))

    @cute.jit
    def _lane_best(self, key, lane: Int32):
        """The lane's largest key and its expert, lower index on a tie: a pairwise tree (depth
        ceil(log2 C) instead of a C - 1 chain); a pair's left half always holds the lower
        indices, so strict > keeps them."""
        cands = []
        for c in cutlass.range_constexpr(self.lanes_e):
            cands.append((key[c], lane + c * WARP))
        for _level in cutlass.range_constexpr((self.lanes_e - 1).bit_length()):
            paired = []
            for j in cutlass.range_constexpr(len(cands) // 2):
                k, i = cands[2 * j]
                kb, ib = cands[2 * j + 1]
                if kb > k:
                    k = kb
                    i = ib
                paired.append((k, i))
            cands = paired + cands[len(cands) // 2 * 2:]
        return cands[0]

    @cute.jit
    def _scores(self, bias_s: Int32, lgs, lane: Int32):
        """Lane l's scores sqrt(softplus) of logits l + 32c, and the keys of score + bias."""
        E = self.spec.experts
        key = cute.make_rmem_tensor((self.lanes_e,), Int32)
        score = cute.make_rmem_tensor((self.lanes_e,), Float32)
        for c in cutlass.range_constexpr(self.lanes_e):
            e = cutlass.min(lane + c * WARP, E - 1)
            s = score_of(lgs[c])
            score[c] = s
            key[c] = order_key(s + lds_f32(bias_s + e * 4))
            if lane + c * WARP >= E:
                key[c] = Int32(MASKED)
        return score, key

    @cute.jit
    def _rank(self, score, key, ids: cute.Pointer, weights: cute.Pointer, row: Int32,
              lane: Int32):
        """One warp: top-k of the keys (ties: lower index), weights s / (Σ s + 1e-20)·scaling."""
        chosen_ids = []
        chosen_scores = []
        for _k in cutlass.range_constexpr(self.spec.topk):
            best, best_i = self._lane_best(key, lane)
            top = redux_max_s32(best)
            cand = best_i
            if best != top:
                cand = Int32(NO_INDEX)
            win = redux_min_s32(cand)
            mine = Float32(0.0)
            for c in cutlass.range_constexpr(self.lanes_e):
                if win == lane + c * WARP:
                    key[c] = Int32(MASKED)
                    mine = score[c]
            chosen_ids.append(win)
            chosen_scores.append(shfl_idx_f32(mine, win % WARP))
        total = chosen_scores[0]
        for k in cutlass.range_constexpr(1, self.spec.topk):
            total = total + chosen_scores[k]
        denom = total + Float32(1e-20)
        if lane == 0:
            out = Int64(row * self.spec.topk * 4)
            for k in cutlass.range_constexpr(self.spec.topk):
                st_s32(ids.toint() + out + Int64(4 * k), chosen_ids[k])
                st_f32(weights.toint() + out + Int64(4 * k),
                       chosen_scores[k] / denom * Float32(self.spec.scaling))


def compile_tile_spec(spec: RouterSpec, options: str):
    """cute.compile the one-pass router with pointer / Int32 arguments only."""
    from cutlass.cute.runtime import make_ptr

    def ptr(dtype=Float32):
        return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=16)

    return cute.compile(RouterTileSm90(spec), ptr(BFloat16), ptr(BFloat16), ptr(), ptr(),
                        ptr(Int32), ptr(), ptr(Int32), Int32(1), cuda.CUstream(0),
                        options=options)
