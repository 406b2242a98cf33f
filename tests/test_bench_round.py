"""The DSpark round benchmark's host path at tiny scale, without a GPU (executor/bench_round.py).

Case parsing; tokens per second; the packing with the DSpark stages' tiled FFNs (threaded equals
arena_contents, byte for byte); both round plans wired on the benchmark's modules with every
cross-rank call counted and the Markov picks left out; the bytes each plan must read, from the
slices its launches point into; and two emulated rounds on one rank with the local stand-ins,
which accept every draft (the module docstring's claim) and advance the rows k + 1 positions;
a case run on capture doubles (tests/bench_fakes.py): every plan's graph is captured through
Plan.record with its side branches, the draft's role graphs serial.
"""
from __future__ import annotations

import bench_fakes as fakes
import numpy as np
import pytest

from executor import bench_round as br
from executor import bench_step as bs
from executor import bench_step_pack as bp
from executor.emulate import bind_host, run_lockstep
from executor.emulate.ranks import caller_tensors, fill_caller_tensors
from executor.hostmem import AddressSpace, HostArena, ManifestBundle
from executor.plan import Plan
from executor.stages import ffn_tiled
from executor.wiring import StepContext, arena_contents, representatives
from kernels.kvrecord_ref import KV_RECORD_BYTES
from loader.config import ModelConfig
from loader.synth import synth_fetch

CONTEXT = 300                     # tiny: window 16, max_position_embeddings 1024


@pytest.fixture(scope="module")
def tiny():
    return ModelConfig.preset("tiny")


def test_selected_rounds_from_the_environment(monkeypatch):
    k = 5
    monkeypatch.delenv(br.CASES_ENV, raising=False)
    assert [(c.seqs, t) for c, t in br.selected_rounds(k)] == \
        [(s, bs.CONTEXTS) for s in br.ROUND_SEQS]
    monkeypatch.setenv(br.CASES_ENV, "c1x4k, 8x64k,c1x100,C1x4K")
    got = br.selected_rounds(k)
    assert [(c.seqs, c.k, t) for c, t in got] == [(1, 5, (4096, 100)), (8, 5, (65536,))]
    case = got[1][0]
    assert (case.verify.rows, case.verify.seqs, case.verify.kind, case.draft_rows) == \
        (48, 8, "verify", 40)
    for bad in ("c2x4k", "c1x65k", "c1x5", "c1", "x4k", "c1xk", "c8x-4k"):
        with pytest.raises(ValueError, match=br.CASES_ENV):
            br.selected_rounds(k, bad)


def test_tokens_per_second():
    assert br.tokens_per_s(2.82, 9000.0) == pytest.approx(2.82 / 9e-3)
    table = br.acceptance_table(5, 10_000.0)
    assert [a for a, _ in table] == list(range(6))
    assert [v for _, v in table] == pytest.approx([100 * (a + 1) for a in range(6)])


def test_tiled_dspark_stages_equal_packing_an_aliasing_fetch(tiny):
    """ffn_tiled(dspark_stages=True): each DSpark stage's expert e holds expert e % unique's
    packed bytes (its own count), the backbone's as without it."""
    fetch = synth_fetch(tiny, 3, bs.TP, bs.RANK)
    stage = next(s.index for s in tiny.layers if s.is_dspark)
    layers = [1, stage]
    plain = dict(ffn_tiled.weights(tiny, bs.TP, bs.RANK, fetch, layers, unique=4))
    both = dict(ffn_tiled.weights(tiny, bs.TP, bs.RANK, fetch, layers, unique=4,
                                  dspark_stages=True))
    assert not any(n.startswith("mtp.") for n in plain)
    assert {n: a.tobytes() for n, a in both.items() if n.startswith("layers.")} == \
        {n: a.tobytes() for n, a in plain.items()}
    prefix = f"mtp.{stage - tiny.num_hidden_layers}.ffn."

    def aliasing(name):             # expert e -> expert e % 4 (the experts' own names)
        parts = name.split(".")
        if name.startswith(prefix + "experts."):
            parts[4] = str(int(parts[4]) % 4)
        return fetch(".".join(parts))

    from executor.stages import ffn
    want = dict(ffn.weights(tiny, bs.TP, bs.RANK, aliasing, [stage]))
    got = {n: a for n, a in both.items() if n.startswith(prefix)}
    assert sorted(got) == sorted(want)
    for name, array in want.items():
        assert np.ascontiguousarray(got[name]).tobytes() == array.tobytes(), name
    assert got[prefix + "experts.codes13"].shape[0] == tiny.dspark_n_routed_experts // 4


