"""Streamed W8A16 GEMV for R <= 8 (SM90, CuTe DSL): weights cp.async'ed to smem before the PDL wait.

Same arithmetic as `kernels/dense.py` (e4m3 -> exactly scaled bf16, mma.sync.m16n8k16, fp32
accumulation, the same K permutation and epilogues); what changes is how the weights arrive:
- Work: units = (16-row tile, unit_k slice of K) in tile-major order; exactly one wave of
  `ctas` <= 132 CTAs, CTA c owns units [U*c/C, U*(c+1)/C) (kernels/dense_ref.DenseSpec).
- Each thread copies exactly the 16-byte weight pieces it will multiply (rows g and g+8 of its
  64-byte chunks) with `cp.async.cg` into a ring of `stages` smem stages, one commit group per
  unit; `cp.async.wait_group(stages - 1)` before a unit, the refill right after it. A thread only
  reads its own pieces: no barrier, no mbarrier in the stream. When the CTA's slice fits the ring
  (every layer but Engram wkv and main_proj) the whole slice is requested before
  `griddepcontrol.wait`. (A first version fed the ring with one `cp.async.bulk` per weight row,
  512-1024 B each: those ran at ~1 copy per 80 cycles per SM, 13 B/clk, slower than registers.)
- Pieces sit chunk-major, [chunk][row half][lane] x 16 B: a warp's 16-byte reads are
  conflict-free. The CTA's scale window is loaded with plain loads before the wait, x of the next
  unit while the current one multiplies.
- A tile's warp partials meet in smem in warp order; a tile shared with other CTAs (at most the
  first and last of a CTA's range) goes through workspace slot (cta, first/last), summed in CTA
  order by the last contributor to arrive on the tile's counter, which resets it: deterministic.
Variants (DenseSpec.variant): "stream" is the round-3 kernel, unchanged. "stream_xt" keeps x
`x_slots - 1` units ahead in a register ring (x's L2 latency once per few units, not per unit),
alternates two accumulator sets where a warp owns one chunk per unit (half the dependent mma
chain), loads the scale bytes before the weights, and gives each CTA whole tiles: no tile is
shared, so no workspace, fence, atomic or last-arrival pass (balance: tiles over <= 132 CTAs
instead of units).
"stream_xts" loads the scale window by 4-byte cp.async in the oldest commit group (ptxas had
scheduled stream_xt's scale LDG behind the whole slice's LDGSTS, so the STS waited for it).
"stream_xtb" is stream_xts with the weights as stored: a CTA's tiles are contiguous (16 rows x K
each), so one thread fetches each with 16 / bulk_rows `cp.async.bulk` copies of whole rows
(<= 8 KB) counted on the tile's mbarrier, and a thread reads rows g and g+8 at its 16 bytes
(K % 128 == 0: a 16-byte read is 2-way bank conflicted, 8 wavefronts a warp instead of 4).
Timeline (DenseSpec.timeline, whole-tile variants): thread 0 of each CTA writes %smid and
(%globaltimer, %clock64) at dense_ref.TIMELINE_POINTS into the workspace (u64 [ctas, 32]): entry,
weights issued, before / after griddepcontrol.wait, first and last weight unit landed (the point
this thread's wait returned: xtb waits on every tile after the PDL wait), before the last tile's
epilogue stores, exit. Every stamp is behind `const_expr(self.timeline)`: without it not one
instruction of the kernel changes (the production cubins stay byte-identical).
Epilogues: those of kernels/dense.py; "swiglu" (stream_xt only) reads a tile's rows g / g+8 as a
gate / up pair with their own scale bytes (two runs of the smem scale window) and stores
bf16(SwiGLU(bf16(gate), bf16(up))); "add_f32" adds the f32 routed sum to bf16(y).

PTX ABI: that of the dense family (kernels/dense_ref.PARAMS); weight, scales, x, out 16-aligned.
"""
from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, Int64, Uint8, cute
from cutlass.cutlass_dsl import T

