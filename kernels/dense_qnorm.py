"""W8A16 tile GEMV whose x prologue applies q_norm (SM90, CuTe DSL): wq_b without attn.q_kv_norm.

Spec, ABI and reference: `kernels/dense_qnorm_ref.py`. The kernel is kernels/dense_tile.py's tile
kernel with x resident (its prologue, tiles and epilogue unchanged); only the B fragments differ:
- before griddepcontrol.wait, beside the weights' bulk copies and the scale bytes, q_norm's fp32
  weight is cp.async'ed into shared memory (a model constant, in the scales' commit group);
- after the wait every thread issues its x loads (16 K of row g per chunk it owns, row stride
  x_stride) and warp w < min(rows, 8) reloads row w whole in split_norm's lane order and computes
  its rstd with attn_prep's instructions (fma.rn squares, bfly + add.rn, div.rn / add.rn /
  sqrt.rn / rcp.rn), into shared memory; one CTA barrier;
- each thread turns its x words into bf16x2 of (x * rstd[g]) * w (mul.rn, cvt.rn.bf16x2), then
  the resident permutation and the tiles as dense_tile.
So the multiplied values are bitwise attn.qr's, and the cost over the plain kernel is one row load
and reduction chain (~40 fma, 5 shuffles, the IEEE div / sqrt / rcp) plus a barrier and 2 mul a
value, after the wait.
"""
from __future__ import annotations

import cutlass
from cuda.bindings import driver as cuda
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, cute
from cutlass.cutlass_dsl import T

from kernels.dense_qnorm_ref import MAX_NORM_ROWS, NORM_LANES, DenseQNormSpec, specs_for
from kernels.dense_ref import BULK_MBARRIERS, CHUNK_K, WARP
from kernels.dense_stream import CONSUMER_BARRIER, smem_addr
from kernels.dense_tile import DenseTileSm90
from kernels.moe_ptx import mbar_wait
from kernels.norm_ref import BF16_PER_VECTOR as VEC
from kernels.norm_ref import row_geometry
from kernels.ptx import (
    asm,
    cp_async_16,
    cp_async_commit,
    cp_async_wait,
    f32_imm,
    ld_v4_u32,
    lds_f32,
    lds_v4_u32,
    shfl_xor_f32,
    sts_f32,
)


def sq_pair_acc(acc: Float32, word: Int32) -> Float32:
    """acc + lo^2 + hi^2 of a bf16 pair, lo first: fma.rn of exact squares (split_norm's order)."""
    return Float32(asm(1, [Int32(word), Float32(acc)],
                       "{ .reg .b32 u; .reg .f32 a, b; shl.b32 u, $1, 16; mov.b32 a, u;\n"
                       "and.b32 u, $1, 0xFFFF0000; mov.b32 b, u;\n"
                       "fma.rn.f32 $0, a, a, $2; fma.rn.f32 $0, b, b, $0; }", "=f,r,f",
                       kind=T.f32(), side_effects=False))


def add_rn(a: Float32, b: Float32) -> Float32:
    return Float32(asm(1, [Float32(a), Float32(b)], "add.rn.f32 $0, $1, $2;", "=f,f,f",
                       kind=T.f32(), side_effects=False))


def rstd_rn(total: Float32, eps: Float32, width: int) -> Float32:
    """1 / sqrt(total / width + eps): attn_prep's div.rn, add, sqrt.rn, rcp.rn (no ftz)."""
    return Float32(asm(1, [Float32(total), Float32(eps)],
                       "{ .reg .f32 m; div.rn.f32 m, $1, " + f32_imm(float(width))
                       + "; add.rn.f32 m, m, $2;\n"
                       "sqrt.rn.f32 m, m; rcp.rn.f32 $0, m; }", "=f,f,f", kind=T.f32(),
                       side_effects=False))


