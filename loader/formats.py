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

import numpy as np

from loader.formats_mx import (
    _BF16,
    _E4M3,
    _E4M3_VALUES,
    ACT_GROUP,
    ACT_SCALE_FLOOR,
    E2M1_MAX,
    E4M3_MAX,
    FP8_BLOCK,
    FUSED_E8M0_EXP_OFFSET,
    FUSED_E8M0_R_MAX,
    MXFP4_GROUP,
    UE8M0_BIAS,
    UE8M0_MAX_FINITE,
    UE8M0_NAN,
    _as_float,
    _as_packed,
    _as_scale_bytes,
    _check_group_scales,
    _first_index,
    _mxfp4_values,
    _require_finite,
    _scale_groups,
    e2m1_decode,
    e2m1_encode,
    e2m1_round_away,
    mxfp4_dequantize,
    mxfp4_pack,
    mxfp4_quantize,
    mxfp4_unpack,
    ue8m0_decode,
    ue8m0_encode_pow2,
    ue8m0_scale_for_amax,
)

# The public names, defined here or in loader/formats_mx.py (callers import them all from here).
__all__ = [
    "ACT_GROUP",
    "ACT_SCALE_FLOOR",
    "E2M1_MAX",
    "E4M3_MAX",
    "FP8_BLOCK",
    "FUSED_E8M0_EXP_OFFSET",
    "FUSED_E8M0_R_MAX",
    "MXFP4_GROUP",
    "UE8M0_BIAS",
    "UE8M0_MAX_FINITE",
    "UE8M0_NAN",
    "FusedE8M0",
    "bf16_round",
    "dequantize_act_fp8",
    "e2m1_decode",
    "e2m1_encode",
    "e2m1_round_away",
    "fp8_block_dequantize",
    "fp8_block_quantize",
    "fp8_block_scales_per_row",
    "fused_e8m0",
    "fused_e8m0_dequantize",
    "fused_e8m0_e4m3_bytes",
    "humming_pad_sublayer",
    "mxfp4_dequantize",
    "mxfp4_pack",
    "mxfp4_quantize",
    "mxfp4_unpack",
    "quantize_act_fp8",
    "to_bf16",
    "ue8m0_decode",
    "ue8m0_encode_pow2",
    "ue8m0_scale_for_amax",
    "w4a8_linear",
    "w8a16_linear",
]


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
