"""CPU tests of the shared per-CTA timeline toolkit (executor/timeline.py): rows decoded under each
family's layout (dense: pairs then %smid; attention / MoE: u32 %smid, padding, then pairs), the
missing-stamp and shape errors, the per-phase percentiles, the tick, the hand-off facts, the
table, and the device run loops' call order against a recording fake graph.

Rows are built word by word from random values with the layout written out by hand here (not
through Layout), so a decoding slip shows; every comparison is exact (integer words, percentiles
of integer cycles compared with NumPy's own).
"""
from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest

from executor import timeline as tl

RNG = np.random.default_rng()
POINTS = ("entry", "before_wait", "after_wait", "work", "exit")
P = len(POINTS)
LAYOUTS = {"dense": tl.Layout(smid_word=2 * P, pairs_word=0),
           "attn": tl.Layout(smid_word=0, pairs_word=2, smid_bits=32)}


def _row_block(kind: str, ctas: int, words: int = 32):
    """(raw u64 [ctas, words], smid, gt, clk) with the layout of `kind` written out explicitly;
    unused words random too (decoding must ignore them)."""
    smid = RNG.integers(0, 132, ctas)
    gt = np.sort(RNG.integers(1, 1 << 50, (ctas, P)), axis=1)
    clk = np.sort(RNG.integers(1, 1 << 50, (ctas, P)), axis=1)
    raw = RNG.integers(1, 1 << 62, (ctas, words)).astype(np.uint64)
    for c in range(ctas):
        for i in range(P):
            g, k = (2 * i, 2 * i + 1) if kind == "dense" else (2 + 2 * i, 3 + 2 * i)
            raw[c, g], raw[c, k] = gt[c, i], clk[c, i]
        if kind == "dense":
            raw[c, 2 * P] = smid[c]
        else:                                   # u32 %smid; the high half is the kernel's pad
            raw[c, 0] = np.uint64(smid[c]) | (np.uint64(RNG.integers(0, 1 << 31)) << np.uint64(32))
    return raw, smid, gt, clk


@pytest.mark.parametrize("kind", ["dense", "attn"])
def test_decode_reads_each_layout(kind):
    layout = LAYOUTS[kind]
    raw, smid, gt, clk = _row_block(kind, 9)
    got_smid, got_gt, got_clk = layout.decode(raw, POINTS, "k")
    for got in (got_smid, got_gt, got_clk):
        assert got.dtype == np.int64
    np.testing.assert_array_equal(got_smid, smid)
    np.testing.assert_array_equal(got_gt, gt)
    np.testing.assert_array_equal(got_clk, clk)
    assert layout.words(P) == (2 * P + 1 if kind == "dense" else 2 + 2 * P)
    rows = layout.rows(raw, P)
    assert rows == [[int(v) for v in r[:layout.words(P)]] for r in raw]
    assert all(type(v) is int for v in rows[0])
    s = tl.Stamps.decode(layout, raw, POINTS, "k")
    assert s.points == POINTS and s.col("work") == 3
    np.testing.assert_array_equal(s.gt[:, s.col("exit")], gt[:, -1])


@pytest.mark.parametrize("kind", ["dense", "attn"])
def test_decode_names_the_first_missing_stamp_or_a_short_row(kind):
    layout = LAYOUTS[kind]
    raw, *_ = _row_block(kind, 6)
    cta, point = int(RNG.integers(0, 5)), int(RNG.integers(0, P))
    raw[cta, layout.pairs_word + 2 * point + 1] = 0          # its clock64
    raw[5, layout.pairs_word] = 0               # a later CTA's entry too: the first one is named
    with pytest.raises(ValueError, match=f"k: CTA {cta} never stamped '{POINTS[point]}' "
                                         r"\(2 stamps missing\)"):
        layout.decode(raw, POINTS, "k")
    _smid, gt, clk = layout.decode(raw, POINTS, "k", complete=False)   # MoE: 0 = not reached
    assert clk[cta, point] == 0 and gt[5, 0] == 0
    need = layout.words(P)
    with pytest.raises(ValueError, match=rf"k: stamps must be u64 \[ctas, >= {need}\]"):
        layout.decode(raw[:, :need - 1], POINTS, "k")
    with pytest.raises(ValueError, match="stamps must be u64"):
        layout.decode(raw[0], POINTS, "k")


def test_reordered_and_out_of_order():
    raw, _, _gt, clk = _row_block("attn", 4)
    s = tl.Stamps.decode(LAYOUTS["attn"], raw, POINTS, "k")
    assert s.out_of_order() == []
    order = ("entry", "work", "before_wait", "after_wait", "exit")
    r = s.reordered(order)
    assert type(r) is type(s) and r.points == order
    for p in POINTS:
        np.testing.assert_array_equal(r.clk[:, r.col(p)], clk[:, POINTS.index(p)])
    bad = [b for b in r.out_of_order() if b.startswith("CTA 0: clock64")]
    assert bad == ["CTA 0: clock64 work > before_wait"]


