"""CPU: mHC step and router launches, built by executor/launches/mhc.py, emulated on host memory.

The launches come from the tiny bundle's manifest exactly as the GPU code builds them; the
emulator (executor/emulate/mhc.py, router.py) runs them over a HostArena. Inputs and the value
checks are tests/mhc_router_cases.py's, shared with tests/gpu/test_mhc_router.py, and poison
mirrors it (its tolerances, and why, are stated there:
X' and the collapse within `mk.rounding_bound`, mixes within `mk.mixes_bound`, pre/post and comb
within 1e-5 of the reference on the launch's own mixes, the RMSNorm bitwise, router logits
within `rk.logits_bound`, ids exact where the reference margin is clear, route weights 2^-17
relative). What this adds: every byte past the launch's rows (and every buffer a mode does not
write) is still poison, the counters are zero after, and the launches chain through one arena.
Arenas hold MAX_ROWS rows, so every R < 256 is a padded-bucket launch.
"""
from __future__ import annotations

import dataclasses

import mhc_router_cases as cases
import numpy as np
import pytest

from executor.emulate import NoEmulator, emulate_launch, run
from executor.hostmem import AddressSpace, HostArena, ManifestBundle
from executor.launch import LaunchSpec
from executor.launches.mhc import (
    MHC_UNTOUCHED,
    mhc_pre_launch,
    mhc_requests,
    mhc_step_launches,
    router_launch,
    router_requests,
)
from kernels import mhc_kernel_ref as mk
from kernels import norm_ref as nr
from kernels import router_ref as rk
from kernels.common_ref import BF16
from loader.config import ModelConfig

RNG = np.random.default_rng()
CFG = ModelConfig.preset("tiny")
MAX_ROWS = mk.MAX_ROWS
MHC_ROWS = (1, 6, 33, MAX_ROWS)         # one row, a mid batch over two row blocks, the maximum
ROUTER_ROWS = (1, 6, 17, MAX_ROWS)


@pytest.fixture(scope="module")
def bundle(tiny_bundle_dir):
    return ManifestBundle(tiny_bundle_dir)


def _poison_from(arena: HostArena, name: str, start: int, what: str) -> None:
    """Every byte of slice `name` from byte `start` on is still 0xFF."""
    tail = arena.view(name, np.uint8)[start:]
    written = np.flatnonzero(tail != 0xFF)
    assert not written.size, f"{what}: {name} written at byte {start + written[0]} (past it)"


# ---- mHC ---------------------------------------------------------------------------------------

def _mhc_arena(spec, rows: int, inputs: dict):
    space = AddressSpace()
    arena = HostArena(space, mhc_requests(spec, MAX_ROWS, "f32"), name="mhc")
    for name in arena.slices:           # inputs' padded rows too: nothing may write them
        arena.fill(name, 0xFF)
    arena.fill("counters", 0)
    if spec.polled:                     # `_lean_poll`'s exchange: empty words are zero
        arena.fill("workspace", 0)
    for name, host in inputs.items():
        arena.upload(name, host)
    return space, arena


def _run_mhc(bundle, spec, rows: int, in_place: bool):
    inputs = cases.mhc_inputs(RNG, spec, rows, "f32")
    space, arena = _mhc_arena(spec, rows, inputs)
    ptrs = {name: arena.ptr(name) for name in arena.slices}
    if in_place:
        ptrs["streams_out"] = ptrs["streams"]
    for name in MHC_UNTOUCHED[spec.mode]:       # the builder's placeholder path
        del ptrs[name]
    eps = CFG.rms_norm_eps
    launches = mhc_step_launches(bundle, spec, nr.make_spec(spec.width, "f32"), ptrs, rows,
                                 eps, CFG.hc_eps, eps)
    assert [launch.kernel.name for launch in launches] == [
        spec.name, f"rmsnorm_bf16_d{spec.width}_wf32"]
    assert run(launches, space) == 2
    return inputs, arena


