"""Runtime probe kernels in the CuTe DSL: stream read, %globaltimer spin, PDL flag pair, chain step.

ABIs, grid rules and references live in `kernels/probes_ref.py` (the runtime imports only that).
All kernels take pointers and 32-bit scalars only, so a plain cuLaunchKernelEx launches the cubin.

PDL placement:
- stream_read / spin wait (`griddepcontrol.wait`) before doing anything an earlier kernel could
  race with, and trigger their dependents only at exit (implicitly), like model kernels.
- pdl_producer triggers `launch_dependents` FIRST, then spins, then publishes the flag: a consumer
  launched with the PDL attribute starts while the producer still spins.
- pdl_consumer reads the flag BEFORE its wait (what it sees proves or disproves overlap), then waits
  and reads it again (must then be the producer's token: the wait orders memory).
- chain_step triggers then waits at entry (the cheapest legal PDL kernel), then CTA 0 adds 1.
"""
from __future__ import annotations

import cutlass
from cuda.bindings import driver as cuda
from cutlass import Int32, Int64, Uint32, cute

from kernels.probes_ref import (
    ALL_PROBES,
    STREAM_THREADS,
    STREAM_UNROLL,
    WARP,
    ProbeSpec,
)

VEC_WORDS = 4  # 4 x u32 = one 16-byte load


