"""Round 9, the work-queue MoE pair (kernels/moe_queue.py: w13sr "bulkq", w2sr "earlyq") on the CPU:
specs and ABI (the static kernels' with one `sched` pointer before rows), the step's pick, the
emulated chain against the reference three times in a row with the counters zero after each, and
a model of the claim protocol (every item run once, by any CTA, whatever the CTAs' speeds)."""
from __future__ import annotations

import heapq
from dataclasses import replace

import numpy as np
import pytest
from test_emulate_moe import Setup, _check_xq, _check_y

from executor.launches import moe as ml
from kernels import moe_kernel_ref as mk
from loader.config import ModelConfig


@pytest.mark.parametrize("config", ["tiny", "v41-flash"])
def test_queued_pair_is_the_static_pair_with_one_sched_pointer(config):
    """Same block, shared memory, ring, occupancy and grid at every R as w13sr "bulk" / w2sr
    "early"; `sched` before rows (before stamps in their timeline builds); in the family's specs
    at every MoE shape."""
    from kernels import moe
    cfg = ModelConfig.preset(config)
    names = {s.name for s in moe.specs(cfg, 4)}
    for shape in mk.moe_shapes(cfg, 4):
        every = {(s.kind, s.variant): s for s in mk.selfrouted_specs(shape)}
        for (kind, variant), base_variant in mk.QUEUED_VARIANTS.items():
            spec, base = every[(kind, variant)], every[(kind, base_variant)]
            assert spec.queued and not base.queued and spec.name in names
            assert spec.params == (*base.params[:-1], ("sched", "u64"), ("rows", "u32"))
            assert (spec.block, spec.smem_bytes, spec.stages, spec.ctas_per_sm,
                    spec.launch_bound) == (base.block, base.smem_bytes, base.stages,
                                           base.ctas_per_sm, base.launch_bound)
            assert all(spec.grid(r) == base.grid(r) for r in (1, 3, 6, 48, 96, 192))
            assert spec.to_dict()["queued"] is True and "queued" not in base.to_dict()
            assert replace(spec, name=base.name, variant=base.variant) == base
        stamped = {(s.kind, s.variant): s for s in mk.timeline_specs(shape)}
        for key in mk.QUEUED_VARIANTS:          # timeline builds: sched, then stamps
            assert stamped[key].params == (*every[key].params[:-1], ("stamps", "u64"),
                                           ("rows", "u32"))
            assert stamped[key].params[-3] == ("sched", "u64") and stamped[key].name in names
        # bulkq copies as bulk (parts, window, barriers)
        split = every[("w13sr", "bulkq")].block[0] // mk.LANES
        assert (mk.bulk_parts(shape, split, "bulkq"), mk.bulk_window(shape, split, "bulkq")) == (
            mk.bulk_parts(shape, split, "bulk"), mk.bulk_window(shape, split, "bulk"))
    # the two kinds' (claim, done) words are disjoint and inside sched; the hand-off slots sit
    # in the lists' header after the distinct count (byte 32) and before the experts
    assert sorted(mk.SCHED_AT.values()) == [0, 2] and mk.SCHED_WORDS == 4
    assert 36 <= mk.QUEUE_SLOTS_AT and mk.QUEUE_SLOTS_AT + 8 <= mk.ROUTING_HEADER


@pytest.fixture(scope="module")
def setup(tiny_bundle_dir):
    return Setup(tiny_bundle_dir)


@pytest.mark.parametrize("rows", [3, 6, 48, mk.MAX_ROWS])
def test_step_picks_the_queued_pair_only_with_sched(setup, rows, monkeypatch):
    s = setup
    tag = s.shape.tag()

    def picked(ptrs):
        return [spec.kernel.name for spec in ml.step_launches(s.bundle, s.shape, ptrs, rows)]
    assert picked(s.ptrs)[1:3] == [f"moe_w13sr_{tag}_bulkq", f"moe_w2sr_{tag}_earlyq"]
    launches = ml.step_launches(s.bundle, s.shape, s.ptrs, rows)
    assert [spec.args[-2] for spec in launches[1:3]] == [s.ptrs["sched"]] * 2
    static = [f"moe_w13sr_{tag}_{ml.STEP_SELFROUTED_W13}", f"moe_w2sr_{tag}_early"]
    assert picked({k: v for k, v in s.ptrs.items() if k != "sched"})[1:3] == static
    monkeypatch.setattr(ml, "STEP_QUEUE", False)        # bench_step's "moe_static"
    assert picked(s.ptrs)[1:3] == static


def test_bench_step_has_the_static_variant():
    from executor import bench_step
    with bench_step.overrides(bench_step.STEP_VARIANTS["moe_static"]()):
        assert ml.STEP_QUEUE is False
    assert ml.STEP_QUEUE is True


@pytest.mark.parametrize(("kind", "rows"), [("uniform", 3), ("uniform", 6), ("one_expert", 8),
                                            ("distinct", 2), ("uniform", 48)])
