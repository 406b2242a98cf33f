"""CPU checks of the RMSNorm, residual-add and RoPE references against float64 ground truth.

Every test draws fresh random inputs. Tolerances, with their arithmetic:
- bf16 outputs of fp32 math on bf16 inputs: the fp32 result carries a relative error of a few
  2**-24, far below the bf16 half-ulp of 2**-9, so it rounds to the same bf16 as the float64 truth
  except when the truth lies within that error of a rounding boundary: at most 1 bf16 ulp apart.
- fp32 tables and frequencies: a few fp32 ulps (stated per test).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from kernels import common_ref as cr
from kernels import elementwise_ref as er
from kernels import norm_ref as nr
from kernels import rope_ref as rr
from loader.config import ModelConfig

RNG = np.random.default_rng()
WIDTHS = (128, 256, 512, 1280, 2048, 5120)


def bf16_normal(shape, scale=1.0):
    return cr.to_bf16(RNG.standard_normal(shape).astype(np.float32) * np.float32(scale))


# ---- RMSNorm ---------------------------------------------------------------------------------

@pytest.mark.parametrize("width", WIDTHS)
def test_row_geometry_tiles_the_row(width):
    threads, vecs = nr.row_geometry(width)
    assert threads * vecs * cr.BF16_PER_VECTOR == width
    assert vecs <= nr.MAX_VECS_PER_THREAD and nr.CTA_THREADS % threads == 0
    assert threads <= nr.WARP and (threads & (threads - 1)) == 0 or threads % nr.WARP == 0


@pytest.mark.parametrize("width", (0, 12, 8 * 24, 8 * 129 * 4))
def test_row_geometry_rejects_untileable_widths(width):
    with pytest.raises(ValueError, match="RMSNorm width"):
        nr.row_geometry(width)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("wdtype", nr.WEIGHT_DTYPES)
@pytest.mark.parametrize("eps", (1e-20, 1e-6))
def test_rmsnorm_ref_within_one_bf16_ulp_of_float64(width, wdtype, eps):
    rows = int(RNG.integers(1, 40))
    x = bf16_normal((rows, width), scale=float(RNG.uniform(0.01, 30)))
    w = RNG.uniform(-2, 2, width).astype(np.float32)
    w = cr.to_bf16(w) if wdtype == "bf16" else w
    got = nr.rmsnorm_ref(x, w, eps)
    truth = nr.rmsnorm_f64(x, w, eps)
    assert got.dtype == cr.BF16 and got.shape == x.shape
    dist = cr.bf16_ulp_distance(got, cr.to_bf16(truth))
    assert dist.max() <= 1, f"max {dist.max()} bf16 ulps at {np.unravel_index(dist.argmax(), dist.shape)}"


@pytest.mark.parametrize("width", WIDTHS)
def test_rmsnorm_sum_of_squares_matches_float64(width):
    """The replayed kernel order is a sum of D positive terms: relative error <= D * 2**-24."""
    x = bf16_normal((16, width))
    got = nr.row_sum_of_squares(x).astype(np.float64)
    truth = np.sum(x.astype(np.float64) ** 2, axis=1)
    assert np.all(np.abs(got - truth) <= truth * width * 2.0**-24)


def test_rmsnorm_all_zero_rows_give_exact_zeros_at_tiny_eps():
    x = bf16_normal((7, 512))
    x[[0, 3, 6]] = 0
    w = cr.to_bf16(RNG.uniform(-2, 2, 512))
    y = nr.rmsnorm_ref(x, w, 1e-20).astype(np.float32)
    assert np.all(y[[0, 3, 6]] == 0) and np.all(np.isfinite(y))
    assert np.count_nonzero(y[[1, 2, 4, 5]]) > 0


@pytest.mark.parametrize("eps", (0.0, -1e-6, float("nan"), float("inf")))
def test_rmsnorm_rejects_non_positive_eps(eps):
    x = bf16_normal((2, 128))
    with pytest.raises(ValueError, match="eps"):
        nr.rmsnorm_ref(x, cr.to_bf16(np.ones(128)), eps)


def test_rmsnorm_rejects_misshapen_inputs():
    with pytest.raises(TypeError, match="weight"):
        nr.rmsnorm_ref(bf16_normal((2, 128)), cr.to_bf16(np.ones(256)), 1e-6)
    with pytest.raises(TypeError, match="bf16"):
        nr.rmsnorm_ref(np.ones((2, 128), np.float32), cr.to_bf16(np.ones(128)), 1e-6)


def test_norm_widths_cover_every_decode_norm():
    v41 = ModelConfig.preset("v41-flash")
    assert nr.norm_widths(v41) == (128, 512, 1280, 5120)
    tiny = ModelConfig.preset("tiny")
    assert nr.norm_widths(tiny) == (128, 256, 512)


def test_rmsnorm_grid_and_bytes():
    spec = nr.make_spec(5120, "f32")
    assert spec.name == "rmsnorm_bf16_d5120_wf32" and spec.smem_bytes == 5120 * 4 + 32
    assert spec.grid(1) == (1, 1, 1) and spec.grid(10_000) == (spec.max_ctas, 1, 1)
    assert nr.make_spec(128, "bf16").grid(17) == (3, 1, 1)          # 8 rows of 128 per CTA
    assert spec.bytes_moved(6) == 6 * 5120 * 4 + 5120 * 4
    with pytest.raises(ValueError, match="rows"):
        spec.grid(0)


@pytest.mark.parametrize("width", WIDTHS)
def test_rmsnorm_persistent_grid_fits_one_wave(width):
    """The grid cap is ctas_per_sm CTAs on each of the 132 SMs, and that many CTAs fit an SM:
    threads, registers (two rows of packed bf16 + 32) and shared memory (+1 KB reserved each)."""
    spec = nr.make_spec(width, "bf16")
    _, vecs = nr.row_geometry(width)
    regs = -(-(8 * vecs + 32) // 8) * 8
    assert spec.max_ctas == cr.H200_NUM_SMS * spec.ctas_per_sm
    assert spec.ctas_per_sm * nr.CTA_THREADS <= nr.MAX_THREADS_PER_SM
    assert spec.ctas_per_sm * nr.CTA_THREADS * regs <= nr.REGISTERS_PER_SM
    assert spec.ctas_per_sm * (spec.smem_bytes + 1024) <= nr.SMEM_PER_SM
    big = 10 * spec.max_ctas * spec.rows_per_cta
    assert spec.grid(big) == (spec.max_ctas, 1, 1)
    assert spec.to_dict()["ctas_per_sm"] == spec.ctas_per_sm


def test_rmsnorm_rejects_an_occupancy_that_does_not_fit():
    with pytest.raises(ValueError, match="do not fit one SM"):
        nr.make_spec(5120, "bf16", ctas_per_sm=12)        # 12 x 21 KB of shared memory
    with pytest.raises(ValueError, match="do not fit one SM"):
        nr.make_spec(128, "bf16", ctas_per_sm=17)         # 17 x 128 threads > 2048


def test_rmsnorm_bundle_registers_fit_the_compiled_occupancy():
    """Every built RMSNorm cubin (HOPDEC_BUNDLE, as `make test` exports) fits ctas_per_sm CTAs per
    SM with its actual register count: otherwise the persistent grid would run a second wave."""
    path = Path(os.environ.get("HOPDEC_BUNDLE", "build/bundle-tiny")) / "manifest.json"
    if not path.is_file():
        pytest.skip(f"no kernel bundle at {path.parent} (set HOPDEC_BUNDLE)")
    kernels = json.loads(path.read_text())["kernels"]
    norms = {n: k for n, k in kernels.items() if k.get("family") == "kernels.norm"}
    assert norms, f"{path}: no RMSNorm kernel"
    for name, k in norms.items():
        ctas = k["spec"]["ctas_per_sm"]
        assert ctas * nr.CTA_THREADS * k["registers"] <= nr.REGISTERS_PER_SM, name
        assert k["spill_bytes"] == 0 and k["local_bytes"] == 0, name


# ---- residual add -------------------------------------------------------------------------------

@pytest.mark.parametrize("a_dtype", er.A_DTYPES)
def test_residual_add_ref_within_one_ulp_and_exact_formula(a_dtype):
    rows, width = int(RNG.integers(1, 50)), 5120
    a = RNG.standard_normal((rows, width)).astype(np.float32) * np.float32(4)
    a = cr.to_bf16(a) if a_dtype == "bf16" else a
    b = bf16_normal((rows, width), scale=8)
    got = er.residual_add_ref(a, b)
    # float64 sum is exact here; fp32 rounding then bf16 rounding can differ from one rounding
    # only at a bf16 halfway point: <= 1 ulp.
    assert cr.bf16_ulp_distance(got, cr.to_bf16(er.residual_add_f64(a, b))).max() <= 1
    if a_dtype == "bf16":      # two bf16 values sum exactly in fp32 unless exponents differ > 16
        same = np.abs(np.log2(np.abs(a.astype(np.float64)) + 1e-30)
                      - np.log2(np.abs(b.astype(np.float64)) + 1e-30)) < 8
        assert np.array_equal(got[same], cr.to_bf16(er.residual_add_f64(a, b))[same])


def test_residual_add_spec_grid_and_bytes():
    spec = er.make_spec(5120, "f32")
    assert spec.bytes_moved(10) == 10 * 5120 * 8
    assert spec.grid(1) == (math.ceil(640 / 256), 1, 1)
    with pytest.raises(TypeError, match="residual add"):
        er.residual_add_ref(bf16_normal((2, 8)), bf16_normal((2, 16)))


# ---- RoPE ----------------------------------------------------------------------------------------

def yarn_f64(theta, factor, original, beta_fast, beta_slow, dim=64):
    """Independent float64 YaRN: per-pair blend of theta^(-2i/dim) and theta^(-2i/dim)/factor."""
    def corr(rot):
        return dim * math.log(original / (rot * 2 * math.pi)) / (2 * math.log(theta))
    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
    out = []
    for i in range(dim // 2):
        base = theta ** (-2.0 * i / dim)
        ramp = min(max((i - low) / ((high - low) or 0.001), 0.0), 1.0)   # 1 = fully interpolated
        out.append(base / factor * ramp + base * (1.0 - ramp))
    return np.array(out)


def test_yarn_correction_range_of_v41_and_tiny():
    # v41: dims rotating 32 / 1 times over 65536 positions at theta 1.6e5 are 15.45 / 24.71.
    assert rr.yarn_correction_range(32, 1, 64, 160000.0, 65536) == (15, 25)
    # tiny: original 64 -> the beta_fast dim is negative (clamped to 0), beta_slow 6.2 -> 7.
    assert rr.yarn_correction_range(32, 1, 64, 160000.0, 64) == (0, 7)


@pytest.mark.parametrize("preset", ("v41-flash", "tiny"))
def test_yarn_inv_freq_matches_float64_formula(preset):
    cfg = ModelConfig.preset(preset)
    s = cfg.rope_scaling
    got = rr.yarn_inv_freq(cfg.compress_rope_theta, s.factor, s.original_max_position_embeddings,
                           s.beta_fast, s.beta_slow)
    truth = yarn_f64(cfg.compress_rope_theta, s.factor, s.original_max_position_embeddings,
                     s.beta_fast, s.beta_slow)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, truth, rtol=4 * 2.0**-24, atol=0)   # a few fp32 roundings
    assert got[0] == pytest.approx(1.0) and got[-1] < rr.plain_inv_freq(1.6e5)[-1]


def test_plain_inv_freq_matches_float64():
    truth = 10000.0 ** (-np.arange(0, 64, 2) / 64.0)
    np.testing.assert_allclose(rr.plain_inv_freq(10000.0), truth, rtol=4 * 2.0**-24)


def test_rope_table_values_and_size():
    cfg = ModelConfig.preset("tiny")
    table = rr.RopeTable.yarn(cfg)
    assert table.cos_sin.shape == (1024, 32, 2) and table.nbytes == rr.table_bytes(1024)
    assert rr.table_bytes(1 << 20) == 268_435_456                      # 256 MiB at 1M positions
    angle = np.arange(1024)[:, None] * table.inv_freq.astype(np.float64)[None, :]
    # The angle is rounded to fp32 once (|err| <= angle * 2**-24), then cos/sin to fp32 (2**-24).
    bound = angle * 2.0**-24 + 2.0**-24
    assert np.all(np.abs(table.cos_sin[..., 0] - np.cos(angle)) <= bound)
    assert np.all(np.abs(table.cos_sin[..., 1] - np.sin(angle)) <= bound)


@pytest.mark.parametrize("inverse", (False, True))
@pytest.mark.parametrize("kind", ("plain", "yarn"))
def test_rope_ref_close_to_float64(inverse, kind):
    cfg = ModelConfig.preset("tiny")
    table = rr.RopeTable.for_ratio(cfg, 1 if kind == "yarn" else 0)
    rows, heads = 33, 4
    x = bf16_normal((rows, heads, 512))
    pos = RNG.integers(0, table.num_positions, rows).astype(np.int32)
    got = rr.rope_ref(x, pos, table, inverse).astype(np.float64)
    truth = rr.rope_f64(x, pos, table.inv_freq, inverse)
    assert np.array_equal(got[..., :448], x[..., :448].astype(np.float64))   # nope dims untouched
    # bf16 rounding of the result (2**-9 relative) plus the table's angle error times |x|.
    mag = np.abs(x[..., 448:].astype(np.float64)).reshape(rows, heads, 32, 2).max(-1)
    mag = np.repeat(mag, 2, axis=-1)
    bound = 2.0**-8 * np.abs(truth[..., 448:]) + mag * (table.num_positions * 2.0**-22)
    assert np.all(np.abs(got[..., 448:] - truth[..., 448:]) <= bound)


def test_rope_inverse_undoes_forward():
    table = rr.RopeTable.plain(ModelConfig.preset("tiny"))
    x = RNG.standard_normal((9, 2, 512)).astype(np.float32)
    pos = RNG.integers(0, 1024, 9).astype(np.int32)
    back = rr.apply_rope(rr.apply_rope(x, pos, table), pos, table, inverse=True)
    np.testing.assert_allclose(back, x, atol=1e-5 * np.abs(x).max())   # cos^2+sin^2 = 1 in fp32
    assert np.array_equal(back[..., :448], x[..., :448])


def test_rope_out_of_range_positions_give_nan_rope_dims_only():
    table = rr.RopeTable.plain(ModelConfig.preset("tiny"))
    x = bf16_normal((4, 1, 512))
    y = rr.rope_ref(x, np.array([0, -1, 1024, 5], np.int32), table).astype(np.float32)
    assert np.all(np.isnan(y[[1, 2], :, 448:])) and not np.any(np.isnan(y[[0, 3]]))
    assert np.array_equal(y[..., :448], x[..., :448].astype(np.float32))


def test_rope_specs_and_bytes():
    spec = rr.make_spec(16, 512, inverse=True, in_place=False)
    assert spec.name == "rope_inv_copy_h16_d512" and spec.params[:2] == (("x", "u64"),
                                                                         ("out", "u64"))
    assert spec.chunks_per_head == 64 and rr.make_spec(16, 512, False, True).chunks_per_head == 8
    assert spec.bytes_moved(3) == 3 * 16 * 512 * 4 + 3 * 260
    assert rr.rope_bytes(3, 16) == 3 * 16 * 64 * 4 + 3 * 260
    with pytest.raises(ValueError, match="RoPE"):
        rr.make_spec(1, 32, False, True)
