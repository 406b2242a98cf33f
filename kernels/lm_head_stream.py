"""Streamed BF16 lm_head for R <= 8 (SM90, CuTe DSL): a cp.async smem ring, fused argmax.

Same arithmetic and argmax keys as `kernels/lm_head.py`; the weights arrive as in
`kernels/dense_stream.py`:
- One wave of `ctas` <= 132 CTAs; CTA c owns WHOLE vocab tiles [T*c/C, T*(c+1)/C), each tile
  streamed as `ksteps` units of 16 rows x unit_k hidden values into a ring of `stages` smem
  stages (~150 KB in flight per SM): every thread cp.async's exactly the 16-byte pieces it
  multiplies, one commit group per unit, so the stream needs no barrier.
- 8 warps split each unit's 32-value chunks (x of the next unit loaded while the
  current one multiplies); at a tile's end the warp partials meet in smem in warp order. Every
  tile takes this same path and order, so equal vocab rows give bit-equal logits (real ties).
- logits: fp32 stores. argmax: each of the 128 accumulator threads keeps a running max of its
  keys (ordered value << 32 | ~index) over the CTA's tiles; at the end a butterfly over the
  8 lanes of a row, the two warp halves in smem, one `red.max.u64` per row and CTA, and the last
  CTA to arrive decodes and resets keys and counter (as kernels/lm_head.py).

PTX ABI: (u64 x, u64 weight, u64 out, u64 keys, u64 counters, u32 rows, u32 vocab_offset).
"""
from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, Int64, Uint8, cute

from kernels.dense_stream import CHUNK_SMEM, PIECE, smem_addr
from kernels.lm_head import (
    argmax_key,
    decode_key,
    key_max,
    key_max_bfly,
    ld_u64_gpu,
    red_max_u64,
    st_u64,
)
from kernels.lm_head_ref import CHUNK_K, ROW_TILE, STREAM_WARPS, TILE_N, WARP, LmHeadSpec
from kernels.ptx import (
    cp_async_16,
    cp_async_commit,
    cp_async_wait,
    ld_v4_u32,
    lds_v4_u32,
    mma_bf16_16816_ordered,
    st_f32,
    st_v2_b32,
)

CONSUMERS = STREAM_WARPS * WARP          # every thread of the CTA
RED_THREADS = TILE_N * ROW_TILE
CONSUMER_BARRIER = 1