def test_parallel_packing_of_the_round_modules_equals_arena_contents(tiny):
    """pack_parallel with the DSpark modules (dspark's globals packed whole, WHOLE_MODULES; the
    stages' FFNs per stage) gives arena_contents' requests and uploads, byte for byte."""
    layer_map = representatives(tiny)
    want_req, want_up = arena_contents(tiny, bs.TP, bs.RANK, synth_fetch(tiny, 5, bs.TP, 0),
                                       bs.MAX_ROWS, br.ROUND_MODULES, layer_map)
    got_req, got_up = bp.pack_parallel(tiny, bs.TP, bs.RANK, synth_fetch(tiny, 5, bs.TP, 0),
                                       bs.MAX_ROWS, br.ROUND_MODULES, layer_map, 3)
    assert got_req == want_req
    assert [n for n, _ in got_up] == [n for n, _ in want_up]
    for (name, got), (_, want) in zip(got_up, want_up):
        assert np.ascontiguousarray(got).tobytes() == want.tobytes(), name
    names = {n for n, _ in got_up}
    assert {"mtp.0.main_proj.weight", "mtp.2.markov_head.markov_w2.weight",
            "mtp.1.ffn.experts.codes2", "mtp.1.ffn.gate.weight"} <= names


class TinyRound:
    """Rank 0 of tiny on a HostArena with the round benchmark's modules and both plans."""

    def __init__(self, cfg, bundle_dir):
        self.cfg, self.space = cfg, AddressSpace()
        self.case = br.RoundCase(2, cfg.dspark_block_size)
        # room for a few rounds (tiny's indexer reaches max_position_embeddings = 1024 entries)
        self.geometry = bs.cache_geometry(cfg, [self.case.verify], (CONTEXT,), extra_tokens=64)
        fetch = synth_fetch(cfg, 0, bs.TP, bs.RANK)
        requests, uploads = arena_contents(cfg, bs.TP, bs.RANK, fetch, bs.MAX_ROWS,
                                           br.ROUND_MODULES, representatives(cfg))
        self.upload_bytes = {name: array.nbytes for name, array in uploads}
        self.arena = HostArena(self.space, requests)
        for name, array in uploads:
            self.arena.upload(name, array)
        self.tensors = {n: a for n, a in caller_tensors(cfg, bs.TP, self.geometry, bs.MAX_ROWS,
                                                        dspark=True).items()
                        if n in bs.bound_rules(cfg, self.geometry, dspark=True)}
        bound = bind_host(self.space, self.tensors)
        self.ctx = StepContext(cfg, bs.TP, bs.RANK, ManifestBundle(bundle_dir), self.arena,
                               bound, bs.MAX_ROWS, geometry=self.geometry)
        self.wired = br.wire_round(cfg, self.ctx)
        self.plans = {name: br.local_plan(plan) for name, plan in self.wired.items()}

    def load(self, context):
        rows, history = bs.row_batch(self.cfg, self.geometry, self.case.verify, context,
                                     np.random.default_rng(7))
        names = bs.metadata_names(self.cfg, self.geometry, dspark=True)
        assert "accepted" not in names and "bonus" not in names and "tokens" not in names
        fill_caller_tensors({n: self.tensors[n] for n in names}, rows, history=history)


@pytest.fixture(scope="module")
def tiny_round(tiny, tiny_bundle_dir):
    return TinyRound(tiny, tiny_bundle_dir)


