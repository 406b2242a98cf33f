"""CPU tests of the dense timeline summariser (executor/dense_timeline.py) on synthetic stamps.

The stamps are built from known per-CTA phase lengths (random cycles), a known SM clock, per-SM
clock64 offsets (clock64 counts per SM) and a globaltimer that ticks at a known resolution, laid
out as kernels/dense_stream.py writes them; the summariser must give back exactly those numbers:
percentiles of the cycle deltas (integers, exact), the clock within the tick's quantisation, the
tick itself, and the entry / exit offsets between consecutive launches.
"""
from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from executor import dense_timeline as tl
from kernels import dense_ref as dr

P = len(dr.TIMELINE_POINTS)


def _launch(rng, start_ns: float, ctas: int, ghz: float, tick: int, sm_offset: np.ndarray):
    """(raw u64 [ctas, TIMELINE_WORDS], cycles per phase [ctas, P - 1], exact entry ns)."""
    phases = rng.integers(50, 4000, size=(ctas, P - 1))
    entry = start_ns + rng.uniform(0, 900, size=ctas)
    ns = entry[:, None] + np.concatenate([np.zeros((ctas, 1)), np.cumsum(phases, 1) / ghz], 1)
    smid = rng.permutation(132)[:ctas]
    raw = np.zeros((ctas, dr.TIMELINE_WORDS), np.uint64)
    raw[:, 0:2 * P:2] = (np.floor(ns / tick) * tick).astype(np.uint64)
    clk = np.round(ns * ghz).astype(np.int64)
    raw[:, 1:2 * P:2] = (clk + sm_offset[smid][:, None]).astype(np.uint64)
    raw[:, 2 * P] = smid
    return raw, phases, ns


def _chain(seed: int, tick: int, ghz: float = 1.755, launches: int = 6, ctas: int = 120):
    rng = np.random.default_rng(seed)
    sm_offset = rng.integers(10**9, 10**12, size=132)
    out, start = [], 5e9 + rng.uniform(0, 1e6)
    for _ in range(launches):
        raw, phases, ns = _launch(rng, start, ctas, ghz, tick, sm_offset)
        out.append((tl.Stamps.parse(raw, "synthetic"), phases, ns, raw))
        start = ns[:, -1].max() + rng.uniform(100, 3000)
    return out


@pytest.mark.parametrize("tick", [32, 1000])
def test_phases_clock_and_resolution_come_back(tick):
    seed = int(np.random.default_rng().integers(1 << 30))
    chain = _chain(seed, tick)
    stamps = [s for s, *_ in chain]
    gcd, step = tl.timer_resolution_ns(stamps)
    assert gcd == tick and step % tick == 0, f"seed {seed}"
    # clock: per SM and group, cycles over the span of its stamps (3 launches, >= 20 us
    # mostly; the median over SMs is what is checked); each end is
    # floored to the tick, so the rate is off by at most 2 ticks / span (the median of the SMs'
    # rates is inside their range)
    ghz = tl.clock_ghz([stamps[:3], stamps[3:]])
    assert abs(ghz - 1.755) <= 1.755 * 2 * tick / 20_000, f"seed {seed}: {ghz}"
    stats = tl.phase_stats(stamps, ghz)
    cycles = np.concatenate([p for _, p, *_ in chain])
    for i, (phase, _, _) in enumerate(tl.PHASES[:-1]):
        want = np.percentile(cycles[:, i], (10, 50, 90))
        got = [stats[phase][f"{q}_cyc"] for q in ("p10", "p50", "p90")]
        assert np.allclose(got, want, rtol=0, atol=1.0), f"seed {seed} {phase}: {got} vs {want}"
        assert stats[phase]["p50_us"] == pytest.approx(want[1] / ghz / 1e3)
    total = np.percentile(cycles.sum(1), 50)
    assert stats["total"]["p50_cyc"] == pytest.approx(total, abs=1.0)


