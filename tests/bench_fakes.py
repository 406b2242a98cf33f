"""CPU doubles for the benchmarks' GPU paths (executor/bench_step.py, bench_round.py, bench_tp.py).

`CaptureLog.install` replaces `Graph.capture` and `LaunchSpec.launch`, so a benchmark's case
function runs on the host with its real wired plans: every launch, stream fork/join and replay
lands in one log, and each captured graph keeps the part of the log its capture recorded. A test
then reads how a graph was captured: which launches went to the side stream, where the fork and
join events stand, which launches kept the PDL attribute.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np

from executor.branches import SideStream


@dataclass(frozen=True)
class Launch:
    kernel: str
    pdl: bool
    stream: str


class Stream:
    def __init__(self, name: str):
        self.name = name

    def synchronize(self) -> None:
        pass


class Event:
    def __init__(self, log: CaptureLog, name: str):
        self.log, self.name = log, name

    def record(self, stream) -> None:
        self.log.events.append(("record", self.name, stream.name))

    def wait(self, stream) -> None:
        self.log.events.append(("wait", self.name, stream.name))


class Graph:
    """A captured graph: the log entries its capture recorded; replays and close are logged."""

    def __init__(self, log: CaptureLog, stream):
        self.log, self.stream, self.events, self.closed = log, stream, None, False

    @property
    def launches(self) -> list[Launch]:
        return [e for e in self.events if isinstance(e, Launch)]

    def on(self, stream: str) -> list[Launch]:
        return [e for e in self.launches if e.stream == stream]

    def launch(self, stream) -> None:
        assert not self.closed and self.events is not None
        self.log.replays.append(self)

    def close(self) -> None:
        self.closed = True


@dataclass
class CaptureLog:
    events: list = field(default_factory=list)
    graphs: list = field(default_factory=list)
    replays: list = field(default_factory=list)
    main: Stream = field(default_factory=lambda: Stream("main"))

    def side_stream(self) -> SideStream:
        return SideStream(Stream("side"), Event(self, "fork"), Event(self, "join"))

    def install(self, monkeypatch) -> CaptureLog:
        from executor.graphs import Graph as RealGraph
        from executor.launch import LaunchSpec

        log = self

        @contextlib.contextmanager
        def capture(stream):
            graph = Graph(log, stream)
            start = len(log.events)
            yield graph
            graph.events = log.events[start:]
            log.graphs.append(graph)

        def launch(spec, stream):
            log.events.append(Launch(spec.kernel.name, spec.pdl, stream.name))

        monkeypatch.setattr(RealGraph, "capture", capture)
        monkeypatch.setattr(LaunchSpec, "launch", launch)
        return self


class Timer:
    """EventTimer's median_us: runs the body once, reports `us`."""

    def __init__(self, us: float = 100.0):
        self.us, self.calls = us, 0

    def median_us(self, fn, reps, warmup=None) -> float:
        fn()
        self.calls += 1
        return self.us


def side_launches(plan, rows: int) -> int:
    """How many of `plan`'s launches at `rows` its side stages make."""
    return sum(len(specs) for stage, specs in plan.launches(rows) if stage.side)


def assert_branched(graph: Graph, plan, rows: int) -> None:
    """`graph` holds `plan`'s launches at `rows` in record (stage) order, its side stages' on the
    side stream after a fork, the main stream waiting on the join before the next `joins` stage."""
    built = plan.launches(rows)
    want = [(spec.kernel.name, stage.side) for stage, specs in built for spec in specs]
    assert [(e.kernel, e.stream == "side") for e in graph.launches] == want
    forks = [i for i, e in enumerate(graph.events) if e == ("wait", "fork", "side")]
    joins = [i for i, e in enumerate(graph.events) if e == ("wait", "join", "main")]
    assert forks and joins and len(graph.on("side")) == side_launches(plan, rows)
    for i, e in enumerate(graph.events):             # every side launch follows a fork
        if isinstance(e, Launch) and e.stream == "side":
            assert any(f < i for f in forks)


class HostArray:
    """What the benchmarks read of a CuPy array (`a[:n].get()`), over NumPy."""

    def __init__(self, array):
        self.array = np.asarray(array)

    def __getitem__(self, key) -> HostArray:
        return HostArray(self.array[key])

    def get(self):
        return self.array.copy()
