"""MX element formats in NumPy: E2M1 codes, UE8M0 scales, MXFP4 packing; the checks every format shares.

The lower half of `loader/formats.py` (whose docstring states the conventions and decisions); callers
import these names from `loader.formats`, which re-exports them.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

MXFP4_GROUP = 32
FP8_BLOCK = 32
ACT_GROUP = 128
E2M1_MAX = 6.0
E4M3_MAX = 448.0
ACT_SCALE_FLOOR = 1e-30
UE8M0_BIAS = 127
UE8M0_NAN = 0xFF
UE8M0_MAX_FINITE = 0xFE
# Widest scale range (binades) the SM90 fused-E8M0 path keeps exact with FP8 activations: offsets in
# [1, 12] keep the E4M3 exponent field of fp4(c) * 2^(offset-6) within 15.
FUSED_E8M0_R_MAX = 11
# E4M3 of fp4(c) * 2^(offset - 6) carries 2^-6; Humming's epilogue multiplies by 2^6 (exp_offset.cuh).
FUSED_E8M0_EXP_OFFSET = 6

_E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
_E2M1_VALUES = np.concatenate([_E2M1_MAGNITUDES, -_E2M1_MAGNITUDES])
_E2M1_MIDPOINTS = ((_E2M1_MAGNITUDES[1:] + _E2M1_MAGNITUDES[:-1]) / 2).astype(np.float64)
_E2M1_ROUNDINGS = ("nearest_even", "nearest_away")

_BF16 = ml_dtypes.bfloat16
_E4M3 = ml_dtypes.float8_e4m3fn
_E4M3_VALUES = np.arange(256, dtype=np.uint8).view(_E4M3).astype(np.float32)  # byte -> value LUT
_E8M0 = ml_dtypes.float8_e8m0fnu


# ---------------------------------------------------------------------------------------------------
# Input checks shared by every entry point: they name the tensor and say what was expected.


def _first_index(mask: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(mask)[0])


def _require_finite(x: np.ndarray, name: str, allow_inf: bool = False) -> None:
    bad = np.isnan(x) if allow_inf else ~np.isfinite(x)
    if bad.any():
        idx = _first_index(bad)
        what = "NaN" if allow_inf else "NaN/Inf"
        raise ValueError(f"{name}: {what} at index {idx} (value {x[idx]}); expected finite values")


def _as_float(x, name: str) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype not in (np.float32, np.float64, np.float16, _BF16):
        raise TypeError(f"{name}: expected a float32/float64/float16/bfloat16 array, got {x.dtype}")
    return x


def _as_codes(codes, name: str) -> np.ndarray:
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise TypeError(f"{name}: expected uint8 E2M1 codes, got {codes.dtype}")
    if codes.size and codes.max() > 15:
        idx = _first_index(codes > 15)
        raise ValueError(f"{name}: E2M1 code {codes[idx]} at index {idx}; expected 0..15")
    return codes


def _as_scale_bytes(scales, name: str, allow_nan: bool = False) -> np.ndarray:
    """UE8M0 scales as uint8 exponent bytes (float8_e8m0fnu is viewed, not copied)."""
    scales = np.asarray(scales)
    if scales.dtype == _E8M0:
        scales = scales.view(np.uint8)
    elif scales.dtype != np.uint8:
        raise TypeError(f"{name}: expected uint8 or float8_e8m0fnu UE8M0 scales, got {scales.dtype}")
    if not allow_nan and scales.size and (scales == UE8M0_NAN).any():
        idx = _first_index(scales == UE8M0_NAN)
        raise ValueError(f"{name}: UE8M0 byte 0xFF (NaN) at index {idx}; expected a finite scale")
    return scales


def _as_packed(packed, name: str) -> np.ndarray:
    packed = np.asarray(packed)
    if packed.dtype not in (np.int8, np.uint8):
        raise TypeError(f"{name}: expected int8 (or uint8) packed E2M1 pairs, got {packed.dtype}")
    if packed.ndim < 1:
        raise ValueError(f"{name}: expected [..., in/2], got a scalar")
    return packed.view(np.uint8)


def _check_group_scales(values_shape, scales: np.ndarray, group: int, name: str) -> None:
    """scales must be values_shape with the last axis divided by group."""
    *lead, k = values_shape
    if k % group:
        raise ValueError(f"{name}: inner dim {k} is not a multiple of the scale group {group}")
    if scales.shape != (*lead, k // group):
        raise ValueError(
            f"{name}: scales shape {scales.shape} does not match values {tuple(values_shape)} with "
            f"one scale per {group} along the last axis; expected {(*lead, k // group)}"
        )


# ---------------------------------------------------------------------------------------------------
# E2M1 (FP4)


def e2m1_decode(codes) -> np.ndarray:
    """float32 values of uint8 E2M1 codes 0..15 (code 8 decodes to -0.0)."""
    return _E2M1_VALUES[_as_codes(codes, "e2m1_decode codes")]


def e2m1_encode(x, rounding: str = "nearest_even") -> np.ndarray:
    """uint8 E2M1 codes of x: nearest value, saturating at +-6 (+-Inf included), NaN raises.

    rounding="nearest_even": ties go to the even code (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2,
    3.5->4, 5->4), as cvt.rn.satfinite and ml_dtypes.float4_e2m1fn do.
    rounding="nearest_away": ties go to the larger magnitude (Humming's ``quant_to_fp4_val``).
    The sign always lands in bit 3, so -0.0 and negatives that round to zero give code 8 (-0).
    """
    if rounding not in _E2M1_ROUNDINGS:
        raise ValueError(f"e2m1_encode: rounding must be one of {_E2M1_ROUNDINGS}, got {rounding!r}")
    x = _as_float(x, "e2m1_encode x").astype(np.float64)  # exact; midpoints compare exactly
    _require_finite(x, "e2m1_encode x", allow_inf=True)
    magnitude = np.abs(x)
    # Number of midpoints <= |x|: the nearest magnitude index with ties going up (>6 saturates to 7).
    index = np.searchsorted(_E2M1_MIDPOINTS, magnitude, side="right")
    if rounding == "nearest_even":
        below = _E2M1_MIDPOINTS[np.maximum(index - 1, 0)]
        on_tie = (index > 0) & (magnitude == below)
        index = index - (on_tie & (index % 2 == 1))
    sign = np.signbit(x).astype(np.uint8) << 3
    return (index.astype(np.uint8) | sign).astype(np.uint8)


def e2m1_round_away(x) -> np.ndarray:
    """Humming's re-rounding as values: nearest E2M1 with ties to the larger magnitude, as codes.

    0.25->0.5, 0.75->1, 1.25->1.5, 1.75->2, 2.5->3, 3.5->4, 5->6; |x| < 0.25 -> 0. Every zero result
    is code 0 (+0), including -0.0 in. ``fused_e8m0`` keeps Humming's bit-level sign on a flushed
    negative (code 8) instead; the two agree in value.
    """
    codes = e2m1_encode(x, rounding="nearest_away")
    return np.where(codes == 8, np.uint8(0), codes).astype(np.uint8)


# ---------------------------------------------------------------------------------------------------
# UE8M0 (power-of-two scales)


def ue8m0_decode(b) -> np.ndarray:
    """float32 ``2^(b-127)`` of UE8M0 bytes (uint8 or float8_e8m0fnu); 0xFF -> NaN; byte 0 -> 2^-127."""
    b = _as_scale_bytes(b, "ue8m0_decode b", allow_nan=True)
    with np.errstate(over="ignore"):  # byte 0xFF overflows here and is replaced by NaN
        values = np.ldexp(np.float32(1.0), b.astype(np.int32) - UE8M0_BIAS)
    return np.where(b == UE8M0_NAN, np.float32(np.nan), values).astype(np.float32)


def ue8m0_encode_pow2(x) -> np.ndarray:
    """UE8M0 bytes of exact powers of two in [2^-127, 2^127]; anything else raises ValueError."""
    x = _as_float(x, "ue8m0_encode_pow2 x").astype(np.float64)
    mantissa, exponent = np.frexp(x)
    byte = exponent.astype(np.int64) - 1 + UE8M0_BIAS
    ok = np.isfinite(x) & (mantissa == 0.5) & (byte >= 0) & (byte <= UE8M0_MAX_FINITE)
    if not ok.all():
        idx = _first_index(~ok)
        raise ValueError(
            f"ue8m0_encode_pow2: x[{idx}] = {x[idx]!r} is not a power of two in [2^-127, 2^127]"
        )
    return byte.astype(np.uint8)


def ue8m0_scale_for_amax(amax, max_code: float) -> np.ndarray:
    """UE8M0 byte of the smallest power of two s with ``amax / s <= max_code`` (the ceil rule).

    So ``s = 2^ceil(log2(amax / max_code))``, computed exactly (no float log2 rounding): every value
    of the group then fits the element format without clipping (E2M1: 6, E4M3: 448). This is the rule
    of DeepSeek's ue8m0 quantizers; OCP MX's ``2^(floor(log2 amax) - emax)`` would clip to max_code.
    The exponent is clamped to the UE8M0 range [-127, 127]: amax = 0 (or tiny) gives byte 0; an amax
    beyond ``max_code * 2^127`` gets byte 254 and its values saturate. amax must be finite and >= 0.
    """
    amax = _as_float(amax, "ue8m0_scale_for_amax amax").astype(np.float64)
    _require_finite(amax, "ue8m0_scale_for_amax amax")
    if (amax < 0).any():
        raise ValueError(f"ue8m0_scale_for_amax: negative amax at {_first_index(amax < 0)}")
    if not max_code > 0:
        raise ValueError(f"ue8m0_scale_for_amax: max_code must be > 0, got {max_code}")
    with np.errstate(divide="ignore"):
        guess = np.ceil(np.log2(amax / max_code))
    guess = np.clip(np.nan_to_num(guess, neginf=-UE8M0_BIAS), -UE8M0_BIAS - 1, UE8M0_BIAS + 1)
    exponent = guess.astype(np.int64)
    # log2 is within one of the truth; fix it with exact float64 comparisons (no overflow: the
    # exponent is clipped to +-128 and max_code is small).
    exponent += amax > np.ldexp(np.float64(max_code), exponent)
    exponent -= amax <= np.ldexp(np.float64(max_code), exponent - 1)
    exponent = np.clip(exponent, -UE8M0_BIAS, UE8M0_BIAS)
    return (exponent + UE8M0_BIAS).astype(np.uint8)


# ---------------------------------------------------------------------------------------------------
# MXFP4: E2M1 pairs + one UE8M0 scale per 32 along K


def mxfp4_pack(codes) -> np.ndarray:
    """int8 ``[..., in/2]`` from uint8 codes ``[..., in]``: low nibble = even k, high nibble = odd k."""
    codes = _as_codes(codes, "mxfp4_pack codes")
    if codes.ndim < 1 or codes.shape[-1] % 2:
        raise ValueError(f"mxfp4_pack: last dim must be even, got shape {codes.shape}")
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.astype(np.uint8).view(np.int8)


def mxfp4_unpack(packed, *, name: str = "packed") -> np.ndarray:
    """uint8 codes ``[..., in]`` from int8/uint8 packed pairs ``[..., in/2]`` (low nibble = even k)."""
    packed = _as_packed(packed, name)
    codes = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=np.uint8)
    codes[..., 0::2] = packed & 0x0F
    codes[..., 1::2] = packed >> 4
    return codes


def mxfp4_quantize(w) -> tuple[np.ndarray, np.ndarray]:
    """(packed int8 ``[..., out, in/2]``, scales uint8 ``[..., out, in/32]``) of float weights.

    Per 32-value group: ceil-rule UE8M0 scale for E2M1 max 6 (``ue8m0_scale_for_amax``), then
    ``e2m1_encode(w / s)`` with ties to even. Division by a power of two is exact, so the only rounding
    is the E2M1 one: error <= half the E2M1 step around |w/s|, times s. NaN/Inf raise.
    """
    w = _as_float(w, "mxfp4_quantize w").astype(np.float64)
    if w.ndim < 2 or w.shape[-1] % MXFP4_GROUP:
        raise ValueError(f"mxfp4_quantize: expected [..., out, in] with in % 32 == 0, got {w.shape}")
    _require_finite(w, "mxfp4_quantize w")
    groups = w.reshape(*w.shape[:-1], -1, MXFP4_GROUP)
    scales = ue8m0_scale_for_amax(np.abs(groups).max(axis=-1), E2M1_MAX)
    exponent = scales.astype(np.int64) - UE8M0_BIAS
    codes = e2m1_encode(np.ldexp(groups, -exponent[..., None]))
    return mxfp4_pack(codes.reshape(w.shape)), scales


def mxfp4_dequantize(packed, scales, *, name: str = "mxfp4") -> np.ndarray:
    """float32 ``fp4(c) * 2^(S-127)`` ``[..., out, in]`` (exact); a NaN scale byte raises."""
    values = _mxfp4_values(packed, f"{name} packed")
    scales = _as_scale_bytes(scales, f"{name} scales")
    _check_group_scales(values.shape, scales, MXFP4_GROUP, name)
    return _scale_groups(values, scales.astype(np.int32) - UE8M0_BIAS)


def _mxfp4_values(packed, name: str) -> np.ndarray:
    """float32 E2M1 values ``[..., in]`` of packed pairs."""
    return _E2M1_VALUES[mxfp4_unpack(packed, name=name)]


def _scale_groups(values: np.ndarray, exponent: np.ndarray) -> np.ndarray:
    """float32 ``values * 2^exponent`` with one exponent (>= -127) per 32 values along the last axis.

    Exact: fp4 and E4M3 values have at most 4 significant bits, so even 2^-127 scales stay exact.
    """
    scale = np.ldexp(np.float32(1.0), exponent)
    grouped = values.reshape(*exponent.shape, -1) * scale[..., None]
    return grouped.reshape(values.shape).astype(np.float32, copy=False)