from kernels.dense import e4m3x4_to_bf16x2x2, ld_u8, prmt, round_bf16, scale_bf16x2
from kernels.dense_ref import (
    BULK_MBARRIERS,
    CHUNK_K,
    FP8_BLOCK,
    ROW_TILE,
    TILE_N,
    TIMELINE_POINTS,
    TIMELINE_WORDS,
    WARP,
    DenseSpec,
)
from kernels.moe_ptx import (
    bulk_copy_g2s,
    mbar_arrive_expect_tx,
    mbar_init,
    mbar_init_fence,
    mbar_wait,
    swiglu,
)
from kernels.ptx import (
    asm,
    cp_async_4,
    cp_async_16,
    cp_async_commit,
    cp_async_wait,
    ld_bf16,
    ld_f32,
    ld_f32_gpu,
    ld_v4_u32,
    lds_u8,
    lds_v4_u32,
    mma_bf16_16816_ordered,
    st_bf16,
    st_f32,
    void,
)

RED_THREADS = TILE_N * ROW_TILE          # one thread per accumulator of the 16 x 8 tile
CONSUMER_BARRIER = 1                     # named barrier of the CTA's warps
PIECE = 16                               # bytes per cp.async / ld.shared.v4
CHUNK_SMEM = 2 * WARP * PIECE            # one 64-byte chunk of 16 rows: [row half][lane] x 16 B


# ---- shared-memory helpers (cp.async and loads: kernels/ptx.py) ---------------------------------

def st_shared_u8(addr: Int32, value: Int32) -> None:
    void([addr, value], "st.shared.u8 [$0], $1;", "r,r")


def smem_addr(tensor) -> Int32:
    return Int32(tensor.iterator.toint())


# ---- timeline stamps (side effects: never merged, never moved across the kernel's other asm) ---

def globaltimer() -> Int64:
    return Int64(asm(1, [], "mov.u64 $0, %globaltimer;", "=l", kind=T.i64(), side_effects=True))


def clock64() -> Int64:
    return Int64(asm(1, [], "mov.u64 $0, %clock64;", "=l", kind=T.i64(), side_effects=True))


def smid() -> Int32:
    return Int32(asm(1, [], "mov.u32 $0, %smid;", "=r", side_effects=True))


def st_u64(addr: Int64, value: Int64) -> None:
    void([addr, value], "st.global.u64 [$0], $1;", "l,l")


def st_v2_u64(addr: Int64, a: Int64, b: Int64) -> None:
    void([addr, a, b], "st.global.v2.u64 [$0], {$1, $2};", "l,l,l")


# ---- kernel ------------------------------------------------------------------------------------

