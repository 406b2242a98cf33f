"""The whole decode step and the DSpark round across GPUs: TP4, one process per H200 (issue 11).

    hopdec devicecheck --only step_tp --bundle build/bundle-v41-bench-step-tp4 ...   # 4 GPUs
    HOPDEC_TP_DEVICES=0,1,2,3 HOPDEC_STEP_CASES=1x4k,6x4k HOPDEC_ROUND_CASES=c1x4k,c8x4k ...

Each rank is a spawned process on its own GPU (`collectives.launcher.run_ranks`) holding what
the one-GPU benchmarks hold for rank 0 (executor/bench_step.py, executor/bench_round.py:
`bench_config`, synthetic weights of the rank's own shard, 40 layers over 8 representatives'
bytes, tiled experts, synthetic KV), wired on `executor.stages.collectives` instead of the local
stand-ins: every all-reduce, the Engram all-gather and the argmax pick, and in the round the
Markov steps' picks, are the one-shot kernels across the four GPUs. So the times here include
the collectives and the ranks' skew, which the one-GPU benchmarks' "+ AR" column only adds up.

Per rank, case and context, after a barrier (ranks wait on each other at every collective, so
their medians differ only by the tail; the table gives the slowest rank's):
- step: the step graph with PDL and without (and without it into or out of the cross-rank
  launches), CUDA-event medians of bs.GRAPH_REPS replays queued back to back, after an eager
  pass counting the routers' distinct experts (bs.run_context, as the one-GPU step benchmark);
- round: the draft and verify graphs each alone on host-loaded rows (as bench_round), and
  br.ROUND_REPS sync-free rounds back to back (draft_sf then verify_sf): with the real picks the
  rows walk at whatever acceptance the synthetic weights give (reported), so this is the round
  an engine replays.
Every whole step, verify and draft graph is captured as the Executor captures it: through
`Plan.record` with the plan's side stages on the rank's second stream (executor/branches.py,
`DeviceStep.capture`); the PDL variants are relaunches applied as record enqueues.
Checked: every rank holds the same tokens (the pick's contract), no non-finite hidden state, no
collective timed out. Run alone (`--only step_tp`): each rank holds ~85 GB of its GPU.
"""
from __future__ import annotations

import os
import statistics
import time
from types import SimpleNamespace

from executor import bench_round as br
from executor import bench_step as bs

DEVICES_VARIABLE = "HOPDEC_TP_DEVICES"
TIMEOUT_S = 540.0


def cross_rank_modules(modules) -> tuple[str, ...]:
    """`modules` with the local stand-ins replaced by the real cross-rank stages."""
    local, real = "executor.stages.local_collectives", "executor.stages.collectives"
    if local not in modules:
        raise ValueError(f"stage modules {list(modules)}: expected {local} to replace")
    return tuple(real if m == local else m for m in modules)


STEP_MODULES = cross_rank_modules(bs.BENCH_MODULES)
ROUND_MODULES = cross_rank_modules(br.ROUND_MODULES)


def skip_reason(devices: tuple[int, ...]) -> str | None:
    if len(devices) != bs.TP or len(set(devices)) != bs.TP:
        return f"needs {bs.TP} distinct GPUs (one rank each), got {list(devices)}"
    return None


class _NoPdlAfterCrossRank:
    """relaunch: the launch recorded right after a cross-rank launch loses its PDL attribute.
    Plan.record enqueues in stage order (side stages on their own stream, but none follows a
    cross-rank stage), so "after" is the next launch of the flat list. Stateful: one per capture."""

    def __init__(self):
        self.after_cross = False

    def __call__(self, spec):
        out = bs.no_pdl(spec) if self.after_cross else spec
        self.after_cross = br.is_cross_rank(spec)
        return out


def _no_pdl_into_cross_rank(spec):
    return bs.no_pdl(spec) if br.is_cross_rank(spec) else spec


