"""The cross-GPU step and round benchmark's host side, without a GPU (executor/bench_tp.py).

The real cross-rank stage modules replace the local stand-ins; the step and round plans wire
complete on them at tiny scale (a HostArena, a collective state by address) with every
all-reduce, all-gather and pick a launch of the one-shot family; one rank's step and round cases
run on capture doubles (tests/bench_fakes.py) and capture every whole graph through Plan.record
with its side branches, the PDL variants as relaunches; the ranks' results aggregate to the
slowest rank and flag ranks that hold different tokens; the tables print.
"""
from __future__ import annotations

import types

import bench_fakes as fakes
import numpy as np
import pytest

from collectives.oneshot import CollectiveState
from executor import bench_round as br
from executor import bench_step as bs
from executor import bench_tp as bt
from executor.emulate import bind_host
from executor.emulate.ranks import caller_tensors
from executor.hostmem import AddressSpace, HostArena, ManifestBundle
from executor.plan import decode_plan
from executor.wiring import StepContext, arena_contents, representatives, wire
from loader.config import ModelConfig
from loader.synth import synth_fetch


def test_cross_rank_modules_replace_the_stand_ins():
    assert "executor.stages.collectives" in bt.STEP_MODULES
    assert "executor.stages.local_collectives" not in bt.STEP_MODULES + bt.ROUND_MODULES
    assert len(bt.STEP_MODULES) == len(bs.BENCH_MODULES)
    with pytest.raises(ValueError, match="local_collectives"):
        bt.cross_rank_modules(("executor.stages.mhc",))
    assert bt.skip_reason((0, 1, 2, 3)) is None
    assert "4 distinct GPUs" in bt.skip_reason((0,))
    assert "4 distinct GPUs" in bt.skip_reason((0, 0, 1, 2))


@pytest.fixture(scope="module")
def tiny_rank(tiny_bundle_dir):
    """Rank 1 of tiny on a HostArena with the round modules (a superset of the step's)."""
    cfg = ModelConfig.preset("tiny")
    case = br.RoundCase(2, cfg.dspark_block_size)
    geometry = bs.cache_geometry(cfg, [case.verify], (300,), extra_tokens=64)
    requests, uploads = arena_contents(cfg, bs.TP, 1, synth_fetch(cfg, 0, bs.TP, 1),
                                       bs.MAX_ROWS, bt.ROUND_MODULES, representatives(cfg))
    space = AddressSpace()
    arena = HostArena(space, requests)
    for name, array in uploads:
        arena.upload(name, array)
    tensors = {n: a for n, a in caller_tensors(cfg, bs.TP, geometry, bs.MAX_ROWS,
                                               dspark=True).items()
               if n in bs.bound_rules(cfg, geometry, dspark=True)}
    state = CollectiveState(1, bs.TP, {"peers": 4096, "control": 8192, "status": 12288})

    def context():
        return StepContext(cfg, bs.TP, 1, ManifestBundle(tiny_bundle_dir), arena,
                           bind_host(space, tensors), bs.MAX_ROWS, collectives=state,
                           geometry=geometry)
    return cfg, case, context


def test_step_and_round_wire_on_the_one_shot_collectives(tiny_rank):
    cfg, case, context = tiny_rank
    layers = cfg.num_hidden_layers
    step = wire(decode_plan(cfg), context(), bt.STEP_MODULES)
    step.require_complete()
    cross = [s for _, group in step.launches(6) for s in group if br.is_cross_rank(s)]
    # embedding + 2 per layer all-reduces, two all-gathers per Engram layer (heads, wkv output:
    # one row chunk at 6 rows), one pick
    assert len(cross) == 1 + 2 * layers + 2 * len(cfg.engram_layer_ids) + 1
    specs = [s for _, group in step.launches(6) for s in group]
    variants = {name: [s if r is None else r(s) for s in specs]      # in record order
                for name, r in bt.pdl_relaunches().items()}
    pdl = {name: [s.pdl for s in v] for name, v in variants.items()}
    assert all(len(v) == len(specs) for v in variants.values())
    assert sum(pdl["pdl"]) - sum(pdl["ar_plain"]) == sum(s.pdl for s in cross)
    assert not any(pdl["plain"]) and sum(pdl["after_ar_plain"]) < sum(pdl["pdl"])
    assert [s.kernel for s in variants["after_ar_plain"]] == [s.kernel for s in specs]
    plans = br.wire_round(cfg, context(), bt.ROUND_MODULES)
    stages = sum(s.is_dspark for s in cfg.layers)
    draft = [s for _, g in plans["draft"].launches(case.draft_rows) for s in g
             if br.is_cross_rank(s)]
    assert len(draft) == 1 + 2 * stages + case.k          # the Markov steps' picks stay in
    for name in ("verify", "verify_sf"):
        got = [s for _, g in plans[name].launches(case.verify.rows) for s in g
               if br.is_cross_rank(s)]
        assert len(got) == len(cross)


