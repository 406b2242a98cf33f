"""Inputs and checks of the embed / Engram kernel tests, shared by the GPU test
(tests/gpu/test_embed_engram.py) and its CPU emulator twin (tests/test_emulate_embed_engram.py).

Embedding, hash ids and lookup are bitwise; the gate is held to `engram_kernel_ref.
gate_error_bound` (the GPU test's docstring says why). References only: the device machine has no
CuTe DSL.
"""
from __future__ import annotations

import numpy as np

from executor.embed_engram_chain import random_table, random_vocab_map
from kernels import engram_kernel_ref as ek
from kernels.common_ref import to_bf16

SPECIAL_ROWS = ek.MAX_SCALE_BYTE + 1   # the table rows holding every finite code / scale byte


def bits_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Bitwise equal as 16-bit words; names the first differing element."""
    g, w = got.view(np.uint16), want.view(np.uint16)
    bad = np.argwhere(g != w)
    if len(bad):
        i = tuple(bad[0])
        raise AssertionError(f"{what}: {len(bad)} of {g.size} elements differ, first at {i}: "
                             f"got {g[i]:#06x} want {w[i]:#06x}")


def hash_inputs(rng, cfg, spec, rows: int):
    """Raw tokens over the vocabulary (row 5: off the map, read as the pad), positions (0..3: the
    pad), and a fresh random non-identity map onto 3/4 of the compressed range, tokens[0] mapped
    to the largest compressed id (the largest products)."""
    tokens = rng.integers(0, spec.vocab_size, (rows, spec.max_ngram)).astype(np.int32)
    vocab_map = random_vocab_map(rng, spec.vocab_size, cfg.engram_compressed_vocab_size * 3 // 4)
    vocab_map[tokens[0]] = cfg.engram_compressed_vocab_size - 1
    if rows > 5:
        tokens[5, :3] = (-1, spec.vocab_size, np.iinfo(np.int32).min)
    positions = rng.integers(0, 100_000, rows).astype(np.int32)
    positions[:min(rows, 4)] = np.arange(min(rows, 4))
    return tokens, positions, vocab_map


def every_code_table(rng, table_rows: int, head_dim: int):
    """Random table whose first SPECIAL_ROWS rows hold every finite E4M3 code and every scale
    byte 0..134 (R >= 48 reads all of them)."""
    codes, scales = random_table(rng, table_rows, head_dim)
    finite = np.array([b for b in range(256) if b & 0x7F != 0x7F], np.uint8)
    codes.reshape(-1)[:finite.size] = finite
    scales.reshape(-1)[:SPECIAL_ROWS] = np.arange(SPECIAL_ROWS)
    return codes, scales


def lookup_ids(rng, spec, rows: int, first_col: int, row_offset: int, table_rows: int):
    """Chosen ids [rows, total_cols] over the table at `row_offset`: this rank's columns start
    with every special row (every code and scale byte), the last id is the table's last row, and
    (rows > 3) two ids fall one row off either end (NaN heads)."""
    ids = rng.integers(row_offset, row_offset + table_rows, (rows, spec.total_cols),
                       dtype=np.int64)
    mine = ids[:, first_col:first_col + spec.cols]     # a view: writes go to ids
    k = min(mine.size, SPECIAL_ROWS)
    mine.flat[:k] = row_offset + np.arange(k)
    ids[-1, first_col + spec.cols - 1] = row_offset + table_rows - 1
    if rows > 3:
        ids[-2, first_col] = row_offset - 1
        ids[-3, first_col + spec.cols - 1] = row_offset + table_rows
    return ids


def gate_inputs(rng, rows: int, n: int, d: int):
    """Streams x [rows, n, d], keys_and_value [rows, (n + 1) d], q and k norm weights; row 0's
    key makes the gate's dot product large and positive, row 1's negative and zero."""
    x = to_bf16(rng.standard_normal((rows, n, d)) * rng.uniform(0.05, 20, (rows, n, 1)))
    kv = to_bf16(rng.standard_normal((rows, (n + 1) * d)) * rng.uniform(0.05, 20))
    qw = to_bf16(rng.uniform(0.2, 2.0, (n, d)))
    kw = to_bf16(rng.uniform(0.2, 2.0, (n, d)))
    kv[0, :n * d] = to_bf16(x[0].reshape(-1) * 2)          # d large and positive
    if rows > 1:
        kv[1, :d] = to_bf16(-x[1, 0])                       # d < 0
        x[1, 1] = 0                                         # d = 0: g = 1/2
    return x, kv, qw, kw


def check_gate(spec, got, x, kv, qw, kw, eps, what: str) -> None:
    """Every element written and within `gate_error_bound` of the float64 gate."""
    exact, bound = ek.gate_error_bound(x, kv, qw, kw, eps, spec)
    got = got.astype(np.float64)
    assert not np.isnan(got).any(), f"{what}: unwritten elements"
    bad = np.argwhere(~(np.abs(got - exact) <= bound))
    assert not len(bad), (f"{what}: {len(bad)} elements out of bound, first {tuple(bad[0])}: "
                          f"got {got[tuple(bad[0])]!r} want {exact[tuple(bad[0])]!r} bound "
                          f"{bound[tuple(bad[0])]!r}")
