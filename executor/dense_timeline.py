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
from dataclasses import dataclass

import numpy as np

from executor import timeline
from executor.timeline import REPORT_DIR_ENV, format_case, report_dir  # noqa: F401 - re-exported
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
LAYOUT = timeline.Layout(smid_word=2 * len(POINTS), pairs_word=0)   # pairs, then %smid


# ---- stamps -> numbers (CPU; tests/test_dense_timeline.py) ---------------------------------------

@dataclass(frozen=True)
class Stamps(timeline.Stamps):
    """One launch's stamps at dense_ref.TIMELINE_POINTS (raw row: (globaltimer, clock64) per
    point, then %smid)."""

    points: tuple[str, ...] = POINTS

    @classmethod
    def parse(cls, raw: np.ndarray, name: str) -> Stamps:
        """u64 [ctas, TIMELINE_WORDS] as the kernel writes them (zeroed before the launch)."""
        return cls.decode(LAYOUT, raw, POINTS, name)


def timer_resolution_ns(launches: list[Stamps]) -> tuple[int, int]:
    """The globaltimer's tick (timeline.timer_ticks) of all stamps; (0, 0): all stamps equal."""
    return timeline.timer_ticks(np.concatenate([s.gt.ravel() for s in launches])) or (0, 0)


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
    """Per phase of PHASES: p10 / p50 / p90 across the pooled CTAs, in cycles and in us."""
    return timeline.phase_stats(launches, PHASES, ghz)


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
        out |= timeline.after_prev_exit(e, w, x, prev.gt[:, prev.col("exit")].max())
    return out


def median_grid_times(pairs: list[tuple[Stamps, Stamps | None]]) -> dict[str, float]:
    """grid_times per (launch, its predecessor), the median of each over the repetitions."""
    return timeline.medians([grid_times(cur, prev) for cur, prev in pairs])


def raw_json(raw: np.ndarray) -> list[list[int]]:
    return LAYOUT.rows(raw, len(POINTS))


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

    def collect(self, slots: int) -> tuple[list[Stamps], list]:
        """The first `slots` slots' stamps and raw rows."""
        stamps = self.stamps(slots)
        return stamps, [raw_json(r) for r in self.last_raw]

    def isolated(self, rows: int) -> tuple[list[Stamps], list]:
        """ISO_REPS single launches, each after an L2 flush, each on another weight copy."""
        return timeline.isolated_runs(self.ctx, ISO_REPS, self.clear,
                                      lambda rep: self.launch(rep % self.copies, 0, rows),
                                      lambda: self.collect(1))

    def chain(self, rows: int, l2: bool) -> tuple[list[list[Stamps]], list]:
        """CHAIN_REPLAYS replays of a CHAIN-launch PDL graph (each launch its own stamp rows)."""
        launches = [self.launch(0 if l2 else i, i, rows) for i in range(CHAIN)]
        return timeline.chain_replays(self.ctx, launches, CHAIN_REPLAYS, self.clear,
                                      lambda: self.collect(CHAIN))

    def close(self) -> None:
        self.arena.close()


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
            timeline.case_metrics(ctx, label, case, stats, grid)
    print("\n".join(lines), flush=True)
