"""GPU tests of the indexer `_timeline` builds (kernels/indexer_timeline.py) in their chains.

A timeline build is a step kernel plus per-CTA stamps; it must compute exactly what the
production kernel computes. For both chains the devicecheck family runs (layers 2/8/14: prep,
scores, top-k entries at ratio 2; the reindex layers: prep, scores and the cluster top-k over
candidate blocks), with fresh random keys, queries, page tables and candidate lists per case:
- the timeline chain's top-k equals the production chain's bit for bit (every element); the
  third chain measures the held top-k candidate (keys kept in smem, `_s16384`) in place of the
  step's top-k, so this also checks the candidate against the step's kernel, bitwise;
- in every launch of a 4-layer PDL chain every CTA stamped every point of its kind
  (ik.TIMELINE_POINTS), clock64 and globaltimer never go back between consecutive points, %smid
  is below the SM count, and nothing is written past a row's used words or past the launch's
  CTAs (the buffer is zeroed).
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from executor.attn_timeline import INDEXER_CHAINS, IndexerTimelineRunner, indexer_kind
from kernels import indexer_kernel_ref as ik

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")


@pytest.mark.parametrize("label", sorted(INDEXER_CHAINS))
@pytest.mark.parametrize("rows", [1, 6, 13])
@pytest.mark.parametrize("length", ["short", "long"])
def test_indexer_timeline_chain(dev, stream, v41_bundle, label, rows, length):
    """`long` rows pass the held top-k candidate's 16384 smem keys at ratio 2 (the rest of the
    row is read from global), `short` ones stay inside them."""
    rng = np.random.default_rng()
    context = int(rng.integers(600, 20000) if length == "short" else rng.integers(33000, 40000))
    ctx = SimpleNamespace(device=dev, stream=stream)
    with IndexerTimelineRunner(ctx, v41_bundle, label, context, rows, rng) as runner:
        assert runner.matches_production(), "timeline top-k differs from production"
        stamps, _ = runner.run_chain(flush=False)
        raw = runner.raw()
        launches = runner.launches()
    assert len(stamps) == len(launches)
    for slot, (s, x) in enumerate(zip(stamps, launches)):
        ctas = int(np.prod(x.grid))
        points = ik.TIMELINE_POINTS[indexer_kind(x.kernel.name)]
        assert s.points == points and s.gt.shape == (ctas, len(points))
        assert not raw[slot, ctas:].any(), f"{x.kernel.name}: stamps past its {ctas} CTAs"
        assert not raw[slot, :ctas, ik.TIMELINE_HEAD_WORDS + 2 * len(points):].any(), \
            "stamps past a row's words"
        assert not raw[slot, :ctas, 1].any(), "the padding word was written"
        assert s.out_of_order() == [], (x.kernel.name, s.out_of_order()[:3])
        assert (s.smid < dev.sm_count).all()
