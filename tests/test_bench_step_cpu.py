"""The step benchmark's host path at tiny scale, without a GPU (executor/bench_step.py).

Synthetic weights without a file equal a synthesized checkpoint's; representative layers packed
once give the same arena bytes as every layer packed; the tiled experts equal packing an aliasing
fetch; the local collectives wire and copy; every bucket's launch list builds against the tiny
manifest (LaunchSpec validates each launch against its kernel's ABI), and the one-rank step with
the stand-ins runs under the emulator with a finite result; a case run on capture doubles
(tests/bench_fakes.py) captures the step, its no-PDL twin and the variants through Plan.record
with the side stream (the "serial" variant without one), the role graphs and eager runs serial.
"""
from __future__ import annotations

import re
import types

import bench_fakes as fakes
import numpy as np
import pytest

from executor import bench_step as bs
from executor import bench_step_pack as bp
from executor.bind import binding_rules
from executor.emulate import bind_host, run_lockstep
from executor.emulate.ranks import caller_tensors, fill_caller_tensors
from executor.hostmem import AddressSpace, HostArena, ManifestBundle
from executor.plan import Plan, decode_plan
from executor.stages import ffn, ffn_tiled
from executor.wiring import StepContext, arena_contents, representatives, wire
from kernels.common_ref import BF16
from loader.checkpoint import Checkpoint
from loader.config import ModelConfig
from loader.sharding import shard
from loader.synth import slice_config, synth, synth_fetch

TINY_CONTEXTS = (40, 300)          # tiny: window 16, max_position_embeddings 1024
LAYER = re.compile(r"layers\.(\d+)\.(.*)")


@pytest.fixture(scope="module")
def tiny():
    return ModelConfig.preset("tiny")


def _aliasing(fetch, layer_map):
    """A fetch where every layer's tensors are its representative's (same role, same values)."""
    def aliased(name):
        m = LAYER.fullmatch(name)
        if m and int(m[1]) in layer_map:
            name = f"layers.{layer_map[int(m[1])]}.{m[2]}"
        return fetch(name)
    return aliased


def test_synth_fetch_equals_a_synthesized_checkpoint(tmp_path, tiny):
    synth(tiny, tmp_path, seed=7, layers=3, progress=False)
    cfg = slice_config(tiny, 3)
    with Checkpoint.open(tmp_path, progress=False) as ckpt:
        for rank in range(4):
            fetch = synth_fetch(cfg, 7, 4, rank)
            for name in ckpt.names:
                want = shard(ckpt, ckpt.spec(name), 4, rank)
                got = fetch(name)
                assert got.dtype == want.dtype and got.shape == want.shape, name
                assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (name, rank)
    with pytest.raises(KeyError, match="layers.9.attn.wq_b.weight"):
        synth_fetch(cfg, 7, 4, 0)("layers.9.attn.wq_b.weight")
    with pytest.raises(ValueError, match="rank 4"):
        synth_fetch(cfg, 7, 4, 4)


def test_representatives_group_layers_by_role(tiny):
    v41 = ModelConfig.preset("v41-flash")
    reps = representatives(v41)
    assert sorted(set(reps.values())) == [0, 1, 2, 3, 14, 20, 21, 24]
    assert reps[8] == 2 and reps[39] == 21 and reps[36] == 24 and reps[19] == 3
    for cfg in (tiny, v41):
        reps = representatives(cfg)
        assert sorted(reps) == [s.index for s in cfg.layers if not s.is_dspark]
        for layer, rep in reps.items():
            a, b = cfg.layer(layer), cfg.layer(rep)
            assert rep <= layer and reps[rep] == rep
            assert (a.ratio, a.mode, a.has_indexer, a.has_engram, a.owns_compressor,
                    a.uses_candidates) == (b.ratio, b.mode, b.has_indexer, b.has_engram,
                                           b.owns_compressor, b.uses_candidates)


