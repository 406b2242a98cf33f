"""RMSNorm for SM90 in the CuTe DSL: one thread group per row, rows software-pipelined, fp32 math.

Computes `y = bf16((x * rstd) * w)` with `rstd = 1/sqrt(sum(x^2)/D + eps)` over rows of a BF16
[rows, D] tensor; `kernels/norm_ref.py` holds the spec, the byte formula and the reference that
replays the kernel's summation order (the two agree bitwise).

How: a group of `threads_per_row` threads owns a row (D=5120: 4 warps x 5 vectors per thread;
D<=2048: a warp or less, several groups per CTA). The weight is staged once per CTA as fp32 in
shared memory, before `griddepcontrol.wait` (it is a model constant, so this prologue overlaps the
previous kernel's tail). Groups then walk rows with a grid stride, software-pipelined: a group
issues the 16-byte loads of its next row, then reduces, normalises and stores the current one, so
its loads stay in flight through the shuffles, the barrier and the stores. x is held as packed
bf16 pairs (two rows of it) and widened to fp32 where it is used, which keeps a thread at <= 64
registers. The grid is persistent: exactly `ctas_per_sm` CTAs per SM, the occupancy the kernel is
compiled for (`.minnctapersm`), so a large launch runs as one wave with no second-wave tail.
Rows wider than a warp meet through a two-slot shared-memory buffer (slot = iteration parity), so
one barrier per row suffices.

PTX ABI: (u64 x, u64 weight, u64 out, u32 rows, f32 eps); constraints: x, weight and out 16-byte
aligned, out may alias x (a group reads its next row, never another group's), eps > 0,
rows * D < 2**31.
"""
from __future__ import annotations

import cutlass
from cuda.bindings import driver as cuda
from cutlass import BFloat16, Float32, Int32, Uint32, cute

from kernels.common_ref import BF16_PER_VECTOR
from kernels.norm_ref import WARP, WEIGHT_DTYPES, RmsNormSpec, built_widths, make_spec

VEC = BF16_PER_VECTOR
WORDS = VEC // 2                    # a 16-byte vector as 4 packed bf16 pairs
_WEIGHT_TYPES = {"bf16": BFloat16, "f32": Float32}


