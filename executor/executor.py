"""`Executor`: one TP rank's decode step behind `bind(**tensors)` once and `step(n_rows, stream)`.

    ex = Executor(cfg, bundle, weights, tp=4, rank=r, device=dev, geometry=CacheGeometry.of(...))
    ex.bind(token_ids=..., positions=..., swa_0=..., ..., tokens=...)   # DLPack, once, validated
    ex.capture()                       # one graph per bucket (1, 2, 4, 8, 16, ..., 192)
    code = ex.step(n_rows, stream)     # 0: served; else a StepResult, nothing written
    ex.close()

`step` takes and returns plain ints. It decides from its arguments and the executor's state only
(never from device data), then replays the captured graph of the smallest bucket >= n_rows on the
caller's stream: one cuGraphLaunch, no allocation, no synchronize, no module load. Declines are
decided before any launch, so a declined step writes nothing. How the caller declares prefill or
other unsupported work without a device read: `executor/reasons.py`. The rows between n_rows and
the bucket must be marked padding by the caller (slot -1, sequence -1): `executor/bind.py`.

`capture()` first builds the rank's arena (executor/wiring.py: boundary buffers, stage scratch,
the weights packed by the stage modules, zeroed first) and wires every stage a stage module
(executor/stages/) builds, on the bound addresses; a plan that still misses stages raises
NotImplementedError naming them, frees that arena again and captures nothing (`step` then
declines with NOT_CAPTURED).

DSpark rounds (`dspark=True`, model doc §4, docs/notes/dspark-round.md):

    ex = Executor(..., dspark=True)    # bind() also takes accepted, bonus (executor/bind.py)
    ex.bind(...); ex.capture()         # verify and draft graphs per sequence-slot bucket
    code = ex.round(n_seqs, stream)    # draft graph, then verify graph: one round, no host work
    # whenever the caller wants (after the stream): accepted[s], bonus[s], and the round's
    # committed tokens tokens[s (k + 1) + j], j = 0..accepted[s] (the greedy picks of the
    # verify rows: the accepted drafts, then the bonus)

The plans are the sync-free ones: decode_plan(dspark=True, sync_free=True) (the verify step
ends with the draft rows' Engram lookback and the row advance to the next draft rows) and
draft_plan(sync_free=True) (it ends by writing the next verify rows and their lookback). So
between rounds the bound rows are the next draft step's, and the caller writes rows, caches,
`bonus` and the draft rows' `token_history` once, before the first round (after prefill). The
graphs are captured per sequence-slot bucket S (each row bucket b gives S = b // (k + 1)): the
verify graph at S (k + 1) rows, the draft graph at S k; slots n_seqs..S-1 are padding (`bonus`
-1). `round(n_seqs)` replays both graphs of the smallest S >= n_seqs (two cuGraphLaunch, the
draft then the verify, in stream order); `draft(n_seqs)` replays the draft graph alone and
`step(n_rows)` the verify graph of the smallest S (k + 1) >= n_rows. Their declines are step's
(decided before any launch), TOO_MANY_ROWS above the largest S; `round`/`draft` take
step's `features` too (PREFILL_ROWS, UNSUPPORTED_FEATURE); on an executor without DSpark they
return UNSUPPORTED_FEATURE.
"""
from __future__ import annotations

from collections.abc import Callable

from executor.bind import (
    MAX_ROWS,
    BindError,
    Binding,
    CacheGeometry,
    binding_rules,
    cuda_device,
    validate_binding,
)
from executor.branches import SideStream
from executor.graphs import BUCKETS, GraphSet, bucket_table
from executor.plan import Plan, decode_plan, draft_plan
from executor.reasons import SUPPORTED_FEATURES, StepFeature, StepResult
from executor.wiring import StepContext, arena_contents, wire

__all__ = ["BindError", "CacheGeometry", "Executor", "StepFeature", "StepResult"]

# Plain-int masks: `~` on an IntFlag only inverts its known members, so an unknown bit would pass.
_PREFILL = int(StepFeature.PREFILL)
_UNSUPPORTED = ~int(SUPPORTED_FEATURES)

# Kernels that poll words other CTAs of their grid write give up after a bounded time (2 ms) and
# then write outputs they could not finish; each sets a sticky flag, its scratch's first i32.
POLL_FLAGS = (("mhc.poll_status", "mHC pre (_lean_poll): a consumer CTA's poll"),
              ("ffn.router_counters", "router (_tile8p): a selection poll"))