def test_layer_map_arena_equals_every_layer_packed(tiny):
    layer_map = representatives(tiny)
    assert layer_map != {k: k for k in layer_map}         # tiny has shared roles (5->3, 9->7)
    fetch = synth_fetch(tiny, 11, 4, 2)
    full_req, full_up = arena_contents(tiny, 4, 2, _aliasing(fetch, layer_map), 16,
                                       bs.BENCH_MODULES)
    req, up = arena_contents(tiny, 4, 2, fetch, 16, bs.BENCH_MODULES, layer_map)
    assert sorted(r[:2] for r in req) == sorted(r[:2] for r in full_req)
    full = dict(full_up)
    assert sorted(full) == sorted(name for name, _ in up)
    for name, array in up:
        assert array.dtype == full[name].dtype and array.shape == full[name].shape, name
        assert np.array_equal(array.view(np.uint8), full[name].view(np.uint8)), name
    # the copies are the representative's array object, not new arrays
    ids = {name: id(a) for name, a in up}
    assert ids["layers.5.attn.wq_b.weight"] == ids["layers.3.attn.wq_b.weight"]
    assert ids["layers.9.ffn.experts.codes13"] == ids["layers.7.ffn.experts.codes13"]


def test_layer_map_refuses_bad_maps(tiny):
    fetch = synth_fetch(tiny, 0, 4, 0)
    good = representatives(tiny)
    bad_maps = {"covers": {k: v for k, v in good.items() if k != 4},
                "not a representative": {**good, 5: 2}}
    for match, layer_map in bad_maps.items():
        with pytest.raises(ValueError, match=match):
            arena_contents(tiny, 4, 0, fetch, 8, bs.BENCH_MODULES, layer_map)
    with pytest.raises(TypeError, match="stage_norm_probe.weights"):
        arena_contents(tiny, 4, 0, fetch, 8, ("stage_norm_probe",), good)


