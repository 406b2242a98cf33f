"""CPU: mHC step and router launches, built by executor/launches/mhc.py, emulated on host memory.

The launches come from the tiny bundle's manifest exactly as the GPU code builds them; the
emulator (executor/emulate/mhc.py, router.py) runs them over a HostArena. Inputs, poison and
every comparison mirror tests/gpu/test_mhc_router.py (its tolerances, and why, are stated there:
X' and the collapse within `mk.rounding_bound`, mixes within `mk.mixes_bound`, pre/post and comb
within 1e-5 of the reference on the launch's own mixes, the RMSNorm bitwise, router logits
within `rk.logits_bound`, ids exact where the reference margin is clear, route weights 2^-17
relative). What this adds: every byte past the launch's rows (and every buffer a mode does not
write) is still poison, the counters are zero after, and the launches chain through one arena.
Arenas hold MAX_ROWS rows, so every R < 256 is a padded-bucket launch.
"""
from __future__ import annotations

import dataclasses

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
from kernels import mhc_ref
from kernels import norm_ref as nr
from kernels import router_ref as rk
from kernels.common_ref import BF16, to_bf16
from loader.config import ModelConfig

RNG = np.random.default_rng()
CFG = ModelConfig.preset("tiny")
MAX_ROWS = mk.MAX_ROWS
MHC_ROWS = (1, 6, 33, MAX_ROWS)         # one row, a mid batch over two row blocks, the maximum
ROUTER_ROWS = (1, 6, 17, MAX_ROWS)
PP_ATOL = 1e-5
COMB_ATOL = 1e-5
ROUTE_REL = 2.0**-17


@pytest.fixture(scope="module")
def bundle(tiny_bundle_dir):
    return ManifestBundle(tiny_bundle_dir)


def _within(got, want, bound, what: str) -> None:
    got64, want64 = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert not np.isnan(got64).any(), f"{what}: unwritten (NaN) elements"
    bad = np.argwhere(np.abs(got64 - want64) > bound)
    if len(bad):
        i = tuple(bad[0])
        b = bound[i] if np.ndim(bound) else bound
        raise AssertionError(f"{what}: {len(bad)} elements out of bound, first at {i}: got "
                             f"{got64[i]!r} want {want64[i]!r} bound {b!r}")


def _poison_from(arena: HostArena, name: str, start: int, what: str) -> None:
    """Every byte of slice `name` from byte `start` on is still 0xFF."""
    tail = arena.view(name, np.uint8)[start:]
    written = np.flatnonzero(tail != 0xFF)
    assert not written.size, f"{what}: {name} written at byte {start + written[0]} (past it)"


# ---- mHC ---------------------------------------------------------------------------------------

def _coefficients(rows: int, streams: int) -> np.ndarray:
    mixes = RNG.standard_normal((rows, mk.MIX_DIM)).astype(np.float32)
    c = mhc_ref.hc_coefficients(mixes, RNG.uniform(0.5, 2, 3).astype(np.float32),
                                RNG.uniform(-1, 1, mk.MIX_DIM).astype(np.float32), mk.HC_MULT,
                                20, 1e-6)
    packed = mk.pack_coefficients(c)
    if streams == 1:
        packed[:, :mk.HC_MULT] = mhc_ref.one_hot_pre(rows, mk.HC_MULT)
    return packed


def _mhc_inputs(spec, rows: int) -> dict:
    s, d, m = spec.streams, spec.width, mk.MIX_DIM
    return {"streams": to_bf16(RNG.standard_normal((rows, s, d)) * RNG.uniform(0.05, 20)),
            "sub_out": to_bf16(RNG.standard_normal((rows, d)) * RNG.uniform(0.05, 20)),
            "coeff_prev": _coefficients(rows, s),
            "fn": (RNG.standard_normal((m, s * d)) * RNG.uniform(0.3, 3) / np.sqrt(s * d))
            .astype(np.float32),
            "scale": np.append(RNG.uniform(0.5, 2, 3), 0).astype(np.float32),
            "base": RNG.uniform(-1, 1, m).astype(np.float32),
            "norm_weight": RNG.uniform(-2, 2, d).astype(np.float32)}


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
    inputs = _mhc_inputs(spec, rows)
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


