"""Sparse MQA decode for SM90 in the CuTe DSL: one cluster per row, split entries, exact softmax.

Computes A13 + A14 of one rank (spec, ABI, byte formulas and reference: `kernels/sparse_mqa_ref.py`):
attention of the rank's 16 heads over a row's SWA window and top-k compressed entries (584-byte
records, K = V), attention sink, BF16 probabilities, inverse RoPE on the output, BF16 out.

How (grid = (S, R), cluster = (S, 1, 1), 256 threads; S = 8 with top-k, 4 without):

    CTA s of row r:  entries [s*per, s*per + count) of the row's list (SWA, then top-k)
      A  record addresses (SWA ring slot / block table; masked -> 0, bad -> 1)   q -> smem
      B  cp.async 8-byte words of every record into smem (masked: zeros; never read)
      C  QK: mma.sync m16n8k16, A = q (16 heads x 16 dims), B = 8 entries dequantized in registers
         (e4m3x2 -> f16x2 -> f32 x 2^k -> bf16x2: exact, FP8 x 2^k fits BF16)
      D  per head (max, sum of exp) of this CTA's entries            -> cluster barrier
      E  every CTA reads all S (max, sum) through DSMEM in rank order: the row's M, L
      F  P = bf16(exp(logit - M) / L) (normalized, as the reference rounds)
      G  PV: mma.sync, A = P (16 heads x 16 entries), B = V bytes -> bf16; warp w owns dims 64w..
         -> partial o [H, 512] fp32 in smem                            -> cluster barrier
      H  CTA s sums dims [s*512/S, (s+1)*512/S) of the S partials in rank order (deterministic),
         bf16, inverse RoPE (dims 448..511, fp32 on the bf16 values), bf16 store -> cluster barrier

Each record is read from memory once per row; nothing outside a row's valid entries is read.

Variants of the top-k kernel (`ref.variant_specs`; the measured default is split="balanced"):
split="fixed" loads the top-k ids in the same wave as row_info (3-hop address chain) and prefetches
the sink and RoPE row into smem; exchange="push" stores what the other CTAs need before each
cluster barrier (`kernels/sparse_mqa_push.py`); qk_runs reads QK operands as lane runs
(`kernels/sparse_mqa_qk.py`); `skip` builds timing-only ablations (outputs meaningless).
PDL: `griddepcontrol.wait` comes first (q, the caches and the metadata are all written by the
step's earlier kernels); `launch_dependents` after the last store.

PTX ABI: (u64 q, u64 out, u64 swa, u64 compressed, u64 topk, u64 block_tables, u64 row_info,
u64 state_lines, u64 sink, u64 rope_table, u32 rows, u32 pages_per_seq, u32 page_size,
u32 num_positions). Buffers 16-byte aligned. Launch with the cluster dimension (S, 1, 1): the DSL
does not bake it into the cubin, so a launch without it is detected (%cluster_nctarank) and writes
NaN rather than wrong numbers.

Phases A/B (addresses, q, records) are `SparseMqaGather` in `kernels/sparse_mqa_gather.py`.
"""
from __future__ import annotations

import cutlass
from cuda.bindings import driver as cuda
from cutlass import Float32, Int32, Int64, cute

from kernels import sparse_mqa_ref as ref
from kernels.ptx import (
    cluster_nctarank,
    cluster_sync,
    cp_async_wait_all,
    e4m3x2_to_bf16x2,
    ld_cluster_f32,
    ld_cluster_v4_f32,
    ld_f32,
    ld_v4_f32,
    lds_f32,
    lds_s64,
    lds_u8,
    lds_u16,
    lds_u32,
    mma_bf16_16816,
    pack_bf16x2,
    round_bf16,
    shfl_add,
    shfl_max,
    st_v2_b32,
    stamp_smid,
    stamp_time,
    sts_f32,
    sts_u32,
    sts_v2_f32,
    ue8m0_to_f32,
)
from kernels.sparse_mqa_gather import REC, SparseMqaGather
from kernels.sparse_mqa_push import SparseMqaPush
from kernels.sparse_mqa_qk import SparseMqaQkRuns

