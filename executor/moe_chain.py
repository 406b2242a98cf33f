"""The routed-MoE kernel chain on device buffers: arena, weight upload, launches; its benchmark.

The launches are built by executor/launches/moe.py on this chain's arena (pointer keys = slice
names). Used by tests/gpu/test_moe_kernel.py and by `hopdec devicecheck` (benchmark "moe_routed",
registered when this module is imported from executor/benchmarks.py).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from executor.arena import Arena
from executor.launch import LaunchSpec
from executor.launches import moe as ml
from kernels import moe_kernel_ref as mk

# anchors.md table 3a (Humming W4A8 on this H200): M -> (distinct experts, w13+w2 us, chain us).
HUMMING_W4A8 = {1: (6.0, 26.92, 32.15), 2: (11.8, 37.51, 42.11), 4: (23.2, 53.98, 58.82),
                6: (34.6, 63.09, 67.85), 8: (46.2, 76.91, 81.92), 16: (84.5, 125.12, 131.17),
                32: (149.4, 205.39, 213.20), 64: (245.6, 327.97, 332.00),
                128: (332.0, 447.78, 449.24), 192: (364.3, 493.00, 494.53)}
BENCH_ROWS = (1, 2, 4, 6, 8, 16, 32, 64, 128, 192)
QUICK_ROWS = (1, 2, 4, 6, 8, 16, 64, 192)


class MoeChain:
    """Every buffer of one rank's routed MoE (sized for MAX_ROWS) and the four launches; the
    candidate w13 / w2 variants the bundle holds are selectable per launch list."""

    def __init__(self, device, bundle, shape: mk.MoeShape):
        self.shape = shape
        self.bundle = bundle
        self.specs = {s.kind: s for s in mk.make_specs(shape)}
        self.kernels = {k: bundle.kernel(s.name) for k, s in self.specs.items()}  # or raise
        # Every kernel of the shape the bundle holds: defaults, candidate variants and the
        # self-routed chain (xquant, w13sr, w2sr + the default combine).
        self.available = ml.available_specs(bundle, shape)
        self.variants = {key: s for key, s in self.available.items()
                         if key[1] and key[0] in ("w13", "w2")}
        self.selfrouted = {key: s for key, s in self.available.items()
                           if key[0] in ("xquant", "w13sr", "w2sr")}
        c13, o13 = shape.w13_bytes
        c2, o2 = shape.w2_bytes
        self.per_expert = {"codes13": c13, "offsets13": o13, "codes2": c2, "offsets2": o2}
        self.arena = Arena(device, ml.weight_requests(shape) + ml.requests(shape, mk.MAX_ROWS))
        self.ptrs = {name: self.arena.ptr(name) for name in self.arena.slices}
        self.zero_sched()

    def close(self) -> None:
        self.arena.close()

    def upload_experts(self, packed: mk.PackedExperts, expert_ids) -> None:
        """Write packed experts (leading axis = len(expert_ids)) at their expert ids."""
        import cupy as cp
        a = self.arena
        parts = {"codes13": packed.w13.codes, "offsets13": packed.w13.offsets,
                 "codes2": packed.w2.codes, "offsets2": packed.w2.offsets}
        for name, arr in parts.items():
            view = a.view(name, np.uint8, (self.shape.num_experts, self.per_expert[name]))
            for i, e in enumerate(expert_ids):
                view[int(e)] = cp.asarray(np.ascontiguousarray(arr[i]).reshape(-1))
        for name, arr in (("scales13", packed.w13.scales), ("scales2", packed.w2.scales)):
            view = a.view(name, np.float32, (self.shape.num_experts,))
            for i, e in enumerate(expert_ids):
                view[int(e)] = float(arr[i])
        cp.cuda.Device().synchronize()

    def upload_inputs(self, x_bf16_bits: np.ndarray, topk_ids: np.ndarray,
                      route_weights: np.ndarray) -> None:
        import cupy as cp
        rows, k = topk_ids.shape
        a = self.arena
        a.view("x", np.uint16, x_bf16_bits.shape)[...] = cp.asarray(x_bf16_bits)
        a.view("ids", np.int32, (rows, k))[...] = cp.asarray(topk_ids.astype(np.int32))
        a.view("route_weights", np.float32, (rows, k))[...] = cp.asarray(
            route_weights.astype(np.float32))
        cp.cuda.Device().synchronize()

    def poison_outputs(self) -> None:
        """NaN in every output and scratch buffer, so an element never written is caught."""
        import cupy as cp
        for name in ("h", "ye", "y", "xq", "xs", "pairs"):
            self.arena.view(name, np.uint8)[...] = 0xFF
        self.arena.view("meta", np.int32)[...] = -7
        cp.cuda.Device().synchronize()

    def zero_sched(self) -> None:
        """The work-queue counters to 0, as the step's arena starts (each queued launch leaves
        its words 0 again)."""
        import cupy as cp
        self.arena.view("sched", np.uint32)[...] = 0
        cp.cuda.Device().synchronize()

    def sched(self) -> np.ndarray:
        """The work-queue counters (w13 claim, done, w2 claim, done) from the device."""
        return self.download("sched", np.uint32, (mk.SCHED_WORDS,))

    def has_queued(self) -> bool:
        return ml.has_queued(self.available)

    def launches_queued(self, rows: int) -> list[LaunchSpec]:
        """xquant -> w13sr "bulkq" -> w2sr "earlyq" -> combine (round 9: claimed items)."""
        return self.launches_selfrouted(rows, *ml.QUEUED_PAIR)

    def variant_names(self, kind: str) -> list[str]:
        """"" (the default) and the candidate variants of kind the bundle holds."""
        return [""] + [v for k, v in self.variants if k == kind]

    def launches(self, rows: int, w13: str = "", w2: str | None = None,
                 kinds=ml.DEFAULT_CHAIN) -> list[LaunchSpec]:
        """The chain's launches (executor/launches/moe.py `chain_launches`: w13 / w2 = a variant
        name, "" the default; w2 None = chosen by rows); `kinds` a prefix of the chain for the
        benchmark's per-stage breakdown."""
        return ml.chain_launches(self.bundle, self.shape, self.ptrs, rows, w13, w2, kinds,
                                 self.available)

    def launches_warp_routed(self, rows: int, w2: str | None = None,
                             w13w: str = "early") -> list[LaunchSpec]:
        """prep -> w13w -> w2 -> combine (executor/launches/moe.py `warp_routed_launches`)."""
        return ml.warp_routed_launches(self.bundle, self.shape, self.ptrs, rows, w2,
                                       self.available, w13w)

    def warp_routed_variants(self, rows: int) -> list[str]:
        """The moe_w13w variants the bundle holds that can run `rows` rows."""
        return [v for v in ml.variant_names(self.available, "w13w")
                if ml.warp_routed_fits(self.available, self.shape, rows, v)]

    def launches_bulk(self, rows: int, w2: str = "bulk", w13w: str = ml.BULK_W13W,
                      w13sr: str = "bulk") -> list[LaunchSpec]:
        """prep -> w13w `w13w` / w13sr `w13sr` -> w2 `w2` -> combine (launches/moe.py
        `bulk_launches`)."""
        return ml.bulk_launches(self.bundle, self.shape, self.ptrs, rows, self.available, w2,
                                w13w, w13sr)

    def step_launches(self, rows: int) -> list[LaunchSpec]:
        """What the decode step launches at `rows` (executor/launches/moe.py `step_launches`)."""
        return ml.step_launches(self.bundle, self.shape, self.ptrs, rows)

    def has_selfrouted(self) -> bool:
        return ml.has_selfrouted(self.available)

    def selfrouted_variants(self, kind: str) -> list[str]:
        """The w13sr / w2sr variants the bundle holds ("" = that kernel's default)."""
        return ml.variant_names(self.selfrouted, kind)

    def launches_selfrouted(self, rows: int, w13: str = "",
                            w2: str | None = None) -> list[LaunchSpec]:
        """xquant -> w13sr -> w2sr -> combine (executor/launches/moe.py `selfrouted_launches`;
        w2 None = mk.W2SR_SINGLE_ROW_VARIANT at R = 1 when the bundle has it)."""
        return ml.selfrouted_launches(self.bundle, self.shape, self.ptrs, rows, w13, w2,
                                      self.available)

    def download(self, name: str, dtype, shape) -> np.ndarray:
        return self.arena.download(name, dtype, shape)