class DenseStreamSm90:
    """Kernel object for one DenseSpec with a streamed variant (dense_ref.STREAM_VARIANTS)."""

    def __init__(self, spec: DenseSpec):
        if not spec.streamed:
            raise ValueError(f"{spec.name}: DenseStreamSm90 needs a streamed variant, got "
                             f"{spec.variant!r}")
        self.spec = spec
        self.round3 = spec.variant == "stream"      # the kernel measured in round 3, unchanged
        self.whole_tiles, self.x_slots = spec.whole_tiles, spec.x_slots
        self.accs = spec.accumulators
        self.n, self.k, self.groups = spec.n, spec.k, spec.groups
        self.unit_k, self.ksteps, self.units = spec.unit_k, spec.ksteps, spec.units
        self.ctas, self.stages, self.stage_bytes = spec.ctas, spec.stages, spec.stage_bytes
        self.chunks = spec.chunks
        self.warps, self.consumers = spec.warps, spec.warps * WARP
        self.chunks_per_warp = -(-self.chunks // self.warps)
        self.window = -(-spec.scale_window() // 16) * 16
        # "swiglu": a tile's rows g / g+8 are gate / up rows (dense_ref.interleave_gate_up), with
        # scales in two runs: the gate rows' at smem 0, the up rows' at s_half (N/64 rows on).
        self.swiglu = spec.epilogue == "swiglu"
        self.s_half, self.tps = spec.scale_half(), spec.tiles_per_scale_row
        self.up_scale_rows = spec.n // 2 // FP8_BLOCK
        self.async_scales = spec.async_scales
        # stream_xtb: tile slot i = the CTA's i-th tile as stored (16 rows x K bytes), filled by
        # bulk copies of bulk_rows rows on mbarrier i (after the ring)
        self.bulk, self.bulk_rows = spec.bulk, spec.bulk_rows
        self.tile_bytes = TILE_N * spec.k
        self.row_stride = spec.row_stride                   # padded tile variants: K + ROW_PAD
        self.slot_bytes = TILE_N * spec.row_stride          # a tile's slot in the ring
        self.ring_bytes = spec.stages * spec.stage_bytes
        self.kg = spec.k // FP8_BLOCK
        self.timeline = spec.timeline
        self.tiles_per_group = spec.n // TILE_N

    @cute.jit
    def __call__(self, x: cute.Pointer, weight: cute.Pointer, scales: cute.Pointer,
                 residual: cute.Pointer, out: cute.Pointer, workspace: cute.Pointer,
                 counters: cute.Pointer, rows: Int32, stream):
        self.kernel(x, weight, scales, residual, out, workspace, counters, rows).launch(
            grid=[self.ctas, 1, 1], block=list(self.spec.block), stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, x: cute.Pointer, weight: cute.Pointer, scales: cute.Pointer,
               residual: cute.Pointer, out: cute.Pointer, workspace: cute.Pointer,
               counters: cute.Pointer, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp, lane = tidx // WARP, tidx % WARP
        g, t = lane // 4, lane % 4
        self._stamp(workspace, cta, tidx, "entry")
        u_begin, n_units = self._unit_range(cta)
        # Trigger at entry: the next kernel's CTAs start beside ours and stream their weights
        # (measured 1.2-2.9 us per launch faster in the PDL chain than triggering at exit).
        cute.arch.griddepcontrol_launch_dependents()

        smem = cutlass.memory.SmemAllocator()
        ring = smem.allocate_tensor(Uint8, cute.make_layout(
            self.ring_bytes + (8 * BULK_MBARRIERS if self.bulk else 0)), byte_alignment=128)
        sc = smem.allocate_tensor(Uint8, cute.make_layout(self.window), byte_alignment=16)
        red = smem.allocate_tensor(Float32, cute.make_layout((WARP, 4, self.warps)),
                                   byte_alignment=16)
        flag = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)
        ring_a, sc_a = smem_addr(ring), smem_addr(sc)
        w_row = weight.toint() + Int64(g) * self.k

        # Weights (constants: no wait), the whole ring deep, one commit group per unit. The scale
        # bytes: loaded after them (round 3) or before them (their latency then hides beneath).
        # stream_xts: the scale window by cp.async in the oldest commit group, so nothing between
        # issuing the weights and griddepcontrol.wait waits on a load that queued behind them.
        sbytes = cute.make_rmem_tensor((-(-self.window // self.consumers),), Int32)
        if cutlass.const_expr(self.async_scales):
            self._scale_copies(scales, sc_a, u_begin, n_units, tidx)
            cp_async_commit()
        elif cutlass.const_expr(not self.round3):
            self._scale_loads(sbytes, scales, u_begin, n_units, tidx)
        if cutlass.const_expr(self.bulk):
            if tidx == 0:
                self._bulk_issue(ring_a, weight, u_begin, n_units)
            self._stamp(workspace, cta, tidx, "issued")
            cp_async_wait(0)                      # the scale group has landed
        else:
            for s in cutlass.range_constexpr(self.stages):
                if s < n_units:
                    self._issue(ring_a, w_row, u_begin + s, s, warp, lane, t)
                cp_async_commit()
            self._stamp(workspace, cta, tidx, "issued")
        if cutlass.const_expr(self.async_scales):
            if cutlass.const_expr(not self.bulk):
                cp_async_wait(self.stages)        # the scale group (the oldest) has landed
        else:
            if cutlass.const_expr(self.round3):
                self._scale_loads(sbytes, scales, u_begin, n_units, tidx)
            self._scale_stores(sbytes, sc_a, u_begin, n_units, tidx)
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=self.consumers)
        self._stamp(workspace, cta, tidx, "before_wait")
        cute.arch.griddepcontrol_wait()          # x and residual come from earlier kernels
        self._stamp(workspace, cta, tidx, "after_wait")
        if cutlass.const_expr(self.bulk):         # every tile of the slice has landed
            for i in cutlass.range_constexpr(self.spec.tiles_per_cta):
                if i < n_units // self.ksteps:
                    mbar_wait(ring_a + self.ring_bytes + 8 * i, Int32(0))
                    if cutlass.const_expr(i == 0):
                        self._stamp(workspace, cta, tidx, "first_landed")
            self._stamp(workspace, cta, tidx, "last_landed")

        acc = cute.make_rmem_tensor((4, self.accs), Float32)
        acc.fill(0.0)
        xbuf = cute.make_rmem_tensor((8, self.chunks_per_warp, self.x_slots), Int32)
        row = cutlass.min(g, rows - 1)
        srow0 = u_begin // self.ksteps // self.tps
        if cutlass.const_expr(self.round3):
            self._round3_loop(acc, xbuf, x, w_row, out, residual, workspace, counters, rows,
                              flag, red, ring_a, sc_a, cta, u_begin, n_units, srow0, row, tidx,
                              warp, lane)
        elif cutlass.const_expr(self.spec.unrolled):   # stream_xtu: kernels/dense_tile.py
            self._tile_loop(acc, xbuf, x, w_row, out, residual, workspace, counters, rows,
                            flag, red, ring_a, sc_a, cta, u_begin, n_units, srow0, row, tidx,
                            warp, lane)
        else:
            self._x_ring_loop(acc, xbuf, x, w_row, out, residual, workspace, counters, rows,
                              flag, red, ring_a, sc_a, cta, u_begin, n_units, srow0, row, tidx,
                              warp, lane)
        self._stamp(workspace, cta, tidx, "exit")

    @cute.jit
    def _stamp(self, workspace: cute.Pointer, cta: Int32, tidx: Int32,
               point: cutlass.Constexpr):
        """Timeline only: thread 0 writes (%globaltimer, %clock64) at `point` (and %smid at
        entry) into the CTA's row of the workspace (dense_ref.TIMELINE_POINTS)."""
        # compile-time test, then the runtime one
        if cutlass.const_expr(self.timeline):  # noqa: SIM102
            if tidx == 0:
                p = TIMELINE_POINTS.index(point)
                row = workspace.toint() + Int64(cta) * (TIMELINE_WORDS * 8)
                now = globaltimer()
                st_v2_u64(row + Int64(16 * p), now, clock64())
                if cutlass.const_expr(point == "entry"):
                    st_u64(row + Int64(16 * len(TIMELINE_POINTS)), Int64(smid()))

    @cute.jit
    def _stamp_landed(self, workspace: cute.Pointer, cta: Int32, tidx: Int32, j: Int32,
                      n_units: Int32, slot: cutlass.Constexpr):
        """Timeline, cp.async ring: this thread's pieces of unit 0 / of the last unit landed
        (unit 0 is always in x slot 0: one copy of that stamp in the unrolled ring, not
        x_slots, which kept wq_b at 128 registers)."""
        if cutlass.const_expr(self.timeline):
            if cutlass.const_expr(slot == 0):  # noqa: SIM102 - compile-time, then runtime
                if j == 0:
                    self._stamp(workspace, cta, tidx, "first_landed")
            if j == n_units - 1:
                self._stamp(workspace, cta, tidx, "last_landed")

    @cute.jit
    def _round3_loop(self, acc, xbuf, x: cute.Pointer, w_row: Int64, out: cute.Pointer,
                     residual: cute.Pointer, workspace: cute.Pointer, counters: cute.Pointer,
                     rows: Int32, flag, red, ring_a: Int32, sc_a: Int32, cta: Int32,
                     u_begin: Int32, n_units: Int32, srow0: Int32, row: Int32, tidx: Int32,
                     warp: Int32, lane: Int32):
        """The units with x one unit ahead (two slots), as measured in round 3."""
        t = lane % 4
        self._load_x(xbuf, 0, x, u_begin, row, warp, t)
        j = Int32(0)
        while j < n_units:
            self._load_x(xbuf, 1, x, u_begin + cutlass.min(j + 1, n_units - 1), row, warp, t)
            self._unit(acc, xbuf, 0, j, w_row, out, residual, workspace, counters, rows, flag,
                       red, ring_a, sc_a, cta, u_begin, n_units, srow0, tidx, warp, lane)
            j += 1
            if j < n_units:
                self._load_x(xbuf, 0, x, u_begin + cutlass.min(j + 1, n_units - 1), row, warp,
                             t)
                self._unit(acc, xbuf, 1, j, w_row, out, residual, workspace, counters, rows,
                           flag, red, ring_a, sc_a, cta, u_begin, n_units, srow0, tidx, warp,
                           lane)
                j += 1


    @cute.jit
    def _unit_range(self, cta: Int32):
        """(first unit, unit count) of this CTA (dense_ref.DenseSpec.unit_range)."""
        if cutlass.const_expr(self.whole_tiles):
            t0 = self.spec.tiles * cta // self.ctas
            t1 = self.spec.tiles * (cta + 1) // self.ctas
            return t0 * self.ksteps, (t1 - t0) * self.ksteps
        u0 = self.units * cta // self.ctas
        return u0, self.units * (cta + 1) // self.ctas - u0

    @cute.jit
    def _x_ring_loop(self, acc, xbuf, x: cute.Pointer, w_row: Int64, out: cute.Pointer,
                     residual: cute.Pointer, workspace: cute.Pointer, counters: cute.Pointer,
                     rows: Int32, flag, red, ring_a: Int32, sc_a: Int32, cta: Int32,
                     u_begin: Int32, n_units: Int32, srow0: Int32, row: Int32, tidx: Int32,
                     warp: Int32, lane: Int32):
        """The units with x_slots - 1 units of x in flight (a register ring of x_slots units,
        unrolled x_slots times so every slot index is a constant): x's L2 latency is paid once
        per x_slots - 1 units instead of once per unit."""
        t, n_slots = lane % 4, self.x_slots
        for s in cutlass.range_constexpr(n_slots - 1):
            self._load_x(xbuf, s, x, u_begin + cutlass.min(s, n_units - 1), row, warp, t)
        j = Int32(0)
        while j < n_units:
            for s in cutlass.range_constexpr(n_slots):
                if j < n_units:
                    ahead = u_begin + cutlass.min(j + n_slots - 1, n_units - 1)
                    self._load_x(xbuf, (s + n_slots - 1) % n_slots, x, ahead, row, warp, t)
                    self._unit(acc, xbuf, s, j, w_row, out, residual, workspace, counters,
                               rows, flag, red, ring_a, sc_a, cta, u_begin, n_units, srow0,
                               tidx, warp, lane)
                    j += 1

    @cute.jit
    def _issue(self, ring_a: Int32, w_row: Int64, u: Int32, slot: Int32, warp: Int32,
               lane: Int32, t: Int32):
        """cp.async this thread's pieces of unit u (rows g, g+8 of its chunks) into `slot`."""
        tile = u // self.ksteps
        src = w_row + Int64(tile * TILE_N) * self.k + Int64((u % self.ksteps) * self.unit_k)
        stage = ring_a + slot * self.stage_bytes + lane * PIECE
        for cj in cutlass.range_constexpr(self.chunks_per_warp):
            ch = warp + self.warps * cj
            if ch < self.chunks:
                off, _ = self._chunk_k(warp, t, cj)
                cp_async_16(stage + ch * CHUNK_SMEM, src + Int64(off))
                cp_async_16(stage + ch * CHUNK_SMEM + WARP * PIECE, src + Int64(8 * self.k + off))

    @cute.jit
    def _scale_window(self, u_begin: Int32, n_units: Int32):
        """(first 32-row scale block, bytes) of the CTA's scale run (whole blocks; "swiglu": of
        its gate rows, the up rows' run is as long)."""
        srow0 = u_begin // self.ksteps // self.tps
        return srow0, ((u_begin + n_units - 1) // self.ksteps // self.tps - srow0 + 1) * self.kg

    @cute.jit
    def _scale_loads(self, sbytes, scales: cute.Pointer, u_begin: Int32, n_units: Int32,
                     tidx: Int32):
        """This thread's bytes of the CTA's scale window -> sbytes (loads only)."""
        srow0, win = self._scale_window(u_begin, n_units)
        s_src = scales.toint() + Int64(srow0 * self.kg)
        for j in cutlass.range_constexpr(cute.size(sbytes)):
            at = tidx + self.consumers * j
            end = win
            if cutlass.const_expr(self.swiglu):       # smem [s_half, ...) <- the up rows' run
                up = Int32(at >= self.s_half)
                shift = up * (self.up_scale_rows * self.kg)
                at = at - up * self.s_half + shift
                end = win + shift
            sbytes[j] = ld_u8(s_src + Int64(cutlass.min(at, end - 1)))

    @cute.jit
    def _bulk_issue(self, ring_a: Int32, weight: cute.Pointer, u_begin: Int32, n_units: Int32):
        """stream_xtb, one thread: per tile of the CTA, its mbarrier expects the tile's bytes,
        then 16 / bulk_rows cp.async.bulk copies of whole rows (the tile is contiguous)."""
        mbars = ring_a + self.ring_bytes
        for i in cutlass.range_constexpr(BULK_MBARRIERS):
            mbar_init(mbars + 8 * i, 1)
        mbar_init_fence()
        tile0, n_tiles = u_begin // self.ksteps, n_units // self.ksteps
        piece = self.bulk_rows * self.k
        for i in cutlass.range_constexpr(self.spec.tiles_per_cta):
            if i < n_tiles:
                mbar_arrive_expect_tx(mbars + 8 * i, self.tile_bytes)
                src = weight.toint() + Int64(tile0 + i) * self.tile_bytes
                for p in cutlass.range_constexpr(TILE_N // self.bulk_rows):
                    bulk_copy_g2s(ring_a + i * self.slot_bytes + p * self.bulk_rows
                                  * self.row_stride, src + Int64(p * piece), piece, mbars + 8 * i)

    @cute.jit
    def _scale_copies(self, scales: cute.Pointer, sc_a: Int32, u_begin: Int32, n_units: Int32,
                      tidx: Int32):
        """stream_xts: the CTA's scale run(s) -> smem by 4-byte cp.async (rows of K/32 bytes,
        a multiple of 4: make_spec), the same placement as _scale_loads + _scale_stores."""
        srow0, win = self._scale_window(u_begin, n_units)
        s_src = scales.toint() + Int64(srow0 * self.kg)
        for j in cutlass.range_constexpr(-(-self.window // (4 * self.consumers))):
            at = 4 * (tidx + self.consumers * j)
            src, used = at, at < win
            if cutlass.const_expr(self.swiglu):       # smem [s_half, ...) <- the up rows' run
                up = Int32(at >= self.s_half)
                src = at - up * self.s_half + up * (self.up_scale_rows * self.kg)
                used = (at < win) | ((at >= self.s_half) & (at - self.s_half < win))
            if used & (at < self.window):
                cp_async_4(sc_a + at, s_src + Int64(src))

    @cute.jit
    def _scale_stores(self, sbytes, sc_a: Int32, u_begin: Int32, n_units: Int32, tidx: Int32):
        """sbytes -> the smem scale window (the caller's barrier publishes it)."""
        _, win = self._scale_window(u_begin, n_units)
        for j in cutlass.range_constexpr(cute.size(sbytes)):
            at = tidx + self.consumers * j
            used = at < win
            if cutlass.const_expr(self.swiglu):
                used = (at < win) | ((at >= self.s_half) & (at - self.s_half < win))
            if used & (at < self.window):
                st_shared_u8(sc_a + at, sbytes[j])

    @cute.jit
    def _chunk_k(self, warp: Int32, t: Int32, cj: cutlass.Constexpr):
        """(offset of this thread's 16 bytes inside the unit, clamped; valid)."""
        off = (warp + self.warps * cj) * CHUNK_K + 16 * t
        return cutlass.min(off, self.unit_k - 16), off < self.unit_k

    @cute.jit
    def _load_x(self, xbuf, slot: cutlass.Constexpr, x: cute.Pointer, u: Int32, row: Int32,
                warp: Int32, t: Int32):
        """x[row, the K of this thread's chunks of unit u] -> xbuf[:, :, slot] (16 B twice)."""
        tile = u // self.ksteps
        grp = tile // self.tiles_per_group
        k0 = (u % self.ksteps) * self.unit_k
        base = x.toint() + Int64((row * self.groups * self.k + grp * self.k + k0) * 2)
        for cj in cutlass.range_constexpr(self.chunks_per_warp):
            off, _ = self._chunk_k(warp, t, cj)
            xw = ld_v4_u32(base + Int64(off * 2)) + ld_v4_u32(base + Int64(off * 2 + 16))
            for w in cutlass.range_constexpr(8):
                xbuf[w, cj, slot] = xw[w]

    @cute.jit
    def _unit(self, acc, xbuf, slot: cutlass.Constexpr, j: Int32, w_row: Int64,
              out: cute.Pointer, residual: cute.Pointer, workspace: cute.Pointer,
              counters: cute.Pointer, rows: Int32, flag, red, ring_a: Int32, sc_a: Int32,
              cta: Int32, u_begin: Int32, n_units: Int32, srow0: Int32, tidx: Int32,
              warp: Int32, lane: Int32):
        """acc += this warp's chunks of unit j; refill the stage; finish the tile at its end."""
        t = lane % 4
        u = u_begin + j
        tile, kstep = u // self.ksteps, u % self.ksteps
        i = j % self.stages
        stage = ring_a + i * self.stage_bytes + lane * PIECE
        if cutlass.const_expr(self.bulk):         # tile slot j // ksteps, rows as stored
            stage = (ring_a + (j // self.ksteps) * self.tile_bytes + (lane // 4) * self.k
                     + kstep * self.unit_k)
        else:
            cp_async_wait(self.stages - 1)       # this thread's pieces of unit j have landed
            self._stamp_landed(workspace, cta, tidx, j, n_units, slot)
        s_row = sc_a + (tile // self.tps - srow0) * self.kg + kstep * (self.unit_k // FP8_BLOCK)
        for cj in cutlass.range_constexpr(self.chunks_per_warp):
            ch = warp + self.warps * cj
            off, valid = self._chunk_k(warp, t, cj)
            if ch < self.chunks:
                a_lo = stage + ch * CHUNK_SMEM       # [chunk][row half][lane] x 16 B
                a_hi = a_lo + WARP * PIECE
                if cutlass.const_expr(self.bulk):  # rows g and g+8 as stored, at its 16 bytes
                    a_lo = stage + off
                    a_hi = stage + 8 * self.k + off
                lo = lds_v4_u32(a_lo)
                hi = lds_v4_u32(a_hi)
                scale2 = scale_bf16x2(lds_u8(s_row + off // FP8_BLOCK), valid)
                scale_hi = scale2                      # rows g and g+8 share a scale block ...
                if cutlass.const_expr(self.swiglu):    # ... but for a gate / up pair
                    scale_hi = scale_bf16x2(lds_u8(s_row + self.s_half + off // FP8_BLOCK),
                                            valid)
                for jj in cutlass.range_constexpr(4):
                    ae0, ao0 = e4m3x4_to_bf16x2x2(lo[jj], scale2)
                    ae1, ao1 = e4m3x4_to_bf16x2x2(hi[jj], scale_hi)
                    b = (prmt(xbuf[2 * jj, cj, slot], xbuf[2 * jj + 1, cj, slot], 0x5410),
                         prmt(xbuf[2 * jj, cj, slot], xbuf[2 * jj + 1, cj, slot], 0x7632))
                    a = jj % self.accs            # 2 sets: two independent mma chains
                    d = mma_bf16_16816_ordered((ae0, ae1, ao0, ao1), b,
                                               [acc[q, a] for q in range(4)])
                    for q in cutlass.range_constexpr(4):
                        acc[q, a] = d[q]
        if cutlass.const_expr(not self.bulk):
            if j + self.stages < n_units:         # the slot is free: this thread read it all
                self._issue(ring_a, w_row, u + self.stages, i, warp, lane, t)
            cp_async_commit()
        if (kstep == self.ksteps - 1) | (j == n_units - 1):
            self._finish_tile(acc, tile, out, residual, workspace, counters, rows, flag, red,
                              cta, tidx, warp, lane)
            acc.fill(0.0)

    @cute.jit
    def _finish_tile(self, acc, tile: Int32, out: cute.Pointer, residual: cute.Pointer,
                     workspace: cute.Pointer, counters: cute.Pointer, rows: Int32, flag, red,
                     cta: Int32, tidx: Int32, warp: Int32, lane: Int32):
        """Warp partials (warp order) -> output, or -> workspace + last contributor sums."""
        for q in cutlass.range_constexpr(4):
            part = acc[q, 0]
            for a in cutlass.range_constexpr(1, self.accs):
                part = part + acc[q, a]
            red[lane, q, warp] = part
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=self.consumers)
        q, ln = tidx // WARP, tidx % WARP
        total = Float32(0.0)
        if tidx < RED_THREADS:
            total = red[ln, q, 0]
            for w in cutlass.range_constexpr(1, self.warps):
                total = total + red[ln, q, w]
        up = Float32(0.0)
        # accumulator q + 2 is q's up row (g + 8); compile-time test, then the runtime one
        if cutlass.const_expr(self.swiglu):  # noqa: SIM102
            if tidx < RED_THREADS // 2:
                up = red[ln, q + 2, 0]
                for w in cutlass.range_constexpr(1, self.warps):
                    up = up + red[ln, q + 2, w]
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=self.consumers)
        self._stamp(workspace, cta, tidx, "epilogue")   # each tile's: the last one stays
        if cutlass.const_expr(self.swiglu):       # whole tiles (make_spec): no workspace
            if tidx < RED_THREADS // 2:
                self._swiglu_epilogue(total, up, q, ln, tile, rows, out)
        elif cutlass.const_expr(self.whole_tiles):  # the CTA owns the tile: no workspace
            if tidx < RED_THREADS:
                self._epilogue(total, q, ln, tile, rows, residual, out)
        else:
            self._combine_shared(total, q, ln, tile, out, residual, workspace, counters, rows,
                                 flag, cta, tidx)

    @cute.jit
    def _combine_shared(self, total: Float32, q: Int32, ln: Int32, tile: Int32,
                        out: cute.Pointer, residual: cute.Pointer, workspace: cute.Pointer,
                        counters: cute.Pointer, rows: Int32, flag, cta: Int32, tidx: Int32):
        """A tile other CTAs share: workspace slot, counter, the last arrival sums in CTA order."""
        first_unit = tile * self.ksteps
        c_lo = ((first_unit + 1) * self.ctas - 1) // self.units
        c_hi = ((first_unit + self.ksteps) * self.ctas - 1) // self.units
        if c_lo == c_hi:
            if tidx < RED_THREADS:
                self._epilogue(total, q, ln, tile, rows, residual, out)
        else:
            ws = workspace.toint()
            side = Int32(tile != (self.units * cta // self.ctas) // self.ksteps)
            if tidx < RED_THREADS:
                st_f32(ws + Int64(((2 * cta + side) * RED_THREADS + tidx) * 4), total)
            # Round 3: every thread fences. Else one thread does, ordered with the others by the
            # CTA barrier (the cooperative-groups grid-sync pattern): one ERRBAR + L1
            # invalidation per CTA instead of 256 (the reads below bypass L1 anyway).
            if cutlass.const_expr(self.round3):
                cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=self.consumers)
            counter = counters + tile
            if tidx == 0:
                if cutlass.const_expr(not self.round3):
                    cute.arch.fence_acq_rel_gpu()     # release the CTA's partials
                old = cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu")
                if cutlass.const_expr(not self.round3):
                    cute.arch.fence_acq_rel_gpu()     # acquire the others' for the CTA
                flag[0] = Int32(old == c_hi - c_lo)
            cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=self.consumers)
            if flag[0] != 0:
                if cutlass.const_expr(self.round3):
                    cute.arch.fence_acq_rel_gpu()
                if tidx < RED_THREADS:
                    total = Float32(0.0)
                    c = c_lo
                    while c <= c_hi:                  # CTA order: the same bits every launch
                        c_side = Int32(tile != (self.units * c // self.ctas) // self.ksteps)
                        slot = (2 * c + c_side) * RED_THREADS + tidx
                        total = total + ld_f32_gpu(ws + Int64(slot * 4))
                        c += 1
                    self._epilogue(total, q, ln, tile, rows, residual, out)
                if tidx == 0:
                    cute.arch.store(counter.llvm_ptr, Int32(0), sem="relaxed", scope="gpu")
            cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=self.consumers)

    @cute.jit
    def _epilogue(self, total: Float32, q: Int32, ln: Int32, tile: Int32, rows: Int32,
                  residual: cute.Pointer, out: cute.Pointer):
        """Accumulator q of lane ln is y[row 2*(ln%4) + q%2, column tile*16 + ln/4 + 8*(q/2)]."""
        n = tile * TILE_N + ln // 4 + 8 * (q // 2)
        r = 2 * (ln % 4) + q % 2
        if r < rows:
            idx = Int64(r * self.groups * self.n + n)
            if cutlass.const_expr(self.spec.epilogue == "f32"):
                st_f32(out.toint() + idx * 4, total)
            elif cutlass.const_expr(self.spec.epilogue == "residual"):
                res = ld_bf16(residual.toint() + idx * 2)
                st_bf16(out.toint() + idx * 2, total + res)
            elif cutlass.const_expr(self.spec.epilogue == "add_f32"):
                routed = ld_f32(residual.toint() + idx * 4)
                st_bf16(out.toint() + idx * 2, round_bf16(total) + routed)
            else:
                st_bf16(out.toint() + idx * 2, total)

    @cute.jit
    def _swiglu_epilogue(self, gate: Float32, up: Float32, q: Int32, ln: Int32, tile: Int32,
                         rows: Int32, out: cute.Pointer):
        """Gate (accumulator q < 2) and up (q + 2) of output column tile*8 + ln/4, row
        2*(ln%4) + q: h = bf16(SwiGLU(bf16(gate), bf16(up))), moe_ref.shared_expert's roundings."""
        j = tile * (TILE_N // 2) + ln // 4
        r = 2 * (ln % 4) + q
        if r < rows:
            h = swiglu(round_bf16(gate), round_bf16(up), self.spec.swiglu_limit)
            st_bf16(out.toint() + Int64(r * (self.n // 2) + j) * 2, h)