def test_round_plans_count_their_cross_rank_calls(tiny_round):
    cfg, case = tiny_round.cfg, tiny_round.case
    layers, stages = cfg.num_hidden_layers, sum(s.is_dspark for s in cfg.layers)
    rows = {"verify": case.verify.rows, "draft": case.draft_rows, "step": case.verify.rows,
            "verify_sf": case.verify.rows, "draft_sf": case.draft_rows}
    calls = {n: br.count_collectives(tiny_round.wired[n], rows[n], tiny_round.cfg) for n in rows}
    assert calls["verify_sf"] == calls["verify"] and calls["draft_sf"] == calls["draft"]
    # all-gathers: each Engram layer's heads and (one row chunk at these rows) wkv output
    assert calls["verify"] == br.Collectives(1 + 2 * layers, 2 * len(cfg.engram_layer_ids), 1)
    assert calls["step"] == calls["verify"]
    assert calls["draft"] == br.Collectives(1 + 2 * stages, 0, case.k)
    for name, plan in tiny_round.plans.items():
        wired = [s for _, g in tiny_round.wired[name].launches(rows[name]) for s in g]
        local = [s for _, g in plan.launches(rows[name]) for s in g]
        assert not any(br.is_cross_rank(s) for s in local)
        assert len(wired) - len(local) == (case.k if name.startswith("draft") else 0)
    roles = [s.range_name for s in tiny_round.wired["draft"].stages]
    assert roles.count("draft.ffn.moe_routed") == stages
    # latency: all-reduces at the bucket's rows, picks at one row (docs/perf.md run 16 table)
    c = calls["draft"]
    assert c.latency_us(10) == pytest.approx(
        c.allreduces * bs.allreduce_us(10) + c.picks * bs.allreduce_us(1))


def test_plan_bytes_from_the_slices_the_launches_touch(tiny_round):
    cfg, case, arena = tiny_round.cfg, tiny_round.case, tiny_round.arena
    rows = {"verify": case.verify.rows, "draft": case.draft_rows}
    touched = {n: bs.touched_slices([s for _, g in tiny_round.plans[n].launches(rows[n])
                                     for s in g], arena) for n in rows}
    v, d = touched["verify"], touched["draft"]
    assert "mtp.0.main_proj.weight" in v - d and "mtp.0.attn.wq_a_wkv.weight" in v & d
    assert "mtp.2.markov_head.markov_w2.weight" in d - v and "head.weight" in v & d
    assert "mtp.1.ffn.experts.codes13" in d - v and "layers.3.ffn.experts.codes13" in v - d
    assert not any(n.startswith("layers.") for n in d)
    up = tiny_round.upload_bytes
    weights = {n: bs.plan_weights(cfg, up, touched[n]) for n in rows}
    assert weights["verify"].expert_slices == cfg.num_hidden_layers
    assert weights["draft"].expert_slices == 3
    mtp_experts = sum(b for n, b in up.items() if n.startswith("mtp.") and ".ffn.experts." in n)
    assert weights["draft"].per_expert * 3 * cfg.dspark_n_routed_experts == mtp_experts
    bb_experts = sum(b for n, b in up.items() if n.startswith("layers.") and ".experts." in n)
    assert weights["verify"].per_expert * cfg.num_hidden_layers * cfg.n_routed_experts == \
        bb_experts
    # dense: what each plan touches whole, not the row tables (embedding, Engram, RoPE, w1)
    want_d = sum(up[n] for n in d & set(up) if ".ffn.experts." not in n
                 and not any(key in n for key in bs.ROW_TABLES))
    assert weights["draft"].dense == want_d and up["head.weight"] < want_d
    distinct_v, distinct_d = [3] * cfg.num_hidden_layers, [2, 3, 4]
    got_v, got_d = br.round_bytes(cfg, weights["verify"], weights["draft"], case, CONTEXT,
                                  distinct_v, distinct_d)
    engram_row = cfg.engram_head_dim + cfg.engram_head_dim // 32
    assert got_v == bs.step_bytes(cfg, bs.WeightBytes(weights["verify"].dense,
                                                      weights["verify"].per_expert, engram_row),
                                  case.verify, CONTEXT, distinct_v)
    kv = case.seqs * 3 * (cfg.sliding_window + case.k) * KV_RECORD_BYTES
    assert br.draft_kv_bytes(cfg, case, CONTEXT) == kv
    assert got_d == (weights["draft"].dense + 9 * weights["draft"].per_expert
                     + case.draft_rows * cfg.hidden_size * 2
                     + case.k * case.seqs * cfg.dspark_markov_rank * 2 + kv)


def _view(tr, name, dtype, n):
    return tr.space.array(tr.ctx.ptr(name), dtype, (n,))


