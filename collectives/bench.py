"""Collectives benchmark for `hopdec devicecheck` (registered as "collectives") or standalone.

What one GPU can show, labelled as such:
- NCCL, world size 1: host cost of one low-level all-reduce call, and its graph-captured
  per-call time (a 1-rank NCCL all-reduce is a copy: a floor for the launch, not TP4 numbers);
- one-shot IPC all-reduce, 4 processes on ONE GPU: host cost per eager call (enqueue only) and
  the per-call time inside a graph of 10 calls. The 4 contexts time-slice the GPU, so this is
  protocol overhead plus context switches, NOT a TP4 latency (that belongs to the TP4 issue).

    python -m collectives.bench --bundle build/bundle-v41-flash-tp4
"""
from __future__ import annotations

import argparse
import json
import sys

from executor.benchmarks import BenchContext, benchmark
from kernels import allreduce_ref as ref

ROWS = (1, 8, 32, 192)
WIDTH = 5120
WORLD = 4


def nccl_world1(ctx: BenchContext, rows_list=ROWS) -> None:
    from collectives.nccl import NcclComm
    from executor.arena import Arena
    from executor.graphs import Graph
    from executor.timing import host_cost_us

    comm = NcclComm.from_unique_id(NcclComm.unique_id(), 0, 1)
    nbytes = max(rows_list) * WIDTH * 2
    try:
        with Arena(ctx.device, [("x", nbytes), ("y", nbytes)]) as arena:
            x, y, s = arena.ptr("x"), arena.ptr("y"), ctx.stream
            for rows in rows_list:
                n = rows * WIDTH

                def call(n=n):
                    comm.all_reduce(x, y, n, "bf16", s.handle)
                us = host_cost_us(call, s.synchronize, batch=100, batches=10)
                ctx.metric(f"NCCL world 1: host cost per low-level all-reduce, {rows} rows", us,
                           "us", "< 10 us", us < 10.0)
                with Graph.capture(s) as g:
                    for _ in range(10):
                        call()
                try:
                    per = ctx.timer.median_us(lambda g=g: g.launch(s), reps=30) / 10
                finally:
                    g.close()
                ctx.metric(f"NCCL world 1 (a copy, 1 GPU): graph per call, {rows} rows", per,
                           "us")
    finally:
        comm.close()


def oneshot_four_processes(ctx: BenchContext, rows_list=ROWS) -> None:
    from collectives import checks
    from collectives.launcher import run_ranks

    bundle = ctx.bundle_with(f"allreduce_oneshot_w{WORLD}_d{WIDTH}")
    if bundle is None:
        raise LookupError(f"no bundle has allreduce_oneshot_w{WORLD}_d{WIDTH}")
    results = run_ranks(checks.oneshot_timings, WORLD, devices=[ctx.device.ordinal] * WORLD,
                        args=(str(bundle.manifest.path.parent), WIDTH, tuple(rows_list)),
                        timeout_s=300)
    bad = [r.describe() for r in results if not r.ok]
    if bad:
        raise RuntimeError("one-shot timing ranks failed: " + "; ".join(bad))
    for rows in rows_list:
        host = max(r.value[rows]["host_us"] for r in results)
        graph = max(r.value[rows]["graph_call_us"] for r in results)
        ctx.metric(f"one-shot, 4 procs on 1 GPU: host cost per eager call, {rows} rows", host,
                   "us", "< 10 us", host < 10.0)
        ctx.metric(f"one-shot, 4 procs on 1 GPU (time-sliced, not TP4): graph per call, "
                   f"{rows} rows", graph, "us")
        ctx.metric(f"  (bus bandwidth at that time, {rows} rows: 1-GPU artefact)",
                   ref.bus_bandwidth_gbps(rows, WIDTH, WORLD, graph), "GB/s")


@benchmark("collectives")
def bench_collectives(ctx: BenchContext) -> None:
    """NCCL world 1 and the one-shot all-reduce with 4 processes on this one GPU."""
    rows = ROWS[:2] if ctx.quick else ROWS
    nccl_world1(ctx, rows)
    oneshot_four_processes(ctx, rows)


def main(argv=None) -> int:
    from executor.benchmarks import result_dicts
    from executor.runtime import Bundle, Device

    parser = argparse.ArgumentParser(prog="python -m collectives.bench",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", required=True, action="append")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    dev = Device(0)
    bundles = {}
    try:
        for path in args.bundle:
            b = Bundle.load(dev, path)
            bundles[b.manifest.config or path] = b
        ctx = BenchContext(dev, dev.stream(), bundles, quick=args.quick)
        try:
            bench_collectives(ctx)
            _, metrics = result_dicts(ctx)
        finally:
            ctx.close()
    finally:
        for b in bundles.values():
            b.close()
        dev.close()
    for m in metrics:
        ok = "-" if m["ok"] is None else ("yes" if m["ok"] else "NO")
        print(f"{m['metric']:78s} {m['value']:>10.3f} {m['unit']:5s} {m['target']:>8s} {ok}")
    print(json.dumps(metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
