"""Weight and activation number formats of the checkpoint and of vLLM's SM90 (Humming) path, in NumPy.

Conventions (others code against them):
- E2M1 codes are uint8 0..15: bit 3 is the sign, ``c & 7 -> {0, .5, 1, 1.5, 2, 3, 4, 6}``, code 8 is -0.
- UE8M0 scales are uint8 exponent bytes, value ``2^(b-127)``, 0xFF = NaN. ``ml_dtypes.float8_e8m0fnu``
  arrays are accepted everywhere a scale is (viewed as uint8, zero-copy).
- MXFP4 weights: int8 ``[out, in/2]`` (low nibble = even k) + UE8M0 ``[out, in/32]``.
- FP8 weights: ``ml_dtypes.float8_e4m3fn [N, K]`` + UE8M0 ``[N/32, K/32]`` (one scale per 32x32 block);
  vLLM's per-row form ``[N, K/32]`` repeats each block row 32 times.
- Activations to the expert GEMMs: E4M3 per 128-value group of a row with a float32 scale.

Decisions the rest of hopdec relies on (details in the function docstrings):
- Power-of-two scales are chosen by the ceil rule: the smallest ``2^e`` with ``amax / 2^e <= max``
  (no clipping); this is the rule of DeepSeek's ``scale_fmt: ue8m0`` quantizers, not OCP's floor rule.
- NaN inputs raise ``ValueError``. ``e2m1_encode`` saturates +-Inf to +-6; quantizers that derive a
  scale from the data (``mxfp4_quantize``, ``fp8_block_quantize``, ``quantize_act_fp8``) raise on Inf.
- ``fused_e8m0`` copies Humming 0.1.19's ``process_fused_e8m0_scale`` + ``process_mxfp4_w4a8`` bit for
  bit, including the -0 (code 8) that its re-rounding leaves on a negative value that flushes to zero.
- A K that is not a multiple of the activation group (w2 input at TP4: I = 576 = 4.5 x 128) gets a
  short tail group, as Humming's input quantizer does (see ``quantize_act_fp8``).
"""

from __future__ import annotations

import dataclasses

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


# ---------------------------------------------------------------------------------------------------
# FP8 E4M3 weights with UE8M0 32x32 block scales


def _e4m3_rne_satfinite(x: np.ndarray) -> np.ndarray:
    """cvt.rn.satfinite.e4m3 of a float32 array (ml_dtypes rounds to nearest even; we saturate)."""
    return np.clip(x, -E4M3_MAX, E4M3_MAX).astype(_E4M3)