WARP = 32
WARPS = ref.CTA_THREADS // WARP
SCALE_OFF = 576                     # 7 UE8M0 bytes
ROPE_OFF = 448                      # 64 bf16 rope values
NOPE = 448
O_ROW_BYTES = ref.HEAD_DIM * 4 + 16  # padded fp32 partial-o row
SOFTMAX_SCALE = ref.HEAD_DIM ** -0.5
NEG_INF = float("-inf")


# ---- timeline stamps (the `_timeline` builds only: ref.TIMELINE_POINTS) -------------------------

def timeline_of(stamps, cta: Int32, tidx: Int32):
    """None in production (stamps None: nothing is emitted); else (the CTA's stamp row, 1 on
    thread 0 else 0), the SM id written at once."""
    if stamps is None:
        return None
    row = stamps + Int64(cta) * (ref.TIMELINE_WORDS * 8)
    writer = _thread0(tidx)
    stamp_smid(row, writer)
    return row, writer


@cute.jit
def _thread0(tidx: Int32) -> Int32:
    writer = Int32(0)
    if tidx == 0:
        writer = Int32(1)
    return writer


def mark(tl, point: str):
    """Thread 0 writes (%globaltimer, %clock64) of `point`; nothing when tl is None."""
    if tl is not None:
        row, writer = tl
        stamp_time(row + 16 * (1 + ref.TIMELINE_POINTS.index(point)), writer)   # 16-B aligned


# ---- the kernel ----------------------------------------------------------------------------------

