"""GPU tests of the fused mHC step (`mhc_pre` + RMSNorm) and the MoE router against their references.

Bundles: HOPDEC_BUNDLE (tiny: D = 256, 16 experts) and HOPDEC_BUNDLE_V41 (D = 5120, 384 experts).
Every case draws fresh inputs, poisons every output with 0xFF bytes (NaN, id -1), launches through
the runtime, and compares every element. Downstream quantities are checked against the reference
fed with the kernel's own upstream outputs (X' for mixes and collapse, mixes for the
coefficients, logits for the selection), so one rounding difference is judged where it happens.

Tolerances (the bounds live in kernels/mhc_kernel_ref.py and kernels/router_ref.py, the checks in
tests/mhc_router_cases.py, shared with the CPU emulator test):
- X' and the collapse: fp32 sums of <= 5 products then one bf16 rounding, against the float64
  value rounded once: |got - exact| <= 2^-7 |exact| + ops·2^-23 Σ|terms| (`rounding_bound`:
  one bf16 ulp, as the fp32 error can move the value across a rounding midpoint).
- mixes: fp32 split-K sum vs float64: (32 + 3 + D/64 + 8) roundings of 2^-24 Σ|x·fn|, times rstd,
  plus 2^-20 relative for the rstd (`mixes_bound`).
- pre/post: sigmoid of the same fp32 mixes; the argument m·s + b may be one fma (<= 1 ulp of
  |m·s| <= ~40: 4e-6, times σ' <= 1/4); exp compiles to ex2.approx.ftz of x·log2(e) (relative
  error <= 2^-22 + |x|·2^-24 <= 2.6e-6 at |x| = 40, times σ(1-σ) <= 1/4); one division; post
  doubles it: 1e-5 abs (a wrong formula or lane is off by > 1e-2).
- comb: fp32 Sinkhorn vs NumPy's fp32 Sinkhorn in another summation order. Measured: fp32 vs
  float64 Sinkhorn differ by <= 2.3e-7 over 200k random 4x4 logits of sd 1..3; the half-warp
  order (tests/test_mhc_router_cpu.py model) on logits perturbed by 1 ulp differs from
  mhc_ref.sinkhorn by <= 1.05e-6 at sd 10 (100k draws); the kernel's ex2.approx exp adds
  <= 2^-22 + 20·2^-24 relative to each softmax term (~1.4e-6 abs): 1e-5 abs leaves x4 or more. Doubly stochastic check:
  every column sums to 1 within 1e-5 (the last step is a column normalisation: S/(S + 1e-6)),
  row sums equal the reference's within 1e-5 (20 rounds do not make rows exactly stochastic).
- router logits: fp32 vs float64 within `logits_bound`; equal weight rows give bitwise equal
  logits (fixed summation order). ids: exact against the reference selection on the kernel's own
  logits, except where two reference selection values are within 2^-17 of the row's largest
  (the kernel's scores, ex2.approx exp + libdevice log1p + sqrt.rn, are within ~1e-6 relative of
  NumPy's and may order those differently): there the chosen expert's reference
  value must equal the reference's slot value within that margin. Ties are constructed: 7 experts
  with identical weight rows and bias (+8: always on top) make the top 6 the 6 lowest of them.
- route weights: s_k / (Σ s + 1e-20)·1.5 with the reference scores of the kernel's ids: 2^-17
  relative (a few ulps of score, a 6-term sum and a division).
- counters: every row block's counter is back to 0 after the launch (the next launch relies on it).
- RMSNorm: bitwise `norm_ref.rmsnorm_ref` of the kernel's own x, whether the separate kernel
  or the fused-norm variants (`_lean_norm*`, `_lean_poll[_ms]_norm*`, launched alone: x_normed
  must come from them).
- `_lean_poll[_ms]_norm*` (kernels/mhc_poll.py): the bounds above at R in POLL_ROWS, and no
  tolerance at all against `_lean` on the same inputs (the same sums in the same orders: every
  output bitwise equal); its exchange must be empty and its timeout flag (counters[0]) clear after
  every launch (a late or lost word would also show as a NaN or wrong value: the poll gives up
  after 2 ms instead of hanging).
- `_tile8` / `_tile8p` (one pass, kernels/router_tile.py) are held to the same bounds: their fp32
  sum has fewer roundings (2 vectors a thread, 10 warps: 30 vs the bound's 49 at D = 5120), their
  selection the same scores and tie rule. `_tile8p`'s exchange words must be zero again after
  every launch (checked with the counters; a late or missing word would also show as a wrong id,
  weight or NaN, since its consumer gives up after POLL_TIMEOUT_NS instead of hanging).
"""
from __future__ import annotations