def test_tiled_experts_equal_packing_an_aliasing_fetch(tiny):
    fetch = synth_fetch(tiny, 3, 4, 1)
    expert = re.compile(r"(layers\.\d+\.ffn\.experts\.)(\d+)(\..*)")

    def aliased(name):
        m = expert.fullmatch(name)
        return fetch(f"{m[1]}{int(m[2]) % 8}{m[3]}" if m else name)

    want = dict(ffn.weights(tiny, 4, 1, aliased, layers=[2, 5]))
    got = dict(ffn_tiled.weights(tiny, 4, 1, fetch, layers=[2, 5], unique=8))
    assert sorted(got) == sorted(want)
    for name, array in want.items():
        tiled = got[name]
        if ".experts." in name:              # [E / 8, 8, ...] repeating 8 experts, no copy
            assert tiled.shape == (array.shape[0] // 8, 8, *array.shape[1:]), name
            assert bp.repeats(tiled) and not tiled.flags.writeable, name
            tiled = np.ascontiguousarray(tiled).reshape(array.shape)
        assert tiled.dtype == array.dtype and tiled.shape == array.shape, name
        assert np.array_equal(tiled.view(np.uint8), array.view(np.uint8)), name
    with pytest.raises(ValueError, match="whole number of repeats"):
        list(ffn_tiled.weights(tiny, 4, 1, fetch, unique=6))


def test_bench_config_cuts_only_the_engram_tables(tiny):
    v41 = ModelConfig.preset("v41-flash")
    cfg = bs.bench_config(v41)
    assert cfg.engram_vocab_size == bs.BENCH_ENGRAM_VOCAB
    assert all(16384 * 24 < rows < 17000 * 24 for rows in cfg.engram_num_embeddings)
    assert all(384e6 < rows for rows in v41.engram_num_embeddings)
    same = {k: v for k, v in cfg.to_dict().items()
            if not k.startswith(("engram_vocab_size", "engram_num_embeddings"))}
    assert same == {k: v for k, v in v41.to_dict().items() if k in same}
    assert bs.bench_config(tiny) is tiny              # tiny's tables are small already


class TinyRank:
    """Rank 0 of tiny on a HostArena with the benchmark's modules, weights and caches."""

    def __init__(self, cfg, bundle_dir):
        self.cfg, self.space = cfg, AddressSpace()
        self.geometry = bs.cache_geometry(cfg, contexts=TINY_CONTEXTS)
        fetch = synth_fetch(cfg, 0, bs.TP, bs.RANK)
        requests, self.uploads = arena_contents(cfg, bs.TP, bs.RANK, fetch, bs.MAX_ROWS,
                                                bs.BENCH_MODULES, representatives(cfg))
        self.arena = HostArena(self.space, requests)
        for name, array in self.uploads:
            self.arena.upload(name, array)
        self.tensors = {n: a for n, a in caller_tensors(cfg, bs.TP, self.geometry,
                                                        bs.MAX_ROWS).items()
                        if n in bs.bound_rules(cfg, self.geometry)}
        bound = bind_host(self.space, self.tensors)
        self.ctx = StepContext(cfg, bs.TP, bs.RANK, ManifestBundle(bundle_dir), self.arena,
                               bound, bs.MAX_ROWS, geometry=self.geometry)
        self.plan = wire(decode_plan(cfg), self.ctx, bs.BENCH_MODULES)

    def load(self, case, context):
        rows, history = bs.row_batch(self.cfg, self.geometry, case, context,
                                     np.random.default_rng(case.rows))
        fill_caller_tensors(self.tensors, rows, history=history)


@pytest.fixture(scope="module")
def tiny_rank(tiny, tiny_bundle_dir):
    return TinyRank(tiny, tiny_bundle_dir)


def test_every_bucket_builds_its_launches(tiny_rank):
    tiny_rank.plan.require_complete()
    names = set(binding_rules(tiny_rank.cfg, bs.TP, tiny_rank.geometry, bs.MAX_ROWS))
    assert set(bs.metadata_names(tiny_rank.cfg, tiny_rank.geometry)) < names
    counts = {}
    for case in bs.CASES:
        for context in TINY_CONTEXTS:
            tiny_rank.load(case, context)               # RowBatch validates the metadata
        built = tiny_rank.plan.launches(case.rows)
        specs = [s for _, group in built for s in group]
        plain = bs.without_pdl(specs)
        assert all(s.pdl for s in specs) and not any(s.pdl for s in plain)
        assert [(s.kernel.name, s.grid, s.args) for s in plain] == \
            [(s.kernel.name, s.grid, s.args) for s in specs]
        groups = bs.role_groups(built)
        assert sum(len(g) for g in groups.values()) == len(specs)
        assert groups["engram.heads_allgather"] == [] and groups["tail.argmax_pick"] == []
        assert groups["engram.kv_allgather"] == []
        counts[case.rows] = len(specs)
    assert min(counts.values()) > 10 * tiny_rank.cfg.num_hidden_layers
    lm_head = [s for s, _ in built if s.name == "tail.lm_head_argmax"]
    assert [len(g) for s, g in built if s in lm_head] == [1]   # argmax only: logits unbound


def test_local_allreduce_copies_the_partial(tiny_rank):
    rows, d = 6, tiny_rank.cfg.hidden_size
    partial = np.random.default_rng(1).standard_normal((rows, d)).astype(BF16)
    tiny_rank.space.array(tiny_rank.ctx.ptr("ffn.partial"), BF16, (rows, d))[...] = partial
    out = tiny_rank.space.array(tiny_rank.ctx.ptr("ffn.out"), BF16, (rows, d))
    out[...] = np.nan
    stage = tiny_rank.plan.stage("layer03.ffn.allreduce")
    run_lockstep([Plan([stage])], rows, tiny_rank.space)
    assert np.array_equal(out.view(np.uint16), partial.view(np.uint16))


def test_one_rank_step_with_the_stand_ins_runs_finite(tiny_rank):
    case = bs.CASES[2]                                   # one verify block of 6 rows
    tiny_rank.load(case, TINY_CONTEXTS[1])
    hidden = tiny_rank.space.array(tiny_rank.ctx.ptr("hidden"), BF16,
                                   (case.rows, tiny_rank.cfg.hidden_size))
    hidden[...] = np.nan
    run_lockstep([tiny_rank.plan], case.rows, tiny_rank.space)
    assert np.isfinite(hidden.astype(np.float32)).all()


def test_step_bytes(tiny_rank):
    cfg = tiny_rank.cfg
    weights = bs.weight_bytes(cfg, tiny_rank.uploads)
    experts = sum(a.nbytes for n, a in tiny_rank.uploads if ".ffn.experts." in n)
    assert weights.per_expert * cfg.num_hidden_layers * cfg.n_routed_experts == experts
    assert weights.dense > 0 and weights.engram_row == cfg.engram_head_dim * 33 // 32
    case = bs.CASES[0]
    # at a context inside the window: SWA only on the ratio-0 layers, plus compressed gathers
    # and index scans elsewhere; the bytes grow with the context and with the sequences
    small, large = (bs.kv_read_bytes(cfg, case, t) for t in TINY_CONTEXTS)
    assert 0 < small < large
    assert bs.kv_read_bytes(cfg, bs.CASES[3], 300) > bs.kv_read_bytes(cfg, bs.CASES[2], 300)
    # T = 1: one SWA record per layer; ratio-1 layers gather their one entry, indexers over a
    # ratio-1 source score one key; ratio-2 layers have no entry yet
    backbone = [s for s in cfg.layers if not s.is_dspark]
    want = 584 * (len(backbone) + sum(s.ratio == 1 for s in backbone)) + 132 * sum(
        s.has_indexer and cfg.layer(s.kv_source).ratio == 1 for s in backbone)
    assert bs.kv_read_bytes(cfg, case, 1) == want
    total = bs.step_bytes(cfg, weights, case, 40, [3] * cfg.num_hidden_layers)
    assert total > weights.dense + 3 * cfg.num_hidden_layers * weights.per_expert
    assert bs.allreduce_us(1) == 3.0 and bs.allreduce_us(192) == 8.1
    assert 3.0 < bs.allreduce_us(6) < 3.5


def test_step_dense_bytes_are_the_slices_its_launches_read(tiny_rank):
    """The arena holds weights a plain step never reads (the DSpark stages'); the step's dense
    bytes count only the slices its launches point into."""
    cfg = tiny_rank.cfg
    dev = type("Dev", (), {"weights": bs.weight_bytes(cfg, tiny_rank.uploads),
                           "arena": tiny_rank.arena,
                           "upload_bytes": {n: a.nbytes for n, a in tiny_rank.uploads}})()
    specs = [s for _, g in tiny_rank.plan.launches(1) for s in g]
    touched = bs.touched_slices(specs, tiny_rank.arena)
    weights = bs.step_weights(cfg, dev, specs)
    unread = {n for n, _ in tiny_rank.uploads if n.startswith("mtp.")}
    assert unread and not unread & touched
    assert 0 < weights.dense < dev.weights.dense
    assert weights.dense == sum(a.nbytes for n, a in tiny_rank.uploads if n in touched
                                and ".ffn.experts." not in n
                                and not any(k in n for k in bs.ROW_TABLES))
    assert (weights.per_expert, weights.engram_row) == (dev.weights.per_expert,
                                                        dev.weights.engram_row)


def test_parallel_packing_equals_arena_contents(tiny):
    """pack_parallel: the requests (slice order = arena layout) and uploads of arena_contents,
    byte for byte, with the same sharing of one array by a role's layers; tiny has DSpark stages
    (packed as themselves), globals before (mhc) and after (attn_proj: RoPE) the layers. Its
    8 experts are 4 repeated twice (stage_ffn_few_experts: ffn_tiled with 4 unique experts)."""
    layer_map = representatives(tiny)
    modules = [m.replace("executor.stages.ffn_tiled", "stage_ffn_few_experts")
               for m in bs.BENCH_MODULES]
    want_req, want_up = arena_contents(tiny, bs.TP, bs.RANK, synth_fetch(tiny, 5, bs.TP, bs.RANK),
                                       bs.MAX_ROWS, modules, layer_map)
    got_req, got_up = bp.pack_parallel(tiny, bs.TP, bs.RANK, synth_fetch(tiny, 5, bs.TP, bs.RANK),
                                       bs.MAX_ROWS, modules, layer_map, 3)
    assert got_req == want_req
    assert [name for name, _ in got_up] == [name for name, _ in want_up]
    for (name, got), (_, want) in zip(got_up, want_up):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), name

    def sharing(uploads):
        first = {}
        return [first.setdefault(id(a), name) for name, a in uploads]
    assert sharing(got_up) == sharing(want_up)
    assert any(name.startswith("mtp.") for name, _ in got_up)
    assert any(bp.repeats(a) for _, a in got_up)          # the experts stay repeating views
    # upload_all (one repeat up, the rest copied on the "device") fills the arena as uploading
    # arena_contents' contiguous arrays one by one does
    arenas = [HostArena(AddressSpace(), want_req) for _ in range(2)]
    for arena in arenas:
        for name, _, _ in want_req:
            arena.view(name, np.uint8, (arena.nbytes(name),))[...] = 0xA5
    bs.upload_all(arenas[0], got_up)
    for name, array in want_up:
        arenas[1].upload(name, array)
    for name, _, _ in want_req:
        shape = (arenas[0].nbytes(name),)
        assert np.array_equal(arenas[0].view(name, np.uint8, shape),
                              arenas[1].view(name, np.uint8, shape)), name


