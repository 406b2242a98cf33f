"""Known-answer and property tests of loader/formats.py (E2M1, UE8M0, E4M3, MXFP4, fused E8M0, acts)."""

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from loader import formats as fm

E2M1_GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)
PROPERTY = settings(max_examples=200, deadline=None)


@pytest.fixture
def rng():
    seed = np.random.SeedSequence().entropy
    print(f"rng seed {seed}")  # shown by pytest when a test fails
    return np.random.default_rng(seed)


def _finite_e4m3_values() -> np.ndarray:
    values = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return np.unique(values[np.isfinite(values)])


def _e4m3_rne_reference(x: np.ndarray) -> np.ndarray:
    """Independent RNE-satfinite to E4M3 in float64: nearest table value, ties to the even byte."""
    table = _finite_e4m3_values()
    x = np.clip(x, table[0], table[-1])
    hi = np.clip(np.searchsorted(table, x, side="left"), 1, len(table) - 1)
    below, above = table[hi - 1], table[hi]
    pick_above = (above - x) < (x - below)
    tie = (above - x) == (x - below)
    above_bytes = np.array(above, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    pick_above |= tie & ((above_bytes & 0x7F) % 2 == 0)
    return np.where(pick_above, above, below)


def _fraction_to_float32(fr: Fraction) -> np.float32:
    """Correctly rounded float32 of an exact positive rational: round to odd in float64, then RNE."""
    f = np.array([float(fr)])  # float() of a Fraction is correctly rounded
    if Fraction(f[0]) != fr:
        if Fraction(f[0]) > fr:
            f = np.nextafter(f, 0.0)
        f = (f.view(np.int64) | 1).view(np.float64)
    return f.astype(np.float32)[0]


# --------------------------------------------------------------------------------------------------
# E2M1


def test_e2m1_decode_every_code_matches_ml_dtypes():
    codes = np.arange(16, dtype=np.uint8)
    want = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    got = fm.e2m1_decode(codes)
    assert got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # -0 at code 8 included


def test_e2m1_encode_every_code_point_and_midpoint_matches_ml_dtypes():
    mids = (E2M1_GRID[1:] + E2M1_GRID[:-1]) / 2
    points = np.concatenate([E2M1_GRID, mids, np.nextafter(mids, 0), np.nextafter(mids, 9)])
    x = np.concatenate([points, -points]).astype(np.float32)
    want = x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    assert np.array_equal(fm.e2m1_encode(x), want)


def test_e2m1_encode_tie_table_nearest_even():
    x = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert fm.e2m1_decode(fm.e2m1_encode(x)).tolist() == [0, 1, 1, 2, 2, 4, 4]


def test_e2m1_encode_random_matches_ml_dtypes(rng):
    x = (rng.standard_normal(100_000) * 3).astype(np.float32)
    x = x[np.abs(x) <= 6]
    want = x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    assert np.array_equal(fm.e2m1_encode(x), want)


def test_e2m1_encode_saturates_and_rejects_nan():
    x = np.array([6.0, 6.5, 1e30, np.inf, -7.0, -np.inf])
    assert fm.e2m1_encode(x).tolist() == [7, 7, 7, 7, 15, 15]
    with pytest.raises(ValueError, match="NaN"):
        fm.e2m1_encode(np.array([1.0, np.nan]))
    with pytest.raises(ValueError, match="rounding"):
        fm.e2m1_encode(np.array([1.0]), rounding="down")


@PROPERTY
@given(hnp.arrays(np.float64, st.integers(2, 64),
                  elements=st.floats(-20, 20, allow_nan=False, allow_infinity=False)))
def test_e2m1_encode_is_monotone(x):
    x = np.sort(x)
    for rounding in ("nearest_even", "nearest_away"):
        values = fm.e2m1_decode(fm.e2m1_encode(x, rounding=rounding))
        assert np.all(np.diff(values) >= 0)


def test_e2m1_round_away_humming_tie_table():
    x = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.2499, 0.0])
    want = [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, 0.0]
    assert fm.e2m1_decode(fm.e2m1_round_away(x)).tolist() == want
    assert fm.e2m1_decode(fm.e2m1_round_away(-x[:7])).tolist() == [-v for v in want[:7]]
    # zero results are +0 (code 0), whatever the sign in
    assert fm.e2m1_round_away(np.array([-0.0, -0.1, -0.2499])).tolist() == [0, 0, 0]