class RmsNormSm90:
    """Kernel object for one RmsNormSpec (config-only __init__, jit launcher, kernel)."""

    def __init__(self, spec: RmsNormSpec):
        self.spec = spec
        self.width = spec.width
        self.threads_per_row = spec.threads_per_row
        self.vecs_per_thread = spec.vecs_per_thread
        self.warps_per_row = max(1, spec.threads_per_row // WARP)
        self.weight_type = _WEIGHT_TYPES[spec.weight_dtype]

    def _slice(self, ptr: cute.Pointer) -> cute.Tensor:
        """This thread's vecs_per_thread vectors of one row: (VEC, k) at vector k*threads_per_row."""
        layout = cute.make_layout((VEC, self.vecs_per_thread), stride=(1, VEC * self.threads_per_row))
        return cute.make_tensor(ptr, layout)

    @cute.jit
    def _row_slice(self, base: cute.Pointer, row: Int32, lane: Int32) -> cute.Tensor:
        """_slice of row `row` of a [rows, D] tensor; the offset is whole 16-byte vectors."""
        return self._slice(base + cute.assume(row * self.width + lane * VEC, divby=VEC))

    @cute.jit
    def __call__(self, x: cute.Pointer, weight: cute.Pointer, out: cute.Pointer, rows: Int32,
                 eps: Float32, stream: cuda.CUstream):
        self.kernel(x, weight, out, rows, eps).launch(
            grid=[self.spec.max_ctas, 1, 1], block=list(self.spec.block), stream=stream,
            use_pdl=True, min_blocks_per_mp=self.spec.ctas_per_sm,
            preferred_smem_carveout=100)   # any value: spares the DSL a GPU query at compile

    @cute.kernel
    def kernel(self, x: cute.Pointer, weight: cute.Pointer, out: cute.Pointer, rows: Int32,
               eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        lane = tidx % self.threads_per_row

        smem = cutlass.memory.SmemAllocator()
        w_smem = smem.allocate_tensor(Float32, cute.make_layout((self.width,)), byte_alignment=16)
        partials = None
        if cutlass.const_expr(self.warps_per_row > 1):
            partials = smem.allocate_tensor(Float32, cute.make_layout((self.warps_per_row, 2)),
                                            byte_alignment=16)
        self._stage_weight(weight, w_smem, tidx)

        cute.arch.griddepcontrol_wait()     # x may be the previous kernel's output

        rows_per_cta = self.spec.rows_per_cta
        row = bidx * rows_per_cta + tidx // self.threads_per_row
        shape = (WORDS, self.vecs_per_thread)
        x_cur = cute.make_rmem_tensor(shape, Uint32)
        x_next = cute.make_rmem_tensor(shape, Uint32)
        if row < rows:
            self._load_row(x, x_cur, row, lane)
        parity = Int32(0)
        # Rows wider than a warp: rows_per_cta == 1, so `row` is uniform over the CTA and every
        # thread reaches the barrier inside the loop the same number of times.
        while row < rows:
            following = row + gdim * rows_per_cta
            if following < rows:
                self._load_row(x, x_next, following, lane)     # in flight until the loop's end
            rstd = self._row_rstd(x_cur, partials, tidx, parity, eps)
            if cutlass.const_expr(self.warps_per_row > 1):
                parity = parity ^ 1
            self._normalise_store(x_cur, rstd, w_smem, out, row, lane)
            if following < rows:
                x_cur.store(x_next.load())
            row = following

        cute.arch.griddepcontrol_launch_dependents()   # this CTA's rows are written

    @cute.jit
    def _stage_weight(self, weight: cute.Pointer, w_smem: cute.Tensor, tidx: Int32):
        """The CTA copies the weight once, widened to fp32, into shared memory; rows then read
        their slice with ld.shared.v4 (keeping it in registers costs ~40 registers a thread)."""
        chunk = cute.make_layout((VEC,))
        for c in cutlass.range_constexpr(0, self.width // VEC, self.spec.block[0]):
            if tidx + c < self.width // VEC:
                w_raw = cute.make_rmem_tensor(chunk, self.weight_type)
                cute.autovec_copy(cute.make_tensor(weight + (tidx + c) * VEC, chunk), w_raw)
                w_f32 = cute.make_rmem_tensor(chunk, Float32)
                w_f32.store(w_raw.load().to(Float32))
                cute.autovec_copy(w_f32, cute.make_tensor(w_smem.iterator + (tidx + c) * VEC,
                                                          chunk))
        cute.arch.sync_threads()

    @cute.jit
    def _load_row(self, x: cute.Pointer, x_regs: cute.Tensor, row: Int32, lane: Int32):
        """Issue this thread's 16-byte loads of one row, as packed bf16 pairs."""
        cute.autovec_copy(cute.recast_tensor(self._row_slice(x, row, lane), Uint32), x_regs)

    @cute.jit
    def _row_rstd(self, x_regs: cute.Tensor, partials, tidx: Int32, parity: Int32,
                  eps: Float32) -> Float32:
        """rstd of the row, its squares summed in the reference's order."""
        acc = Float32(0.0)
        for k in cutlass.range_constexpr(self.vecs_per_thread):
            # Widen by bit moves (a bf16 is the high half of its fp32): a different expression
            # from the normalise step's cvt, so the compiler cannot keep 8 fp32 per vector alive
            # across the reduction in place of 4 words (that cost 40 registers at D=5120).
            pairs = x_regs[None, k].load()
            even = (pairs * Uint32(1 << 16)).bitcast(Float32)
            odd = (pairs & Uint32(0xFFFF0000)).bitcast(Float32)
            for j in cutlass.range_constexpr(WORDS):
                acc = acc + even[j] * even[j]       # fma; x*x is exact for bf16 x
                acc = acc + odd[j] * odd[j]
        total = cute.arch.warp_reduction_sum(acc, threads_in_group=min(self.threads_per_row, WARP))
        if cutlass.const_expr(self.warps_per_row > 1):
            total = self._cross_warp_sum(total, partials, tidx, parity)
        return Float32(1.0) / cute.math.sqrt(total / Float32(self.width) + eps)

    @cute.jit
    def _normalise_store(self, x_regs: cute.Tensor, rstd: Float32, w_smem: cute.Tensor,
                         out: cute.Pointer, row: Int32, lane: Int32):
        """y = (x * rstd) * w, one vector at a time (8 weight registers live, not 8 per vector)."""
        chunk = cute.make_layout((VEC,))
        w_row = self._slice(w_smem.iterator + lane * VEC)
        y_row = self._row_slice(out, row, lane)
        for k in cutlass.range_constexpr(self.vecs_per_thread):
            wk = cute.make_rmem_tensor(chunk, Float32)
            cute.autovec_copy(w_row[None, k], wk)
            xk = x_regs[None, k].load().bitcast(BFloat16).to(Float32)
            yk = cute.make_rmem_tensor(chunk, BFloat16)
            yk.store(((xk * rstd) * wk.load()).to(BFloat16))
            cute.autovec_copy(yk, y_row[None, k])

    @cute.jit
    def _cross_warp_sum(self, acc: Float32, partials: cute.Tensor, tidx: Int32,
                        parity: Int32) -> Float32:
        """Sum of the row's warp totals in warp order (the reference adds them the same way)."""
        if tidx % WARP == 0:
            partials[tidx // WARP, parity] = acc
        cute.arch.sync_threads()
        total = partials[0, parity]
        for warp in cutlass.range_constexpr(1, self.warps_per_row):
            total = total + partials[warp, parity]
        return total


def kernel_function(spec: RmsNormSpec):
    """The @cute.kernel whose Python signature the build checks against spec.params."""
    del spec
    return RmsNormSm90.kernel


def specs(cfg, tp: int) -> list[RmsNormSpec]:
    """The bundle's RMSNorm kernels: both weight dtypes at norm_ref.built_widths."""
    del tp
    return [make_spec(width, dtype) for width in built_widths(cfg) for dtype in WEIGHT_DTYPES]


def compile_spec(spec: RmsNormSpec, options: str = "--gpu-arch sm_90a"):
    """cute.compile one RMSNorm with pointer / Int32 / Float32 arguments only."""
    from cutlass.cute.runtime import make_ptr

    def ptr(dtype):
        return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=16)

    return cute.compile(RmsNormSm90(spec), ptr(BFloat16), ptr(_WEIGHT_TYPES[spec.weight_dtype]),
                        ptr(BFloat16), Int32(1), Float32(1e-6), cuda.CUstream(0), options=options)
