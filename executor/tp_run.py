"""One TP rank of the decode step in its own process: one-shot all-reduce, Executor, caller tensors.

    spec = RankSpec.of(ctx.rank, parse_devices("0,1,2,3", 4))   # or [0] * 4: 4 ranks, one GPU
    rank = TPRank(spec, "build/bundle-tiny", WeightSource(checkpoint=path), geometry,
                  ctx.exchange, buckets=(8, 192))              # collective set-up: every rank
    rank.write(host_inputs(cfg, 4, geometry, rows, history, caches))   # metadata + caches, once
    out = rank.step(rows.num_rows, host_inputs(cfg, 4, geometry, rows, history))
    out.result, out.tokens, out.logits  # StepResult; outputs read back after a stream sync
    rank.close()                        # every rank (a final exchange: peers done with our buffer)

With `dspark=True` the rank's Executor serves DSpark rounds (executor/executor.py): the caller
tensors add `accepted` and `bonus`, and `rank.round(n_seqs)` / `rank.draft(n_seqs)` enqueue a
round (draft graph, then verify graph) or its draft step alone on the rank's stream and return
the code without any synchronisation or read; `rank.read(name)` reads when the test wants.

What it wires, in order: the rank's Device (its primary context, shared with CuPy), the kernel
bundle, `collectives.oneshot.OneShotAllReduce` over the caller's `exchange` (an all-gather of
bytes: `collectives.launcher.RankContext.exchange` in tests and benchmarks, an NCCL byte
all-gather in an engine), the `Executor(comm=ar.state())`, one CuPy array per tensor of
`binding_rules` (the optional `logits` only when asked), bind, capture of the given buckets, and
a last exchange so that no rank's first collective spins while a peer is still capturing.

Host reads happen only outside `Executor.step`: `step` here enqueues the step on the rank's stream,
then synchronizes and copies the outputs back (a test and benchmark convenience; an engine reads
when it wants). Writes go on the same stream, so they are ordered before the step that uses them.

The largest bucket must be 192 (MAX_ROWS): the Executor sizes its arena and the collective stages'
kernel specs from it, and the bundle's one-shot kernels and the IPC buffers are built for 192 rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from executor.bind import MAX_ROWS, CacheGeometry, binding_rules
from executor.graphs import BUCKETS

CACHE_PREFIXES = ("swa_", "compressed_", "index_keys_", "compressor_ring_")
OUTPUTS = ("tokens", "logits")


def is_cache(name: str) -> bool:
    return name.startswith(CACHE_PREFIXES)


# ---- where a rank runs ------------------------------------------------------------------------

def parse_devices(text: str | None, world: int) -> tuple[int, ...]:
    """Device ordinals of the ranks: None or "" puts every rank on device 0 (contexts
    time-slice one GPU: a protocol test, not TP performance); else "0,1,2,3", one per rank."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"parse_devices: world must be a positive int, got {world!r}")
    if text is None or not text.strip():
        return (0,) * world
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise ValueError(f"device list {text!r}: expected comma-separated ordinals such as "
                         f"'0,1,2,3'")
    if len(parts) != world:
        raise ValueError(f"device list {text!r} names {len(parts)} device(s); a world of "
                         f"{world} needs one per rank")
    return tuple(int(p) for p in parts)


@dataclass(frozen=True)
class RankSpec:
    """Which rank of which world runs on which device ordinal."""

    rank: int
    world: int
    device: int

    def __post_init__(self):
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"RankSpec.{name} must be an int, got {value!r}")
        if self.world < 1 or not 0 <= self.rank < self.world or self.device < 0:
            raise ValueError(f"RankSpec: need world >= 1, 0 <= rank < world and device >= 0; "
                             f"got rank={self.rank} world={self.world} device={self.device}")

    @classmethod
    def of(cls, rank: int, devices) -> RankSpec:
        """Rank `rank` of a world of len(devices), on devices[rank]."""
        devices = tuple(devices)
        if not 0 <= rank < len(devices):
            raise ValueError(f"RankSpec.of: rank {rank} outside the {len(devices)} devices "
                             f"{list(devices)}")
        return cls(rank, len(devices), devices[rank])


@dataclass(frozen=True)
class WeightSource:
    """The model's weights: a checkpoint directory, or a synthetic preset (loader.synth, the
    values `synth(preset, seed)` would write, drawn on demand). Exactly one of the two."""

    checkpoint: str | None = None
    preset: str | None = None
    seed: int = 0

    def __post_init__(self):
        if (self.checkpoint is None) == (self.preset is None):
            raise ValueError(f"WeightSource: give exactly one of checkpoint= (a directory) or "
                             f"preset= (synthetic weights), got checkpoint={self.checkpoint!r} "
                             f"preset={self.preset!r}")
        if self.checkpoint is not None and not Path(self.checkpoint).is_dir():
            raise ValueError(f"WeightSource: checkpoint {self.checkpoint!r} is not a directory")

    def open(self, tp: int, rank: int):
        """(ModelConfig, fetch(name) -> rank's slice in its checkpoint dtype)."""
        if self.preset is not None:
            from loader.config import ModelConfig
            from loader.synth import synth_fetch
            cfg = ModelConfig.preset(self.preset)
            return cfg, synth_fetch(cfg, self.seed, tp, rank)
        from loader.checkpoint import Checkpoint
        from loader.sharding import shard
        ckpt = Checkpoint.open(self.checkpoint, progress=False)

        def fetch(name: str) -> np.ndarray:
            return shard(ckpt, ckpt.spec(name), tp, rank)
        return ckpt.config, fetch


