"""Device benchmarks for `hopdec devicecheck`: a registry of functions, each adding report rows.

Adding a benchmark is one registration:

    @benchmark("rmsnorm")
    def bench_rmsnorm(ctx: BenchContext) -> None:
        ...
        ctx.bandwidth(kernel, case, rows, median_us, bytes_moved)   # or ctx.metric(...)

Bandwidth rows are reported against physics: bytes that must move / 4.8 TB/s, and against the
best streaming read measured on this device (the `stream_read` benchmark runs first and sets it).
Device times are CUDA-event medians with the L2 flushed between reps (cold inputs); host times are
perf_counter medians over batches.
"""
from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from executor.arena import Arena
from executor.cuda import check, driver
from executor.graphs import Graph, GraphSet
from executor.launch import LaunchSpec
from executor.nvtx_ranges import Ranges
from executor.timing import EventTimer, L2Flusher, host_cost_us
from kernels import probes_ref as pr

HBM_BYTES_PER_S = 4.8e12
MB = 1 << 20


@dataclass(frozen=True)
class BandwidthRow:
    kernel: str
    case: str
    rows: int
    us: float
    bytes: int
    gbps: float
    pct_hbm: float
    pct_stream: float | None


@dataclass(frozen=True)
class MetricRow:
    metric: str
    value: float
    unit: str
    target: str = ""
    ok: bool | None = None


