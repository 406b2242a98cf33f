"""Side branches: stages that run beside the step's main chain, on a second stream.

Some of a layer's launches feed nothing the main chain runs next: the shared expert's w1|w3 is read
only by its w2, which follows the router and the routed experts; the compressor and the indexer
are read only by sparse MQA, which follows wq_b and the q RoPE. At decode sizes a launch is
latency, not bandwidth (docs/perf.md: 4-15 us a launch against 1-2 us of weight traffic), so such
a launch costs nothing when it runs beside the chain instead of in it.

A plan marks those stages `side` and the stage its branch joins before `joins`
(executor.plan.Stage); `Plan.record(stream, rows, side=SideStream)` enqueues them:

    side.fork(main)     # before a side stage: the side stream waits for main's work so far
                        # (not again before the next side stage if main enqueued nothing since)
    ... the side stage's launches on side.stream, main stages' on main ...
    side.join(main)     # main waits for everything enqueued on the side stream so far

A side stage thus starts once both its side predecessors and the main stages placed before it in
the plan are done: the compressor (placed after the attention norm) runs beside wq_a|wkv, the
indexer (after q_kv_norm, whose attn.qr it reads) beside wq_b.

Under a graph capture the fork and the join become the graph's edges (no event stays in the
graph); eagerly they are an event record and a stream wait. Every kernel still calls
griddepcontrol.wait before reading its inputs, so a launch with the PDL attribute and two
predecessors (the join) starts its prologue early and waits for both.

One SideStream serves a whole plan: branches never nest and each joins within its layer (Plan
checks this), so its two events are reused in stream order.
"""
from __future__ import annotations


class SideStream:
    """The second stream of a plan's branches and the two events that fork and join it."""

    def __init__(self, stream, fork_event, join_event):
        self.stream = stream
        self._fork, self._join = fork_event, join_event

    @classmethod
    def create(cls, device) -> SideStream:
        """On `device` (runtime.Device or a test double): a new non-blocking stream and two
        ordering events, all released with the device."""
        return cls(device.stream(), device.event(), device.event())

    def fork(self, main) -> None:
        self._fork.record(main)
        self._fork.wait(self.stream)

    def join(self, main) -> None:
        self._join.record(self.stream)
        self._join.wait(main)