def _check_mhc_bytes(spec, rows: int, in_place: bool, inputs: dict, arena: HostArena) -> None:
    """Nothing past the rows, nothing a mode does not write; counters zero; inputs intact."""
    tag, s, d, m = f"{spec.name} rows={rows}", spec.streams, spec.width, mk.MIX_DIM
    _poison_from(arena, "x_out", 2 * rows * d, tag)
    _poison_from(arena, "x_normed", 2 * rows * d, tag)
    _poison_from(arena, "streams", 2 * rows * s * d, tag)
    _poison_from(arena, "streams_out", 0 if in_place or spec.mode == "plain"
                 else 2 * rows * s * d, tag)
    if not in_place and spec.mode != "plain":
        assert np.array_equal(arena.view("streams", np.uint16, (rows, s, d)),
                              inputs["streams"].view(np.uint16)), f"{tag}: input X written"
    written = 0 if spec.mode == "postonly" else rows
    for name in ("mixes", "coeff_out"):
        _poison_from(arena, name, 4 * written * m, tag)
    if spec.polled:
        assert not arena.view("workspace", np.uint8).any(), f"{tag}: exchange not left empty"
    else:
        _poison_from(arena, "workspace", 4 * spec.slices * written * mk.PARTIAL_STRIDE, tag)
    if written and not spec.polled:
        pad = arena.view("workspace", np.uint32, (spec.slices, rows, mk.PARTIAL_STRIDE))
        assert (pad[:, :, mk.PARTIALS:] == 0xFFFFFFFF).all(), f"{tag}: workspace padding written"
    assert not arena.view("counters", np.int32).any(), f"{tag}: counters not zero"


@pytest.mark.parametrize("spec", mk.mhc_specs(CFG), ids=lambda spec: spec.name)
def test_emulated_mhc_step_matches_reference(bundle, spec):
    s, d, m = spec.streams, spec.width, mk.MIX_DIM
    for rows in MHC_ROWS:
        in_place = spec.mode != "plain" and rows % 2 == 0
        inputs, arena = _run_mhc(bundle, spec, rows, in_place)
        source = "streams" if in_place or spec.mode == "plain" else "streams_out"
        got = {"streams": arena.download(source, BF16, (rows, s, d)),
               "x": arena.download("x_out", BF16, (rows, d)),
               "normed": arena.download("x_normed", BF16, (rows, d)),
               "mixes": arena.download("mixes", np.float32, (rows, m)),
               "coeff": arena.download("coeff_out", np.float32, (rows, m)),
               "workspace": None if spec.polled else arena.download(
                   "workspace", np.float32, (spec.slices, rows, mk.PARTIAL_STRIDE))}
        cases.check_mhc_values(spec, CFG, rows, inputs, got)
        _check_mhc_bytes(spec, rows, in_place, inputs, arena)


def test_mhc_launch_refuses_bad_wiring(bundle):
    spec = mk.make_spec(CFG.hidden_size, mk.HC_MULT, "post", CFG.hc_sinkhorn_iters,
                        live_rows=True, approx_rcp=True)
    inputs = cases.mhc_inputs(RNG, spec, 4, "f32")
    space, arena = _mhc_arena(spec, 4, inputs)
    ptrs = {name: arena.ptr(name) for name in arena.slices}
    with pytest.raises(KeyError, match="'mixes'"):
        mhc_pre_launch(bundle, spec, {k: v for k, v in ptrs.items() if k != "mixes"}, 4,
                       1e-6, 1e-6)
    launch = mhc_pre_launch(bundle, spec, ptrs, 4, 1e-6, 1e-6)
    arena.view("counters", np.int32)[0] = 1          # not zeroed: the GPU reduce would misfire
    with pytest.raises(ValueError, match="counters"):
        emulate_launch(launch, space)
    arena.fill("counters", 0)
    record = bundle.kernel(spec.name)
    with pytest.raises(ValueError, match="grid"):           # a row block too many
        emulate_launch(LaunchSpec(record, (spec.slices, 2, 1), launch.args), space)
    variant = dataclasses.replace(record, name=spec.name + "_x",
                                  spec={**record.spec, "name": spec.name + "_x"})
    with pytest.raises(NoEmulator, match="_x"):
        emulate_launch(LaunchSpec(variant, launch.grid, launch.args), space)


