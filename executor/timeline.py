"""Per-CTA timeline stamps: what the dense, attention and MoE timeline benchmarks share.

A timeline build has thread 0 of every CTA write one row of u64 words into a zeroed buffer: its
%smid, and per point (%globaltimer ns, %clock64 cycles) in two consecutive words. Where those
sit in the row differs by family (`Layout`: dense_ref puts %smid after the pairs, the attention
and MoE builds before them). Here: the rows decoded given a layout, per-phase p10 / p50 / p90
across pooled CTAs, the timer's tick, the PDL hand-off facts, the phase table and its metrics,
where the raw stamps go, and the isolated / PDL-chain run loops of the runners. The families keep
their phases, clock fits, grid facts and device runners (executor/{dense,attn,moe}_timeline.py).
NumPy only at import (tests/test_timeline.py).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

REPORT_DIR_ENV = "HOPDEC_REPORT_DIR"


@dataclass(frozen=True)
class Layout:
    """A row's words: %smid in word `smid_word` (its low `smid_bits` bits: the attention and MoE
    builds store a u32 beside a padding word), point i's globaltimer in word pairs_word + 2 i and
    its clock64 in the next."""

    smid_word: int
    pairs_word: int
    smid_bits: int = 64

    def words(self, points: int) -> int:
        """The words a row of `points` points uses (the rest of the row stays 0)."""
        return max(self.smid_word + 1, self.pairs_word + 2 * points)

    def decode(self, raw: np.ndarray, points: tuple[str, ...], name: str,
               complete: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(smid [C], globaltimer ns [C, P], clock64 [C, P]), int64, of u64 raw [C, >= words].
        complete: raise ValueError naming the first CTA and point never stamped (still 0)."""
        p, need = len(points), self.words(len(points))
        if raw.ndim != 2 or raw.shape[1] < need:
            raise ValueError(f"{name}: stamps must be u64 [ctas, >= {need}], got {raw.shape}")
        raw = raw.astype(np.int64)
        at = self.pairs_word
        gt, clk = raw[:, at:at + 2 * p:2], raw[:, at + 1:at + 1 + 2 * p:2]
        if complete:
            missing = np.argwhere((gt == 0) | (clk == 0))
            if missing.size:
                cta, point = missing[0]
                raise ValueError(f"{name}: CTA {cta} never stamped '{points[point]}' "
                                 f"({len(missing)} stamps missing)")
        smid = raw[:, self.smid_word]
        if self.smid_bits < 64:
            smid = smid & ((1 << self.smid_bits) - 1)
        return smid, gt, clk

    def rows(self, raw: np.ndarray, points: int) -> list[list[int]]:
        """Each row's used words as ints (the raw stamps a report keeps)."""
        return [[int(v) for v in row[:self.words(points)]] for row in raw]


@dataclass(frozen=True)
class Stamps:
    """One launch's stamps: smid [C], globaltimer ns [C, P], clock64 cycles [C, P] (int64) at
    `points`, every one stamped. The families subclass it for their `parse`."""

    smid: np.ndarray
    gt: np.ndarray
    clk: np.ndarray
    points: tuple[str, ...]

    @classmethod
    def decode(cls, layout: Layout, raw: np.ndarray, points: tuple[str, ...], name: str):
        """u64 [ctas, >= layout.words] as the kernel wrote them into a zeroed buffer. Raises
        ValueError naming the first CTA and point that was never stamped."""
        return cls(*layout.decode(raw, points, name), points=tuple(points))

    def col(self, point: str) -> int:
        return self.points.index(point)

    def reordered(self, points: tuple[str, ...]) -> Stamps:
        """The same stamps with the points in another order (the order a build reaches them in,
        where that differs from the order of its stamp words)."""
        cols = [self.col(p) for p in points]
        return replace(self, points=tuple(points), gt=self.gt[:, cols], clk=self.clk[:, cols])

    def out_of_order(self) -> list[str]:
        """'CTA c: a > b' for every CTA whose clock64 or globaltimer goes back between points."""
        bad = []
        for name, t in (("clock64", self.clk), ("globaltimer", self.gt)):
            for cta, point in np.argwhere(np.diff(t, axis=1) < 0):
                bad.append(f"CTA {cta}: {name} {self.points[point]} > {self.points[point + 1]}")
        return bad


def timer_ticks(ns: np.ndarray) -> tuple[int, int] | None:
    """The globaltimer's tick from stamps (ns, any shape): (gcd of every stamp's distance to the
    earliest, smallest step between distinct stamps); they agree for a timer that advances in
    whole ticks. None with fewer than 2 distinct stamps."""
    values = np.unique(ns.ravel())
    if values.size < 2:
        return None
    return int(np.gcd.reduce(values - values[0])), int(np.diff(values).min())


