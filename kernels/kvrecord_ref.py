"""NumPy reference of the SM90 KV-cache records: the 584-byte latent and the 132-byte index key.

Latent record (one SWA or compressed entry; vLLM SM90 / FlashMLA "MODEL1 FP8 sparse" layout, AoS):

    bytes [  0, 448)  448 x FP8 E4M3  nope dims 0..447, each divided by its group's scale
    bytes [448, 576)   64 x BF16      rope dims 448..511 (little endian), stored as is
    bytes [576, 583)    7 x UE8M0     one power-of-two scale per 64 nope dims: 2^(byte - 127)
    byte   583          pad (0)

Index key record (one 128-d indexer key):

    bytes [  0, 128)  128 x FP8 E4M3  key / scale
    bytes [128, 132)    1 x float32   scale (little endian), a power of two

Scales: `s = 2^ceil(log2(max(amax, 1e-4) / 448))`, so `|x / s| <= 448` and the FP8 cast (round to
nearest even) never saturates; an all-zero group gets the floor scale. Decoding multiplies back;
FP8 x 2^k and BF16 are exact in float32, so decode(encode(x)) is the value every kernel reads.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from loader import formats

HEAD_DIM = 512
NOPE_DIM = 448
ROPE_DIM = 64
KV_SCALE_GROUP = 64
KV_NUM_SCALES = NOPE_DIM // KV_SCALE_GROUP  # 7
KV_ROPE_OFFSET = NOPE_DIM  # 448
KV_SCALE_OFFSET = NOPE_DIM + 2 * ROPE_DIM  # 576
KV_RECORD_BYTES = 584  # 576 + 7 scales + 1 pad

INDEX_DIM = 128
INDEX_SCALE_OFFSET = INDEX_DIM
INDEX_RECORD_BYTES = 132

FP8_MAX = 448.0
# uncertain: amax floor 1e-4 as in DeepSeek's act_quant / FlashMLA's quantizer; vLLM's SM90 V4 cache
# kernel was not read. It only matters for all-zero (or near-zero) groups.
AMAX_FLOOR = 1e-4

_FP8 = ml_dtypes.float8_e4m3fn
_BF16 = ml_dtypes.bfloat16


def pow2_scale_exponent(amax: np.ndarray) -> np.ndarray:
    """Exponent k (int32) of the smallest power of two 2^k with max(amax, 1e-4) / 2^k <= 448."""
    floored = np.maximum(amax.astype(np.float32), np.float32(AMAX_FLOOR))
    return formats.ue8m0_scale_for_amax(floored, FP8_MAX).astype(np.int32) - 127


def _fp8_bytes(scaled: np.ndarray) -> np.ndarray:
    """FP8 E4M3 bytes, round to nearest even; |scaled| <= 448 by construction (clip is a no-op)."""
    return np.clip(scaled, -FP8_MAX, FP8_MAX).astype(_FP8).view(np.uint8)


def _fp8_values(raw: np.ndarray) -> np.ndarray:
    return raw.view(_FP8).astype(np.float32)


def _check(name: str, arr: np.ndarray, dtype, last: int) -> None:
    ok = isinstance(arr, np.ndarray) and arr.dtype == dtype and arr.ndim == 2
    if not ok or arr.shape[1] != last:
        got = f"{arr.dtype} {arr.shape}" if isinstance(arr, np.ndarray) else type(arr).__name__
        raise ValueError(f"{name}: expected a {np.dtype(dtype).name} array [N, {last}], got {got}")


def encode_kv_record(entries: np.ndarray) -> np.ndarray:
    """[N, 512] float32 (rope dims already rotated) -> [N, 584] uint8 records."""
    _check("kv entries", entries, np.float32, HEAD_DIM)
    if not np.isfinite(entries).all():
        raise ValueError("kv entries: non-finite values cannot be stored in a KV record")
    n = entries.shape[0]
    nope = entries[:, :NOPE_DIM].reshape(n, KV_NUM_SCALES, KV_SCALE_GROUP)
    exps = pow2_scale_exponent(np.abs(nope).max(axis=2))  # [N, 7]
    out = np.zeros((n, KV_RECORD_BYTES), np.uint8)
    out[:, :NOPE_DIM] = _fp8_bytes(np.ldexp(nope, -exps[:, :, None])).reshape(n, NOPE_DIM)
    rope = entries[:, NOPE_DIM:].astype(_BF16)
    out[:, KV_ROPE_OFFSET:KV_SCALE_OFFSET] = rope.view(np.uint8).reshape(n, 2 * ROPE_DIM)
    out[:, KV_SCALE_OFFSET:KV_SCALE_OFFSET + KV_NUM_SCALES] = (exps + 127).astype(np.uint8)
    return out


def decode_kv_record(records: np.ndarray) -> np.ndarray:
    """[N, 584] uint8 records -> [N, 512] float32 entries (exactly what a kernel dequantizes)."""
    _check("kv records", records, np.uint8, KV_RECORD_BYTES)
    n = records.shape[0]
    exps = records[:, KV_SCALE_OFFSET:KV_SCALE_OFFSET + KV_NUM_SCALES].astype(np.int32) - 127
    nope = _fp8_values(np.ascontiguousarray(records[:, :NOPE_DIM])).reshape(n, KV_NUM_SCALES, -1)
    out = np.empty((n, HEAD_DIM), np.float32)
    out[:, :NOPE_DIM] = np.ldexp(nope, exps[:, :, None]).reshape(n, NOPE_DIM)
    rope = np.ascontiguousarray(records[:, KV_ROPE_OFFSET:KV_SCALE_OFFSET]).view(_BF16)
    out[:, NOPE_DIM:] = rope.astype(np.float32)
    return out


def quantize_kv(entries: np.ndarray) -> np.ndarray:
    """decode(encode(entries)): the values a reader of the cache sees."""
    return decode_kv_record(encode_kv_record(entries))


def encode_index_key(keys: np.ndarray) -> np.ndarray:
    """[N, 128] float32 index keys -> [N, 132] uint8 records (FP8 + one fp32 power-of-two scale)."""
    _check("index keys", keys, np.float32, INDEX_DIM)
    if not np.isfinite(keys).all():
        raise ValueError("index keys: non-finite values cannot be stored in an index key record")
    # uncertain: power-of-two fp32 scale (V4.1's scale_fmt ue8m0 applied to vLLM's indexer K cache);
    # a plain amax/448 scale would be the other reading.
    exps = pow2_scale_exponent(np.abs(keys).max(axis=1))
    out = np.empty((keys.shape[0], INDEX_RECORD_BYTES), np.uint8)
    out[:, :INDEX_DIM] = _fp8_bytes(np.ldexp(keys, -exps[:, None]))
    scales = np.ldexp(np.ones_like(exps, dtype=np.float32), exps).astype("<f4")
    out[:, INDEX_SCALE_OFFSET:] = scales.view(np.uint8).reshape(-1, 4)
    return out


def decode_index_key(records: np.ndarray) -> np.ndarray:
    """[N, 132] uint8 records -> [N, 128] float32 keys."""
    _check("index key records", records, np.uint8, INDEX_RECORD_BYTES)
    scales = np.ascontiguousarray(records[:, INDEX_SCALE_OFFSET:]).view("<f4").astype(np.float32)
    return _fp8_values(np.ascontiguousarray(records[:, :INDEX_DIM])) * scales


def quantize_index_key(keys: np.ndarray) -> np.ndarray:
    """decode(encode(keys))."""
    return decode_index_key(encode_index_key(keys))
