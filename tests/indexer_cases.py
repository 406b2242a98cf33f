"""Rows and checks of the indexer kernel tests, shared by the GPU test
(tests/gpu/test_indexer_publish.py) and its CPU emulator twin (tests/test_emulate_indexer.py).

Plan and q fragments / scales / weights bitwise; scores within `indexer_kernel_ref.
score_tolerance` and NaN (poison) wherever nothing may be written (the GPU test's docstring says
why). References only: the device machine has no CuTe DSL.
"""
from __future__ import annotations

import numpy as np

from kernels import indexer_kernel_ref as ik
from kernels import indexer_ref


def make_rows(rng, context: int, rows: int, padding: int):
    """Sequences of 1 (R = 1), 5 (a draft-sized block) or 6 rows ending near `context`, then
    `padding` rows of sequence -1: positions, seq_index and the number of sequences."""
    per = 1 if rows == 1 else 5 if rows == 5 else 6
    pos, seq = [], []
    q = 0
    while len(pos) < rows:
        n = min(per, rows - len(pos))
        end = max(n, context - int(rng.integers(0, 3)))
        pos += list(range(end - n, end))
        seq += [q] * n
        q += 1
    pos += [0] * padding
    seq += [-1] * padding
    return np.array(pos, np.int32), np.array(seq, np.int32), q


def check_prep(get, ratio: int, mode: str, codes, scales, w, positions, seq_index,
               cands=None) -> None:
    """The prep launch's q fragments, scales, head weights and work plan, bitwise;
    `get(name, dtype, shape)` reads one output."""
    for name, dtype, want in (("qfrag", np.uint8, ik.fragment_order(codes)),
                              ("qscale", np.float32, ik.scale_order(scales)),
                              ("qw", np.float32, ik.weight_order(w)),
                              ("plan", np.int32, ik.work_plan(positions, seq_index, ratio, mode,
                                                              cands))):
        np.testing.assert_array_equal(get(name, dtype, want.shape), want, err_msg=name)


def check_scores(got, qd, w, decoded, seq_index, allowed=None) -> None:
    """Within tolerance where written; NaN (poison) beyond each sequence's entries, outside the
    allowed (candidate) entries and on padding rows."""
    for q, keys in enumerate(decoded):
        idx = np.flatnonzero(seq_index == q)
        n = keys.shape[0]
        want = indexer_ref.index_scores(qd[idx], w[idx], keys)
        tol = ik.score_tolerance(qd[idx], w[idx], keys)
        part = got[idx, :n]
        mask = np.ones_like(part, bool) if allowed is None else allowed[idx, :n]
        bad = mask & ~(np.abs(part - want) <= tol)
        assert not bad.any(), (f"sequence {q}: {bad.sum()} scores out of tolerance, first at "
                               f"{np.argwhere(bad)[0]}: {part[bad][0]} vs {want[bad][0]}")
        assert np.isnan(part[~mask]).all(), f"sequence {q}: a score outside the candidates"
        assert np.isnan(got[idx, n:]).all(), f"sequence {q}: a score past its {n} entries"
    assert np.isnan(got[seq_index < 0]).all(), "a padding row got scores"
