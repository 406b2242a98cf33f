"""Devicecheck benchmarks of the dense W8A16, grouped wo_a and lm_head kernels, Humming beside them.

Registered into `executor.benchmarks.BENCHMARKS` on import (devicecheck must import this module).
Per shape and R in {1, 5, 6, 8, 17, 48, 192} (quick: 1, 6, 8, 192): the kernel the step picks
(8 rows per pass at R <= 8, 32 above; shown with `*`) and, at R <= 8, every candidate variant the
bundle holds beside it (dense_ref.candidate_specs), timed
- isolated: one launch, L2 flushed before each rep (CUDA-event median);
- in a PDL chain: a graph of CHAIN launches, each on another copy of the weights (copies cover at
  least 3x the L2, so weights come from HBM), with the programmatic-serialization attribute, so
  each kernel's weight prefetch (issued before `griddepcontrol.wait`) overlaps its predecessor's
  tail; per-launch time = graph time / CHAIN.
Bytes are the kernel's must-read/write bytes (weights + scales + x + out), % is of 4.8 TB/s.
Humming W8A16 / cuBLAS lm_head numbers are `docs/anchors.md` table 3c (same H200 model, graphs).

Round 5 chain diagnostics (`_diagnose_chain`, the step's R <= 8 kernels at R = 1): why a streamed
launch costs ~3-4 us more than its bytes inside the chain. Cases beside "R1 pdl":
- "R1 pdl-l2": the chain on ONE weight copy (L2-resident after the first launch): what is left
  when HBM is not the limit (residency, hand-off, compute after the wait);
- "R1 nopdl": the chain without the PDL attribute (no overlap at all);
- "R1 pdl+probe": each launch followed by the 132-CTA chain-step probe (no smem, triggers at entry),
  as in the step where small kernels sit between the linears; per pair;
- "... carve100": the same with CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 100 on both
  kernels (the SM keeps its largest smem split, so a kernel of another split never has to wait
  for the SM to drain); restored to the default (-1) afterwards;
and the metric "CTAs per SM" (cuOccupancyMaxActiveBlocksPerMultiprocessor) under both carveouts:
two are needed for the next launch's CTAs to stream beside ours.
"""
from __future__ import annotations

import os

from executor.arena import Arena
from executor.benchmarks import MB, BenchContext, fill_random_bf16, fill_random_u32
from executor.cuda import check, driver
from executor.graphs import Graph
from executor.launch import LaunchSpec
from executor.launches.dense import dense_launch, lm_head_launch

ROWS = (1, 5, 6, 8, 17, 48, 192)
QUICK_ROWS = (1, 6, 8, 192)
# Narrow run (a short device call): only these layers (comma-separated `_label`s, e.g.
# "wqa_wkv,wq_b,wo_a"), at R = 1 and 6, in the PDL chain and isolated, no R = 1 diagnostics.
LABELS_ENV = "HOPDEC_DENSE_LABELS"
NARROW_ROWS = (1, 6)
CHAIN = 16
# anchors.md 3c: Humming W8A16 (and cuBLAS bf16 lm_head) CUDA-graph median µs per M.
HUMMING_US = {
    "wqa_wkv": {1: 9.50, 6: 9.55, 8: 9.58, 32: 11.42, 192: 18.53},
    "wq_b": {1: 11.53, 6: 11.48, 8: 12.11, 32: 14.04, 192: 18.49},
    "wo_b": {1: 10.90, 6: 11.01, 8: 11.05, 32: 12.73, 192: 18.52},
    "shared_w13": {1: 9.40, 6: 9.42, 8: 9.44, 32: 11.05, 192: 17.54},
    "shared_w2": {1: 5.26, 6: 5.27, 8: 5.27, 32: 5.31, 192: 12.62},
    "lm_head": {1: 81.61, 6: 83.89, 8: 84.30, 32: 84.41, 192: 102.13},
}
# The epilogues measured: bf16 everywhere (executor/stages/attn_proj.py: the reference rounds each
# rank's partial to bf16 before the all-reduce), and the shared expert's fused ones beside its
# bf16 kernels (executor/stages/ffn.py SHARED_EXPERT_FUSED: w1|w3 + SwiGLU, w2 + routed sum).
PLAN_EPILOGUES: dict[str, tuple[str, ...]] = {"shared_w13": ("bf16", "swiglu"),
                                              "shared_w2": ("bf16", "add_f32")}