import mhc_router_cases as cases
import numpy as np
import pytest

from executor.mhc_router_chain import MhcStep, Router, download, poison, upload
from kernels import mhc_kernel_ref as mk
from kernels import router_ref as rk
from kernels.common_ref import BF16, to_bf16

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

ROWS = (1, 5, 6, 12, 48, 192)
POLL_ROWS = (1, 2, 5, 6, 8, 17, 48, 192)       # `_lean_poll`: 1-8 the step's, then 1 and 6 blocks
RNG = np.random.default_rng()


# ---- mHC ---------------------------------------------------------------------------------------

def _mhc_run(stream, step, cfg, rows: int, in_place: bool, inputs: dict):
    """Upload `inputs`, poison every output (the exchange of `_lean_poll` stays zero: 0xFF would
    read as tagged words), launch, and download (outputs as `cases.check_mhc_values` takes them,
    counters, and the polled variants' exchange bytes)."""
    spec, s, d, m = step.spec, step.spec.streams, step.spec.width, mk.MIX_DIM
    for name, host in inputs.items():
        upload(step.arena, name, host)
    for name in ("streams_out", "x_out", "coeff_out", "mixes", "x_normed") + (
            () if spec.polled else ("workspace",)):
        poison(step.arena, name)
    cp.cuda.Device().synchronize()
    eps, hc_eps = cfg.rms_norm_eps, cfg.hc_eps
    step.launch_pre(rows, eps, hc_eps, in_place=in_place).launch(stream)
    if not spec.norm_weight:           # fused: x_normed must come from mhc_pre alone
        step.launch_norm(rows, eps).launch(stream)
    stream.synchronize()
    a = step.arena
    source = "streams" if in_place or spec.mode == "plain" else "streams_out"
    got = {"streams": download(a, source, BF16, (rows, s, d)),
           "x": download(a, "x_out", BF16, (rows, d)),
           "normed": download(a, "x_normed", BF16, (rows, d)),
           "mixes": download(a, "mixes", np.float32, (rows, m)),
           "coeff": download(a, "coeff_out", np.float32, (rows, m))}
    counters = download(a, "counters", np.int32, (mk.counter_count(step.max_rows),))
    scratch = None                     # the polled exchange (the others' partials: not checked)
    if spec.polled:
        scratch = download(a, "workspace", np.uint8, (mk.workspace_bytes(spec, step.max_rows),))
    return got, counters, scratch


def _mhc_case(dev, stream, bundle, spec, rows: int, cfg, in_place: bool):
    step = MhcStep(dev, bundle, spec, max_rows=max(ROWS))        # weight dtype: the spec's
    try:
        inputs = cases.mhc_inputs(RNG, spec, rows, spec.norm_weight)
        got, counters, scratch = _mhc_run(stream, step, cfg, rows, in_place, inputs)
    finally:
        step.close()
    if spec.polled:      # every tagged word consumed and zeroed; the timeout flag (counters[0])
        assert not scratch.any(), (f"{spec.name} rows={rows}: exchange not left empty at bytes "
                                   f"{np.flatnonzero(scratch)[:8].tolist()}")
    return inputs, got, counters


def _check_mhc(spec, cfg, rows, inputs, got, counters):
    tag = f"{spec.name} rows={rows}"
    assert not counters.any(), f"{tag}: counters not reset: {counters}"
    if spec.mode == "postonly":      # no mixes, no coefficients: the poison is untouched
        assert np.isnan(got["mixes"]).all() and np.isnan(got["coeff"]).all(), f"{tag}: wrote mixes"
    cases.check_mhc_values(spec, cfg, rows, inputs, got)


def _mode_spec(cfg, mode: str) -> mk.MhcPreSpec:
    streams = 1 if mode.startswith("broadcast") else mk.HC_MULT
    kind = "plain" if mode.startswith("broadcast") else mode.split("_")[0]
    return mk.make_spec(cfg.hidden_size, streams, kind, cfg.hc_sinkhorn_iters,
                        live_rows="_lr" in mode, approx_rcp="_rcp" in mode, lean="_lean" in mode,
                        norm_weight=mode.partition("_norm")[2], polled="_poll" in mode,
                        mix_split="_ms" in mode)