def norm_pair(word: Int32, rstd: Float32, w_lo: Int32, w_hi: Int32) -> Int32:
    """bf16x2 of ((lo * rstd) * w_lo, (hi * rstd) * w_hi), RN: attn_prep's mul / mul / cvt."""
    return Int32(asm(1, [Int32(word), Float32(rstd), Int32(w_lo), Int32(w_hi)],
                     "{ .reg .b32 u; .reg .f32 a, b, wa, wb; mov.b32 wa, $3; mov.b32 wb, $4;\n"
                     "shl.b32 u, $1, 16; mov.b32 a, u; and.b32 u, $1, 0xFFFF0000; mov.b32 b, u;\n"
                     "mul.rn.f32 a, a, $2; mul.rn.f32 a, a, wa; mul.rn.f32 b, b, $2;\n"
                     "mul.rn.f32 b, b, wb; cvt.rn.bf16x2.f32 $0, b, a; }", "=r,r,f,r,r",
                     side_effects=False))


class DenseQNormSm90(DenseTileSm90):
    """Kernel object for one DenseQNormSpec: dense_tile's kernel with the q_norm prologue."""

    def __init__(self, spec: DenseQNormSpec):
        super().__init__(spec)
        if not self.resident:
            raise ValueError(f"{spec.name}: the q_norm prologue needs x resident")
        self.x_stride = spec.x_stride
        threads, self.norm_vecs = row_geometry(spec.k)
        assert threads == NORM_LANES and self.warps >= MAX_NORM_ROWS, spec

    @cute.jit
    def __call__(self, x: cute.Pointer, weight: cute.Pointer, scales: cute.Pointer,
                 norm_weight: cute.Pointer, out: cute.Pointer, rows: Int32, eps: Float32,
                 stream: cuda.CUstream):
        self.qn_kernel(x, weight, scales, norm_weight, out, rows, eps).launch(
            grid=[self.ctas, 1, 1], block=list(self.spec.block), stream=stream, use_pdl=True)

    @cute.kernel
    def qn_kernel(self, x: cute.Pointer, weight: cute.Pointer, scales: cute.Pointer,
                  norm_weight: cute.Pointer, out: cute.Pointer, rows: Int32, eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp, lane = tidx // WARP, tidx % WARP
        g, t = lane // 4, lane % 4
        u_begin, n_units = self._unit_range(cta)
        cute.arch.griddepcontrol_launch_dependents()      # at entry, as dense_stream

        smem = cutlass.memory.SmemAllocator()
        ring = smem.allocate_tensor(Uint8, cute.make_layout(
            self.ring_bytes + 8 * BULK_MBARRIERS), byte_alignment=128)
        sc = smem.allocate_tensor(Uint8, cute.make_layout(self.window), byte_alignment=16)
        red = smem.allocate_tensor(Float32, cute.make_layout((WARP, 4, self.warps)),
                                   byte_alignment=16)
        flag = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)
        nw = smem.allocate_tensor(Float32, cute.make_layout(self.k), byte_alignment=16)
        rs = smem.allocate_tensor(Float32, cute.make_layout(MAX_NORM_ROWS), byte_alignment=16)
        ring_a, sc_a, nw_a, rs_a = smem_addr(ring), smem_addr(sc), smem_addr(nw), smem_addr(rs)

        # Constants before the wait: scale bytes and q_norm's weight (one commit group), the
        # weight tiles by bulk copies (thread 0).
        self._scale_copies(scales, sc_a, u_begin, n_units, tidx)
        for j in cutlass.range_constexpr(-(-self.k // (4 * self.consumers))):
            piece = tidx + self.consumers * j
            if piece < self.k // 4:
                cp_async_16(nw_a + 16 * piece, norm_weight.toint() + Int64(16 * piece))
        cp_async_commit()
        if tidx == 0:
            self._bulk_issue(ring_a, weight, u_begin, n_units)
        cp_async_wait(0)
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=self.consumers)
        cute.arch.griddepcontrol_wait()          # attn.qkv comes from wq_a|wkv
        for i in cutlass.range_constexpr(self.spec.tiles_per_cta):
            if i < n_units // self.ksteps:
                mbar_wait(ring_a + self.ring_bytes + 8 * i, Int32(0))

        row = cutlass.min(g, rows - 1)
        xr = cute.make_rmem_tensor((8, self.chunks_per_warp), Int32)
        for cj in cutlass.range_constexpr(self.chunks_per_warp):
            self._load_q_chunk(xr, cj, x, row, warp, t)
        if warp < cutlass.min(rows, MAX_NORM_ROWS):
            self._row_rstd(x, rs_a, warp, lane, eps)
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=self.consumers)
        self._normalise(xr, nw_a, lds_f32(rs_a + 4 * row), warp, t)
        self._permute_resident(xr)
        acc = cute.make_rmem_tensor((4, self.accs), Float32)
        acc.fill(0.0)
        srow0 = u_begin // self.ksteps // self.tps
        self._tiles(acc, xr, x, out, out, out, out, rows, flag, red, ring_a, sc_a, cta, u_begin,
                    n_units, srow0, row, tidx, warp, lane)

    @cute.jit
    def _load_q_chunk(self, xr, cj: cutlass.Constexpr, x: cute.Pointer, row: Int32, warp: Int32,
                      t: Int32):
        """q[row, this thread's 16 K of chunk cj] -> xr[:, cj] (rows x_stride apart; a warp
        without chunk cj reads the last chunk, unused), as dense_tile's _load_x_chunk."""
        ch = cutlass.min(warp + self.warps * cj, self.k_chunks - 1)
        base = x.toint() + Int64((row * self.x_stride + ch * CHUNK_K + 16 * t) * 2)
        xw = ld_v4_u32(base) + ld_v4_u32(base + Int64(16))
        for w in cutlass.range_constexpr(8):
            xr[w, cj] = xw[w]
        cute.arch.sync_warp()

    @cute.jit
    def _row_rstd(self, x: cute.Pointer, rs_a: Int32, r: Int32, lane: Int32, eps: Float32):
        """rstd of row r (this warp's) -> smem: lane l sums vectors l, l + 32, .. element by
        element, then the butterfly 16..1, as split_norm / attn_prep (norm_ref.rmsnorm_ref)."""
        base = x.toint() + Int64((r * self.x_stride + lane * VEC) * 2)
        words = []
        for k in cutlass.range_constexpr(self.norm_vecs):
            words += ld_v4_u32(base + Int64(k * NORM_LANES * VEC * 2))
        acc = Float32(0.0)
        for w in cutlass.range_constexpr(len(words)):
            acc = sq_pair_acc(acc, words[w])
        for k in cutlass.range_constexpr(5):
            acc = add_rn(shfl_xor_f32(acc, 16 >> k), acc)
        rstd = rstd_rn(acc, eps, self.k)
        if lane == 0:
            sts_f32(rs_a + 4 * r, rstd)

    @cute.jit
    def _normalise(self, xr, nw_a: Int32, rstd: Float32, warp: Int32, t: Int32):
        """xr's x words -> bf16x2 of (x * rstd) * w, q_norm's weight at the same 16 K."""
        for cj in cutlass.range_constexpr(self.chunks_per_warp):
            ch = cutlass.min(warp + self.warps * cj, self.k_chunks - 1)
            at = nw_a + (ch * CHUNK_K + 16 * t) * 4
            wv = lds_v4_u32(at) + lds_v4_u32(at + 16) + lds_v4_u32(at + 32) + lds_v4_u32(at + 48)
            for w in cutlass.range_constexpr(8):
                xr[w, cj] = norm_pair(xr[w, cj], rstd, wv[2 * w], wv[2 * w + 1])


def kernel_function(spec: DenseQNormSpec):
    """The @cute.kernel whose Python signature the build checks against spec.params."""
    del spec
    return DenseQNormSm90.qn_kernel


def specs(cfg, tp: int) -> list[DenseQNormSpec]:
    return specs_for(cfg, tp)


def compile_spec(spec: DenseQNormSpec, options: str = "--gpu-arch sm_90a"):
    """cute.compile one folded kernel with pointer / Int32 / Float32 arguments only."""
    from cutlass.cute.runtime import make_ptr

    def ptr(dtype):
        return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=16)

    return cute.compile(DenseQNormSm90(spec), ptr(BFloat16), ptr(Uint8), ptr(Uint8),
                        ptr(Float32), ptr(BFloat16), Int32(1), Float32(1e-6), cuda.CUstream(0),
                        options=options)
