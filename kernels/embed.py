"""Embedding lookup for SM90 in the CuTe DSL: R token ids -> R BF16 rows of this rank's table or 0.

Spec, byte formula and reference: `kernels/embed_ref.py` (vocab-parallel table with AR-0 after it,
or the whole table replicated, which needs no AR-0: the same kernel, another spec). Each thread
copies one 16-byte vector per step, grid-stride over R * D/8 vectors, one wave of CTAs. The ids
may be the previous step's argmax, so nothing precedes the PDL wait.

The table may live in device memory or in pinned host memory mapped into the device's address
space (UVA): the kernel only dereferences the pointer, so either works (host reads go over PCIe).

PTX ABI: (u64 token_ids, u64 table, u64 out, u32 rows, u32 vocab_offset); table and out 16-byte
aligned, table_rows * D < 2**31.
"""
from __future__ import annotations

from cuda.bindings import driver as cuda
from cutlass import BFloat16, Int32, cute

from kernels.common_ref import BF16_PER_VECTOR
from kernels.embed_ref import CTA_THREADS, EmbedSpec, embed_specs

VEC = BF16_PER_VECTOR


class EmbedSm90:
    """Kernel object for one EmbedSpec."""

    def __init__(self, spec: EmbedSpec):
        self.spec = spec
        self.width = spec.width
        self.table_rows = spec.table_rows
        self.vectors_per_row = spec.vectors_per_row

    @cute.jit
    def __call__(self, token_ids: cute.Pointer, table: cute.Pointer, out: cute.Pointer,
                 rows: Int32, vocab_offset: Int32, stream: cuda.CUstream):
        self.kernel(token_ids, table, out, rows, vocab_offset).launch(
            grid=[self.spec.max_ctas, 1, 1], block=list(self.spec.block), stream=stream,
            use_pdl=True)

    @cute.kernel
    def kernel(self, token_ids: cute.Pointer, table: cute.Pointer, out: cute.Pointer,
               rows: Int32, vocab_offset: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        chunk = cute.make_layout((VEC,))
        total = rows * self.vectors_per_row
        i = bidx * CTA_THREADS + tidx

        cute.arch.griddepcontrol_wait()     # the ids may be the previous kernel's argmax

        while i < total:
            row = i // self.vectors_per_row
            vec = i - row * self.vectors_per_row
            local = cute.make_tensor(token_ids + row, cute.make_layout((1,)))[0] - vocab_offset
            values = cute.make_rmem_tensor(chunk, BFloat16)
            values.fill(0.0)
            if local >= 0:  # noqa: SIM102 - nested: a dynamic `if` cannot short-circuit
                if local < self.table_rows:
                    src = table + cute.assume(local * self.width + vec * VEC, divby=VEC)
                    cute.autovec_copy(cute.make_tensor(src, chunk), values)
            dst = out + cute.assume(row * self.width + vec * VEC, divby=VEC)
            cute.autovec_copy(values, cute.make_tensor(dst, chunk))
            i += gdim * CTA_THREADS

        cute.arch.griddepcontrol_launch_dependents()


def kernel_function(spec: EmbedSpec):
    """The @cute.kernel whose Python signature the build checks against spec.params."""
    del spec
    return EmbedSm90.kernel


def specs(cfg, tp: int) -> list[EmbedSpec]:
    return embed_specs(cfg, tp)


def compile_spec(spec: EmbedSpec, options: str = "--gpu-arch sm_90a"):
    """cute.compile one embedding lookup with pointer / Int32 arguments only."""
    from cutlass.cute.runtime import make_ptr

    def ptr(dtype, align):
        return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=align)

    return cute.compile(EmbedSm90(spec), ptr(Int32, 4), ptr(BFloat16, 16), ptr(BFloat16, 16),
                        Int32(1), Int32(0), cuda.CUstream(0), options=options)