def _humming_quant_to_fp4_val(v: np.ndarray) -> np.ndarray:
    """Bit-level transcription of Humming 0.1.19 process_mxfp4.cuh quant_to_fp4_val (float32)."""
    bits = v.astype(np.float32).view(np.uint32)
    mask = np.uint32(0x81C00000)
    rz = (bits & mask).view(np.float32)
    ru = ((bits + np.uint32(0x00200000)) & mask).view(np.float32)
    rn = np.where(np.abs(v - rz) >= np.abs(v - ru), ru, rz).astype(np.float32).view(np.uint32)
    return (((rn & 0x80000000) >> 28) | ((rn & 0x01C00000) >> 22)).astype(np.uint8)


def test_round_away_matches_humming_bit_trick_for_every_code_and_shift():
    # Humming dequantizes code c to fp4(c) * 2^-126 (bits c << 22), scales by 2^-delta in float32
    # with denormals kept, and rounds with the bit trick above.
    codes = np.arange(16, dtype=np.uint8)
    codes = codes[codes != 8]  # rewritten to 0 before re-rounding
    for delta in range(1, 30):
        scaled = (codes.astype(np.uint32) & 7) << 22 | (codes.astype(np.uint32) & 8) << 28
        v = scaled.view(np.float32) * np.float32(2.0**-delta)
        want = _humming_quant_to_fp4_val(v)
        got = fm.e2m1_encode(np.ldexp(fm.e2m1_decode(codes), -delta), rounding="nearest_away")
        assert np.array_equal(got, want), f"delta {delta}"
        assert np.array_equal(fm.e2m1_decode(fm.e2m1_round_away(
            np.ldexp(fm.e2m1_decode(codes), -delta))), fm.e2m1_decode(want))


# --------------------------------------------------------------------------------------------------
# UE8M0 and E4M3


def test_ue8m0_decode_every_byte_matches_ml_dtypes():
    b = np.arange(256, dtype=np.uint8)
    want = b.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    got = fm.ue8m0_decode(b)
    assert np.array_equal(got, want, equal_nan=True) and np.isnan(got[255])
    assert np.array_equal(fm.ue8m0_decode(b.view(ml_dtypes.float8_e8m0fnu)), got, equal_nan=True)
    with pytest.raises(TypeError, match="UE8M0"):
        fm.ue8m0_decode(b.astype(np.int16))


def test_ue8m0_encode_pow2_round_trips_every_finite_byte():
    b = np.arange(255, dtype=np.uint8)
    assert np.array_equal(fm.ue8m0_encode_pow2(fm.ue8m0_decode(b)), b)
    for bad in (3.0, 0.0, -2.0, np.inf, np.nan, 2.0**-128, 2.0**128, 1.5 * 2.0**-127):
        with pytest.raises(ValueError, match="power of two"):
            fm.ue8m0_encode_pow2(np.array([1.0, bad]))


@PROPERTY
@given(st.floats(0, 1e37, allow_nan=False), st.sampled_from([6.0, 448.0]))
def test_ue8m0_scale_for_amax_is_smallest_fitting_power_of_two(amax, max_code):
    b = int(fm.ue8m0_scale_for_amax(np.array([amax]), max_code)[0])
    e = b - 127
    assert 0 <= b <= 254
    if b > 0:  # not clamped at the bottom: half the scale would not fit
        assert Fraction(amax) > Fraction(max_code) * Fraction(2) ** (e - 1)
    assert Fraction(amax) <= Fraction(max_code) * Fraction(2) ** e