@dataclass
class BenchContext:
    device: object
    stream: object
    bundles: dict                      # config name -> Bundle
    quick: bool = False
    out_dir: Path | None = None        # the report directory: benchmarks' raw files go there
    stream_gbps: float | None = None   # best streaming read, set by `stream_read`
    bandwidth_rows: list = field(default_factory=list)
    metric_rows: list = field(default_factory=list)
    _timer: EventTimer | None = None
    _flusher: L2Flusher | None = None

    @property
    def timer(self) -> EventTimer:
        if self._timer is None:
            self._timer = EventTimer(self.stream, max_reps=200)
        return self._timer

    @property
    def flusher(self) -> L2Flusher:
        """Sweeps 2x the L2 between reps: a read with the stream-read probe when a bundle has it."""
        if self._flusher is None:
            bundle = self.bundle_with(pr.STREAM_READ.name)
            reader = None
            if bundle is not None:
                kernel = bundle.kernel(pr.STREAM_READ.name)
                grid_x = self.device.sm_count * pr.STREAM_CTAS_PER_SM
                parts = 16 * pr.stream_read_partials_count(grid_x)   # tail of the sweep buffer

                def reader(ptr: int, nbytes: int) -> LaunchSpec:
                    return LaunchSpec(kernel, (grid_x,), (ptr, ptr + nbytes - parts,
                                                          (nbytes - parts) // 16))
            self._flusher = L2Flusher(self.device, reader=reader)
        return self._flusher

    def bundle_with(self, kernel_prefix: str, prefer=("v41-flash", "tiny")):
        """The first bundle (by preference) holding a kernel whose name starts with the prefix."""
        order = [c for c in prefer if c in self.bundles] + [c for c in self.bundles
                                                             if c not in prefer]
        for config in order:
            if any(n.startswith(kernel_prefix) for n in self.bundles[config].names()):
                return self.bundles[config]
        return None

    def cold_median_us(self, fn: Callable[[], None], reps: int) -> float:
        return self.timer.median_us(fn, reps=reps, warmup=2, flush=self.flusher)

    def bandwidth(self, kernel: str, case: str, rows: int, us: float, nbytes: int) -> BandwidthRow:
        gbps = nbytes / (us * 1e-6) / 1e9
        pct_stream = 100.0 * gbps / self.stream_gbps if self.stream_gbps else None
        row = BandwidthRow(kernel, case, rows, us, nbytes, gbps,
                           100.0 * gbps * 1e9 / HBM_BYTES_PER_S, pct_stream)
        self.bandwidth_rows.append(row)
        return row

    def metric(self, metric: str, value: float, unit: str, target: str = "",
               ok: bool | None = None) -> MetricRow:
        row = MetricRow(metric, value, unit, target, ok)
        self.metric_rows.append(row)
        return row

    def close(self) -> None:
        for thing in (self._timer, self._flusher):
            if thing is not None:
                thing.close()


BENCHMARKS: list[tuple[str, Callable[[BenchContext], None]]] = []


def benchmark(name: str):
    """Register a benchmark; they run in registration order (stream_read first)."""
    def register(fn):
        if any(n == name for n, _ in BENCHMARKS):
            raise ValueError(f"benchmark {name!r} registered twice")
        BENCHMARKS.append((name, fn))
        return fn
    return register


def fill_random_u32(arena: Arena, name: str, chunk_words: int = 64 * MB) -> None:
    """Random bits in a slice (never time on zeros), in chunks to bound CuPy's temporaries."""
    import cupy as cp
    view = arena.view(name, "uint32")
    for start in range(0, view.size, chunk_words):
        stop = min(view.size, start + chunk_words)
        view[start:stop] = cp.random.randint(0, 2**31, size=stop - start, dtype=cp.int32)
    cp.cuda.Device().synchronize()


def fill_random_bf16(arena: Arena, name: str, chunk: int = 64 * MB) -> None:
    """Normal(0, 1) values rounded down to bf16 (the top 16 bits of float32 draws)."""
    import cupy as cp
    view = arena.view(name, "uint16")
    for start in range(0, view.size, chunk):
        stop = min(view.size, start + chunk)
        draws = cp.random.standard_normal(stop - start, dtype=cp.float32)
        view[start:stop] = (draws.view(cp.uint32) >> 16).astype(cp.uint16)
    cp.cuda.Device().synchronize()


# ---- probes and runtime ------------------------------------------------------------------------

@benchmark("stream_read")
def bench_stream_read(ctx: BenchContext) -> None:
    """16-byte streaming reads over 64 MB .. 4 GB; the best is the device's streaming bandwidth."""
    bundle = ctx.bundle_with(pr.STREAM_READ.name)
    sizes = [64 * MB << k for k in range(7)]    # 64 MB .. 4 GB
    if ctx.quick:
        sizes = sizes[:3]
    grid_x = ctx.device.sm_count * pr.STREAM_CTAS_PER_SM
    reqs = [("src", sizes[-1], "u32 random"), ("parts", 4 * pr.stream_read_partials_count(grid_x))]
    best = 0.0
    with Arena(ctx.device, reqs) as arena:
        fill_random_u32(arena, "src")
        for size in sizes:
            spec = LaunchSpec(bundle.kernel(pr.STREAM_READ.name), (grid_x,),
                              (arena.ptr("src"), arena.ptr("parts"),
                               pr.check_stream_read_size(size)))
            us = ctx.cold_median_us(lambda s=spec: s.launch(ctx.stream),
                                    reps=20 if ctx.quick else 50)
            row = ctx.bandwidth(pr.STREAM_READ.name, f"{size // MB} MB", 0, us,
                                pr.stream_read_bytes(size, grid_x))
            best = max(best, row.gbps)
    ctx.stream_gbps = best
    ctx.metric("measured streaming bandwidth", best, "GB/s", "reference for %stream")


def _chain_graph(ctx: BenchContext, bundle, counter: int, steps: int, pdl: bool) -> Graph:
    specs = [LaunchSpec(bundle.kernel(pr.CHAIN_STEP.name), (ctx.device.sm_count,), (counter,),
                        pdl=pdl) for _ in range(steps)]
    with Graph.capture(ctx.stream) as g:
        for s in specs:
            s.launch(ctx.stream)
    return g


@benchmark("pdl_boundary")
def bench_pdl_boundary(ctx: BenchContext) -> None:
    """Per-kernel-boundary cost in a graph of 200 tiny kernels (132 CTAs), with and without PDL."""
    bundle = ctx.bundle_with(pr.CHAIN_STEP.name)
    steps = 200
    per = {}
    with Arena(ctx.device, [("counter", 4)]) as arena:
        for pdl in (False, True):
            g = _chain_graph(ctx, bundle, arena.ptr("counter"), steps, pdl)
            try:
                us = ctx.timer.median_us(lambda g=g: g.launch(ctx.stream), reps=50, warmup=3)
            finally:
                g.close()
            per[pdl] = us / steps
            label = "with PDL" if pdl else "without PDL"
            ctx.metric(f"graph of {steps} chain kernels, {label}", us, "us")
    ctx.metric("kernel boundary in a graph, without PDL", per[False], "us")
    ctx.metric("kernel boundary in a graph, with PDL", per[True], "us", "< 1 us", per[True] < 1.0)
    ctx.metric("PDL saving per boundary", per[False] - per[True], "us")


@benchmark("host_costs")
def bench_host_costs(ctx: BenchContext) -> None:
    """Host time of one graph launch (1 and 200 nodes), one LaunchSpec.launch, one NVTX range."""
    bundle = ctx.bundle_with(pr.CHAIN_STEP.name)
    drain = ctx.stream.synchronize
    with Arena(ctx.device, [("counter", 4)]) as arena:
        spec = LaunchSpec(bundle.kernel(pr.CHAIN_STEP.name), (ctx.device.sm_count,),
                          (arena.ptr("counter"),))
        us = host_cost_us(lambda: spec.launch(ctx.stream), drain, batch=200)
        ctx.metric("host cost of LaunchSpec.launch (cuLaunchKernelEx, PDL)", us, "us")
        for steps in (1, 200):
            g = _chain_graph(ctx, bundle, arena.ptr("counter"), steps, True)
            try:
                us = host_cost_us(lambda g=g: g.launch(ctx.stream), drain, batch=20)
            finally:
                g.close()
            ctx.metric(f"host cost of one graph launch ({steps} nodes)", us, "us", "< 10 us",
                       us < 10.0)
        # step()-style: rows -> bucket lookup -> cuGraphLaunch, over all 27 vLLM buckets
        gs = GraphSet.capture(ctx.stream, lambda rows: spec.launch(ctx.stream))
        try:
            rows = iter(range(10**9))
            us = host_cost_us(lambda: gs.launch(next(rows) % 192 + 1, ctx.stream), drain,
                              batch=20)
        finally:
            gs.close()
        ctx.metric("host cost of GraphSet.launch(rows) (step()-style)", us, "us", "< 10 us",
                   us < 10.0)
    ranges = Ranges()
    if ranges.enabled:
        def push_pop():
            ranges.push("layer")
            ranges.pop()
        us = host_cost_us(push_pop, lambda: None, batch=1000)
        ctx.metric("NVTX push+pop (domain hopdec)", us, "us")
    else:
        ctx.metric("NVTX push+pop (nvtx package missing: no-op)", 0.0, "us", "", False)


@benchmark("sync_free")
def bench_sync_free(ctx: BenchContext) -> None:
    """Host time to enqueue a 200-node graph behind a 20 ms kernel, and that it returned first."""
    cu = driver()
    bundle = ctx.bundle_with(pr.SPIN.name)
    spin_ns = 20_000_000
    with Arena(ctx.device, [("out", 8), ("counter", 4)]) as arena:
        spin = LaunchSpec(bundle.kernel(pr.SPIN.name), (1,), (arena.ptr("out"), spin_ns))
        g = _chain_graph(ctx, bundle, arena.ptr("counter"), 200, True)
        done = check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DEFAULT))
        try:
            ctx.stream.synchronize()
            t0 = time.perf_counter_ns()
            spin.launch(ctx.stream)
            g.launch(ctx.stream)
            host_us = (time.perf_counter_ns() - t0) / 1e3
            check(cu.cuEventRecord(done, ctx.stream.cu_handle))
            running = cu.cuEventQuery(done)[0] == cu.CUresult.CUDA_ERROR_NOT_READY
            ctx.stream.synchronize()
            wall_us = (time.perf_counter_ns() - t0) / 1e3
        finally:
            check(cu.cuEventDestroy(done))
            g.close()
    ctx.metric("host time: enqueue 20 ms spin + 200-node graph", host_us, "us", "< 200 us",
               host_us < 200.0 and running)
    ctx.metric("wall time until that work completed", wall_us, "us")


