"""Executor DSpark rounds on a CPU: capture of the verify and draft graphs per sequence-slot bucket,
`round` / `draft` replaying them (draft, then verify), their declines (nothing launched) and the
refusals of bad arguments; then the real plans wired on a HostArena (every stage, both plans).

Graphs are tests/test_executor_cpu.py's recording fakes: each replay logs (bucket, stream) and
the launches record(bucket) made, in plan order. Row counts, slot counts and streams are drawn
fresh per run.
"""
from __future__ import annotations

import numpy as np
import pytest
from test_executor_cpu import (
    CFG,
    FakeDevice,
    Recorder,
    _Capturing,
    fake_tensors,
)

from executor.executor import Executor
from executor.graphs import BUCKETS
from executor.plan import decode_plan, draft_plan
from executor.reasons import StepResult

K = CFG.dspark_block_size
GEOMETRY_KW = {"max_seqs": 4, "ring_slots": 32, "ring_rows": 8, "page_size": 64,
               "num_pages": 16, "pages_per_seq": 4}


def _fake(plan, recorder: Recorder, tag: str):
    """`plan` with every stage wired to one fake launch named `tag:stage`."""
    for stage in plan.stages:
        plan = plan.wire(stage.name, lambda rows, n=stage.name: [_Capturing(recorder,
                                                                             f"{tag}:{n}")])
    return plan


def _executor(buckets=BUCKETS, bind=True, capture=True):
    from executor.bind import CacheGeometry

    rec = Recorder()
    ex = Executor(CFG, bundle=None, weights=None, tp=2, rank=1, device=FakeDevice(),
                  geometry=CacheGeometry(**GEOMETRY_KW), buckets=buckets, capture_graphs=rec,
                  dspark=True,
                  plan=_fake(decode_plan(CFG, dspark=True, sync_free=True), rec, "verify"),
                  draft=_fake(draft_plan(CFG, sync_free=True), rec, "draft"))
    if bind:
        ex.bind(**fake_tensors(ex.rules))
    if capture:
        ex.capture("capture-stream")
    return ex, rec