def _label(spec) -> str:
    if spec.name.startswith("wo_a"):
        return "wo_a"
    return spec.name.removeprefix("dense_w8a16_").split("_n")[0]


def _shown_name(spec) -> str:
    """The kernel's name and variant; `*` marks the one the step picks at its row count (the
    plain name; of the shared expert's, the fused epilogue's)."""
    from executor.stages.ffn import SHARED_EPILOGUES
    step = "*" if spec.name.endswith(f"_{spec.epilogue}") else ""
    if _label(spec) in SHARED_EPILOGUES and spec.epilogue != SHARED_EPILOGUES[_label(spec)]:
        step = ""
    return f"{spec.name} [{spec.variant}{step}]"


def _copies(weight_bytes: int, l2_bytes: int) -> int:
    return max(2, -(-3 * l2_bytes // weight_bytes))


def _time_both(ctx: BenchContext, launches: list[LaunchSpec], reps: int) -> tuple[float, float]:
    """(isolated cold µs of launches[0], per-launch µs inside a PDL graph of CHAIN launches)."""
    iso = ctx.cold_median_us(lambda: launches[0].launch(ctx.stream), reps=reps)
    with Graph.capture(ctx.stream) as g:
        for i in range(CHAIN):
            launches[i % len(launches)].launch(ctx.stream)
    try:
        chain = ctx.timer.median_us(lambda: g.launch(ctx.stream), reps=20, warmup=2) / CHAIN
    finally:
        g.close()
    return iso, chain


def _report(ctx: BenchContext, name: str, label: str, rows: int, nbytes: int, weight_bytes: int,
            iso: float, chain: float, target_pct: float | None) -> None:
    """Bandwidth rows; the Humming and target metrics for the kernel the step uses only."""
    ctx.bandwidth(name, f"R{rows} iso", rows, iso, nbytes)
    row = ctx.bandwidth(name, f"R{rows} pdl", rows, chain, nbytes)
    if name.endswith("]") and not name.endswith("*]"):
        return                                          # a candidate: side by side only
    humming = HUMMING_US.get(label, {}).get(rows)
    if humming is not None:
        ctx.metric(f"{label} R={rows}: Humming {humming:.2f} us / ours (pdl chain)",
                   humming / chain, "x", "> 1", humming / chain > 1.0)
    if target_pct is not None and rows <= 8 and weight_bytes >= 8 * MB:
        ctx.metric(f"{name} R={rows} pdl chain % of 4.8 TB/s", row.pct_hbm, "%",
                   f">= {target_pct:.0f}%", row.pct_hbm >= target_pct)


CARVEOUT_MAX, CARVEOUT_DEFAULT = 100, -1


def _carveout(kernels, percent: int) -> None:
    cu = driver()
    attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    for k in kernels:
        check(cu.cuFuncSetAttribute(k.function, attr, percent),
              call=f"cuFuncSetAttribute[{k.name}, carveout {percent}]")


def _ctas_per_sm(kernel) -> int:
    threads = kernel.block[0] * kernel.block[1] * kernel.block[2]
    return int(check(driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(
        kernel.function, threads, kernel.smem_bytes)))


def _chain_us(ctx: BenchContext, sequence: list[LaunchSpec], per: int) -> float:
    """µs per `per` launches of a PDL graph of `sequence` (CHAIN launches)."""
    with Graph.capture(ctx.stream) as g:
        for launch in sequence:
            launch.launch(ctx.stream)
    try:
        return ctx.timer.median_us(lambda: g.launch(ctx.stream), reps=20, warmup=2) * per \
            / len(sequence)
    finally:
        g.close()


def _diagnose_chain(ctx: BenchContext, bundle, spec, launches: list[LaunchSpec],
                    no_pdl: list[LaunchSpec], rows: int) -> None:
    """The round-5 chain cases of the module docstring for one step kernel."""
    from kernels import probes_ref as pr
    probe_bundle = ctx.bundle_with(pr.CHAIN_STEP.name)
    name, nbytes = _shown_name(spec), spec.bytes_moved(rows)
    ctx.bandwidth(name, f"R{rows} pdl-l2", rows, _chain_us(ctx, [launches[0]] * CHAIN, 1),
                  nbytes)
    ctx.bandwidth(name, f"R{rows} nopdl", rows,
                  _chain_us(ctx, [no_pdl[i % len(no_pdl)] for i in range(CHAIN)], 1), nbytes)
    kernels = [launches[0].kernel]
    if probe_bundle is not None:
        with Arena(ctx.device, [("counter", 4)]) as counter:
            probe = LaunchSpec(probe_bundle.kernel(pr.CHAIN_STEP.name), (ctx.device.sm_count,),
                               (counter.ptr("counter"),), pdl=True)
            kernels.append(probe.kernel)
            pairs = [x for i in range(CHAIN // 2) for x in (launches[i % len(launches)], probe)]
            for carve in (CARVEOUT_DEFAULT, CARVEOUT_MAX):
                tag = "" if carve == CARVEOUT_DEFAULT else " carve100"
                _carveout(kernels, carve)
                try:
                    ctx.metric(f"{spec.name}: CTAs per SM (carveout {carve})",
                               _ctas_per_sm(launches[0].kernel), "CTAs", ">= 2")
                    ctx.bandwidth(name, f"R{rows} pdl+probe{tag}", rows,
                                  _chain_us(ctx, pairs, 2), nbytes)
                    if carve == CARVEOUT_MAX:
                        ctx.bandwidth(name, f"R{rows} pdl{tag}", rows, _chain_us(
                            ctx, [launches[i % len(launches)] for i in range(CHAIN)], 1), nbytes)
                finally:
                    _carveout(kernels, CARVEOUT_DEFAULT)


def narrow(specs, labels: str) -> list:
    """The specs of the comma-separated layer labels (LABELS_ENV); all of them when empty."""
    only = [x for x in labels.split(",") if x]
    if not only:
        return list(specs)
    out = [s for s in specs if _label(s) in only]
    if not out:
        raise LookupError(f"{LABELS_ENV}={labels!r} selects no dense kernel of the bundle")
    return out


def _dense_specs(bundle):
    from kernels import dense_qgmma_ref as qr
    from kernels import dense_ref as dr
    out = []
    for name in bundle.names():
        rec = bundle.manifest.kernels[name]
        if rec.family not in ("kernels.dense", "kernels.wo_a", "kernels.dense_qgmma"):
            continue
        # the QGMMA candidates (`_sqg`, round 9) are timed beside the step's kernel of their layer
        cls = qr.QgSpec if rec.family == "kernels.dense_qgmma" else dr.DenseSpec
        spec = cls.from_dict(rec.spec)
        if spec.timeline:                 # stamps: executor/dense_timeline.py measures those
            continue
        if spec.epilogue in PLAN_EPILOGUES.get(_label(spec), ("bf16",)):
            out.append(spec)
    return out


def _for_rows(variants, rows: int):
    """Every variant that takes `rows` rows: 8 rows per pass at R <= 8, else 32 (all variants of
    a kind, so candidates are measured side by side)."""
    return [s for s in variants if s.row_tiles == (1 if rows <= 8 else 4)]


def bench_dense(ctx: BenchContext) -> None:
    """Every W8A16 linear and wo_a of the bundle at every R, isolated and in a PDL chain."""
    from kernels import dense_ref as dr

    bundle = ctx.bundle_with("dense_w8a16_")
    if bundle is None:
        raise LookupError("no bundle has dense_w8a16 kernels")
    only = os.environ.get(LABELS_ENV, "")
    specs = narrow(_dense_specs(bundle), only)
    row_set = NARROW_ROWS if only else (QUICK_ROWS if ctx.quick else ROWS)
    shapes = sorted({(s.groups, s.n, s.k) for s in specs})
    for groups, n, k in shapes:
        variants = [s for s in specs if (s.groups, s.n, s.k) == (groups, n, k)]
        wbytes = groups * n * k
        sbytes = groups * (n // 32) * (k // 32)
        copies = _copies(wbytes, ctx.device.info.l2_bytes)
        reqs = [(f"w{c}", wbytes) for c in range(copies)] + [(f"s{c}", sbytes)
                                                             for c in range(copies)]
        reqs += [("x", dr.MAX_ROWS * groups * k * 2), ("out", dr.MAX_ROWS * groups * n * 4),
                 ("res", dr.MAX_ROWS * groups * n * 4),
                 ("ws", max([v.workspace_bytes() for v in variants] + [4])),
                 ("cnt", max([v.counters_bytes() for v in variants] + [4]))]
        with Arena(ctx.device, reqs) as a:
            for c in range(copies):
                fill_random_u32(a, f"w{c}")                  # random e4m3 bytes (some NaN codes:
                a.view(f"s{c}", "uint8")[:] = 118            # timing only, values unused)
            fill_random_bf16(a, "x")
            fill_random_bf16(a, "res")                   # bf16 residual / f32 routed sum
            a.view("cnt", "uint32")[:] = 0
            for rows in row_set:
                def launch_ptrs(c):
                    return {"x": a.ptr("x"), "weight": a.ptr(f"w{c}"), "scales": a.ptr(f"s{c}"),
                            "residual": a.ptr("res"), "out": a.ptr("out"),
                            "workspace": a.ptr("ws"), "counters": a.ptr("cnt")}
                for spec in _for_rows(variants, rows):
                    launches = [dense_launch(bundle, spec, launch_ptrs(c), rows)
                                for c in range(copies)]
                    iso, chain = _time_both(ctx, launches, reps=30 if ctx.quick else 60)
                    _report(ctx, _shown_name(spec), _label(spec), rows, spec.bytes_moved(rows),
                            spec.weight_bytes(), iso, chain, 80.0)
                    if rows == 1 and spec.streamed and not only:
                        no_pdl = [dense_launch(bundle, spec, launch_ptrs(c), rows, pdl=False)
                                  for c in range(copies)]
                        try:                     # diagnostics must not cost the family table
                            _diagnose_chain(ctx, bundle, spec, launches, no_pdl, rows)
                        except Exception as exc:  # noqa: BLE001 - reported as a metric
                            ctx.metric(f"{spec.name}: chain diagnostics failed: {exc!r}"[:200],
                                       0.0, "", "runs", False)


def bench_lm_head(ctx: BenchContext) -> None:
    """lm_head + split-vocab argmax (and the logits path) at every R, isolated and PDL-chained."""
    from kernels import lm_head_ref as lr

    bundle = ctx.bundle_with("lm_head_bf16_")
    if bundle is None:
        raise LookupError("no bundle has lm_head kernels")
    recs = [bundle.manifest.kernels[n] for n in bundle.names() if n.startswith("lm_head_bf16_")]
    specs = [lr.spec_from_dict(r.spec) for r in recs]
    any_spec = specs[0]
    wbytes = any_spec.weight_bytes()
    copies = _copies(wbytes, ctx.device.info.l2_bytes)
    reqs = [(f"w{c}", wbytes) for c in range(copies)]
    reqs += [("x", lr.MAX_ROWS * any_spec.hidden * 2), ("out", lr.MAX_ROWS * any_spec.vocab * 4),
             ("keys", lr.MAX_ROWS * 8), ("cnt", max(s.counters_bytes() for s in specs))]
    with Arena(ctx.device, reqs) as a:
        for c in range(copies):
            fill_random_bf16(a, f"w{c}")
        fill_random_bf16(a, "x")
        a.view("keys", "uint64")[:] = 0
        a.view("cnt", "uint32")[:] = 0
        for mode in ("argmax", "logits"):
            for rows in (QUICK_ROWS if ctx.quick else ROWS):
                if mode == "logits" and rows not in (1, 8, 48):
                    continue
                for spec in _for_rows([s for s in specs if s.mode == mode], rows):
                    launches = [lm_head_launch(bundle, spec,
                                               {"x": a.ptr("x"), "weight": a.ptr(f"w{c}"),
                                                "out": a.ptr("out"), "keys": a.ptr("keys"),
                                                "counters": a.ptr("cnt")}, rows, 0)
                                for c in range(copies)]
                    iso, chain = _time_both(ctx, launches, reps=20 if ctx.quick else 40)
                    _report(ctx, spec.name, "lm_head" if mode == "argmax" else "", rows,
                            spec.bytes_moved(rows), wbytes, iso, chain,
                            85.0 if mode == "argmax" else None)