# ---- model kernels -----------------------------------------------------------------------------

DECODE_ROWS = (1, 8, 64, 192)


GRAPH_REPEATS = 20


def _graph_per_kernel_us(ctx: BenchContext, launch: LaunchSpec) -> float:
    """Per-launch device time inside a graph of GRAPH_REPEATS PDL launches (decode's regime:
    back-to-back kernels, inputs L2-warm as the previous kernel's output would be)."""
    with Graph.capture(ctx.stream) as g:
        for _ in range(GRAPH_REPEATS):
            launch.launch(ctx.stream)
    try:
        return ctx.timer.median_us(lambda: g.launch(ctx.stream), reps=30, warmup=3) / GRAPH_REPEATS
    finally:
        g.close()


def _sweep(ctx: BenchContext, bundle, name: str, spec, cases, args_for_rows) -> list:
    """Time kernel `name` at each (case label, rows): one isolated launch with a cold L2, and for
    decode row counts also the per-launch time inside a graph. One bandwidth row per timing."""
    rows_out = []
    for case, rows in cases:
        launch = LaunchSpec(bundle.kernel(name), spec.grid(rows), args_for_rows(rows))
        us = ctx.cold_median_us(lambda s=launch: s.launch(ctx.stream),
                                reps=30 if ctx.quick else 60)
        rows_out.append(ctx.bandwidth(name, case, rows, us, spec.bytes_moved(rows)))
        if rows <= max(DECODE_ROWS):
            us = _graph_per_kernel_us(ctx, launch)
            ctx.bandwidth(name, f"{rows} graph", rows, us, spec.bytes_moved(rows))
    return rows_out