class LmHeadStreamSm90:
    """Kernel object for one LmHeadSpec with variant "stream"."""

    def __init__(self, spec: LmHeadSpec):
        if spec.variant != "stream":
            raise ValueError(f"{spec.name}: LmHeadStreamSm90 needs variant 'stream'")
        self.spec = spec
        self.hidden, self.unit_k, self.ksteps = spec.hidden, spec.unit_k, spec.ksteps
        self.tiles, self.ctas, self.stages = spec.tiles, spec.ctas, spec.stages
        self.stage_bytes, self.chunks = spec.stage_bytes, spec.chunks
        self.chunks_per_warp = -(-self.chunks // STREAM_WARPS)
        self.row_bytes = spec.hidden * 2

    @cute.jit
    def __call__(self, x: cute.Pointer, weight: cute.Pointer, out: cute.Pointer,
                 keys: cute.Pointer, counters: cute.Pointer, rows: Int32, vocab_offset: Int32,
                 stream):
        self.kernel(x, weight, out, keys, counters, rows, vocab_offset).launch(
            grid=[self.ctas, 1, 1], block=list(self.spec.block), stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, x: cute.Pointer, weight: cute.Pointer, out: cute.Pointer,
               keys: cute.Pointer, counters: cute.Pointer, rows: Int32, vocab_offset: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp, lane = tidx // WARP, tidx % WARP
        g, t = lane // 4, lane % 4
        t_begin = self.tiles * cta // self.ctas
        u_begin = t_begin * self.ksteps
        n_units = (self.tiles * (cta + 1) // self.ctas - t_begin) * self.ksteps

        smem = cutlass.memory.SmemAllocator()
        ring = smem.allocate_tensor(Uint8, cute.make_layout(self.stages * self.stage_bytes),
                                    byte_alignment=128)
        red = smem.allocate_tensor(Float32, cute.make_layout((WARP, 4, STREAM_WARPS)),
                                   byte_alignment=16)
        cta_best = smem.allocate_tensor(Int64, cute.make_layout((ROW_TILE, 2)),
                                        byte_alignment=16)
        flag = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)
        ring_a = smem_addr(ring)
        w_row = weight.toint() + Int64(g * self.row_bytes)

        for s in cutlass.range_constexpr(self.stages):      # before the PDL wait
            if s < n_units:
                self._issue(ring_a, w_row, u_begin + s, s, warp, lane, t)
            cp_async_commit()
        cute.arch.griddepcontrol_wait()                      # x is the final norm's output

        acc = cute.make_rmem_tensor((4,), Float32)
        acc.fill(0.0)
        best = cute.make_rmem_tensor((1,), Int64)
        best.fill(0)
        xbuf = cute.make_rmem_tensor((4, self.chunks_per_warp, 2), Int32)
        x_row = x.toint() + Int64(cutlass.min(g, rows - 1) * self.row_bytes)
        self._load_x(xbuf, 0, x_row, u_begin, warp, t)
        j = Int32(0)
        while j < n_units:
            self._load_x(xbuf, 1, x_row, u_begin + cutlass.min(j + 1, n_units - 1), warp, t)
            self._unit(acc, best, xbuf, 0, j, w_row, out, rows, red, ring_a, u_begin, n_units,
                       tidx, warp, lane)
            j += 1
            if j < n_units:
                self._load_x(xbuf, 0, x_row, u_begin + cutlass.min(j + 1, n_units - 1), warp, t)
                self._unit(acc, best, xbuf, 1, j, w_row, out, rows, red, ring_a, u_begin,
                           n_units, tidx, warp, lane)
                j += 1
        if cutlass.const_expr(self.spec.mode == "argmax"):
            self._publish(best, cta_best, flag, keys, counters, out, rows, vocab_offset, tidx,
                          warp, lane)
        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def _issue(self, ring_a: Int32, w_row: Int64, u: Int32, slot: Int32, warp: Int32,
               lane: Int32, t: Int32):
        """cp.async this thread's pieces of unit u (vocab rows g, g+8 of its chunks)."""
        src = (w_row + Int64((u // self.ksteps) * TILE_N) * self.row_bytes
               + Int64((u % self.ksteps) * self.unit_k * 2 + 16 * t))
        stage = ring_a + slot * self.stage_bytes + lane * PIECE
        for cj in cutlass.range_constexpr(self.chunks_per_warp):
            ch = warp + STREAM_WARPS * cj
            if ch < self.chunks:
                cp_async_16(stage + ch * CHUNK_SMEM, src + Int64(ch * CHUNK_K * 2))
                cp_async_16(stage + ch * CHUNK_SMEM + WARP * PIECE,
                            src + Int64(8 * self.row_bytes + ch * CHUNK_K * 2))

    @cute.jit
    def _load_x(self, xbuf, slot: cutlass.Constexpr, x_row: Int64, u: Int32, warp: Int32,
                t: Int32):
        """x[row g, this thread's 8 hidden values of each of its chunks of unit u]."""
        base = x_row + Int64((u % self.ksteps) * self.unit_k * 2)
        for cj in cutlass.range_constexpr(self.chunks_per_warp):
            ch = cutlass.min(warp + STREAM_WARPS * cj, self.chunks - 1)
            xw = ld_v4_u32(base + Int64(ch * CHUNK_K * 2 + 16 * t))
            for w in cutlass.range_constexpr(4):
                xbuf[w, cj, slot] = xw[w]

    @cute.jit
    def _unit(self, acc, best, xbuf, slot: cutlass.Constexpr, j: Int32, w_row: Int64,
              out: cute.Pointer, rows: Int32, red, ring_a: Int32, u_begin: Int32,
              n_units: Int32, tidx: Int32, warp: Int32, lane: Int32):
        t = lane % 4
        u = u_begin + j
        i = j % self.stages
        cp_async_wait(self.stages - 1)
        stage = ring_a + i * self.stage_bytes + lane * PIECE
        for cj in cutlass.range_constexpr(self.chunks_per_warp):
            ch = warp + STREAM_WARPS * cj
            if ch < self.chunks:
                wa = lds_v4_u32(stage + ch * CHUNK_SMEM)
                wb = lds_v4_u32(stage + ch * CHUNK_SMEM + WARP * PIECE)
                for jj in cutlass.range_constexpr(2):
                    a = (wa[2 * jj], wb[2 * jj], wa[2 * jj + 1], wb[2 * jj + 1])
                    d = mma_bf16_16816_ordered(a, (xbuf[2 * jj, cj, slot],
                                                   xbuf[2 * jj + 1, cj, slot]),
                                               [acc[q] for q in range(4)])
                    for q in cutlass.range_constexpr(4):
                        acc[q] = d[q]
        if j + self.stages < n_units:
            self._issue(ring_a, w_row, u + self.stages, i, warp, lane, t)
        cp_async_commit()
        if u % self.ksteps == self.ksteps - 1:
            self._finish_tile(acc, best, u // self.ksteps, out, rows, red, tidx, warp, lane)
            acc.fill(0.0)

    @cute.jit
    def _finish_tile(self, acc, best, tile: Int32, out: cute.Pointer, rows: Int32, red,
                     tidx: Int32, warp: Int32, lane: Int32):
        """Warp partials in warp order -> logit (row 2*(ln%4) + q%2, vocab tile*16 + ...)."""
        for q in cutlass.range_constexpr(4):
            red[lane, q, warp] = acc[q]
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=CONSUMERS)
        if tidx < RED_THREADS:
            q, ln = tidx // WARP, tidx % WARP
            total = red[ln, q, 0]
            for w in cutlass.range_constexpr(1, STREAM_WARPS):
                total = total + red[ln, q, w]
            n = tile * TILE_N + ln // 4 + 8 * (q // 2)
            if cutlass.const_expr(self.spec.mode == "logits"):
                r = 2 * (ln % 4) + q % 2
                if r < rows:
                    st_f32(out.toint() + Int64(r * self.spec.vocab + n) * 4, total)
            else:
                best[0] = key_max(best[0], argmax_key(total, n))
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=CONSUMERS)

    @cute.jit
    def _publish(self, best, cta_best, flag, keys: cute.Pointer, counters: cute.Pointer,
                 out: cute.Pointer, rows: Int32, vocab_offset: Int32, tidx: Int32, warp: Int32,
                 lane: Int32):
        """Row max over the CTA -> red.max on the row key; the last CTA decodes and resets."""
        key = best[0]
        for off in (4, 8, 16):                    # the 8 lanes of one (row, warp)
            key = key_max_bfly(key, off)
        if (tidx < RED_THREADS) & (lane < 4):     # warp q: row 2*lane + q%2, half q//2
            cta_best[2 * lane + warp % 2, warp // 2] = key
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=CONSUMERS)
        if (tidx < ROW_TILE) & (tidx < rows):
            red_max_u64(keys.toint() + Int64(tidx) * 8,
                        key_max(cta_best[tidx, 0], cta_best[tidx, 1]))
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=CONSUMERS)
        if tidx == 0:
            old = cute.arch.atomic_add(counters, Int32(1), sem="acq_rel", scope="gpu")
            flag[0] = Int32(old == self.ctas - 1)
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=CONSUMERS)
        if flag[0] != 0:
            cute.arch.fence_acq_rel_gpu()
            if (tidx < ROW_TILE) & (tidx < rows):
                key_addr = keys.toint() + Int64(tidx) * 8
                bits, index = decode_key(ld_u64_gpu(key_addr), vocab_offset)
                st_v2_b32(out.toint() + Int64(tidx) * 8, bits, index)
                st_u64(key_addr, Int64(0))
            if tidx == 0:
                cute.arch.store(counters.llvm_ptr, Int32(0), sem="relaxed", scope="gpu")