def test_ue8m0_scale_for_amax_edges():
    got = fm.ue8m0_scale_for_amax(np.array([0.0, 6.0, np.nextafter(6.0, 7), 3.0, 1e-300, 1e300]), 6)
    assert got.tolist() == [0, 127, 128, 126, 0, 254]
    with pytest.raises(ValueError, match="NaN/Inf"):
        fm.ue8m0_scale_for_amax(np.array([np.inf]), 6.0)
    with pytest.raises(ValueError, match="negative"):
        fm.ue8m0_scale_for_amax(np.array([-1.0]), 6.0)


def test_e4m3_every_byte_round_trips_and_saturates():
    b = np.arange(256, dtype=np.uint8)
    values = b.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = np.isfinite(values)
    assert finite.sum() == 254  # 0x7F and 0xFF are the only NaNs
    back = fm._e4m3_rne_satfinite(values[finite]).view(np.uint8)
    assert np.array_equal(back, b[finite])
    big = np.array([448.0, 449.0, 464.0, 500.0, 1e30, -1e30], np.float32)
    assert fm._e4m3_rne_satfinite(big).astype(np.float32).tolist() == [448] * 5 + [-448]


# --------------------------------------------------------------------------------------------------
# MXFP4


def test_mxfp4_pack_known_bytes():
    codes = np.array([[1, 2, 15, 8, 0, 7]], dtype=np.uint8)
    assert fm.mxfp4_pack(codes).view(np.uint8).tolist() == [[0x21, 0x8F, 0x70]]
    assert fm.mxfp4_pack(codes).dtype == np.int8


@PROPERTY
@given(hnp.arrays(np.uint8, hnp.array_shapes(min_dims=1, max_dims=3, max_side=8).map(
    lambda s: (*s[:-1], 2 * s[-1])), elements=st.integers(0, 15)))
