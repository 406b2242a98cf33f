"""Streamed W8A16 GEMV, variant "stream_xtu": stream_xtb with each tile's chunks unrolled (SM90).

Why (docs/notes/dense-design.md, round 7): after griddepcontrol.wait the streamed kernels are
issue-bound. A unit of stream_xtb costs ~95 SASS instructions per 64-K chunk a warp owns plus
~100 per unit (the unit's tile / K-step / stage / scale-row arithmetic, the x ring slot, the
runtime tile-end test that also ends the basic block), and the 2 warps per SM sub-partition issue
at ~60% of the cycles: ~320 cycles per chunk + ~330 per unit, which is what the timeline measured.
This variant keeps stream_xtb's prologue (bulk copies of whole tiles on one mbarrier per tile,
scales by cp.async, everything requested before the PDL wait) and changes the multiply only:
- one unit per tile (unit_k = K); the tiles of the CTA and the chunks of a tile are unrolled at
  compile time, so every smem offset is an immediate and the chunks of a tile are one basic block
  (ptxas interleaves one chunk's conversion with the previous chunk's mma chain);
- x: with one group and K <= 2048 (X_RESIDENT_WORDS) the warp's B fragments of the whole K are
  loaded once per CTA, permuted once, and reused by every tile (wq_b: 4 tiles, wo_b: 3); else
  x runs X_AHEAD chunks ahead inside the tile (one L2 round trip after the wait, then hidden);
- each tile's scale words (bf16x2 2^(s-7)) are formed at the tile's start;
- two accumulator sets alternate over the mma steps (half the dependent HMMA chain).
The arithmetic is kernels/dense.py's (exact e4m3 -> bf16 times the block scale, fp32 mma,
the same K permutation); only the order of the fp32 sums differs (two accumulators, summed at
the tile end), which the reference's fp32 bound covers. Epilogues: bf16, f32, residual and
swiglu (rows g / g+8 a gate / up pair with their own scale rows, as in stream_xt).
"""
from __future__ import annotations

import cutlass
from cutlass import Int32, Int64, cute

from kernels.dense import e4m3x4_to_bf16x2x2, prmt, scale_bf16x2
from kernels.dense_ref import CHUNK_K, FP8_BLOCK, TILE_N, TILE_VARIANTS, DenseSpec
from kernels.dense_stream import DenseStreamSm90
from kernels.ptx import ld_v4_u32, lds_u8, lds_v4_u32, mma_bf16_16816_ordered