def test_two_local_rounds_accept_every_draft_and_advance(tiny_round):
    """verify, draft, verify on the emulator with the stand-ins: the second verify accepts all
    k drafts (0 = the unwritten `tokens`), the rows advance k + 1 positions a round, the draft's
    base logits are finite."""
    tr, k = tiny_round, tiny_round.case.k
    seqs, rows_v, rows_d = tr.case.seqs, tr.case.verify.rows, tr.case.draft_rows
    tr.load(CONTEXT)
    start = _view(tr, "positions", np.int64, rows_v).copy()
    base = tr.space.array(tr.ctx.ptr("dspark.base"), np.float32,
                          (rows_d, tr.cfg.vocab_size // bs.TP))
    base[...] = np.nan
    run_lockstep([tr.plans["verify_sf"]], rows_v, tr.space)
    first = _view(tr, "accepted", np.int32, seqs).copy()
    run_lockstep([tr.plans["draft_sf"]], rows_d, tr.space)
    assert np.isfinite(base).all()
    ids = _view(tr, "token_ids", np.int64, rows_v).reshape(seqs, k + 1)
    assert (ids[:, 1:] == 0).all()              # the Markov steps' prev: the unwritten zeros
    pos = _view(tr, "positions", np.int64, rows_v).reshape(seqs, k + 1)
    want = start.reshape(seqs, k + 1) + first[:, None].astype(np.int64) + 1
    assert np.array_equal(pos, want)
    run_lockstep([tr.plans["verify_sf"]], rows_v, tr.space)
    assert (_view(tr, "accepted", np.int32, seqs) == k).all()
    assert (_view(tr, "bonus", np.int64, seqs) == 0).all()


def test_local_plans_keep_stages_and_order(tiny_round):
    for name, plan in tiny_round.plans.items():
        assert isinstance(plan, Plan)
        assert [s.name for s in plan.stages] == [s.name for s in tiny_round.wired[name].stages]
    # the verify's baseline: the plain step, the verify's stages without the DSpark ones
    step = [s.name for s in tiny_round.plans["step"].stages]
    assert step == [s.name for s in tiny_round.plans["verify"].stages
                    if not s.range_name.startswith("dspark.")]


def test_report_metrics_and_tables(tiny_round, capsys):
    """One (case, context)'s metrics and table line from given times (the GPU path's tail)."""
    from executor.benchmarks import BenchContext

    cfg, case = tiny_round.cfg, tiny_round.case
    rows = {"verify": case.verify.rows, "draft": case.draft_rows, "step": case.verify.rows}
    halves = ("verify", "draft")
    specs = {n: [s for _, g in tiny_round.plans[n].launches(rows[n]) for s in g] for n in rows}
    known = br.PlanCase(rows, {n: len(specs[n]) for n in rows},
                        {n: br.count_collectives(tiny_round.wired[n], rows[n], tiny_round.cfg)
                         for n in halves},
                        {n: bs.plan_weights(cfg, tiny_round.upload_bytes,
                                            bs.touched_slices(specs[n], tiny_round.arena))
                         for n in halves})
    ctx = BenchContext(device=None, stream=None, bundles={})
    dev = type("Dev", (), {"nonfinite": lambda self, name, dtype, shape: 0})()
    times = {"draft": 500.0, "verify": 8400.0, "round": 8900.0, "step": 8250.0, "b2b": 7000.0}
    distinct = {"verify": [5] * cfg.num_hidden_layers, "draft": [3, 4, 5]}
    speeds = []
    line = br._report(ctx, dev, cfg, case, 4096, known, times, distinct, None, speeds)
    metrics = {r.metric: r.value for r in ctx.metric_rows}
    tag = f"round {case.label} ctx=4k"
    latency = sum(known.calls[n].latency_us(rows[n]) for n in halves)
    assert metrics[f"{tag}: round + AR"] == pytest.approx(8900.0 + latency)
    assert metrics[f"{tag}: verify - plain step (the DSpark stages)"] == pytest.approx(150.0)
    assert metrics[f"{tag}: draft picks"] == case.k
    v, d = br.round_bytes(cfg, known.weights["verify"], known.weights["draft"], case, 4096,
                          distinct["verify"], distinct["draft"])
    assert ctx.bandwidth_rows[0].bytes == v + d
    assert speeds == [(f"{case.label} 4k", pytest.approx(8900.0 + latency), None)]
    assert line.split()[:3] == [case.label, "4k", "8900.0"]
    br._print_tables(cfg, [line], speeds, "docs/perf.md run 16")
    out = capsys.readouterr().out
    assert line in out and f"{case.label} 4k" in out


def test_draft_roles_left_out_of_the_breakdown_are_the_row_writers(tiny_round):
    built = tiny_round.plans["draft_sf"].launches(tiny_round.case.draft_rows)
    roles = set(bs.role_groups(built))
    left_out = {r for r in roles if r.startswith(br.ROW_WRITERS)}
    assert left_out == {"dspark.history_verify", "dspark.advance_verify"}
    assert {"draft.ffn.moe_routed", "draft.lm_head_logits", "dspark.markov0"} <= roles - left_out


def test_halves_timed_alone_never_rewrite_their_rows(tiny_round):
    """"verify" and "draft" (no sync_free) have no stage that rewrites the bound rows, so each
    replays on the host's rows; the sync-free plans end with the row writers."""
    writers = (*br.ROW_WRITERS, "dspark.commit")
    for name in ("verify", "draft", "step"):
        assert not [s.name for s in tiny_round.plans[name].stages
                    if s.range_name.startswith(writers)]
    for name in ("verify_sf", "draft_sf"):
        assert tiny_round.plans[name].stages[-1].range_name.startswith("dspark.advance")


def test_draft_batch_rows(tiny):
    case = br.RoundCase(3, tiny.dspark_block_size)
    geometry = bs.cache_geometry(tiny, [case.verify], (CONTEXT,))
    rows, history, anchors = br.draft_batch(tiny, geometry, case, CONTEXT,
                                            np.random.default_rng(0))
    k = case.k
    assert rows.num_rows == case.draft_rows and rows.num_seqs == case.seqs
    ids = np.asarray(rows.token_ids).reshape(case.seqs, k)
    assert np.array_equal(ids[:, 0], anchors) and (ids[:, 1:] == tiny.dspark_noise_token_id).all()
    assert (anchors >= 0).all() and (anchors < tiny.vocab_size // bs.TP).all()
    pos = np.asarray(rows.positions).reshape(case.seqs, k)
    assert (pos == np.arange(CONTEXT - k, CONTEXT)).all()
    assert history.shape[0] == case.draft_rows


def test_bench_case_captures_every_plan_with_its_branches(tiny_round, monkeypatch, capsys):
    """_bench_case on capture doubles: the five plans' graphs (verify, draft, step, the
    sync-free pair) through Plan.record with the side stream, the draft's role graphs on the
    main stream alone, every graph closed; one table line per context."""
    from executor.benchmarks import BenchContext

    tr = tiny_round
    log = fakes.CaptureLog().install(monkeypatch)

    class Round(br.DeviceRound):
        def __init__(self):
            self.cfg, self.stream, self.side = tr.cfg, log.main, log.side_stream()
            self.plans, self.wired, self.arena = tr.plans, tr.wired, tr.arena
            self.upload_bytes = tr.upload_bytes

        def load(self, case, context):
            pass

        def load_draft(self, case, context):
            pass

        def distinct_experts(self, built, rows):
            return [2 for stage, _ in built if stage.range_name.endswith("ffn.router")]

        def nonfinite(self, name, dtype, shape):
            return 0

    def time_round(stream, graphs, reps, warmup):
        graphs["draft"].launch(stream)
        graphs["verify"].launch(stream)
        return {"draft": 1.0, "verify": 2.0, "round": 3.0}

    monkeypatch.setattr(br, "_time_round", time_round)
    ctx = BenchContext(device=None, stream=None, bundles={}, _timer=fakes.Timer())
    dev, case = Round(), tr.case
    lines = br._bench_case(ctx, dev, tr.cfg, case, (CONTEXT,), None, [])
    assert len(lines) == 1 and all(g.closed for g in log.graphs)
    rows = br.plan_rows(case)
    plans, roles = log.graphs[:len(rows)], log.graphs[len(rows):]
    for (name, count), graph in zip(rows.items(), plans):
        fakes.assert_branched(graph, dev.plans[name], count)
    assert roles and all(not g.on("side") and g.launches == g.events for g in roles)
    capsys.readouterr()
