"""Where a sparse MQA (and indexer) launch's time goes, per CTA: the `_timeline` builds' stamps.

The timeline builds (kernels/sparse_mqa_ref.timeline_specs; the step's kernels plus a stamps
pointer) have thread 0 of every CTA write a row of u64: word 0 %smid, word 1 padding, then
(%globaltimer ns, %clock64) per point of the kernel's POINTS (16-byte aligned pairs). `bench_attn_timeline` (devicecheck family
"attn_timeline") runs them as the family benchmarks and the step do, at 4k and 64k context,
R = 1 and 6:
- "iso": one launch after an L2 flush (ISO_REPS times, CTAs pooled);
- "chain": a graph of CHAIN PDL launches of the kernel, each on its own case (other rows, other
  records) and its own stamp rows, CHAIN_REPLAYS replays; the launch at CHAIN_SHOWN (the 4th) is
  reported.
Per phase (consecutive points, then entry -> exit): p10 / p50 / p90 across CTAs in clock64 cycles
(one SM's counter: exact within a CTA) and in us (cycles / the SM clock fitted from the stamps).
Per launch (globaltimer, ns): the spread of the CTAs' entries and wait returns, the last exit
after the first entry and, in the chain, first / last entry and wait return after the previous
launch's last exit and the exit pitch. Every chain also checks that the timeline build's output
equals the production kernel's bit for bit on the same case. Raw stamps: attn-timeline.json in the
devicecheck report dir. NumPy only above the device section (tests/test_attn_timeline.py).
"""
from __future__ import annotations

import itertools
import json

import numpy as np

from executor import timeline
from kernels import indexer_kernel_ref as ik
from kernels import sparse_mqa_ref as ref

CONTEXTS = (4096, 65536)
ROWS = (1, 6)
ISO_REPS = 3
CHAIN = 6
CHAIN_SHOWN = 3                 # the 4th launch of the chain (steady state)
CHAIN_REPLAYS = 3
JSON_NAME = "attn-timeline.json"
HEAD = ref.TIMELINE_HEAD_WORDS  # %smid, padding: then (globaltimer, clock64) pairs
assert HEAD == ik.TIMELINE_HEAD_WORDS
LAYOUT = timeline.Layout(smid_word=0, pairs_word=HEAD, smid_bits=32)
GRID_KEY_WIDTH = 34             # the grid facts' names column (longer names than dense's)


# ---- stamps -> numbers (CPU) ---------------------------------------------------------------------

class Stamps(timeline.Stamps):
    """One launch's stamps at the points a build names (raw row: %smid, padding, then
    (globaltimer, clock64) per point)."""

    @classmethod
    def parse(cls, raw: np.ndarray, points: tuple[str, ...], name: str) -> Stamps:
        """u64 [ctas, >= HEAD + 2 * len(points)] as the kernel writes them into a zeroed buffer.
        Raises ValueError naming the first CTA and point that was never stamped."""
        return cls.decode(LAYOUT, raw, points, name)