class DenseTileSm90(DenseStreamSm90):
    """Kernel object for a "stream_xtu" DenseSpec: DenseStreamSm90's prologue, `_tile_loop`."""

    def __init__(self, spec: DenseSpec):
        if not spec.unrolled:
            raise ValueError(f"{spec.name}: DenseTileSm90 needs one of the tile variants "
                             f"{TILE_VARIANTS}, got {spec.variant!r}")
        if spec.epilogue not in ("bf16", "f32", "residual", "swiglu"):
            raise ValueError(f"{spec.name}: the tile variants have the bf16 / f32 / residual / "
                             f"swiglu epilogues, got {spec.epilogue!r}")
        super().__init__(spec)
        self.k_chunks = spec.k // CHUNK_K                    # 64-K chunks of a tile
        self.full_chunks = self.k_chunks // self.warps     # chunks every warp owns
        self.resident, self.x_ahead = spec.x_resident, spec.x_ahead

    @cute.jit
    def _tile_loop(self, acc, xbuf, x: cute.Pointer, w_row: Int64, out: cute.Pointer,
                   residual: cute.Pointer, workspace: cute.Pointer, counters: cute.Pointer,
                   rows: Int32, flag, red, ring_a: Int32, sc_a: Int32, cta: Int32,
                   u_begin: Int32, n_units: Int32, srow0: Int32, row: Int32, tidx: Int32,
                   warp: Int32, lane: Int32):
        """The CTA's tiles (one unit each), their chunks unrolled; x resident or X_AHEAD ahead."""
        t = lane % 4
        xr = cute.make_rmem_tensor((8, self.chunks_per_warp), Int32)    # x words of chunk cj
        if cutlass.const_expr(self.resident):    # x is the same for every tile: B fragments once
            for cj in cutlass.range_constexpr(self.chunks_per_warp):
                self._load_x_chunk(xr, cj, x, u_begin, row, warp, t)
            self._permute_resident(xr)
        self._tiles(acc, xr, x, out, residual, workspace, counters, rows, flag, red, ring_a,
                    sc_a, cta, u_begin, n_units, srow0, row, tidx, warp, lane)

    @cute.jit
    def _permute_resident(self, xr):
        """Resident x words (element pairs 2w, 2w + 1) -> B fragments, once per CTA."""
        for cj in cutlass.range_constexpr(self.chunks_per_warp):
            for jj in cutlass.range_constexpr(4):
                lo_x, hi_x = xr[2 * jj, cj], xr[2 * jj + 1, cj]
                xr[2 * jj, cj] = prmt(lo_x, hi_x, 0x5410)
                xr[2 * jj + 1, cj] = prmt(lo_x, hi_x, 0x7632)

    @cute.jit
    def _tiles(self, acc, xr, x: cute.Pointer, out: cute.Pointer, residual: cute.Pointer,
               workspace: cute.Pointer, counters: cute.Pointer, rows: Int32, flag, red,
               ring_a: Int32, sc_a: Int32, cta: Int32, u_begin: Int32, n_units: Int32,
               srow0: Int32, row: Int32, tidx: Int32, warp: Int32, lane: Int32):
        """The CTA's tiles over xr (resident B fragments, or x loaded X_AHEAD chunks ahead)."""
        g, t = lane // 4, lane % 4
        cpw = self.chunks_per_warp
        for i in cutlass.range_constexpr(self.spec.tiles_per_cta):
            if i < n_units:                                   # one unit per tile
                tile = u_begin + i
                if cutlass.const_expr(not self.resident):
                    for cj in cutlass.range_constexpr(min(self.x_ahead, cpw)):
                        self._load_x_chunk(xr, cj, x, tile, row, warp, t)
                # rows g and g + 8 of tile slot i as stored (bulk copies), this thread's 16 B
                a_row = (ring_a + i * self.slot_bytes + g * self.row_stride + warp * CHUNK_K
                         + 16 * t)
                s_row = sc_a + (tile // self.tps - srow0) * self.kg
                # scale words of rows g (and g + 8: the same block, but an up row's with swiglu)
                sw = cute.make_rmem_tensor((2, cpw), Int32)
                for cj in cutlass.range_constexpr(cpw):
                    ch = cutlass.min(warp + self.warps * cj, self.k_chunks - 1)
                    at = s_row + ch * (CHUNK_K // FP8_BLOCK) + t // 2
                    sw[0, cj] = scale_bf16x2(lds_u8(at), True)
                    sw[1, cj] = sw[0, cj]
                    if cutlass.const_expr(self.swiglu):
                        sw[1, cj] = scale_bf16x2(lds_u8(at + self.s_half), True)
                acc.fill(0.0)
                for cj in cutlass.range_constexpr(cpw):
                    if cutlass.const_expr(not self.resident and cj + self.x_ahead < cpw):
                        self._load_x_chunk(xr, cj + self.x_ahead, x, tile, row, warp, t)
                    if cutlass.const_expr(cj < self.full_chunks):
                        self._chunk(acc, xr, cj, sw[0, cj], sw[1, cj], a_row)
                    else:                                     # the last chunk: some warps only
                        if warp + self.warps * cj < self.k_chunks:
                            self._chunk(acc, xr, cj, sw[0, cj], sw[1, cj], a_row)
                self._finish_tile(acc, tile, out, residual, workspace, counters, rows, flag,
                                  red, cta, tidx, warp, lane)

    @cute.jit
    def _load_x_chunk(self, xr, cj: cutlass.Constexpr, x: cute.Pointer, tile: Int32, row: Int32,
                      warp: Int32, t: Int32):
        """x[row, the 16 K of this thread in chunk cj] -> xr[:, cj] (two 16-byte loads; a warp
        without chunk cj reads the last chunk, unused)."""
        ch = cutlass.min(warp + self.warps * cj, self.k_chunks - 1)
        grp = tile // self.tiles_per_group
        base = x.toint() + Int64((row * self.groups * self.k + grp * self.k + ch * CHUNK_K
                                  + 16 * t) * 2)
        xw = ld_v4_u32(base) + ld_v4_u32(base + Int64(16))
        for w in cutlass.range_constexpr(8):
            xr[w, cj] = xw[w]
        # ptxas sinks these loads to their first use (one L2 round trip per chunk, measured in
        # the SASS); a load cannot move past a warp barrier, which orders memory.
        cute.arch.sync_warp()

    @cute.jit
    def _chunk(self, acc, xr, cj: cutlass.Constexpr, scale2: Int32, scale_hi: Int32,
               a_row: Int32):
        """acc += rows g / g+8 of this warp's chunk cj times x: 4 mma steps, alternating sets.
        a_row: row g of the tile slot at this warp's first chunk and this thread's 16 bytes."""
        off = self.warps * CHUNK_K * cj                   # an immediate offset
        lo = lds_v4_u32(a_row + off)
        hi = lds_v4_u32(a_row + (TILE_N // 2) * self.row_stride + off)
        for jj in cutlass.range_constexpr(4):
            ae0, ao0 = e4m3x4_to_bf16x2x2(lo[jj], scale2)
            ae1, ao1 = e4m3x4_to_bf16x2x2(hi[jj], scale_hi)
            b = (xr[2 * jj, cj], xr[2 * jj + 1, cj])       # resident: permuted at load
            if cutlass.const_expr(not self.resident):
                b = (prmt(xr[2 * jj, cj], xr[2 * jj + 1, cj], 0x5410),
                     prmt(xr[2 * jj, cj], xr[2 * jj + 1, cj], 0x7632))
            a = jj % self.accs
            d = mma_bf16_16816_ordered((ae0, ae1, ao0, ao1), b, [acc[q, a] for q in range(4)])
            for q in cutlass.range_constexpr(4):
                acc[q, a] = d[q]