def fp8_block_quantize(w, block: int = FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 ``[N, K]``, UE8M0 uint8 ``[N/block, K/block]``) of float weights.

    Per block: ceil-rule power-of-two scale so the block amax fits 448, then ``RNE_satfinite(w / s)``.
    w is rounded to float32 first (checkpoint values are bf16/f32), so ``w / s`` is exact and E4M3 is
    the only rounding: relative error <= 2^-4 for results in the E4M3 normal range. NaN/Inf raise.
    """
    w = _as_float(w, "fp8_block_quantize w").astype(np.float32)
    if w.ndim != 2 or w.shape[0] % block or w.shape[1] % block:
        raise ValueError(f"fp8_block_quantize: expected [N, K] with N, K % {block} == 0, got {w.shape}")
    _require_finite(w, "fp8_block_quantize w")
    n, k = w.shape
    blocks = w.reshape(n // block, block, k // block, block)
    scales = ue8m0_scale_for_amax(np.abs(blocks).max(axis=(1, 3)), E4M3_MAX)
    exponent = scales.astype(np.int32)[:, None, :, None] - UE8M0_BIAS
    q = _e4m3_rne_satfinite(np.ldexp(blocks, -exponent).astype(np.float32))
    return q.reshape(n, k), scales


def fp8_block_scales_per_row(s, block: int = FP8_BLOCK, *, name: str = "scales") -> np.ndarray:
    """uint8 ``[N, K/block]`` from block scales ``[N/block, K/block]`` (vLLM's repeat along N)."""
    s = _as_scale_bytes(s, name, allow_nan=True)
    if s.ndim != 2:
        raise ValueError(f"{name}: expected block scales [N/{block}, K/{block}], got shape {s.shape}")
    return np.repeat(s, block, axis=0)


def _fp8_row_scales(w: np.ndarray, s, block: int, name: str) -> np.ndarray:
    """Per-row float32 scales ``[N, K/block]`` from block ``[N/block, K/block]`` or row form."""
    s = _as_scale_bytes(s, f"{name} scales")
    n, k = w.shape
    if k % block or n % block:
        raise ValueError(f"{name}: weight shape {w.shape} is not a multiple of the {block} block")
    if s.shape == (n // block, k // block):
        s = np.repeat(s, block, axis=0)
    elif s.shape != (n, k // block):
        raise ValueError(
            f"{name}: scales shape {s.shape} fits neither block form {(n // block, k // block)} "
            f"nor per-row form {(n, k // block)} of weight {w.shape}"
        )
    return ue8m0_decode(s)


def fp8_block_dequantize(w, s, block: int = FP8_BLOCK, *, name: str = "fp8 weight") -> np.ndarray:
    """float32 ``e4m3(w) * 2^(s-127)`` ``[N, K]``; s is block ``[N/32, K/32]`` or per-row ``[N, K/32]``.

    Exact in float32. NaN weight bytes (0x7F/0xFF) and NaN scale bytes raise.
    """
    w = np.asarray(w)
    if w.dtype != _E4M3 or w.ndim != 2:
        raise TypeError(f"{name}: expected float8_e4m3fn [N, K], got {w.dtype} {w.shape}")
    row_scales = _fp8_row_scales(w, s, block, name)
    raw = w.view(np.uint8)
    nan = (raw & 0x7F) == 0x7F
    if nan.any():
        idx = _first_index(nan)
        raise ValueError(f"{name}: E4M3 NaN byte 0x{raw[idx]:02X} at index {idx}")
    values = _E4M3_VALUES[raw].reshape(w.shape[0], -1, block) * row_scales[..., None]
    return values.reshape(w.shape)


# ---------------------------------------------------------------------------------------------------
# Humming SM90 fused E8M0 (humming-formats.md section 2.1, steps 1-6)


@dataclasses.dataclass(frozen=True, eq=False)
class FusedE8M0:
    """One sublayer (w13 or w2) of one or more experts after Humming's SM90 fused-E8M0 step.

    packed: int8 ``[..., out, in/2]``, re-rounded codes c' (low nibble = even k).
    offsets: uint8 ``[..., out, in/32]`` in [1, 12], ``max(S, lo) - lo + 1``.
    weight_scale_2: float32 ``[...]``, ``2^(lo-127) / 2`` per expert.
    lo: int32 ``[...]`` (0-d for one expert; ``int(f.lo)`` works), the expert's lowest kept exponent.
    Effective weight: ``fp4(c') * 2^(max(S, lo) - 127) = fp4(c') * 2^(offset - 1 + lo - 127)``.
    """

    packed: np.ndarray
    offsets: np.ndarray
    weight_scale_2: np.ndarray
    lo: np.ndarray


def humming_pad_sublayer(
    packed, scales, n_multiple: int = 256, k_multiple: int = 128
) -> tuple[np.ndarray, np.ndarray]:
    """Pad one MoE sublayer as Humming's ``check_and_pad_tensors`` does before the fused-E8M0 step.

    vLLM passes ``pad_n_to_multiple=256, pad_k_to_multiple=128``. Weights pad with zero bytes. Scales
    pad along K with the row's max byte (harmless: it changes neither smax nor smin), and along N with
    the e8m0 value 1.0 (byte 127, from ``F.pad(value=1)`` on a float8_e8m0fnu tensor). The N padding
    enters smax/smin of ``fused_e8m0``: at TP4 w13 has N = 2 x 576 = 1152 -> 1280, so every expert
    whose largest real scale is below 2^0 sees smax = 127 and may re-round its small groups.
    UNVERIFIED on a GPU: read from humming-kernels 0.1.19 ``transform.py``, not run.
    """
    packed = _as_packed(packed, "humming_pad_sublayer packed")
    scales = _as_scale_bytes(scales, "humming_pad_sublayer scales")
    _check_group_scales((*packed.shape[:-1], packed.shape[-1] * 2), scales, MXFP4_GROUP,
                        "humming_pad_sublayer")
    n, k = packed.shape[-2], packed.shape[-1] * 2
    pad_n, pad_k = -n % n_multiple, -k % k_multiple
    if pad_k % MXFP4_GROUP:
        raise ValueError(f"humming_pad_sublayer: K pad {pad_k} is not a multiple of 32")
    lead = [(0, 0)] * (packed.ndim - 2)
    packed = np.pad(packed, lead + [(0, pad_n), (0, pad_k // 2)])
    row_max = np.broadcast_to(scales.max(axis=-1, keepdims=True),
                              (*scales.shape[:-1], pad_k // MXFP4_GROUP))
    scales = np.concatenate([scales, row_max], axis=-1)
    scales = np.pad(scales, lead + [(0, pad_n), (0, 0)], constant_values=UE8M0_BIAS)
    return packed.view(np.int8), scales


def fused_e8m0(packed, scales, r_max: int = FUSED_E8M0_R_MAX, *, name: str = "expert") -> FusedE8M0:
    """Humming's SM90 fused-E8M0 transform of ONE sublayer (w13 or w2), per expert on leading axes.

    Bit-exact copy of humming-kernels 0.1.19 ``process_fused_e8m0_scale`` (FP8 activations) and the
    ``process_mxfp4_w4a8`` kernel, over all rows and groups of each expert ``[..., out, in]``:
    1. smax, smin of the scale bytes; ``r = min(smax - smin, r_max)``; ``lo = smax - r``.
    2. ``delta = max(S, lo) - S`` (non-zero only for groups more than r_max binades below smax).
    3. In every group code 8 (-0) becomes 0; then groups with delta > 0 are re-rounded,
       ``c' = fp4_round(fp4(c) * 2^-delta)`` to nearest with ties to the larger magnitude. Humming
       rounds with a sign-keeping bit trick, so a negative value that flushes to zero becomes code 8
       (-0) again; it is kept here so packed bytes match vLLM's.
    4. ``offset = max(S, lo) - lo + 1`` in [1, r_max + 1].
    5. ``weight_scale_2 = 2^(lo - 127) / 2`` (float32).
    vLLM runs this on what the rank holds (the TP slice, w13 = [w1; w3] as one sublayer) after
    ``humming_pad_sublayer``; call that first and slice back to match its numbers bit for bit.
    """
    packed = _as_packed(packed, f"{name} packed")
    scales = _as_scale_bytes(scales, f"{name} scales")
    if not 0 <= r_max <= FUSED_E8M0_R_MAX:
        raise ValueError(f"fused_e8m0: r_max must be in [0, {FUSED_E8M0_R_MAX}], got {r_max}")
    codes = mxfp4_unpack(packed, name=f"{name} packed")
    _check_group_scales(codes.shape, scales, MXFP4_GROUP, name)
    if scales.shape[-1] == 0 or scales.shape[-2] == 0:
        raise ValueError(f"{name}: empty expert, scales shape {scales.shape}")
    s = scales.astype(np.int32)
    smax, smin = s.max(axis=(-2, -1)), s.min(axis=(-2, -1))
    lo = smax - np.minimum(smax - smin, r_max)
    s_eff = np.maximum(s, lo[..., None, None])
    delta = s_eff - s

    codes = codes.reshape(*scales.shape, MXFP4_GROUP)
    codes[codes == 8] = 0
    shifted = delta > 0
    if shifted.any():
        values = np.ldexp(e2m1_decode(codes[shifted]), -delta[shifted][:, None])
        codes[shifted] = e2m1_encode(values, rounding="nearest_away")
    weight_scale_2 = np.ldexp(np.float32(1.0), lo - UE8M0_BIAS) / np.float32(2.0)
    return FusedE8M0(
        packed=mxfp4_pack(codes.reshape(*scales.shape[:-1], -1)),
        offsets=(s_eff - lo[..., None, None] + 1).astype(np.uint8),
        weight_scale_2=np.asarray(weight_scale_2, dtype=np.float32),
        lo=np.asarray(lo, dtype=np.int32),
    )


def fused_e8m0_dequantize(f: FusedE8M0) -> np.ndarray:
    """float32 effective weight ``fp4(c') * 2^(max(S, lo) - 127)`` ``[..., out, in]`` (exact)."""
    exponent = f.offsets.astype(np.int32) - 1 + f.lo[..., None, None] - UE8M0_BIAS
    return _scale_groups(_mxfp4_values(f.packed, "FusedE8M0.packed"), exponent)


def fused_e8m0_e4m3_bytes(f: FusedE8M0) -> np.ndarray:
    """uint8 ``[..., out, in]``: the E4M3 byte the SM90 kernel expands each code to.

    Value ``fp4(c') * 2^(offset - 6)``, exact since offset <= 12 keeps the exponent field <= 15 (as
    Humming's ``fused_dequant_single_for_mxfp4``); code 8 gives 0x80. ``value * 2^6 * weight_scale_2``
    is the effective weight.
    """
    values = _mxfp4_values(f.packed, "FusedE8M0.packed")
    values = _scale_groups(values, f.offsets.astype(np.int32) - FUSED_E8M0_EXP_OFFSET)
    e4m3 = values.astype(_E4M3)
    assert np.array_equal(e4m3.astype(np.float32), values), "fused E4M3 expansion must be exact"
    return e4m3.view(np.uint8)


# ---------------------------------------------------------------------------------------------------
# Activations (humming-formats.md section 3)


def _num_groups(k: int, group: int) -> int:
    return -(-k // group)


def quantize_act_fp8(x, group: int = ACT_GROUP) -> tuple[np.ndarray, np.ndarray]:
    """(q e4m3 ``[M, K]``, float32 scales ``[M, ceil(K/group)]``): Humming's DynamicGroup input quant.

    Per row and group: ``s = max(amax / 448, 1e-30)`` in float32 (not a power of two),
    ``q = RNE_satfinite(x * (1/s))`` with 1/s the float32 reciprocal and one float32 multiply.
    K % group != 0 gives a last, shorter group (K = 576 at TP4: four of 128 and one of 64).
    Humming does the same: ``get_group_scale_shape`` allots ceil(K/group) scales and its quantizer
    reads columns >= K as inactive, so the tail's amax is over its real values; the GEMM pads w2's K
    to 640 with zero weights. Identical to zero-padding x to 640. Read from humming-kernels 0.1.19
    (``process_input/quantization.cuh``, ``config.py``), not run; which activation mode stock vLLM
    V4.1 uses is itself UNVERIFIED (humming-formats.md section 6.1). NaN/Inf in x raise.
    """
    x = _as_float(x, "quantize_act_fp8 x")
    if x.ndim != 2:
        raise ValueError(f"quantize_act_fp8: expected x [M, K], got shape {x.shape}")
    if group <= 0:
        raise ValueError(f"quantize_act_fp8: group must be > 0, got {group}")
    x = x.astype(np.float32)
    _require_finite(x, "quantize_act_fp8 x")
    m, k = x.shape
    groups = _num_groups(k, group)
    padded = np.zeros((m, groups * group), dtype=np.float32)
    padded[:, :k] = x
    padded = padded.reshape(m, groups, group)
    amax = np.abs(padded).max(axis=-1) if groups else np.zeros((m, 0), np.float32)
    scales = np.maximum(amax / np.float32(E4M3_MAX), np.float32(ACT_SCALE_FLOOR))
    inverse = np.float32(1.0) / scales
    q = _e4m3_rne_satfinite(padded * inverse[..., None])
    return q.reshape(m, -1)[:, :k], scales.astype(np.float32)


def dequantize_act_fp8(q, s, group: int = ACT_GROUP) -> np.ndarray:
    """float32 ``q * s`` ``[M, K]`` with s ``[M, ceil(K/group)]`` (tail group as in quantize_act_fp8)."""
    q = np.asarray(q)
    s = np.asarray(s)
    if q.dtype != _E4M3 or q.ndim != 2:
        raise TypeError(f"dequantize_act_fp8: expected float8_e4m3fn [M, K], got {q.dtype} {q.shape}")
    m, k = q.shape
    if s.dtype != np.float32 or s.shape != (m, _num_groups(k, group)):
        raise ValueError(
            f"dequantize_act_fp8: scales {s.dtype} {s.shape}; expected float32 "
            f"{(m, _num_groups(k, group))} for q {q.shape} and group {group}"
        )
    return q.astype(np.float32) * np.repeat(s, group, axis=1)[:, :k]


# ---------------------------------------------------------------------------------------------------
# BF16


def to_bf16(x) -> np.ndarray:
    """ml_dtypes.bfloat16 of x, round to nearest even (float64 in is rounded once, not twice)."""
    x = np.asarray(x)
    if x.dtype == np.float64:
        x = _float64_to_float32_round_odd(x)
    return _as_float(x, "to_bf16 x").astype(_BF16)


def bf16_round(x) -> np.ndarray:
    """float32 of ``to_bf16(x)``: x rounded to bf16 precision."""
    return to_bf16(x).astype(np.float32)


def _float64_to_float32_round_odd(x: np.ndarray) -> np.ndarray:
    # ml_dtypes goes float64 -> float32 -> bf16, which can round twice. Rounding to float32 "to odd"
    # (truncate, then set the last bit if inexact) keeps enough information for one correct RNE.
    with np.errstate(over="ignore"):
        y = x.astype(np.float32)
    too_far = np.abs(y.astype(np.float64)) > np.abs(x)
    y = np.where(too_far, np.nextafter(y, np.float32(0)), y).astype(np.float32)
    inexact = np.isfinite(x) & (y.astype(np.float64) != x)
    bits = y.view(np.uint32) | inexact.astype(np.uint32)
    return bits.view(np.float32)


# ---------------------------------------------------------------------------------------------------
# Reference GEMMs (float32 accumulation), used by the reference step and the kernel tests


def _effective_expert_weight(weight) -> np.ndarray:
    if isinstance(weight, FusedE8M0):
        return fused_e8m0_dequantize(weight)
    if isinstance(weight, tuple) and len(weight) == 2:
        return mxfp4_dequantize(*weight, name="w4a8_linear weight")
    weight = np.asarray(weight)
    if weight.dtype != np.float32:
        raise TypeError(
            "w4a8_linear: weight must be FusedE8M0, (packed, scales) or a float32 [N, K] "
            f"effective weight, got {weight.dtype}"
        )
    return weight


def _pad_k(a: np.ndarray, group: int) -> np.ndarray:
    """a ``[R, K]`` zero-padded along K to a whole number of groups (no copy when already whole)."""
    tail = -a.shape[1] % group
    return np.pad(a, ((0, 0), (0, tail))) if tail else a


def w4a8_linear(x, weight, group: int = ACT_GROUP) -> np.ndarray:
    """float32 ``[M, N]`` of one expert's W4A8 GEMM as SM90 Humming computes it.

    weight: FusedE8M0 (vLLM's numbers), (packed, scales) (plain MXFP4, the "true" reference), or an
    already dequantized float32 ``[N, K]`` (cache it: dequantizing dominates the cost).
    x ``[M, K]`` (bf16 values) is quantized per ``quantize_act_fp8``; then per K-group j a float32
    partial ``P_j = xq_j @ W_j^T`` (the WGMMA segment), and ``y += as[:, j] * P_j`` in float32, j in
    order. The kernel's E4M3 weight is ``W * 2^-k`` for a power of two, so this is the same arithmetic.
    """
    w = _effective_expert_weight(weight)
    x = _as_float(x, "w4a8_linear x")
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"w4a8_linear: x {x.shape} and weight {w.shape} must be [M, K] and [N, K]")
    q, scales = quantize_act_fp8(x, group)
    xq, wp = _pad_k(q.astype(np.float32), group), _pad_k(w, group)
    m, groups = scales.shape
    # [G, M, g] @ [G, g, N] -> [G, M, N]: one float32 partial per group.
    partials = np.matmul(xq.reshape(m, groups, group).transpose(1, 0, 2),
                         wp.reshape(-1, groups, group).transpose(1, 2, 0))
    y = np.zeros((m, w.shape[0]), dtype=np.float32)
    for j in range(groups):
        y += scales[:, j, None] * partials[j]
    return y


def w8a16_linear(x_bf16, w_e4m3, scales) -> np.ndarray:
    """float32 ``x @ (e4m3(w) * 2^(s-127))^T`` ``[M, N]`` with float32 accumulation (W8A16).

    x: bf16 (or float32 holding bf16 values) ``[M, K]``; scales block ``[N/32, K/32]`` or per-row
    ``[N, K/32]``. The caller rounds the result to bf16 (``to_bf16``).
    """
    w = fp8_block_dequantize(w_e4m3, scales, name="w8a16_linear weight")
    x = _as_float(x_bf16, "w8a16_linear x").astype(np.float32)
    if x.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"w8a16_linear: x {x.shape} and weight {w.shape} must be [M, K] and [N, K]")
    return np.matmul(x, w.T)