def phases(points: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """(name, from, to): every consecutive pair of points, then the total."""
    out = [(b, a, b) for a, b in itertools.pairwise(points)]
    return out + [("total", points[0], points[-1])]


def clock_ghz(launches: list[Stamps], min_span_ns: int = 1000) -> float:
    """SM clock: the median over CTAs of clock64 span / globaltimer span (entry -> exit of one
    CTA: one SM, no idle gap), over the CTAs that span >= min_span_ns."""
    rates = []
    for s in launches:
        span = s.gt[:, -1] - s.gt[:, 0]
        cyc = s.clk[:, -1] - s.clk[:, 0]
        rates += list(cyc[span >= min_span_ns] / span[span >= min_span_ns])
    if not rates:
        raise ValueError(f"no CTA's stamps span {min_span_ns} ns: cannot fit the SM clock")
    return float(np.median(rates))


def phase_stats(launches: list[Stamps], ghz: float) -> dict[str, dict[str, float]]:
    """Per phase of the launches' points: p10 / p50 / p90 across the pooled CTAs, in cycles
    and in us."""
    return timeline.phase_stats(launches, phases(launches[0].points), ghz)


def grid_times(cur: Stamps, prev: Stamps | None) -> dict[str, float]:
    """globaltimer facts of one launch, us (module docstring)."""
    e, x = cur.gt[:, cur.col("entry")], cur.gt[:, -1]
    w = cur.gt[:, cur.col("after_wait")]
    out = {"entry spread": (e.max() - e.min()) / 1e3,
           "wait return spread": (w.max() - w.min()) / 1e3,
           "last exit after first entry": (x.max() - e.min()) / 1e3,
           "last exit after last wait return": (x.max() - w.max()) / 1e3}
    if prev is not None:
        out |= timeline.after_prev_exit(e, w, x, prev.gt[:, -1].max())
    return out


def median_grid_times(pairs: list[tuple[Stamps, Stamps | None]]) -> dict[str, float]:
    return timeline.medians([grid_times(cur, prev) for cur, prev in pairs])


def report(ctx, label: str, case: str, launches: list[Stamps], pairs, ghz: float,
           metrics: bool) -> list[str]:
    """The case's table lines; with `metrics`, the p50 of each phase and the grid facts too."""
    stats, grid = phase_stats(launches, ghz), median_grid_times(pairs)
    if metrics:
        timeline.case_metrics(ctx, label, case, stats, grid)
    return timeline.format_case(f"{label} {case} ({len(launches)} launches pooled)", stats, grid,
                                GRID_KEY_WIDTH)


def raw_rows(raw: np.ndarray, points: tuple[str, ...]) -> list[list[int]]:
    return LAYOUT.rows(raw, len(points))


# ---- device: sparse MQA ----------------------------------------------------------------------------

def _mqa_timeline_specs(bundle) -> list[ref.SparseMqaSpec]:
    from executor.launches.sparse_mqa import spec_of
    return [spec_of(bundle.manifest.kernels[n].spec) for n in bundle.names()
            if n.startswith("sparse_mqa_") and n.endswith("_timeline")]


class MqaTimelineRunner:
    """CHAIN distinct cases of one (context, rows) on device, a stamp block per chain slot."""

    def __init__(self, ctx, bundle, spec: ref.SparseMqaSpec, production: ref.SparseMqaSpec,
                 context: int, rows: int, rng):
        from executor.arena import Arena
        from executor.sparse_mqa_chain import BENCH_CASES, SparseMqaBuffers, make_case
        self.ctx, self.bundle, self.spec, self.rows = ctx, bundle, spec, rows
        self.production = production
        cases = [make_case(production, rng, context, BENCH_CASES[rows], write_all=True)
                 for _ in range(CHAIN)]
        self.bufs = [SparseMqaBuffers(ctx.device, bundle, c) for c in cases]
        self.slot_bytes = spec.stamp_rows(rows) * ref.TIMELINE_WORDS * 8
        self.arena = Arena(ctx.device, [("stamps", CHAIN * self.slot_bytes)])

    def launch(self, case: int, slot: int):
        return self.bufs[case].launch_of(self.bundle, self.spec,
                                         stamps=self.arena.ptr("stamps") + slot * self.slot_bytes)

    def clear(self) -> None:
        self.ctx.stream.synchronize()
        self.arena.fill("stamps", 0)
        self.arena.synchronize()

    def stamps(self, slots: int) -> tuple[list[Stamps], list]:
        self.ctx.stream.synchronize()
        raw = self.arena.download("stamps", np.uint64, (CHAIN, self.spec.stamp_rows(self.rows),
                                                        ref.TIMELINE_WORDS))
        order = ref.timeline_points(self.spec)            # words: ref.TIMELINE_POINTS order
        out = [Stamps.parse(raw[i], ref.TIMELINE_POINTS, f"{self.spec.name} slot {i}")
               .reordered(order) for i in range(slots)]
        return out, [raw_rows(raw[i], ref.TIMELINE_POINTS) for i in range(slots)]

    def isolated(self) -> tuple[list[Stamps], list]:
        return timeline.isolated_runs(self.ctx, ISO_REPS, self.clear,
                                      lambda rep: self.launch(rep % CHAIN, 0),
                                      lambda: self.stamps(1))

    def chain(self) -> tuple[list[list[Stamps]], list]:
        launches = [self.launch(i, i) for i in range(CHAIN)]
        return timeline.chain_replays(self.ctx, launches, CHAIN_REPLAYS, self.clear,
                                      lambda: self.stamps(CHAIN))

    def matches_production(self) -> bool:
        """The timeline build's output on case 0 equals the production kernel's bit for bit."""
        b = self.bufs[0]
        outs = []
        for launch in (b.launch_of(self.bundle, self.production), self.launch(0, 0)):
            b.arena.fill("out", 0xFF)
            launch.launch(self.ctx.stream)
            self.ctx.stream.synchronize()
            outs.append(b.output().view(np.uint16).copy())
        return bool(np.array_equal(outs[0], outs[1]))

    def close(self) -> None:
        for b in self.bufs:
            b.close()
        self.arena.close()


def _mqa_label(spec: ref.SparseMqaSpec) -> str:
    return ("mqa_topk" if spec.topk else "mqa_swa") + ("_early" if spec.early else "")


def _mqa_cases(ctx, bundle, spec, doc: dict, tables: list) -> None:
    """Every (context, rows) of one timeline kernel: iso, chain, the output check."""
    from executor.launches.sparse_mqa import spec_of
    production = spec_of(bundle.manifest.kernels[spec.name.removesuffix("_timeline")].spec)
    rng = np.random.default_rng(11)
    kdoc = doc["kernels"].setdefault(spec.name, {})
    for context in CONTEXTS if spec.topk else CONTEXTS[:1]:
        for rows in ROWS:
            case = f"T{context // 1024}k R{rows}"
            runner = MqaTimelineRunner(ctx, bundle, spec, production, context, rows, rng)
            try:
                same = runner.matches_production()
                ctx.metric(f"tl {_mqa_label(spec)} {case}: output equals {production.name}'s",
                           float(same), "bool", "1", same)
                iso, iso_raw = runner.isolated()
                replays, chain_raw = runner.chain()
            finally:
                runner.close()
            kdoc[f"{case} iso"], kdoc[f"{case} chain"] = iso_raw, chain_raw
            tables.append((_mqa_label(spec), f"{case} iso", iso, [(s, None) for s in iso]))
            shown = [r[CHAIN_SHOWN] for r in replays]
            tables.append((_mqa_label(spec), f"{case} chain #{CHAIN_SHOWN + 1}", shown,
                           [(r[CHAIN_SHOWN], r[CHAIN_SHOWN - 1]) for r in replays]))


# ---- device: indexer -------------------------------------------------------------------------------

def stamped_launch(bundle, launch, stamps: int):
    """The `_timeline` twin of a production LaunchSpec: same grid, cluster and arguments, the
    stamps address inserted where the twin's ABI has it."""
    from executor.launch import LaunchSpec
    twin = bundle.kernel(launch.kernel.name + "_timeline")
    at = [name for name, _ in twin.params].index("stamps")
    return LaunchSpec(twin, launch.grid, launch.args[:at] + (stamps,) + launch.args[at:],
                      cluster=launch.cluster)


def indexer_kind(name: str) -> str:
    """The TIMELINE_POINTS key of an indexer kernel name."""
    for kind in ("prep", "scores", "topkc", "topk"):
        if name.startswith(f"indexer_{kind}_"):
            return kind
    raise ValueError(f"{name}: not an indexer prep / scores / top-k kernel")


# label -> (ratio, mode, suffix of the top-k kernel measured instead of the step's: "" = the step's)
INDEXER_CHAINS = {"idx_dense_r2": (2, "dense", ""), "idx_reindex": (1, "candidates", ""),
                  "idx_dense_r2_held": (2, "dense", f"_s{ik.TOPK_HELD}")}
LAYERS = 4                      # index layers per chain graph (the step has 3 dense r2, 4 reindex)
LAYER_SHOWN = 2                 # the 3rd layer's launches are reported


class IndexerTimelineRunner:
    """One index layer kind's prep -> scores -> top-k (the step's kernels, their timeline twins)
    on one IndexerChain at (context, rows); a stamp block per launch of a LAYERS-layer chain."""

    def __init__(self, ctx, bundle, label: str, context: int, rows: int, rng):
        import cupy as cp

        from executor.arena import Arena
        from executor.benchmarks import fill_random_bf16
        from executor.indexer_chain import IndexerChain, layout_rows, random_key_records
        from executor.launch import LaunchSpec
        from executor.launches import indexer as il
        ratio, mode, topk_suffix = INDEXER_CHAINS[label]
        self.ctx, self.bundle, self.rows = ctx, bundle, rows
        pos, seq, seqs = layout_rows(rows, context)
        ld = -(-context // 64) * 64             # the step's scores stride: the pages' reach
        shape = il.IndexerShape(32, ratio, mode, 512, 2048, 8, 64, rows, seqs, ld)
        self.chain = IndexerChain(ctx.device, bundle, shape)
        keys = self.chain.arena.view("keys", np.uint8)
        chunk = random_key_records(rng, 8192).reshape(-1)
        for start in range(0, keys.size, chunk.size):
            stop = min(keys.size, start + chunk.size)
            keys[start:stop] = cp.asarray(chunk[:stop - start])
        pages = keys.size // ik.KEY_BYTES // 64
        self.chain.upload("block_tables", rng.permutation(pages).astype(np.int32))
        fill_random_bf16(self.chain.arena, "q")
        fill_random_bf16(self.chain.arena, "w_raw")
        self.chain.upload("positions", pos)
        self.chain.upload("seq_index", seq)
        if mode == "candidates":
            blocks = max(1, context // 8)
            cands = np.full((rows, 2048), -1, np.int32)
            for r in range(rows):
                picked = np.sort(rng.permutation(blocks)[:2048])
                cands[r, :picked.size] = picked
            self.chain.upload("cands", cands)
        self.chain.arena.synchronize()
        self.production = il.indexer_launches(bundle, shape, self.chain.ptrs(), rows, 0.0156,
                                              cluster_topk=mode == "candidates")
        # What is measured: the step's chain, or with a candidate top-k on the same arguments.
        *head, topk = self.production
        self.measured = head + [LaunchSpec(bundle.kernel(topk.kernel.name + topk_suffix),
                                           topk.grid, topk.args, cluster=topk.cluster)]
        ctas = max(int(np.prod(x.grid)) for x in self.production)
        self.slot_bytes = ctas * ik.TIMELINE_WORDS * 8
        self.slots = LAYERS * len(self.production)
        self.arena = Arena(ctx.device, [("stamps", self.slots * self.slot_bytes)])

    def names(self) -> list[str]:
        return [x.kernel.name for x in self.measured]

    def launches(self) -> list:
        base = self.arena.ptr("stamps")
        return [stamped_launch(self.bundle, x, base + (layer * len(self.measured) + i)
                               * self.slot_bytes)
                for layer in range(LAYERS) for i, x in enumerate(self.measured)]

    def raw(self) -> np.ndarray:
        """u64 [launch slot, most CTAs of a launch, TIMELINE_WORDS]."""
        self.ctx.stream.synchronize()
        return self.arena.download("stamps", np.uint64,
                                   (self.slots, self.slot_bytes // 8 // ik.TIMELINE_WORDS,
                                    ik.TIMELINE_WORDS))

    def stamps(self) -> tuple[list[Stamps], list]:
        raw = self.raw()
        out, raws = [], []
        for slot, x in enumerate(self.launches()):
            points = ik.TIMELINE_POINTS[indexer_kind(x.kernel.name)]
            ctas = int(np.prod(x.grid))
            out.append(Stamps.parse(raw[slot, :ctas], points, f"{x.kernel.name} slot {slot}"))
            raws.append(raw_rows(raw[slot, :ctas], points))
        return out, raws

    def run_chain(self, flush: bool) -> tuple[list[Stamps], list]:
        """One replay of the LAYERS-layer PDL graph (after an L2 flush if asked)."""
        self.ctx.stream.synchronize()
        self.arena.fill("stamps", 0)
        self.arena.synchronize()
        if flush:
            self.ctx.flusher.flush(self.ctx.stream)
        self.graph.launch(self.ctx.stream)
        return self.stamps()

    def matches_production(self) -> bool:
        """The timeline chain's top-k (of the measured top-k kernel) equals the step's
        production chain's bit for bit."""
        outs = []
        k = 512
        for launches in (self.production, self.launches()[:len(self.measured)]):
            self.chain.poison("topk")
            self.chain.arena.synchronize()
            for x in launches:
                x.launch(self.ctx.stream)
            self.ctx.stream.synchronize()
            outs.append(self.chain.download("topk", np.int32, (self.rows, k)))
        return bool(np.array_equal(outs[0], outs[1]))

    def __enter__(self):
        from executor.graphs import Graph
        with Graph.capture(self.ctx.stream) as g:
            for x in self.launches():
                x.launch(self.ctx.stream)
        self.graph = g
        return self

    def __exit__(self, *exc):
        self.graph.close()
        self.arena.close()
        self.chain.close()


def _indexer_cases(ctx, bundle, label: str, doc: dict, tables: list) -> None:
    rng = np.random.default_rng(13)
    kdoc = doc["kernels"].setdefault(label, {})
    for context in CONTEXTS:
        for rows in ROWS:
            case = f"T{context // 1024}k R{rows}"
            runner = IndexerTimelineRunner(ctx, bundle, label, context, rows, rng)
            with runner:
                same = runner.matches_production()
                ctx.metric(f"tl {label} {case}: top-k equals the production chain's",
                           float(same), "bool", "1", same)
                runner.run_chain(flush=False)                 # warm-up
                replays, raws = zip(*[runner.run_chain(flush=f)
                                      for f in [True] * ISO_REPS + [False] * CHAIN_REPLAYS])
                names = runner.names()
            kdoc[case] = {"kernels": names, "replays": list(raws)}
            n = len(names)
            for i, name in enumerate(names):
                kind = indexer_kind(name)
                iso = [r[i] for r in replays[:ISO_REPS]]                  # layer 1, cold L2
                tables.append((f"{label} {kind}", f"{case} iso", iso,
                               [(r[i], r[i - 1] if i else None) for r in replays[:ISO_REPS]]))
                at = LAYER_SHOWN * n + i
                warm = replays[ISO_REPS:]
                tables.append((f"{label} {kind}", f"{case} chain L{LAYER_SHOWN + 1}",
                               [r[at] for r in warm], [(r[at], r[at - 1]) for r in warm]))


def bench_attn_timeline(ctx) -> None:
    """The sparse MQA and indexer timeline kernels: per-phase tables (printed) and metrics, raw
    JSON."""
    bundle = ctx.bundle_with("sparse_mqa_")
    specs = _mqa_timeline_specs(bundle) if bundle is not None else []
    if not specs:
        raise LookupError("no bundle has sparse MQA timeline kernels (sparse_mqa_*_timeline)")
    doc = {"points": {"sparse_mqa": ref.TIMELINE_POINTS, **ik.TIMELINE_POINTS}, "kernels": {}}
    tables = []
    for spec in specs:
        try:
            _mqa_cases(ctx, bundle, spec, doc, tables)
        except Exception as exc:  # noqa: BLE001 - one kernel's failure must not hide the others
            ctx.metric(f"tl {spec.name} failed: {exc!r}"[:200], 0.0, "", "runs", False)
    ibundle = ctx.bundle_with("indexer_scores_dense_h32_r2_p64_timeline")
    for label in INDEXER_CHAINS if ibundle is not None else ():
        try:
            _indexer_cases(ctx, ibundle, label, doc, tables)
        except Exception as exc:  # noqa: BLE001
            ctx.metric(f"tl {label} failed: {exc!r}"[:200], 0.0, "", "runs", False)
    try:
        _summarise(ctx, doc, tables)
    finally:
        out = timeline.report_dir(ctx)
        if out is not None and out.is_dir():
            (out / JSON_NAME).write_text(json.dumps(doc))
            ctx.metric(f"tl raw stamps written to {out / JSON_NAME}", 1, "")


def _summarise(ctx, doc: dict, tables: list) -> None:
    if not tables:
        return
    every = [s for _, _, launches, _ in tables for s in launches]
    ghz = clock_ghz(every)
    doc["clock_ghz"] = ghz
    ctx.metric("tl SM clock (clock64 / globaltimer per CTA)", ghz, "GHz")
    lines = [f"attn timeline: SM clock {ghz:.3f} GHz"]
    compact = ["attn timeline, p50 us per phase (points in the order reached) | exit pitch:"]
    for label, case, launches, pairs in tables:        # metrics: the chain cases only
        lines += report(ctx, label, case, launches, pairs, ghz, metrics=" chain" in case)
        stats, grid = phase_stats(launches, ghz), median_grid_times(pairs)
        compact.append(f"  {label:22s} {case:18s} " + " ".join(
            f"{k}={v['p50_us']:.2f}" for k, v in stats.items())
            + (f" | pitch={grid['exit pitch']:.2f}" if "exit pitch" in grid else ""))
    print("\n".join(lines + compact), flush=True)