class Executor:
    """One rank's decode executor. Not thread-safe: one caller thread, one step in flight per
    stream (the graphs share the executor's scratch buffers)."""

    def __init__(self, config, bundle, weights, tp: int, rank: int, comm=None, *, device,
                 geometry: CacheGeometry, plan: Plan | None = None, buckets=BUCKETS,
                 owns_bundle: bool = False,
                 capture_graphs: Callable = GraphSet.capture, ranges=None,
                 stage_modules=None, arena_factory: Callable | None = None,
                 dspark: bool = False, draft: Plan | None = None):
        """`device`: the runtime Device (its `ordinal` is where bound tensors must live).
        `plan`: the step plan (default `decode_plan(config)`). `capture_graphs(stream, record,
        buckets) -> GraphSet` is GraphSet.capture; tests substitute a recording fake.
        `ranges`: an nvtx_ranges.Ranges for per-layer/per-stage ranges, or None.
        `weights`: this rank's weights, a `fetch(name) -> ndarray` (a checkpoint tensor's rank
        slice in its checkpoint dtype) or a RankWeights (its `.fetch`); None = a plan given
        complete (tests). `comm`: the rank's collective state (`CollectiveState`, e.g.
        `OneShotAllReduce.state()`), None at tp=1. `stage_modules` (default
        wiring.STAGE_MODULES) and `arena_factory(requests) -> Arena` (default an Arena on
        `device`; tests pass a HostArena) shape the arena capture() builds. `dspark`: serve
        DSpark rounds (module docstring: the sync-free verify plan, the draft plan `draft`,
        default draft_plan(config, sync_free=True); bind() also takes accepted and bonus)."""
        for name, value in (("tp", tp), ("rank", rank)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Executor: {name} must be an int, got {value!r}")
        if tp < 1 or not 0 <= rank < tp:
            raise ValueError(f"Executor: need tp >= 1 and 0 <= rank < tp, got tp={tp} rank={rank}")
        buckets = tuple(sorted(set(buckets)))
        if (not buckets or any(isinstance(b, bool) or not isinstance(b, int) for b in buckets)
                or buckets[0] < 1 or buckets[-1] > MAX_ROWS):
            raise ValueError(f"Executor: buckets must be ints in 1..{MAX_ROWS}, got {buckets!r}")
        self.config, self.bundle, self.weights = config, bundle, weights
        self.tp, self.rank, self.comm = tp, rank, comm
        self.device = device
        self.geometry = geometry
        self.buckets = buckets
        self.max_rows = buckets[-1]
        self.rules = binding_rules(config, tp, geometry, dspark=dspark)
        if draft is not None and not dspark:
            raise ValueError("Executor: a draft plan serves DSpark rounds: pass dspark=True")
        self.dspark = dspark
        if plan is None:
            plan = decode_plan(config, dspark=dspark, sync_free=dspark)
        self.plan = plan
        self.draft_plan = (draft_plan(config, sync_free=True) if dspark and draft is None
                           else draft)
        self.round_slots = _round_slots(config, buckets) if dspark else ()
        self._step_buckets = (tuple(s * (config.dspark_block_size + 1) for s in self.round_slots)
                              if dspark else buckets)
        self._round_table = bucket_table(self.round_slots) if dspark else [0]
        self.arena = None                # the rank's arena, built by capture()
        self._fetch = getattr(weights, "fetch", weights)
        self._stage_modules = stage_modules
        self._arena_factory = arena_factory
        self._owns_bundle = owns_bundle
        self._capture_graphs = capture_graphs
        self._ranges = ranges
        self._binding: Binding | None = None
        self._graphs: GraphSet | None = None
        self._draft_graphs: GraphSet | None = None
        self._stream_handle = 0
        self._stream = None
        self._closed = False

    # ---- bind ------------------------------------------------------------------------------

    @property
    def binding(self) -> Binding | None:
        return self._binding

    def bind(self, **tensors) -> None:
        """Validate and record the caller's tensors (see executor/bind.py for the set).

        All or nothing: on any error the previous binding (if any) stays in force. After
        capture() the graphs hold the recorded addresses, so a rebind must bind the same
        addresses (the same tensors); anything else raises and changes nothing.
        """
        if self._closed:
            raise RuntimeError("Executor.bind: the executor is closed")
        new = validate_binding(self.rules, tensors, cuda_device(self.device.ordinal))
        if self._graphs is not None and dict(new.pointers) != dict(self._binding.pointers):
            moved = sorted(n for n in set(new.pointers) | set(self._binding.pointers)
                           if new.pointers.get(n) != self._binding.pointers.get(n))
            raise BindError(f"bind: the step graphs were captured on the previous addresses; "
                            f"tensors {moved} moved. Build a new Executor to bind new memory.")
        self._binding = new

    # ---- capture ---------------------------------------------------------------------------

    @property
    def captured(self) -> bool:
        return self._graphs is not None

    def capture(self, stream=None) -> None:
        """Capture one graph per bucket (largest first) on `stream` (default: a new stream of
        the device); with DSpark the verify graphs, then the draft graphs, per sequence-slot
        bucket. Refuses before capturing anything when unbound or when a plan has missing
        stages (NotImplementedError naming them)."""
        if self._closed:
            raise RuntimeError("Executor.capture: the executor is closed")
        if self._binding is None:
            raise RuntimeError("Executor.capture: bind() the caller's tensors first (the "
                               "graphs record their addresses)")
        if self._graphs is not None:
            raise RuntimeError("Executor.capture: already captured")
        unwired = self.plan, self.draft_plan
        if self._fetch is not None and any(p.missing_stages() for p in self._plans()):
            self._wire()
        graphs = []
        try:
            for p in self._plans():
                p.require_complete()
            stream = self.device.stream() if stream is None else stream
            side = (SideStream.create(self.device)
                    if any(p.has_branches for p in self._plans()) else None)
            graphs.append(self._capture_plan(self.plan, stream, side, self._step_buckets))
            if self.dspark:
                k = self.config.dspark_block_size
                graphs.append(self._capture_plan(self.draft_plan, stream, side,
                                                 tuple(s * k for s in self.round_slots)))
        except BaseException:
            for g in graphs:
                g.close()
            if (self.plan, self.draft_plan) != unwired:     # the arena this call built goes too
                arena, self.arena = self.arena, None
                self.plan, self.draft_plan = unwired
                arena.close()
            raise
        self._graphs = graphs[0]
        self._draft_graphs = graphs[1] if self.dspark else None

    def _plans(self) -> list[Plan]:
        return [self.plan] + ([self.draft_plan] if self.dspark else [])

    def _capture_plan(self, plan: Plan, stream, side, buckets) -> GraphSet:
        def record(rows: int) -> None:
            plan.record(stream, rows, self._ranges, side=side)
        return self._capture_graphs(stream, record, buckets)

    def _wire(self) -> None:
        """Build the arena and wire the plan (and the draft plan) on it; on any failure (a
        missing stage included) the arena is freed and the plans left as they were."""
        cfg = self.config
        requests, uploads = arena_contents(cfg, self.tp, self.rank, self._fetch, self.max_rows,
                                           self._stage_modules)
        if self._arena_factory is not None:
            arena = self._arena_factory(requests)
        else:
            from executor.arena import Arena
            arena = Arena(self.device, requests)
        try:
            arena.zero()
            for name, array in uploads:
                arena.upload(name, array)
            arena.synchronize()                 # the uploads ran on another stream than step's
            ctx = StepContext(cfg, self.tp, self.rank, self.bundle, arena,
                              self._binding.pointers, self.max_rows, self.comm, self.geometry)
            plan = wire(self.plan, ctx, self._stage_modules)
            plan.require_complete()
            draft = None
            if self.dspark:
                draft = wire(self.draft_plan, ctx, self._stage_modules)
                draft.require_complete()
        except BaseException:
            arena.close()
            raise
        self.arena, self.plan = arena, plan
        if self.dspark:
            self.draft_plan = draft

    # ---- step ------------------------------------------------------------------------------

    def step(self, n_rows: int, stream: int, features: int = 0) -> int:
        """Serve one decode step of `n_rows` rows on the caller's stream (a raw cudaStream_t).

        Returns StepResult.SERVED (0) after enqueueing the bucket's graph, or the reason it
        declined, decided before any launch (so nothing is written). Checks, in order: argument
        types (TypeError/ValueError: a caller bug, not a decline), CLOSED, NOT_BOUND,
        NOT_CAPTURED, NO_ROWS, TOO_MANY_ROWS, PREFILL_ROWS, UNSUPPORTED_FEATURE.
        """
        _check_call("step", "n_rows", n_rows, stream, features)
        reason = self._decline_reason(n_rows, features)
        if reason:
            return reason
        self._graphs.launch(n_rows, self._caller_stream(stream))
        return StepResult.SERVED

    def round(self, n_seqs: int, stream: int, features: int = 0) -> int:
        """Serve one DSpark round of `n_seqs` sequence slots on the caller's stream: the draft
        graph, then the verify graph, of the smallest slot bucket >= n_seqs (module docstring).
        Returns SERVED (0) or step's declines (`features` as in step), decided before any
        launch; UNSUPPORTED_FEATURE on an executor without DSpark."""
        reason = self._round_decline("round", n_seqs, stream, features)
        if reason:
            return reason
        handle = self._caller_stream(stream)
        slots = self._round_table[n_seqs]
        k = self.config.dspark_block_size
        self._draft_graphs.launch(slots * k, handle)
        self._graphs.launch(slots * (k + 1), handle)
        return StepResult.SERVED

    def draft(self, n_seqs: int, stream: int, features: int = 0) -> int:
        """Only the draft step of a round (its graph of the smallest slot bucket >= n_seqs);
        the declines of `round`."""
        reason = self._round_decline("draft", n_seqs, stream, features)
        if reason:
            return reason
        k = self.config.dspark_block_size
        self._draft_graphs.launch(self._round_table[n_seqs] * k, self._caller_stream(stream))
        return StepResult.SERVED

    def _round_decline(self, what: str, n_seqs: int, stream: int,
                       features: int) -> StepResult:
        _check_call(what, "n_seqs", n_seqs, stream, features)
        if not self.dspark:
            return StepResult.UNSUPPORTED_FEATURE
        return self._decline_reason(n_seqs, features, self.round_slots[-1])

    def _caller_stream(self, stream: int):
        if stream != self._stream_handle:
            self._stream = self._external_stream(stream)
            self._stream_handle = stream
        return self._stream

    def _decline_reason(self, n_rows: int, features: int, limit: int = 0) -> StepResult:
        """`limit`: the most rows (or sequence slots) served, default the step's."""
        if self._closed:
            return StepResult.CLOSED
        if self._binding is None:
            return StepResult.NOT_BOUND
        if self._graphs is None:
            return StepResult.NOT_CAPTURED
        if n_rows == 0:
            return StepResult.NO_ROWS
        if n_rows > (limit or self._step_buckets[-1]):
            return StepResult.TOO_MANY_ROWS
        if features & _PREFILL:
            return StepResult.PREFILL_ROWS
        if features & _UNSUPPORTED:
            return StepResult.UNSUPPORTED_FEATURE
        return StepResult.SERVED

    def bucket_for(self, n_rows: int) -> int:
        """The bucket `step(n_rows, ...)` replays (after capture)."""
        if self._graphs is None:
            raise RuntimeError("Executor.bucket_for: not captured")
        return self._graphs.bucket_for(n_rows)

    @staticmethod
    def _external_stream(handle: int):
        from executor.runtime import Stream
        return Stream.external(handle)

    # ---- health ----------------------------------------------------------------------------

    def poll_timeouts(self) -> list[str]:
        """The in-kernel poll timeouts that fired since capture (sticky flags), described; []
        when none. A host read that waits for the device (cuCtxSynchronize): call it between
        steps when you want to know, never inside a hot loop. Non-empty means some step wrote
        outputs from a poll that gave up: treat those steps' results as invalid. The one-shot
        all-reduce reports its own timeouts in pinned host memory (collectives/oneshot.py)."""
        if self.arena is None:
            return []
        import numpy as np
        self.arena.synchronize()
        found = []
        for name, what in POLL_FLAGS:
            try:
                self.arena.nbytes(name)
            except KeyError:                    # a plan without that kernel
                continue
            if int(self.arena.download(name, np.int32, (1,))[0]):
                found.append(f"{what} timed out ({name}[0] is set)")
        return found

    # ---- close -----------------------------------------------------------------------------

    def close(self) -> None:
        """Release the graphs, the arena and (if owned) the bundle; idempotent. The caller's
        bound tensors are only un-referenced, never freed."""
        if self._closed:
            return
        self._closed = True
        graphs, self._graphs = self._graphs, None
        draft_graphs, self._draft_graphs = self._draft_graphs, None
        arena, self.arena = self.arena, None
        try:
            for g in (graphs, draft_graphs):
                if g is not None:
                    g.close()
        finally:
            try:
                if arena is not None:
                    arena.close()
            finally:
                if self._owns_bundle and self.bundle is not None:
                    self.bundle.close()
                self.bundle = None
                self._binding = None
                self._stream = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _round_slots(config, buckets) -> tuple[int, ...]:
    """The sequence-slot buckets of DSpark rounds: S = b // (k + 1) of every row bucket b (at
    least 1), so each slot bucket's verify rows S (k + 1) fit the largest row bucket."""
    block = config.dspark_block_size + 1
    return tuple(sorted({max(1, b // block) for b in buckets}))


def _check_call(what: str, name: str, count, stream, features) -> None:
    """A caller bug, not a decline: plain ints, count >= 0, no legacy default stream."""
    if type(count) is not int or type(stream) is not int or type(features) is not int:
        raise TypeError(f"Executor.{what} takes plain ints ({name}, stream, features), got "
                        f"{type(count).__name__}, {type(stream).__name__}, "
                        f"{type(features).__name__}")
    if count < 0 or stream <= 1 or features < 0:
        raise ValueError(f"Executor.{what}: need {name} >= 0, a stream handle > 1 (0 and 1 are "
                         f"the legacy default stream: CU_STREAM_LEGACY) and features >= 0; got "
                         f"{name}={count}, stream={stream}, features={features}")