def test_grid_times_are_relative_to_the_previous_launch():
    seed = int(np.random.default_rng().integers(1 << 30))
    chain = _chain(seed, tick=32)
    (prev, _, prev_ns, _), (cur, _, cur_ns, _) = chain[2], chain[3]
    got = tl.grid_times(cur, prev)
    prev_exit = prev_ns[:, -1].max()
    wait = dr.TIMELINE_POINTS.index("after_wait")
    want = {"first entry after prev exit": cur_ns[:, 0].min() - prev_exit,
            "last entry after prev exit": cur_ns[:, 0].max() - prev_exit,
            "first wait return after prev exit": cur_ns[:, wait].min() - prev_exit,
            "last wait return after prev exit": cur_ns[:, wait].max() - prev_exit,
            "exit pitch": cur_ns[:, -1].max() - prev_exit,
            "last exit": cur_ns[:, -1].max() - cur_ns[:, 0].min(),
            "last landed": cur_ns[:, dr.TIMELINE_POINTS.index("last_landed")].max()
            - cur_ns[:, 0].min(),
            "entry spread": cur_ns[:, 0].max() - cur_ns[:, 0].min()}
    assert set(got) == set(want)
    for key, ns in want.items():           # each stamp floored to 32 ns: <= 32 ns off
        assert abs(got[key] - ns / 1e3) <= 0.032 + 1e-9, f"seed {seed} {key}"
    alone = tl.grid_times(cur, None)
    assert "first entry after prev exit" not in alone and set(alone) <= set(got)
    med = tl.median_grid_times([(c[0], p[0]) for p, c in pairwise(chain)])
    assert set(med) == set(got)
    text = "\n".join(tl.format_case("case", tl.phase_stats([cur], 1.755), got))
    assert "pdl wait" in text and "exit pitch" in text


def test_an_unstamped_point_or_a_wrong_shape_is_named():
    raw, _, _ = _launch(np.random.default_rng(), 1e9, 8, 1.8, 32, np.zeros(132, np.int64))
    raw[5, 2 * dr.TIMELINE_POINTS.index("after_wait")] = 0
    with pytest.raises(ValueError, match="CTA 5 never stamped 'after_wait'"):
        tl.Stamps.parse(raw, "k")
    with pytest.raises(ValueError, match="stamps must be u64"):
        tl.Stamps.parse(raw[:, :5], "k")
    with pytest.raises(ValueError, match="cannot fit the SM clock"):
        tl.clock_ghz([[tl.Stamps(np.zeros(2, np.int64), np.ones((2, P), np.int64),
                                 np.ones((2, P), np.int64))]])


def test_timeline_specs_are_the_step_kernels_with_stamps_and_never_picked():
    from loader.config import ModelConfig
    for preset in ("tiny", "v41-flash"):
        cfg = ModelConfig.preset(preset)
        specs = dr.dense_specs(cfg, 4)
        names = {s.name for s in specs}
        timeline = [s for s in specs if s.timeline]
        assert {s.name.split("_n")[0].removeprefix("dense_w8a16_") for s in timeline} \
            == set(dr.TIMELINE_LABELS)
        for s in timeline:
            twin = s.name.removesuffix("_timeline")      # the step's kernel or a candidate
            assert twin in names and s.name.endswith("_timeline") and "_r8_bf16" in s.name
            plain = next(x for x in specs if x.name == twin)
            assert (plain.variant, plain.unit_k) == (s.variant, s.unit_k)
            assert plain.workspace_bytes() == 0
            assert s.workspace_bytes() == s.ctas * dr.TIMELINE_WORDS * 8
            assert dr.DenseSpec.from_dict(s.to_dict()) == s
        assert all("timeline" not in s.to_dict() for s in specs if not s.timeline)
    with pytest.raises(ValueError, match="timeline stamps take the workspace"):
        dr.make_spec("wo_b", 256, 1024, variant="stream", timeline=True)


class _FakeRunner:
    """TimelineRunner's interface over synthetic stamps (no GPU): one chain of launches per
    isolated rep / replay, from the same generator as the tests above."""

    def __init__(self, ctx, bundle, spec):
        self.spec, self.seed = spec, ctx.seed

    def _launches(self, count: int):
        chain = _chain(self.seed, 32, launches=count, ctas=self.spec.ctas)
        self.seed += 1
        return [s for s, *_ in chain], [tl.raw_json(raw) for *_, raw in chain]

    def isolated(self, rows):
        runs = [self._launches(1) for _ in range(tl.ISO_REPS)]
        return [r[0][0] for r in runs], [r[1][0] for r in runs]

    def chain(self, rows, l2):
        runs = [self._launches(tl.CHAIN) for _ in range(tl.CHAIN_REPLAYS)]
        return [r[0] for r in runs], [r[1] for r in runs]

    def close(self):
        pass


class _FakeCtx:
    def __init__(self, specs):
        from types import SimpleNamespace
        self.seed = int(np.random.default_rng().integers(1 << 30))
        self.rows = []
        kernels = {s.name: SimpleNamespace(spec=s.to_dict()) for s in specs}
        self.bundle = SimpleNamespace(names=lambda: list(kernels),
                                      manifest=SimpleNamespace(kernels=kernels))

    def bundle_with(self, prefix):
        return self.bundle

    def metric(self, metric, value, unit, target="", ok=None):
        self.rows.append((metric, value, unit, ok))


