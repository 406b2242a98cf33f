"""CPU tests of the attention timeline summariser (executor/attn_timeline.py) and the sparse MQA
timeline specs / launch (kernels/sparse_mqa_ref.timeline_specs, executor/launches/sparse_mqa.py).

Synthetic stamps with known phase lengths, SM clock and launch offsets go in; the summariser must
give them back exactly (the arithmetic is integer ns and cycles, so the tolerance is float64
rounding, 1e-9 relative). Fresh random phase lengths per run.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from executor import attn_timeline as tl
from executor.launches.sparse_mqa import sparse_mqa_launch, spec_of
from kernels import sparse_mqa_ref as ref
from loader.config import ModelConfig

RNG = np.random.default_rng()
POINTS = ref.TIMELINE_POINTS


def _raw(start_ns: np.ndarray, phase_ns: np.ndarray, ghz: float, smid: np.ndarray) -> np.ndarray:
    """u64 [ctas, TIMELINE_WORDS]: CTA c enters at start_ns[c], point i at start + cumsum."""
    ctas = start_ns.size
    raw = np.zeros((ctas, ref.TIMELINE_WORDS), np.uint64)
    at = start_ns[:, None] + np.concatenate([np.zeros((ctas, 1), np.int64),
                                             np.cumsum(phase_ns, axis=1)], axis=1)
    clk0 = RNG.integers(1 << 20, 1 << 40, ctas)[:, None]           # per-SM counters differ
    raw[:, 0] = smid
    raw[:, 2:2 + 2 * len(POINTS):2] = at
    raw[:, 3:3 + 2 * len(POINTS):2] = clk0 + np.round((at - start_ns[:, None]) * ghz)
    return raw


def _launch(ctas: int, start: int, ghz: float, phase_ns: np.ndarray | None = None):
    if phase_ns is None:
        phase_ns = RNG.integers(50, 3000, (ctas, len(POINTS) - 1)) * 32
    start_ns = start + RNG.integers(0, 20, ctas) * 32
    raw = _raw(start_ns, phase_ns, ghz, RNG.integers(0, 132, ctas))
    return tl.Stamps.parse(raw, POINTS, "synthetic"), phase_ns, start_ns


def test_phases_cover_every_consecutive_pair():
    got = tl.phases(POINTS)
    assert [p[0] for p in got[:-1]] == list(POINTS[1:])
    assert all(a == POINTS[i] and b == POINTS[i + 1] for i, (_, a, b) in enumerate(got[:-1]))
    assert got[-1] == ("total", POINTS[0], POINTS[-1])


def test_phase_stats_and_clock_give_back_the_synthetic_phases():
    ghz = float(RNG.uniform(1.5, 2.0))
    launches, phase_ns = [], []
    for i in range(3):
        s, p, _ = _launch(16, 10_000_000 * (i + 1), ghz)
        launches.append(s)
        phase_ns.append(p)
    fitted = tl.clock_ghz(launches)
    assert abs(fitted - ghz) < 1e-3 * ghz          # cycles rounded to integers per point
    stats = tl.phase_stats(launches, fitted)
    pooled = np.concatenate(phase_ns)
    for i, point in enumerate(POINTS[1:]):
        want = np.percentile(pooled[:, i], (10, 50, 90))
        got = [stats[point][f"p{p}_us"] for p in (10, 50, 90)]
        np.testing.assert_allclose(got, want / 1e3, rtol=2e-3, atol=2e-6)
    total = np.percentile(pooled.sum(axis=1), 50) / 1e3
    assert stats["total"]["p50_us"] == pytest.approx(total, rel=2e-3)


def test_grid_times_of_a_chain_pair():
    ghz = 1.8
    prev, _, _ = _launch(8, 1_000_000, ghz)
    prev_exit = int(prev.gt[:, -1].max())
    cur, phase_ns, start = _launch(8, prev_exit - 4_000, ghz)
    g = tl.grid_times(cur, prev)
    wait = start + phase_ns[:, :POINTS.index("after_wait")].sum(axis=1)
    exit_ = start + phase_ns.sum(axis=1)
    assert g["first entry after prev exit"] == pytest.approx((start.min() - prev_exit) / 1e3)
    assert g["last entry after prev exit"] == pytest.approx((start.max() - prev_exit) / 1e3)
    assert g["first wait return after prev exit"] == pytest.approx((wait.min() - prev_exit) / 1e3)
    assert g["last wait return after prev exit"] == pytest.approx((wait.max() - prev_exit) / 1e3)
    assert g["exit pitch"] == pytest.approx((exit_.max() - prev_exit) / 1e3)
    assert g["entry spread"] == pytest.approx((start.max() - start.min()) / 1e3)
    assert g["wait return spread"] == pytest.approx((wait.max() - wait.min()) / 1e3)
    assert g["last exit after first entry"] == pytest.approx((exit_.max() - start.min()) / 1e3)
    assert "exit pitch" not in tl.grid_times(cur, None)


def test_parse_names_a_missing_stamp_and_order_check_names_a_reversal():
    s, phase_ns, start = _launch(4, 5_000_000, 1.8)
    raw = _raw(start, phase_ns, 1.8, s.smid.astype(np.uint64))
    cta, point = int(RNG.integers(0, 4)), int(RNG.integers(0, len(POINTS)))
    raw[cta, 2 + 2 * point] = 0
    with pytest.raises(ValueError, match=f"CTA {cta} never stamped '{POINTS[point]}'"):
        tl.Stamps.parse(raw, POINTS, "x")
    with pytest.raises(ValueError, match="stamps must be"):
        tl.Stamps.parse(np.zeros((4, 5), np.uint64), POINTS, "x")
    assert s.out_of_order() == []
    raw = _raw(start, phase_ns, 1.8, s.smid.astype(np.uint64))
    raw[1, 3 + 2 * 5] = raw[1, 3 + 2 * 4] - np.uint64(1)       # clock64 of 'landed' < 'issued'
    bad = tl.Stamps.parse(raw, POINTS, "x").out_of_order()
    assert any(b.startswith("CTA 1: clock64") for b in bad)


@pytest.mark.parametrize("preset", ["tiny", "v41-flash"])
def test_timeline_specs_twin_the_step_kernels(preset):
    cfg = ModelConfig.preset(preset)
    step, twins = ref.sparse_mqa_specs(cfg, 4), ref.timeline_specs(cfg, 4)
    cands = ref.candidate_specs(cfg, 4)
    extra = [cands[k] for k in ref.TIMELINE_CANDIDATES if cands[k].name != step[1].name]
    assert len(twins) == len(step) + len(extra)
    for prod, twin in zip(step + extra, twins, strict=True):
        assert twin.name == prod.name + "_timeline" and twin.timeline and not prod.timeline
        assert twin.params == ref.TIMELINE_PARAMS and prod.params == ref.PARAMS
        names = [n for n, _ in twin.params]
        assert names[names.index("stamps") + 1] == "rows"
        assert [p for p in twin.params if p[0] != "stamps"] == list(prod.params)
        assert (twin.smem_bytes, twin.entries_per_cta, twin.cluster) == (
            prod.smem_bytes, prod.entries_per_cta, prod.cluster)
        back = spec_of(twin.to_dict())
        assert back == twin and spec_of(prod.to_dict()) == prod
        assert "timeline" not in prod.to_dict()            # production manifests unchanged
    assert tl.HEAD + 2 * len(POINTS) <= ref.TIMELINE_WORDS and tl.HEAD % 2 == 0
    with pytest.raises(ValueError, match="timeline build of an ablation"):
        ref.make_spec(16, 128, 5, 512, 256, split="fixed", exchange="push", skip=("qk",),
                      timeline=True)


class _Bundle:
    """Kernel records as a manifest gives them: name, ABI (the launch packs args against it)."""

    def __init__(self, *specs):
        self.specs = {s.name: s for s in specs}

    def kernel(self, name):
        s = self.specs[name]
        return SimpleNamespace(name=name, params=s.params, smem_bytes=s.smem_bytes, block=s.block)


def test_launch_takes_stamps_only_for_timeline_builds():
    cfg = ModelConfig.preset("tiny")
    prod, twin = ref.sparse_mqa_specs(cfg, 4)[1], ref.timeline_specs(cfg, 4)[1]
    ptrs = {n: 4096 * (i + 1) for i, n in enumerate(
        ("q", "out", "swa", "compressed", "topk", "block_tables", "row_info", "state_lines",
         "sink", "rope_table"))}
    bundle = _Bundle(prod, twin)
    sizes = {"pages_per_seq": 3, "page_size": 64, "num_positions": 100}
    plain = sparse_mqa_launch(bundle, prod, ptrs, 2, **sizes)
    stamped = sparse_mqa_launch(bundle, twin, ptrs, 2, stamps=77, **sizes)
    assert stamped.args == plain.args[:10] + (77,) + plain.args[10:]
    assert len(stamped.args) == len(twin.params)
    with pytest.raises(ValueError, match="stamps required"):
        sparse_mqa_launch(bundle, twin, ptrs, 2, **sizes)
    with pytest.raises(ValueError, match="stamps given"):
        sparse_mqa_launch(bundle, prod, ptrs, 2, stamps=77, **sizes)


def test_indexer_timeline_twins_insert_stamps_before_the_first_scalar():
    from kernels import indexer_kernel_ref as ik
    specs = [ik.make_prep_spec(32, "dense", 2, 64), ik.make_scores_spec(32, "candidates", 1, 64),
             ik.make_topk_spec("entries", 512, 2), ik.make_topk_cluster_spec("candidates", 512, 1)]
    for prod in specs:
        twin = ik.timeline_twin(prod)
        assert twin.name == prod.name + "_timeline" and twin.timeline
        names = [n for n, _ in twin.params]
        at = names.index("stamps")
        assert all(k == "u64" for _, k in twin.params[:at + 1])
        assert twin.params[at + 1][1] != "u64"
        assert ik.production_of(twin) == prod
        assert twin.grid(5) == prod.grid(5) and twin.stamp_rows(5) == int(np.prod(prod.grid(5)))
        assert "timeline" not in prod.to_dict() and twin.to_dict()["timeline"] is True
        assert tl.indexer_kind(twin.name) == prod.kind
        assert ik.TIMELINE_POINTS[prod.kind][0] == "entry"
        assert ik.TIMELINE_POINTS[prod.kind][-1] == "exit"
        assert "after_wait" in ik.TIMELINE_POINTS[prod.kind]
        assert tl.HEAD + 2 * len(ik.TIMELINE_POINTS[prod.kind]) <= ik.TIMELINE_WORDS
        with pytest.raises(ValueError, match="already a timeline build"):
            ik.timeline_twin(twin)
    with pytest.raises(ValueError, match="not an indexer"):
        tl.indexer_kind("sparse_mqa_swa_h16_w128_c4")


def test_stamped_launch_keeps_grid_cluster_and_args():
    from kernels import indexer_kernel_ref as ik
    prod = ik.make_topk_cluster_spec("candidates", 512, 1)
    twin = ik.timeline_twin(prod)
    bundle = _Bundle(prod, twin)
    from executor.launch import LaunchSpec
    args = (16, 32, 48, 64, 80, 3, 4096, 2048)
    plain = LaunchSpec(bundle.kernel(prod.name), prod.grid(3), args, cluster=prod.cluster)
    stamped = tl.stamped_launch(bundle, plain, 999)
    assert stamped.kernel.name == twin.name
    assert (stamped.grid, stamped.cluster) == (plain.grid, plain.cluster)
    assert stamped.args == args[:5] + (999,) + args[5:]


def test_early_build_reaches_its_points_in_another_order():
    cfg = ModelConfig.preset("v41-flash")
    early = ref.candidate_specs(cfg, 4)["fixed_push_runs_early"]
    order = ref.timeline_points(early)
    assert sorted(order) == sorted(POINTS) and order != POINTS
    assert order.index("issued") < order.index("before_wait") < order.index("landed")
    assert ref.timeline_points(ref.candidate_specs(cfg, 4)["fixed_push_runs"]) == POINTS
    s, _, _ = _launch(4, 1_000_000, 1.8)                   # word order -> reached order
    r = s.reordered(order)
    for p in POINTS:
        assert np.array_equal(r.gt[:, r.col(p)], s.gt[:, s.col(p)])
        assert np.array_equal(r.clk[:, r.col(p)], s.clk[:, s.col(p)])


class _FakeMqaRunner:
    """Stands in for MqaTimelineRunner: synthetic stamps, no device."""

    def __init__(self, ctx, bundle, spec, production, context, rows, rng):
        self.spec, self.rows = spec, rows

    def matches_production(self):
        return True

    def _launches(self, n, start):
        ctas = self.spec.stamp_rows(self.rows)
        order = ref.timeline_points(self.spec)
        return [_launch(ctas, start + 5_000 * i, 1.8)[0].reordered(order) for i in range(n)]

    def isolated(self):
        return self._launches(tl.ISO_REPS, 1_000_000), [[]] * tl.ISO_REPS

    def chain(self):
        return [self._launches(tl.CHAIN, 9_000_000) for _ in range(tl.CHAIN_REPLAYS)], []

    def close(self):
        pass


class _FakeIndexerRunner:
    def __init__(self, ctx, bundle, label, context, rows, rng):
        from kernels import indexer_kernel_ref as ik
        self.kinds = ["prep", "scores", "topkc" if "reindex" in label else "topk"]
        self.ik = ik

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def matches_production(self):
        return True

    def names(self):
        return [f"indexer_{k}_x" for k in self.kinds]

    def run_chain(self, flush):
        out = []
        for i in range(tl.LAYERS * len(self.kinds)):
            points = self.ik.TIMELINE_POINTS[self.kinds[i % len(self.kinds)]]
            phase_ns = RNG.integers(50, 3000, (8, len(points) - 1)) * 32
            raw = np.zeros((8, ref.TIMELINE_WORDS), np.uint64)
            start = np.full(8, 1_000_000 + 10_000 * i)
            at = start[:, None] + np.concatenate([np.zeros((8, 1), np.int64),
                                                  np.cumsum(phase_ns, axis=1)], axis=1)
            raw[:, 2:2 + 2 * len(points):2] = at
            raw[:, 3:3 + 2 * len(points):2] = np.round(at * 1.8)
            out.append(tl.Stamps.parse(raw, points, "fake"))
        return out, []


def test_family_runs_end_to_end_on_fake_runners(monkeypatch):
    """The devicecheck family's glue: every kernel and case reported, metrics for the chain
    cases, nothing failed (the device parts are the fakes)."""
    cfg = ModelConfig.preset("v41-flash")
    specs = ref.sparse_mqa_specs(cfg, 4) + ref.variant_specs(cfg, 4) + ref.timeline_specs(cfg, 4)
    from kernels import indexer_kernel_ref as ik
    names = [s.name for s in specs] + [
        ik.timeline_twin(ik.make_scores_spec(32, "dense", 2, 64)).name]
    records = {s.name: SimpleNamespace(spec=s.to_dict()) for s in specs}
    bundle = SimpleNamespace(names=lambda: names, manifest=SimpleNamespace(kernels=records))
    metrics = []
    ctx = SimpleNamespace(bundle_with=lambda prefix: bundle, out_dir=None,
                          metric=lambda *a, **k: metrics.append(a))
    monkeypatch.setattr(tl, "MqaTimelineRunner", _FakeMqaRunner)
    monkeypatch.setattr(tl, "IndexerTimelineRunner", _FakeIndexerRunner)
    monkeypatch.delenv("HOPDEC_REPORT_DIR", raising=False)
    monkeypatch.setattr("sys.argv", ["x"])
    tl.bench_attn_timeline(ctx)
    text = [m[0] for m in metrics]
    assert not [t for t in text if "failed" in t], [t for t in text if "failed" in t]
    for label in ("mqa_topk", "mqa_swa", "mqa_topk_early", "idx_dense_r2 topk",
                  "idx_reindex topkc", "idx_reindex scores", "idx_dense_r2 prep"):
        assert any(t.startswith(f"tl {label} T4k R1 chain") for t in text), label
    assert any(t.startswith("tl mqa_topk T64k R6 chain #4 exit pitch") for t in text)
    assert not any(" iso " in t for t in text)
