"""Collectives benchmark for `hopdec devicecheck` (registered as "collectives") or standalone.

What one GPU can show, labelled as such:
- NCCL, world size 1: host cost of one low-level all-reduce call, and its graph-captured
  per-call time (a 1-rank NCCL all-reduce is a copy: a floor for the launch, not TP4 numbers);
- one-shot kernel, one rank whose peers have "already arrived" (local buffers pre-filled): the
  kernel's own cost without NVLink or waiting, a floor for TP4;
- one-shot IPC all-reduce, 4 processes on ONE GPU: host cost per eager call (enqueue only) and
  the per-call time inside a graph of 10 calls. The 4 contexts time-slice the GPU, so this is
  protocol overhead plus context switches, NOT a TP4 latency (that belongs to the TP4 issue).

    python -m collectives.bench --bundle build/bundle-v41-flash-tp4
"""
from __future__ import annotations

import argparse
import json
import sys

from executor.benchmarks import BenchContext
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


def oneshot_single_rank_floor(ctx: BenchContext, rows_list=ROWS) -> None:
    """Rank 0 of 4 with every peer "already arrived": the 4 receive buffers are local and each
    replay first copies data into the other ranks' slots of both generations. The kernel's own
    cost (push 4 copies, read 4 slots, reset, write) without NVLink or waiting: a floor for
    TP4, measured as graph(copies + all-reduce) - graph(copies)."""
    import ctypes

    from executor.arena import Arena
    from executor.cuda import check, driver
    from executor.graphs import Graph
    from executor.launch import LaunchSpec

    cu = driver()
    spec = ref.make_spec(WORLD, WIDTH)
    bundle = ctx.bundle_with(spec.name)
    if bundle is None:
        raise LookupError(f"no bundle has {spec.name}")
    kernel = bundle.kernel(spec.name)
    row_bytes = max(rows_list) * WIDTH * 2
    reqs = [(f"buf{r}", spec.buffer_bytes) for r in range(WORLD)]
    reqs += [("state", 256), ("status", 64), ("inp", row_bytes), ("out", row_bytes),
             ("src", row_bytes)]
    with Arena(ctx.device, reqs) as arena:
        for r in range(WORLD):
            check(cu.cuMemsetD16(arena.ptr(f"buf{r}"), ref.SENTINEL_BITS, spec.buffer_bytes // 2))
        check(cu.cuMemsetD32(arena.ptr("state"), 0, 64))
        check(cu.cuMemsetD32(arena.ptr("status"), 0, 16))
        check(cu.cuMemsetD16(arena.ptr("inp"), 0x3F80, row_bytes // 2))   # bf16 1.0
        check(cu.cuMemsetD16(arena.ptr("src"), 0x4000, row_bytes // 2))   # bf16 2.0
        table = (ctypes.c_uint64 * WORLD)(*[arena.ptr(f"buf{r}") for r in range(WORLD)])
        check(cu.cuMemcpyHtoD(arena.ptr("state"), table, 8 * WORLD))
        check(cu.cuCtxSynchronize())
        s = ctx.stream
        for rows in rows_list:
            n = rows * WIDTH * 2
            launch = LaunchSpec(kernel, spec.grid(rows),
                                (arena.ptr("inp"), arena.ptr("out"), arena.ptr("state"),
                                 arena.ptr("state") + 128, arena.ptr("status"), 0, rows,
                                 100_000))

            def fill(n=n):
                for g in range(2):
                    for src in range(1, WORLD):
                        check(cu.cuMemcpyDtoDAsync(arena.ptr("buf0") + spec.slot_offset(g, src),
                                                   arena.ptr("src"), n, s.cu_handle))
            times = {}
            for with_ar in (False, True):
                with Graph.capture(s) as g:
                    for _ in range(10):
                        fill()
                        if with_ar:
                            launch.launch(s)
                try:
                    times[with_ar] = ctx.timer.median_us(lambda g=g: g.launch(s), reps=30) / 10
                finally:
                    g.close()
            us = times[True] - times[False]
            ctx.metric(f"one-shot kernel, 1 rank, peers pre-arrived (floor): {rows} rows", us,
                       "us")
            ctx.bandwidth(spec.name, f"{rows} floor", rows, us, spec.bytes_moved(rows))
        status = (ctypes.c_uint32 * 4)()
        check(cu.cuMemcpyDtoH(status, arena.ptr("status"), 16))
        out = (ctypes.c_uint16 * (max(rows_list) * WIDTH))()
        check(cu.cuMemcpyDtoH(out, arena.ptr("out"), ctypes.sizeof(out)))
        if any(status) or any(v != 0x40E0 for v in out):       # 1 + 2 + 2 + 2 = bf16 7.0
            raise RuntimeError(f"single-rank floor: wrong result or a timeout ({list(status)})")


def bench_collectives(ctx: BenchContext) -> None:
    """NCCL world 1 and the one-shot all-reduce with 4 processes on this one GPU."""
    rows = ROWS[:2] if ctx.quick else ROWS
    nccl_world1(ctx, rows)
    oneshot_single_rank_floor(ctx, rows)
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
            bw, metrics = result_dicts(ctx)
        finally:
            ctx.close()
    finally:
        for b in bundles.values():
            b.close()
        dev.close()
    for r in bw:
        print(f"{r['kernel']:40s} {r['case']:>10s} {r['us']:>9.2f} us {r['bytes']:>10d} B "
              f"{r['gbps']:>7.0f} GB/s {r['pct_hbm']:>5.1f} %HBM")
    for m in metrics:
        ok = "-" if m["ok"] is None else ("yes" if m["ok"] else "NO")
        print(f"{m['metric']:78s} {m['value']:>10.3f} {m['unit']:5s} {m['target']:>8s} {ok}")
    print(json.dumps(metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