def pdl_relaunches() -> dict:
    """The step graph four ways, as relaunches for Plan.record (fresh ones for each case's
    captures): PDL on every edge ("pdl"), on none ("plain"), on every edge but into the
    cross-rank launches ("ar_plain": an all-reduce starts only when the kernel before it has
    finished) or but out of them ("after_ar_plain")."""
    return {**bs.STEP_RELAUNCHES, "ar_plain": _no_pdl_into_cross_rank,
            "after_ar_plain": _NoPdlAfterCrossRank()}


# ---- one rank (a spawned process) -------------------------------------------------------------

def tp_rank(ctx, bundle_dir: str, step_cases, rounds) -> dict:
    """Rank ctx.rank on GPU ctx.device: the step cases, then the round cases; per-case times."""
    import cupy as cp

    from collectives.oneshot import OneShotAllReduce
    from executor.runtime import Bundle, Device
    from executor.timing import EventTimer

    cfg = bs.bench_config()
    dev = Device(ctx.device)                    # primary context current before CuPy touches it
    try:
        cp.cuda.Device(ctx.device).use()
        bundle = Bundle.load(dev, bundle_dir)
        stream = dev.stream()
        site = SimpleNamespace(device=dev, stream=stream,
                               timer=EventTimer(stream, max_reps=bs.GRAPH_REPS))
        ar = OneShotAllReduce(bundle, ctx.rank, ctx.world, cfg.hidden_size, ctx.exchange)
        try:
            out = {"step": _step_cases(ctx, site, cfg, bundle, ar, step_cases) if step_cases
                   else [],
                   "round": _round_cases(ctx, site, cfg, bundle, ar, rounds) if rounds else []}
            ar.raise_if_failed()
            return out
        finally:
            ctx.barrier()                       # nobody frees a buffer a peer may still read
            ar.close()
            site.timer.close()
            bundle.close()
    finally:
        dev.close()


def _step_cases(ctx, site, cfg, bundle, ar, cases) -> list[dict]:
    t0 = time.perf_counter()
    dev = bs.DeviceStep(site, cfg, bundle, STEP_MODULES, rank=ctx.rank,
                        collectives=ar.state())
    results = []
    try:
        for case, contexts in cases:
            launches = bs.case_launches(cfg, dev, case.rows)
            graphs = {}
            try:
                bs.capture_step(dev, case.rows, pdl_relaunches(), graphs)
                for context in contexts:
                    run = bs.run_context(dev, site.timer, case, context, launches, graphs,
                                         sync=ctx.barrier)
                    results.append({
                        "rows": case.rows, "context": context, "us": run.times,
                        "distinct": statistics.mean(run.distinct), "bytes": run.nbytes,
                        "nonfinite": dev.nonfinite(case.rows),
                        "tokens": dev.tensors["tokens"][:case.rows].get().tolist()})
            finally:
                bs.close_graphs(graphs)
    finally:
        dev.close()
    results.append({"wall_s": time.perf_counter() - t0, "pack_s": dev.pack_s})
    return results


def _round_cases(ctx, site, cfg, bundle, ar, rounds) -> list[dict]:
    dev = br.DeviceRound(site, cfg, bundle, rounds, ROUND_MODULES, rank=ctx.rank,
                         collectives=ar.state())
    results = []
    try:
        for case, contexts in rounds:
            rows = br.plan_rows(case)
            built = {name: dev.plans[name].launches(rows[name]) for name in rows}
            graphs = {}
            try:
                br.capture_plans(dev, rows, graphs)
                for context in contexts:
                    ctx.barrier()
                    times, distinct = br._time_halves(site, dev, case, context, graphs, built)
                    dev.load(case.verify, context)
                    graphs["verify_sf"].launch(site.stream)    # the rows are the draft's now
                    ctx.barrier()
                    b2b = br._time_round(site.stream, {"draft": graphs["draft_sf"],
                                                       "verify": graphs["verify_sf"]},
                                         br.ROUND_REPS, br.WARMUP_ROUNDS)
                    accepted = dev.tensors["accepted"][:case.seqs].get()
                    results.append({
                        "seqs": case.seqs, "context": context, "us": times,
                        "b2b": b2b, "accepted": accepted.tolist(),
                        "distinct": {n: statistics.mean(v) for n, v in distinct.items()},
                        "tokens": dev.tensors["tokens"][:case.verify.rows].get().tolist()})
            finally:
                bs.close_graphs(graphs)
    finally:
        dev.close()
    return results