def test_queued_chain_equals_the_reference_three_times(setup, kind, rows):
    """xquant -> bulkq -> earlyq -> combine three times: the reference's y, sched zero after each;
    a queued kernel that finds its words nonzero raises (on the GPU it would skip items)."""
    s = setup
    x, _, want = s.inputs(kind, rows)
    sched = s.arena.view("sched", np.uint32)
    launches = ml.selfrouted_launches(s.bundle, s.shape, s.ptrs, rows, *ml.QUEUED_PAIR)
    for launch in range(3):
        what = f"queued chain ({kind}, R={rows}, launch {launch})"
        _check_y(s.run(launches), want, what)
        _check_xq(s, x, what)
        assert not sched.any(), f"{what}: sched left {sched.tolist()}"
    for at in mk.SCHED_AT.values():
        sched[at + 1] = 5
        with pytest.raises(ValueError, match=r"sched .*\(claim, done\) = \[0, 5\]"):
            s.run(launches)
        sched[...] = 0


# ---- a model of the claim protocol --------------------------------------------------------------

def _simulate(total: int, grid: int, ahead: int, rng) -> tuple[list[int], int, int]:
    """Event model of kernels/moe_queue.py: CTA b runs item b first; each later item is the
    value of a claim (grid + counter++) made `ahead` items before it is run (w2 "earlyq": 1, at
    the item before's top; w13 "bulkq": 2, the second item's claim at entry); a CTA stops at
    the first claimed value >= total, then adds to done; the add that completes the grid zeroes
    both counters. Item times random per CTA (its SM's rate) and per item. Returns (runs per
    item, claim and done counters after the launch)."""
    claim, done = 0, 0
    runs = [0] * total
    speed = rng.uniform(0.7, 1.3, grid)
    queue = []                          # (time, cta): the CTA starts its next item then
    held: dict[int, list[int]] = {}
    for b in range(grid):
        held[b] = [b]
        for _ in range(ahead - 1):      # claims before the first item's top (bulkq: at entry)
            held[b].append(grid + claim)
            claim += 1
        heapq.heappush(queue, (0.0, b))
    while queue:
        now, b = heapq.heappop(queue)
        item = held[b].pop(0)
        if item >= total:
            done += 1
            if done == grid:
                claim, done = 0, 0
            continue
        runs[item] += 1
        if held[b][-1:] == [] or held[b][-1] < total:   # claim the next-but-(ahead - 1) item
            held[b].append(grid + claim)
            claim += 1
        heapq.heappush(queue, (now + speed[b] * rng.uniform(0.9, 1.1), b))
    return runs, claim, done


@pytest.mark.parametrize("ahead", [1, 2])
def test_claim_protocol_runs_every_item_once_and_resets(ahead):
    rng = np.random.default_rng()
    for total, grid in ((2506, 396), (1392, 396), (36, 396), (396, 396), (397, 396), (5, 7)):
        for _ in range(3):
            runs, claim, done = _simulate(total, grid, ahead, rng)
            assert runs == [1] * total, (total, grid, ahead)
            assert (claim, done) == (0, 0)


def test_every_step_kernel_waits_on_its_predecessor(tiny_bundle_dir):
    """w13sr "bulkq" claims its second item before its griddepcontrol.wait, relying on the
    previous launch of itself (at least two kernels back) having completed when it starts: true
    when every kernel of the stream executes griddepcontrol.wait (a grid then completes only after
    its predecessor did, so completion is transitive). Only the runtime's PDL probe has none."""
    import json
    kernels = json.loads((tiny_bundle_dir / "manifest.json").read_text())["kernels"]
    assert [n for n, k in kernels.items() if not k["pdl_wait"] and not n.startswith("probe_")] == []


@pytest.mark.parametrize("rows", [3, 6])
def test_timeline_launches_of_the_queued_and_the_static_pair(setup, rows):
    """devicecheck's timeline: the step's pair (queued where ptrs has sched) with its w13 / w2
    replaced by their `_tl` builds (sched, then stamps, then rows), and with static=True the
    static pair's."""
    s = setup
    stamps = (1 << 40, 1 << 41)
    tag = s.shape.tag()
    for static, pair in ((False, ml.QUEUED_PAIR), (True, (ml.STEP_SELFROUTED_W13, "early"))):
        got = ml.timeline_launches(s.bundle, s.shape, s.ptrs, rows, stamps, static=static)
        plain = ml.selfrouted_launches(s.bundle, s.shape, s.ptrs, rows, *pair)
        assert [g.kernel.name for g in got[1:3]] == [
            f"moe_w13sr_{tag}_{pair[0]}_tl", f"moe_w2sr_{tag}_{pair[1]}_tl"]
        for i in (1, 2):
            assert got[i].grid == plain[i].grid
            assert got[i].args == (*plain[i].args[:-1], stamps[i - 1], rows)
        assert (got[1].args[-3] == s.ptrs["sched"]) == (not static)