def _rank_site(log):
    barriers = []
    ctx = types.SimpleNamespace(rank=1, barrier=lambda: barriers.append(len(log.replays)))
    site = types.SimpleNamespace(stream=log.main, timer=fakes.Timer(), device=None)
    return ctx, site, types.SimpleNamespace(state=lambda: None), barriers


def test_step_cases_capture_the_branched_step_four_ways(tiny_rank, monkeypatch):
    """_step_cases on one rank: each case's four graphs go through Plan.record with the side
    stream (fork, side launches, join), with the PDL attribute as the flat lists had it
    (pdl / plain / none into / none out of the cross-rank launches); a barrier before each
    graph's timing; every graph closed."""
    cfg, _, context = tiny_rank
    log = fakes.CaptureLog().install(monkeypatch)
    monkeypatch.setattr(bs, "TIMING_ROUNDS", 1)
    made = []

    class Step(bs.DeviceStep):
        def __init__(self, site, cfg, bundle, modules, rank, collectives):
            self.cfg, self.stream, self.side = cfg, site.stream, log.side_stream()
            self.plan = wire(decode_plan(cfg), context(), modules)
            self.tensors = {"tokens": fakes.HostArray(np.arange(bs.MAX_ROWS) % 7)}
            self.pack_s, self.closed = 0.5, False
            made.append(self)

        def load(self, case, context):
            log.events.append(("load", case.rows, context))

        def distinct_experts(self, built, rows):
            return [3] * cfg.num_hidden_layers

        def nonfinite(self, rows):
            return 0

        def close(self):
            self.closed = True

    weights = bs.WeightBytes(10**6, 10**3, 64)
    monkeypatch.setattr(bs, "DeviceStep", Step)
    monkeypatch.setattr(bs, "step_weights", lambda cfg, dev, specs: weights)
    ctx, site, ar, barriers = _rank_site(log)
    case = bs.Case(6, 1, "verify")
    results = bt._step_cases(ctx, site, cfg, None, ar, [(case, (300, 40))])
    dev = made[0]
    assert dev.closed and len(log.graphs) == 4 and all(g.closed for g in log.graphs)
    names = list(bt.pdl_relaunches())
    assert names == ["pdl", "plain", "ar_plain", "after_ar_plain"]
    specs = [s for _, group in dev.plan.launches(case.rows) for s in group]
    cross = [br.is_cross_rank(s) for s in specs]
    want = {"pdl": [s.pdl for s in specs], "plain": [False] * len(specs),
            "ar_plain": [s.pdl and not c for s, c in zip(specs, cross)],
            "after_ar_plain": [s.pdl and not (i and cross[i - 1]) for i, s in enumerate(specs)]}
    for name, graph in zip(names, log.graphs):
        fakes.assert_branched(graph, dev.plan, case.rows)
        assert [e.pdl for e in graph.launches] == want[name], name
    assert all(s.pdl for s in specs) and any(cross)
    # per context: a barrier after the load, then one before each graph's replays
    # (TIMING_ROUNDS = 1 here: one round-robin round)
    assert log.replays == log.graphs * 2
    assert barriers == [0, 0, 1, 2, 3, 4, 4, 5, 6, 7]
    assert [r["context"] for r in results[:2]] == [300, 40] and "wall_s" in results[2]
    for r in results[:2]:
        assert list(r["us"]) == names and r["distinct"] == 3 and r["nonfinite"] == 0
        assert r["bytes"] == bs.step_bytes(cfg, weights, case, r["context"],
                                           [3] * cfg.num_hidden_layers)
        assert r["tokens"] == [i % 7 for i in range(case.rows)]