def test_phase_stats_are_percentiles_of_the_cycle_deltas():
    ghz = float(RNG.uniform(1.4, 2.0))
    launches = [tl.Stamps.decode(LAYOUTS["dense"], _row_block("dense", 33)[0], POINTS, "k")
                for _ in range(3)]
    phases = (("wait", "before_wait", "after_wait"), ("total", "entry", "exit"))
    stats = tl.phase_stats(launches, phases, ghz)
    assert list(stats) == ["wait", "total"]
    for name, a, b in phases:
        cyc = np.concatenate([s.clk[:, POINTS.index(b)] - s.clk[:, POINTS.index(a)]
                              for s in launches])
        q = np.percentile(cyc, (10, 50, 90))
        for i, p in enumerate((10, 50, 90)):
            assert stats[name][f"p{p}_cyc"] == q[i]
            assert stats[name][f"p{p}_us"] == q[i] / ghz / 1e3


def test_timer_ticks_medians_and_hand_off():
    tick = int(RNG.choice([32, 1000]))
    ns = (RNG.integers(0, 10**6, (5, 7)) * tick + 10**12)
    ns[0, 0], ns[0, 1] = 10**12, 10**12 + tick          # one step of a single tick
    assert tl.timer_ticks(ns) == (tick, tick)
    assert tl.timer_ticks(np.full(4, 7)) is None and tl.timer_ticks(np.array([], np.int64)) is None
    assert tl.medians([{"a": 1.0, "b": 5.0}, {"a": 3.0, "b": 4.0}, {"a": 2.0, "b": 9.0}]) \
        == {"a": 2.0, "b": 5.0}
    got = tl.after_prev_exit(np.array([5000, 7000]), np.array([9000, 8000]),
                             np.array([20000, 15000]), 4000)
    assert got == {"first entry after prev exit": 1.0, "last entry after prev exit": 3.0,
                   "first wait return after prev exit": 4.0,
                   "last wait return after prev exit": 5.0, "exit pitch": 16.0}


def test_format_case_and_metrics():
    stats = {"wait": {"p10_us": 1.0, "p50_us": 2.5, "p90_us": 3.0, "p10_cyc": 1800.0,
                      "p50_cyc": 4500.0, "p90_cyc": 5400.0}}
    lines = tl.format_case("title", stats, {"exit pitch": 4.25}, key_width=34)
    assert lines == ["title",
                     "  phase          p10 us   p50 us   p90 us   p10 cyc   p50 cyc   p90 cyc",
                     "  wait            1.000    2.500    3.000      1800      4500      5400",
                     "  exit pitch" + " " * 24 + "    4.250 us (globaltimer)"]
    dense_width = tl.format_case("t", {}, {"x": 1.0})[-1]
    assert dense_width == "  x" + " " * 27 + "    1.000 us (globaltimer)"
    rows = []
    tl.case_metrics(SimpleNamespace(metric=lambda *a: rows.append(a)), "lab", "R1 iso", stats,
                    {"exit pitch": 4.25})
    assert rows == [("tl lab R1 iso wait: p10/p90 1.00/3.00 us, p50 4500 cyc", 2.5, "us"),
                    ("tl lab R1 iso exit pitch", 4.25, "us")]


def test_run_loops_keep_the_device_call_order(monkeypatch):
    """isolated_runs / chain_replays against a recording graph, stream and flusher: the order
    the runners issued before the loops moved here."""
    log = []

    class Graph:
        def launch(self, stream):
            log.append("graph.launch")

        def close(self):
            log.append("graph.close")

        @staticmethod
        @contextmanager
        def capture(stream):
            log.append("capture")
            yield Graph()
            log.append("captured")

    import executor.graphs
    monkeypatch.setattr(executor.graphs, "Graph", Graph)
    ctx = SimpleNamespace(stream="s", flusher=SimpleNamespace(flush=lambda s: log.append("flush")))
    n = iter(range(100))

    def launch(what):
        return SimpleNamespace(launch=lambda s: log.append(f"launch {what}"))

    def collect():
        i = next(n)
        log.append("collect")
        return [f"s{i}"], [f"r{i}"]

    runs, raws = tl.isolated_runs(ctx, 2, lambda: log.append("clear"), launch, collect)
    assert (runs, raws) == (["s0", "s1"], ["r0", "r1"])
    assert log == ["clear", "flush", "launch 0", "collect"] + ["clear", "flush", "launch 1",
                                                               "collect"]
    log.clear()
    runs, raws = tl.chain_replays(ctx, [launch("a"), launch("b")], 2,
                                  lambda: log.append("clear"), collect)
    assert (runs, raws) == ([["s2"], ["s3"]], [["r2"], ["r3"]])
    assert log == ["capture", "launch a", "launch b", "captured", "graph.launch",
                   "clear", "graph.launch", "collect", "clear", "graph.launch", "collect",
                   "graph.close"]
    log.clear()

    def broken():
        raise ValueError("CTA 3 never stamped 'exit'")

    with pytest.raises(ValueError, match="never stamped"):
        tl.chain_replays(ctx, [launch("a")], 2, lambda: None, broken)
    assert log[-1] == "graph.close"                 # the graph is closed on a failure too


def test_report_dir_falls_back_to_the_command_line(monkeypatch, tmp_path):
    monkeypatch.delenv(tl.REPORT_DIR_ENV, raising=False)
    monkeypatch.setattr("sys.argv", ["devicecheck", "--out", str(tmp_path / "a")])
    assert tl.report_dir(SimpleNamespace(out_dir=None)) == tmp_path / "a"
    monkeypatch.setattr("sys.argv", ["devicecheck", f"--out={tmp_path / 'b'}"])
    assert tl.report_dir() == tmp_path / "b"
    monkeypatch.setattr("sys.argv", ["devicecheck"])
    assert tl.report_dir() is None