# ---- the parent (devicecheck family "step_tp") --------------------------------------------------

def aggregate(values: list[dict], kind: str) -> list[dict]:
    """Per case over the ranks: the slowest rank's times, rank 0's counts, whether every rank
    holds the same tokens, the worst non-finite count."""
    per_rank = [[c for c in v[kind] if "context" in c] for v in values]
    if len({len(cases) for cases in per_rank}) != 1:
        raise ValueError(f"{kind}: the ranks ran different case counts "
                         f"{[len(c) for c in per_rank]}")
    out = []
    for cases in zip(*per_rank):
        first = dict(cases[0])
        first["us"] = {k: max(c["us"][k] for c in cases) for k in first["us"]}
        if "b2b" in first:
            first["b2b"] = {k: max(c["b2b"][k] for c in cases) for k in first["b2b"]}
        first["ranks_agree"] = all(c["tokens"] == first["tokens"] for c in cases)
        first["nonfinite"] = max(c.get("nonfinite", 0) for c in cases)
        out.append(first)
    return out


def step_table(rows: list[dict]) -> str:
    head = (f"{'R':>4s} {'ctx':>4s} {'TP4 us':>9s} {'no-PDL':>9s} {'AR noPDL':>9s} "
            f"{'after AR':>9s} {'GB r0':>6s} {'%4.8':>5s} "
            f"{'floor us':>8s} {'target':>7s} {'experts':>7s} {'tokens':>7s}")
    lines = [("whole step across 4 GPUs (one process per rank, one-shot collectives; slowest "
              "rank's median; no-PDL: no PDL edge; AR noPDL: none into the cross-rank launches; "
              "after AR: none out of them; GB r0: rank 0's bytes that must be read)"), head]
    for r in rows:
        us, floor = r["us"]["pdl"], r["bytes"] / bs.HBM_BYTES_PER_S * 1e6
        target = bs.TARGET_MS.get(r["rows"])
        lines.append(f"{r['rows']:>4d} {bs._context_label(r['context']):>4s} {us:>9.1f} "
                     f"{r['us']['plain']:>9.1f} {r['us'].get('ar_plain', 0.0):>9.1f} "
                     f"{r['us'].get('after_ar_plain', 0.0):>9.1f} {r['bytes'] / 1e9:>6.2f} "
                     f"{100 * floor / us:>5.1f} {floor:>8.1f} "
                     f"{f'{target * 1e3:.0f}' if target else '-':>7s} {r['distinct']:>7.1f} "
                     f"{'agree' if r['ranks_agree'] else 'DIFFER':>7s}")
    return "\n".join(lines)


def round_table(rows: list[dict]) -> str:
    head = (f"{'c':>3s} {'ctx':>4s} {'round':>9s} {'verify':>9s} {'draft':>8s} {'b2b round':>9s} "
            f"{'accepted':>8s} {'tok/s/seq':>9s} {'PR us':>6s} {'PR tok/s':>8s} {'tokens':>7s}")
    lines = [(f"DSpark round across 4 GPUs (round = verify + draft, each alone on random rows; "
             f"b2b: {br.ROUND_REPS} sync-free rounds back to back with the real picks; tok/s/seq "
             f"at {br.UPSTREAM_AL} tokens a round over the b2b round; PR: the upstream PR's "
             f"median ITL, 4 x H200)"), head]
    for r in rows:
        label = bs._context_label(r["context"])
        pr = br.UPSTREAM_ITL_MS.get((r["seqs"], label))
        b2b = r["b2b"]["round"]
        lines.append(
            f"{'c' + str(r['seqs']):>3s} {label:>4s} {r['us']['round']:>9.1f} "
            f"{r['us']['verify']:>9.1f} {r['us']['draft']:>8.1f} {b2b:>9.1f} "
            f"{statistics.mean(r['accepted']):>8.2f} "
            f"{br.tokens_per_s(br.UPSTREAM_AL, b2b):>9.0f} "
            f"{f'{pr * 1e3:.0f}' if pr else '-':>6s} "
            f"{f'{br.tokens_per_s(br.UPSTREAM_AL, pr * 1e3):.0f}' if pr else '-':>8s} "
            f"{'agree' if r['ranks_agree'] else 'DIFFER':>7s}")
    return "\n".join(lines)


