"""Device benchmarks for `hopdec devicecheck`: a registry of functions, each adding rows to a report.

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

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from executor.arena import Arena
from executor.graphs import Graph
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
        if self._flusher is None:
            self._flusher = L2Flusher(self.device)
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
            us = ctx.cold_median_us(lambda s=spec: s.launch(ctx.stream), reps=20 if ctx.quick else 50)
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
    ranges = Ranges()
    if ranges.enabled:
        def push_pop():
            ranges.push("layer")
            ranges.pop()
        us = host_cost_us(push_pop, lambda: None, batch=1000)
        ctx.metric("NVTX push+pop (domain hopdec)", us, "us")
    else:
        ctx.metric("NVTX push+pop (nvtx package missing: no-op)", 0.0, "us", "", False)


# ---- model kernels -----------------------------------------------------------------------------

@benchmark("rmsnorm")
def bench_rmsnorm(ctx: BenchContext) -> None:
    """RMSNorm over 1 MB .. 256 MB of input at the widest width built (D=5120 on v41-flash)."""
    from kernels import norm_ref

    bundle = ctx.bundle_with("rmsnorm_")
    if bundle is None:
        raise LookupError("no bundle has an rmsnorm kernel")
    recs = [bundle.manifest.kernels[n] for n in bundle.names() if n.startswith("rmsnorm_")]
    width = max(r.spec["width"] for r in recs)
    sizes = [1 * MB, 4 * MB, 16 * MB, 64 * MB, 256 * MB]
    if ctx.quick:
        sizes = [1 * MB, 64 * MB]
    max_rows = sizes[-1] // (2 * width)
    reqs = [("x", max_rows * width * 2, f"bf16 [{max_rows}, {width}]"),
            ("out", max_rows * width * 2, f"bf16 [{max_rows}, {width}]"),
            ("weight", width * 4, f"bf16/f32 [{width}]")]
    with Arena(ctx.device, reqs) as arena:
        fill_random_bf16(arena, "x")
        fill_random_bf16(arena, "weight")
        for rec in sorted((r for r in recs if r.spec["width"] == width), key=lambda r: r.name):
            spec = norm_ref.make_spec(width, rec.spec["weight_dtype"])
            for size in sizes:
                rows = size // (2 * width)
                launch = LaunchSpec(bundle.kernel(rec.name), spec.grid(rows),
                                    (arena.ptr("x"), arena.ptr("weight"), arena.ptr("out"),
                                     rows, 1e-6))
                us = ctx.cold_median_us(lambda s=launch: s.launch(ctx.stream), reps=50)
                row = ctx.bandwidth(rec.name, f"{size // MB} MB in", rows, us,
                                    norm_ref.rmsnorm_bytes(rows, width, rec.spec["weight_dtype"]))
                if size >= 64 * MB and row.pct_stream is not None:
                    ctx.metric(f"{rec.name} at {size // MB} MB: % of streaming bandwidth",
                               row.pct_stream, "%", ">= 80%", row.pct_stream >= 80.0)


def result_dicts(ctx: BenchContext) -> tuple[list[dict], list[dict]]:
    return [asdict(r) for r in ctx.bandwidth_rows], [asdict(r) for r in ctx.metric_rows]
