"""LaunchSpec: a kernel launch validated against its manifest ABI and packed once, launched cheaply.

Constructing a LaunchSpec checks the grid and every argument against the kernel's parameter list
(count; u64 pointers as non-null ints; u32/i32 ranges; f32 finite-representable) and packs the
`void*[]` parameter array with ctypes ONCE. `launch(stream)` is then a single
`cuLaunchKernelEx`, with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION when `pdl` and
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION when `cluster` is given (the DSL does not record a cluster
shape in the cubin, so a cluster kernel's launch must say it).
"""
from __future__ import annotations

import ctypes
import math

from executor.cuda import check, driver

_CTYPE = {"u64": ctypes.c_uint64, "u32": ctypes.c_uint32, "i32": ctypes.c_int32,
          "f32": ctypes.c_float}
_INT_RANGE = {"u64": (1, 2**64 - 1), "u32": (0, 2**32 - 1), "i32": (-2**31, 2**31 - 1)}
_F32_MAX = 3.4028234663852886e38
_GRID_LIMITS = (2**31 - 1, 65535, 65535)


def _check_arg(kernel_name: str, pname: str, ptype: str, value):
    where = f"kernel {kernel_name!r} param {pname!r} ({ptype})"
    if ptype == "f32":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{where}: expected a float, got {type(value).__name__} {value!r}")
        if math.isfinite(value) and abs(value) > _F32_MAX:
            raise ValueError(f"{where}: {value!r} overflows float32")
        return
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "a device pointer (int)" if ptype == "u64" else "an int"
        raise TypeError(f"{where}: expected {kind}, got {type(value).__name__} {value!r}")
    lo, hi = _INT_RANGE[ptype]
    if not lo <= value <= hi:
        what = "a non-null pointer" if ptype == "u64" else f"in [{lo}, {hi}]"
        raise ValueError(f"{where}: expected {what}, got {value}")


def _check_grid(kernel_name: str, grid) -> tuple[int, int, int]:
    if not isinstance(grid, (tuple, list)) or not 1 <= len(grid) <= 3:
        raise ValueError(f"kernel {kernel_name!r}: grid must be 1-3 ints, got {grid!r}")
    g = tuple(grid) + (1,) * (3 - len(grid))
    for dim, lim in zip(g, _GRID_LIMITS):
        if isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= lim:
            raise ValueError(f"kernel {kernel_name!r}: grid {grid!r} out of range "
                             f"(each dim in [1, {lim}])")
    return g


def pack_params(kernel_name: str, params, args):
    """Check args against the ABI; return (ctypes values, void*[] array), kept alive together."""
    args = tuple(args)
    if len(args) != len(params):
        names = ", ".join(f"{n}:{t}" for n, t in params)
        raise TypeError(f"kernel {kernel_name!r} takes {len(params)} args ({names}), "
                        f"got {len(args)}")
    values = []
    for (pname, ptype), value in zip(params, args):
        _check_arg(kernel_name, pname, ptype, value)
        values.append(_CTYPE[ptype](value))
    array = (ctypes.c_void_p * max(1, len(values)))(
        *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
    return values, array


class LaunchSpec:
    """One launch of one kernel with fixed arguments: validated and packed at construction."""

    def __init__(self, kernel, grid, args, pdl: bool = True, smem: int | None = None,
                 cluster=None):
        self.kernel = kernel
        self.grid = _check_grid(kernel.name, grid)
        self.cluster = None if cluster is None else _check_grid(kernel.name, cluster)
        if self.cluster and any(g % c for g, c in zip(self.grid, self.cluster)):
            raise ValueError(f"kernel {kernel.name!r}: grid {self.grid} is not a multiple of the "
                             f"cluster {self.cluster}")
        self.args = tuple(args)
        self.pdl = bool(pdl)
        self.smem = kernel.smem_bytes if smem is None else smem
        if isinstance(self.smem, bool) or not isinstance(self.smem, int) or self.smem < 0:
            raise ValueError(f"kernel {kernel.name!r}: smem must be an int >= 0, got {smem!r}")
        if self.smem > max(kernel.smem_bytes, 48 * 1024):
            raise ValueError(f"kernel {kernel.name!r}: {self.smem} B of dynamic shared memory "
                             f"exceeds the {kernel.smem_bytes} B its manifest opted in to")
        self._values, self._array = pack_params(kernel.name, kernel.params, self.args)
        self._params_addr = ctypes.addressof(self._array)
        self._config = None
        self._stream = None
        self._launch_ex = None

    def _build_config(self, stream_handle):
        cu = driver()
        cfg = cu.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = self.grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = self.kernel.block
        cfg.sharedMemBytes = self.smem
        cfg.hStream = stream_handle
        self._launch_ex = cu.cuLaunchKernelEx
        ids, attrs = cu.CUlaunchAttributeID, []
        if self.pdl:
            attr = cu.CUlaunchAttribute()
            attr.id = ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            attrs.append(attr)
        if self.cluster:
            attr = cu.CUlaunchAttribute()
            attr.id = ids.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            dim = attr.value.clusterDim
            dim.x, dim.y, dim.z = self.cluster
            attrs.append(attr)
        cfg.attrs = attrs
        cfg.numAttrs = len(attrs)
        return cfg

    def launch(self, stream) -> None:
        """One cuLaunchKernelEx on `stream` (a Stream; its config is cached per stream)."""
        if stream is not self._stream:
            self._config = self._build_config(stream.cu_handle)
            self._stream = stream
        err, = self._launch_ex(self._config, self.kernel.function, self._params_addr, 0)
        if err != 0:
            check((err,), call=f"cuLaunchKernelEx[{self.kernel.name}]")

    def __repr__(self) -> str:
        return (f"LaunchSpec({self.kernel.name}, grid={self.grid}, block={self.kernel.block}, "
                f"pdl={self.pdl}, cluster={self.cluster}, args={self.args})")
