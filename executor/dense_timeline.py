"""Where a streamed dense kernel's time goes, per CTA: the `_timeline` kernels' stamps (devicecheck).

The timeline kernels (kernels/dense_ref.timeline_specs: the step's R <= 8 kernel of wq_a|wkv,
wq_b and wo_b, bf16, with DenseSpec.timeline) write, per CTA, %smid and (%globaltimer,
%clock64) at dense_ref.TIMELINE_POINTS into their workspace. `bench_dense_timeline` runs each at
R = 1 and 6
- "iso": one launch after an L2 flush (ISO_REPS times, CTAs pooled);
- "chain": a graph of CHAIN PDL launches of the same kernel, each on its own weight copy (HBM)
  and stamp rows; the launch at CHAIN_SHOWN (the 4th) is reported, CHAIN_REPLAYS replays pooled;
- "chain-l2" (R = 1): the same chain on ONE weight copy (L2-resident after the first launch);
and reports per phase (consecutive points) the p10 / median / p90 across CTAs in clock64 cycles
(exact within a CTA) and in us (cycles / the SM clock, fitted per SM from the stamps); per launch
the first and last CTA entry after the previous launch's last exit, and the grid's last weight
byte and last exit after its first entry (globaltimer: ns, at the timer's resolution, which
`timer_resolution_ns` reads from the stamps themselves). Raw stamps: dense-timeline.json in the
devicecheck report dir (`report_dir`).
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kernels import dense_ref as dr

POINTS = dr.TIMELINE_POINTS
PHASES = (("issue", "entry", "issued"),            # weight copies (and scale copies) issued
          ("scales+bar", "issued", "before_wait"),  # scale group landed, CTA barrier
          ("pdl wait", "before_wait", "after_wait"),
          ("first unit", "after_wait", "first_landed"),
          ("rest units", "first_landed", "last_landed"),   # xts: units 0..n-2 multiplied meanwhile
          ("math tail", "last_landed", "epilogue"),        # what is multiplied after the last byte
          ("epilogue", "epilogue", "exit"),
          ("total", "entry", "exit"))
ROWS = (1, 6)
ISO_REPS = 5
CHAIN = 8
CHAIN_SHOWN = 3                 # the 4th launch of the chain (steady state)
CHAIN_REPLAYS = 3
JSON_NAME = "dense-timeline.json"
REPORT_DIR_ENV = "HOPDEC_REPORT_DIR"


# ---- stamps -> numbers (CPU; tests/test_dense_timeline.py) ---------------------------------------

@dataclass(frozen=True)
class Stamps:
    """One launch's stamps: smid [C], globaltimer ns [C, P], clock64 cycles [C, P] (raw row:
    (globaltimer, clock64) per point, then %smid: dense_ref.TIMELINE_POINTS)."""

    smid: np.ndarray
    gt: np.ndarray
    clk: np.ndarray

    @classmethod
    def parse(cls, raw: np.ndarray, name: str) -> Stamps:
        """u64 [ctas, TIMELINE_WORDS] as the kernel writes them (zeroed before the launch)."""
        p = len(POINTS)
        if raw.ndim != 2 or raw.shape[1] < 1 + 2 * p:
            raise ValueError(f"{name}: stamps must be u64 [ctas, >= {1 + 2 * p}], got {raw.shape}")
        raw = raw.astype(np.int64)
        gt, clk = raw[:, 0:2 * p:2], raw[:, 1:2 * p:2]
        missing = np.argwhere((gt == 0) | (clk == 0))
        if missing.size:
            cta, point = missing[0]
            raise ValueError(f"{name}: CTA {cta} never stamped '{POINTS[point]}' "
                             f"({len(missing)} stamps missing)")
        return cls(raw[:, 2 * p], gt, clk)

    def col(self, point: str) -> int:
        return POINTS.index(point)


def timer_resolution_ns(launches: list[Stamps]) -> tuple[int, int]:
    """The globaltimer's tick as (gcd of every stamp's distance to the earliest, smallest step
    between distinct stamps); they agree for a timer that advances in whole ticks. (0, 0): all
    stamps equal."""
    values = np.unique(np.concatenate([s.gt.ravel() for s in launches]))
    if values.size < 2:
        return 0, 0
    return int(np.gcd.reduce(values - values[0])), int(np.diff(values).min())


def clock_ghz(groups: list[list[Stamps]], min_span_ns: int = 2000) -> float:
    """SM clock from (globaltimer, clock64) pairs of one SM (clock64 counts per SM) within one
    group of back-to-back launches (a chain replay: no idle gap, whose clock may differ): the
    median over (group, SM) of clock span / time span, those spanning >= min_span_ns only."""
    rates = []
    for launches in groups:
        smid = np.concatenate([s.smid for s in launches])
        gt = np.concatenate([s.gt for s in launches])
        clk = np.concatenate([s.clk for s in launches])
        for sm in np.unique(smid):
            g, c = gt[smid == sm].ravel(), clk[smid == sm].ravel()
            span = int(g.max() - g.min())
            if span >= min_span_ns:
                rates.append((int(c[g.argmax()]) - int(c[g.argmin()])) / span)
    if not rates:
        raise ValueError(f"no SM's stamps span {min_span_ns} ns: cannot fit the SM clock")
    return float(np.median(rates))


def phase_stats(launches: list[Stamps], ghz: float) -> dict[str, dict[str, float]]:
    """Per phase: p10 / p50 / p90 across the pooled CTAs, in cycles and in us."""
    out = {}
    for phase, a, b in PHASES:
        cyc = np.concatenate([s.clk[:, s.col(b)] - s.clk[:, s.col(a)] for s in launches])
        q = np.percentile(cyc, (10, 50, 90))
        out[phase] = {"p10_cyc": q[0], "p50_cyc": q[1], "p90_cyc": q[2],
                      "p10_us": q[0] / ghz / 1e3, "p50_us": q[1] / ghz / 1e3,
                      "p90_us": q[2] / ghz / 1e3}
    return out


def grid_times(cur: Stamps, prev: Stamps | None) -> dict[str, float]:
    """globaltimer facts of one launch, us: first / last CTA entry and griddepcontrol.wait
    return after the previous launch's last exit (chain: the PDL hand-off), last landed and
    last exit after the first entry, exit-to-exit pitch."""
    e, x = cur.gt[:, cur.col("entry")], cur.gt[:, cur.col("exit")]
    w = cur.gt[:, cur.col("after_wait")]
    out = {"entry spread": (e.max() - e.min()) / 1e3,
           "last landed": (cur.gt[:, cur.col("last_landed")].max() - e.min()) / 1e3,
           "last exit": (x.max() - e.min()) / 1e3}
    if prev is not None:
        prev_exit = prev.gt[:, prev.col("exit")].max()
        out |= {"first entry after prev exit": (e.min() - prev_exit) / 1e3,
                "last entry after prev exit": (e.max() - prev_exit) / 1e3,
                "first wait return after prev exit": (w.min() - prev_exit) / 1e3,
                "last wait return after prev exit": (w.max() - prev_exit) / 1e3,
                "exit pitch": (x.max() - prev_exit) / 1e3}
    return out


def median_grid_times(pairs: list[tuple[Stamps, Stamps | None]]) -> dict[str, float]:
    """grid_times per (launch, its predecessor), the median of each over the repetitions."""
    each = [grid_times(cur, prev) for cur, prev in pairs]
    return {key: float(np.median([d[key] for d in each])) for key in each[0]}


def format_case(title: str, stats: dict, grid: dict) -> list[str]:
    head = (f"  {'phase':12s} {'p10 us':>8s} {'p50 us':>8s} {'p90 us':>8s} "
            f"{'p10 cyc':>9s} {'p50 cyc':>9s} {'p90 cyc':>9s}")
    lines = [title, head]
    for phase, s in stats.items():
        lines.append(f"  {phase:12s} {s['p10_us']:8.3f} {s['p50_us']:8.3f} {s['p90_us']:8.3f} "
                     f"{s['p10_cyc']:9.0f} {s['p50_cyc']:9.0f} {s['p90_cyc']:9.0f}")
    lines += [f"  {key:28s} {value:8.3f} us (globaltimer)" for key, value in grid.items()]
    return lines


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


def raw_json(raw: np.ndarray) -> list[list[int]]:
    return [[int(v) for v in row[:1 + 2 * len(POINTS)]] for row in raw]


# ---- device ------------------------------------------------------------------------------------

def _timeline_specs(bundle) -> list[dr.DenseSpec]:
    specs = [dr.DenseSpec.from_dict(bundle.manifest.kernels[n].spec) for n in bundle.names()
             if n.startswith("dense_w8a16_") and n.endswith("_timeline")]
    return [s for s in specs if s.timeline]


class TimelineRunner:
    """One timeline spec's buffers: weight copies, x, out, a stamp row block per chain slot."""

    def __init__(self, ctx, bundle, spec: dr.DenseSpec):
        from executor.arena import Arena
        from executor.benchmarks import fill_random_bf16, fill_random_u32
        self.ctx, self.bundle, self.spec = ctx, bundle, spec
        wbytes, sbytes = spec.n * spec.k, (spec.n // 32) * (spec.k // 32)
        self.copies = max(CHAIN, -(-3 * ctx.device.info.l2_bytes // wbytes))
        reqs = [(f"w{c}", wbytes) for c in range(self.copies)]
        reqs += [(f"s{c}", sbytes) for c in range(self.copies)]
        reqs += [("x", dr.ROW_TILE * spec.k * 2), ("out", dr.ROW_TILE * spec.n * 2),
                 ("stamps", CHAIN * spec.workspace_bytes())]
        self.arena = Arena(ctx.device, reqs)
        for c in range(self.copies):
            fill_random_u32(self.arena, f"w{c}")         # timing only: the values are unused
            self.arena.view(f"s{c}", "uint8")[:] = 118
        fill_random_bf16(self.arena, "x")
        self.arena.synchronize()

    def launch(self, copy: int, slot: int, rows: int, pdl: bool = True):
        from executor.launches.dense import dense_launch
        a = self.arena
        ptrs = {"x": a.ptr("x"), "weight": a.ptr(f"w{copy}"), "scales": a.ptr(f"s{copy}"),
                "out": a.ptr("out"),
                "workspace": a.ptr("stamps") + slot * self.spec.workspace_bytes()}
        return dense_launch(self.bundle, self.spec, ptrs, rows, pdl=pdl)

    def stamps(self, slots: int) -> list[Stamps]:
        self.ctx.stream.synchronize()
        raw = self.arena.download("stamps", np.uint64,
                                  (CHAIN, self.spec.ctas, dr.TIMELINE_WORDS))
        self.last_raw = raw[:slots]
        return [Stamps.parse(raw[i], f"{self.spec.name} slot {i}") for i in range(slots)]

    def clear(self) -> None:
        self.ctx.stream.synchronize()
        self.arena.fill("stamps", 0)
        self.arena.synchronize()

    def isolated(self, rows: int) -> tuple[list[Stamps], list]:
        """ISO_REPS single launches, each after an L2 flush, each on another weight copy."""
        runs, raws = [], []
        for rep in range(ISO_REPS):
            self.clear()
            self.ctx.flusher.flush(self.ctx.stream)
            self.launch(rep % self.copies, 0, rows).launch(self.ctx.stream)
            runs += self.stamps(1)
            raws.append(raw_json(self.last_raw[0]))
        return runs, raws

    def chain(self, rows: int, l2: bool) -> tuple[list[list[Stamps]], list]:
        """CHAIN_REPLAYS replays of a CHAIN-launch PDL graph (each launch its own stamp rows)."""
        from executor.graphs import Graph
        launches = [self.launch(0 if l2 else i, i, rows) for i in range(CHAIN)]
        with Graph.capture(self.ctx.stream) as g:
            for launch in launches:
                launch.launch(self.ctx.stream)
        replays, raws = [], []
        try:
            g.launch(self.ctx.stream)                     # warm-up (code, TLB, clocks)
            for _ in range(CHAIN_REPLAYS):
                self.clear()
                g.launch(self.ctx.stream)
                replays.append(self.stamps(CHAIN))
                raws.append([raw_json(r) for r in self.last_raw])
        finally:
            g.close()
        return replays, raws

    def close(self) -> None:
        self.arena.close()


def _metrics(ctx, label: str, case: str, stats: dict, grid: dict) -> None:
    for phase, s in stats.items():
        ctx.metric(f"tl {label} {case} {phase}: p10/p90 {s['p10_us']:.2f}/{s['p90_us']:.2f} us, "
                   f"p50 {s['p50_cyc']:.0f} cyc", s["p50_us"], "us")
    for key, value in grid.items():
        ctx.metric(f"tl {label} {case} {key}", value, "us")


def _label(spec: dr.DenseSpec) -> str:
    """The layer, plus what sets a candidate apart (e.g. `wqa_wkv_u1024`)."""
    layer = spec.name.removeprefix("dense_w8a16_").split("_n")[0]
    tail = spec.name.removesuffix("_timeline").split(f"_r8_{spec.epilogue}")[-1]
    return layer + tail


def _collect(ctx, bundle, spec: dr.DenseSpec, runner_class, doc: dict, cases: list,
             every: list, groups: list) -> None:
    """Run one timeline kernel's cases; append (label, case, launches, pairs) to `cases`."""
    runner = runner_class(ctx, bundle, spec)
    kdoc = doc["kernels"][spec.name] = {"variant": spec.variant, "ctas": spec.ctas}
    try:
        for rows in ROWS:
            iso, iso_raw = runner.isolated(rows)
            kdoc[f"R{rows} iso"] = iso_raw
            cases.append((_label(spec), f"R{rows} iso", iso, [(s, None) for s in iso]))
            every += iso
            for l2 in ((False, True) if rows == 1 else (False,)):
                replays, raw = runner.chain(rows, l2)
                case = f"R{rows} chain{'-l2' if l2 else ''}"
                kdoc[case] = raw
                every += [s for r in replays for s in r]
                groups += replays
                for pos in (CHAIN_SHOWN, CHAIN - 1):
                    cases.append((_label(spec), f"{case} #{pos + 1}", [r[pos] for r in replays],
                                  [(r[pos], r[pos - 1]) for r in replays]))
    finally:
        runner.close()


def bench_dense_timeline(ctx, runner_class=None) -> None:
    """The timeline kernels at R = 1 and 6: isolated, 4th of a PDL chain, (R = 1) L2 chain.
    `runner_class`: TimelineRunner (tests pass one that makes stamps up)."""
    bundle = ctx.bundle_with("dense_w8a16_")
    specs = _timeline_specs(bundle) if bundle is not None else []
    if not specs:
        raise LookupError("no bundle has dense timeline kernels (dense_w8a16_*_timeline)")
    doc, every, groups, cases = {"points": POINTS, "kernels": {}}, [], [], []
    for spec in specs:
        try:
            _collect(ctx, bundle, spec, runner_class or TimelineRunner, doc, cases, every, groups)
        except Exception as exc:  # noqa: BLE001 - one kernel's failure must not hide the others
            ctx.metric(f"tl {spec.name} failed: {exc!r}"[:200], 0.0, "", "runs", False)
    out = report_dir(ctx)
    try:
        if every:
            _summarise(ctx, doc, cases, every, groups)
    finally:
        if out is not None and out.is_dir():
            (out / JSON_NAME).write_text(json.dumps(doc))
            ctx.metric(f"tl raw stamps written to {out / JSON_NAME}", 1, "")
        else:
            ctx.metric("tl raw stamps NOT written (no report dir found)", 0, "")


def _summarise(ctx, doc: dict, cases: list, every: list, groups: list) -> None:
    """Clock and tick, then per case the phase table (printed; metrics for iso and the 4th)."""
    (resolution, step), ghz = timer_resolution_ns(every), clock_ghz(groups)
    doc |= {"globaltimer_gcd_ns": resolution, "globaltimer_step_ns": step, "clock_ghz": ghz}
    ctx.metric("tl globaltimer tick: gcd of stamp distances", resolution, "ns")
    ctx.metric("tl globaltimer tick: smallest step between stamps", step, "ns")
    ctx.metric("tl SM clock (clock64 / globaltimer per SM and chain replay)", ghz, "GHz")
    lines = [f"dense timeline: globaltimer tick {resolution} ns, SM clock {ghz:.3f} GHz"]
    for label, case, launches, pairs in cases:
        stats, grid = phase_stats(launches, ghz), median_grid_times(pairs)
        lines += format_case(f"{label} {case} ({len(launches)} launches pooled)", stats, grid)
        if case.endswith((" iso", f" #{CHAIN_SHOWN + 1}")):     # the table: iso and the 4th
            _metrics(ctx, label, case, stats, grid)
    print("\n".join(lines), flush=True)
