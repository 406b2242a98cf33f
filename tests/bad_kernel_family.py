"""A kernel family that must NOT build: used by tests/test_build.py to prove the build's checks fail.

- `bad_abi_axpy`: the spec lists 3 parameters, the kernel takes 4 (a wrong ABI).
- `bad_spill_sum`: 320 fp32 values live per thread across a loop; a thread has at most 255
  registers, so ptxas must spill.
"""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
from cuda.bindings import driver as cuda
from cutlass import Float32, Int32, cute

LIVE_VALUES = 320


@dataclass(frozen=True)
class BadSpec:
    name: str
    params: tuple[tuple[str, str], ...]
    block: tuple[int, int, int] = (32, 1, 1)
    smem_bytes: int = 0

    def grid(self, rows: int) -> tuple[int, int, int]:
        return (1, 1, 1)

    def to_dict(self) -> dict:
        return {"name": self.name, "params": [list(p) for p in self.params]}


BAD_ABI = BadSpec("bad_abi_axpy", (("x", "u64"), ("y", "u64"), ("n", "u32")))
BAD_SPILL = BadSpec("bad_spill_sum", (("x", "u64"), ("out", "u64"), ("n", "u32")))


@cute.kernel
def axpy_kernel(x: cute.Pointer, y: cute.Pointer, n: Int32, alpha: Float32):
    tidx, _, _ = cute.arch.thread_idx()
    cute.arch.griddepcontrol_wait()
    if tidx < n:
        tx = cute.make_tensor(x, cute.make_layout((32,)))
        ty = cute.make_tensor(y, cute.make_layout((32,)))
        ty[tidx] = tx[tidx] * alpha + ty[tidx]


@cute.kernel
def spill_kernel(x: cute.Pointer, out: cute.Pointer, n: Int32):
    tidx, _, _ = cute.arch.thread_idx()
    cute.arch.griddepcontrol_wait()
    tx = cute.make_tensor(x, cute.make_layout((LIVE_VALUES, 32), stride=(32, 1)))
    vals = cute.make_rmem_tensor((LIVE_VALUES,), Float32)
    for k in cutlass.range_constexpr(LIVE_VALUES):
        vals[k] = tx[k, tidx]
    acc = Float32(0.0)
    i = Int32(0)
    while i < n:              # every value stays live across a dynamic loop
        for k in cutlass.range_constexpr(LIVE_VALUES):
            vals[k] = vals[k] * acc + vals[(k + 1) % LIVE_VALUES]
            acc = acc + vals[k]
        i += 1
    cute.make_tensor(out, cute.make_layout((32,)))[tidx] = acc


@cute.jit
def launch_axpy(x: cute.Pointer, y: cute.Pointer, n: Int32, alpha: Float32, stream: cuda.CUstream):
    axpy_kernel(x, y, n, alpha).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream,
                                       use_pdl=True)


@cute.jit
def launch_spill(x: cute.Pointer, out: cute.Pointer, n: Int32, stream: cuda.CUstream):
    spill_kernel(x, out, n).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream, use_pdl=True)


def specs(cfg, tp: int) -> list[BadSpec]:
    del cfg, tp
    return [BAD_ABI, BAD_SPILL]


def compile_spec(spec: BadSpec, options: str = "--gpu-arch sm_90a"):
    from cutlass.cute.runtime import make_ptr
    p = make_ptr(Float32, 0, cute.AddressSpace.gmem, assumed_align=16)
    if spec is BAD_ABI or spec.name == BAD_ABI.name:
        return cute.compile(launch_axpy, p, p, Int32(1), Float32(1.0), cuda.CUstream(0),
                            options=options)
    return cute.compile(launch_spill, p, p, Int32(1), cuda.CUstream(0), options=options)
