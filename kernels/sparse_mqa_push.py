"""The push exchange of the sparse MQA decode kernel (`kernels/sparse_mqa.py`, exchange="push").

Session 1 measured the pull exchange (DSMEM loads after a cluster barrier) as the largest single
phase (2.7 us of 13.7 at R = 1): the normalizer's loads of the other CTAs' sums are serial round
trips (each behind a branch on the previous one), and the final reduction reads 8 remote partials
and then needs a third barrier so that no CTA leaves while others still read its shared memory.
Here every CTA *stores* what the others need before the barrier, and reads only its own shared
memory after it (stores to another CTA's shared memory are fire-and-forget; the barrier's
release/acquire orders them):

    stats   thread (h, j < S) stores the head's (max, sum, bad) into CTA j's slot [my rank][h]
            -> cluster barrier 1 -> the normalizer reads slots 0..S-1 locally, in rank order
    o       warp w's 64 PV dims are the dims CTA w owns (S = 8 = warps): it stores its partial o
            into CTA w's inbox [my rank][h][..] -> cluster barrier 2 -> CTA s sums its inbox in
            rank order. No third barrier: after barrier 2 nobody touches another CTA's memory.

The arithmetic (M, L, P, the rank-order sums) is the fixed split's, operation for operation.

PV reads 8 bytes per record per lane instead of 8 single bytes per n-tile: the mma's column n of
n-tile j is dim 8n + j of the warp's 64 (not 8j + n), so lane (g, t) needs dims 8g .. 8g + 7 of
each of its 4 records (one 8-byte load each, `prmt` picks the byte pair per n-tile), and ends up
holding the 16 consecutive dims 16t .. 16t + 15 of heads g and g + 8 (four 16-byte stores each).
The products and their k order are unchanged, so o is bit-identical to the fixed split's.

Records are copied by record (warp w takes records w, w + 8, ..; lane l words l, l + 32, l + 64)
so each lane reads a record address once instead of once per 8-byte word.
"""
from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, Int64, cute
from cutlass.cutlass_dsl import T

from kernels import sparse_mqa_ref as ref
from kernels.ptx import (
    asm,
    cp_async_8,
    e4m3x2_to_bf16x2,
    lds_f32,
    lds_s64,
    lds_u8,
    pack_bf16x2,
    round_bf16,
    st_v2_b32,
    sts_v2_f32,
    sts_v2_u32,
    ue8m0_to_f32,
    void,
)

WARP = 32
REC = ref.RECORD_BYTES
REC_WORDS = REC // 8
SCALE_OFF = 576
ROPE_OFF = 448
NOPE = 448
DIMS = 64                           # a warp's PV dims = one UE8M0 group = one CTA's output dims
WARPS = ref.CTA_THREADS // WARP


def st_cluster_v4_f32(saddr: Int32, rank: Int32, a, b, c, d):
    """16 bytes into the same shared offset of CTA `rank` (runtime) of the cluster."""
    void([Int32(saddr), Int32(rank), Float32(a), Float32(b), Float32(c), Float32(d)],
         "{ .reg .b32 r; mapa.shared::cluster.u32 r, $0, $1;\n"
         "st.shared::cluster.v4.f32 [r], {$2, $3, $4, $5}; }", "r,r,f,f,f,f")


def lds_v2_u32(saddr: Int32):
    v = asm(2, [Int32(saddr)], "ld.shared.v2.u32 {$0, $1}, [$2];", "=r,=r,r", side_effects=True)
    return [Int32(x) for x in v]


def lds_v4_f32(saddr: Int32):
    v = asm(4, [Int32(saddr)], "ld.shared.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,r",
            kind=T.f32(), side_effects=True)
    return [Float32(x) for x in v]


def prmt(a: Int32, b: Int32, selector: int) -> Int32:
    """Bytes of the pair (b:a) picked by `selector` (PTX prmt.b32, default mode)."""
    return Int32(asm(1, [Int32(a), Int32(b)], f"prmt.b32 $0, $1, $2, {selector:#x};", "=r,r,r",
                     side_effects=False))


