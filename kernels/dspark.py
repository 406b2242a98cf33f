"""DSpark round kernels for SM90 in the CuTe DSL: aux states, greedy acceptance, ring rollback.

Spec, ABI and reference: `kernels/dspark_ref.py`. All three are tiny (a few kB per step) and run
inside the captured round, so they read the device-side counts and never the host:
- aux: each thread one 16-byte chunk of each of the S streams, fp32 sum in stream order, * 0.25,
  one bf16 rounding; grid-stride over rows * D / 8 chunks;
- accept: one thread per row; it finds its block's first row (a backward scan of at most
  max_block - 1 rows: a sequence's rows are adjacent) and walks the block's drafts forward;
- rollback: one CTA per row, 256 threads of four fp32 NaN each over the 1024-wide ring row.
Nothing precedes the PDL wait: every input is an earlier kernel's output (or the previous
step's), and the outputs may still be read by the previous step's kernels.
"""
from __future__ import annotations

import cutlass
from cuda.bindings import driver as cuda
from cutlass import BFloat16, Float32, Int32, Int64, cute

from kernels.common_ref import BF16_PER_VECTOR, H200_NUM_SMS
from kernels.dspark_ref import (
    CTA_THREADS,
    NAN_BITS,
    RING_WIDTH,
    AcceptSpec,
    AuxSpec,
    RollbackSpec,
    specs_for,
)

VEC = BF16_PER_VECTOR
ONE = (1,)


@cute.jit
def _load(ptr: cute.Pointer, i):
    return cute.make_tensor(ptr + i, cute.make_layout(ONE))[0]


@cute.jit
def _store(ptr: cute.Pointer, i, value):
    cute.make_tensor(ptr + i, cute.make_layout(ONE))[0] = value


@cute.jit
def _block_start(seq_index: cute.Pointer, r: Int32, seq: Int32, max_block: int) -> Int32:
    """The first row of row r's block (rows of a sequence are adjacent, at most max_block)."""
    first = r
    for _ in cutlass.range_constexpr(max_block - 1):
        if first > 0:   # noqa: SIM102 -- nested: the DSL's `and` would load seq_index[-1]
            if _load(seq_index, first - 1) == seq:
                first -= 1
    return first


