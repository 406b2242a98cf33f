"""CUDA graphs: capture a stream's launches once, replay them with one cuGraphLaunch, per bucket.

    with Graph.capture(stream) as g:      # THREAD_LOCAL: other threads' CUDA calls stay legal
        spec.launch(stream)               # ... every launch of the step
    g.launch(stream)                      # ~2-4 us of host time, whatever the node count

Launches made with the PDL attribute become programmatic edges in the captured graph
(`edge_types()` reports them). Buckets follow vLLM: 1, 2, 4, 8, 16, ..., 192 rows; a step of R rows
replays the graph of the smallest bucket >= R (`bucket_for`, a list lookup).
"""
from __future__ import annotations

from collections.abc import Callable

from executor.cuda import check, driver

BUCKETS: tuple[int, ...] = (1, 2, 4, *range(8, 193, 8))


def bucket_table(buckets=BUCKETS) -> list[int]:
    """table[r] = smallest bucket >= r for r in 1..max(buckets); table[0] = 0 (no step)."""
    bs = sorted(set(buckets))
    if not bs or bs[0] < 1 or any(not isinstance(b, int) for b in bs):
        raise ValueError(f"buckets must be positive ints, got {buckets!r}")
    table, i = [0], 0
    for r in range(1, bs[-1] + 1):
        while bs[i] < r:
            i += 1
        table.append(bs[i])
    return table


class Graph:
    """An instantiated, uploaded CUDA graph (plus its source graph, kept for inspection)."""

    def __init__(self):
        self.graph = None          # CUgraph
        self.exec = None           # CUgraphExec

    @classmethod
    def capture(cls, stream) -> _Capture:
        """Context manager: capture `stream` (thread-local mode); the Graph is ready after it."""
        return _Capture(cls(), stream)

    def launch(self, stream) -> None:
        err, = driver().cuGraphLaunch(self.exec, stream.cu_handle)
        if err != 0:
            check((err,), call="cuGraphLaunch")

    def num_nodes(self) -> int:
        _nodes, n = check(driver().cuGraphGetNodes(self.graph, 0))
        return int(n)

    def edge_types(self) -> list[str]:
        """The type of every dependency edge: 'programmatic', 'default' or another enum name."""
        cu = driver()
        *_, n = check(cu.cuGraphGetEdges(self.graph, 0))
        if not n:
            return []
        _from, _to, data, n = check(cu.cuGraphGetEdges(self.graph, n))
        kinds = cu.CUgraphDependencyType
        names = {int(kinds.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC): "programmatic",
                 int(kinds.CU_GRAPH_DEPENDENCY_TYPE_DEFAULT): "default"}
        return [names.get(int(d.type), str(d.type)) for d in data[:n]]

    def close(self) -> None:
        cu = driver()
        if self.exec is not None:
            check(cu.cuGraphExecDestroy(self.exec))
            self.exec = None
        if self.graph is not None:
            check(cu.cuGraphDestroy(self.graph))
            self.graph = None


class _Capture:
    def __init__(self, graph: Graph, stream):
        self.g = graph
        self.stream = stream

    def __enter__(self) -> Graph:
        cu = driver()
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        check(cu.cuStreamBeginCapture(self.stream.cu_handle, mode))
        return self.g

    def __exit__(self, exc_type, exc, tb) -> bool:
        cu = driver()
        err, graph = cu.cuStreamEndCapture(self.stream.cu_handle)
        if exc_type is not None:          # the body failed: drop the partial graph, keep its error
            if err == 0 and graph is not None:
                cu.cuGraphDestroy(graph)
            return False
        check((err,), call="cuStreamEndCapture")
        self.g.graph = graph
        try:
            self.g.exec = check(cu.cuGraphInstantiate(graph, 0))
            check(cu.cuGraphUpload(self.g.exec, self.stream.cu_handle))
        except BaseException:
            self.g.close()
            raise
        return False


class GraphSet:
    """One graph per row bucket, all recorded by the same `record(rows)` callback."""

    def __init__(self, graphs: dict[int, Graph]):
        self.graphs = graphs
        self._table = bucket_table(tuple(graphs))
        self.max_rows = len(self._table) - 1

    @classmethod
    def capture(cls, stream, record: Callable[[int], None], buckets=BUCKETS) -> GraphSet:
        """Capture record(b) for every bucket b, largest first (as vLLM does)."""
        graphs: dict[int, Graph] = {}
        try:
            for b in sorted(set(buckets), reverse=True):
                with Graph.capture(stream) as g:
                    record(b)
                graphs[b] = g
        except BaseException:
            for g in graphs.values():
                g.close()
            raise
        return cls(graphs)

    def bucket_for(self, rows: int) -> int:
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"rows={rows} outside the captured buckets 1..{self.max_rows}")
        return self._table[rows]

    def launch(self, rows: int, stream) -> int:
        """Replay the graph of rows' bucket on stream; returns the bucket."""
        b = self.bucket_for(rows)
        self.graphs[b].launch(stream)
        return b

    def close(self) -> None:
        for g in self.graphs.values():
            g.close()
