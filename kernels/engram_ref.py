"""NumPy reference of V4.1 Engram: n-gram hash ids, FP8 table lookup, and the per-stream gate.

Model doc §2.1 step 3 and §2.2 E1-E3, following DeepSeek's Engram `NgramHashMapping`:

- Multipliers (odd int64, from `np.random.default_rng(10007·layer)`) and the prime bucket sizes come
  from `loader.config.ModelConfig.engram_hash_multipliers` / `engram_primes` (one global prime walk).
- Token ids go through the compressed-vocabulary map first (`compress`, loader/engram_vocab.py).
  Positions before 0 read the pad: the config's `engram_pad_token_id` is a RAW token id and the
  compressed pad is map[pad_id] (DeepSeek's `NgramHashMapping`: `pad_id = lookup_table[pad_id]`),
  so padding the raw history (`ngram_history`) and then mapping it is the same thing.
- For order n = 2..max_ngram at a row of position p: mix = XOR_{k<n} (tok[p-k]·mult[k]) over the
  compressed token ids. Head h of order n takes
  row `mix mod prime[n, h] + offset[n, h]`, offsets being the running sum of the layer's primes in
  (n, h) order. Result: int64 [R, (max_ngram-1)·heads], column c = (n-2)·heads + h.
- Lookup: each id selects one FP8 E4M3 table row of `head_dim` values with one UE8M0 scale per
  32 values; the product is exact in BF16.
- Gate (E3), per stream i, in fp32: d_i = Σ_d (x̂_i·q_w_i)(k̂_i·k_w_i) / √D with x̂, k̂ RMS-normalised
  (eps = rms_norm_eps), g_i = σ(sign(d_i)·√max(|d_i|, 1e-6)), X_i += g_i·v, stored BF16.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from loader.formats import bf16_round as round_bf16

SCALE_GROUP = 32


def ngram_history(tokens: np.ndarray, positions: np.ndarray, max_ngram: int,
                  pad_id: int) -> np.ndarray:
    """Token history per row: [R, max_ngram], column k = the token at position p-k.

    `tokens[r, k]` must already hold the token at p-k for every k with p-k >= 0 (callers pass the
    last max_ngram tokens of the sequence, newest first); entries at negative positions become pad.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.shape != (positions.shape[0], max_ngram):
        raise ValueError(f"engram history must be [R, {max_ngram}], got {tokens.shape}")
    before_start = (positions[:, None] - np.arange(max_ngram)[None, :]) < 0
    return np.where(before_start, np.int64(pad_id), tokens)


def compress(history: np.ndarray, vocab_map: np.ndarray) -> np.ndarray:
    """Raw token ids (any shape) -> compressed ids int64 through `vocab_map` [vocab_size]."""
    history = np.asarray(history, np.int64)
    if history.size and (history.min() < 0 or history.max() >= vocab_map.shape[0]):
        raise ValueError(f"engram history ids must be in [0, {vocab_map.shape[0]}) (the vocab "
                         f"map's size), got {history.min()}..{history.max()}")
    return np.asarray(vocab_map, np.int64)[history]


def hash_ids(history: np.ndarray, multipliers: np.ndarray, primes: np.ndarray) -> np.ndarray:
    """[R, max_ngram] compressed-token history -> global table rows int64 [R, orders·heads].

    `primes` is [orders, heads] (orders = max_ngram - 1, for n = 2..max_ngram).
    """
    orders, heads = primes.shape
    if history.shape[1] != orders + 1 or multipliers.shape != (orders + 1,):
        raise ValueError(f"engram hash: history {history.shape}, multipliers {multipliers.shape}, "
                         f"primes {primes.shape} disagree on max_ngram")
    offsets = np.concatenate([[0], np.cumsum(primes.reshape(-1))[:-1]]).reshape(orders, heads)
    products = history * multipliers[None, :]
    mix = products[:, 0]
    ids = np.empty((history.shape[0], orders, heads), dtype=np.int64)
    for order in range(orders):
        mix = np.bitwise_xor(mix, products[:, order + 1])
        ids[:, order, :] = mix[:, None] % primes[order][None, :] + offsets[order][None, :]
    return ids.reshape(history.shape[0], orders * heads)


def lookup(ids: np.ndarray, table_codes: np.ndarray, table_scales: np.ndarray,
           row_offset: int = 0) -> np.ndarray:
    """E1 for one rank: ids [R, h_l] (global rows) -> [R, h_l, head_dim] BF16 values (exact).

    table_codes: FP8 E4M3 [rows_l, head_dim] (ml_dtypes float8_e4m3fn or its uint8 bytes);
    table_scales: UE8M0 bytes [rows_l, head_dim/32]; the rank's table starts at global row row_offset.
    """
    local = ids - int(row_offset)
    if local.size and (local.min() < 0 or local.max() >= table_codes.shape[0]):
        raise ValueError(f"engram ids out of this rank's table rows [{row_offset}, "
                         f"{row_offset + table_codes.shape[0]})")
    codes = np.asarray(table_codes)
    if codes.dtype == np.uint8:
        codes = codes.view(ml_dtypes.float8_e4m3fn)
    values = codes[local].astype(np.float32)
    exps = np.asarray(table_scales, dtype=np.uint8)[local].astype(np.int32) - 127
    scales = np.ldexp(np.float32(1.0), exps).astype(np.float32)
    return values * np.repeat(scales, SCALE_GROUP, axis=-1)


def _rms_normalize(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))


def gate_update(streams: np.ndarray, keys_and_value: np.ndarray, q_weight: np.ndarray,
                k_weight: np.ndarray, norm_eps: float) -> np.ndarray:
    """E3: streams [R, n, D] + wkv output [R, (n+1)·D] -> updated streams [R, n, D] (BF16 values)."""
    rows, n, dim = streams.shape
    if keys_and_value.shape != (rows, (n + 1) * dim) or q_weight.shape != (n, dim) \
            or k_weight.shape != (n, dim):
        raise ValueError(f"engram gate: streams {streams.shape}, wkv out {keys_and_value.shape}, "
                         f"q_weight {q_weight.shape}, k_weight {k_weight.shape}")
    kv = keys_and_value.astype(np.float32)
    keys, value = kv[:, :n * dim].reshape(rows, n, dim), kv[:, n * dim:]
    query = _rms_normalize(streams.astype(np.float32), norm_eps) * q_weight.astype(np.float32)
    key = _rms_normalize(keys, norm_eps) * k_weight.astype(np.float32)
    dot = (query * key).sum(axis=-1) / np.float32(np.sqrt(dim))
    signed_root = np.sign(dot) * np.sqrt(np.maximum(np.abs(dot), np.float32(1e-6)))
    gate = 1.0 / (1.0 + np.exp(-signed_root))
    return round_bf16(streams.astype(np.float32) + gate[:, :, None] * value[:, None, :])