def phase_stats(launches: list[Stamps], phases, ghz: float) -> dict[str, dict[str, float]]:
    """Per phase (name, from point, to point): p10 / p50 / p90 of its clock64 cycles across the
    pooled CTAs, and in us at `ghz`."""
    out = {}
    for phase, a, b in phases:
        cyc = np.concatenate([s.clk[:, s.col(b)] - s.clk[:, s.col(a)] for s in launches])
        q = np.percentile(cyc, (10, 50, 90))
        out[phase] = {"p10_cyc": q[0], "p50_cyc": q[1], "p90_cyc": q[2],
                      "p10_us": q[0] / ghz / 1e3, "p50_us": q[1] / ghz / 1e3,
                      "p90_us": q[2] / ghz / 1e3}
    return out


def after_prev_exit(entry: np.ndarray, wait: np.ndarray, exit_: np.ndarray,
                    prev_exit: int) -> dict[str, float]:
    """A chained launch's PDL hand-off, us from the previous launch's last exit: its first / last
    CTA entry and griddepcontrol.wait return, and its last exit (the exit pitch); globaltimer
    ns per CTA in."""
    return {"first entry after prev exit": (entry.min() - prev_exit) / 1e3,
            "last entry after prev exit": (entry.max() - prev_exit) / 1e3,
            "first wait return after prev exit": (wait.min() - prev_exit) / 1e3,
            "last wait return after prev exit": (wait.max() - prev_exit) / 1e3,
            "exit pitch": (exit_.max() - prev_exit) / 1e3}


def medians(each: list[dict[str, float]]) -> dict[str, float]:
    """The median of every key over repetitions (dicts with the first one's keys)."""
    return {key: float(np.median([d[key] for d in each])) for key in each[0]}


def format_case(title: str, stats: dict, grid: dict, key_width: int = 28) -> list[str]:
    """A case's lines: the phase table (us, then cycles), then one line per grid fact, its name
    in a column of `key_width`."""
    head = (f"  {'phase':12s} {'p10 us':>8s} {'p50 us':>8s} {'p90 us':>8s} "
            f"{'p10 cyc':>9s} {'p50 cyc':>9s} {'p90 cyc':>9s}")
    lines = [title, head]
    for phase, s in stats.items():
        lines.append(f"  {phase:12s} {s['p10_us']:8.3f} {s['p50_us']:8.3f} {s['p90_us']:8.3f} "
                     f"{s['p10_cyc']:9.0f} {s['p50_cyc']:9.0f} {s['p90_cyc']:9.0f}")
    return lines + [f"  {key:{key_width}s} {value:8.3f} us (globaltimer)"
                    for key, value in grid.items()]


def case_metrics(ctx, label: str, case: str, stats: dict, grid: dict) -> None:
    """The devicecheck rows of a case: each phase's p50 us (p10 / p90 us and p50 cycles in the
    name), each grid fact."""
    for phase, s in stats.items():
        ctx.metric(f"tl {label} {case} {phase}: p10/p90 {s['p10_us']:.2f}/{s['p90_us']:.2f} us, "
                   f"p50 {s['p50_cyc']:.0f} cyc", s["p50_us"], "us")
    for key, value in grid.items():
        ctx.metric(f"tl {label} {case} {key}", value, "us")


# ---- device runs (the runners pass their own launches, clear and download) ----------------------

def isolated_runs(ctx, reps: int, clear, launch_of, collect) -> tuple[list, list]:
    """`reps` single launches, each after clear() and an L2 flush: launch_of(rep), then
    collect() -> (stamps, raw rows) of it; both concatenated over the reps."""
    runs, raws = [], []
    for rep in range(reps):
        clear()
        ctx.flusher.flush(ctx.stream)
        launch_of(rep).launch(ctx.stream)
        got, raw = collect()
        runs += got
        raws += raw
    return runs, raws


def chain_replays(ctx, launches: list, replays: int, clear, collect) -> tuple[list, list]:
    """`launches` captured as one PDL graph, replayed once to warm up, then `replays` times,
    each after clear(): collect() -> (stamps, raw rows) per replay."""
    from executor.graphs import Graph
    with Graph.capture(ctx.stream) as g:
        for launch in launches:
            launch.launch(ctx.stream)
    runs, raws = [], []
    try:
        g.launch(ctx.stream)                     # warm-up (code, TLB, clocks)
        for _ in range(replays):
            clear()
            g.launch(ctx.stream)
            got, raw = collect()
            runs.append(got)
            raws.append(raw)
    finally:
        g.close()
    return runs, raws


def report_dir(ctx=None) -> Path | None:
    """$HOPDEC_REPORT_DIR, else the devicecheck context's report dir, else the `--out` of the
    devicecheck command line, else None."""
    if os.environ.get(REPORT_DIR_ENV):
        return Path(os.environ[REPORT_DIR_ENV])
    if getattr(ctx, "out_dir", None):
        return Path(ctx.out_dir)
    argv = sys.argv
    for i, arg in enumerate(argv):
        if arg == "--out" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if arg.startswith("--out="):
            return Path(arg.split("=", 1)[1])
    return None
