"""Rank programs for the multi-process GPU checks: run by tests/gpu and the collectives benchmark.

Each function is `program(ctx, ...)` for `collectives.launcher.run_ranks`: it runs in one rank's
spawned process, opens its device and the kernel bundle, builds a OneShotAllReduce through
`ctx.exchange`, and returns plain data (digests, mismatch reports, timings) to the parent.

Inputs are drawn from a seed the parent picks fresh per run; rank s's input of call c comes from
`default_rng((seed, c, s))`, so every rank can rebuild every rank's input and compute the NumPy
reference itself. Outputs are poisoned (bf16 NaN 0xFFFF) before each call and compared bitwise.
"""
from __future__ import annotations

import hashlib
import os
import signal
import time

import numpy as np

from kernels import allreduce_ref as ref
from kernels.common_ref import BF16

POISON = 0xFFFF


def draw_input(seed: int, call: int, rank: int, rows: int, width: int) -> np.ndarray:
    """Rank `rank`'s bf16 [rows, width] input of call `call`: normal values, about 1% -0.0."""
    rng = np.random.default_rng((seed, call, rank))
    x = (rng.standard_normal((rows, width), np.float32) * 4).astype(BF16)
    bits = x.view(np.uint16)
    bits[rng.random((rows, width)) < 0.01] = ref.SENTINEL_BITS
    return x


def draw_residual(seed: int, call: int, rows: int, width: int) -> np.ndarray:
    rng = np.random.default_rng((seed, call, 1 << 20))
    return (rng.standard_normal((rows, width), np.float32) * 16).astype(BF16)


def expected(seed: int, call: int, world: int, rows: int, width: int, fused: bool) -> np.ndarray:
    xs = [draw_input(seed, call, s, rows, width) for s in range(world)]
    if fused:
        return ref.allreduce_residual_ref(xs, draw_residual(seed, call, rows, width))
    return ref.allreduce_ref(xs)


def compare(got: np.ndarray, want: np.ndarray) -> dict:
    """Bitwise comparison: mismatch count, first mismatching (row, col) with both bit patterns."""
    g, w = got.view(np.uint16), want.view(np.uint16)
    bad = np.argwhere(g != w)
    report = {"mismatches": int(bad.shape[0]), "unwritten": int((g == POISON).sum()),
              "digest": hashlib.sha256(g.tobytes()).hexdigest()[:16]}
    if bad.shape[0]:
        r, c = (int(v) for v in bad[0])
        report["first"] = (r, c, hex(int(g[r, c])), hex(int(w[r, c])))
    return report


