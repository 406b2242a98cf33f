"""CPU tests of the mHC step and router kernels' specs, references, and NumPy models of their
lane-level data movement (split-K slicing, the half-warp Sinkhorn, the warp arg-max top-k).

The models replay in fp32 what kernels/mhc.py and kernels/router.py do lane by lane; a wrong
slice offset, lane mapping or tie rule fails here before any GPU run.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kernels import mhc_kernel_ref as mk
from kernels import mhc_ref, moe_ref
from kernels import router_ref as rk
from kernels.common_ref import to_bf16
from loader.config import ModelConfig

RNG = np.random.default_rng()
CONFIGS = ("tiny", "v41-flash")


# ---- specs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("config", CONFIGS)
def test_mhc_specs_and_bytes(config):
    cfg = ModelConfig.preset(config)
    specs = mk.mhc_specs(cfg)
    d = cfg.hidden_size
    assert [s.name for s in specs] == [f"mhc_pre_d{d}_s4_post_lr_rcp", f"mhc_pre_d{d}_s1_plain",
                                       f"mhc_pre_d{d}_s4_postonly", f"mhc_pre_d{d}_s4_post_lean",
                                       f"mhc_pre_d{d}_s4_plain_lean",
                                       f"mhc_pre_d{d}_s1_plain_lean",
                                       f"mhc_pre_d{d}_s4_post_lean_normbf16",
                                       f"mhc_pre_d{d}_s4_post_lean_normf32",
                                       f"mhc_pre_d{d}_s4_post_lean_poll_normbf16",
                                       f"mhc_pre_d{d}_s4_post_lean_poll_normf32",
                                       f"mhc_pre_d{d}_s4_post_lean_poll_ms_normbf16",
                                       f"mhc_pre_d{d}_s4_post_lean_poll_ms_normf32"]
    post, lean, fused, polled = specs[0], specs[3], specs[7], specs[9]
    assert fused.bytes_moved(1) == post.bytes_moved(1) + (2 + 4) * d
    assert fused.smem_bytes == lean.smem_bytes == polled.smem_bytes == specs[11].smem_bytes
    assert specs[11].mix_split and mk.workspace_bytes(specs[11], 8) == mk.workspace_bytes(
        polled, 8)
    for spec in specs:
        assert mk.spec_from_dict(spec.to_dict()) == spec
    # The exchange: [25, slices] partial words, then D/2 words of bf16 pairs, 16-byte aligned.
    assert polled.exchange_x_offset == 8 * 25 * (d // 64) and polled.exchange_x_offset % 16 == 0
    assert polled.exchange_row_bytes == polled.exchange_x_offset + 4 * d
    assert mk.workspace_bytes(polled, 8) == 8 * polled.exchange_row_bytes
    assert mk.workspace_bytes(post, 8) == 4 * (d // 64) * 8 * 32
    assert post.grid(1) == (cfg.hidden_size // 64, 1, 1)
    assert post.grid(192) == (cfg.hidden_size // 64, 6, 1)
    assert polled.grid(192) == post.grid(192)
    assert post.smem_bytes <= 48 * 1024        # no opt-in needed
    fn_bytes = 4 * 24 * 4 * cfg.hidden_size
    assert post.bytes_moved(1) - fn_bytes == (2 * 4 + 2 + 2 + 2 * 4) * cfg.hidden_size + 4 * 72
    if config == "v41-flash":
        assert fn_bytes == 1_966_080                 # the 1.97 MB of fn per sublayer
    postonly = specs[2]
    assert postonly.bytes_moved(1) == post.bytes_moved(1) - fn_bytes - 4 * 48
    assert postonly.smem_bytes == 0
    for bad_rows in (0, mk.MAX_ROWS + 1):
        with pytest.raises(ValueError, match="rows"):
            post.grid(bad_rows)


def test_mhc_spec_validation():
    with pytest.raises(ValueError, match="mode"):
        mk.make_spec(256, 4, "pre", 20)
    with pytest.raises(ValueError, match="multiple of 64"):
        mk.make_spec(200, 4, "post", 20)
    with pytest.raises(ValueError, match="streams"):
        mk.make_spec(256, 1, "post", 20)
    with pytest.raises(ValueError, match="streams"):
        mk.make_spec(256, 1, "postonly", 20)
    with pytest.raises(ValueError, match="Sinkhorn"):
        mk.make_spec(256, 4, "post", 0)
    with pytest.raises(ValueError, match="live_rows"):
        mk.make_spec(256, 4, "postonly", 20, live_rows=True)
    with pytest.raises(ValueError, match="approx_rcp"):
        mk.make_spec(256, 4, "postonly", 20, approx_rcp=True)
    for flags in ({"live_rows": True}, {"approx_rcp": True}):
        with pytest.raises(ValueError, match="lean"):
            mk.make_spec(256, 4, "post", 20, lean=True, **flags)
    with pytest.raises(ValueError, match="lean"):
        mk.make_spec(256, 4, "postonly", 20, lean=True)
    with pytest.raises(ValueError, match="chunks"):
        mk.make_spec(64 * 24, 4, "post", 20, lean=True)        # 24 slices: no 16-slice chunks
    with pytest.raises(ValueError, match="with lean"):
        mk.make_spec(256, 4, "post", 20, norm_weight="f32")
    with pytest.raises(ValueError, match="RMSNorm weight 'f16'"):
        mk.make_spec(256, 4, "post", 20, lean=True, norm_weight="f16")
    for flags, slices in (({"norm_weight": "f32"}, 4), ({"lean": True}, 4),
                          ({"lean": True, "norm_weight": "f32", "width": 64 * 3}, 3)):
        with pytest.raises(ValueError, match=f"polled.*got {slices}"):
            mk.make_spec(flags.pop("width", 256), 4, "post", 20, polled=True, **flags)
    with pytest.raises(ValueError, match="mix_split"):
        mk.make_spec(256, 4, "post", 20, lean=True, norm_weight="f32", mix_split=True)


@pytest.mark.parametrize("width, chunks", [(256, 1), (5120, 5), (64 * 32, 2)])
def test_lean_smem_holds_the_chunk_sums(width, chunks):
    """The lean reduce writes [32 rows, 25, chunks] chunk sums into the fn region, then the
    reduced [32, 32] sums, a flag, the norm's warp totals and the staged scale / base after it;
    the default variants keep their layout."""
    for streams, mode in ((4, "post"), (4, "plain"), (1, "plain")):
        lean = mk.make_spec(width, streams, mode, 20, lean=True)
        default = mk.make_spec(width, streams, mode, 20)
        assert lean.reduce_chunks == chunks
        assert lean.fn_region_bytes >= 4 * mk.ROWS_PER_CTA * mk.PARTIALS * chunks
        assert lean.fn_region_bytes >= default.fn_region_bytes == 4 * 24 * streams * 64
        assert lean.smem_bytes == lean.fn_region_bytes + 4 * 32 * 32 + 16 + 16 + 128 <= 48 * 1024
        assert default.smem_bytes == default.fn_region_bytes + 4 * 32 * 32 + 16


@pytest.mark.parametrize("config", CONFIGS)
def test_router_specs_and_bytes(config):
    cfg = ModelConfig.preset(config)
    spec, tile, polled = rk.router_specs(cfg)
    assert spec.name == f"router_e{cfg.n_routed_experts}_d{cfg.hidden_size}_k6"
    assert tile.name == spec.name + "_tile8" and tile.one_pass and not tile.polled
    assert polled == dataclasses.replace(tile, name=tile.name + "p", polled=True)
    assert rk.spec_from_dict(polled.to_dict()) == polled
    assert tile.scratch_bytes(9) == 4 * 2 and spec.scratch_bytes(9) == 4
    assert polled.scratch_bytes(9) == rk.EXCHANGE_OFFSET + 8 * 9 * cfg.n_routed_experts
    assert rk.EXCHANGE_OFFSET >= 4 * rk.counter_count(rk.MAX_ROWS, tile.rows_per_cta)
    epc = 3 if cfg.n_routed_experts % 3 == 0 else 2
    assert tile.grid(6) == (cfg.n_routed_experts // epc, 1, 1)
    assert tile.grid(9) == (cfg.n_routed_experts // epc, 2, 1)
    assert tile.threads * tile.vecs_per_thread * 8 == cfg.hidden_size
    assert tile.threads % 32 == 0 and tile.threads <= 1024
    assert rk.spec_from_dict(tile.to_dict()) == tile
    assert rk.spec_from_dict(spec.to_dict()) == spec
    if config == "v41-flash":
        assert (tile.threads, tile.experts_per_cta, tile.grid(8)[0]) == (320, 3, 128)
    assert spec.grid(6) == (cfg.n_routed_experts // 2, 1, 1)
    assert spec.grid(192) == (cfg.n_routed_experts // 2, 12, 1)
    assert spec.threads * spec.vecs_per_thread * 8 == cfg.hidden_size
    if config == "v41-flash":
        assert spec.bytes_moved(0) - 4 * 384 == 3_932_160   # the 3.9 MB BF16 gate per layer
    with pytest.raises(ValueError, match="rows"):
        spec.grid(rk.MAX_ROWS + 1)
    with pytest.raises(ValueError, match="multiple of 256"):
        rk.make_spec(200, 16, 6, 1.5)
    with pytest.raises(ValueError, match="row block"):
        rk.make_spec(256, 16, 6, 1.5, rows_per_cta=8)
    with pytest.raises(ValueError, match="even expert count"):
        rk.make_spec(256, 15, 6, 1.5)
    with pytest.raises(ValueError, match="one-pass row tile"):
        rk.make_spec(256, 16, 6, 1.5, rows_per_cta=16, one_pass=True)
    with pytest.raises(ValueError, match="polled"):
        rk.make_spec(256, 16, 6, 1.5, polled=True)


# ---- mHC reference and kernel models -------------------------------------------------------------

def _inputs(rows: int, width: int):
    x = to_bf16(RNG.standard_normal((rows, 4, width)) * RNG.uniform(0.1, 10))
    f = to_bf16(RNG.standard_normal((rows, width)))
    mixes = RNG.standard_normal((rows, 24)).astype(np.float32)
    prev = mhc_ref.hc_coefficients(mixes, np.ones(3, np.float32),
                                   RNG.uniform(-1, 1, 24).astype(np.float32), 4, 20, 1e-6)
    fn = (RNG.standard_normal((24, 4 * width)) / np.sqrt(4 * width)).astype(np.float32)
    return x, f, prev, fn


def test_pack_unpack_round_trip():
    _, _, prev, _ = _inputs(7, 64)
    back = mk.unpack_coefficients(mk.pack_coefficients(prev))
    for a, b in ((prev.pre, back.pre), (prev.post, back.post), (prev.comb, back.comb)):
        assert np.array_equal(a, b)
    with pytest.raises(ValueError, match="24"):
        mk.unpack_coefficients(np.zeros((2, 23), np.float32))


def test_mhc_pre_ref_is_the_step_composition():
    """post -> mixes -> coefficients, collapse with the previous pre: as executor/reference/step
    composes mhc_ref (apply_pending, _coefficients, hc_collapse with the carried pre)."""
    rows, width = 5, 128
    x, f, prev, fn = _inputs(rows, width)
    scale = RNG.uniform(0.5, 2, 3).astype(np.float32)
    base = RNG.uniform(-1, 1, 24).astype(np.float32)
    out = mk.mhc_pre_ref("post", x, f, mk.pack_coefficients(prev), fn, scale, base, 1e-20,
                         1e-6, 20)
    x_new = mhc_ref.hc_post(f, x, prev)
    mixes = mhc_ref.hc_mixes(x_new, fn, 1e-20)
    coeff = mhc_ref.hc_coefficients(mixes, scale, base, 4, 20, 1e-6)
    assert np.array_equal(out.streams.view(np.uint16), x_new.view(np.uint16))
    assert np.array_equal(out.mixes, mixes)
    assert np.array_equal(out.coeff, mk.pack_coefficients(coeff))
    assert np.array_equal(out.x.view(np.uint16),
                          mhc_ref.hc_collapse(x_new, prev.pre).view(np.uint16))
    plain = mk.mhc_pre_ref("plain", x, None, mk.pack_coefficients(prev), fn, scale, base,
                           1e-20, 1e-6, 20)
    assert np.array_equal(plain.mixes, mhc_ref.hc_mixes(x, fn, 1e-20))


def split_k_mixes(x_new: np.ndarray, fn: np.ndarray, eps: float, chunk: int = 0) -> np.ndarray:
    """fp32 model of the kernel's sum: thread (slice, dv) sums its 8 d of every stream in order
    (squares first, then per m: stream j, d), 8 lanes meet in a butterfly (xor 4, 2, 1), the last
    CTA adds slices in slice order (`chunk` > 0, lean: each run of `chunk` slices in order, then
    the chunk sums in chunk order), then mixes = dot · 1/sqrt(Σx²/(S·D) + eps)."""
    rows, s, d = x_new.shape
    x = x_new.astype(np.float32).reshape(rows, s, d // 64, 8, 8)     # [r, j, slice, dv, e]
    f = fn.astype(np.float32).reshape(24, s, d // 64, 8, 8)
    part = np.zeros((rows, d // 64, 8, 25), np.float32)
    for j in range(s):
        for e in range(8):
            part[..., 24] += x[:, j, :, :, e] * x[:, j, :, :, e]
    for m in range(24):
        for j in range(s):
            for e in range(8):
                part[..., m] += x[:, j, :, :, e] * f[m, j, :, :, e][None]
    lanes = np.arange(8)
    for off in (4, 2, 1):
        part = part + part[:, :, lanes ^ off]
    part = part[:, :, 0]                                               # [r, slice, 25]
    chunk = chunk or d // 64
    sums = []
    for start in range(0, d // 64, chunk):
        t = part[:, start]
        for sl in range(start + 1, start + chunk):
            t = t + part[:, sl]
        sums.append(t)
    total = sums[0]
    for t in sums[1:]:
        total = total + t
    rstd = np.float32(1) / np.sqrt(total[:, 24] / np.float32(s * d) + np.float32(eps))
    return (total[:, :24] * rstd[:, None]).astype(np.float32)


@pytest.mark.parametrize("width", [256, 5120])
@pytest.mark.parametrize("lean", [False, True])
def test_split_k_slicing_covers_every_element_within_the_bound(width, lean):
    rows = 3
    chunk = min(mk.REDUCE_CHUNK, width // 64) if lean else 0
    x, _, _, fn = _inputs(rows, width)
    got = split_k_mixes(x, fn, 1e-20, chunk)
    want = mhc_ref.hc_mixes(x, fn, 1e-20)
    bound = mk.mixes_bound(x, fn, 1e-20)
    assert (np.abs(got.astype(np.float64) - want) <= bound).all()
    # A slicing error (one slice dropped) is far outside the bound.
    x_bad = x.copy()
    x_bad[:, :, 64:128] = 0
    assert (np.abs(split_k_mixes(x_bad, fn, 1e-20, chunk) - want) > bound).any()


def half_warp_sinkhorn(logits: np.ndarray, iters: int, eps: float,
                       rcp_rng=None) -> np.ndarray:
    """fp32 model of `_sinkhorn`: lane l of a half-warp holds comb[l // 4, l % 4]; row sums are
    the butterfly over lanes xor 1, 2, column sums over xor 4, 8: (a + b) + (c + d).
    `rcp_rng`: the `approx_rcp` variant, v·rcp(total) with the reciprocal off by a random
    +-1 ulp (rcp.approx.ftz's bound) and the product rounded to fp32."""
    lanes = np.arange(16)
    v = logits.astype(np.float32).reshape(-1, 16)
    eps = np.float32(eps)

    def sum4(a, stride):
        t = a + a[:, lanes ^ stride]
        return t + t[:, lanes ^ (2 * stride)]

    def normalise(a, total):
        if rcp_rng is None:
            return a / total
        r = np.float32(1) / total
        r = (r * (1 + rcp_rng.choice([-1, 1], r.shape) * 2.0**-23)).astype(np.float32)
        return a * r

    mx = np.maximum(v, v[:, lanes ^ 1])
    mx = np.maximum(mx, mx[:, lanes ^ 2])
    e = np.exp(v - mx)
    c = normalise(e, sum4(e, 1)) + eps
    c = normalise(c, sum4(c, 4) + eps)
    for _ in range(iters - 1):
        c = normalise(c, sum4(c, 1) + eps)
        c = normalise(c, sum4(c, 4) + eps)
    return c.reshape(-1, 4, 4)


@pytest.mark.parametrize("sd", [0.5, 3.0, 10.0])
def test_approx_rcp_sinkhorn_within_the_gpu_tolerance(sd):
    """The `_rcp` variant's normalisations (1 ulp reciprocal + a rounded product) stay within
    COMB_ATOL of mhc_ref.sinkhorn, columns still sum to 1 within 1e-5, and the model is not
    vacuous: it differs from the div.rn model."""
    logits = (RNG.standard_normal((4000, 4, 4)) * sd).astype(np.float32)
    got = half_warp_sinkhorn(logits, 20, 1e-6, rcp_rng=RNG)
    want = mhc_ref.sinkhorn(logits, 20, 1e-6)
    assert np.abs(got - want).max() <= 1e-5
    assert np.abs(got.sum(axis=1) - 1).max() <= 1e-5
    assert not np.array_equal(got, half_warp_sinkhorn(logits, 20, 1e-6))


def thread_sinkhorn(logits: np.ndarray, iters: int, eps: float, rng) -> np.ndarray:
    """fp32 model of the lean `_lean_sinkhorn`: one thread holds c[j, k] in registers; a row or
    column sum is (a + b) + (c + d); each normalisation is v·rcp(total) with the reciprocal off
    by a random +-1 ulp (rcp.approx.ftz's bound) and the product rounded to fp32."""
    c = logits.astype(np.float32).reshape(-1, 4, 4)
    eps = np.float32(eps)

    def rcp(total):
        r = np.float32(1) / total
        return (r * (1 + rng.choice([-1, 1], r.shape) * 2.0**-23)).astype(np.float32)

    def rows_of(a):
        return ((a[:, :, 0] + a[:, :, 1]) + (a[:, :, 2] + a[:, :, 3]))[:, :, None]

    def cols_of(a):
        return ((a[:, 0] + a[:, 1]) + (a[:, 2] + a[:, 3]))[:, None, :]

    mx = np.maximum(np.maximum(c[:, :, 0], c[:, :, 1]), np.maximum(c[:, :, 2], c[:, :, 3]))
    e = np.exp(c - mx[:, :, None])
    c = e * rcp(rows_of(e)) + eps
    c = c * rcp(cols_of(c) + eps)
    for _ in range(iters - 1):
        c = c * rcp(rows_of(c) + eps)
        c = c * rcp(cols_of(c) + eps)
    return c


@pytest.mark.parametrize("sd", [0.5, 3.0, 10.0])
def test_lean_thread_sinkhorn_within_the_gpu_tolerance(sd):
    """The lean tail's register Sinkhorn (a thread per row, rcp.approx) stays within COMB_ATOL
    of mhc_ref.sinkhorn with columns summing to 1 within 1e-5; swapping its row and column
    sums (normalising rows last) is detected on skewed logits."""
    logits = (RNG.standard_normal((4000, 4, 4)) * sd).astype(np.float32)
    got = thread_sinkhorn(logits, 20, 1e-6, RNG)
    want = mhc_ref.sinkhorn(logits, 20, 1e-6)
    assert np.abs(got - want).max() <= 1e-5
    assert np.abs(got.sum(axis=1) - 1).max() <= 1e-5
    skewed = (RNG.standard_normal((2000, 4, 4)) * 3).astype(np.float32)
    wrong = thread_sinkhorn(skewed.transpose(0, 2, 1), 20, 1e-6, RNG).transpose(0, 2, 1)
    assert np.abs(wrong.sum(axis=1) - 1).max() > 1e-3


def test_half_warp_sinkhorn_lane_mapping():
    logits = (RNG.standard_normal((2000, 4, 4)) * RNG.uniform(0.5, 3)).astype(np.float32)
    got = half_warp_sinkhorn(logits, 20, 1e-6)
    want = mhc_ref.sinkhorn(logits, 20, 1e-6)
    assert np.abs(got - want).max() <= 1e-5           # the GPU test's COMB_ATOL
    assert np.abs(got.sum(axis=1) - 1).max() <= 1e-5  # columns (source j summed) are stochastic
    # A transposed lane mapping normalises rows last, so columns stop summing to 1 (visible on
    # skewed logits, where 20 rounds leave rows ~1e-2 from stochastic): detected.
    skewed = (RNG.standard_normal((2000, 4, 4)) * 3).astype(np.float32)
    wrong = half_warp_sinkhorn(skewed.transpose(0, 2, 1), 20, 1e-6).transpose(0, 2, 1)
    assert np.abs(wrong.sum(axis=1) - 1).max() > 1e-3


# ---- router reference and the warp top-k model ---------------------------------------------------

def test_select_from_logits_matches_moe_ref_route():
    rows, d, e = 9, 256, 16
    x = to_bf16(RNG.standard_normal((rows, d)))
    w = to_bf16(RNG.standard_normal((e, d)) / 16)
    bias = RNG.uniform(-0.3, 0.3, e).astype(np.float32)
    want = moe_ref.route(x, w, bias, 6, 1.5)
    got = rk.select_from_logits(moe_ref.matmul_t(x, w), bias, 6, 1.5)
    assert np.array_equal(got.ids, want.experts)
    assert np.array_equal(got.weights, want.weights)


def warp_topk(selection: np.ndarray, k: int) -> np.ndarray:
    """Model of `_select`: lane l holds experts l + 32c; per round the lane-local best (strict >,
    ascending c), then a butterfly keeping (larger value, or equal value and lower index)."""
    rows, e = selection.shape
    per_lane = -(-e // 32)
    padded = np.full((rows, 32 * per_lane), -np.inf, np.float32)
    padded[:, :e] = selection
    sel = padded.reshape(rows, per_lane, 32).copy()                  # [r, c, lane]
    out = np.zeros((rows, k), np.int64)
    lanes = np.arange(32)
    for slot in range(k):
        best_v, best_i = sel[:, 0].copy(), np.broadcast_to(lanes, (rows, 32)).copy()
        for c in range(1, per_lane):
            better = sel[:, c] > best_v
            best_v = np.where(better, sel[:, c], best_v)
            best_i = np.where(better, lanes + 32 * c, best_i)
        for off in (16, 8, 4, 2, 1):
            ov, oi = best_v[:, lanes ^ off], best_i[:, lanes ^ off]
            take = (ov > best_v) | ((ov == best_v) & (oi < best_i))
            best_v, best_i = np.where(take, ov, best_v), np.where(take, oi, best_i)
        assert (best_i == best_i[:, :1]).all()                      # every lane agrees
        out[:, slot] = best_i[:, 0]
        sel[np.arange(rows), best_i[:, 0] // 32, best_i[:, 0] % 32] = -np.inf
    return out


@pytest.mark.parametrize("experts", [16, 384])
def test_warp_topk_ties_to_lower_index(experts):
    rows = 200
    # Few distinct values: many exact ties, at the top-6 boundary too.
    sel = RNG.integers(0, 5, (rows, experts)).astype(np.float32)
    want = np.argsort(-sel, axis=1, kind="stable")[:, :6]
    assert np.array_equal(warp_topk(sel, 6), want)
    sel = RNG.standard_normal((rows, experts)).astype(np.float32)
    assert np.array_equal(warp_topk(sel, 6), np.argsort(-sel, axis=1, kind="stable")[:, :6])


def test_logits_bound_holds_for_a_kernel_order_sum():
    """fp32 sum in the kernel's order (thread vectors in order, butterfly, warps in order)."""
    rows, d, e = 4, 5120, 8
    x = to_bf16(RNG.standard_normal((rows, d)) * 3)
    w = to_bf16(RNG.standard_normal((e, d)) / 70)
    t = 128
    prod = (x.astype(np.float32)[:, None, :] * w.astype(np.float32)[None]).reshape(
        rows, e, d // 8 // t, t, 8)                                  # [r, e, i, thread, elem]
    acc = np.zeros((rows, e, t), np.float32)
    for i in range(prod.shape[2]):
        for k in range(8):
            acc = acc + prod[:, :, i, :, k]
    acc = acc.reshape(rows, e, 4, 32)
    lanes = np.arange(32)
    for off in (16, 8, 4, 2, 1):
        acc = acc + acc[..., lanes ^ off]
    total = acc[..., 0, 0]
    for warp in range(1, 4):
        total = total + acc[..., warp, 0]
    err = np.abs(total - rk.logits_f64(x, w))
    assert (err <= rk.logits_bound(x, w)).all()


# ---- the one-pass `_tile8` kernel's lane-level models (kernels/router_tile.py) -------------------

def reduce_scatter(vals: np.ndarray) -> np.ndarray:
    """Model of `_tile_logits`' warp reduction: vals [32 lanes, N] fp32 -> totals [N], read from
    the lanes that store them (lane % 4 == 0, slot base + m)."""
    lanes = np.arange(32)
    cur, base = vals.astype(np.float32), np.zeros(32, np.int64)
    for off in (16, 8, 4):
        h = cur.shape[1] // 2
        upper = (lanes & off) != 0
        keep = np.where(upper[:, None], cur[:, h:], cur[:, :h])
        send = np.where(upper[:, None], cur[:, :h], cur[:, h:])
        cur = keep + send[lanes ^ off]
        base = base + np.where(upper, h, 0)
    for off in (2, 1):
        cur = cur + cur[lanes ^ off]
    out = np.full(vals.shape[1], np.nan, np.float32)
    for lane in range(0, 32, 4):
        for m in range(cur.shape[1]):
            assert np.isnan(out[base[lane] + m]), "two lanes store one slot"
            out[base[lane] + m] = cur[lane, m]
    return out


def butterfly(vals: np.ndarray) -> np.ndarray:
    """The default kernel's full butterfly (every lane ends with the total), lane 0's."""
    lanes = np.arange(32)
    cur = vals.astype(np.float32)
    for off in (16, 8, 4, 2, 1):
        cur = cur + cur[lanes ^ off]
    return cur[0]


@pytest.mark.parametrize("n", [16, 24])
def test_reduce_scatter_is_the_butterfly_bitwise(n):
    """Every slot written once, with the full butterfly's fp32 value (same pairing tree), so
    equal weight rows keep giving bitwise equal logits; a slot mapping off by one is caught."""
    vals = (RNG.standard_normal((32, n)) * 10.0 ** RNG.integers(-3, 4, (32, n))).astype(
        np.float32)
    got = reduce_scatter(vals)
    assert np.array_equal(got, butterfly(vals))
    assert not np.array_equal(np.roll(got, 1), butterfly(vals))
    same = np.repeat(vals[:, :1], n, axis=1)                   # equal columns: equal totals
    assert (reduce_scatter(same) == reduce_scatter(same)[0]).all()


def order_key(v: np.ndarray) -> np.ndarray:
    """kernels/router_tile.order_key: int32 keys whose signed order is the float order."""
    b = v.astype(np.float32).view(np.int32)
    return b ^ ((b >> 31) & np.int32(0x7FFFFFFF))


def redux_topk(selection: np.ndarray, k: int) -> np.ndarray:
    """Model of `_select` in `_tile8`: lane-local best key (a pairwise tree, strict >), warp max of
    the keys (redux.max), warp min of the indices holding it (redux.min), the owner masks."""
    rows, e = selection.shape
    per_lane = -(-e // 32)
    keys = np.full((rows, per_lane * 32), -(2**31), np.int64)
    keys[:, :e] = order_key(selection)
    keys = keys.reshape(rows, per_lane, 32)                       # [r, c, lane]
    lanes = np.arange(32)
    out = np.zeros((rows, k), np.int64)
    for slot in range(k):
        # `_lane_best`: a pairwise tree over c (left halves hold the lower indices; strict >)
        cands = [(keys[:, c], np.broadcast_to(lanes + 32 * c, (rows, 32))) for c in range(per_lane)]
        while len(cands) > 1:
            paired = []
            for (ka, ia), (kb, ib) in zip(cands[0::2], cands[1::2]):
                better = kb > ka
                paired.append((np.where(better, kb, ka), np.where(better, ib, ia)))
            cands = paired + cands[len(cands) // 2 * 2:]
        best, best_i = cands[0]
        top = best.max(axis=1, keepdims=True)
        win = np.where(best == top, best_i, 2**31 - 1).min(axis=1)
        out[:, slot] = win
        keys[np.arange(rows), win // 32, win % 32] = -(2**31)
    return out


@pytest.mark.parametrize("experts", [16, 128, 384])
def test_redux_topk_is_stable_argsort(experts):
    rows = 200
    sel = (RNG.integers(-3, 3, (rows, experts)) * 0.5).astype(np.float32)   # many exact ties
    assert np.array_equal(redux_topk(sel, 6), np.argsort(-sel, axis=1, kind="stable")[:, :6])
    sel = (RNG.standard_normal((rows, experts)) * 10.0 ** RNG.integers(-30, 30, (rows, 1))
           ).astype(np.float32)                                         # signs, tiny, huge
    sel[:, ::7] = -np.inf
    assert np.array_equal(redux_topk(sel, 6), np.argsort(-sel, axis=1, kind="stable")[:, :6])
    a = np.array([-np.inf, -3e38, -1.0, -1e-40, 0.0, 1e-40, 1.0, 3e38, np.inf], np.float32)
    assert (np.diff(order_key(a).astype(np.int64)) > 0).all()


def test_logits_bound_holds_for_the_tile_kernel_order():
    """fp32 sum in `_tile8`'s order (320 threads of 2 vectors, butterfly tree, 10 warps)."""
    rows, d, e, t = 4, 5120, 6, 320
    x = to_bf16(RNG.standard_normal((rows, d)) * 3)
    w = to_bf16(RNG.standard_normal((e, d)) / 70)
    prod = (x.astype(np.float32)[:, None, :] * w.astype(np.float32)[None]).reshape(
        rows, e, d // 8 // t, t, 8)
    acc = np.zeros((rows, e, t), np.float32)
    for i in range(prod.shape[2]):
        for k in range(8):
            acc = acc + prod[:, :, i, :, k]
    acc = acc.reshape(rows, e, t // 32, 32)
    lanes = np.arange(32)
    for off in (16, 8, 4, 2, 1):
        acc = acc + acc[..., lanes ^ off]
    total = acc[..., 0, 0]
    for warp in range(1, t // 32):
        total = total + acc[..., warp, 0]
    assert (np.abs(total - rk.logits_f64(x, w)) <= rk.logits_bound(x, w)).all()