def test_serial_order_refuses_a_module_that_does_not_split_by_layer():
    heads = [("embed", 0), ("rope", 1)]
    part = bp.LayerPart(("embed",), [("layers.3.w", 2)], "rope")
    mod = types.SimpleNamespace(__name__="fake_stage")
    assert bp._serial_order(mod, heads, [(3, part)]) == [("embed", 0), ("layers.3.w", 2),
                                                         ("rope", 1)]
    after = bp.LayerPart((), [("layers.4.w", 3)], "embed")             # every global after
    assert bp._serial_order(mod, heads, [(4, after)]) == [("layers.4.w", 3), *heads]
    for bad in ([(3, bp.LayerPart(("rope",), [("layers.3.w", 2)], None))],   # out of order
                [(3, bp.LayerPart(("embed",), [("layers.3.w", 2)], None))],  # rope unmade
                [(2, after), (3, part)]):                # layers split the globals differently
        with pytest.raises(RuntimeError, match=r"fake_stage.weights\(layers=\[3\]\)"):
            bp._serial_order(mod, heads, bad)


def test_shared_fetch_makes_each_name_once_for_many_threads(tiny):
    from concurrent.futures import ThreadPoolExecutor

    calls = []
    plain = synth_fetch(tiny, 2, bs.TP, bs.RANK)

    def counted(name):
        calls.append(name)
        return plain(name)

    shared = bp.SharedFetch(counted)
    names = ["embed.weight", "layers.2.attn.wq_b.weight", "layers.2.attn.wq_b.scale",
             "layers.3.attn.wo_b.weight", "layers.3.attn.wo_b.scale"] * 6
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(shared, names))
    assert sorted(calls) == sorted(set(names))
    for name, array in zip(names, got):
        want = synth_fetch(tiny, 2, bs.TP, bs.RANK)(name)        # a fresh source: no cache
        assert np.array_equal(array.view(np.uint8), want.view(np.uint8)), name
        assert not array.flags.writeable
    with pytest.raises(KeyError, match="layers.99.attn.wq_b.weight"):
        shared("layers.99.attn.wq_b.weight")
    with pytest.raises(KeyError, match="layers.99.attn.wq_b.weight"):   # the waiters' error too
        shared("layers.99.attn.wq_b.weight")