class _RankSetup:
    """Device, bundle, stream, arena and the one-shot all-reduce of one rank."""

    def __init__(self, ctx, bundle_dir: str, width: int, timeout_ms: int, max_rows: int):
        from collectives.oneshot import OneShotAllReduce
        from executor.runtime import Arena, Bundle, Device

        self.dev = Device(ctx.device)
        self.bundle = Bundle.load(self.dev, bundle_dir)
        self.stream = self.dev.stream()
        nbytes = max_rows * width * 2
        names = ("inp0", "inp1", "inp2", "res0", "res1", "res2", "out0", "out1", "out2")
        self.arena = Arena(self.dev, [(n, nbytes, f"bf16 [{max_rows}, {width}]") for n in names])
        self.ar = OneShotAllReduce(self.bundle, ctx.rank, ctx.world, width, ctx.exchange,
                                   timeout_ms=timeout_ms)
        self.width = width

    # cuMemcpyHtoD (pageable) and cuMemsetD16 run on the legacy stream and may return before
    # the device is done; our non-blocking stream does not wait for it: synchronize the context.
    def put(self, name: str, x: np.ndarray) -> None:
        from executor.cuda import check, driver
        x = np.ascontiguousarray(x)
        check(driver().cuMemcpyHtoD(self.arena.ptr(name), x, x.nbytes))
        check(driver().cuCtxSynchronize())

    def poison(self, name: str) -> None:
        from executor.cuda import check, driver
        check(driver().cuMemsetD16(self.arena.ptr(name), POISON, self.arena.nbytes(name) // 2))
        check(driver().cuCtxSynchronize())

    def get(self, name: str, rows: int) -> np.ndarray:
        from executor.cuda import check, driver
        out = np.empty((rows, self.width), BF16)
        check(driver().cuMemcpyDtoH(out, self.arena.ptr(name), out.nbytes))
        return out

    def close(self) -> None:
        self.ar.close()
        self.arena.close()
        self.bundle.close()
        self.dev.close()


def _stage(s: _RankSetup, ctx, seed: int, call: int, slot: int, rows: int, fused: bool):
    """Upload call `call`'s input (and residual) into buffers `slot`, poison the output; the
    launch for it, and the check to run once it completed."""
    s.put(f"inp{slot}", draw_input(seed, call, ctx.rank, rows, s.width))
    residual = None
    if fused:
        s.put(f"res{slot}", draw_residual(seed, call, rows, s.width))
        residual = s.arena.ptr(f"res{slot}")
    s.poison(f"out{slot}")
    spec = s.ar.launch_spec(rows, s.arena.ptr(f"inp{slot}"), s.arena.ptr(f"out{slot}"), residual)

    def verify() -> dict:
        want = expected(seed, call, ctx.world, rows, s.width, fused)
        return {"call": call, "rows": rows, "fused": fused,
                **compare(s.get(f"out{slot}", rows), want)}
    return spec, verify


def oneshot_correctness(ctx, bundle_dir: str, width: int, seed: int, timeout_ms: int = 60_000,
                        graph_replays: int = 4) -> dict:
    """Eager single calls over row counts and both epilogues, three back-to-back calls per sync,
    then a captured graph of three calls replayed with fresh inputs (generation handling)."""
    from executor.graphs import Graph

    s = _RankSetup(ctx, bundle_dir, width, timeout_ms, ref.MAX_ROWS)
    reports, call = [], 0
    try:
        for rows, fused in ((1, False), (7, True), (32, False), (192, True), (192, False),
                            (3, True)):
            spec, verify = _stage(s, ctx, seed, call, 0, rows, fused)
            spec.launch(s.stream)
            s.stream.synchronize()
            reports.append({"phase": "eager", **verify()})
            call += 1
        plan = ((5, False), (64, True), (9, False))      # odd count: the parity flips per replay
        staged = [_stage(s, ctx, seed, call + k, k, r, f) for k, (r, f) in enumerate(plan)]
        for spec, _ in staged:                            # queued back to back, one sync
            spec.launch(s.stream)
        s.stream.synchronize()
        reports += [{"phase": "back-to-back", **v()} for _, v in staged]
        call += len(plan)
        with Graph.capture(s.stream) as g:
            for spec, _ in staged:
                spec.launch(s.stream)
        try:
            for _ in range(graph_replays):
                staged = [_stage(s, ctx, seed, call + k, k, r, f) for k, (r, f) in enumerate(plan)]
                g.launch(s.stream)                        # same pointers: the specs are cached
                s.stream.synchronize()
                reports += [{"phase": "graph", **v()} for _, v in staged]
                call += len(plan)
        finally:
            g.close()
        return {"reports": reports, "failed_sources": s.ar.failed_sources()}
    finally:
        ctx.barrier()                                     # nobody frees a buffer still in use
        s.close()


def oneshot_killed_rank(ctx, bundle_dir: str, width: int, victim: int, timeout_ms: int) -> dict:
    """The victim dies (SIGKILL) after set-up; the others launch an all-reduce, which must end
    after about timeout_ms with the victim flagged, and raise CollectiveTimeout."""
    s = _RankSetup(ctx, bundle_dir, width, timeout_ms, ref.MAX_ROWS)
    try:
        ctx.barrier()
        if ctx.rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        spec, _ = _stage(s, ctx, 0, 0, 0, 4, False)
        t0 = time.perf_counter()
        spec.launch(s.stream)
        s.stream.synchronize()
        waited_ms = (time.perf_counter() - t0) * 1e3
        if s.ar.failed_sources() != [victim]:
            raise AssertionError(f"rank {ctx.rank}: expected only rank {victim} flagged, got "
                                 f"{s.ar.failed_sources()} after {waited_ms:.0f} ms")
        from collectives.oneshot import CollectiveTimeout
        try:
            s.ar.raise_if_failed()
        except CollectiveTimeout as exc:
            raise CollectiveTimeout(f"{exc} [waited {waited_ms:.0f} ms]") from None
        raise AssertionError(f"rank {ctx.rank}: raise_if_failed did not raise")
    finally:
        s.close()


def oneshot_timings(ctx, bundle_dir: str, width: int, rows_list, calls_per_graph: int = 10,
                    replays: int = 10, host_calls: int = 100) -> dict:
    """Per rows: host cost of one eager launch (enqueue only) and the per-call time of a graph
    of `calls_per_graph` all-reduces (CUDA events). Every rank runs the same sequence."""
    from executor.graphs import Graph
    from executor.timing import EventTimer

    s = _RankSetup(ctx, bundle_dir, width, 60_000, ref.MAX_ROWS)
    timer = EventTimer(s.stream, max_reps=replays)
    out = {}
    try:
        for rows in rows_list:
            s.put("inp0", draw_input(1, 0, ctx.rank, rows, width))
            spec = s.ar.launch_spec(rows, s.arena.ptr("inp0"), s.arena.ptr("out0"))
            s.stream.synchronize()
            ctx.barrier()
            t0 = time.perf_counter_ns()
            for _ in range(host_calls):
                spec.launch(s.stream)
            host_us = (time.perf_counter_ns() - t0) / 1e3 / host_calls
            s.stream.synchronize()
            with Graph.capture(s.stream) as g:
                for _ in range(calls_per_graph):
                    spec.launch(s.stream)
            try:
                ctx.barrier()
                us = timer.median_us(lambda g=g: g.launch(s.stream), reps=replays, warmup=1)
            finally:
                g.close()
            out[rows] = {"host_us": host_us, "graph_call_us": us / calls_per_graph}
        s.ar.raise_if_failed()
        return out
    finally:
        timer.close()
        ctx.barrier()
        s.close()
