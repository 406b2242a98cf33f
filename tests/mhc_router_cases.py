"""Inputs and checks of the mHC step and router kernel tests, shared by the GPU test
(tests/gpu/test_mhc_router.py) and its CPU emulator twin (tests/test_emulate_mhc_router.py).

The tolerances and why the arithmetic justifies them are stated in the GPU test's docstring; here
they are code. References only (kernels/*_ref.py): the device machine has no CuTe DSL.
"""
from __future__ import annotations

import numpy as np

from kernels import mhc_kernel_ref as mk
from kernels import mhc_ref
from kernels import norm_ref as nr
from kernels import router_ref as rk
from kernels.common_ref import to_bf16

PP_ATOL = 1e-5                  # pre/post: sigmoid of the same fp32 mixes
COMB_ATOL = 1e-5                # comb: fp32 Sinkhorn in another summation order
ROUTE_REL = 2.0**-17            # router selection margin and route weights, relative


def within(got, want, bound, what: str) -> None:
    """Every element written (no NaN) and |got - want| <= bound (a scalar or per element)."""
    got64, want64 = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert not np.isnan(got64).any(), f"{what}: unwritten (NaN) elements"
    bad = np.argwhere(np.abs(got64 - want64) > bound)
    if len(bad):
        i = tuple(bad[0])
        b = bound[i] if np.ndim(bound) else bound
        raise AssertionError(f"{what}: {len(bad)} elements out of bound, first at {i}: got "
                             f"{got64[i]!r} want {want64[i]!r} bound {b!r}")


# ---- mHC ---------------------------------------------------------------------------------------

def previous_coefficients(rng, rows: int, streams: int) -> np.ndarray:
    """A previous sublayer's packed coefficients: M2 of random mixes (post in (0, 2), comb
    near doubly stochastic, pre > 0); one stream: a one-hot pre."""
    mixes = rng.standard_normal((rows, mk.MIX_DIM)).astype(np.float32)
    c = mhc_ref.hc_coefficients(mixes, rng.uniform(0.5, 2, 3).astype(np.float32),
                                rng.uniform(-1, 1, mk.MIX_DIM).astype(np.float32), mk.HC_MULT,
                                20, 1e-6)
    packed = mk.pack_coefficients(c)
    if streams == 1:
        packed[:, :mk.HC_MULT] = mhc_ref.one_hot_pre(rows, mk.HC_MULT)
    return packed


def mhc_inputs(rng, spec, rows: int, norm_weight: str) -> dict:
    """Fresh inputs of one launch, by arena slice name: X, f, coeff_prev, fn, scale (3 used, a
    zero pad), base and the RMSNorm weight (bf16 values when `norm_weight` is 'bf16')."""
    s, d, m = spec.streams, spec.width, mk.MIX_DIM
    w = rng.uniform(-2, 2, d).astype(np.float32)
    return {"streams": to_bf16(rng.standard_normal((rows, s, d)) * rng.uniform(0.05, 20)),
            "sub_out": to_bf16(rng.standard_normal((rows, d)) * rng.uniform(0.05, 20)),
            "coeff_prev": previous_coefficients(rng, rows, s),
            "fn": (rng.standard_normal((m, s * d)) * rng.uniform(0.3, 3) / np.sqrt(s * d))
            .astype(np.float32),
            "scale": np.append(rng.uniform(0.5, 2, 3), 0).astype(np.float32),
            "base": rng.uniform(-1, 1, m).astype(np.float32),
            "norm_weight": to_bf16(w) if norm_weight == "bf16" else w}


