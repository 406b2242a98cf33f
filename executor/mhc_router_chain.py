"""The mHC step and the MoE router on device buffers: arenas, launches; their benchmark.

Used by tests/gpu/test_mhc_router.py and by `hopdec devicecheck` (benchmark "mhc_router",
`executor.mhc_router_chain:bench_mhc_router`). The mHC step is two launches: `mhc_pre` (post,
mixes, Sinkhorn, collapse) and the `kernels.norm` RMSNorm of the collapse.
"""
from __future__ import annotations

import numpy as np

from executor.arena import Arena
from executor.launch import LaunchSpec
from executor.launches.mhc import (
    mhc_norm_launch,
    mhc_pre_launch,
    mhc_requests,
    router_launch,
    router_requests,
)
from kernels import mhc_kernel_ref as mk
from kernels import norm_ref as nr
from kernels import router_ref as rk
from kernels.common_ref import to_bf16

BENCH_ROWS = (1, 5, 6, 12, 48, 192)
QUICK_ROWS = (1, 6, 48, 192)


class MhcStep:
    """Every buffer of one mHC step kernel sized for `max_rows`; counters zeroed once. The norm
    weight's dtype: the fused-norm spec's, else `norm_weight` (default f32)."""

    def __init__(self, device, bundle, spec: mk.MhcPreSpec, max_rows: int = mk.MAX_ROWS,
                 norm_weight: str = ""):
        norm_weight = spec.norm_weight or norm_weight or "f32"
        if spec.norm_weight and norm_weight != spec.norm_weight:
            raise ValueError(f"{spec.name} fuses a {spec.norm_weight} norm weight, not "
                             f"{norm_weight}")
        self.spec, self.max_rows, self.bundle = spec, max_rows, bundle
        self.kernel = bundle.kernel(spec.name)
        self.norm_spec = nr.make_spec(spec.width, norm_weight)
        self.norm_kernel = bundle.kernel(self.norm_spec.name)
        self.arena = Arena(device, mhc_requests(spec, max_rows, norm_weight))
        self.arena.view("counters", np.int32)[...] = 0
        if spec.polled:                 # `_lean_poll`: its exchange of tagged words, too
            self.arena.view("workspace", np.uint8)[...] = 0

    def _ptrs(self, in_place: bool = False) -> dict[str, int]:
        ptrs = {name: self.arena.ptr(name) for name in self.arena.slices}
        if in_place:
            ptrs["streams_out"] = ptrs["streams"]
        return ptrs

    def launch_pre(self, rows: int, norm_eps: float, hc_eps: float,
                   in_place: bool = False) -> LaunchSpec:
        return mhc_pre_launch(self.bundle, self.spec, self._ptrs(in_place), rows, norm_eps,
                              hc_eps)

    def launch_norm(self, rows: int, eps: float) -> LaunchSpec:
        return mhc_norm_launch(self.bundle, self.norm_spec, self._ptrs(), rows, eps)

    def close(self) -> None:
        self.arena.close()


class Router:
    """Every buffer of the router sized for `max_rows`; counters zeroed once."""

    def __init__(self, device, bundle, spec: rk.RouterSpec, max_rows: int = rk.MAX_ROWS):
        self.spec, self.max_rows, self.bundle = spec, max_rows, bundle
        self.kernel = bundle.kernel(spec.name)
        self.arena = Arena(device, router_requests(spec, max_rows))
        self.arena.view("counters", np.int32)[...] = 0

    def launch(self, rows: int) -> LaunchSpec:
        ptrs = {name: self.arena.ptr(name) for name in self.arena.slices}
        return router_launch(self.bundle, self.spec, ptrs, rows)

    def close(self) -> None:
        self.arena.close()


def upload(arena: Arena, name: str, host: np.ndarray) -> None:
    arena.upload(name, host)


def download(arena: Arena, name: str, dtype, shape) -> np.ndarray:
    return arena.download(name, dtype, shape)


def poison(arena: Arena, name: str) -> None:
    """All bytes 0xFF: NaN as bf16 and f32, -1 as int32."""
    arena.fill(name, 0xFF)