@pytest.mark.parametrize("mode", ["post_lr_rcp", "post_lean", "post_lean_normbf16",
                                  "post_lean_normf32", "post_lean_poll_normbf16",
                                  "post_lean_poll_normf32", "post_lean_poll_ms_normbf16",
                                  "post_lean_poll_ms_normf32", "plain_lean", "broadcast",
                                  "broadcast_lean", "postonly"])
def test_mhc_pre_matches_reference(dev, stream, preset_bundle, mode):
    cfg, bundle = preset_bundle
    spec = _mode_spec(cfg, mode)
    for rows in POLL_ROWS if spec.polled else ROWS:
        in_place = spec.mode != "plain" and rows % 2 == 0
        out = _mhc_case(dev, stream, bundle, spec, rows, cfg, in_place)
        _check_mhc(spec, cfg, rows, *out)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("norm", ["bf16", "f32"])
def test_mhc_pre_poll_bitwise_equals_lean(dev, stream, preset_bundle, norm, split):
    """`_lean_poll` is `_lean` with another handoff (`_ms`: and the row's mixes split over 4
    warps, each mix summed in the same order): the same products and sums in the same orders,
    so on the same inputs every output (X', x, mixes, coefficients, x_normed) is bitwise
    `_lean`'s, at the step's rows and across row blocks; its exchange is left empty and its
    timeout flag clear."""
    cfg, bundle = preset_bundle
    specs = [mk.make_spec(cfg.hidden_size, mk.HC_MULT, "post", cfg.hc_sinkhorn_iters,
                          lean=True, norm_weight=norm, polled=polled, mix_split=split and polled)
             for polled in (False, True)]
    steps = [MhcStep(dev, bundle, spec, max_rows=max(POLL_ROWS)) for spec in specs]
    try:
        for rows in POLL_ROWS:
            inputs = cases.mhc_inputs(RNG, specs[1], rows, specs[1].norm_weight)
            (want, _, _), (got, flag, scratch) = [
                _mhc_run(stream, step, cfg, rows, rows % 2 == 0, inputs) for step in steps]
            tag = f"{specs[1].name} rows={rows}"
            want_n, got_n = want["normed"], got["normed"]
            for what in ("streams", "x", "mixes", "coeff"):
                g, w = got[what], want[what]
                assert not np.isnan(g.astype(np.float32)).any(), f"{tag}: {what} unwritten"
                assert np.array_equal(g.view(np.uint8), w.view(np.uint8)), (
                    f"{tag}: {what} differs from _lean at "
                    f"{np.argwhere(g.view(np.uint8) != w.view(np.uint8))[:4].tolist()}")
            assert not np.isnan(got_n.astype(np.float32)).any(), f"{tag}: x_normed unwritten"
            assert np.array_equal(got_n.view(np.uint16), want_n.view(np.uint16)), (
                f"{tag}: x_normed differs from _lean's")
            assert not flag.any(), f"{tag}: timeout flag set: {flag[:4]}"
            assert not scratch.any(), f"{tag}: exchange not left empty"
    finally:
        for step in steps:
            step.close()


@pytest.mark.parametrize("variant", ["lr_rcp", "lean", "lean_poll", "lean_poll_ms"])
def test_mhc_pre_relaunch_reuses_counters(dev, stream, preset_bundle, variant):
    """Two launches on the same counters (the second after the first resets them) both reduce,
    to bitwise equal mixes and coefficients (the reduce order does not depend on timing).
    `_lean_poll`: the same exchange twice (the first launch must leave it empty)."""
    cfg, bundle = preset_bundle
    spec = _mode_spec(cfg, {"lr_rcp": "post_lr_rcp", "lean": "post_lean",
                            "lean_poll": "post_lean_poll_normf32",
                            "lean_poll_ms": "post_lean_poll_ms_normf32"}[variant])
    step = MhcStep(dev, bundle, spec, max_rows=max(ROWS))
    try:
        rows, s, d = 48, spec.streams, spec.width
        x = to_bf16(RNG.standard_normal((rows, s, d)))
        upload(step.arena, "streams", x)
        upload(step.arena, "sub_out", to_bf16(RNG.standard_normal((rows, d))))
        upload(step.arena, "coeff_prev", cases.previous_coefficients(RNG, rows, s))
        upload(step.arena, "fn", (RNG.standard_normal((mk.MIX_DIM, s * d)) / np.sqrt(s * d))
               .astype(np.float32))
        upload(step.arena, "scale", np.array([1, 1, 1, 0], np.float32))
        upload(step.arena, "base", RNG.uniform(-1, 1, mk.MIX_DIM).astype(np.float32))
        results = []
        for _ in range(2):
            poison(step.arena, "mixes")
            poison(step.arena, "coeff_out")
            cp.cuda.Device().synchronize()
            step.launch_pre(rows, cfg.rms_norm_eps, cfg.hc_eps).launch(stream)
            stream.synchronize()
            results.append(np.concatenate(
                [download(step.arena, name, np.float32, (rows, mk.MIX_DIM))
                 for name in ("mixes", "coeff_out")], axis=1))
        assert not np.isnan(results[1]).any(), "second launch: mixes / coefficients unwritten"
        assert np.array_equal(results[0].view(np.uint32), results[1].view(np.uint32)), \
            "the split-K reduce is not deterministic across launches"
        counters = download(step.arena, "counters", np.int32, (mk.counter_count(max(ROWS)),))
        assert not counters.any(), f"{spec.name}: counters / timeout flag left set: {counters}"
        if spec.polled:
            scratch = download(step.arena, "workspace", np.uint8,
                               (mk.workspace_bytes(spec, max(ROWS)),))
            assert not scratch.any(), f"{spec.name}: exchange not left empty"
    finally:
        step.close()