# ---- caller tensors on the host -----------------------------------------------------------------

def check_buckets(buckets) -> tuple[int, ...]:
    buckets = tuple(sorted(set(buckets)))
    if not buckets or buckets[-1] != MAX_ROWS or buckets[0] < 1:
        raise ValueError(f"buckets {buckets!r}: the largest must be {MAX_ROWS} (the executor sizes "
                         f"its arena and the collective kernels' row capacity from it, and the "
                         f"bundle's one-shot kernels are built for {MAX_ROWS} rows)")
    return buckets


def bound_rules(cfg, tp: int, geometry: CacheGeometry, bind_logits: bool,
                dspark: bool = False) -> dict:
    """The binding_rules entries a rank binds: every required one, `logits` when asked (bound,
    it adds the logits-mode lm_head to the step); dspark: the round's outputs too."""
    return {n: r for n, r in binding_rules(cfg, tp, geometry, dspark=dspark).items()
            if r.required or (n == "logits" and bind_logits)}


def allocate(rules: dict, zeros) -> dict:
    """One zeroed array per rule, `zeros(shape, dtype)` (cupy.zeros on a GPU, numpy.zeros in a
    CPU test), exactly the rule's dtype and shape."""
    return {name: zeros(rule.shape, np.dtype(rule.dtype)) for name, rule in rules.items()}


def host_inputs(cfg, tp: int, geometry: CacheGeometry, rows, history=None,
                caches=None) -> dict[str, np.ndarray]:
    """The step's row metadata for `rows` (a RowBatch; rows past it padding up to 192) and,
    when `caches` (reference KVCaches) is given, every cache tensor, as host arrays by bound
    name: executor.emulate.ranks.fill_caller_tensors on just those names."""
    from executor.emulate.ranks import fill_caller_tensors

    rules = {n: r for n, r in binding_rules(cfg, tp, geometry).items()
             if n not in OUTPUTS and (caches is not None or not is_cache(n))}
    arrays = allocate(rules, np.zeros)
    fill_caller_tensors(arrays, rows, caches, history)
    return arrays


# ---- one rank on its GPU --------------------------------------------------------------------------

@dataclass(frozen=True)
class StepOutput:
    """What `TPRank.step` read back: tokens int64 [n_rows], logits float32 [n_rows, vocab/tp]
    (this rank's shard; None when not bound); both None when the step declined."""

    result: int
    tokens: np.ndarray | None
    logits: np.ndarray | None


