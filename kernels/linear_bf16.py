"""BF16-weight linear with few outputs for SM90 in the CuTe DSL (the indexer's head weights).

Spec, reference and tolerance: `kernels/linear_bf16_ref.py`. One warp per output column and 8
rows, 4 warps per CTA: lane l reads the 8-byte weight chunks l, l + 32, ... of its column (256 B
coalesced per warp load), multiplies them by the rows' x chunks (L1/L2 hits: every warp of the
grid reads the same x) and accumulates with fma in fp32; a 5-step xor butterfly finishes and lane
0 stores the bf16 (RNE). Weight loads come in groups of 8 chunks, double-buffered, the first group
requested before `griddepcontrol.wait` (weights never depend on an earlier kernel). Rows past the
batch read the last row and store nothing. Helpers from `kernels.compressor` (same walk, fp32 out).
"""
from __future__ import annotations

import cutlass
from cuda.bindings import driver as cuda
from cutlass import Float32, Int32, Int64, cute

from kernels import linear_bf16_ref as lr
from kernels.compressor import bf16x4
from kernels.indexer_ptx import _addr, imin
from kernels.ptx import shfl_xor_f32, st_bf16

UNROLL = 8            # weight chunks in flight per lane


class LinearBf16Sm90:
    """out [R, N] bf16 = x [R, K] bf16 @ w [N, K]^T bf16."""

    def __init__(self, spec: lr.LinearBf16Spec):
        self.spec = spec

    @cute.jit
    def __call__(self, x: cute.Pointer, w: cute.Pointer, out: cute.Pointer, rows: Int32,
                 stream: cuda.CUstream):
        self.kernel(x, w, out, rows).launch(
            grid=[self.spec.n // lr.COLS_PER_CTA, (rows + lr.ROW_TILE - 1) // lr.ROW_TILE, 1],
            block=list(self.spec.block), stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, x: cute.Pointer, w: cute.Pointer, out: cute.Pointer, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, _ = cute.arch.block_idx()
        lane = tidx % lr.LANES
        col = bidx * lr.COLS_PER_CTA + tidx // lr.LANES
        row0 = bidy * lr.ROW_TILE
        k = self.spec.k
        wrow = _addr(w) + Int64(col) * (k * 2)
        chunks = k // lr.CHUNK
        unroll = UNROLL if chunks % UNROLL == 0 else 1
        wv = self.load_weights(wrow, 0, unroll, lane)
        cute.arch.griddepcontrol_wait()        # x comes from the previous kernel
        xrow = []
        for i in cutlass.range_constexpr(lr.ROW_TILE):
            xrow.append(_addr(x) + Int64(imin(row0 + i, rows - 1)) * (k * 2))
        acc = [Float32(0.0)] * lr.ROW_TILE
        groups = chunks // unroll
        for g in cutlass.range_constexpr(groups):
            nxt = wv
            if cutlass.const_expr(g + 1 < groups):
                nxt = self.load_weights(wrow, g + 1, unroll, lane)
            for u in cutlass.range_constexpr(unroll):
                c = (g * unroll + u) * lr.LANES + lane
                for i in cutlass.range_constexpr(lr.ROW_TILE):
                    xv = bf16x4(xrow[i] + Int64(c) * 8)
                    a = acc[i]
                    for j in cutlass.range_constexpr(4):
                        a = a + xv[j] * wv[u][j]
                    acc[i] = a
            wv = nxt
        for i in cutlass.range_constexpr(lr.ROW_TILE):
            a = acc[i]
            for s in cutlass.range_constexpr(5):
                a = a + shfl_xor_f32(a, 16 >> s)
            if lane == 0 and row0 + i < rows:
                st_bf16(_addr(out) + (Int64(row0 + i) * self.spec.n + col) * 2, a)
        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def load_weights(self, wrow: Int64, g: cutlass.Constexpr, unroll: cutlass.Constexpr,
                     lane: Int32):
        """The lane's `unroll` 4-value weight chunks of group g, as floats."""
        wv = []
        for u in cutlass.range_constexpr(unroll):
            c = (g * unroll + u) * lr.LANES + lane
            wv.append(bf16x4(wrow + Int64(c) * 8))
        return wv


def kernel_function(spec: lr.LinearBf16Spec):
    del spec
    return LinearBf16Sm90.kernel


def specs(cfg, tp: int) -> list[lr.LinearBf16Spec]:
    """The indexer's head-weights linear when the model has an indexer (replicated: tp unused)."""
    del tp
    if not any(layer.has_indexer for layer in cfg.layers):
        return []
    return [lr.indexer_weights_spec(cfg)]


def compile_spec(spec: lr.LinearBf16Spec, options: str = "--gpu-arch sm_90a"):
    from cutlass.cute.runtime import make_ptr

    def ptr():
        return make_ptr(Int32, 0, cute.AddressSpace.gmem, assumed_align=16)

    return cute.compile(LinearBf16Sm90(spec), ptr(), ptr(), ptr(), Int32(1), cuda.CUstream(0),
                        options=options)
