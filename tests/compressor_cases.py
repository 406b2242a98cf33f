"""Inputs and checks of the compressor kernel tests, shared by the GPU test
(tests/gpu/test_compressor_publish.py), its CPU emulator twin (tests/test_emulate_compressor.py)
and the reference's CPU checks (tests/test_compressor_kernel_cpu.py).

The tolerances are kernels/compressor_kernel_ref.py's (`proj_tolerance`, `entry_tolerance`,
`key_tolerance`); the GPU test's docstring says why the arithmetic justifies them. References
only: the device machine has no CuTe DSL.
"""
from __future__ import annotations

import numpy as np

from kernels import compressor_kernel_ref as ck
from kernels import kvrecord_ref
from loader import formats


def random_weights(rng, ratio: int, hidden: int) -> np.ndarray:
    """The projection weight [HEAD_DIM * ratio, hidden]: fp32 at r = 2, bf16 values at r = 1."""
    w = (rng.standard_normal((ck.HEAD_DIM * ratio, hidden)) * 0.02).astype(np.float32)
    return w if ratio == 2 else formats.bf16_round(w)


def make_rows(rng, blocks, padding: int, seqs: int):
    """positions, seq_index (then `padding` rows of -1) of `blocks` ((start position, rows) per
    sequence), and the sequences' state lines: a permutation of seqs + 3 lines."""
    pos, seq = [], []
    for q, (start, n) in enumerate(blocks):
        pos += list(range(start, start + n))
        seq += [q] * n
    pos += [int(rng.integers(0, 100))] * padding
    seq += [-1] * padding
    lines = rng.permutation(seqs + 3)[:seqs].astype(np.int32)
    return np.array(pos, np.int32), np.array(seq, np.int32), lines


def rings_before(rng, blocks, lines, ring_lines: int) -> np.ndarray:
    """Ring lines [ring_lines, RING_ROWS, RING_WIDTH]: each sequence's line holds random rows at
    the RING_ROWS positions before its block (an earlier step); every other row NaN."""
    ring = np.full((ring_lines, ck.RING_ROWS, ck.RING_WIDTH), np.nan, np.float32)
    for q, (start, _) in enumerate(blocks):
        for p in range(max(0, start - ck.RING_ROWS), start):
            ring[lines[q], p % ck.RING_ROWS] = rng.standard_normal(ck.RING_WIDTH)
    return ring


def check_projection(kv_score, rows: int, x, w) -> None:
    """kv_score's first `rows` rows within `proj_tolerance` of the float64 product, the rest
    still NaN (poison)."""
    want = x.astype(np.float64) @ w.astype(np.float64).T
    bad = ~(np.abs(kv_score[:rows] - want) <= ck.proj_tolerance(x, w))
    assert not bad.any(), (f"{bad.sum()} outputs out of tolerance, first at {np.argwhere(bad)[0]}:"
                           f" {kv_score[:rows][bad][0]} vs {want[bad][0]}")
    assert np.isnan(kv_score[rows:]).all(), "the projection wrote past the batch"


def check_records(got_cache, got_keys, slots, entries, keys, total_slots: int) -> None:
    """Published records decoded within the entry / index-key tolerances, pad byte 0; every slot
    nothing publishes to keeps its 0xFF poison."""
    written = slots[slots >= 0]
    untouched = np.ones(total_slots, bool)
    untouched[written] = False
    assert (got_cache[untouched] == 0xFF).all(), "an entry record outside the published slots"
    assert (got_keys[untouched] == 0xFF).all(), "an index key outside the published slots"
    ok = slots >= 0
    if not ok.any():                     # r = 2 at an even decode position only writes the ring
        return
    assert (got_cache[written, -1] == 0).all(), "record pad byte"
    dec = kvrecord_ref.decode_kv_record(got_cache[written])
    bad = ~(np.abs(dec - entries[ok]) <= ck.entry_tolerance(entries[ok]))
    assert not bad.any(), (f"{bad.sum()} entry values out of tolerance, first at "
                           f"{np.argwhere(bad)[0]}: {dec[bad][0]} vs {entries[ok][bad][0]}")
    deck = kvrecord_ref.decode_index_key(got_keys[written])
    bad = ~(np.abs(deck - keys[ok]) <= ck.key_tolerance(keys[ok]))
    assert not bad.any(), (f"{bad.sum()} index key values out of tolerance, first at "
                           f"{np.argwhere(bad)[0]}: {deck[bad][0]} vs {keys[ok][bad][0]}")