def _fill_random_weights(chain: MoeChain) -> None:
    """Random FP4 codes and valid offsets (o8 = 8 * [1, 12]) for every expert, on the device."""
    import cupy as cp
    a = chain.arena
    for name in ("codes13", "codes2"):
        view = a.view(name, np.uint8)
        view[...] = cp.random.randint(0, 256, size=view.size, dtype=cp.int32).astype(cp.uint8)
    for name in ("offsets13", "offsets2"):
        view = a.view(name, np.uint8)
        view[...] = (8 * cp.random.randint(1, 13, size=view.size, dtype=cp.int32)).astype(cp.uint8)
    for name in ("scales13", "scales2"):
        a.view(name, np.float32)[...] = np.float32(2.0**-10)
    cp.cuda.Device().synchronize()


def bench_moe_routed(ctx) -> None:
    """The routed-MoE chain (prep + w13 + w2 + combine) at R = 1..192, uniform top-k routing over
    every expert, L2 flushed before each rep; the self-routed chain (xquant + w13sr + w2sr +
    combine, rows labelled "selfrouted"; "selfrouted early" = both early-refill variants;
    "selfrouted bulk" = w13sr bulk + w2sr early, the static pair; "selfrouted queued" = the
    work-queue pair w13sr bulkq + w2sr earlyq, round 9) beside it; Humming's stock numbers
    (anchors.md)."""
    from executor.benchmarks import fill_random_bf16
    bundle = ctx.bundle_with("moe_w13_")
    if bundle is None:
        raise LookupError("no bundle has the moe kernels")
    # The backbone's shape (the most experts), not the DSpark stages' that a bundle may also hold.
    shape = max((ml.shape_of(bundle.manifest.kernels[n].spec) for n in bundle.names()
                 if n.startswith("moe_w13_")), key=lambda s: (s.num_experts, s.topk))
    rng = np.random.default_rng()
    chain = MoeChain(ctx.device, bundle, shape)
    try:
        _fill_random_weights(chain)
        fill_random_bf16(chain.arena, "x")
        for rows in QUICK_ROWS if ctx.quick else BENCH_ROWS:
            ids = np.stack([rng.choice(shape.num_experts, shape.topk, replace=False)
                            for _ in range(rows)]).astype(np.int32)
            weights = rng.random((rows, shape.topk)).astype(np.float32)
            x_bits = chain.download("x", np.uint16, (rows, shape.hidden))
            chain.upload_inputs(x_bits, ids, weights)
            distinct = len(np.unique(ids))
            chains = [("", chain.launches(rows))]
            step_w13, step_w2 = ml.step_variants(chain.available, rows)
            if step_w13:                 # the variants the step launches below 6 rows
                chains.append((f" {step_w13}", chain.launches(rows, step_w13, step_w2)))
            for w13w in chain.warp_routed_variants(rows):
                chains.append((" w13w" + (f" {w13w}" if w13w else ""),
                               chain.launches_warp_routed(rows, step_w2, w13w)))
            # Round 5: the step's chain with every weight byte by bulk copies.
            if ml.bulk_fits(chain.available, shape, rows):
                chains.append((" bulk", chain.launches_bulk(rows)))
                for w2 in ("bulkp", "bulkpd"):      # round 7: bulkpd decodes before its wait
                    if ("w2", w2) in chain.available:
                        chains.append((f" {w2}", chain.launches_bulk(rows, w2)))
                        if ml.warp_routed_fits(chain.available, shape, rows, "bulkw_lean4"):
                            chains.append((f" {w2} lean4", chain.launches_bulk(
                                rows, w2, "bulkw_lean4")))
                if ml.warp_routed_fits(chain.available, shape, rows, "bulkw_lean4"):
                    chains.append((" bulk lean4", chain.launches_bulk(rows, "bulk",
                                                                      "bulkw_lean4")))
            if chain.has_selfrouted():
                for w13w in ("bulkw", "bulkw_lean4"):     # round 6: w13w in the self-routed chain
                    if ml.warp_routed_fits(chain.available, shape, rows, w13w):
                        chains.append((f" selfrouted w13w {w13w}", ml.selfrouted_w13w_launches(
                            chain.bundle, shape, chain.ptrs, rows, w13w,
                            available=chain.available)))
                w2_early = "early" in chain.selfrouted_variants("w2sr")
                for w13 in chain.selfrouted_variants("w13sr"):
                    if w13 == ml.QUEUED_PAIR[0]:
                        continue                 # only with its w2 (the row below)
                    w2 = ("early" if w13 in ("early", "bulk", "bulkw") and w2_early
                          else None)
                    chains.append((" selfrouted" + (f" {w13}" if w13 else ""),
                                   chain.launches_selfrouted(rows, w13=w13, w2=w2)))
                if chain.has_queued():           # round 9: claimed items
                    chains.append((" selfrouted queued", chain.launches_queued(rows)))
            for label, specs in chains:
                def run(specs=specs):
                    for s in specs:
                        s.launch(ctx.stream)
                us = ctx.cold_median_us(run, reps=20 if ctx.quick else 50)
                row = ctx.bandwidth(f"moe_routed_{shape.tag()}", f"D={distinct}{label}", rows,
                                    us, mk.moe_bytes(shape, distinct, rows))
                _report_targets(ctx, rows, us, row, shape, label)
            if chain.has_queued():               # every queued launch leaves its words zero
                left = int(np.count_nonzero(chain.sched()))
                ctx.metric(f"moe queued R={rows}: nonzero sched words after the runs", left, "-",
                           "== 0", left == 0)
            if rows <= 8:
                _report_prefixes(ctx, chain, rows)
            if rows in TIMELINE_ROWS:
                _report_timeline(ctx, chain, rows)
    finally:
        chain.close()