def _check_mhc_values(spec, rows: int, inputs: dict, got: dict) -> None:
    tag, s = f"{spec.name} rows={rows}", spec.streams
    x, fn, eps = inputs["streams"], inputs["fn"], CFG.rms_norm_eps
    pc = mk.unpack_coefficients(inputs["coeff_prev"])
    if spec.mode != "plain":
        f = inputs["sub_out"].astype(np.float64)
        exact = (pc.post[:, :, None].astype(np.float64) * f[:, None, :]
                 + np.einsum("rjk,rjd->rkd", pc.comb.astype(np.float64), x.astype(np.float64)))
        terms = (np.abs(pc.post)[:, :, None] * np.abs(f)[:, None, :]
                 + np.einsum("rjk,rjd->rkd", np.abs(pc.comb).astype(np.float64),
                             np.abs(x.astype(np.float64))))
        _within(got["streams"], exact, mk.rounding_bound(exact, terms, 5), f"{tag}: X'")
    else:
        assert np.array_equal(got["streams"].view(np.uint16), x.view(np.uint16)), f"{tag}: X"
    xn = got["streams"].astype(np.float64)
    collapse = np.einsum("rn,rnd->rd", pc.pre[:, :s].astype(np.float64), xn)
    cterms = np.einsum("rn,rnd->rd", np.abs(pc.pre[:, :s]).astype(np.float64), np.abs(xn))
    _within(got["x"], collapse, mk.rounding_bound(collapse, cterms, s + 1), f"{tag}: collapse")
    want_norm = nr.rmsnorm_ref(got["x"], inputs["norm_weight"], eps)
    assert np.array_equal(got["normed"].view(np.uint16), want_norm.view(np.uint16)), \
        f"{tag}: rmsnorm"
    if spec.mode == "postonly":
        return
    want = mk.finish_ref(got["streams"], pc.pre[:, :s], fn, inputs["scale"][:3], inputs["base"],
                         eps, CFG.hc_eps, CFG.hc_sinkhorn_iters)
    bound = mk.mixes_bound(got["streams"], fn, eps)
    _within(got["mixes"], want.mixes, bound, f"{tag}: mixes")
    ref = mk.pack_coefficients(mhc_ref.hc_coefficients(
        got["mixes"], inputs["scale"][:3], inputs["base"], mk.HC_MULT, CFG.hc_sinkhorn_iters,
        CFG.hc_eps))
    _within(got["coeff"][:, :8], ref[:, :8], PP_ATOL, f"{tag}: pre/post")
    _within(got["coeff"][:, 8:], ref[:, 8:], COMB_ATOL, f"{tag}: comb")
    comb = got["coeff"][:, 8:].reshape(rows, 4, 4).astype(np.float64)
    _within(comb.sum(axis=1), np.ones((rows, 4)), 1e-5, f"{tag}: comb column sums")
    ref_rows = ref[:, 8:].reshape(rows, 4, 4).astype(np.float64).sum(axis=2)
    _within(comb.sum(axis=2), ref_rows, 1e-5, f"{tag}: comb row sums")
    if spec.polled:                     # its exchange is checked empty in _check_mhc_bytes
        return
    # The split-K scratch: Σ over slices of the partials, scaled by rstd, is the mixes.
    ws = got["workspace"].astype(np.float64)
    sums = ws.sum(axis=0)
    rstd = 1.0 / np.sqrt(sums[:, mk.MIX_DIM:mk.PARTIALS] / (s * spec.width) + eps)
    _within(sums[:, :mk.MIX_DIM] * rstd, want.mixes, bound, f"{tag}: workspace partials")


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
        _check_mhc_values(spec, rows, inputs, got)
        _check_mhc_bytes(spec, rows, in_place, inputs, arena)


def test_mhc_launch_refuses_bad_wiring(bundle):
    spec = mk.make_spec(CFG.hidden_size, mk.HC_MULT, "post", CFG.hc_sinkhorn_iters,
                        live_rows=True, approx_rcp=True)
    inputs = _mhc_inputs(spec, 4)
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