def _fill_mhc(step: MhcStep, rng) -> None:
    from executor.benchmarks import fill_random_bf16
    for name in ("streams", "sub_out"):
        fill_random_bf16(step.arena, name)
    s, d, m = step.spec.streams, step.spec.width, mk.MIX_DIM
    upload(step.arena, "fn", (rng.standard_normal((m, s * d)) / np.sqrt(s * d)).astype(np.float32))
    upload(step.arena, "scale", np.array([1.0, 1.0, 1.0, 0.0], np.float32))
    upload(step.arena, "base", rng.uniform(-1, 1, m).astype(np.float32))
    coeff = np.tile(np.concatenate([np.full(4, 0.25), np.ones(4), np.full(16, 0.25)]),
                    (step.max_rows, 1)).astype(np.float32)
    upload(step.arena, "coeff_prev", coeff)
    ones = np.ones(d, np.float32)
    upload(step.arena, "norm_weight", to_bf16(ones) if step.norm_spec.weight_dtype == "bf16"
           else ones)


def _time_step(ctx, step: MhcStep, rows: int, reps: int) -> float:
    """mhc_pre alone, then mhc_pre + its RMSNorm (two PDL launches); returns the pair's us
    (a fused-norm kernel: its own us, the norm is inside)."""
    spec = step.spec
    pre = step.launch_pre(rows, 1e-20, 1e-6, in_place=True)
    norm = step.launch_norm(rows, 1e-20)
    us = ctx.cold_median_us(lambda: pre.launch(ctx.stream), reps=reps)
    ctx.bandwidth(spec.name, f"pred {mk.predicted_us(rows, spec.width):.1f} us", rows, us,
                  spec.bytes_moved(rows))
    if spec.norm_weight:
        return us

    def chain():
        pre.launch(ctx.stream)
        norm.launch(ctx.stream)
    us = ctx.cold_median_us(chain, reps=reps)
    ctx.bandwidth(f"{spec.name}+rmsnorm", "2 launches, PDL", rows, us,
                  spec.bytes_moved(rows) + nr.rmsnorm_bytes(rows, spec.width, "f32"))
    return us


def bench_mhc_router(ctx) -> None:
    """mhc_pre (post mode) alone and followed by its RMSNorm, and the router, at R = 1..192,
    L2 flushed before each rep; bytes = what must move (fn / gate weight once + activations)."""
    bundle = ctx.bundle_with("mhc_pre_")
    if bundle is None or not any(n.startswith("router_") for n in bundle.names()):
        raise LookupError("no bundle has the mhc_pre and router kernels")
    rng = np.random.default_rng()
    post_specs = []
    for name in sorted(n for n in bundle.names() if n.startswith("mhc_pre_") and "_post" in n):
        post_specs.append(mk.spec_from_dict(bundle.manifest.kernels[name].spec))
        if post_specs[-1].name != name:
            raise ValueError(f"bundle kernel {name}: its manifest spec rebuilds as "
                             f"{post_specs[-1].name}")
    spec = post_specs[0]
    rspecs = []
    for rname in sorted(n for n in bundle.names() if n.startswith("router_")):
        rspecs.append(rk.spec_from_dict(bundle.manifest.kernels[rname].spec))
    steps = [MhcStep(ctx.device, bundle, sp) for sp in post_specs]
    routers = [Router(ctx.device, bundle, rspec) for rspec in rspecs]
    try:
        for step in steps:
            _fill_mhc(step, rng)
        from executor.benchmarks import fill_random_bf16
        for router in routers:
            fill_random_bf16(router.arena, "x")
            fill_random_bf16(router.arena, "weight")
            upload(router.arena, "bias",
                   rng.uniform(-0.1, 0.1, router.spec.experts).astype(np.float32))
        reps = 20 if ctx.quick else 50
        for rows in QUICK_ROWS if ctx.quick else BENCH_ROWS:
            chain_us = min(_time_step(ctx, step, rows, reps) for step in steps)
            route_us = []
            for router in routers:
                route, rspec = router.launch(rows), router.spec
                us = ctx.cold_median_us(lambda route=route: route.launch(ctx.stream), reps=reps)
                pred = rk.predicted_us(rows, rspec.hidden, rspec.experts, rspec.one_pass,
                                       rspec.polled)
                ctx.bandwidth(rspec.name, f"pred {pred:.1f} us", rows, us,
                              rspec.bytes_moved(rows))
                route_us.append(us)
            # One layer's share: two mHC steps (attn, ffn) and the best variants, vs the HBM floor
            # of their bytes (fn twice + gate once + activations) at 4.8 TB/s.
            layer_bytes = 2 * spec.bytes_moved(rows) + routers[0].spec.bytes_moved(rows)
            ctx.metric(f"mhc x2 + router per layer, R={rows} (floor {layer_bytes / 4.8e6:.1f} us)",
                       2 * chain_us + min(route_us), "us")
    finally:
        for step in steps:
            step.close()
        for router in routers:
            router.close()