class TPRank:
    """One rank: Device, bundle, one-shot all-reduce, captured Executor and its bound tensors."""

    def __init__(self, spec: RankSpec, bundle_dir, weights: WeightSource,
                 geometry: CacheGeometry, exchange, *, buckets=BUCKETS, bind_logits: bool = True,
                 timeout_ms: int | None = None, dspark: bool = False):
        """Collective: every rank of the world must construct its TPRank (the IPC handles and the
        capture barrier go through `exchange`). On failure everything opened is closed."""
        from executor.bundle import BundleError, read_manifest

        buckets = check_buckets(buckets)
        manifest = read_manifest(bundle_dir)
        if manifest.tp and manifest.tp != spec.world:
            raise BundleError(f"{manifest.path}: built for tp={manifest.tp}, this world is "
                              f"{spec.world}")
        self.spec, self.geometry, self._exchange = spec, geometry, exchange
        self.cfg, fetch = weights.open(spec.world, spec.rank)
        self.dspark = dspark
        self.rules = bound_rules(self.cfg, spec.world, geometry, bind_logits, dspark)
        self.dev = self.bundle = self.ar = self.executor = self.stream = None
        self.tensors: dict = {}
        self._closed = False
        try:
            self._open(bundle_dir, fetch, buckets, timeout_ms)
        except BaseException:
            self._release(peers_done=False)
            raise

    def _open(self, bundle_dir, fetch, buckets, timeout_ms) -> None:
        import cupy as cp

        from collectives.oneshot import DEFAULT_TIMEOUT_MS, OneShotAllReduce
        from executor.cuda import check, driver
        from executor.executor import Executor
        from executor.runtime import Bundle, Device

        spec = self.spec
        self.dev = Device(spec.device)
        cp.cuda.Device(spec.device).use()          # CuPy allocates on this rank's device
        self.bundle = Bundle.load(self.dev, bundle_dir)
        self.stream = self.dev.stream()
        self._cp_stream = cp.cuda.ExternalStream(self.stream.handle, spec.device)
        self.ar = OneShotAllReduce(self.bundle, spec.rank, spec.world, self.cfg.hidden_size,
                                   self._exchange, timeout_ms=timeout_ms or DEFAULT_TIMEOUT_MS)
        self.executor = Executor(self.cfg, self.bundle, fetch, tp=spec.world, rank=spec.rank,
                                 comm=self.ar.state(), device=self.dev, geometry=self.geometry,
                                 buckets=buckets, dspark=self.dspark)
        with self._cp_stream:
            self.tensors = allocate(self.rules, cp.zeros)
        self.stream.synchronize()
        self.executor.bind(**self.tensors)
        self.executor.capture(self.stream)
        # capture() uploaded the weights with CuPy on the legacy stream, which our non-blocking
        # stream does not wait for: the whole context, before the first step may read them.
        check(driver().cuCtxSynchronize())
        self._exchange(b"captured")                 # no first collective spins on a capture

    # ---- data in and out (host <-> bound tensors, on the rank's stream) --------------------

    def _tensor(self, name: str):
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"rank {self.spec.rank}: no bound tensor {name!r}; bound: "
                           f"{sorted(self.tensors)}") from None

    def write(self, arrays: dict) -> None:
        """Copy host arrays into the bound tensors of the same names (exact dtype and shape),
        ordered before any later step on the rank's stream."""
        for name, host in arrays.items():
            t = self._tensor(name)
            host = np.asarray(host)
            if host.dtype != t.dtype or host.shape != t.shape:
                raise ValueError(f"rank {self.spec.rank}: {name!r} is {t.dtype} "
                                 f"{list(t.shape)}; got {host.dtype} {list(host.shape)}")
        for name, host in arrays.items():       # async on our stream (staged: pageable host)
            self.tensors[name].set(np.ascontiguousarray(host), stream=self._cp_stream)

    def fill(self, name: str, value) -> None:
        """Set every element of a bound tensor (poisoning outputs before a step)."""
        with self._cp_stream:
            self._tensor(name).fill(value)

    def read(self, name: str) -> np.ndarray:
        """A host copy of a whole bound tensor, after everything queued on the stream."""
        self.stream.synchronize()
        return self._tensor(name).get(stream=self._cp_stream)

    def save(self, names) -> dict:
        """Device copies of `names` (e.g. the caches before a step), for `restore`."""
        with self._cp_stream:
            return {n: self._tensor(n).copy() for n in names}

    def restore(self, saved: dict) -> None:
        with self._cp_stream:
            for name, copy in saved.items():
                self.tensors[name][...] = copy

    # ---- the step -------------------------------------------------------------------------

    def step(self, n_rows: int, inputs: dict | None = None, features: int = 0) -> StepOutput:
        """Write `inputs` (host arrays by bound name: `host_inputs`), Executor.step on the rank's
        stream, then (outside it) a sync and the outputs' first n_rows rows. A declined step
        returns its StepResult and reads nothing."""
        if inputs:
            self.write(inputs)
        result = self.executor.step(n_rows, self.stream.handle, features)
        if result:
            return StepOutput(int(result), None, None)
        tokens = self.read("tokens")[:n_rows]
        logits = self.read("logits")[:n_rows] if "logits" in self.tensors else None
        return StepOutput(0, tokens, logits)

    def round(self, n_seqs: int) -> int:
        """Executor.round on the rank's stream: enqueued, not waited for, nothing read."""
        return int(self.executor.round(n_seqs, self.stream.handle))

    def draft(self, n_seqs: int) -> int:
        """Executor.draft (a round's draft step alone) on the rank's stream, not waited for."""
        return int(self.executor.draft(n_seqs, self.stream.handle))

    def scratch(self, name: str, dtype, shape) -> np.ndarray:
        """A host copy of an executor arena slice (tests: e.g. `dspark.base`), after the stream."""
        self.stream.synchronize()
        return self.executor.arena.download(name, dtype, shape)

    def failed_sources(self) -> list[int]:
        """Ranks whose data some collective of this rank waited for in vain (no sync)."""
        return self.ar.failed_sources()

    # ---- close ----------------------------------------------------------------------------

    def close(self) -> None:
        """Collective: wait for the stream, agree with every rank that no collective is in
        flight, then free everything (idempotent). If the agreement fails (a peer died), the
        IPC buffer is left to process exit rather than freed under a peer."""
        if self._closed:
            return
        peers_done = False
        try:
            if self.stream is not None:
                self.stream.synchronize()
            self._exchange(b"close")
            peers_done = True
        finally:
            self._release(peers_done)

    def _release(self, peers_done: bool) -> None:
        self._closed = True
        if self.executor is not None:
            self.executor.close()
        self.tensors = {}
        if self.dev is not None:
            import cupy as cp
            cp.get_default_memory_pool().free_all_blocks()
        if self.ar is not None and peers_done:
            self.ar.close()
        if self.bundle is not None:
            self.bundle.close()
        if self.dev is not None:
            self.dev.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