class AuxSm90:
    """Kernel object for one AuxSpec."""

    def __init__(self, spec: AuxSpec):
        self.spec = spec

    @cute.jit
    def __call__(self, streams: cute.Pointer, aux: cute.Pointer, target: Int32, rows: Int32,
                 stream: cuda.CUstream):
        self.kernel(streams, aux, target, rows).launch(
            grid=[H200_NUM_SMS, 1, 1], block=list(self.spec.block),
            stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, streams: cute.Pointer, aux: cute.Pointer, target: Int32, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        spec = self.spec
        chunk = cute.make_layout((VEC,))
        per_row = spec.chunks_per_row
        i = bidx * CTA_THREADS + tidx

        cute.arch.griddepcontrol_wait()     # the streams come from this layer's mhc_pre

        while i < rows * per_row:
            row = i // per_row
            col = (i - row * per_row) * VEC
            base = row * (spec.streams * spec.width) + col
            held = cute.make_rmem_tensor(chunk, BFloat16)
            cute.autovec_copy(cute.make_tensor(streams + base, chunk), held)
            total = held.load().to(Float32)
            for s in cutlass.range_constexpr(1, spec.streams):
                cute.autovec_copy(cute.make_tensor(streams + (base + s * spec.width), chunk),
                                  held)
                total = total + held.load().to(Float32)
            mean = cute.make_rmem_tensor(chunk, BFloat16)
            mean.store((total * Float32(1.0 / spec.streams)).to(BFloat16))
            out = row * (spec.targets * spec.width) + target * spec.width + col
            cute.autovec_copy(mean, cute.make_tensor(aux + out, chunk))
            i += gdim * CTA_THREADS

        cute.arch.griddepcontrol_launch_dependents()


class AcceptSm90:
    """Kernel object for one AcceptSpec."""

    def __init__(self, spec: AcceptSpec):
        self.spec = spec

    @cute.jit
    def __call__(self, token_ids: cute.Pointer, tokens: cute.Pointer, seq_index: cute.Pointer,
                 slot_mapping: cute.Pointer, accepted: cute.Pointer, bonus: cute.Pointer,
                 context_slots: cute.Pointer, rows: Int32, stream: cuda.CUstream):
        self.kernel(token_ids, tokens, seq_index, slot_mapping, accepted, bonus,
                    context_slots, rows).launch(
            grid=[1, 1, 1], block=list(self.spec.block), stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, token_ids: cute.Pointer, tokens: cute.Pointer, seq_index: cute.Pointer,
               slot_mapping: cute.Pointer, accepted: cute.Pointer, bonus: cute.Pointer,
               context_slots: cute.Pointer, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        r = bidx * CTA_THREADS + tidx

        cute.arch.griddepcontrol_wait()     # tokens: the verify step's greedy pick

        while r < rows:
            seq = _load(seq_index, r)
            slot = Int64(-1)
            if seq >= 0:
                first = _block_start(seq_index, r, seq, self.spec.max_block)
                count, going = Int32(0), Int32(1)
                for k in cutlass.range_constexpr(self.spec.max_block - 1):
                    nxt = first + (k + 1)
                    if going != 0 and nxt < rows:
                        if _load(seq_index, nxt) == seq and \
                                _load(token_ids, nxt) == _load(tokens, first + k):
                            count += 1
                        else:
                            going = Int32(0)
                    else:
                        going = Int32(0)
                if r == first:
                    _store(accepted, seq, count)
                    _store(bonus, seq, _load(tokens, first + count))
                if r - first <= count:
                    slot = _load(slot_mapping, r)
            _store(context_slots, r, slot)
            r += gdim * CTA_THREADS

        cute.arch.griddepcontrol_launch_dependents()


class RollbackSm90:
    """Kernel object for one RollbackSpec."""

    def __init__(self, spec: RollbackSpec):
        self.spec = spec

    @cute.jit
    def __call__(self, ring: cute.Pointer, positions: cute.Pointer, seq_index: cute.Pointer,
                 state_lines: cute.Pointer, accepted: cute.Pointer, rows: Int32,
                 stream: cuda.CUstream):
        self.kernel(ring, positions, seq_index, state_lines, accepted, rows).launch(
            grid=[rows, 1, 1], block=list(self.spec.block), stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, ring: cute.Pointer, positions: cute.Pointer, seq_index: cute.Pointer,
               state_lines: cute.Pointer, accepted: cute.Pointer, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        r, _, _ = cute.arch.block_idx()

        cute.arch.griddepcontrol_wait()     # accepted: the acceptance kernel's output

        seq = _load(seq_index, r)
        if seq >= 0:
            first = _block_start(seq_index, r, seq, self.spec.max_block)
            pos = _load(positions, r)
            if pos - _load(positions, first) > Int64(_load(accepted, seq)):
                line = Int64(_load(state_lines, seq))
                ring_row = line * self.spec.ring_rows + (pos & (self.spec.ring_rows - 1))
                quad = cute.make_layout((4,))
                nan = cute.make_rmem_tensor(quad, Int32)
                for j in cutlass.range_constexpr(4):
                    nan[j] = Int32(NAN_BITS)
                dst = cute.recast_ptr(ring, dtype=Int32) + (ring_row * RING_WIDTH + tidx * 4)
                cute.autovec_copy(nan, cute.make_tensor(dst, quad))

        cute.arch.griddepcontrol_launch_dependents()


_KERNELS = {AuxSpec: AuxSm90, AcceptSpec: AcceptSm90, RollbackSpec: RollbackSm90}


def kernel_function(spec):
    """The @cute.kernel whose Python signature the build checks against spec.params."""
    return _KERNELS[type(spec)].kernel


def specs(cfg, tp: int) -> list:
    del tp
    return specs_for(cfg)


def compile_spec(spec, options: str = "--gpu-arch sm_90a"):
    """cute.compile one DSpark round kernel with pointer / Int32 arguments only."""
    from cutlass.cute.runtime import make_ptr

    def ptr(dtype, align):
        return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=align)

    stream = cuda.CUstream(0)
    if isinstance(spec, AuxSpec):
        return cute.compile(AuxSm90(spec), ptr(BFloat16, 16), ptr(BFloat16, 16), Int32(0),
                            Int32(1), stream, options=options)
    if isinstance(spec, AcceptSpec):
        return cute.compile(AcceptSm90(spec), ptr(Int64, 8), ptr(Int64, 8), ptr(Int32, 4),
                            ptr(Int64, 8), ptr(Int32, 4), ptr(Int64, 8), ptr(Int64, 8),
                            Int32(1), stream, options=options)
    return cute.compile(RollbackSm90(spec), ptr(Float32, 16), ptr(Int64, 8), ptr(Int32, 4),
                        ptr(Int32, 4), ptr(Int32, 4), Int32(1), stream, options=options)
