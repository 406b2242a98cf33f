"""RMSNorm for SM90 in the CuTe DSL: one thread group per row, 16-byte loads, fp32 math, bf16 out.

Computes `y = bf16((x * rstd) * w)` with `rstd = 1/sqrt(sum(x^2)/D + eps)` over rows of a BF16
[rows, D] tensor; `kernels/norm_ref.py` holds the spec, the byte formula and the reference that
replays the kernel's summation order (the two agree bitwise).

How: a group of `threads_per_row` threads owns a row (D=5120: 4 warps x 5 vectors per thread;
D<=2048: a warp or less, several rows per CTA). Each thread keeps its slice of the weight in
registers, loaded before `griddepcontrol.wait` (the weight is a model constant, so this prologue
overlaps the previous kernel's tail). CTAs then walk rows with a grid stride, a whole wave of CTAs
in flight so that HBM sees enough 16-byte loads. Rows wider than a warp meet through a two-slot
shared-memory buffer (slot = iteration parity), so one barrier per row suffices.

PTX ABI: (u64 x, u64 weight, u64 out, u32 rows, f32 eps); constraints: x, weight and out 16-byte
aligned, out may alias x, eps > 0, rows * D < 2**31.
"""
from __future__ import annotations

import cutlass
from cuda.bindings import driver as cuda
from cutlass import BFloat16, Float32, Int32, cute

from kernels.common_ref import BF16_PER_VECTOR
from kernels.norm_ref import WARP, RmsNormSpec, make_spec, norm_widths

VEC = BF16_PER_VECTOR
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
    def __call__(self, x: cute.Pointer, weight: cute.Pointer, out: cute.Pointer, rows: Int32,
                 eps: Float32, stream: cuda.CUstream):
        self.kernel(x, weight, out, rows, eps).launch(
            grid=[self.spec.max_ctas, 1, 1], block=list(self.spec.block), stream=stream,
            use_pdl=True)

    @cute.kernel
    def kernel(self, x: cute.Pointer, weight: cute.Pointer, out: cute.Pointer, rows: Int32,
               eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        lane = tidx % self.threads_per_row
        shape = (VEC, self.vecs_per_thread)

        # Prologue before the PDL wait (the weight is a model constant): the CTA stages the weight
        # once, as fp32, in shared memory; rows then read their slice with ld.shared.v4. Keeping it
        # in registers instead costs ~40 registers and a third of the occupancy HBM needs.
        smem = cutlass.memory.SmemAllocator()
        w_smem = smem.allocate_tensor(Float32, cute.make_layout((self.width,)), byte_alignment=16)
        partials = None
        if cutlass.const_expr(self.warps_per_row > 1):
            partials = smem.allocate_tensor(Float32, cute.make_layout((self.warps_per_row, 2)),
                                            byte_alignment=16)
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

        cute.arch.griddepcontrol_wait()     # x may be the previous kernel's output

        rows_per_cta = self.spec.rows_per_cta
        row = bidx * rows_per_cta + tidx // self.threads_per_row
        parity = Int32(0)
        # Rows wider than a warp: rows_per_cta == 1, so `row` is uniform over the CTA and every
        # thread reaches the barrier inside the loop the same number of times.
        while row < rows:
            offset = row * self.width + lane * VEC
            x_raw = cute.make_rmem_tensor(shape, BFloat16)
            cute.autovec_copy(self._slice(x + offset), x_raw)
            xf = cute.make_rmem_tensor(shape, Float32)
            xf.store(x_raw.load().to(Float32))
            acc = Float32(0.0)
            for k in cutlass.range_constexpr(self.vecs_per_thread):
                for e in cutlass.range_constexpr(VEC):
                    acc = acc + xf[e, k] * xf[e, k]     # fma; x*x is exact for bf16 x
            acc = cute.arch.warp_reduction_sum(
                acc, threads_in_group=min(self.threads_per_row, WARP))
            total = acc
            if cutlass.const_expr(self.warps_per_row > 1):
                total = self._cross_warp_sum(acc, partials, tidx, parity)
                parity = parity ^ 1
            rstd = Float32(1.0) / cute.math.sqrt(total / Float32(self.width) + eps)
            # One vector at a time: 8 weight registers live instead of the whole slice.
            w_row = self._slice(w_smem.iterator + lane * VEC)
            y_row = self._slice(out + offset)
            for k in cutlass.range_constexpr(self.vecs_per_thread):
                wk = cute.make_rmem_tensor(chunk, Float32)
                cute.autovec_copy(w_row[None, k], wk)
                yk = cute.make_rmem_tensor(chunk, BFloat16)
                yk.store(((xf[None, k].load() * rstd) * wk.load()).to(BFloat16))
                cute.autovec_copy(yk, y_row[None, k])
            row += gdim * rows_per_cta

        cute.arch.griddepcontrol_launch_dependents()   # this CTA's rows are written

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
    """Both weight dtypes at every RMSNorm width of the config (widths do not depend on tp)."""
    del tp
    return [make_spec(width, dtype) for width in norm_widths(cfg) for dtype in ("bf16", "f32")]


def compile_spec(spec: RmsNormSpec, options: str = "--gpu-arch sm_90a"):
    """cute.compile one RMSNorm with pointer / Int32 / Float32 arguments only."""
    from cutlass.cute.runtime import make_ptr

    def ptr(dtype):
        return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=16)

    return cute.compile(RmsNormSm90(spec), ptr(BFloat16), ptr(_WEIGHT_TYPES[spec.weight_dtype]),
                        ptr(BFloat16), Int32(1), Float32(1e-6), cuda.CUstream(0), options=options)