def test_the_family_benchmark_reports_every_case_and_writes_the_stamps(tmp_path, monkeypatch):
    import json

    from loader.config import ModelConfig
    specs = dr.dense_specs(ModelConfig.preset("v41-flash"), 4)
    ctx = _FakeCtx([s for s in specs if s.timeline or s.name.endswith("_r8_bf16")])
    monkeypatch.setenv(tl.REPORT_DIR_ENV, str(tmp_path))
    tl.bench_dense_timeline(ctx, runner_class=_FakeRunner)
    names = [m for m, *_ in ctx.rows]
    assert not [r for r in ctx.rows if r[3] is False], ctx.rows
    for label in dr.TIMELINE_LABELS:
        for case in ("R1 iso", "R1 chain #4", "R1 chain-l2 #4", "R6 iso", "R6 chain #4"):
            for phase, _, _ in tl.PHASES:
                assert any(n.startswith(f"tl {label} {case} {phase}:") for n in names), \
                    (label, case, phase)
        assert f"tl {label} R1 chain #4 first entry after prev exit" in names
    ghz = next(v for m, v, *_ in ctx.rows if m.startswith("tl SM clock"))
    assert ghz == pytest.approx(1.755, rel=0.01)
    doc = json.loads((tmp_path / tl.JSON_NAME).read_text())
    timeline = [s for s in specs if s.timeline]
    assert doc["globaltimer_gcd_ns"] == 32 and len(doc["kernels"]) == len(timeline) >= 3
    assert all(f"tl {tl._label(s)} R6 chain #4 total" in " ".join(names) for s in timeline)
    assert len({tl._label(s) for s in timeline}) == len(timeline)       # one row set each
    kdoc = doc["kernels"][next(s.name for s in specs if s.timeline)]
    assert len(kdoc["R1 chain"]) == tl.CHAIN_REPLAYS and len(kdoc["R1 chain"][0]) == tl.CHAIN
    assert len(kdoc["R6 iso"]) == tl.ISO_REPS


def test_a_failing_kernel_is_reported_and_the_others_still_run(tmp_path, monkeypatch):
    from loader.config import ModelConfig
    specs = [s for s in dr.dense_specs(ModelConfig.preset("tiny"), 4) if s.timeline]
    ctx = _FakeCtx(specs)

    class Broken(_FakeRunner):
        def chain(self, rows, l2):
            if self.spec.name == specs[0].name:
                raise ValueError("CTA 3 never stamped 'exit'")
            return super().chain(rows, l2)

    monkeypatch.setenv(tl.REPORT_DIR_ENV, str(tmp_path))
    tl.bench_dense_timeline(ctx, runner_class=Broken)
    failed = [m for m, _, _, ok in ctx.rows if ok is False]
    assert len(failed) == 1 and specs[0].name in failed[0] and "never stamped" in failed[0]
    plain = next(s for s in specs[1:] if s.name.endswith(f"_r8_{s.epilogue}_timeline"))
    assert any(m.startswith(f"tl {plain.name.split('_n')[0].removeprefix('dense_w8a16_')} "
                            "R6 chain #4 total") for m, *_ in ctx.rows)


def test_report_dir_prefers_the_environment_then_the_context(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from executor import dense_timeline as dt

    monkeypatch.delenv(dt.REPORT_DIR_ENV, raising=False)
    assert dt.report_dir(SimpleNamespace(out_dir=tmp_path)) == tmp_path
    monkeypatch.setenv(dt.REPORT_DIR_ENV, str(tmp_path / "env"))
    assert dt.report_dir(SimpleNamespace(out_dir=tmp_path)) == tmp_path / "env"


def test_the_dense_benchmark_narrows_to_the_named_layers():
    """executor/bench_dense.narrow (HOPDEC_DENSE_LABELS): only the named layers' kernels, all of
    them when unset, a clear error when a name selects nothing."""
    from executor import bench_dense as bd
    from kernels import wo_a_ref as wr
    from loader.config import ModelConfig
    cfg = ModelConfig.preset("tiny")
    specs = dr.dense_specs(cfg, 4) + wr.wo_a_specs(cfg, 4)
    assert bd.narrow(specs, "") == specs
    picked = bd.narrow(specs, "wqa_wkv,wo_a")
    assert picked and {bd._label(s) for s in picked} == {"wqa_wkv", "wo_a"}
    assert len(picked) == sum(bd._label(s) in ("wqa_wkv", "wo_a") for s in specs)
    with pytest.raises(LookupError, match="HOPDEC_DENSE_LABELS"):
        bd.narrow(specs, "no_such_layer")
