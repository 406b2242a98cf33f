"""Indexer reference: FP4 round trip, scores, top-k and candidate blocks against brute force."""
from __future__ import annotations

import numpy as np
import pytest

from kernels import indexer_ref as ix

E2M1_GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)


def _fp4_brute(x: np.ndarray) -> np.ndarray:
    """Per element: scale 2^ceil(log2(amax/6)), nearest E2M1 value, ties to the even code."""
    out = np.empty_like(x, dtype=np.float64)
    for r in range(x.shape[0]):
        for g in range(0, x.shape[1], 32):
            vals = x[r, g:g + 32].astype(np.float64)
            k = int(np.ceil(np.log2(max(np.abs(vals).max(), 1e-4) / 6.0)))
            for i, v in enumerate(vals):
                a = abs(v) / 2.0**k
                dist = np.abs(E2M1_GRID - a)
                best = np.flatnonzero(dist == dist.min())
                code = best[0] if best.size == 1 else next(c for c in best if c % 2 == 0)
                out[r, g + i] = np.copysign(E2M1_GRID[code] * 2.0**k, v)
    return out


def test_fp4_round_trip_matches_brute_force():
    rng = np.random.default_rng()
    x = (rng.standard_normal((6, 128)) * np.exp2(rng.integers(-8, 8, (6, 1)))).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero group takes the floor scale and stays zero
    got = ix.fp4_quantize_dequantize(x)
    # Exact: scale and code choice are determined; every product fp4 x 2^k is exact in fp32.
    np.testing.assert_array_equal(got, _fp4_brute(x).astype(np.float32))


def test_fp4_ties_round_to_even():
    x = np.zeros((1, 32), np.float32)
    x[0, :4] = [6.0, 2.5, 0.25, 5.0]  # amax 6 -> scale 1; 2.5 -> 2, 0.25 -> 0, 5 -> 4 (even codes)
    np.testing.assert_array_equal(ix.fp4_quantize_dequantize(x)[0, :4], [6.0, 2.0, 0.0, 4.0])


def test_index_scores_match_loop():
    rng = np.random.default_rng()
    q = rng.standard_normal((3, 4, 128)).astype(np.float32)
    w = rng.standard_normal((3, 4)).astype(np.float32)
    k = rng.standard_normal((37, 128)).astype(np.float32)
    got = ix.index_scores(q, w, k)
    want = np.zeros((3, 37))
    for r in range(3):
        for s in range(37):
            dots = [float(q[r, h].astype(np.float64) @ k[s]) for h in range(4)]
            want[r, s] = sum(float(w[r, h]) * max(0.0, d) for h, d in enumerate(dots))
    # The reference sums in float64 and rounds once to float32: half an fp32 ulp (2^-24 relative).
    np.testing.assert_allclose(got, want, rtol=2.0**-23, atol=1e-30)


def _topk_brute(scores, allowed, k):
    out = np.full((scores.shape[0], k), -1, np.int64)
    for r in range(scores.shape[0]):
        cand = [s for s in range(scores.shape[1]) if allowed[r, s]]
        cand.sort(key=lambda s: (-scores[r, s], s))
        best = sorted(cand[:k])
        out[r, :len(best)] = best
    return out


@pytest.mark.parametrize("n,k", [(5, 16), (16, 16), (40, 16), (200, 16), (3, 4)])
def test_topk_matches_brute_force(n, k):
    rng = np.random.default_rng()
    # Coarse values force many ties, so the tie rule (lower entry first) is exercised.
    scores = rng.integers(-4, 5, (7, n)).astype(np.float32)
    allowed = ix.visible_mask(rng.integers(0, n + 1, 7), n) & (rng.random((7, n)) < 0.8)
    got = ix.topk_entries(scores, allowed, k)
    assert got.dtype == np.int32 and got.shape == (7, k)
    np.testing.assert_array_equal(got, _topk_brute(scores, allowed, k))


def _candidates_brute(scores, allowed, own, bs, nb):
    n = scores.shape[1]
    out = np.full((scores.shape[0], nb), -1, np.int64)
    for r in range(scores.shape[0]):
        blocks = []
        for b in range(-(-n // bs)):
            members = [s for s in range(b * bs, min(n, (b + 1) * bs)) if allowed[r, s]]
            if b == own[r] // bs:
                blocks.append((-np.inf, b))
            elif members:
                blocks.append((-max(scores[r, s] for s in members), b))
        best = sorted(b for _, b in sorted(blocks)[:nb])
        out[r, :len(best)] = best
    return out


@pytest.mark.parametrize("n", [7, 32, 33, 64, 130])
def test_candidate_blocks_match_brute_force(n):
    rng = np.random.default_rng()
    rows = 6
    own = np.sort(rng.integers(0, n, rows))  # rows of one verify block see entries s <= own
    scores = rng.integers(-3, 4, (rows, n)).astype(np.float32)
    allowed = ix.visible_mask(own + 1, n)
    got = ix.candidate_blocks(scores, allowed, own, block_size=8, num_blocks=4)
    np.testing.assert_array_equal(got, _candidates_brute(scores, allowed, own, 8, 4))
    # The own block is always in; the mask covers exactly the listed blocks.
    assert all(own[r] // 8 in got[r] for r in range(rows))
    mask = ix.candidate_entry_mask(got, n, 8)
    want = np.array([[s // 8 in set(got[r][got[r] >= 0]) for s in range(n)] for r in range(rows)])
    np.testing.assert_array_equal(mask, want)


def test_topk_inside_candidates_matches_brute_force():
    rng = np.random.default_rng()
    n, rows = 90, 6
    own = np.arange(n - rows, n)
    scores = rng.standard_normal((rows, n)).astype(np.float32)
    visible = ix.visible_mask(own + 1, n)
    blocks = ix.candidate_blocks(scores, visible, own, 8, 4)
    allowed = visible & ix.candidate_entry_mask(blocks, n, 8)
    assert (allowed.sum(axis=1) >= 16).all()  # 4 * 8 - 7 >= 16 candidates
    np.testing.assert_array_equal(ix.topk_entries(scores, allowed, 16),
                                  _topk_brute(scores, allowed, 16))


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="weights"):
        ix.index_scores(np.zeros((2, 4, 128), np.float32), np.zeros((2, 3)), np.zeros((5, 128)))
    with pytest.raises(ValueError, match="multiple of 32"):
        ix.fp4_quantize_dequantize(np.zeros((1, 30), np.float32))
