"""Benchmark timing: CUDA-event medians on the device, perf_counter medians on the host, L2 flush.

Device time: each rep is bracketed by its own event pair, all reps are queued back to back, then the
host waits once and reads every pair: the median is robust to the odd slow rep. An optional L2
flush (a sweep over a buffer twice the L2) runs between reps, outside the events, so each timed rep
reads its inputs from HBM.
Host time: the median, over batches, of the wall time of `batch` calls divided by `batch`; the
device is drained between batches so no call ever blocks on a full launch queue.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from executor.cuda import check, driver


class EventTimer:
    """Times `fn()` launches on one stream with CUDA events; returns per-rep microseconds."""

    def __init__(self, stream, max_reps: int = 200):
        cu = driver()
        self.stream = stream
        flags = cu.CUevent_flags.CU_EVENT_DEFAULT
        self._events = [(check(cu.cuEventCreate(flags)), check(cu.cuEventCreate(flags)))
                        for _ in range(max_reps)]

    def time_us(self, fn: Callable[[], None], reps: int = 100, warmup: int = 3,
                flush: L2Flusher | None = None) -> list[float]:
        if not 1 <= reps <= len(self._events):
            raise ValueError(f"reps must be in 1..{len(self._events)}, got {reps}")
        cu = driver()
        s = self.stream.cu_handle
        for _ in range(warmup):
            fn()
        for start, stop in self._events[:reps]:
            if flush is not None:
                flush.flush(self.stream)
            check(cu.cuEventRecord(start, s))
            fn()
            check(cu.cuEventRecord(stop, s))
        self.stream.synchronize()
        return [check(cu.cuEventElapsedTime(a, b)) * 1e3 for a, b in self._events[:reps]]

    def median_us(self, fn: Callable[[], None], reps: int = 100, warmup: int = 3,
                  flush: L2Flusher | None = None) -> float:
        return statistics.median(self.time_us(fn, reps, warmup, flush))

    def close(self) -> None:
        cu = driver()
        while self._events:
            a, b = self._events.pop()
            check(cu.cuEventDestroy(a))
            check(cu.cuEventDestroy(b))


class L2Flusher:
    """A device buffer of at least twice the L2, swept between timed reps to evict the inputs.

    With a `reader` (a callback building a LaunchSpec that reads `nbytes` at `ptr`, e.g. the
    stream-read probe) the sweep is a read, which leaves the L2 full of clean lines. Without one
    it is a cuMemsetD32Async, which leaves dirty lines whose write-back then competes with the
    timed kernel: use it only where no reader exists.
    """

    def __init__(self, device, nbytes: int | None = None, reader=None):
        cu = driver()
        self.nbytes = nbytes or max(2 * device.info.l2_bytes, 64 << 20)
        self.nbytes = (self.nbytes + 255) // 256 * 256
        self._ptr = check(cu.cuMemAlloc(self.nbytes))
        self._value = 0
        try:
            self._read = reader(int(self._ptr), self.nbytes) if reader is not None else None
        except BaseException:
            self.close()
            raise

    @property
    def reads(self) -> bool:
        return self._read is not None

    def flush(self, stream) -> None:
        if self._read is not None:
            self._read.launch(stream)
            return
        self._value = (self._value + 1) & 0xFFFFFFFF   # a new value each time: no shortcut possible
        check(driver().cuMemsetD32Async(self._ptr, self._value, self.nbytes // 4,
                                        stream.cu_handle))

    def close(self) -> None:
        if self._ptr is not None:
            check(driver().cuMemFree(self._ptr))
            self._ptr = None


def host_cost_us(fn: Callable[[], None], drain: Callable[[], None], batch: int = 100,
                 batches: int = 30) -> float:
    """Median host microseconds per call of fn, over `batches` batches of `batch` calls."""
    per_call = []
    drain()
    for _ in range(batches):
        t0 = time.perf_counter_ns()
        for _ in range(batch):
            fn()
        per_call.append((time.perf_counter_ns() - t0) / 1e3 / batch)
        drain()
    return statistics.median(per_call)