def test_round_cases_capture_every_plan_with_its_branches(tiny_rank, monkeypatch):
    """_round_cases on one rank: the five plans' graphs (verify, draft, step and the sync-free
    pair, cross-rank picks in) go through Plan.record with the side stream; every one closed."""
    cfg, case, context = tiny_rank
    log = fakes.CaptureLog().install(monkeypatch)
    made = []

    class Round(br.DeviceRound):
        def __init__(self, site, cfg, bundle, rounds, modules, rank, collectives):
            self.cfg, self.stream, self.side = cfg, site.stream, log.side_stream()
            self.plans = br.wire_round(cfg, context(), modules)
            self.tensors = {"accepted": fakes.HostArray(np.full(8, 5, np.int32)),
                            "tokens": fakes.HostArray(np.zeros(bs.MAX_ROWS, np.int64))}
            self.closed = False
            made.append(self)

        def load(self, case, context):
            pass

        def load_draft(self, case, context):
            pass

        def distinct_experts(self, built, rows):
            return [2]

        def close(self):
            self.closed = True

    def time_round(stream, graphs, reps, warmup):
        graphs["draft"].launch(stream)
        graphs["verify"].launch(stream)
        return {"draft": 1.0, "verify": 2.0, "round": 3.0}

    monkeypatch.setattr(br, "DeviceRound", Round)
    monkeypatch.setattr(br, "_time_round", time_round)
    ctx, site, ar, _ = _rank_site(log)
    results = bt._round_cases(ctx, site, cfg, None, ar, [(case, (300,))])
    dev, rows = made[0], br.plan_rows(case)
    assert dev.closed and len(log.graphs) == len(rows) == 5
    assert all(g.closed for g in log.graphs)
    for (name, count), graph in zip(rows.items(), log.graphs):
        fakes.assert_branched(graph, dev.plans[name], count)
    assert any(br.is_cross_rank(s) for _, g in dev.plans["draft"].launches(case.draft_rows)
               for s in g)
    assert len(results) == 1 and results[0]["b2b"]["round"] == 3.0
    assert results[0]["accepted"] == [5] * case.seqs


def _rank_value(scale: float, tokens=(5, 7)) -> dict:
    step = [{"rows": 1, "context": 4096, "us": {"pdl": 1000 * scale, "plain": 1200 * scale,
                                                           "ar_plain": 990 * scale,
                                                           "after_ar_plain": 995 * scale},
             "distinct": 6.0, "bytes": 4_000_000_000, "nonfinite": 0, "tokens": list(tokens)},
            {"wall_s": 10.0, "pack_s": 5.0}]
    rnd = [{"seqs": 1, "context": 4096, "us": {"round": 3000 * scale, "verify": 2500 * scale,
                                               "draft": 500 * scale},
            "b2b": {"round": 2900 * scale, "draft": 450, "verify": 2450}, "accepted": [0],
            "distinct": {"verify": 30.0, "draft": 5.0}, "tokens": list(tokens)}]
    return {"step": step, "round": rnd}


def test_aggregate_takes_the_slowest_rank_and_checks_the_tokens():
    values = [_rank_value(1.0), _rank_value(1.1), _rank_value(0.9), _rank_value(1.0)]
    steps = bt.aggregate(values, "step")
    assert len(steps) == 1 and steps[0]["us"]["pdl"] == pytest.approx(1100)
    assert steps[0]["ranks_agree"]
    rounds = bt.aggregate(values, "round")
    assert rounds[0]["b2b"]["round"] == pytest.approx(2900 * 1.1)
    values[3] = _rank_value(1.0, tokens=(5, 8))
    assert not bt.aggregate(values, "step")[0]["ranks_agree"]
    text = bt.step_table(bt.aggregate(values, "step"))
    assert "DIFFER" in text and "1100.0" in text
    text = bt.round_table(bt.aggregate(values, "round"))
    assert "c1" in text and "5340" in text                # the upstream PR's c1 4k ITL
    values[2]["step"] = values[2]["step"][1:]
    with pytest.raises(ValueError, match="different case counts"):
        bt.aggregate(values, "step")
