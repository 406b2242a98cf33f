"""Clamped SwiGLU for SM90 in the CuTe DSL: h = bf16(silu(min(g, L)) * clip(u, -L, L)) per row.

Spec, byte formula, reference and tolerance: `kernels/swiglu_ref.py`. Each thread takes one
8-output chunk per step: a 16-byte load of 8 gates, one of the 8 matching ups (I columns further
on), the routed experts' SwiGLU instructions (`kernels.moe_ptx.swiglu`) in fp32, one cvt to bf16 and
a 16-byte store; a grid stride over rows * I / 8 chunks. PDL: the wait comes first (h13 is the
previous launch's output); the dependents are released right after it, so the next linear
streams its weights while this kernel runs (its own wait still orders it after our stores).

PTX ABI: (u64 h13, u64 out, u32 rows); both 16-byte aligned, out disjoint from h13,
rows * 2I < 2**31.
"""
from __future__ import annotations

from cuda.bindings import driver as cuda
from cutlass import BFloat16, Float32, Int32, cute, range_constexpr

from kernels.common_ref import BF16_PER_VECTOR
from kernels.moe_ptx import swiglu
from kernels.swiglu_ref import CTA_THREADS, SwigluSpec, specs_for

VEC = BF16_PER_VECTOR


class SwigluSm90:
    """Kernel object for one SwigluSpec."""

    def __init__(self, spec: SwigluSpec):
        self.spec = spec
        self.inter = spec.inter
        self.chunks_per_row = spec.chunks_per_row
        self.limit = spec.limit

    @cute.jit
    def __call__(self, h13: cute.Pointer, out: cute.Pointer, rows: Int32,
                 stream: cuda.CUstream):
        self.kernel(h13, out, rows).launch(
            grid=[self.spec.max_ctas, 1, 1], block=[CTA_THREADS, 1, 1], stream=stream,
            use_pdl=True)

    @cute.kernel
    def kernel(self, h13: cute.Pointer, out: cute.Pointer, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        chunk = cute.make_layout((VEC,))
        num_chunks = rows * self.chunks_per_row
        i = bidx * CTA_THREADS + tidx

        cute.arch.griddepcontrol_wait()             # h13 is the previous launch's output
        cute.arch.griddepcontrol_launch_dependents()

        while i < num_chunks:
            # chunk i = (row, c): gates at row * 2I + 8c = 8i + row * I, ups I further, out at 8i
            gate_at = i * VEC + (i // self.chunks_per_row) * self.inter
            gate = cute.make_rmem_tensor(chunk, BFloat16)
            up = cute.make_rmem_tensor(chunk, BFloat16)
            cute.autovec_copy(cute.make_tensor(h13 + gate_at, chunk), gate)
            cute.autovec_copy(cute.make_tensor(h13 + gate_at + self.inter, chunk), up)
            g = gate.load().to(Float32)
            u = up.load().to(Float32)
            act = cute.make_rmem_tensor(chunk, Float32)
            for j in range_constexpr(VEC):
                act[j] = swiglu(g[j], u[j], self.limit)
            h = cute.make_rmem_tensor(chunk, BFloat16)
            h.store(act.load().to(BFloat16))
            cute.autovec_copy(h, cute.make_tensor(out + i * VEC, chunk))
            i += gdim * CTA_THREADS


def kernel_function(spec: SwigluSpec):
    """The @cute.kernel whose Python signature the build checks against spec.params."""
    del spec
    return SwigluSm90.kernel


def specs(cfg, tp: int) -> list[SwigluSpec]:
    return specs_for(cfg, tp)


def compile_spec(spec: SwigluSpec, options: str = "--gpu-arch sm_90a"):
    """cute.compile one SwiGLU with pointer / Int32 arguments only."""
    from cutlass.cute.runtime import make_ptr

    def ptr():
        return make_ptr(BFloat16, 0, cute.AddressSpace.gmem, assumed_align=16)

    return cute.compile(SwigluSm90(spec), ptr(), ptr(), Int32(1), cuda.CUstream(0),
                        options=options)