def check_mhc_values(spec, cfg, rows: int, inputs: dict, got: dict) -> None:
    """One launch's outputs (`got`: streams = X', x, normed, mixes, coeff, and optionally the
    split-K workspace [slices, rows, PARTIAL_STRIDE]) against the references, downstream ones
    fed with the launch's own upstream outputs."""
    tag, s = f"{spec.name} rows={rows}", spec.streams
    x, fn, eps = inputs["streams"], inputs["fn"], cfg.rms_norm_eps
    pc = mk.unpack_coefficients(inputs["coeff_prev"])
    if spec.mode != "plain":
        f = inputs["sub_out"].astype(np.float64)
        exact = (pc.post[:, :, None].astype(np.float64) * f[:, None, :]
                 + np.einsum("rjk,rjd->rkd", pc.comb.astype(np.float64), x.astype(np.float64)))
        terms = (np.abs(pc.post)[:, :, None] * np.abs(f)[:, None, :]
                 + np.einsum("rjk,rjd->rkd", np.abs(pc.comb).astype(np.float64),
                             np.abs(x.astype(np.float64))))
        within(got["streams"], exact, mk.rounding_bound(exact, terms, 5), f"{tag}: X'")
    else:
        assert np.array_equal(got["streams"].view(np.uint16), x.view(np.uint16)), \
            f"{tag}: X changed"
    xn = got["streams"].astype(np.float64)
    collapse = np.einsum("rn,rnd->rd", pc.pre[:, :s].astype(np.float64), xn)
    cterms = np.einsum("rn,rnd->rd", np.abs(pc.pre[:, :s]).astype(np.float64), np.abs(xn))
    within(got["x"], collapse, mk.rounding_bound(collapse, cterms, s + 1), f"{tag}: collapse")
    want_norm = nr.rmsnorm_ref(got["x"], inputs["norm_weight"], eps)
    assert np.array_equal(got["normed"].view(np.uint16), want_norm.view(np.uint16)), \
        f"{tag}: rmsnorm"
    if spec.mode == "postonly":
        return
    want = mk.finish_ref(got["streams"], pc.pre[:, :s], fn, inputs["scale"][:3], inputs["base"],
                         eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)
    bound = mk.mixes_bound(got["streams"], fn, eps)
    within(got["mixes"], want.mixes, bound, f"{tag}: mixes")
    # Coefficients from the kernel's own mixes.
    ref = mk.pack_coefficients(mhc_ref.hc_coefficients(
        got["mixes"], inputs["scale"][:3], inputs["base"], mk.HC_MULT, cfg.hc_sinkhorn_iters,
        cfg.hc_eps))
    within(got["coeff"][:, :8], ref[:, :8], PP_ATOL, f"{tag}: pre/post")
    within(got["coeff"][:, 8:], ref[:, 8:], COMB_ATOL, f"{tag}: comb")
    comb = got["coeff"][:, 8:].reshape(rows, 4, 4).astype(np.float64)
    within(comb.sum(axis=1), np.ones((rows, 4)), 1e-5, f"{tag}: comb column sums")
    ref_rows = ref[:, 8:].reshape(rows, 4, 4).astype(np.float64).sum(axis=2)
    within(comb.sum(axis=2), ref_rows, 1e-5, f"{tag}: comb row sums")
    if got.get("workspace") is None:
        return
    # The split-K scratch: Σ over slices of the partials, scaled by rstd, is the mixes.
    sums = got["workspace"].astype(np.float64).sum(axis=0)
    rstd = 1.0 / np.sqrt(sums[:, mk.MIX_DIM:mk.PARTIALS] / (s * spec.width) + eps)
    within(sums[:, :mk.MIX_DIM] * rstd, want.mixes, bound, f"{tag}: workspace partials")


# ---- router ------------------------------------------------------------------------------------

def router_inputs(rng, spec, rows: int, ties: bool):
    """x, weight, bias and the tied expert group (None without ties) of one router launch."""
    e, d = spec.experts, spec.hidden
    x = to_bf16(rng.standard_normal((rows, d)) * rng.uniform(0.1, 3))
    weight = to_bf16(rng.standard_normal((e, d)) * rng.uniform(0.3, 3) / np.sqrt(d))
    bias = rng.uniform(-0.3, 0.3, e).astype(np.float32)
    group = None
    if ties:        # 7 equal weight rows and bias on top: the top 6 are the lowest 6 of them
        group = np.sort(rng.choice(e, 7, replace=False))
        weight[group] = weight[group[0]]
        bias[group] = np.float32(8.0)
    return x, weight, bias, group


def check_router(spec, rows, x, weight, bias, group, logits, ids, weights) -> None:
    """Logits within `logits_bound`; ids exact where the reference margin is clear, else a value
    within it; ties to the lower index; route weights 2^-17 relative."""
    tag = f"{spec.name} rows={rows}"
    within(logits, rk.logits_f64(x, weight), rk.logits_bound(x, weight), f"{tag}: logits")
    want = rk.select_from_logits(logits, bias, spec.topk, spec.scaling)
    assert ((ids >= 0) & (ids < spec.experts)).all(), f"{tag}: ids out of range: {ids}"
    assert all(len(set(r)) == spec.topk for r in ids.tolist()), f"{tag}: repeated ids"
    sel = want.selection.astype(np.float64)
    ordered = -np.sort(-sel, axis=1)[:, :spec.topk + 1]
    margin = ROUTE_REL * np.abs(ordered).max(axis=1, keepdims=True)
    gaps = ordered[:, :-1] - ordered[:, 1:]
    clear = (gaps > margin) & np.concatenate([np.ones((rows, 1), bool),
                                              gaps[:, :-1] > margin], axis=1)
    bad = clear & (ids != want.ids)
    assert not bad.any(), (f"{tag}: ids differ where the reference margin is clear: rows "
                           f"{np.argwhere(bad)[:4].tolist()}, got {ids[bad][:4]} want "
                           f"{want.ids[bad][:4]}")
    got_sel = np.take_along_axis(sel, ids.astype(np.int64), axis=1)
    within(got_sel, ordered[:, :spec.topk], np.broadcast_to(margin, got_sel.shape),
           f"{tag}: chosen selection values")
    if group is not None:
        assert (logits[:, group] == logits[:, group[:1]]).all(), f"{tag}: equal rows, unequal logits"
        assert (ids == group[:spec.topk]).all(), f"{tag}: ties not broken to the lower index"
    scores = np.sqrt(np.logaddexp(0.0, logits.astype(np.float64)))
    chosen = np.take_along_axis(scores, ids.astype(np.int64), axis=1)
    exp_w = chosen / (chosen.sum(axis=1, keepdims=True) + 1e-20) * spec.scaling
    within(weights, exp_w, ROUTE_REL * np.abs(exp_w) + 1e-30, f"{tag}: route weights")