def _router_inputs(spec, rows: int, ties: bool):
    e, d = spec.experts, spec.hidden
    x = to_bf16(RNG.standard_normal((rows, d)) * RNG.uniform(0.1, 3))
    weight = to_bf16(RNG.standard_normal((e, d)) * RNG.uniform(0.3, 3) / np.sqrt(d))
    bias = RNG.uniform(-0.3, 0.3, e).astype(np.float32)
    group = None
    if ties:        # 7 equal weight rows and bias on top: the top 6 are the lowest 6 of them
        group = np.sort(RNG.choice(e, 7, replace=False))
        weight[group] = weight[group[0]]
        bias[group] = np.float32(8.0)
    return x, weight, bias, group


def _check_router(spec, rows, x, weight, bias, group, logits, ids, weights) -> None:
    tag = f"{spec.name} rows={rows}"
    _within(logits, rk.logits_f64(x, weight), rk.logits_bound(x, weight), f"{tag}: logits")
    want = rk.select_from_logits(logits, bias, spec.topk, spec.scaling)
    assert ((ids >= 0) & (ids < spec.experts)).all(), f"{tag}: ids out of range: {ids}"
    assert all(len(set(r)) == spec.topk for r in ids.tolist()), f"{tag}: repeated ids"
    sel = want.selection.astype(np.float64)
    ordered = -np.sort(-sel, axis=1)[:, :spec.topk + 1]
    margin = ROUTE_REL * np.abs(ordered).max(axis=1, keepdims=True)
    gaps = ordered[:, :-1] - ordered[:, 1:]
    clear = (gaps > margin) & np.concatenate([np.ones((rows, 1), bool),
                                              gaps[:, :-1] > margin], axis=1)
    assert not (clear & (ids != want.ids)).any(), f"{tag}: ids differ where the margin is clear"
    got_sel = np.take_along_axis(sel, ids.astype(np.int64), axis=1)
    _within(got_sel, ordered[:, :spec.topk], np.broadcast_to(margin, got_sel.shape),
            f"{tag}: chosen selection values")
    if group is not None:
        assert (logits[:, group] == logits[:, group[:1]]).all(), f"{tag}: equal rows, logits"
        assert (ids == group[:spec.topk]).all(), f"{tag}: ties not broken to the lower index"
    scores = np.sqrt(np.logaddexp(0.0, logits.astype(np.float64)))
    chosen = np.take_along_axis(scores, ids.astype(np.int64), axis=1)
    exp_w = chosen / (chosen.sum(axis=1, keepdims=True) + 1e-20) * spec.scaling
    _within(weights, exp_w, ROUTE_REL * np.abs(exp_w) + 1e-30, f"{tag}: route weights")


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
        x, weight, bias, group = _router_inputs(spec, rows, ties)
        space = AddressSpace()
        arena = HostArena(space, router_requests(spec, MAX_ROWS), name="router")
        for name in arena.slices:
            arena.fill(name, 0xFF)
        arena.fill("counters", 0)
        for name, host in (("x", x), ("weight", weight), ("bias", bias)):
            arena.upload(name, host)
        ptrs = {name: arena.ptr(name) for name in arena.slices}
        assert run([router_launch(bundle, spec, ptrs, rows)], space) == 1
        _check_router(spec, rows, x, weight, bias, group, *_router_outputs(spec, rows, arena))
        _check_router_bytes(spec, rows, arena)


# ---- the FFN sublayer's head: mHC step, RMSNorm, router on one arena ---------------------------

def test_emulated_ffn_head_chains_through_one_arena(bundle):
    """ffn.mhc_pre (the `_post_lr_rcp` winner, in place) -> ffn.norm -> ffn.router, the
    router reading the norm's output: three launches, one address space."""
    spec = mk.make_spec(CFG.hidden_size, mk.HC_MULT, "post", CFG.hc_sinkhorn_iters,
                        live_rows=True, approx_rcp=True)
    rspec = rk.router_specs(CFG)[0]
    rows = int(RNG.integers(2, 48))
    inputs = _mhc_inputs(spec, rows)
    _, weight, bias, _ = _router_inputs(rspec, rows, False)
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
    _check_router(rspec, rows, normed, weight, bias, None,
                  *_router_outputs(rspec, rows, arena, "router."))
    _check_router_bytes(rspec, rows, arena, "router.")