def bench_step_tp(ctx) -> None:
    """devicecheck family "step_tp": the step and the round across 4 GPUs (see the docstring);
    one skipped line with fewer GPUs."""
    from collectives.launcher import run_ranks
    from collectives.multi import resolve_devices, visible_gpus

    devices = resolve_devices(os.environ.get(DEVICES_VARIABLE), visible_gpus())
    reason = skip_reason(devices)
    if reason is not None:
        ctx.metric(f"step_tp: skipped: {reason}", float(len(devices)), "GPUs")
        return
    cfg = bs.bench_config()
    step_cases = bs.selected_cases(quick=ctx.quick)
    rounds = br.selected_rounds(cfg.dspark_block_size)
    bundle = bs.find_bundle(ctx, cfg)
    t0 = time.perf_counter()
    results = run_ranks(tp_rank, bs.TP, devices=devices, timeout_s=TIMEOUT_S,
                        args=(str(bundle.manifest.path.parent), step_cases, rounds))
    failed = [r.describe() for r in results if not r.ok]
    if failed:
        raise RuntimeError("step_tp: rank(s) failed:\n" + "\n".join(failed))
    values = [r.value for r in results]
    ctx.metric("step_tp: wall time (4 processes: pack, upload, capture, time)",
               time.perf_counter() - t0, "s")
    steps, round_rows = aggregate(values, "step"), aggregate(values, "round")
    for r in steps:
        tag = bs.case_tag("step_tp", r["rows"], r["context"])
        target = bs.TARGET_MS.get(r["rows"])
        ctx.bandwidth("step graph (TP4, 4 GPUs)", tag.removeprefix("step_tp "), r["rows"],
                      r["us"]["pdl"], r["bytes"])
        ctx.metric(f"{tag}: graph, slowest rank", r["us"]["pdl"], "us",
                   f"<= {target * 1e3:.0f}" if target else "",
                   r["us"]["pdl"] <= target * 1e3 if target else None)
        for name, what in (("plain", "without PDL"), ("ar_plain", "no PDL into all-reduces"),
                           ("after_ar_plain", "no PDL out of all-reduces")):
            ctx.metric(f"{tag}: graph {what}, slowest rank", r["us"][name], "us")
        ctx.metric(f"{tag}: every rank holds the same tokens", float(r["ranks_agree"]), "", "1",
                   r["ranks_agree"])
        ctx.metric(f"{tag}: non-finite hidden values (worst rank)", r["nonfinite"], "", "0",
                   r["nonfinite"] == 0)
    for r in round_rows:
        tag = f"round_tp c{r['seqs']} ctx={bs._context_label(r['context'])}"
        for name in ("round", "verify", "draft"):
            ctx.metric(f"{tag}: {name} graph, slowest rank", r["us"][name], "us")
        ctx.metric(f"{tag}: sync-free round back to back, slowest rank", r["b2b"]["round"], "us")
        ctx.metric(f"{tag}: accepted drafts (mean over sequences, last round)",
                   statistics.mean(r["accepted"]), "")
        ctx.metric(f"{tag}: every rank holds the same tokens", float(r["ranks_agree"]), "", "1",
                   r["ranks_agree"])
    print(step_table(steps) + "\n\n" + round_table(round_rows), flush=True)