TIMELINE_ROWS = (1, 6)


def _report_timeline(ctx, chain: MoeChain, rows: int) -> None:
    """The step's chain at `rows` (as it is now inputs are uploaded) with its w13 / w2 timeline
    builds: per-phase median / p10 / p90 across CTAs, the w13 -> w2 overlap, %globaltimer's
    resolution as metrics; every raw record and the summary to moe-timeline-R<rows>.json in the
    report directory. One warm-up run, then L2
    flushed and one run of the chain (the records are that run's)."""
    import cupy as cp

    from executor import moe_timeline as tl
    if not any(n.startswith("moe_") and n.endswith("_tl") for n in chain.bundle.names()):
        ctx.metric(f"moe timeline R={rows}: no timeline builds in the bundle", 0, "-")
        return
    ctas = mk.H200_NUM_SMS * 4
    bufs = [cp.zeros(ctas * mk.TIMELINE_RECORD_BYTES, dtype=cp.uint8) for _ in range(2)]
    dump = {}
    stamps = (bufs[0].data.ptr, bufs[1].data.ptr)
    chains = [(f"moe timeline R={rows}", ml.timeline_launches(
        chain.bundle, chain.shape, chain.ptrs, rows, stamps))]
    if rows >= ml.SELFROUTED_FROM_ROWS and ml.STEP_QUEUE and chain.has_queued():
        # round 9: the step's pair is the queued one; the static pair beside it
        chains.append((f"moe timeline R={rows} static", ml.timeline_launches(
            chain.bundle, chain.shape, chain.ptrs, rows, stamps, static=True)))
    for label, specs in chains:
        for _ in range(2):                   # the first run loads the modules: the second counts
            for buf in bufs:
                buf[...] = 0
            cp.cuda.Device().synchronize()
            ctx.flusher.flush(ctx.stream)
            for s in specs:
                s.launch(ctx.stream)
            ctx.stream.synchronize()
        recs = [tl.Records.parse(s.kernel.name, cp.asnumpy(buf), s.grid[0])
                for s, buf in zip(specs[1:3], bufs)]
        summary = tl.summarise(*recs)
        for metric, value, unit in tl.metric_lines(label, summary):
            ctx.metric(metric, value, unit)
        dump[label] = {"summary": summary, "raw": {
            r.name: {"smid": r.smid.tolist(), "ns": r.ns.tolist(), "clock": r.clock.tolist(),
                     "events": list(tl.EVENTS)} for r in recs}}
    out = _report_dir(ctx)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"moe-timeline-R{rows}.json").write_text(json.dumps(dump, indent=1))


