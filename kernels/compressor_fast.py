"""Round 9 compressor kernels (SM90, CuTe DSL): the "bulk" projection and the "staged" publish.

Specs and layouts: `kernels/compressor_kernel_ref.py` (`make_proj_spec(r, D, "bulk")`,
`make_publish_spec(r, "staged")`, `proj_bulk_layout`); why and the predictions:
docs/notes/compressor-design.md "Round 9". Same outputs and tolerances as the session-1 kernels
of `kernels/compressor.py`; the staged publish calls the session-1 publish's math (pool_pair,
latent_rstd, latent_store, rope_entry_pair, store_entry, key_latent, store_key), so the same
arithmetic in the same order; only its loads differ.

Bulk projection (PTX: u64 x, u64 w, u64 out, u32 rows): one CTA of stage_k / 4 threads (128 at
D = 5120) per 4 output columns, grid (512 r / 4). Thread 0 streams the 4 weight rows and the x tile
of 8 ("bulk") or 16 ("bulk16") rows through a ring of `slots` shared-memory slots (one cp.async.bulk per weight row segment and
per x row segment, counted on the slot's mbarrier); the weight copies of the first slots are issued
before griddepcontrol.wait (they never depend on an earlier kernel), the x copies after it. Thread
t multiplies dims 4t..4t+3 of every slot for the 4 columns x 8 (16) rows (32 (64) fp32 fma
chains), then a warp butterfly per output, the warp partials in shared memory summed in warp
order. Rows past R read the last row and are not stored; larger R loops over the row tiles
through the same ring (the weights stream again per tile, from L2).
Why: the session-1 kernel's weight loads were serialised by the compiler (one 16-byte load in
flight per lane, after the PDL wait); a bulk copy cannot be sunk to its use.

    slot g % slots: [W col 0..3: stage_k values][x rows of the tile: stage_k bf16]
                    (g = tile * stages + s)
    thread 0:  issue W(0..slots-1) | wait PDL | issue x(0..slots-1) | ... refill g+slots after
    all:       wait bar(g) -> 128 (256) fma a thread -> bar.sync -> (thread 0 refills the slot)

Staged publish (PTX: session-1 PUBLISH_PARAMS): grid min(R, 128), CTA b does rows b, b + grid, ...
Before the PDL wait thread 0 bulk-copies wk (128 KB bf16) into shared memory; after it, every
load that depends only on the row (positions, seq_index, the row's and the previous row's kv_score
and metadata, norm_w, k_norm) is issued at once, then those that need them (state line, page,
RoPE rows), then the partner: three global round trips instead of the session-1 chain of ~12.
The index key reads wk from shared memory. The CTA waits for the wk copy before it exits, also
when no row of it publishes.
"""
from __future__ import annotations

import cutlass
from cuda.bindings import driver as cuda
from cutlass import Float32, Int32, Int64, cute
from cutlass.cutlass_dsl import T

from kernels import compressor_kernel_ref as ck
from kernels import kvrecord_ref as rec
from kernels.compressor import (
    LANES,
    CompressorPublishSm90,
    _ld_f32_nc,
    flag_ge,
    key_latent,
    latent_store,
    pool_pair,
    rope_entry_pair,
)
from kernels.indexer_ptx import _addr, imin
from kernels.kv_publish import rstd_of, select_f32
from kernels.moe_ptx import (
    bulk_copy_g2s,
    lds_v2,
    mbar_arrive_expect_tx,
    mbar_init,
    mbar_init_fence,
    mbar_wait,
)
from kernels.ptx import (
    asm,
    bf16_pair,
    ld_s32,
    ld_v4_f32,
    lds_f32,
    shfl_xor_f32,
    st_f32,
    st_v4_f32,
    sts_f32,
    void,
)

E4M3_MANT = 0x600000
E4M3_TOP = 8
WK_BYTES = ck.INDEX_DIM * ck.HEAD_DIM * 2
WK_COPY = 8192                      # bytes per bulk copy of wk (16 copies)


def lds_v4_f32(saddr: Int32):
    v = asm(4, [Int32(saddr)], "ld.shared.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,r",
            kind=T.f32(), side_effects=True)
    return [Float32(x) for x in v]


def lds_bf16x4(saddr: Int32):
    w = lds_v2(saddr)
    a, b = bf16_pair(w[0])
    c, d = bf16_pair(w[1])
    return [a, b, c, d]