def _slots(buckets) -> list[int]:
    return sorted({max(1, b // (K + 1)) for b in buckets})


def test_capture_makes_verify_and_draft_graphs_per_slot_bucket():
    ex, rec = _executor()
    slots = _slots(BUCKETS)
    assert ex.round_slots == tuple(slots) and slots[-1] == 192 // (K + 1)
    # verify graphs first (largest first), then the draft graphs
    assert rec.captured == ([s * (K + 1) for s in reversed(slots)]
                            + [s * K for s in reversed(slots)])
    assert {"accepted", "bonus"} <= set(ex.rules)


def test_round_replays_the_draft_then_the_verify_graph_of_the_slot_bucket():
    ex, rec = _executor()
    stream = int(np.random.default_rng().integers(2, 1 << 40))
    verify = [f"verify:{s.name}" for s in ex.plan.stages]
    draft = [f"draft:{s.name}" for s in ex.draft_plan.stages]
    assert draft[-2:] == ["draft:dspark.history_verify", "draft:dspark.advance_verify"]
    assert verify[-2:] == ["verify:dspark.history_draft", "verify:dspark.advance_draft"]
    for n in range(1, ex.round_slots[-1] + 1):
        rec.graph_launches.clear()
        rec.kernel_launches.clear()
        assert ex.round(n, stream) == StepResult.SERVED
        s = min(b for b in ex.round_slots if b >= n)
        assert rec.graph_launches == [(s * K, stream), (s * (K + 1), stream)]
        assert rec.kernel_launches == draft + verify
        rec.graph_launches.clear()
        assert ex.draft(n, stream) == StepResult.SERVED
        assert rec.graph_launches == [(s * K, stream)]


def test_step_replays_the_verify_graph_of_the_smallest_slot_bucket():
    ex, rec = _executor(buckets=(8, 64, 192))
    assert ex.round_slots == (1, 10, 32)
    for rows, bucket in [(1, 6), (6, 6), (7, 60), (60, 60), (61, 192), (192, 192)]:
        rec.graph_launches.clear()
        assert ex.step(rows, 9) == StepResult.SERVED
        assert rec.graph_launches == [(bucket, 9)]
    assert ex.step(193, 9) == StepResult.TOO_MANY_ROWS


def test_round_declines_launch_nothing():
    rng = np.random.default_rng()
    ex, rec = _executor(bind=False, capture=False)
    n = int(rng.integers(1, 33))
    for call in (ex.round, ex.draft):
        assert call(n, 7) == StepResult.NOT_BOUND
    ex.bind(**fake_tensors(ex.rules))
    for call in (ex.round, ex.draft):
        assert call(n, 7) == StepResult.NOT_CAPTURED
    ex.capture("capture-stream")
    for call in (ex.round, ex.draft):
        assert call(0, 7) == StepResult.NO_ROWS
        assert call(33 + int(rng.integers(0, 100)), 7) == StepResult.TOO_MANY_ROWS
    assert rec.graph_launches == []
    ex.close()
    for call in (ex.round, ex.draft):
        assert call(n, 7) == StepResult.CLOSED
    assert rec.graph_launches == [] and rec.kernel_launches == []


def test_the_largest_slot_bucket_bounds_a_round():
    ex, rec = _executor(buckets=(8, 48, 192))             # slots 1, 8, 32
    assert ex.round(8, 5) == StepResult.SERVED
    rec.graph_launches.clear()
    assert ex.round(9, 5) == StepResult.SERVED
    assert rec.graph_launches == [(32 * K, 5), (32 * (K + 1), 5)]
    ex2, rec2 = _executor(buckets=(8, 48))
    assert ex2.round(8, 5) == StepResult.SERVED
    assert ex2.round(9, 5) == StepResult.TOO_MANY_ROWS
    assert rec2.graph_launches == [(40, 5), (48, 5)]


def test_round_takes_plain_ints_and_needs_dspark():
    ex, rec = _executor()
    for bad in [(np.int64(2), 7), (2.0, 7), (True, 7), (2, "7")]:
        for call in (ex.round, ex.draft):
            with pytest.raises(TypeError, match="plain ints"):
                call(*bad)
    for bad in [(2, 0), (2, 1), (-1, 7)]:
        with pytest.raises(ValueError, match="legacy default stream"):
            ex.round(*bad)
    assert rec.graph_launches == []
    from test_executor_cpu import ready_executor
    plain, rec = ready_executor()
    assert plain.round(1, 7) == StepResult.UNSUPPORTED_FEATURE
    assert plain.draft(1, 7) == StepResult.UNSUPPORTED_FEATURE
    assert rec.graph_launches == []
    with pytest.raises(ValueError, match="dspark=True"):
        Executor(CFG, None, None, tp=2, rank=0, device=FakeDevice(),
                 geometry=ex.geometry, draft=ex.draft_plan)


def test_capture_wires_both_real_plans_on_the_arena(tiny_bundle_dir):
    """The real stage modules wire every stage of both sync-free plans on one HostArena (the
    draft plan's cross-rank stages through the executor's comm, as the verify plan's)."""
    from test_executor_cpu import FakeGraph, host_bound_tensors
    from test_executor_wiring import GEOMETRY, Arenas
    from tiny_checkpoint import tiny_checkpoint

    from collectives.oneshot import CollectiveState
    from executor.graphs import GraphSet
    from executor.hostmem import AddressSpace, ManifestBundle
    from executor.wiring import STAGE_MODULES
    from loader.checkpoint import Checkpoint
    from loader.sharding import shard

    space, captured = AddressSpace(), []
    arenas = Arenas(space)

    def capture(stream, record, buckets):         # no launch: the buckets, empty graphs
        captured.extend(sorted(buckets, reverse=True))
        return GraphSet({b: FakeGraph(b, [], []) for b in buckets})

    with Checkpoint.open(tiny_checkpoint(), progress=False) as ckpt:
        tp, rank = 4, 1
        ex = Executor(ckpt.config, ManifestBundle(tiny_bundle_dir),
                      lambda name: shard(ckpt, ckpt.spec(name), tp, rank), tp, rank,
                      CollectiveState(rank, tp, {"peers": 1 << 40, "control": 1 << 40,
                                                 "status": 1 << 40}),
                      device=FakeDevice(), geometry=GEOMETRY, buckets=(8, 192),
                      capture_graphs=capture,
                      stage_modules=STAGE_MODULES, arena_factory=arenas, dspark=True)
        ex.bind(**host_bound_tensors(space, ex.rules))
        ex.capture("capture-stream")
    assert not ex.plan.missing_stages() and not ex.draft_plan.missing_stages()
    assert len(arenas.made) == 1 and arenas.closed == []
    assert captured == [192, 6, 160, 5]
    for rows in (6, 192):                           # every builder, at both slot buckets
        assert ex.plan.launches(rows)
        assert ex.draft_plan.launches(rows // (K + 1) * K)
    names = [spec.kernel.name for _, specs in ex.draft_plan.launches(5) for spec in specs]
    assert names[-2:] == [f"dspark_history_verify_k{K}_c3_n{CFG.dspark_noise_token_id}",
                          f"dspark_advance_verify_k{K}_n{CFG.dspark_noise_token_id}"]
    ex.close()
    assert arenas.closed == arenas.made