# ---- router ------------------------------------------------------------------------------------

def _launch_router(stream, router, spec, rows: int):
    """Poison the outputs, launch on `rows` rows and wait; (logits, ids, weights, scratch)."""
    a = router.arena
    for name in ("logits", "ids", "weights"):
        poison(a, name)
    cp.cuda.Device().synchronize()
    router.launch(rows).launch(stream)
    stream.synchronize()
    return (download(a, "logits", np.float32, (rows, spec.experts)),
            download(a, "ids", np.int32, (rows, spec.topk)),
            download(a, "weights", np.float32, (rows, spec.topk)),
            download(a, "counters", np.uint8, (spec.scratch_bytes(max(ROWS)),)))


def _router_case(dev, stream, bundle, spec, rows: int, ties: bool):
    x, weight, bias, group = cases.router_inputs(RNG, spec, rows, ties)
    router = Router(dev, bundle, spec, max_rows=max(ROWS))
    try:
        for name, host in (("x", x), ("weight", weight), ("bias", bias)):
            upload(router.arena, name, host)
        outputs = _launch_router(stream, router, spec, rows)
    finally:
        router.close()
    return (x, weight, bias, group, *outputs)


def _check_router(spec, rows, x, weight, bias, group, logits, ids, weights, counters):
    cases.check_router(spec, rows, x, weight, bias, group, logits, ids, weights)
    assert not counters.any(), (f"{spec.name} rows={rows}: scratch not reset (counters, "
                                f"`_tile8p` exchange) at bytes "
                                f"{np.flatnonzero(counters)[:8].tolist()}")


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("variant", ["rb16", "tile8", "tile8p"])
def test_router_matches_reference(dev, stream, preset_bundle, ties, variant):
    """Every router kernel; the one-pass ones also at 8 and 9 rows (a full tile, one row into
    the next)."""
    cfg, bundle = preset_bundle
    default, tile8, tile8p = rk.router_specs(cfg)
    spec = {"rb16": default, "tile8": tile8, "tile8p": tile8p}[variant]
    for rows in ROWS + ((8, 9) if spec.one_pass else ()):
        _check_router(spec, rows, *_router_case(dev, stream, bundle, spec, rows, ties))


@pytest.mark.parametrize("variant", [1, 2])
def test_router_relaunch_reuses_scratch(dev, stream, preset_bundle, variant):
    """`_tile8` / `_tile8p` launched 3 times on one arena (the step's 40 layers share one scratch),
    fresh x each time and R = 8, 3, 6 (fewer rows than before: a stale exchange word or counter
    of an earlier launch would be taken as this launch's): every launch matches its reference."""
    cfg, bundle = preset_bundle
    spec = rk.router_specs(cfg)[variant]
    e, d = spec.experts, spec.hidden
    router = Router(dev, bundle, spec, max_rows=max(ROWS))
    try:
        weight = to_bf16(RNG.standard_normal((e, d)) / np.sqrt(d))
        bias = RNG.uniform(-0.3, 0.3, e).astype(np.float32)
        upload(router.arena, "weight", weight)
        upload(router.arena, "bias", bias)
        for rows in (8, 3, 6):
            x = to_bf16(RNG.standard_normal((rows, d)))
            upload(router.arena, "x", x)
            _check_router(spec, rows, x, weight, bias, None,
                          *_launch_router(stream, router, spec, rows))
    finally:
        router.close()
