"""Elementwise kernels for SM90 in the CuTe DSL: residual add and stream broadcast.

Residual add: out = bf16(float(a) + float(b)) over [rows, D].

Spec, byte formula and reference: `kernels/elementwise_ref.py`. Each thread takes one 8-element
chunk per step (a 16-byte bf16 load, or two for f32 `a`), with a grid stride over rows * D / 8
chunks and one full wave of CTAs. Nothing precedes the PDL wait: both inputs come from earlier
kernels (the all-reduce and the previous residual).

PTX ABI: (u64 a, u64 b, u64 out, u32 rows); all three 16-byte aligned (32 for f32 `a` is not
needed: two 16-byte loads), out may alias b, rows * D < 2**31.

Stream broadcast: out[r, s, :] = x[r, :] (the first layer's residual streams from the embedding).
Same walk: each thread loads one 16-byte chunk of x and stores it into each of the S streams.
PTX ABI: (u64 x, u64 out, u32 rows); 16-byte aligned, out does not alias x, rows * S * D < 2**31.
"""
from __future__ import annotations

import cutlass
from cuda.bindings import driver as cuda
from cutlass import BFloat16, Float32, Int32, cute

from kernels.common_ref import BF16_PER_VECTOR
from kernels.elementwise_ref import (
    CTA_THREADS,
    BroadcastSpec,
    ResidualAddSpec,
    make_broadcast_spec,
    make_spec,
)

VEC = BF16_PER_VECTOR
_A_TYPES = {"bf16": BFloat16, "f32": Float32}


class ResidualAddSm90:
    """Kernel object for one ResidualAddSpec."""

    def __init__(self, spec: ResidualAddSpec):
        self.spec = spec
        self.chunks_per_row = spec.chunks_per_row
        self.a_type = _A_TYPES[spec.a_dtype]

    @cute.jit
    def __call__(self, a: cute.Pointer, b: cute.Pointer, out: cute.Pointer, rows: Int32,
                 stream: cuda.CUstream):
        self.kernel(a, b, out, rows).launch(
            grid=[self.spec.max_ctas, 1, 1], block=[CTA_THREADS, 1, 1], stream=stream,
            use_pdl=True)

    @cute.kernel
    def kernel(self, a: cute.Pointer, b: cute.Pointer, out: cute.Pointer, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        chunk = cute.make_layout((VEC,))
        num_chunks = rows * self.chunks_per_row
        i = bidx * CTA_THREADS + tidx

        cute.arch.griddepcontrol_wait()     # a and b are earlier kernels' outputs

        while i < num_chunks:
            a_raw = cute.make_rmem_tensor(chunk, self.a_type)
            b_raw = cute.make_rmem_tensor(chunk, BFloat16)
            cute.autovec_copy(cute.make_tensor(a + i * VEC, chunk), a_raw)
            cute.autovec_copy(cute.make_tensor(b + i * VEC, chunk), b_raw)
            total = cute.make_rmem_tensor(chunk, BFloat16)
            total.store((a_raw.load().to(Float32) + b_raw.load().to(Float32)).to(BFloat16))
            cute.autovec_copy(total, cute.make_tensor(out + i * VEC, chunk))
            i += gdim * CTA_THREADS

        cute.arch.griddepcontrol_launch_dependents()


class BroadcastStreamsSm90:
    """Kernel object for one BroadcastSpec."""

    def __init__(self, spec: BroadcastSpec):
        self.spec = spec
        self.chunks_per_row = spec.chunks_per_row
        self.row_elems = spec.width
        self.streams = spec.streams

    @cute.jit
    def __call__(self, x: cute.Pointer, out: cute.Pointer, rows: Int32, stream: cuda.CUstream):
        self.kernel(x, out, rows).launch(
            grid=[self.spec.max_ctas, 1, 1], block=[CTA_THREADS, 1, 1], stream=stream,
            use_pdl=True)

    @cute.kernel
    def kernel(self, x: cute.Pointer, out: cute.Pointer, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        chunk = cute.make_layout((VEC,))
        num_chunks = rows * self.chunks_per_row
        i = bidx * CTA_THREADS + tidx

        cute.arch.griddepcontrol_wait()     # x is the previous kernel's output

        while i < num_chunks:
            row = i // self.chunks_per_row
            col = (i - row * self.chunks_per_row) * VEC
            held = cute.make_rmem_tensor(chunk, BFloat16)
            cute.autovec_copy(cute.make_tensor(x + i * VEC, chunk), held)
            base = row * (self.streams * self.row_elems) + col
            for s in cutlass.range_constexpr(self.streams):
                cute.autovec_copy(held, cute.make_tensor(out + (base + s * self.row_elems),
                                                         chunk))
            i += gdim * CTA_THREADS

        cute.arch.griddepcontrol_launch_dependents()


def kernel_function(spec):
    """The @cute.kernel whose Python signature the build checks against spec.params."""
    if isinstance(spec, BroadcastSpec):
        return BroadcastStreamsSm90.kernel
    return ResidualAddSm90.kernel


def specs(cfg, tp: int) -> list:
    """The residual add at the hidden width (f32 partials + bf16 residual, and bf16 + bf16) and
    the broadcast of the embedding into the hc_mult residual streams."""
    del tp
    return ([make_spec(cfg.hidden_size, a_dtype) for a_dtype in ("f32", "bf16")]
            + [make_broadcast_spec(cfg.hidden_size, cfg.hc_mult)])


def compile_spec(spec, options: str = "--gpu-arch sm_90a"):
    """cute.compile one elementwise kernel with pointer / Int32 arguments only."""
    from cutlass.cute.runtime import make_ptr

    def ptr(dtype):
        return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=16)

    if isinstance(spec, BroadcastSpec):
        return cute.compile(BroadcastStreamsSm90(spec), ptr(BFloat16), ptr(BFloat16), Int32(1),
                            cuda.CUstream(0), options=options)
    return cute.compile(ResidualAddSm90(spec), ptr(_A_TYPES[spec.a_dtype]), ptr(BFloat16),
                        ptr(BFloat16), Int32(1), cuda.CUstream(0), options=options)