def test_mxfp4_pack_unpack_round_trip(codes):
    packed = fm.mxfp4_pack(codes)
    assert packed.shape == (*codes.shape[:-1], codes.shape[-1] // 2)
    assert np.array_equal(fm.mxfp4_unpack(packed), codes)


def _half_step(magnitude: np.ndarray) -> np.ndarray:
    """Half the gap between the E2M1 grid points around each magnitude in [0, 6]."""
    hi = np.clip(np.searchsorted(E2M1_GRID, magnitude, side="left"), 1, 7)
    return (E2M1_GRID[hi] - E2M1_GRID[hi - 1]) / 2


def test_mxfp4_quantize_error_within_half_step_at_block_scale(rng):
    # Fresh weights spanning many binades per row, so groups get very different scales.
    w = (rng.standard_normal((48, 256)) * np.exp2(rng.integers(-30, 10, (48, 1)))).astype(np.float32)
    w[3, 32:64] = 0.0  # an all-zero group
    packed, scales = fm.mxfp4_quantize(w)
    assert packed.shape == (48, 128) and scales.shape == (48, 8) and scales.dtype == np.uint8
    s = np.repeat(fm.ue8m0_decode(scales).astype(np.float64), 32, axis=1)
    err = np.abs(fm.mxfp4_dequantize(packed, scales).astype(np.float64) - w)
    # Scaling by a power of two is exact, so the only error is one E2M1 rounding of |w|/s <= 6.
    assert np.all(np.abs(w) / s <= 6)
    assert np.all(err <= _half_step(np.abs(w) / s) * s)
    assert scales[3, 1] == 0 and np.all(fm.mxfp4_dequantize(packed, scales)[3, 32:64] == 0)


def test_mxfp4_quantize_is_exact_on_representable_weights(rng):
    codes = rng.integers(0, 16, (8, 64), dtype=np.uint8)
    codes[:, ::32] = 7  # amax 6 in every group, so the quantizer picks exactly the drawn scale
    scales = rng.integers(100, 140, (8, 2), dtype=np.uint8)
    w = fm.mxfp4_dequantize(fm.mxfp4_pack(codes), scales)
    packed, got_scales = fm.mxfp4_quantize(w)
    assert np.array_equal(got_scales, scales)
    assert np.array_equal(fm.mxfp4_dequantize(packed, got_scales), w)


def test_mxfp4_bad_input_names_the_tensor():
    with pytest.raises(ValueError, match="w13 scales.*0xFF"):
        fm.mxfp4_dequantize(np.zeros((2, 16), np.int8), np.full((2, 1), 255, np.uint8), name="w13")
    with pytest.raises(ValueError, match="w2: scales shape"):
        fm.mxfp4_dequantize(np.zeros((2, 16), np.int8), np.zeros((2, 2), np.uint8), name="w2")
    with pytest.raises(TypeError, match="packed"):
        fm.mxfp4_unpack(np.zeros((2, 16), np.float32))
    with pytest.raises(ValueError, match="NaN"):
        fm.mxfp4_quantize(np.full((1, 32), np.nan, np.float32))


# --------------------------------------------------------------------------------------------------
# FP8 32x32 blocks


def test_fp8_block_quantize_relative_error(rng):
    w = (rng.standard_normal((96, 64)) * np.exp2(rng.integers(-20, 20, (96, 1)))).astype(np.float32)
    q, s = fm.fp8_block_quantize(w)
    assert q.dtype == ml_dtypes.float8_e4m3fn and s.shape == (3, 2) and s.dtype == np.uint8
    d = fm.fp8_block_dequantize(q, s).astype(np.float64)
    scale = np.repeat(np.repeat(fm.ue8m0_decode(s).astype(np.float64), 32, 0), 32, 1)
    normal = np.abs(w) / scale >= 2.0**-6  # the E4M3 normal range, before rounding
    # E4M3 has 3 mantissa bits: RNE error <= 2^-4 relative in the normal range, 2^-10 absolute
    # (half the subnormal step) below it, both times the exact power-of-two scale.
    assert np.all(np.abs(d - w)[normal] <= 2.0**-4 * np.abs(w[normal]))
    assert np.all(np.abs(d - w)[~normal] <= 2.0**-10 * scale[~normal])
    assert np.all(np.abs(q.astype(np.float32)) <= 448)


def test_fp8_block_scales_per_row_and_dequantize_forms_agree(rng):
    q = rng.standard_normal((64, 96)).astype(ml_dtypes.float8_e4m3fn)
    s = rng.integers(110, 140, (2, 3), dtype=np.uint8)
    rows = fm.fp8_block_scales_per_row(s)
    assert rows.shape == (64, 3) and np.array_equal(rows[31], s[0]) and np.array_equal(rows[32], s[1])
    want = q.astype(np.float64) * np.repeat(np.exp2(rows.astype(np.float64) - 127), 32, axis=1)
    assert np.array_equal(fm.fp8_block_dequantize(q, s), want.astype(np.float32))
    assert np.array_equal(fm.fp8_block_dequantize(q, rows), want.astype(np.float32))
    assert np.array_equal(fm.fp8_block_dequantize(q, s.view(ml_dtypes.float8_e8m0fnu)),
                          want.astype(np.float32))
    with pytest.raises(ValueError, match="wq_a: scales shape"):
        fm.fp8_block_dequantize(q, s[:1], name="wq_a")
    bad = q.copy()
    bad.view(np.uint8)[5, 7] = 0x7F
    with pytest.raises(ValueError, match=r"wkv: E4M3 NaN byte 0x7F at index \(5, 7\)"):
        fm.fp8_block_dequantize(bad, s, name="wkv")


# --------------------------------------------------------------------------------------------------
# Humming fused E8M0


def _random_expert(rng, out, k, lo_byte, hi_byte):
    codes = rng.integers(0, 16, (out, k), dtype=np.uint8)
    scales = rng.integers(lo_byte, hi_byte + 1, (out, k // 32), dtype=np.uint8)
    return codes, scales


def test_fused_e8m0_equals_plain_mxfp4_within_11_binades(rng):
    codes, scales = _random_expert(rng, 64, 256, 100, 111)
    scales[0, 0], scales[1, 1] = 100, 111  # range exactly 11: the widest kept exactly
    packed = fm.mxfp4_pack(codes)
    f = fm.fused_e8m0(packed, scales)
    assert int(f.lo) == 100 and f.weight_scale_2 == np.float32(2.0 ** (100 - 127) / 2)
    assert np.array_equal(f.offsets, scales - 100 + 1)
    assert np.array_equal(fm.mxfp4_unpack(f.packed), np.where(codes == 8, 0, codes))
    assert np.array_equal(fm.fused_e8m0_dequantize(f), fm.mxfp4_dequantize(packed, scales))


@PROPERTY
@given(st.integers(0, 40), st.integers(0, 2**63 - 1))
def test_fused_e8m0_properties_for_any_scale_spread(spread, seed):
    rng = np.random.default_rng(seed)
    codes, scales = _random_expert(rng, 8, 128, 127 - spread, 127)
    packed = fm.mxfp4_pack(codes)
    f = fm.fused_e8m0(packed, scales)
    smax, smin = int(scales.max()), int(scales.min())
    lo = smax - min(smax - smin, 11)
    assert int(f.lo) == lo and 1 <= f.offsets.min() and f.offsets.max() <= 12
    assert np.array_equal(f.offsets, np.maximum(scales, lo) - lo + 1)
    plain = fm.mxfp4_dequantize(packed, scales).astype(np.float64)
    effective = fm.fused_e8m0_dequantize(f).astype(np.float64)
    kept = np.repeat(scales >= lo, 32, axis=1)
    assert np.array_equal(effective[kept], plain[kept])  # groups within 11 binades: exact
    # Lower groups are rounded once onto the E2M1 grid at scale 2^(lo-127): half a step at most.
    unit = 2.0 ** (lo - 127)
    bound = _half_step(np.abs(plain[~kept]) / unit) * unit
    assert np.all(np.abs(effective[~kept] - plain[~kept]) <= bound)


def test_fused_e8m0_rewrites_negative_zero_in_every_group(rng):
    codes, scales = _random_expert(rng, 8, 128, 120, 122)
    codes[:, ::3] = 8
    f = fm.fused_e8m0(fm.mxfp4_pack(codes), scales)
    got = fm.mxfp4_unpack(f.packed)
    assert not np.any(got == 8) and np.all(got[:, ::3] == 0)
    assert np.all(fm.fused_e8m0_e4m3_bytes(f)[:, ::3] == 0)


def test_fused_e8m0_group_14_binades_below_is_rerounded_exactly():
    # One expert, 2 rows x 2 groups; the max scale is 120 and group (1, 1) sits at 106: 14 binades
    # below. r = min(14, 11) = 11, lo = 109, so that group is shifted by delta = 3 (divide by 8).
    codes = np.zeros((2, 64), np.uint8)
    codes[:, :32] = 7
    codes[1, 32:48] = np.arange(16)
    codes[1, 48:64] = np.arange(16)[::-1]
    scales = np.array([[120, 115], [112, 106]], np.uint8)
    packed = fm.mxfp4_pack(codes)
    f = fm.fused_e8m0(packed, scales)
    assert np.array_equal(fm.mxfp4_unpack(packed), codes)  # the input is not changed in place
    assert int(f.lo) == 109 and f.offsets.tolist() == [[12, 7], [4, 1]]
    assert f.weight_scale_2 == np.float32(2.0**-19)
    # fp4 / 8, rounded to nearest with ties away: 0, .0625, .125, .1875 -> 0; .25 -> .5 (tie);
    # .375 -> .5; .5 -> .5; .75 -> 1 (tie). Negatives flush to -0 (code 8), as Humming's bit trick.
    shifted = [0, 0, 0, 0, 1, 1, 1, 2]
    want = shifted + [8 if c == 0 else c | 8 for c in shifted]
    want[8] = 0  # code 8 was -0 and became +0 before the shift
    got = fm.mxfp4_unpack(f.packed)[1, 32:64]
    assert got.tolist() == want + want[::-1]
    effective = fm.fused_e8m0_dequantize(f)
    assert np.array_equal(effective[1, 32:64], fm.e2m1_decode(got) * np.float32(2.0**-18))
    untouched = np.array_equal(effective[:, :32], fm.mxfp4_dequantize(
        fm.mxfp4_pack(codes), scales)[:, :32])
    assert untouched and np.array_equal(effective[0, 32:], np.zeros(32, np.float32))


def test_fused_e8m0_e4m3_bytes_follow_humming_recipe_and_identity(rng):
    # Three experts with wide scale ranges, so clamped groups and all offsets 1..12 occur.
    codes = rng.integers(0, 16, (3, 32, 128), dtype=np.uint8)
    scales = rng.integers(90, 125, (3, 32, 4), dtype=np.uint8)
    scales[0] = rng.integers(118, 120, (32, 4))  # one narrow expert
    f = fm.fused_e8m0(fm.mxfp4_pack(codes), scales)
    got = fm.fused_e8m0_e4m3_bytes(f)
    assert got.shape == codes.shape and got.dtype == np.uint8
    # Humming dequant_fused.cuh: magnitude m -> byte base[m] + 8 * offset (m > 0), sign in bit 7.
    base = np.array([0, 0, 8, 12, 16, 20, 24, 28])
    c = fm.mxfp4_unpack(f.packed).astype(np.int64)
    off = np.repeat(f.offsets.astype(np.int64), 32, axis=-1)
    want = np.where(c & 7, base[c & 7] + 8 * off, 0) | (c & 8) << 4
    assert np.array_equal(got, want.astype(np.uint8))
    e4m3 = got.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    identity = e4m3 * np.float32(64) * f.weight_scale_2[:, None, None]
    assert np.array_equal(identity, fm.fused_e8m0_dequantize(f))


def test_fused_e8m0_is_vectorised_over_experts(rng):
    codes = rng.integers(0, 16, (4, 16, 64), dtype=np.uint8)
    scales = rng.integers(95, 125, (4, 16, 2), dtype=np.uint8)
    packed = fm.mxfp4_pack(codes)
    f = fm.fused_e8m0(packed, scales)
    assert f.lo.shape == (4,) and f.weight_scale_2.shape == (4,)
    for e in range(4):
        one = fm.fused_e8m0(packed[e], scales[e])
        assert int(one.lo) == f.lo[e] and one.weight_scale_2 == f.weight_scale_2[e]
        assert np.array_equal(one.packed, f.packed[e]) and np.array_equal(one.offsets, f.offsets[e])


def test_humming_pad_sublayer_tp4_w13_shape(rng):
    codes, scales = _random_expert(rng, 1152, 128, 110, 118)
    packed, padded = fm.humming_pad_sublayer(fm.mxfp4_pack(codes), scales)
    assert packed.shape == (1280, 64) and padded.shape == (1280, 4)
    assert np.all(packed[1152:] == 0) and np.all(padded[1152:] == 127)
    f = fm.fused_e8m0(packed, padded)
    assert int(f.lo) == 127 - 11  # the padded rows' 2^0 scale becomes smax
    codes2, scales2 = _random_expert(rng, 256, 576, 110, 118)
    packed2, padded2 = fm.humming_pad_sublayer(fm.mxfp4_pack(codes2), scales2)
    assert packed2.shape == (256, 320) and np.array_equal(padded2[:, 18:], np.repeat(
        scales2.max(axis=1, keepdims=True), 2, axis=1))


def test_fused_e8m0_rejects_nan_scale_and_bad_shapes():
    with pytest.raises(ValueError, match="layers.3.w2 scales.*0xFF"):
        fm.fused_e8m0(np.zeros((2, 16), np.int8), np.full((2, 1), 255, np.uint8), name="layers.3.w2")
    with pytest.raises(ValueError, match="scales shape"):
        fm.fused_e8m0(np.zeros((2, 16), np.int8), np.zeros((2, 2), np.uint8))


# --------------------------------------------------------------------------------------------------
# Activations


def _act_reference(x: np.ndarray, group: int):
    """Direct construction: exact float64/Fraction scale and reciprocal, f32 product, table RNE."""
    m, k = x.shape
    groups = -(-k // group)
    q = np.empty((m, k))
    s = np.empty((m, groups), np.float32)
    for i in range(m):
        for j in range(groups):
            seg = x[i, j * group:(j + 1) * group].astype(np.float64)
            amax = Fraction(float(np.abs(seg).max()))
            scale = max(_fraction_to_float32(amax / 448), np.float32(1e-30))
            inverse = _fraction_to_float32(1 / Fraction(float(scale)))
            product = (seg * np.float64(inverse)).astype(np.float32)  # exact in f64, one rounding
            q[i, j * group:(j + 1) * group] = _e4m3_rne_reference(product.astype(np.float64))
            s[i, j] = scale
    return q, s


@pytest.mark.parametrize("k", [128, 576, 5120, 96])
def test_quantize_act_fp8_matches_direct_construction(rng, k):
    x = (rng.standard_normal((5, k)) * np.exp2(rng.integers(-12, 12, (5, 1)))).astype(ml_dtypes.bfloat16)
    x[1, :64] = 0  # an all-zero group (when k > 64 it is not the whole row)
    q, s = fm.quantize_act_fp8(x)
    q_want, s_want = _act_reference(x.astype(np.float32), 128)
    assert q.dtype == ml_dtypes.float8_e4m3fn and s.dtype == np.float32
    assert s.shape == (5, -(-k // 128))
    assert np.array_equal(s, s_want)
    assert np.array_equal(q.astype(np.float64), q_want)


def test_quantize_act_fp8_tail_group_equals_zero_padding(rng):
    x = rng.standard_normal((3, 576)).astype(np.float32)
    q, s = fm.quantize_act_fp8(x)
    q_pad, s_pad = fm.quantize_act_fp8(np.pad(x, ((0, 0), (0, 64))))
    assert np.array_equal(s, s_pad) and np.array_equal(q.view(np.uint8), q_pad[:, :576].view(np.uint8))
    assert np.array_equal(s[:, 4], np.abs(x[:, 512:]).max(axis=1) / np.float32(448))


def test_quantize_act_fp8_scale_floor_on_zero_groups():
    x = np.zeros((2, 256), np.float32)
    x[0, 200] = 3.0
    q, s = fm.quantize_act_fp8(x)
    assert s[0, 0] == np.float32(1e-30) and s[1].tolist() == [np.float32(1e-30)] * 2
    assert np.all(q.astype(np.float32)[1] == 0) and q.astype(np.float32)[0, 200] == 448
    assert np.array_equal(fm.dequantize_act_fp8(q, s)[1], np.zeros(256, np.float32))


def test_dequantize_act_fp8_relative_error(rng):
    x = (rng.standard_normal((4, 576)) * np.exp2(rng.uniform(-8, 8, (4, 576)))).astype(np.float32)
    q, s = fm.quantize_act_fp8(x)
    d = fm.dequantize_act_fp8(q, s)
    scale = np.repeat(s.astype(np.float64), 128, axis=1)[:, :576]
    # E4M3 RNE: <= 2^-4 relative where |x/s| is in the normal range (>= 2^-6), <= 2^-10 * s (half
    # the subnormal step) below it; the float32 multiply by 1/s and the final q * s add a few 2^-24.
    normal = np.abs(x) / scale >= 2.0**-6
    err = np.abs(d.astype(np.float64) - x)
    assert np.all(err[normal] <= 2.0**-4 * np.abs(x[normal]) * (1 + 2.0**-20))
    assert np.all(err[~normal] <= 2.0**-10 * scale[~normal] * (1 + 2.0**-20))


def test_quantize_act_fp8_bad_input():
    with pytest.raises(ValueError, match="NaN/Inf"):
        fm.quantize_act_fp8(np.array([[1.0, np.inf]], np.float32))
    with pytest.raises(ValueError, match="M, K"):
        fm.quantize_act_fp8(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="scales"):
        fm.dequantize_act_fp8(np.zeros((1, 256), ml_dtypes.float8_e4m3fn), np.zeros((1, 1), np.float32))


# --------------------------------------------------------------------------------------------------
# BF16 and reference GEMMs


def test_to_bf16_rounds_once_from_float64(rng):
    x32 = rng.standard_normal(10_000).astype(np.float32)
    assert np.array_equal(fm.to_bf16(x32).view(np.uint16), x32.astype(ml_dtypes.bfloat16).view(np.uint16))
    assert fm.bf16_round(np.array([1 + 2.0**-8 + 2.0**-30]))[0] == np.float32(1 + 2.0**-7)
    x = rng.standard_normal(10_000) * np.exp2(rng.integers(-100, 100, 10_000))
    x[:3] = [1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8 + 2.0**-40)]  # ties and a near-tie
    got = fm.bf16_round(x).astype(np.float64)
    # Neighbours: truncate to bf16 (toward zero) and step one bf16 ulp away from zero.
    down = (x.astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32).astype(np.float64)
    down = np.where(np.abs(down) > np.abs(x), np.nextafter(down.astype(np.float32), 0)
                    .view(np.uint32).__and__(0xFFFF0000).view(np.float32), down)
    up = (down.astype(np.float32).view(np.uint32) + 0x10000).view(np.float32).astype(np.float64)
    d_down, d_up = np.abs(x - down), np.abs(up - x)
    even_up = (up.astype(np.float32).view(np.uint32) >> 16) % 2 == 0
    want = np.where((d_up < d_down) | ((d_up == d_down) & even_up), up, down)
    assert np.array_equal(got, want)


def _gemm_bound(a: np.ndarray, b: np.ndarray, k: int) -> np.ndarray:
    # Float32 accumulation of k products: |error| <= k * 2^-24 * sum |a||b| (classic dot-product
    # bound, gamma_k ~ k u), times 2 for the final scaling and accumulate across groups.
    return 2 * k * 2.0**-24 * (np.abs(a) @ np.abs(b).T) + 1e-30


def test_w4a8_linear_matches_float64_construction(rng):
    m, n, k = 7, 96, 576  # the w2 shape at TP4 per expert (n cut down), with its tail group
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    scales = rng.integers(115, 121, (n, k // 32), dtype=np.uint8)
    f = fm.fused_e8m0(fm.mxfp4_pack(codes), scales)
    x = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    y = fm.w4a8_linear(x, f)
    w = fm.fused_e8m0_dequantize(f).astype(np.float64)
    q, s = fm.quantize_act_fp8(x)
    xq = q.astype(np.float64) * np.repeat(s.astype(np.float64), 128, axis=1)[:, :k]
    want = xq @ w.T
    assert y.dtype == np.float32 and y.shape == (m, n)
    assert np.all(np.abs(y - want) <= _gemm_bound(xq, w, 128 + s.shape[1]))
    # plain MXFP4 and a pre-dequantized weight give the same numbers here (range <= 11 binades)
    assert np.array_equal(fm.w4a8_linear(x, (fm.mxfp4_pack(codes), scales)), y)
    assert np.array_equal(fm.w4a8_linear(x, fm.fused_e8m0_dequantize(f)), y)


def test_w8a16_linear_matches_float64_construction(rng):
    m, n, k = 5, 64, 160
    w, s = fm.fp8_block_quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
    x = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    y = fm.w8a16_linear(x, w, s)
    wf = fm.fp8_block_dequantize(w, s).astype(np.float64)
    want = x.astype(np.float64) @ wf.T
    assert y.dtype == np.float32
    assert np.all(np.abs(y - want) <= _gemm_bound(x.astype(np.float64), wf, k))
    assert np.array_equal(fm.w8a16_linear(x, w, fm.fp8_block_scales_per_row(s)), y)
    with pytest.raises(ValueError, match="w8a16_linear"):
        fm.w8a16_linear(x[:, :32], w, s)
