"""RoPE for SM90 in the CuTe DSL: interleaved pairs on the last 64 dims of each head, table angles.

Spec, tables, byte formula and reference: `kernels/rope_ref.py`. x is BF16 [rows, heads,
head_dim]; every thread step takes one 8-element chunk (one 16-byte load, 4 pairs) and the 32
bytes of (cos, sin) for those pairs at the row's position (two 16-byte loads from the fp32 table).
In place, only the 8 rope chunks of each head are touched; out of place, the 448 nope dims are
copied by the same grid-stride loop. A position outside [0, num_positions) reads table row 0 and
writes NaN (visible, never out of bounds).

PTX ABI: in place (u64 x, u64 table, u64 positions, u32 rows, u32 num_positions); out of place
(u64 x, u64 out, u64 table, u64 positions, u32 rows, u32 num_positions). x, out, table 16-byte
aligned, positions int32 [rows].
"""
from __future__ import annotations

import cutlass
from cuda.bindings import driver as cuda
from cutlass import BFloat16, Float32, Int32, cute

from kernels.common_ref import BF16_PER_VECTOR
from kernels.rope_ref import CTA_THREADS, PAIRS, ROPE_DIM, RopeSpec, step_specs

VEC = BF16_PER_VECTOR


class RopeSm90:
    """Kernel object for one RopeSpec (two kernel entry points: in place and out of place)."""

    def __init__(self, spec: RopeSpec):
        self.spec = spec
        self.heads = spec.heads
        self.head_dim = spec.head_dim
        self.chunks_per_head = spec.chunks_per_head
        self.nope_chunks = (spec.head_dim - ROPE_DIM) // VEC
        self.inverse = spec.inverse

    @cute.jit
    def launch_in_place(self, x: cute.Pointer, table: cute.Pointer, positions: cute.Pointer,
                        rows: Int32, num_positions: Int32, stream: cuda.CUstream):
        self.kernel_in_place(x, table, positions, rows, num_positions).launch(
            grid=[self.spec.max_ctas, 1, 1], block=[CTA_THREADS, 1, 1], stream=stream,
            use_pdl=True)

    @cute.jit
    def launch_copy(self, x: cute.Pointer, out: cute.Pointer, table: cute.Pointer,
                    positions: cute.Pointer, rows: Int32, num_positions: Int32,
                    stream: cuda.CUstream):
        self.kernel_copy(x, out, table, positions, rows, num_positions).launch(
            grid=[self.spec.max_ctas, 1, 1], block=[CTA_THREADS, 1, 1], stream=stream,
            use_pdl=True)

    @cute.kernel
    def kernel_in_place(self, x: cute.Pointer, table: cute.Pointer, positions: cute.Pointer,
                        rows: Int32, num_positions: Int32):
        self._body(x, x, table, positions, rows, num_positions)

    @cute.kernel
    def kernel_copy(self, x: cute.Pointer, out: cute.Pointer, table: cute.Pointer,
                    positions: cute.Pointer, rows: Int32, num_positions: Int32):
        self._body(x, out, table, positions, rows, num_positions)

    @cute.jit
    def _body(self, x: cute.Pointer, out: cute.Pointer, table: cute.Pointer,
              positions: cute.Pointer, rows: Int32, num_positions: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        num_chunks = rows * (self.heads * self.chunks_per_head)
        i = bidx * CTA_THREADS + tidx

        cute.arch.griddepcontrol_wait()     # x and positions come from earlier kernels / the host

        while i < num_chunks:
            unit = i // self.chunks_per_head          # (row, head)
            chunk = i - unit * self.chunks_per_head
            if cutlass.const_expr(self.spec.in_place):
                offset = unit * self.head_dim + self.nope_chunks * VEC + chunk * VEC
                self._rotate_chunk(x, out, table, positions, offset, unit // self.heads,
                                   chunk, num_positions)
            else:
                offset = unit * self.head_dim + chunk * VEC
                if chunk < self.nope_chunks:   # staged through registers: 16-byte ld/st
                    layout = cute.make_layout((VEC,))
                    staged = cute.make_rmem_tensor(layout, BFloat16)
                    cute.autovec_copy(cute.make_tensor(x + offset, layout), staged)
                    cute.autovec_copy(staged, cute.make_tensor(out + offset, layout))
                else:
                    self._rotate_chunk(x, out, table, positions, offset, unit // self.heads,
                                       chunk - self.nope_chunks, num_positions)
            i += gdim * CTA_THREADS

        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def _rotate_chunk(self, x: cute.Pointer, out: cute.Pointer, table: cute.Pointer,
                      positions: cute.Pointer, offset: Int32, row: Int32, rope_chunk: Int32,
                      num_positions: Int32):
        """Rotate the 4 pairs of rope chunk `rope_chunk` (pairs 4c..4c+3) of one head."""
        layout = cute.make_layout((VEC,))
        pos = cute.make_tensor(positions + row, cute.make_layout((1,)))[0]
        valid = (pos >= 0) & (pos < num_positions)
        index = Int32(0)
        if valid:
            index = pos
        cos_sin = cute.make_rmem_tensor(layout, Float32)     # (cos, sin) x 4 pairs
        cute.autovec_copy(cute.make_tensor(table + index * (2 * PAIRS) + rope_chunk * VEC, layout),
                          cos_sin)
        if not valid:
            cos_sin.fill(Float32(float("nan")))
        x_raw = cute.make_rmem_tensor(layout, BFloat16)
        cute.autovec_copy(cute.make_tensor(x + offset, layout), x_raw)
        xf = cute.make_rmem_tensor(layout, Float32)
        xf.store(x_raw.load().to(Float32))
        y = cute.make_rmem_tensor(layout, Float32)
        for q in cutlass.range_constexpr(VEC // 2):
            c, s = cos_sin[2 * q], cos_sin[2 * q + 1]
            x0, x1 = xf[2 * q], xf[2 * q + 1]
            if cutlass.const_expr(self.inverse):
                y[2 * q] = x0 * c + x1 * s
                y[2 * q + 1] = x1 * c - x0 * s
            else:
                y[2 * q] = x0 * c - x1 * s
                y[2 * q + 1] = x0 * s + x1 * c
        y_out = cute.make_rmem_tensor(layout, BFloat16)
        y_out.store(y.load().to(BFloat16))
        cute.autovec_copy(y_out, cute.make_tensor(out + offset, layout))


def kernel_function(spec: RopeSpec):
    """The @cute.kernel whose Python signature the build checks against spec.params."""
    return RopeSm90.kernel_in_place if spec.in_place else RopeSm90.kernel_copy


def specs(cfg, tp: int) -> list[RopeSpec]:
    """The bundle's RoPE kernels: rope_ref.step_specs (GPU tests read that list DSL-free)."""
    return step_specs(cfg, tp)


def compile_spec(spec: RopeSpec, options: str = "--gpu-arch sm_90a"):
    """cute.compile one RoPE kernel with pointer / Int32 arguments only."""
    from cutlass.cute.runtime import make_ptr

    def ptr(dtype, align=16):
        return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=align)

    kernel = RopeSm90(spec)
    tail = (ptr(Float32), ptr(Int32, 4), Int32(1), Int32(1), cuda.CUstream(0))
    if spec.in_place:
        return cute.compile(kernel.launch_in_place, ptr(BFloat16), *tail, options=options)
    return cute.compile(kernel.launch_copy, ptr(BFloat16), ptr(BFloat16), *tail, options=options)