def byte_pair(j: int) -> int:
    """prmt selector: byte j of a, then byte j of b (an e4m3 pair, lower k low)."""
    return j | (4 + j) << 4


def half_pair(j: int) -> int:
    """prmt selector: bf16 j of a, then bf16 j of b."""
    return (2 * j) | (2 * j + 1) << 4 | (4 + 2 * j) << 8 | (5 + 2 * j) << 12


class SparseMqaPush:
    """Record copy, statistics and partial-o push, inbox reduction; mixed into SparseMqaSm90."""

    @cute.jit
    def _load_records_by_record(self, base: Int32, tidx: Int32):
        """Warp w copies records w, w + 8, ..; lane l its words l, l + 32, l + 64 (< 73)."""
        warp, lane = tidx // WARP, tidx % WARP
        # Unrolled (E is a compile-time constant), so the warp's address loads issue together.
        for k in cutlass.range_constexpr((self.E + WARPS - 1) // WARPS):
            i = warp + WARPS * k
            if i < self.E:
                addr = lds_s64(base + self.lay.addresses + i * 8)
                for j in cutlass.range_constexpr((REC_WORDS + WARP - 1) // WARP):
                    w = lane + WARP * j
                    if w < REC_WORDS:
                        dst = base + self.lay.records + i * REC + w * 8
                        if addr > 1:
                            cp_async_8(dst, addr + Int64(w * 8))
                        else:
                            sts_v2_u32(dst, Int32(0), Int32(0))

    @cute.jit
    def _push_stats(self, base: Int32, s: Int32, h: Int32, j: Int32, m, total, bad, cluster_ok):
        """Lane j < S of head h's 16 lanes stores the head's statistics into CTA j's slot [s]."""
        if cluster_ok & (j < self.S):
            slot = base + self.lay.stats + (s * ref.MMA_M + h) * ref.STATS_BYTES
            st_cluster_v4_f32(slot, j, m, total, bad, Float32(0.0))

    @cute.jit
    def _row_norm_push(self, base: Int32, h: Int32, cluster_ok):
        """M = max(sink, every CTA's max), L = exp(sink - M) + sum_s l_s exp(m_s - M), rank order
        (the pull exchange's arithmetic on the pushed slots)."""
        sink_h = Float32(0.0)
        if h < self.H:
            sink_h = lds_f32(base + self.lay.consts + h * 4)
        big = sink_h
        norm = Float32(0.0)
        bad = Float32(1.0)                  # a launch without the cluster shape: NaN out
        if cluster_ok:
            bad = Float32(0.0)
            for rank in cutlass.range_constexpr(self.S):
                stat = base + self.lay.stats + (rank * ref.MMA_M + h) * ref.STATS_BYTES
                big = cutlass.max(big, lds_f32(stat))
                bad = cutlass.max(bad, lds_f32(stat + 8))
            norm = cute.math.exp(sink_h - big)
            for rank in cutlass.range_constexpr(self.S):
                stat = base + self.lay.stats + (rank * ref.MMA_M + h) * ref.STATS_BYTES
                part = lds_f32(stat + 4)
                if part > Float32(0.0):
                    norm = norm + part * cute.math.exp(lds_f32(stat) - big)
        if bad > Float32(0.0):
            big = Float32(float("nan"))
        sts_v2_f32(base + self.lay.norm + h * 8, big, norm)

    @cute.jit
    def _pv_push(self, base: Int32, tidx: Int32, s: Int32, cluster_ok):
        """o_s[h, 64w + d] over this CTA's entries (module docstring: column n of n-tile j is dim
        8n + j), stored into CTA w's inbox slot [s]."""
        warp, lane = tidx // WARP, tidx % WARP
        g, t = lane // 4, lane % 4
        acc = cute.make_rmem_tensor((4, 8), Float32)
        acc.fill(0.0)
        e0 = Int32(self.E if "pv" in self.skip else 0)     # the pv ablation skips the loop
        while e0 < self.E:
            a = self._p_frag(base, e0, g, t)
            ea = base + self.lay.records + (e0 + 2 * t) * REC
            rows = (ea, ea + REC, ea + 8 * REC, ea + 9 * REC)
            if warp < NOPE // DIMS:
                sc = [ue8m0_to_f32(lds_u8(x + SCALE_OFF + warp)) for x in rows]
                w = [lds_v2_u32(x + warp * DIMS + 8 * g) for x in rows]
                for nt in cutlass.range_constexpr(8):
                    sel = byte_pair(nt % 4)
                    b0 = e4m3x2_to_bf16x2(prmt(w[0][nt // 4], w[1][nt // 4], sel), sc[0], sc[1])
                    b1 = e4m3x2_to_bf16x2(prmt(w[2][nt // 4], w[3][nt // 4], sel), sc[2], sc[3])
                    self._mma_into(acc, nt, a, b0, b1)
            else:                           # dims 448..511: bf16 rope values, 16 bytes a lane
                lo = [lds_v2_u32(x + ROPE_OFF + 16 * g) for x in rows]
                hi = [lds_v2_u32(x + ROPE_OFF + 16 * g + 8) for x in rows]
                for nt in cutlass.range_constexpr(8):
                    src = lo if nt < 4 else hi
                    k, sel = (nt % 4) // 2, half_pair(nt % 2)
                    b0 = prmt(src[0][k], src[1][k], sel)
                    b1 = prmt(src[2][k], src[3][k], sel)
                    self._mma_into(acc, nt, a, b0, b1)
            e0 += ref.ENTRY_TILE
        if cluster_ok:
            for half in cutlass.range_constexpr(2):     # heads g, g + 8
                h = g + 8 * half
                if h < self.H:
                    row = base + self.lay.inbox + (s * ref.MMA_M + h) * ref.INBOX_ROW_BYTES + 64 * t
                    for c in cutlass.range_constexpr(4):     # dims 16t + 4c .. + 3
                        i, n0 = 2 * half + c // 2, 4 * (c % 2)
                        st_cluster_v4_f32(row + 16 * c, warp, acc[i, n0],
                                          acc[i, n0 + 1], acc[i, n0 + 2], acc[i, n0 + 3])

    @cute.jit
    def _reduce_inbox_store(self, base: Int32, tidx: Int32, s: Int32, r: Int32, rows: Int32,
                            pos: Int32, seq: Int32, out: cute.Pointer, rope_table: cute.Pointer,
                            num_positions: Int32, cluster_ok):
        """CTA s owns dims [64 s, 64 s + 64): 4 dims per thread, the S partials in rank order,
        bf16, inverse RoPE (CTA 7), bf16 out (the pull exchange's arithmetic on the inbox)."""
        h, chunk = tidx // 16, tidx % 16
        v = cute.make_rmem_tensor((4,), Float32)
        if (h < self.H) & (r < rows):
            d = s * DIMS + 4 * chunk
            v.fill(float("nan"))
            if cluster_ok:
                v.fill(0.0)
                for rank in cutlass.range_constexpr(self.S):
                    src = (base + self.lay.inbox + (rank * ref.MMA_M + h) * ref.INBOX_ROW_BYTES
                           + 16 * chunk)
                    part = lds_v4_f32(src)
                    for k in cutlass.range_constexpr(4):
                        v[k] = v[k] + part[k]
            for k in cutlass.range_constexpr(4):
                v[k] = round_bf16(v[k])
            if d >= NOPE:
                self._inverse_rope(v, base, d, pos, rope_table, num_positions)
            if seq < 0:
                v.fill(0.0)
            dst = out.toint() + ((Int64(r) * self.H + h) * ref.HEAD_DIM + d) * 2
            st_v2_b32(dst, pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]))
