"""Host memory that stands in for device memory, so launch lists can be emulated on a CPU.

`AddressSpace` hands out fake device addresses (regions 2^40 apart, never 0) for numpy byte
buffers and resolves any (address, bytes) back to a view, raising `OutOfBounds` when a range
leaves its region: an emulated kernel that reads or writes past a buffer fails exactly where the
GPU would have read garbage. `HostArena` is `executor.arena.Arena` on that space (same layout
rule, same methods: ptr, nbytes, view, upload, download, fill), so code that builds launches on an
Arena builds the same launches, with host addresses, on a HostArena. `ManifestBundle` is a
bundle's manifest without the cubins: `kernel(name)` gives the KernelRecord (name, params, block,
smem), which is all a LaunchSpec needs until it is launched.
"""
from __future__ import annotations

import numpy as np

from executor.arena import MIN_ALIGN, SliceTable
from executor.bundle import KernelRecord, read_manifest

REGION_STRIDE = 1 << 40


class OutOfBounds(IndexError):
    """An emulated access left every region of the address space."""


class AddressSpace:
    """Fake device addresses for host byte buffers."""

    def __init__(self):
        self._regions: list[tuple[int, str, np.ndarray]] = []   # (base, name, uint8 buffer)

    def add(self, name: str, buffer: np.ndarray) -> int:
        """Register a C-contiguous array's bytes; returns its fake device address."""
        if not isinstance(buffer, np.ndarray) or not buffer.flags.c_contiguous:
            raise TypeError(f"address space region {name!r}: need a C-contiguous numpy array")
        base = REGION_STRIDE * (len(self._regions) + 1)
        self._regions.append((base, name, buffer.reshape(-1).view(np.uint8)))
        return base

    def region(self, ptr: int) -> tuple[int, str, np.ndarray]:
        index = ptr // REGION_STRIDE - 1
        if not isinstance(ptr, int) or not 0 <= index < len(self._regions):
            raise OutOfBounds(f"address {ptr:#x} is in no region of the address space")
        return self._regions[index]

    def bytes(self, ptr: int, nbytes: int) -> np.ndarray:
        """The uint8 view of [ptr, ptr + nbytes)."""
        base, name, buf = self.region(ptr)
        start = ptr - base
        if nbytes < 0 or start + nbytes > buf.size:
            raise OutOfBounds(f"access [{start}, {start + nbytes}) of region {name!r} "
                              f"({buf.size} bytes) at address {ptr:#x}")
        return buf[start:start + nbytes]

    def array(self, ptr: int, dtype, shape) -> np.ndarray:
        """A writable view of `shape` elements of `dtype` starting at `ptr` (must be aligned)."""
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        count = int(np.prod(shape, dtype=np.int64))
        if ptr % dtype.alignment:
            raise ValueError(f"address {ptr:#x} is not aligned for {dtype}")
        return self.bytes(ptr, count * dtype.itemsize).view(dtype).reshape(shape)

    def name_of(self, ptr: int) -> str:
        base, name, _ = self.region(ptr)
        return f"{name}+{ptr - base}"


class HostArena(SliceTable):
    """`Arena`'s interface over one host buffer registered in an AddressSpace."""

    def __init__(self, space: AddressSpace, requests, align: int = MIN_ALIGN, name: str = "arena"):
        super().__init__(requests, align)
        self.space = space
        self.buffer = np.zeros(self.total_bytes, np.uint8)
        self.base = space.add(name, self.buffer)

    def ptr(self, name: str) -> int:
        return self.base + self._slice(name).offset

    def view(self, name: str, dtype, shape=None) -> np.ndarray:
        s = self._slice(name)
        dtype = np.dtype(dtype)
        shape = (s.nbytes // dtype.itemsize,) if shape is None else tuple(shape)
        if int(np.prod(shape)) * dtype.itemsize > s.nbytes:
            raise ValueError(f"view {shape} {dtype} of slice {name!r} exceeds its {s.nbytes} bytes")
        return self.space.array(self.ptr(name), dtype, shape)

    def upload(self, name: str, host) -> None:
        raw = np.ascontiguousarray(host).view(np.uint8).reshape(-1)
        if raw.size > self.nbytes(name):
            raise ValueError(f"upload to slice {name!r}: {raw.size} bytes, it holds "
                             f"{self.nbytes(name)}")
        self.view(name, np.uint8, raw.shape)[...] = raw

    def download(self, name: str, dtype, shape) -> np.ndarray:
        return self.view(name, dtype, shape).copy()

    def fill(self, name: str, byte: int) -> None:
        self.view(name, np.uint8)[...] = byte

    def zero(self) -> None:
        self.buffer[...] = 0

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        pass


class ManifestBundle:
    """A bundle's manifest read on a CPU: kernel records by name, nothing loaded."""

    def __init__(self, path):
        self.manifest = read_manifest(path)

    def kernel(self, name: str) -> KernelRecord:
        try:
            return self.manifest.kernels[name]
        except KeyError:
            raise KeyError(f"bundle {self.manifest.path.parent} has no kernel {name!r}") from None

    def names(self) -> list[str]:
        return sorted(self.manifest.kernels)

    def close(self) -> None:
        pass
