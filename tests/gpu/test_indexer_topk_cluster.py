"""GPU: the cluster top-k variant (kernels/indexer_topk_cluster.py) and the default on given scores.

Fresh random scores every run, uploaded directly (no scores kernel), so the selection itself is
stressed: many exact ties at the threshold (values on a coarse grid, +0 and -0 mixed), all-equal
rows, plain random rows; rows of different lengths in one launch plus a padding row (sequence -1);
lengths around k, with fewer entries than k (everything taken), at the slice boundaries of the 8
CTAs, and past the 131072 entries the slices hold in shared memory (the global-memory fallback).
Every score past a row's visible entries is poisoned with the largest finite float, so a read past
the row would be selected and show; the outputs are poisoned with 0xFF. The selection is exact:
outputs are compared bitwise with `topk_ref` (the model-level `indexer_ref` functions), for the
entries (k = 512) and blocks (k = 2048 blocks of 8, own block forced in) selections of the default
kernels and of the three cluster variants (entries, blocks, both from one read); a relaunch is
bitwise identical. The candidates variant (reindex layers) gets ascending candidate lists with -1
padding (as the candidate source writes them), the row's partial last block among them, every
score outside the row's candidate blocks poisoned, 2048 candidate blocks (all slots in shared
memory) and 8200 (past the 8192 slots held: the global fallback).
"""
from __future__ import annotations

import numpy as np
import pytest

from executor.indexer_chain import IndexerChain, IndexerShape
from executor.launch import LaunchSpec
from kernels import indexer_kernel_ref as ik

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

POISON = np.float32(np.finfo(np.float32).max)
# Visible entries of the rows of one case (one launch); 131072 = the in-shared-memory capacity.
LENGTHS = [(1, 7, 300), (511, 512, 513), (4095, 4096, 4097), (2047 * 8 + 1, 16384, 16385),
           (65536, 70001, 1000), (131072, 131064, 12345), (140000, 131073, 3),
           (262145, 5, 200000)]
DISTS = ["ties", "equal", "normal"]


def draw_scores(rng, dist: str, rows: int, ld: int) -> np.ndarray:
    if dist == "ties":          # 33 values incl. +-0: every threshold bin holds many exact ties
        s = (rng.integers(-16, 17, (rows, ld)) * 0.25).astype(np.float32)
        s[rng.random((rows, ld)) < 0.3] = np.float32(-0.0)
        return s
    if dist == "equal":
        return np.full((rows, ld), np.float32(rng.standard_normal()), np.float32)
    return rng.standard_normal((rows, ld)).astype(np.float32)


@pytest.mark.parametrize("dist", DISTS)
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda v: "-".join(map(str, v)))
def test_cluster_topk_equals_reference(dev, v41_bundle, lengths, dist):
    rng = np.random.default_rng()
    n = np.array(lengths, np.int64)
    rows = n.size + 1                                      # + one padding row
    positions = np.append(n - 1, 0).astype(np.int32)       # ratio 1: visible = position + 1
    seq_index = np.append(np.arange(n.size), -1).astype(np.int32)
    ld = int(n.max()) + 64
    chain = IndexerChain(dev, v41_bundle, IndexerShape(32, 1, "dense", 512, 2048, 8, 64, rows, rows,
                                                   ld, candidate_source=True))
    try:
        scores = draw_scores(rng, dist, rows, ld)
        scores[np.arange(ld)[None, :] >= np.append(n, 0)[:, None]] = POISON
        chain.upload("scores", scores)
        chain.upload("positions", positions)
        chain.upload("seq_index", seq_index)
        want_topk = ik.topk_ref(scores, positions, seq_index, "entries", 512, 1)
        want_blocks = ik.topk_ref(scores, positions, seq_index, "blocks", 2048, 1)
        launches = topk_launches(chain, rows) + list(chain.variant_launches(rows).values())
        assert len(launches) == 5
        stream = dev.stream()
        for rep in range(2):                               # a relaunch is bitwise identical
            chain.poison("topk", "blocks_out", "topk_c", "blocks_c", "topk_b", "blocks_b")
            cp.cuda.Device().synchronize()
            for spec in launches:
                spec.launch(stream)
            stream.synchronize()
            for name, want, k in (("topk", want_topk, 512), ("topk_c", want_topk, 512),
                                  ("topk_b", want_topk, 512), ("blocks_out", want_blocks, 2048),
                                  ("blocks_c", want_blocks, 2048),
                                  ("blocks_b", want_blocks, 2048)):
                got = chain.download(name, np.int32, (rows, k))
                np.testing.assert_array_equal(got, want, err_msg=f"{name} (launch {rep})")
    finally:
        chain.close()


def topk_launches(chain: IndexerChain, rows: int) -> list[LaunchSpec]:
    """The default top-k kernels alone (the chain's launches without prep and scores)."""
    return [sp for sp in chain.launches(rows, 1.0)
            if sp.kernel.name.startswith("indexer_topk_")]


CAND_LENGTHS = [(1, 100, 5000), (4097, 70000, 131072), (16, 65536, 262145)]


@pytest.mark.parametrize("num_cands", [2048, 8200])
@pytest.mark.parametrize("dist", DISTS)
@pytest.mark.parametrize("lengths", CAND_LENGTHS, ids=lambda v: "-".join(map(str, v)))
def test_cluster_topk_candidates_equals_reference(dev, v41_bundle, lengths, dist, num_cands):
    rng = np.random.default_rng()
    n = np.array(lengths, np.int64)
    rows = n.size + 1
    positions = np.append(n - 1, 0).astype(np.int32)
    seq_index = np.append(np.arange(n.size), -1).astype(np.int32)
    ld = int(n.max()) + 64
    chain = IndexerChain(dev, v41_bundle, IndexerShape(32, 1, "candidates", 512, num_cands, 8, 64,
                                                   rows, rows, ld))
    try:
        cands = np.full((rows, num_cands), -1, np.int32)
        for r, length in enumerate(n):
            nb = -(-int(length) // 8)
            m = int(rng.integers(max(1, min(nb, num_cands) // 2), min(nb, num_cands) + 1))
            pick = rng.choice(nb - 1, m - 1, replace=False) if m > 1 else np.zeros(0, int)
            cands[r, :m] = np.sort(np.append(pick, nb - 1))      # own (partial) block included
        inside = np.zeros((rows, ld), bool)
        for r, length in enumerate(n):
            e = (cands[r][cands[r] >= 0][:, None] * 8 + np.arange(8)).reshape(-1)
            inside[r, e[e < length]] = True
        scores = np.where(inside, draw_scores(rng, dist, rows, ld), POISON).astype(np.float32)
        for name, arr in (("scores", scores), ("positions", positions),
                          ("seq_index", seq_index), ("cands", cands)):
            chain.upload(name, arr)
        want = ik.topk_ref(scores, positions, seq_index, "candidates", 512, 1, cands=cands)
        launches = topk_launches(chain, rows) + list(chain.variant_launches(rows).values())
        assert len(launches) == 2
        stream = dev.stream()
        for rep in range(2):
            chain.poison("topk", "topk_c")
            cp.cuda.Device().synchronize()
            for spec in launches:
                spec.launch(stream)
            stream.synchronize()
            for name in ("topk", "topk_c"):
                np.testing.assert_array_equal(chain.download(name, np.int32, (rows, 512)), want,
                                              err_msg=f"{name} (launch {rep})")
    finally:
        chain.close()
