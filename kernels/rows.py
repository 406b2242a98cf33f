"""Row metadata prep for SM90 in the CuTe DSL: int64 caller rows -> int32 kernel rows (rows_ref.py).

One thread per row, grid-stride; scalar loads and stores (a few hundred bytes per step). Nothing
precedes the PDL wait: the previous step's kernels may still read the int32 copies.
"""
from __future__ import annotations

import cutlass
from cuda.bindings import driver as cuda
from cutlass import Int32, Int64, cute

from kernels.rows_ref import CTA_THREADS, RowsPrepSpec, spec_for


class RowsPrepSm90:
    """Kernel object for one RowsPrepSpec."""

    def __init__(self, spec: RowsPrepSpec):
        self.spec = spec
        self.cols = spec.history_cols

    @cute.jit
    def __call__(self, token_ids: cute.Pointer, positions: cute.Pointer,
                 token_history: cute.Pointer, tokens32: cute.Pointer, positions32: cute.Pointer,
                 history32: cute.Pointer, rows: Int32, stream: cuda.CUstream):
        self.kernel(token_ids, positions, token_history, tokens32, positions32, history32,
                    rows).launch(grid=[self.spec.grid(1)[0], 1, 1], block=list(self.spec.block),
                                 stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, token_ids: cute.Pointer, positions: cute.Pointer,
               token_history: cute.Pointer, tokens32: cute.Pointer, positions32: cute.Pointer,
               history32: cute.Pointer, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        one = cute.make_layout((1,))
        r = bidx * CTA_THREADS + tidx

        cute.arch.griddepcontrol_wait()     # the previous step may still read our outputs

        while r < rows:
            token = cute.make_tensor(token_ids + r, one)[0]
            cute.make_tensor(tokens32 + r, one)[0] = Int32(token)
            pos = cute.make_tensor(positions + r, one)[0]
            cute.make_tensor(positions32 + r, one)[0] = Int32(pos)
            if cutlass.const_expr(self.cols > 0):
                out = history32 + r * self.cols
                cute.make_tensor(out, one)[0] = Int32(token)
                for k in cutlass.range_constexpr(1, self.cols):
                    past = cute.make_tensor(token_history + r * (self.cols - 1) + (k - 1), one)[0]
                    cute.make_tensor(out + k, one)[0] = Int32(past)
            r += gdim * CTA_THREADS

        cute.arch.griddepcontrol_launch_dependents()


def kernel_function(spec: RowsPrepSpec):
    """The @cute.kernel whose Python signature the build checks against spec.params."""
    del spec
    return RowsPrepSm90.kernel


def specs(cfg, tp: int) -> list[RowsPrepSpec]:
    del tp
    return [spec_for(cfg)]


def compile_spec(spec: RowsPrepSpec, options: str = "--gpu-arch sm_90a"):
    """cute.compile the rows prep with pointer / Int32 arguments only."""
    from cutlass.cute.runtime import make_ptr

    def ptr(dtype, align):
        return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=align)

    return cute.compile(RowsPrepSm90(spec), ptr(Int64, 8), ptr(Int64, 8), ptr(Int64, 8),
                        ptr(Int32, 4), ptr(Int32, 4), ptr(Int32, 4), Int32(1),
                        cuda.CUstream(0), options=options)
