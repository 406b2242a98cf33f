"""Executor.capture on a CPU: it builds the rank's arena, wires the plan on the bound addresses,
and refuses (freeing that arena, changing nothing) while stages are missing."""
import numpy as np
import pytest
from test_executor_cpu import FakeDevice, Recorder, host_bound_tensors
from tiny_checkpoint import tiny_checkpoint

from collectives.oneshot import CollectiveState
from executor.bind import CacheGeometry
from executor.executor import Executor
from executor.hostmem import AddressSpace, HostArena, ManifestBundle
from executor.plan import decode_plan
from loader.checkpoint import Checkpoint
from loader.sharding import shard

GEOMETRY = CacheGeometry(max_seqs=2, ring_slots=32, ring_rows=8, page_size=64, num_pages=4,
                         pages_per_seq=2)        # what the tiny bundle's kernels are built for


class Arenas:
    """An arena_factory that makes HostArenas and remembers which were closed."""

    def __init__(self, space):
        self.space, self.made, self.closed = space, [], []

    def __call__(self, requests):
        arena = HostArena(self.space, requests, name=f"arena{len(self.made)}")
        arena.close = lambda a=arena: self.closed.append(a)
        self.made.append(arena)
        return arena


def _executor(ckpt, bundle_dir, space, arenas, modules, capture_graphs=None):
    cfg, tp, rank = ckpt.config, 4, 2
    ex = Executor(cfg, ManifestBundle(bundle_dir), lambda name: shard(ckpt, ckpt.spec(name), tp,
                                                                      rank),
                  tp, rank, CollectiveState(rank, tp, {"peers": 1 << 40, "control": 1 << 40,
                                                       "status": 1 << 40}),
                  device=FakeDevice(), geometry=GEOMETRY,
                  capture_graphs=capture_graphs or Recorder(),
                  stage_modules=modules, arena_factory=arenas)
    ex.bind(**host_bound_tensors(space, ex.rules))
    return ex


@pytest.fixture(scope="module")
def ckpt():
    with Checkpoint.open(tiny_checkpoint(), progress=False) as c:
        yield c


def test_capture_wires_what_it_can_then_refuses_and_frees_the_arena(ckpt, tiny_bundle_dir):
    space = AddressSpace()
    arenas = Arenas(space)
    modules = ("executor.stages.collectives", "stage_norm_probe")
    ex = _executor(ckpt, tiny_bundle_dir, space, arenas, modules)
    with pytest.raises(NotImplementedError) as info:
        ex.capture("capture-stream")
    msg = str(info.value)
    assert "attn.wq_b" in msg and "attn.allreduce" not in msg and "attn.norm" not in msg
    assert len(arenas.made) == 1 and arenas.closed == arenas.made
    assert ex.arena is None and not ex.captured
    assert len(ex.plan.missing_stages()) == len(decode_plan(ckpt.config).stages)
    arena = arenas.made[0]
    norm = "layers.2.attn_norm.weight"
    assert np.array_equal(arena.view(norm, np.uint8), ckpt.get(norm).view(np.uint8))
    assert "streams" in arena.slices and "pick" in arena.slices


def test_a_failed_capture_after_wiring_frees_the_arena_and_unwires(ckpt, tiny_bundle_dir):
    """Every stage wired (the default stage modules), then the graph capture fails: the arena
    this capture built is freed and the plan is the unwired one again."""
    from executor.wiring import STAGE_MODULES

    def failing_capture(stream, record, buckets):
        raise RuntimeError("capture failed")

    space = AddressSpace()
    arenas = Arenas(space)
    ex = _executor(ckpt, tiny_bundle_dir, space, arenas, STAGE_MODULES, failing_capture)
    before = ex.plan
    with pytest.raises(RuntimeError, match="capture failed"):
        ex.capture("capture-stream")
    assert len(arenas.made) == 1 and arenas.closed == arenas.made
    assert ex.arena is None and ex.plan is before and not ex.captured



def test_poll_timeouts_reads_each_kernels_sticky_flag(ckpt, tiny_bundle_dir):
    """poll_timeouts() is empty without an arena and on a zeroed one, skips a flag the plan's
    arena lacks, and names each polling kernel whose flag (its scratch's first i32) is set."""
    from executor.executor import POLL_FLAGS

    space = AddressSpace()
    ex = _executor(ckpt, tiny_bundle_dir, space, Arenas(space), modules=None)
    assert ex.poll_timeouts() == []
    ex.arena = HostArena(space, [(name, 64) for name, _ in POLL_FLAGS] + [("other", 64)])
    assert ex.poll_timeouts() == []
    ex.arena.view("other", np.int32, (1,))[0] = 1
    assert ex.poll_timeouts() == []
    for i, (name, what) in enumerate(POLL_FLAGS):
        ex.arena.view(name, np.int32, (1,))[0] = 1
        found = ex.poll_timeouts()
        assert len(found) == i + 1 and what in found[-1] and name in found[-1]
    ex.arena = HostArena(space, [(POLL_FLAGS[0][0], 64)])        # a plan without the router
    ex.arena.view(POLL_FLAGS[0][0], np.int32, (1,))[0] = 1
    assert len(ex.poll_timeouts()) == 1
    ex.arena = None