def _report_prefixes(ctx, chain: MoeChain, rows: int) -> None:
    """The step's chain at `rows` and each of its prefixes timed alone, L2 flushed: the
    differences are each kernel's share of the chain's time."""
    specs = chain.step_launches(rows)
    names = [s.kernel.name.replace(f"_{chain.shape.tag()}", "") for s in specs]
    for n in range(1, len(specs) + 1):
        def run(part=specs[:n]):
            for s in part:
                s.launch(ctx.stream)
        us = ctx.cold_median_us(run, reps=20 if ctx.quick else 50)
        ctx.metric(f"moe step chain R={rows}: {' + '.join(names[:n])}", us, "us")


def _report_targets(ctx, rows: int, us: float, row, shape: mk.MoeShape, label: str) -> None:
    if shape.hidden != 5120 or rows not in HUMMING_W4A8:
        return
    h_distinct, h_pair, _ = HUMMING_W4A8[rows]
    h_gbps = h_distinct * shape.checkpoint_expert_bytes() / (h_pair * 1e-6) / 1e9
    ctx.metric(f"moe{label} R={rows}: Humming w13+w2 (anchors.md) {h_pair:.2f} us, "
               f"{h_gbps:.0f} GB/s; ours", us, "us", f"< {h_pair:.1f}", us < h_pair)
    if rows <= 8:
        ctx.metric(f"moe{label} R={rows}: effective bandwidth", row.gbps, "GB/s", ">= 4000",
                   row.gbps >= 4000)
        if row.pct_stream is not None:
            ctx.metric(f"moe{label} R={rows}: % of measured streaming read", row.pct_stream, "%",
                       ">= 90%", row.pct_stream >= 90)
    elif rows <= 64:
        ctx.metric(f"moe{label} R={rows}: effective bandwidth", row.gbps, "GB/s", ">= 3800",
                   row.gbps >= 3800)


def _report_dir(ctx) -> Path:
    """Where the devicecheck report goes: the context's, else scripts/device-run.sh's $OUT
    (default ./devicecheck-out), so the raw timelines land beside report.json."""
    out = getattr(ctx, "out_dir", None)
    return Path(out) if out else Path(os.environ.get("OUT", "devicecheck-out"))