class SparseMqaSm90(SparseMqaGather, SparseMqaPush, SparseMqaQkRuns):
    """Kernel object for one SparseMqaSpec (config-only __init__, jit launcher, kernel, phases)."""

    def __init__(self, spec: ref.SparseMqaSpec):
        self.spec = spec
        self.lay = spec.layout
        self.S = spec.cluster_ctas
        self.E = spec.entries_per_cta
        self.H = spec.heads
        self.topk = spec.topk
        self.dims_per_cta = ref.HEAD_DIM // self.S
        self.skip = frozenset(spec.skip)
        self.consts = self.lay.consts >= 0      # sink and RoPE row prefetched into smem
        self.push = spec.exchange == "push"     # kernels/sparse_mqa_push.py
        self.early = spec.early                 # addresses and records before the PDL wait
        if self.E > ref.CTA_THREADS or self.E % ref.ENTRY_TILE:
            raise ValueError(f"{spec.name}: {self.E} entries per CTA; need a multiple of "
                             f"{ref.ENTRY_TILE} <= {ref.CTA_THREADS}")

    @cute.jit
    def __call__(self, q: cute.Pointer, out: cute.Pointer, swa: cute.Pointer,
                 compressed: cute.Pointer, topk: cute.Pointer, block_tables: cute.Pointer,
                 row_info: cute.Pointer, state_lines: cute.Pointer, sink: cute.Pointer,
                 rope_table: cute.Pointer, rows: Int32, pages_per_seq: Int32, page_size: Int32,
                 num_positions: Int32, stream: cuda.CUstream):
        self.kernel(q, out, swa, compressed, topk, block_tables, row_info, state_lines, sink,
                    rope_table, rows, pages_per_seq, page_size, num_positions).launch(
            grid=[self.S, 1, 1], block=list(self.spec.block), cluster=list(self.spec.cluster),
            smem=self.spec.smem_bytes, stream=stream, use_pdl=True,
            min_blocks_per_mp=ref.CTAS_PER_SM,
            preferred_smem_carveout=100)   # given, so the DSL does not query a GPU at compile

    @cute.kernel
    def kernel(self, q: cute.Pointer, out: cute.Pointer, swa: cute.Pointer,
               compressed: cute.Pointer, topk: cute.Pointer, block_tables: cute.Pointer,
               row_info: cute.Pointer, state_lines: cute.Pointer, sink: cute.Pointer,
               rope_table: cute.Pointer, rows: Int32, pages_per_seq: Int32, page_size: Int32,
               num_positions: Int32):
        self.run(q, out, swa, compressed, topk, block_tables, row_info, state_lines, sink,
                 rope_table, rows, pages_per_seq, page_size, num_positions)

    @cute.jit
    def run(self, q: cute.Pointer, out: cute.Pointer, swa: cute.Pointer,
            compressed: cute.Pointer, topk: cute.Pointer, block_tables: cute.Pointer,
            row_info: cute.Pointer, state_lines: cute.Pointer, sink: cute.Pointer,
            rope_table: cute.Pointer, rows: Int32, pages_per_seq: Int32, page_size: Int32,
            num_positions: Int32, stamps=None):
        """The kernel's body; stamps: the timeline build's u64 address (None in production, so
        no stamp reaches the production cubin)."""
        tidx, _, _ = cute.arch.thread_idx()
        s, r, _ = cute.arch.block_idx()
        tl = timeline_of(stamps, r * self.S + s, tidx)
        mark(tl, "entry")
        smem = cutlass.memory.SmemAllocator()
        base = Int32(smem.allocate(self.spec.smem_bytes, byte_alignment=16).toint())
        cluster_ok = cluster_nctarank(side_effects=True) == self.S
        self._zero_pad_heads(base, tidx)
        if cutlass.const_expr(self.consts):     # a weight, not written by the step: before the wait
            self._prefetch_sink(base, tidx, sink)
        if cutlass.const_expr(self.early):      # all but q: complete before the previous kernel
            pos, seq = self._addresses_fixed(q, swa, compressed, topk, block_tables, row_info,
                                             state_lines, rope_table, base, tidx, s, r, rows,
                                             pages_per_seq, page_size, num_positions)
            n_pad = Int32(self.E)
            mark(tl, "addresses")
            if cutlass.const_expr("gather" not in self.skip):
                self._load_records_by_record(base, tidx)
            mark(tl, "issued")
        mark(tl, "before_wait")
        cute.arch.griddepcontrol_wait()     # q, caches, top-k and row metadata: earlier kernels
        mark(tl, "after_wait")

        if cutlass.const_expr(self.early):
            if r < rows:
                self._load_q(q, base, r, tidx)
        else:
            if cutlass.const_expr(self.spec.split == "fixed"):
                pos, seq = self._addresses_fixed(q, swa, compressed, topk, block_tables,
                                                 row_info, state_lines, rope_table, base, tidx,
                                                 s, r, rows, pages_per_seq, page_size,
                                                 num_positions)
                n_pad = Int32(self.E)
            else:
                pos, seq, n_pad = self._addresses_balanced(q, swa, compressed, topk,
                                                           block_tables, row_info, state_lines,
                                                           base, tidx, s, r, rows,
                                                           pages_per_seq, page_size)
            mark(tl, "addresses")
            if cutlass.const_expr(self.push):
                if cutlass.const_expr("gather" not in self.skip):
                    self._load_records_by_record(base, tidx)
            else:
                self._load_records(base, tidx, n_pad)
            mark(tl, "issued")
        cp_async_wait_all()
        cute.arch.sync_threads()
        mark(tl, "landed")

        if cutlass.const_expr(self.spec.qk_runs):
            self._logits_runs(base, tidx)
        else:
            self._logits(base, tidx, n_pad)
        cute.arch.sync_threads()
        mark(tl, "qk")
        self._local_stats(base, tidx, n_pad, s, cluster_ok)
        mark(tl, "stats")
        self._cluster_sync()                # every CTA's (max, sum, bad) is visible
        mark(tl, "exchange1")
        if cutlass.const_expr(self.push):
            cute.arch.griddepcontrol_launch_dependents()    # the next kernel's launch overlaps
            if tidx < ref.MMA_M:
                self._row_norm_push(base, tidx, cluster_ok)
        elif tidx < ref.MMA_M:
            self._row_norm(base, tidx, sink, cluster_ok)
        cute.arch.sync_threads()
        self._probs(base, tidx, n_pad)
        cute.arch.sync_threads()
        mark(tl, "probs")
        if cutlass.const_expr(self.push):
            self._pv_push(base, tidx, s, cluster_ok)
            mark(tl, "pv")
            self._cluster_sync()            # every CTA's partial o is in its owner's inbox
            mark(tl, "exchange2")
            self._reduce_inbox_store(base, tidx, s, r, rows, pos, seq, out, rope_table,
                                     num_positions, cluster_ok)
            mark(tl, "exit")
        else:
            self._pv(base, tidx, n_pad)
            mark(tl, "pv")
            self._cluster_sync()            # every CTA's partial o is visible
            mark(tl, "exchange2")
            self._reduce_store(base, tidx, s, r, rows, pos, seq, out, rope_table, num_positions,
                               cluster_ok)
            self._cluster_sync()            # no CTA leaves while others read its partial o
            mark(tl, "exit")
            cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def _cluster_sync(self):
        cluster_sync()

    # ---- phase C/D: logits and the CTA's softmax statistics ----------------------------------

    @cute.jit
    def _q_frag(self, base: Int32, k0: int, g: Int32, t: Int32):
        qa = base + self.lay.q + g * ref.Q_ROW_BYTES + (k0 + 2 * t) * 2
        qb = qa + 8 * ref.Q_ROW_BYTES
        return (lds_u32(qa), lds_u32(qb), lds_u32(qa + 16), lds_u32(qb + 16))

    @cute.jit
    def _logits(self, base: Int32, tidx: Int32, n_pad: Int32):
        """logits[h, n] = q[h] . entry[n] / sqrt(512); warp w takes 8-entry tiles w, w + 8, .."""
        warp, lane = tidx // WARP, tidx % WARP
        g, t = lane // 4, lane % 4
        acc = cute.make_rmem_tensor((4,), Float32)
        tile = warp
        while tile < n_pad // 8:
            entry = base + self.lay.records + (tile * 8 + g) * REC
            acc.fill(0.0)
            scale = Float32(0.0)
            for kk in cutlass.range_constexpr(ref.HEAD_DIM // 16):
                k0 = 16 * kk
                a = self._q_frag(base, k0, g, t)
                if cutlass.const_expr(k0 < NOPE):
                    if cutlass.const_expr(kk % 4 == 0):
                        scale = ue8m0_to_f32(lds_u8(entry + SCALE_OFF + kk // 4))
                    b0 = e4m3x2_to_bf16x2(lds_u16(entry + k0 + 2 * t), scale, scale)
                    b1 = e4m3x2_to_bf16x2(lds_u16(entry + k0 + 8 + 2 * t), scale, scale)
                else:
                    off = ROPE_OFF + (k0 - NOPE) * 2 + 4 * t
                    b0 = lds_u32(entry + off)
                    b1 = lds_u32(entry + off + 16)
                d = mma_bf16_16816(a, (b0, b1), [acc[i] for i in range(4)])
                for i in cutlass.range_constexpr(4):
                    acc[i] = d[i]
            n0 = tile * 8 + 2 * t
            for e in cutlass.range_constexpr(2):
                valid = lds_s64(base + self.lay.addresses + (n0 + e) * 8) > 1
                for half in cutlass.range_constexpr(2):
                    value = Float32(NEG_INF)
                    if valid:
                        value = acc[2 * half + e] * Float32(SOFTMAX_SCALE)
                    h = g + 8 * half
                    sts_f32(base + self.lay.logits + (h * self.E + n0 + e) * 4, value)
            tile += WARPS

    @cute.jit
    def _local_stats(self, base: Int32, tidx: Int32, n_pad: Int32, s: Int32, cluster_ok):
        """(max, sum exp(l - max), bad) per head over this CTA's entries; 16 lanes per head, a
        fixed butterfly order (deterministic)."""
        h, j = tidx // 16, tidx % 16
        row = base + self.lay.logits + h * self.E * 4
        m = Float32(NEG_INF)
        bad = Float32(0.0)
        n = j
        while n < n_pad:
            m = cutlass.max(m, lds_f32(row + n * 4))
            if lds_s64(base + self.lay.addresses + n * 8) == 1:
                bad = Float32(1.0)
            n += 16
        for off in (8, 4, 2, 1):
            m = shfl_max(m, off)
            bad = shfl_max(bad, off)
        total = Float32(0.0)
        if m > Float32(NEG_INF):
            n = j
            while n < n_pad:
                total = total + cute.math.exp(lds_f32(row + n * 4) - m)
                n += 16
        for off in (8, 4, 2, 1):
            total = shfl_add(total, off)
        if cutlass.const_expr(self.push):
            self._push_stats(base, s, h, j, m, total, bad, cluster_ok)
        elif j == 0:
            stat = base + self.lay.stats + h * ref.STATS_BYTES
            sts_v2_f32(stat, m, total)
            sts_f32(stat + 8, bad)

    # ---- phase E/F: the row's normalizer (DSMEM) and the probabilities ------------------------

    @cute.jit
    def _row_norm(self, base: Int32, h: Int32, sink: cute.Pointer, cluster_ok):
        """M = max(sink, every CTA's max), L = exp(sink - M) + sum_s l_s exp(m_s - M), rank order."""
        sink_h = Float32(0.0)
        if h < self.H:
            if cutlass.const_expr(self.consts):
                sink_h = lds_f32(base + self.lay.consts + h * 4)
            else:
                sink_h = ld_f32(sink.toint() + Int64(h) * 4)
        stat = base + self.lay.stats + h * ref.STATS_BYTES
        big = sink_h
        norm = Float32(0.0)
        bad = Float32(1.0)                  # a launch without the cluster shape: NaN out
        if cluster_ok:
            bad = Float32(0.0)
            for rank in cutlass.range_constexpr(self.S):
                big = cutlass.max(big, ld_cluster_f32(stat, rank))
                bad = cutlass.max(bad, ld_cluster_f32(stat + 8, rank))
            norm = cute.math.exp(sink_h - big)
            for rank in cutlass.range_constexpr(self.S):
                part = ld_cluster_f32(stat + 4, rank)
                if part > Float32(0.0):
                    norm = norm + part * cute.math.exp(ld_cluster_f32(stat, rank) - big)
        if bad > Float32(0.0):
            big = Float32(float("nan"))
        sts_v2_f32(base + self.lay.norm + h * 8, big, norm)

    @cute.jit
    def _probs(self, base: Int32, tidx: Int32, n_pad: Int32):
        """P[h, n] = bf16(exp(logit - M) / L) as bf16 pairs; rows >= H and masked entries are 0."""
        half = n_pad // 2
        idx = tidx
        while idx < ref.MMA_M * half:
            h, n = idx // half, 2 * (idx % half)
            word = Int32(0)
            if h < self.H:
                big = lds_f32(base + self.lay.norm + h * 8)
                norm = lds_f32(base + self.lay.norm + h * 8 + 4)
                row = base + self.lay.logits + (h * self.E + n) * 4
                p0 = cute.math.exp(lds_f32(row) - big) / norm
                p1 = cute.math.exp(lds_f32(row + 4) - big) / norm
                word = pack_bf16x2(p0, p1)
            sts_u32(base + self.lay.probs + h * self.lay.probs_row_bytes + n * 2, word)
            idx += ref.CTA_THREADS

    # ---- phase G: PV -------------------------------------------------------------------------

    @cute.jit
    def _p_frag(self, base: Int32, e0: Int32, g: Int32, t: Int32):
        pa = base + self.lay.probs + g * self.lay.probs_row_bytes + (e0 + 2 * t) * 2
        pb = pa + 8 * self.lay.probs_row_bytes
        return (lds_u32(pa), lds_u32(pb), lds_u32(pa + 16), lds_u32(pb + 16))

    @cute.jit
    def _pv(self, base: Int32, tidx: Int32, n_pad: Int32):
        """o_s[h, d] = sum over this CTA's entries of P[h, n] V[n, d]; warp w owns dims 64w..64w+63
        (one scale group; warp 7 the bf16 rope dims). The partial lands in smem over the records."""
        warp, lane = tidx // WARP, tidx % WARP
        g, t = lane // 4, lane % 4
        acc = cute.make_rmem_tensor((4, 8), Float32)
        acc.fill(0.0)
        e0 = Int32(0)
        while e0 < n_pad:
            a = self._p_frag(base, e0, g, t)
            ea = base + self.lay.records + (e0 + 2 * t) * REC
            eb, ec = ea + REC, ea + 8 * REC
            ed = ec + REC
            if warp < NOPE // 64:
                sa = ue8m0_to_f32(lds_u8(ea + SCALE_OFF + warp))
                sb = ue8m0_to_f32(lds_u8(eb + SCALE_OFF + warp))
                sc = ue8m0_to_f32(lds_u8(ec + SCALE_OFF + warp))
                sd = ue8m0_to_f32(lds_u8(ed + SCALE_OFF + warp))
                for nt in cutlass.range_constexpr(8):
                    d = warp * 64 + nt * 8 + g
                    b0 = e4m3x2_to_bf16x2(lds_u8(ea + d) | (lds_u8(eb + d) << 8), sa, sb)
                    b1 = e4m3x2_to_bf16x2(lds_u8(ec + d) | (lds_u8(ed + d) << 8), sc, sd)
                    self._mma_into(acc, nt, a, b0, b1)
            else:
                for nt in cutlass.range_constexpr(8):
                    off = ROPE_OFF + (nt * 8 + g) * 2
                    b0 = lds_u16(ea + off) | (lds_u16(eb + off) << 16)
                    b1 = lds_u16(ec + off) | (lds_u16(ed + off) << 16)
                    self._mma_into(acc, nt, a, b0, b1)
            e0 += ref.ENTRY_TILE
        cute.arch.sync_threads()            # every warp is done with the records: reuse them
        for nt in cutlass.range_constexpr(8):
            d0 = warp * 64 + nt * 8 + 2 * t
            for half in cutlass.range_constexpr(2):
                h = g + 8 * half
                if h < self.H:
                    dst = base + self.lay.records + h * ref.O_ROW_BYTES + d0 * 4
                    sts_v2_f32(dst, acc[2 * half, nt], acc[2 * half + 1, nt])

    @cute.jit
    def _mma_into(self, acc, nt: int, a, b0: Int32, b1: Int32):
        d = mma_bf16_16816(a, (b0, b1), [acc[i, nt] for i in range(4)])
        for i in cutlass.range_constexpr(4):
            acc[i, nt] = d[i]

    # ---- phase H: cluster reduction, inverse RoPE, store -------------------------------------

    @cute.jit
    def _reduce_store(self, base: Int32, tidx: Int32, s: Int32, r: Int32, rows: Int32,
                      pos: Int32, seq: Int32, out: cute.Pointer, rope_table: cute.Pointer,
                      num_positions: Int32, cluster_ok):
        """CTA s owns dims [s*512/S, (s+1)*512/S): 4 dims per thread step, S partials in rank
        order, bf16, inverse RoPE (pairs never straddle a 4-dim chunk), bf16 out."""
        per_head = self.dims_per_cta // 4
        chunks = self.H * per_head
        v = cute.make_rmem_tensor((4,), Float32)
        for i in cutlass.range_constexpr(0, chunks, ref.CTA_THREADS):
            c = tidx + i
            if (c < chunks) & (r < rows):
                h = c // per_head
                d = s * self.dims_per_cta + 4 * (c % per_head)
                src = base + self.lay.records + h * ref.O_ROW_BYTES + d * 4
                v.fill(float("nan"))
                if cluster_ok:
                    v.fill(0.0)
                    for rank in cutlass.range_constexpr(self.S):
                        part = ld_cluster_v4_f32(src, rank)
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

    @cute.jit
    def _inverse_rope(self, v, base: Int32, d: Int32, pos: Int32, rope_table: cute.Pointer,
                      num_positions: Int32):
        """Pairs (d, d+1), (d+2, d+3): y0 = x0 c + x1 s, y1 = x1 c - x0 s; a position outside
        the table gives NaN (never an out-of-bounds read)."""
        cs = cute.make_rmem_tensor((4,), Float32)
        cs.fill(float("nan"))
        if (pos >= 0) & (pos < num_positions):
            pair = (d - NOPE) // 2
            if cutlass.const_expr(self.consts):     # prefetched in phase A
                for k in cutlass.range_constexpr(4):
                    cs[k] = lds_f32(base + self.lay.consts + ref.MMA_M * 4 + pair * 8 + k * 4)
            else:
                row = ld_v4_f32(rope_table.toint() + (Int64(pos) * 32 + Int64(pair)) * 8)
                for k in cutlass.range_constexpr(4):
                    cs[k] = row[k]
        for p in cutlass.range_constexpr(2):
            x0, x1 = v[2 * p], v[2 * p + 1]
            c, sn = cs[2 * p], cs[2 * p + 1]
            v[2 * p] = x0 * c + x1 * sn
            v[2 * p + 1] = x1 * c - x0 * sn


class SparseMqaTimelineSm90(SparseMqaSm90):
    """A `_timeline` build: the production body with (u64 stamps) before rows (ref.TIMELINE_PARAMS)."""

    @cute.jit
    def __call__(self, q: cute.Pointer, out: cute.Pointer, swa: cute.Pointer,
                 compressed: cute.Pointer, topk: cute.Pointer, block_tables: cute.Pointer,
                 row_info: cute.Pointer, state_lines: cute.Pointer, sink: cute.Pointer,
                 rope_table: cute.Pointer, stamps: cute.Pointer, rows: Int32,
                 pages_per_seq: Int32, page_size: Int32, num_positions: Int32,
                 stream: cuda.CUstream):
        self.kernel(q, out, swa, compressed, topk, block_tables, row_info, state_lines, sink,
                    rope_table, stamps, rows, pages_per_seq, page_size, num_positions).launch(
            grid=[self.S, 1, 1], block=list(self.spec.block), cluster=list(self.spec.cluster),
            smem=self.spec.smem_bytes, stream=stream, use_pdl=True,
            min_blocks_per_mp=ref.CTAS_PER_SM, preferred_smem_carveout=100)

    @cute.kernel
    def kernel(self, q: cute.Pointer, out: cute.Pointer, swa: cute.Pointer,
               compressed: cute.Pointer, topk: cute.Pointer, block_tables: cute.Pointer,
               row_info: cute.Pointer, state_lines: cute.Pointer, sink: cute.Pointer,
               rope_table: cute.Pointer, stamps: cute.Pointer, rows: Int32,
               pages_per_seq: Int32, page_size: Int32, num_positions: Int32):
        self.run(q, out, swa, compressed, topk, block_tables, row_info, state_lines, sink,
                 rope_table, rows, pages_per_seq, page_size, num_positions, stamps.toint())


def kernel_class(spec: ref.SparseMqaSpec):
    return SparseMqaTimelineSm90 if spec.timeline else SparseMqaSm90


def kernel_function(spec: ref.SparseMqaSpec):
    """The @cute.kernel whose Python signature the build checks against spec.params."""
    return kernel_class(spec).kernel


def specs(cfg, tp: int) -> list[ref.SparseMqaSpec]:
    """The two measured kernels, the candidates and ablations (`ref.variant_specs`), then the
    step kernels' timeline twins (`ref.timeline_specs`)."""
    return (ref.sparse_mqa_specs(cfg, tp) + ref.variant_specs(cfg, tp)
            + ref.timeline_specs(cfg, tp))


def compile_spec(spec: ref.SparseMqaSpec, options: str = "--gpu-arch sm_90a"):
    """cute.compile one sparse MQA kernel with pointer / Int32 arguments only."""
    from cutlass.cute.runtime import make_ptr

    def ptr(dtype):
        return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=16)

    pointers = [ptr(cutlass.BFloat16), ptr(cutlass.BFloat16), ptr(cutlass.Uint8),
                ptr(cutlass.Uint8), ptr(Int32), ptr(Int32), ptr(Int32), ptr(Int32), ptr(Float32),
                ptr(Float32)] + ([ptr(cutlass.Int64)] if spec.timeline else [])
    return cute.compile(kernel_class(spec)(spec), *pointers, Int32(1), Int32(1), Int32(64),
                        Int32(1), cuda.CUstream(0), options=options)