# ---- router ------------------------------------------------------------------------------------

def _router_outputs(spec, rows: int, arena: HostArena, prefix: str = ""):
    e, k = spec.experts, spec.topk
    return (arena.download(prefix + "logits", np.float32, (rows, e)),
            arena.download(prefix + "ids", np.int32, (rows, k)),
            arena.download(prefix + "weights", np.float32, (rows, k)))


def _check_router_bytes(spec, rows: int, arena: HostArena, prefix: str = "") -> None:
    tag = f"{spec.name} rows={rows}"
    _poison_from(arena, prefix + "logits", 4 * rows * spec.experts, tag)
    for name in ("ids", "weights"):
        _poison_from(arena, prefix + name, 4 * rows * spec.topk, tag)
    assert not arena.view(prefix + "counters", np.int32).any(), f"{tag}: counters not zero"


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("spec", rk.router_specs(CFG), ids=lambda spec: spec.name)
def test_emulated_router_matches_reference(bundle, ties, spec):
    for rows in ROUTER_ROWS:
        x, weight, bias, group = cases.router_inputs(RNG, spec, rows, ties)
        space = AddressSpace()
        arena = HostArena(space, router_requests(spec, MAX_ROWS), name="router")
        for name in arena.slices:
            arena.fill(name, 0xFF)
        arena.fill("counters", 0)
        for name, host in (("x", x), ("weight", weight), ("bias", bias)):
            arena.upload(name, host)
        ptrs = {name: arena.ptr(name) for name in arena.slices}
        assert run([router_launch(bundle, spec, ptrs, rows)], space) == 1
        cases.check_router(spec, rows, x, weight, bias, group, *_router_outputs(spec, rows, arena))
        _check_router_bytes(spec, rows, arena)


# ---- the FFN sublayer's head: mHC step, RMSNorm, router on one arena ---------------------------

def test_emulated_ffn_head_chains_through_one_arena(bundle):
    """ffn.mhc_pre (the `_post_lr_rcp` winner, in place) -> ffn.norm -> ffn.router, the
    router reading the norm's output: three launches, one address space."""
    spec = mk.make_spec(CFG.hidden_size, mk.HC_MULT, "post", CFG.hc_sinkhorn_iters,
                        live_rows=True, approx_rcp=True)
    rspec = rk.router_specs(CFG)[0]
    rows = int(RNG.integers(2, 48))
    inputs = cases.mhc_inputs(RNG, spec, rows, "f32")
    _, weight, bias, _ = cases.router_inputs(RNG, rspec, rows, False)
    space = AddressSpace()
    requests = mhc_requests(spec, MAX_ROWS) + [
        ("router." + name, nbytes, comment)
        for name, nbytes, comment in router_requests(rspec) if name != "x"]
    arena = HostArena(space, requests, name="step")
    for name in arena.slices:
        arena.fill(name, 0xFF)
    arena.fill("counters", 0)
    arena.fill("router.counters", 0)
    for name, host in [*inputs.items(), ("router.weight", weight), ("router.bias", bias)]:
        arena.upload(name, host)
    ptrs = {name: arena.ptr(name) for name in arena.slices}
    ptrs["streams_out"] = ptrs["streams"]
    eps = CFG.rms_norm_eps
    launches = mhc_step_launches(bundle, spec, nr.make_spec(spec.width, "f32"), ptrs, rows,
                                 eps, CFG.hc_eps, eps)
    route = {name.removeprefix("router."): p for name, p in ptrs.items()
             if name.startswith("router.")}
    launches.append(router_launch(bundle, rspec, {**route, "x": ptrs["x_normed"]}, rows))
    assert run(launches, space) == 3
    normed = arena.download("x_normed", BF16, (rows, spec.width))
    x_out = arena.download("x_out", BF16, (rows, spec.width))
    assert np.array_equal(normed.view(np.uint16),
                          nr.rmsnorm_ref(x_out, inputs["norm_weight"], eps).view(np.uint16))
    cases.check_router(rspec, rows, normed, weight, bias, None,
                       *_router_outputs(rspec, rows, arena, "router."))
    _check_router_bytes(rspec, rows, arena, "router.")
