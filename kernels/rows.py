"""Row metadata prep for SM90 in the CuTe DSL: int64 caller rows -> int32 kernel rows (rows_ref.py).

One thread per row, grid-stride; scalar loads and stores (a few kB per step). A draft row scans
the step's rows for its block's first and last positions (R <= 192: at most 192 loads, L1-hot).
Nothing precedes the PDL wait: the previous step's kernels may still read the int32 copies.
"""
from __future__ import annotations

import cutlass
from cuda.bindings import driver as cuda
from cutlass import Int8, Int32, Int64, cute

from kernels.rows_ref import CTA_THREADS, INFO_FIELDS, KIND_DRAFT, RowsPrepSpec, spec_for


class RowsPrepSm90:
    """Kernel object for one RowsPrepSpec."""

    def __init__(self, spec: RowsPrepSpec):
        self.spec = spec
        self.cols = spec.history_cols

    @cute.jit
    def __call__(self, token_ids: cute.Pointer, positions: cute.Pointer,
                 token_history: cute.Pointer, seq_index: cute.Pointer, block_kind: cute.Pointer,
                 tokens32: cute.Pointer, positions32: cute.Pointer, history32: cute.Pointer,
                 row_info: cute.Pointer, rows: Int32, stream: cuda.CUstream):
        self.kernel(token_ids, positions, token_history, seq_index, block_kind, tokens32,
                    positions32, history32, row_info, rows).launch(
            grid=[self.spec.grid(1)[0], 1, 1], block=list(self.spec.block), stream=stream,
            use_pdl=True)

    @cute.kernel
    def kernel(self, token_ids: cute.Pointer, positions: cute.Pointer,
               token_history: cute.Pointer, seq_index: cute.Pointer, block_kind: cute.Pointer,
               tokens32: cute.Pointer, positions32: cute.Pointer, history32: cute.Pointer,
               row_info: cute.Pointer, rows: Int32):
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
            self._row_info(positions, seq_index, block_kind, row_info, r, rows, Int32(pos))
            r += gdim * CTA_THREADS

        cute.arch.griddepcontrol_launch_dependents()


    @cute.jit
    def _row_info(self, positions: cute.Pointer, seq_index: cute.Pointer,
                  block_kind: cute.Pointer, row_info: cute.Pointer, r: Int32, rows: Int32,
                  pos: Int32):
        one = cute.make_layout((1,))
        seq = cute.make_tensor(seq_index + r, one)[0]
        lo, hi = Int32(0), Int32(-1)
        if seq >= 0:
            lo, hi = pos - self.spec.window + 1, pos
            if Int32(cute.make_tensor(block_kind + r, one)[0]) == KIND_DRAFT:
                first, last = pos, pos
                j = Int32(0)
                while j < rows:
                    if cute.make_tensor(seq_index + j, one)[0] == seq:
                        p = Int32(cute.make_tensor(positions + j, one)[0])
                        first = cutlass.min(first, p)
                        last = cutlass.max(last, p)
                    j += 1
                lo, hi = first - self.spec.window, last
            lo = cutlass.max(lo, Int32(0))
        out = row_info + r * INFO_FIELDS
        cute.make_tensor(out, one)[0] = cutlass.select_(seq >= 0, pos, Int32(0))
        cute.make_tensor(out + 1, one)[0] = lo
        cute.make_tensor(out + 2, one)[0] = hi
        cute.make_tensor(out + 3, one)[0] = seq


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
                        ptr(Int32, 4), ptr(Int8, 1), ptr(Int32, 4), ptr(Int32, 4),
                        ptr(Int32, 4), ptr(Int32, 16), Int32(1), cuda.CUstream(0),
                        options=options)
