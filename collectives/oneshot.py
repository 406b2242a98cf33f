"""The one-shot all-reduce on the host: peer buffers, device state, launches, failure check.

    ar = OneShotAllReduce(bundle, rank, world, width, exchange)   # collective set-up, once
    spec = ar.launch_spec(rows, inp, out)                         # or residual=ptr: fused add
    spec.launch(stream)                                           # eager, or inside a capture
    ar.raise_if_failed()                                          # sync-free: reads pinned memory
    ar.close()

Kernel and protocol: `kernels/allreduce.py`, `kernels/allreduce_ref.py`. Per rank this owns:
- the IPC receive buffer (2 generations x world slots x max_rows x width bf16, -0.0-filled), and
  every peer's, mapped through `collectives.ipc.PeerBuffers`;
- 256 device bytes: the peer table (u64[world]) and `control` (generation, arrivals, failed);
- `status`: u32[world] of pinned, device-mapped host memory. A poll that times out stores 1 for
  the silent rank; the host reads it with a plain load, no stream synchronize.

A timed-out call leaves the generations of the ranks out of step: the object is then unusable
(every later launch returns at once with garbage) and must be closed; raise_if_failed says so.
Every rank must launch the same sequence of (rows) calls; the collectives.allreduce table makes
that choice from the row count alone.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from collectives.ipc import Exchange, PeerBuffers
from executor.cuda import check, driver
from executor.launch import LaunchSpec
from executor.launches.allreduce import CONTROL_OFFSET, STATE_BYTES, oneshot_launches
from kernels import allreduce_ref as ref

DEFAULT_TIMEOUT_MS = 10_000
_HOSTALLOC_PORTABLE_DEVICEMAP = 0x01 | 0x02   # CU_MEMHOSTALLOC_PORTABLE | _DEVICEMAP


class CollectiveTimeout(RuntimeError):
    """A one-shot all-reduce waited past its timeout for data from another rank."""


@dataclass(frozen=True)
class CollectiveState:
    """A rank's one-shot state by address: what the step's collective stages launch on
    (executor/stages/collectives.py). `pointers` = {peers, control, status}."""

    rank: int
    world: int
    pointers: dict
    timeout_us: int = DEFAULT_TIMEOUT_MS * 1000


class OneShotAllReduce:
    """One rank's side of the one-shot all-reduce (plain and residual-fused kernels)."""

    def __init__(self, bundle, rank: int, world: int, width: int, exchange: Exchange, *,
                 max_rows: int = ref.MAX_ROWS, timeout_ms: int = DEFAULT_TIMEOUT_MS):
        if not isinstance(timeout_ms, int) or not 1 <= timeout_ms <= 3_600_000:
            raise ValueError(f"one-shot all-reduce: timeout_ms must be an int in 1..3600000, "
                             f"got {timeout_ms!r}")
        self.specs = {e: ref.make_spec(world, width, e, max_rows) for e in ("none", "residual")}
        self.bundle = bundle
        self.kernels = {e: bundle.kernel(s.name) for e, s in self.specs.items()}
        for e, s in self.specs.items():       # the bundle's capacity must match ours
            got = self.kernels[e].record.spec or {}
            if got.get("max_rows") != max_rows or got.get("world") != world:
                raise ValueError(f"kernel {s.name}: bundle built for world {got.get('world')}, "
                                 f"max_rows {got.get('max_rows')}; this rank asks for world "
                                 f"{world}, max_rows {max_rows}")
        self.rank, self.world, self.width, self.max_rows = rank, world, width, max_rows
        self.timeout_us = timeout_ms * 1000
        self._state = self._host_status = None
        self._specs_cache: dict[tuple, LaunchSpec] = {}
        self.peers = PeerBuffers(rank, world, self.specs["none"].buffer_bytes, exchange,
                                 fill_u16=ref.SENTINEL_BITS)
        try:
            self._alloc_state()
        except BaseException:
            self.close()
            raise

    def _alloc_state(self) -> None:
        cu = driver()
        self._state = check(cu.cuMemAlloc(STATE_BYTES))
        check(cu.cuMemsetD32(self._state, 0, STATE_BYTES // 4))
        table = (ctypes.c_uint64 * self.world)(*self.peers.ptrs)
        check(cu.cuMemcpyHtoD(self._state, table, 8 * self.world))
        self._host_status = check(cu.cuMemHostAlloc(4 * self.world,
                                                    _HOSTALLOC_PORTABLE_DEVICEMAP))
        self._status_words = (ctypes.c_uint32 * self.world).from_address(int(self._host_status))
        for s in range(self.world):
            self._status_words[s] = 0
        self._status_dev = int(check(cu.cuMemHostGetDevicePointer(self._host_status, 0)))

    @property
    def peer_table(self) -> int:
        return int(self._state)

    def state(self) -> CollectiveState:
        """This rank's state for the step's wired collective stages (the same buffers,
        generations and status as launch_spec's calls: the two may be interleaved)."""
        return CollectiveState(self.rank, self.world, {"peers": self.peer_table,
                                                       "control": self.control,
                                                       "status": self._status_dev},
                               self.timeout_us)

    @property
    def control(self) -> int:
        return int(self._state) + CONTROL_OFFSET

    def launch_spec(self, rows: int, inp: int, out: int, residual: int | None = None) -> LaunchSpec:
        """The launch for `rows` rows of inp -> out (bf16 [rows, width], 16-byte aligned; out may
        alias inp or residual). Built and validated once per argument set; capturable."""
        key = (rows, inp, out, residual)
        spec = self._specs_cache.get(key)
        if spec is not None:
            return spec
        epilogue = "none" if residual is None else "residual"
        ptrs = {"inp": inp, "out": out, "peers": self.peer_table, "control": self.control,
                "status": self._status_dev}
        if residual is not None:
            ptrs["residual"] = residual
        spec, = oneshot_launches(self.bundle, self.specs[epilogue], ptrs, self.rank, rows,
                                 self.timeout_us)
        self._specs_cache[key] = spec
        return spec

    def failed_sources(self) -> list[int]:
        """Ranks whose data did not arrive within the timeout in some call so far (no sync:
        a plain read of pinned memory; a call still in flight may not have reported yet)."""
        if self._host_status is None:
            raise RuntimeError(f"rank {self.rank}: one-shot all-reduce is closed")
        return [s for s in range(self.world) if self._status_words[s]]

    def raise_if_failed(self) -> None:
        silent = self.failed_sources()
        if silent:
            raise CollectiveTimeout(
                f"rank {self.rank}: one-shot all-reduce waited more than "
                f"{self.timeout_us // 1000} ms for data from rank(s) {silent} (dead or on "
                f"another step?); this all-reduce is unusable, close it")

    def close(self) -> None:
        """Free the device state, the status word and the peer buffers (idempotent). Call it on
        every rank after the last all-reduce has completed everywhere."""
        cu = driver()
        self._specs_cache.clear()
        if self._state is not None:
            check(cu.cuMemFree(self._state))
            self._state = None
        if self._host_status is not None:
            check(cu.cuMemFreeHost(self._host_status))
            self._host_status = None
        if getattr(self, "peers", None) is not None:
            self.peers.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
