"""The GPU runtime's front door: Device and Stream here, the rest re-exported from its modules.

    dev = Device(0)                                   # primary context retained and made current
    bundle = Bundle.load(dev, "build/bundle-tiny")    # every cubin loaded, manifest checked
    arena = Arena(dev, [("x", nbytes), ...])          # one cuMemAlloc, named aligned slices
    stream = dev.stream()                             # non-blocking stream
    spec = LaunchSpec(bundle.kernel(name), grid, args=(arena.ptr("x"), rows, eps))
    with Graph.capture(stream) as g:
        spec.launch(stream)
    g.launch(stream)

Everything goes through the driver API (cuda.bindings), imported lazily; every call is checked;
every object has an idempotent close(). There is no global state beyond the driver's own.
"""
from __future__ import annotations

from dataclasses import dataclass

from executor.arena import Arena, Slice, plan_slices
from executor.bundle import Bundle, BundleError, Kernel, read_manifest
from executor.cuda import CudaError, check, driver
from executor.graphs import BUCKETS, Graph, GraphSet, bucket_table
from executor.launch import LaunchSpec
from executor.timing import EventTimer, L2Flusher, host_cost_us

__all__ = [
    "BUCKETS",
    "Arena",
    "Bundle",
    "BundleError",
    "CudaError",
    "Device",
    "DeviceInfo",
    "Event",
    "EventTimer",
    "Graph",
    "GraphSet",
    "Kernel",
    "L2Flusher",
    "LaunchSpec",
    "Slice",
    "Stream",
    "bucket_table",
    "check",
    "host_cost_us",
    "plan_slices",
    "read_manifest",
]


@dataclass(frozen=True)
class DeviceInfo:
    ordinal: int
    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    l2_bytes: int
    max_smem_optin: int
    total_mem_bytes: int


class Stream:
    """A CUDA stream; `handle` is the raw int (cudaStream_t). Owned streams come from
    `Device.stream()`; `Stream.external(int)` wraps a caller's stream without owning it."""

    def __init__(self, cu_handle, owned: bool = True):
        self.cu_handle = cu_handle
        self.handle = int(cu_handle)
        self.owned = owned

    @classmethod
    def external(cls, handle: int) -> Stream:
        """Wrap a stream the caller owns (e.g. torch's current stream); close() leaves it alone."""
        if isinstance(handle, bool) or not isinstance(handle, int) or handle <= 0:
            raise ValueError(f"external stream handle must be a positive int (never the legacy "
                             f"default stream 0), got {handle!r}")
        return cls(driver().CUstream(handle), owned=False)

    def synchronize(self) -> None:
        """Host waits for the stream: setup and tests only, never inside a step."""
        check(driver().cuStreamSynchronize(self.cu_handle))

    def close(self) -> None:
        if self.cu_handle is not None and self.owned:
            check(driver().cuStreamDestroy(self.cu_handle))
        self.cu_handle = None


class Event:
    """A CUDA event without timing, for ordering streams (executor.branches): `record(stream)`
    marks the work enqueued on `stream` so far; `wait(stream)` makes `stream` wait for that mark.
    Under a graph capture the pair becomes a dependency edge of the graph."""

    def __init__(self, cu_handle):
        self.cu_handle = cu_handle

    def record(self, stream: Stream) -> None:
        check(driver().cuEventRecord(self.cu_handle, stream.cu_handle))

    def wait(self, stream: Stream) -> None:
        check(driver().cuStreamWaitEvent(stream.cu_handle, self.cu_handle, 0))

    def close(self) -> None:
        if self.cu_handle is not None:
            check(driver().cuEventDestroy(self.cu_handle))
        self.cu_handle = None


class Device:
    """One GPU: its retained primary context (current on this thread) and what it created."""

    def __init__(self, ordinal: int = 0):
        cu = driver()
        check(cu.cuInit(0))
        count = check(cu.cuDeviceGetCount())
        if not 0 <= ordinal < count:
            raise ValueError(f"device ordinal {ordinal} out of range: {count} CUDA device(s)")
        self.ordinal = ordinal
        self.handle = check(cu.cuDeviceGet(ordinal))
        self.context = check(cu.cuDevicePrimaryCtxRetain(self.handle))
        self._streams: list[Stream] = []
        self._events: list[Event] = []
        try:
            check(cu.cuCtxSetCurrent(self.context))
            self.info = self._query_info()
        except BaseException:
            cu.cuDevicePrimaryCtxRelease(self.handle)
            self.context = None
            raise

    def _query_info(self) -> DeviceInfo:
        cu = driver()
        a = cu.CUdevice_attribute

        def attr(which) -> int:
            return int(check(cu.cuDeviceGetAttribute(which, self.handle)))

        name = check(cu.cuDeviceGetName(256, self.handle))
        name = name.split(b"\0", 1)[0].decode() if isinstance(name, bytes) else str(name)
        return DeviceInfo(
            ordinal=self.ordinal, name=name,
            compute_capability=(attr(a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                                attr(a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)),
            sm_count=attr(a.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
            l2_bytes=attr(a.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
            max_smem_optin=attr(a.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
            total_mem_bytes=int(check(cu.cuDeviceTotalMem(self.handle))))

    @property
    def sm_count(self) -> int:
        return self.info.sm_count

    @property
    def max_smem_optin(self) -> int:
        return self.info.max_smem_optin

    def stream(self) -> Stream:
        """A new non-blocking stream (never the legacy default stream), closed with the device."""
        cu = driver()
        handle = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
        s = Stream(handle)
        self._streams.append(s)
        return s

    def event(self) -> Event:
        """A new event without timing (ordering only), destroyed with the device."""
        cu = driver()
        e = Event(check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)))
        self._events.append(e)
        return e

    def mem_free_bytes(self) -> int:
        free, _total = check(driver().cuMemGetInfo())
        return int(free)

    def synchronize(self) -> None:
        """Host waits for all work of the context: setup, tests and benchmarks only."""
        check(driver().cuCtxSynchronize())

    def close(self) -> None:
        """Destroy this device's events and streams, release the primary context (idempotent)."""
        while self._events:
            self._events.pop().close()
        while self._streams:
            self._streams.pop().close()
        if self.context is not None:
            check(driver().cuDevicePrimaryCtxRelease(self.handle))
            self.context = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