@cute.kernel
def stream_read_kernel(src: cute.Pointer, partials: cute.Pointer, num_vectors: Int32):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    gdim, _, _ = cute.arch.grid_dim()
    # (VEC_WORDS, num_vectors): column i is the i-th 16-byte vector of src
    vecs = cute.make_tensor(
        src, cute.make_layout((VEC_WORDS, num_vectors), stride=(1, VEC_WORDS)))
    acc = cute.make_rmem_tensor(VEC_WORDS, Uint32)
    acc.fill(0)
    cute.arch.griddepcontrol_wait()
    stride = gdim * STREAM_THREADS
    i = bidx * STREAM_THREADS + tidx
    # UNROLL independent loads are issued before their results are folded: several in flight.
    while i + (STREAM_UNROLL - 1) * stride < num_vectors:
        v0 = vecs[(None, i)].load()
        v1 = vecs[(None, i + stride)].load()
        v2 = vecs[(None, i + 2 * stride)].load()
        v3 = vecs[(None, i + 3 * stride)].load()
        acc.store(acc.load() ^ v0 ^ v1 ^ v2 ^ v3)
        i += STREAM_UNROLL * stride
    while i < num_vectors:
        acc.store(acc.load() ^ vecs[(None, i)].load())
        i += stride
    word = acc[0] ^ acc[1] ^ acc[2] ^ acc[3]
    for k in cutlass.range_constexpr(5):
        word = word ^ cute.arch.shuffle_sync_bfly(word, offset=16 >> k)
    if tidx % WARP == 0:
        out = cute.make_tensor(partials, cute.make_layout(gdim * (STREAM_THREADS // WARP)))
        out[bidx * (STREAM_THREADS // WARP) + tidx // WARP] = word


@cute.jit
def _spin_until(spin_ns: Int32):
    start = cute.arch.globaltimer()
    now = start
    while now - start < Int64(spin_ns):
        now = cute.arch.globaltimer()
    return now - start


@cute.kernel
def spin_kernel(out: cute.Pointer, spin_ns: Int32):
    tidx, _, _ = cute.arch.thread_idx()
    cute.arch.griddepcontrol_wait()
    elapsed = _spin_until(spin_ns)
    if tidx == 0:
        cute.make_tensor(out, cute.make_layout(1))[0] = elapsed


@cute.kernel
def pdl_producer_kernel(flag: cute.Pointer, spin_ns: Int32, token: Int32):
    tidx, _, _ = cute.arch.thread_idx()
    cute.arch.griddepcontrol_launch_dependents()   # let the consumer start while we spin
    _spin_until(spin_ns)
    if tidx == 0:
        cute.arch.store(flag.llvm_ptr, Uint32(token), sem="release", scope="gpu")


@cute.kernel
def pdl_consumer_kernel(flag: cute.Pointer, out: cute.Pointer, token: Int32):
    tidx, _, _ = cute.arch.thread_idx()
    result = cute.make_tensor(out, cute.make_layout(2))
    if tidx == 0:
        before = cute.arch.load(flag.llvm_ptr, Uint32, sem="relaxed", scope="gpu")
        result[0] = Uint32(before == Uint32(token))
    cute.arch.griddepcontrol_wait()                 # the producer grid has finished and flushed
    if tidx == 0:
        result[1] = cute.arch.load(flag.llvm_ptr, Uint32, sem="relaxed", scope="gpu")


@cute.kernel
def chain_step_kernel(counter: cute.Pointer):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    cute.arch.griddepcontrol_launch_dependents()
    cute.arch.griddepcontrol_wait()
    if bidx == 0 and tidx == 0:
        c = cute.make_tensor(counter, cute.make_layout(1))
        c[0] = c[0] + Uint32(1)


# ---- launchers (used by cute.compile only; the runtime launches the cubin itself) ----------------

@cute.jit
def launch_stream_read(src: cute.Pointer, partials: cute.Pointer, num_vectors: Int32,
                       stream: cuda.CUstream, grid_x: cutlass.Constexpr):
    stream_read_kernel(src, partials, num_vectors).launch(
        grid=[grid_x, 1, 1], block=[STREAM_THREADS, 1, 1], stream=stream, use_pdl=True)


@cute.jit
def launch_spin(out: cute.Pointer, spin_ns: Int32, stream: cuda.CUstream):
    spin_kernel(out, spin_ns).launch(grid=[1, 1, 1], block=[WARP, 1, 1], stream=stream,
                                     use_pdl=True)


@cute.jit
def launch_pdl_producer(flag: cute.Pointer, spin_ns: Int32, token: Int32, stream: cuda.CUstream):
    pdl_producer_kernel(flag, spin_ns, token).launch(
        grid=[1, 1, 1], block=[WARP, 1, 1], stream=stream, use_pdl=True)


@cute.jit
def launch_pdl_consumer(flag: cute.Pointer, out: cute.Pointer, token: Int32,
                        stream: cuda.CUstream):
    pdl_consumer_kernel(flag, out, token).launch(
        grid=[1, 1, 1], block=[WARP, 1, 1], stream=stream, use_pdl=True)


@cute.jit
def launch_chain_step(counter: cute.Pointer, stream: cuda.CUstream, grid_x: cutlass.Constexpr,
                      threads: cutlass.Constexpr):
    chain_step_kernel(counter).launch(grid=[grid_x, 1, 1], block=[threads, 1, 1], stream=stream,
                                      use_pdl=True)


def specs(cfg=None, tp: int = 1) -> list[ProbeSpec]:
    """The probes do not depend on the model: the same five kernels for every config."""
    del cfg, tp
    return list(ALL_PROBES)


def _ptr(dtype, align: int = 16):
    from cutlass.cute.runtime import make_ptr
    return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=align)


def compile_spec(spec: ProbeSpec, options: str = "--gpu-arch sm_90a"):
    """cute.compile one probe for sm_90a with pointer / Int32 arguments only."""
    stream = cuda.CUstream(0)
    if spec.kind == "stream_read":
        return cute.compile(launch_stream_read, _ptr(Uint32), _ptr(Uint32, 4), Int32(0), stream,
                            spec.grid_x, options=options)
    if spec.kind == "spin":
        return cute.compile(launch_spin, _ptr(Int64, 8), Int32(0), stream, options=options)
    if spec.kind == "pdl_producer":
        return cute.compile(launch_pdl_producer, _ptr(Uint32, 4), Int32(0), Int32(0), stream,
                            options=options)
    if spec.kind == "pdl_consumer":
        return cute.compile(launch_pdl_consumer, _ptr(Uint32, 4), _ptr(Uint32, 4), Int32(0),
                            stream, options=options)
    if spec.kind == "chain_step":
        return cute.compile(launch_chain_step, _ptr(Uint32, 4), stream, spec.grid_x,
                            spec.block[0], options=options)
    raise ValueError(f"unknown probe kind {spec.kind!r} in spec {spec.name}")
