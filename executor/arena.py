"""One device allocation carved into named, aligned, disjoint slices (the executor's only memory).

Every buffer a step touches lives in one `cuMemAlloc`, allocated before any graph capture, so
steady-state decode never allocates or frees (cuMemFree synchronizes). The layout is planned on
the host (`plan_slices`, CPU-testable) and fixed for the arena's life; graphs record raw pointers.
"""
from __future__ import annotations

from dataclasses import dataclass

from executor.cuda import check, driver

MIN_ALIGN = 256  # cudaMalloc's guarantee; 16-byte vector loads and TMA need no more


@dataclass(frozen=True)
class Slice:
    """One named region of the arena: [offset, offset + nbytes) bytes from its base."""

    name: str
    offset: int
    nbytes: int
    comment: str = ""           # shape/dtype, e.g. "bf16 [192, 5120]"

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def _align_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


def plan_slices(requests, align: int = MIN_ALIGN) -> tuple[dict[str, Slice], int]:
    """Lay out `(name, nbytes[, comment])` requests back to back, each start aligned to `align`.

    Returns (slices by name, total bytes). Raises ValueError naming the bad request: duplicate
    or empty names, non-integer or non-positive sizes, an alignment below 256 or not a power of 2.
    """
    if not isinstance(align, int) or align < MIN_ALIGN or align & (align - 1):
        raise ValueError(f"arena alignment must be a power of two >= {MIN_ALIGN}, got {align!r}")
    slices: dict[str, Slice] = {}
    offset = 0
    for i, req in enumerate(requests):
        if not isinstance(req, (tuple, list)) or len(req) not in (2, 3):
            raise ValueError(f"arena request #{i} must be (name, nbytes[, comment]), got {req!r}")
        name, nbytes = req[0], req[1]
        comment = req[2] if len(req) == 3 else ""
        if not isinstance(name, str) or not name:
            raise ValueError(f"arena request #{i}: name must be a non-empty string, got {name!r}")
        if name in slices:
            raise ValueError(f"arena slice {name!r} requested twice")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"arena slice {name!r}: nbytes must be a positive int, got {nbytes!r}")
        offset = _align_up(offset, align)
        slices[name] = Slice(name, offset, nbytes, str(comment))
        offset += nbytes
    if not slices:
        raise ValueError("an arena needs at least one slice")
    return slices, _align_up(offset, align)


class SliceTable:
    """The planned slices of an arena by name (shared by Arena and the emulator's HostArena)."""

    def __init__(self, requests, align: int = MIN_ALIGN):
        self.slices, self.total_bytes = plan_slices(requests, align)
        self.align = align

    def _slice(self, name: str) -> Slice:
        try:
            return self.slices[name]
        except KeyError:
            raise KeyError(f"arena has no slice {name!r}; slices: {sorted(self.slices)}") from None

    def nbytes(self, name: str) -> int:
        return self._slice(name).nbytes

    def describe(self) -> str:
        """One line per slice: name, offset, bytes, comment."""
        return "\n".join(f"{s.name:24s} @{s.offset:>12d} {s.nbytes:>12d} B  {s.comment}"
                         for s in self.slices.values())


class Arena(SliceTable):
    """One cuMemAlloc holding every slice; `ptr(name)` is the raw device address kernels take."""

    def __init__(self, device, requests, align: int = MIN_ALIGN):
        super().__init__(requests, align)
        self.device = device
        self.base = 0
        cu = driver()
        self._devptr = check(cu.cuMemAlloc(self.total_bytes))
        self.base = int(self._devptr)

    def ptr(self, name: str) -> int:
        if not self.base:
            raise RuntimeError(f"arena is closed (asked for slice {name!r})")
        return self.base + self._slice(name).offset

    def view(self, name: str, dtype, shape=None):
        """A cupy.ndarray over the slice (tests and uploads; never inside a step)."""
        import cupy as cp
        import numpy as np

        s = self._slice(name)
        dtype = np.dtype(dtype)
        count = s.nbytes // dtype.itemsize
        shape = (count,) if shape is None else tuple(shape)
        if int(np.prod(shape)) * dtype.itemsize > s.nbytes:
            raise ValueError(f"view {shape} {dtype} of slice {name!r} exceeds its {s.nbytes} bytes")
        mem = cp.cuda.UnownedMemory(self.ptr(name), s.nbytes, self)
        return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(mem, 0))

    def upload(self, name: str, host) -> None:
        """Copy a host array's bytes to the start of a slice (tests and set-up; never in a step)."""
        import cupy as cp
        import numpy as np

        raw = np.ascontiguousarray(host).view(np.uint8).reshape(-1)
        if raw.size > self.nbytes(name):
            raise ValueError(f"upload to slice {name!r}: {raw.size} bytes, it holds "
                             f"{self.nbytes(name)}")
        self.view(name, np.uint8, raw.shape)[...] = cp.asarray(raw)

    def download(self, name: str, dtype, shape):
        """The slice's first bytes as a host array of `dtype` and `shape`."""
        return self.view(name, dtype, shape).get()

    def fill(self, name: str, byte: int) -> None:
        """Every byte of a slice set to `byte` (0xFF poisons: NaN as bf16/f32, -1 as int)."""
        import numpy as np

        self.view(name, np.uint8)[...] = byte

    def synchronize(self) -> None:
        """Wait for every copy into the arena (uploads go through CuPy's stream, not the
        caller's: a step on another stream must not start before they land)."""
        check(driver().cuCtxSynchronize())

    def zero(self) -> None:
        """Every byte of the arena 0 (counters and flags the kernels expect zero when bound)."""
        check(driver().cuMemsetD8(self._devptr, 0, self.total_bytes))

    def close(self) -> None:
        if self.base:
            check(driver().cuMemFree(self._devptr))
            self.base = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