def test_selected_cases_from_the_environment(monkeypatch):
    monkeypatch.delenv(bs.CASES_ENV, raising=False)
    assert bs.selected_cases() == [(case, bs.CONTEXTS) for case in bs.CASES]
    assert bs.selected_cases(quick=True) == [(case, bs.CONTEXTS) for case in bs.CASES[:2]]
    monkeypatch.setenv(bs.CASES_ENV, " 6x64k, 1x4K,6x4k,6x65536 ")
    by_rows = {c.rows: c for c in bs.CASES}
    assert bs.selected_cases(quick=True) == [(by_rows[6], (65536, 4096)), (by_rows[1], (4096,))]
    assert bs.selected_cases("192x1000") == [(by_rows[192], (1000,))]
    for bad in ("2x4k", "1x128k", "48x4", "1", "x4k", "1x4m", "1x4k,"):
        with pytest.raises(ValueError, match=bs.CASES_ENV):
            bs.selected_cases(bad)


def test_role_breakdown_per_launch_and_against_the_graph(capsys):
    """Fake graphs that 'take' a known time: the metrics divide by the launches and compare the
    sum with the whole-step graph."""
    taken = []

    class Graph:
        def __init__(self, us):
            self.us = us

        def launch(self, stream):
            taken.append(self.us)

    class Timer:
        def median_us(self, fn, reps):
            fn()
            return taken[-1]

    metrics = {}
    ctx = types.SimpleNamespace(timer=Timer(), metric=lambda n, v, u: metrics.__setitem__(n, v))
    roles = {"attn.mhc_pre": Graph(650.0), "ffn.router": Graph(250.0)}
    bs._role_breakdown(ctx, types.SimpleNamespace(stream=None), roles,
                       {"attn.mhc_pre": 40, "ffn.router": 50}, "step R=1", 1000.0)
    tag = "step R=1: role"
    assert metrics[f"{tag} attn.mhc_pre (its launches alone, graph)"] == 650.0
    assert metrics[f"{tag} attn.mhc_pre: us per launch (40 launches per step)"] == 650.0 / 40
    assert metrics[f"{tag} ffn.router: us per launch (50 launches per step)"] == 5.0
    assert metrics["step R=1: sum of the role graphs (90 launches)"] == 900.0
    assert metrics["step R=1: graph minus the sum of the roles (boundaries, overlap)"] == 100.0
    table = capsys.readouterr().out
    assert "attn.mhc_pre" in table and "16.25" in table and "1000.0" in table