def _widest(bundle, prefix: str, size=lambda spec: spec["width"]):
    """(largest size, the kernels of that size): the variants decode spends most bytes on."""
    recs = [bundle.manifest.kernels[n] for n in bundle.names() if n.startswith(prefix)]
    widest = max(size(r.spec) for r in recs)
    return widest, sorted((r for r in recs if size(r.spec) == widest), key=lambda r: r.name)


@benchmark("rmsnorm")
def bench_rmsnorm(ctx: BenchContext) -> None:
    """RMSNorm at decode rows and over 1 MB .. 256 MB of input, every width and weight dtype built
    (the >= 80%-of-streaming target holds per width)."""
    from kernels import norm_ref

    bundle = ctx.bundle_with("rmsnorm_")
    if bundle is None:
        raise LookupError("no bundle has an rmsnorm kernel")
    recs = sorted((bundle.manifest.kernels[n] for n in bundle.names() if n.startswith("rmsnorm_")),
                  key=lambda r: (-r.spec["width"], r.name))
    sizes = [1 * MB, 64 * MB] if ctx.quick else [1 * MB, 4 * MB, 16 * MB, 64 * MB, 256 * MB]
    widest = recs[0].spec["width"]
    xbytes = max(max(sizes), max(DECODE_ROWS) * widest * 2)
    reqs = [("x", xbytes, "bf16 [rows, width]"), ("out", xbytes, "bf16 [rows, width]"),
            ("weight", widest * 4, "bf16/f32 [width]")]
    with Arena(ctx.device, reqs) as arena:
        fill_random_bf16(arena, "x")
        fill_random_bf16(arena, "weight")
        for rec in recs:
            width = rec.spec["width"]
            cases = [(f"{r} cold", r) for r in DECODE_ROWS]
            cases += [(f"{size // MB} MB in", size // (2 * width)) for size in sizes]
            spec = norm_ref.make_spec(width, rec.spec["weight_dtype"])
            rows = _sweep(ctx, bundle, rec.name, spec, cases, lambda n: (
                arena.ptr("x"), arena.ptr("weight"), arena.ptr("out"), n, 1e-6))
            for row in rows:
                if row.rows >= 64 * MB // (2 * width) and row.pct_stream:   # >= 64 MB of input
                    ctx.metric(f"{rec.name} at {row.case}: % of streaming bandwidth",
                               row.pct_stream, "%", ">= 80%", row.pct_stream >= 80.0)


@benchmark("residual_add")
def bench_residual_add(ctx: BenchContext) -> None:
    """Residual add (fp32 or bf16 a + bf16 b -> bf16) at decode rows and 64 / 256 MB of a."""
    from kernels import elementwise_ref

    bundle = ctx.bundle_with("residual_add_")
    if bundle is None:
        raise LookupError("no bundle has a residual_add kernel")
    width, recs = _widest(bundle, "residual_add_")
    cases = [(f"{r} cold", r) for r in DECODE_ROWS]
    sizes_mb = (64,) if ctx.quick else (64, 256)
    cases += [(f"{mb} MB a32", mb * MB // (4 * width)) for mb in sizes_mb]
    max_rows = max(r for _, r in cases)
    reqs = [("a", max_rows * width * 4, f"f32 [{max_rows}, {width}]"),
            ("b", max_rows * width * 2, f"bf16 [{max_rows}, {width}]"),
            ("out", max_rows * width * 2, f"bf16 [{max_rows}, {width}]")]
    with Arena(ctx.device, reqs) as arena:
        fill_random_bf16(arena, "a")
        fill_random_bf16(arena, "b")
        for rec in recs:
            spec = elementwise_ref.make_spec(width, rec.spec["a_dtype"])
            _sweep(ctx, bundle, rec.name, spec, cases, lambda n: (
                arena.ptr("a"), arena.ptr("b"), arena.ptr("out"), n))


@benchmark("rope")
def bench_rope(ctx: BenchContext) -> None:
    """RoPE (every variant of the largest heads x head_dim) at decode rows, 4096, 32768 rows."""
    import cupy as cp

    from kernels import rope_ref

    bundle = ctx.bundle_with("rope_")
    if bundle is None:
        raise LookupError("no bundle has a rope kernel")
    _, recs = _widest(bundle, "rope_", size=lambda spec: spec["heads"] * spec["head_dim"])
    heads, head_dim = recs[0].spec["heads"], recs[0].spec["head_dim"]
    num_positions = 65536
    cases = [(f"{r} cold", r) for r in DECODE_ROWS + ((4096,) if ctx.quick else (4096, 32768))]
    max_rows = max(r for _, r in cases)
    xbytes = max_rows * heads * head_dim * 2
    reqs = [("x", xbytes, f"bf16 [{max_rows}, {heads}, {head_dim}]"), ("out", xbytes),
            ("table", rope_ref.table_bytes(num_positions), f"f32 [{num_positions}, 32, 2]"),
            ("positions", max_rows * 4, f"i32 [{max_rows}]")]
    with Arena(ctx.device, reqs) as arena:
        fill_random_bf16(arena, "x")
        fill_random_bf16(arena, "out")
        arena.view("table", "float32")[:] = cp.random.uniform(-1, 1, arena.nbytes("table") // 4,
                                                              dtype=cp.float32)
        arena.view("positions", "int32")[:] = cp.random.randint(0, num_positions, max_rows,
                                                                dtype=cp.int32)
        cp.cuda.Device().synchronize()
        for rec in recs:
            s = rec.spec
            spec = rope_ref.make_spec(s["heads"], s["head_dim"], s["inverse"], s["in_place"])
            io = (arena.ptr("x"),) if s["in_place"] else (arena.ptr("x"), arena.ptr("out"))
            _sweep(ctx, bundle, rec.name, spec, cases, lambda n, io=io: io + (
                arena.ptr("table"), arena.ptr("positions"), n, num_positions))


def result_dicts(ctx: BenchContext) -> tuple[list[dict], list[dict]]:
    return [asdict(r) for r in ctx.bandwidth_rows], [asdict(r) for r in ctx.metric_rows]


# Benchmarks that live beside their kernel family's host code, as (name, "module:function"); they
# run after the runtime ones above and are imported only when run. Adding one is one line here.
FAMILY_BENCHMARKS = (
    ("moe_routed", "executor.moe_chain:bench_moe_routed"),
    ("dense_w8a16", "executor.bench_dense:bench_dense"),
    ("lm_head", "executor.bench_dense:bench_lm_head"),
    ("dense_timeline", "executor.dense_timeline:bench_dense_timeline"),   # per-CTA stamps
    ("sparse_mqa", "executor.sparse_mqa_chain:bench_sparse_mqa"),
    ("indexer", "executor.indexer_chain:bench_indexer"),
    ("attn_timeline", "executor.attn_timeline:bench_attn_timeline"),   # MQA/indexer CTA stamps
    ("compressor", "executor.compressor_chain:bench_compressor"),
    ("collectives", "collectives.bench:bench_collectives"),
    ("tp", "collectives.multi:bench_tp"),               # >= 2 GPUs; one skipped line on 1
    ("embed_engram", "executor.embed_engram_chain:bench_embed_engram"),
    ("mhc_router", "executor.mhc_router_chain:bench_mhc_router"),
    ("step", "executor.bench_step:bench_step"),      # late: it holds ~85 GB of the GPU
    ("round", "executor.bench_round:bench_round"),   # after step: it reads the step's times
    ("step_tp", "executor.bench_tp:bench_step_tp"),  # 4 GPUs, run alone: 4 ranks of ~85 GB
)


def _family_benchmark(target: str) -> Callable[[BenchContext], None]:
    module, function = target.split(":")

    def run(ctx: BenchContext) -> None:
        getattr(importlib.import_module(module), function)(ctx)
    return run


for _name, _target in FAMILY_BENCHMARKS:
    benchmark(_name)(_family_benchmark(_target))