def mbar_arrive_expect_tx_reg(saddr: Int32, nbytes: Int32):
    """`mbar_arrive_expect_tx` with the byte count in a register."""
    void([Int32(saddr), Int32(nbytes)],
         "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", "r,r,~{memory}")


def ld_s32_or(addr: Int64, pred: Int32, fallback: int):
    """The s32 at addr where pred != 0, else `fallback` (no load): a predicated load, no branch."""
    return Int32(asm(1, [Int64(addr), Int32(pred)],
                     "{ .reg .pred p; setp.ne.s32 p, $2, 0; mov.b32 $0, " + str(fallback)
                     + ";\n@p ld.global.s32 $0, [$1]; }", "=r,l,r", side_effects=True))


class CompressorProjBulkSm90:
    """kv_score [R, 512 r] fp32 = x [R, D] bf16 @ W^T through a shared-memory ring (module doc)."""

    def __init__(self, spec: ck.CompressorSpec):
        self.spec = spec
        self.rt = ck.PROJ_BULK_ROW_TILES[spec.variant]         # rows a tile: 8 or 16
        self.real_only = spec.variant == "bulkr"                # copy the x rows < R only
        self.lay = ck.proj_bulk_layout(spec.ratio, spec.hidden, self.rt)
        self.wb = spec.weight_bytes_per_value

    @cute.jit
    def __call__(self, x: cute.Pointer, w: cute.Pointer, out: cute.Pointer, rows: Int32,
                 stream: cuda.CUstream):
        self.kernel(x, w, out, rows).launch(
            grid=[self.spec.out_cols // ck.PROJ_BULK_COLS, 1, 1], block=list(self.spec.block),
            smem=self.spec.smem_bytes, stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, x: cute.Pointer, w: cute.Pointer, out: cute.Pointer, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lay = self.lay
        smem = cutlass.memory.SmemAllocator()
        base = smem.allocate(self.spec.smem_bytes, byte_alignment=128).toint()
        bars = base + lay.bars_at
        col0 = bidx * ck.PROJ_BULK_COLS
        wrow = _addr(w) + Int64(col0) * (self.spec.hidden * self.wb)
        total = ((rows + self.rt - 1) // self.rt) * lay.stages
        if tidx == 0:
            for k in cutlass.range_constexpr(lay.slots):
                mbar_init(bars + 8 * k, 1)
            mbar_init_fence()
            # The weights never depend on an earlier kernel: in flight before the PDL wait.
            for k in cutlass.range_constexpr(lay.slots):
                if k < total:
                    self.expect(bars + 8 * k, Int32(k // lay.stages), rows)
                    self.copy_w(base + k * lay.slot_bytes, wrow, Int32(k % lay.stages),
                                bars + 8 * k)
        cute.arch.griddepcontrol_wait()        # x comes from the previous kernel
        if tidx == 0:
            for k in cutlass.range_constexpr(lay.slots):
                if k < total:
                    self.copy_x(base + k * lay.slot_bytes + lay.w_bytes, _addr(x),
                                Int32(k // lay.stages), Int32(k % lay.stages), rows,
                                bars + 8 * k)
        cute.arch.sync_threads()               # the barriers are initialised
        acc = cute.make_rmem_tensor((ck.PROJ_BULK_COLS, self.rt), Float32)
        tiles = total // lay.stages
        for tile in cutlass.range(tiles, unroll=1):
            acc.fill(0.0)
            for s in cutlass.range_constexpr(lay.stages):
                g = tile * lay.stages + s
                slot = g % lay.slots
                sb = base + slot * lay.slot_bytes
                mbar_wait(bars + 8 * slot, (g // lay.slots) % 2)
                self.stage_fma(acc, sb, tidx)
                cute.arch.sync_threads()       # every thread is done with the slot
                nxt = g + lay.slots
                if tidx == 0 and nxt < total:
                    self.expect(bars + 8 * slot, nxt // lay.stages, rows)
                    self.copy_w(sb, wrow, nxt % lay.stages, bars + 8 * slot)
                    self.copy_x(sb + lay.w_bytes, _addr(x), nxt // lay.stages,
                                nxt % lay.stages, rows, bars + 8 * slot)
            self.reduce_store(acc, base + lay.parts_at, _addr(out), tile, rows, col0, tidx)
        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def expect(self, bar: Int32, tile: Int32, rows: Int32):
        """Arrive on the slot's barrier announcing the bytes its copies of `tile` will bring."""
        if cutlass.const_expr(self.real_only):
            real = imin(rows - tile * self.rt, self.rt)
            mbar_arrive_expect_tx_reg(bar, self.lay.w_bytes + real * (self.lay.stage_k * 2))
        else:
            mbar_arrive_expect_tx(bar, self.lay.slot_bytes)

    @cute.jit
    def copy_w(self, dst: Int32, wrow: Int64, s: Int32, bar: Int32):
        """Dims [s stage_k, (s + 1) stage_k) of the CTA's 4 weight rows, one copy per row."""
        seg = self.lay.stage_k * self.wb
        for j in cutlass.range_constexpr(ck.PROJ_BULK_COLS):
            bulk_copy_g2s(dst + j * seg, wrow + Int64(j) * (self.spec.hidden * self.wb)
                          + Int64(s) * seg, seg, bar)

    @cute.jit
    def copy_x(self, dst: Int32, x: Int64, tile: Int32, s: Int32, rows: Int32, bar: Int32):
        """The same dims of rows tile * 8 .. + 7 (clamped to the last row), one copy per row."""
        seg = self.lay.stage_k * 2
        for i in cutlass.range_constexpr(self.rt):
            row = imin(tile * self.rt + i, rows - 1)
            if cutlass.const_expr(self.real_only):
                if tile * self.rt + i < rows:
                    bulk_copy_g2s(dst + i * seg, x + Int64(row) * (self.spec.hidden * 2)
                                  + Int64(s) * seg, seg, bar)
            else:
                bulk_copy_g2s(dst + i * seg, x + Int64(row) * (self.spec.hidden * 2)
                              + Int64(s) * seg, seg, bar)

    @cute.jit
    def stage_fma(self, acc, sb: Int32, tidx: Int32):
        """acc[j, i] += x[i, 4t..4t+3] . W[j, 4t..4t+3] over one slot, in dim order."""
        wv = []
        for j in cutlass.range_constexpr(ck.PROJ_BULK_COLS):
            if cutlass.const_expr(self.wb == 4):
                wv.append(lds_v4_f32(sb + j * (self.lay.stage_k * 4) + tidx * 16))
            else:
                wv.append(lds_bf16x4(sb + j * (self.lay.stage_k * 2) + tidx * 8))
        xs = sb + self.lay.w_bytes + tidx * 8
        for i in cutlass.range_constexpr(self.rt):
            xv = lds_bf16x4(xs + i * (self.lay.stage_k * 2))
            for j in cutlass.range_constexpr(ck.PROJ_BULK_COLS):
                a = acc[j, i]
                for k in cutlass.range_constexpr(4):
                    a = a + xv[k] * wv[j][k]
                acc[j, i] = a

    @cute.jit
    def reduce_store(self, acc, parts: Int32, out: Int64, tile: Int32, rows: Int32,
                     col0: Int32, tidx: Int32):
        """Warp butterfly per output, warp partials summed in warp order by threads 0..31."""
        lane, warp = tidx % LANES, tidx // LANES
        for j in cutlass.range_constexpr(ck.PROJ_BULK_COLS):
            for i in cutlass.range_constexpr(self.rt):
                a = acc[j, i]
                for k in cutlass.range_constexpr(5):
                    a = a + shfl_xor_f32(a, 16 >> k)
                if lane == 0:
                    sts_f32(parts + (warp * (ck.PROJ_BULK_COLS * self.rt) + j * self.rt + i)
                            * 4, a)
        cute.arch.sync_threads()
        if tidx < ck.PROJ_BULK_COLS * self.rt:
            v = lds_f32(parts + tidx * 4)
            for wi in cutlass.range_constexpr(1, self.lay.warps):
                v = v + lds_f32(parts + (wi * ck.PROJ_BULK_COLS * self.rt + tidx) * 4)
            row = tile * self.rt + tidx % self.rt
            if row < rows:
                st_f32(out + (Int64(row) * self.spec.out_cols + col0
                              + tidx // self.rt) * 4, v)


class CompressorPublishStagedSm90(CompressorPublishSm90):
    """The session-1 publish with wk in shared memory and the loads issued early (module doc)."""

    def grid(self, rows: Int32):
        """CTAs of a launch: min(R, 128), each doing rows b, b + grid, ..."""
        return cutlass.min(rows, ck.PUBLISH_STAGED_CTAS)

    @cute.kernel
    def kernel(self, kv_score: cute.Pointer, ring: cute.Pointer, positions: cute.Pointer,
               seq_index: cute.Pointer, state_lines: cute.Pointer, block_tables: cute.Pointer,
               norm_w: cute.Pointer, wk: cute.Pointer, k_norm: cute.Pointer,
               table: cute.Pointer, cache: cute.Pointer, keys: cute.Pointer, rows: Int32,
               pages_per_seq: Int32, page_size: Int32, num_positions: Int32, eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        smem = cutlass.memory.SmemAllocator()
        base = smem.allocate(self.spec.smem_bytes, byte_alignment=128).toint()
        bar = base + ck.PUBLISH_SMEM
        wks = base + ck.PUBLISH_STAGED_WK_AT
        if tidx == 0:                          # wk never depends on an earlier kernel
            mbar_init(bar, 1)
            mbar_init_fence()
            mbar_arrive_expect_tx(bar, WK_BYTES)
            for i in cutlass.range_constexpr(WK_BYTES // WK_COPY):
                bulk_copy_g2s(wks + i * WK_COPY, _addr(wk) + Int64(i * WK_COPY), WK_COPY, bar)
        cute.arch.sync_threads()               # the barrier is initialised
        cute.arch.griddepcontrol_wait()        # kv_score, positions and the tables come earlier
        row = bidx
        while row < rows:
            self.one_row(kv_score, ring, positions, seq_index, state_lines, block_tables,
                         norm_w, k_norm, table, cache, keys, rows, pages_per_seq, page_size,
                         num_positions, eps, base, bar, wks, row, tidx)
            row += gdim
        mbar_wait(bar, Int32(0))               # no bulk copy may land after the CTA exits
        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def one_row(self, kv_score: cute.Pointer, ring: cute.Pointer, positions: cute.Pointer,
                seq_index: cute.Pointer, state_lines: cute.Pointer, block_tables: cute.Pointer,
                norm_w: cute.Pointer, k_norm: cute.Pointer, table: cute.Pointer,
                cache: cute.Pointer, keys: cute.Pointer, rows: Int32, pages_per_seq: Int32,
                page_size: Int32, num_positions: Int32, eps: Float32, base: Int32, bar: Int32,
                wks: Int32, row: Int32, tidx: Int32):
        r = self.spec.ratio
        # Round trip 1: everything that depends on the row only. No branch before the loads of
        # round trips 2 and 3 (the compiler would sink them into it): their addresses are made
        # valid for padding rows instead, and only the stores depend on seq >= 0.
        seq = ld_s32(_addr(seq_index) + Int64(row) * 4)
        pos = ld_s32(_addr(positions) + Int64(row) * 4)
        prow = cutlass.max(row - 1, 0)
        pseq = ld_s32(_addr(seq_index) + Int64(prow) * 4)
        ppos = ld_s32(_addr(positions) + Int64(prow) * 4)
        src = _addr(kv_score) + Int64(row) * (ck.HEAD_DIM * r * 4) + Int64(tidx * 16)
        kv = ld_v4_f32(src)
        sc = kv
        kv_prev = kv
        sc_prev = kv
        if cutlass.const_expr(r == 2):
            sc = ld_v4_f32(src + ck.HEAD_DIM * 4)
            psrc = _addr(kv_score) + Int64(prow) * (ck.RING_WIDTH * 4) + Int64(tidx * 16)
            kv_prev = ld_v4_f32(psrc)
            sc_prev = ld_v4_f32(psrc + ck.HEAD_DIM * 4)
        nw = ld_v4_f32(_addr(norm_w) + Int64(tidx * 16))
        kn_w = _ld_f32_nc(_addr(k_norm) + Int64(tidx * 4))
        real = flag_ge(seq, 0)
        seq_c = cutlass.max(seq, 0)
        e = pos // r
        page_idx = e // page_size
        # Round trip 2: the page, the RoPE rows, the state line (they need seq / pos).
        in_table = Int32(0)
        if page_idx >= 0 and page_idx < pages_per_seq:
            in_table = real
        page = ld_s32_or(_addr(block_tables) + (Int64(seq_c) * pages_per_seq
                                                + Int64(in_table * page_idx)) * 4,
                         in_table, -1)
        epos = e * r
        valid = Int32(0)
        if epos >= 0 and epos < num_positions:
            valid = Int32(1)
        trow = _addr(table) + Int64(valid * epos) * (rec.ROPE_DIM * 4)
        pair = 2 * (tidx % 16)
        cs0 = self.cos_sin(trow, pair, valid)
        cs1 = self.cos_sin(trow, pair + 1, valid)
        cs_key = self.cos_sin(trow, (tidx % 64) // 2, valid)
        slot = Int64(page) * page_size + e % page_size
        publish = Int32(1)
        if cutlass.const_expr(r == 2):
            line = ld_s32_or(_addr(state_lines) + Int64(seq_c) * 4, real, 0)
            ring_line = _addr(ring) + Int64(line) * (ck.RING_ROWS * ck.RING_WIDTH * 4)
            # Round trip 3: the ring's partner row, used unless the partner is this launch's
            # previous row (the partner rule of the session-1 kernel; both loads are valid).
            same = Int32(0)
            if row > 0 and pseq == seq and ppos == pos - 1:
                same = Int32(1)
            prev = (ring_line + Int64((pos - 1) & (ck.RING_ROWS - 1)) * (ck.RING_WIDTH * 4)
                    + Int64(tidx * 16))
            kv_ring = ld_v4_f32(prev)
            sc_ring = ld_v4_f32(prev + ck.HEAD_DIM * 4)
            kv_prev = [select_f32(same, kv_prev[k], kv_ring[k]) for k in range(4)]
            sc_prev = [select_f32(same, sc_prev[k], sc_ring[k]) for k in range(4)]
            if real == 1:
                dst = (ring_line + Int64(pos % ck.RING_ROWS) * (ck.RING_WIDTH * 4)
                       + Int64(tidx * 16))
                st_v4_f32(dst, *kv)
                st_v4_f32(dst + ck.HEAD_DIM * 4, *sc)
            publish = pos % 2
            kv = pool_pair(kv_prev, sc_prev, kv, sc)
        if page < 0:
            publish = Int32(0)
        if real == 0:
            publish = Int32(0)
        if publish == 1:
            self.publish_staged(kv, nw, kn_w, cs0, cs1, cs_key,
                                _addr(cache) + slot * rec.KV_RECORD_BYTES,
                                _addr(keys) + slot * rec.INDEX_RECORD_BYTES, eps, base, bar,
                                wks, tidx)

    @cute.jit
    def publish_staged(self, x, w, kn_w: Float32, cs0, cs1, cs_key, entry: Int64, key: Int64,
                       eps: Float32, base: Int32, bar: Int32, wks: Int32, tidx: Int32):
        """`CompressorPublishSm90.publish` with its loads (norm_w, the RoPE rows) done already."""
        rstd = self.latent_rstd(x, eps, base, tidx)
        lat = latent_store(x, rstd, w, base, tidx)
        y = list(lat)
        for q in cutlass.range_constexpr(2):
            c, s = cs0 if q == 0 else cs1
            y[2 * q], y[2 * q + 1] = rope_entry_pair(lat[2 * q], lat[2 * q + 1], c, s, tidx)
        self.store_entry(y, entry, tidx)
        cute.arch.sync_threads()               # latent complete in shared memory
        mbar_wait(bar, Int32(0))               # wk has landed (long since, mostly)
        self.index_key_staged(wks, kn_w, cs_key, key, eps, base, tidx)

    @cute.jit
    def index_key_staged(self, wks: Int32, kn_w: Float32, cs_key, key: Int64, eps: Float32,
                         base: Int32, tidx: Int32):
        """`CompressorPublishSm90.index_key` on wk in shared memory (same order of operations:
        the dot products' loop is repeated for its loads; the rest is shared)."""
        lane = tidx % LANES
        warp = tidx // LANES
        lat = key_latent(base, lane)
        mine = Float32(0.0)
        for jj in cutlass.range(LANES, unroll=8):
            j = warp * LANES + jj
            wrow = wks + j * (ck.HEAD_DIM * 2) + lane * 32
            part = Float32(0.0)
            for v in cutlass.range_constexpr(4):
                wv = lds_bf16x4(wrow + 8 * v)
                for k in cutlass.range_constexpr(4):
                    part = part + lat[4 * v + k] * wv[k]
            for k in cutlass.range_constexpr(5):
                part = part + shfl_xor_f32(part, 16 >> k)
            if lane == jj:
                mine = part
        rstd = rstd_of(self.block_sum(mine * mine, base, tidx, 1), eps, ck.INDEX_DIM)
        kn = (mine * rstd) * kn_w
        other = shfl_xor_f32(kn, 1)
        c, s = cs_key
        self.store_key(kn, other, c, s, key, base, tidx)


CLASSES = {("proj", "bulk"): CompressorProjBulkSm90, ("proj", "bulk16"): CompressorProjBulkSm90,
           ("proj", "bulkr"): CompressorProjBulkSm90,
           ("publish", "staged"): CompressorPublishStagedSm90}