def test_bench_case_captures_the_step_with_its_branches(tiny_rank, monkeypatch, capsys):
    """_bench_case on capture doubles: "pdl" and "plain" (no PDL attribute anywhere) hold the
    step's launches with its side stages on the side stream between fork and join; the variant
    "serial" the same launches on the main stream alone, "mqa_round7" branched as the step; the
    role graphs and the eager runs launch nothing on the side stream; every graph closed, the
    constants restored."""
    from executor import plan as plan_mod
    from executor.benchmarks import BenchContext

    tr = tiny_rank
    log = fakes.CaptureLog().install(monkeypatch)

    class Step(bs.DeviceStep):
        def __init__(self):
            self.cfg, self.stream, self.side = tr.cfg, log.main, log.side_stream()
            self.plan, self.step, self.modules = tr.plan, tr.ctx, bs.BENCH_MODULES
            self.arena, self.weights = tr.arena, bs.weight_bytes(tr.cfg, tr.uploads)
            self.upload_bytes = {n: a.nbytes for n, a in tr.uploads}

        def load(self, case, context):
            pass

        def distinct_experts(self, built, rows):
            return [2] * tr.cfg.num_hidden_layers

        def nonfinite(self, rows):
            return 0

    monkeypatch.setenv(bs.VARIANTS_ENV, "serial,mqa_round7")
    ctx = BenchContext(device=None, stream=None, bundles={}, _timer=fakes.Timer())
    dev, case = Step(), bs.Case(6, 1, "verify")
    lines = bs._bench_case(ctx, dev, case, (300,), tr.cfg, None)
    assert len(lines) == 1 and all(g.closed for g in log.graphs)
    assert plan_mod.STEP_BRANCHES and dev.plan.has_branches
    pdl, plain, serial, mqa_round7, *roles = log.graphs
    for graph, flag in ((pdl, True), (plain, False)):
        fakes.assert_branched(graph, dev.plan, case.rows)
        assert all(e.pdl is flag for e in graph.launches)
    assert not serial.on("side") and serial.launches == serial.events
    assert [e.kernel for e in serial.launches] == [e.kernel for e in pdl.launches]
    assert len(mqa_round7.on("side")) == len(pdl.on("side"))      # a switch, still branched
    assert roles and all(not g.on("side") and g.launches == g.events for g in roles)
    side = [e for e in log.events if isinstance(e, fakes.Launch) and e.stream == "side"]
    assert len(side) == 3 * fakes.side_launches(dev.plan, case.rows)   # not eager, not serial
    metrics = {r.metric for r in ctx.metric_rows}
    assert "step R=6 ctx=300: graph replay" in metrics
    assert any(m.startswith("step R=6 ctx=300: graph of variant serial") for m in metrics)
    capsys.readouterr()
