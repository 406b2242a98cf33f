"""GPU: the queued self-routed MoE pair on native FP8 wgmma (round 10, kernels/moe_qgmma.py:
xquant -> w13sr "bulkqg" -> w2sr "earlyqg" -> combine) against the reference, and beside the
mma.sync pair it replaces (xquant -> w13sr "bulkq" -> w2sr "earlyq").

The tensor core adds a group's k-steps with its own (narrower than fp32) accumulator, so nothing
here is bitwise the mma.sync chain: the reference check is moe_ref.check_two_stage, whose bound
held with a 13-bit accumulator model (docs/notes/moe-tolerance.md). What IS exact: the launches
are deterministic (three back to back, each into its own NaN-poisoned h / ye / y, bitwise equal)
and each leaves its sched words zero.
- `test_qg_chain_matches_the_reference`: test_moe_kernel's setup (both bundles, a pool of
  experts with host weights: several tokens per expert, so w13's 2-token chunks repeat): the
  pair (the w2 alone after bulkq where the bundle has no bulkqg: tiny) against the reference.
- `test_qg_chain_at_every_shape`: every MoE shape of each preset bundle, random weights in every
  expert: deterministic, sched zero, and within 2^-7 (relative Frobenius) of the mma.sync pair.
"""
from __future__ import annotations

import numpy as np
import pytest
from moe_cases import random_chains
from test_moe_kernel import POOL_SEEDS, _routing, setup  # noqa: F401 (fixture)

from executor.launches import moe as ml
from kernels import moe_ref

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

ROWS = (3, 5, 6, 8, 16, 48, 96, 192)
LAUNCHES = 3


def _pair(chain):
    """The QG pair, or bulkq with the w2 of the pair where the bundle has no bulkqg."""
    w13 = ml.QG_PAIR[0] if ("w13sr", ml.QG_PAIR[0]) in chain.available else ml.QUEUED_PAIR[0]
    assert ("w2sr", ml.QG_PAIR[1]) in chain.available, "the bundle lacks w2sr earlyqg"
    return w13, ml.QG_PAIR[1]


def _run(chain, rows, stream, pair):
    """(h bits, y) of `pair`'s chain LAUNCHES times back to back (no synchronisation between
    them), launch i into its own NaN-poisoned h, ye, y; and the sched words after the last."""
    s = chain.shape
    assert not chain.sched().any(), f"sched not zero before the launches: {chain.sched()}"
    chain.poison_outputs()
    sizes = {"h": rows * s.topk * s.inter * 2, "ye": rows * s.topk * s.hidden * 2,
             "y": rows * s.hidden * 4}
    extra = [{k: cp.full(n, 0xFF, cp.uint8) for k, n in sizes.items()}
             for _ in range(LAUNCHES - 1)]
    ptrs = [chain.ptrs] + [{**chain.ptrs, **{k: b.data.ptr for k, b in bufs.items()}}
                           for bufs in extra]
    cp.cuda.Device().synchronize()
    for p in ptrs:
        for spec in ml.selfrouted_launches(chain.bundle, s, p, rows, *pair, chain.available):
            spec.launch(stream)
    stream.synchronize()
    out = [(chain.download("h", np.uint16, (rows * s.topk, s.inter)),
            chain.download("y", np.float32, (rows, s.hidden)))]
    for bufs in extra:
        out.append((cp.asnumpy(bufs["h"]).view(np.uint16).reshape(rows * s.topk, s.inter),
                    cp.asnumpy(bufs["y"]).view(np.float32).reshape(rows, s.hidden)))
    return out, chain.sched()


def _assert_deterministic(got, sched, what):
    h0, y0 = got[0]
    assert np.isfinite(y0).all(), f"non-finite y (NaN poison left?), {what}"
    for i, (h, y) in enumerate(got[1:], 1):
        np.testing.assert_array_equal(h, h0, err_msg=f"h of launch {i} vs launch 0, {what}")
        np.testing.assert_array_equal(y, y0, err_msg=f"y of launch {i} vs launch 0, {what}")
    assert not sched.any(), f"sched after {LAUNCHES} launches: {sched.tolist()}, {what}"


def _kinds(rows, experts, topk):
    return ("uniform", "one_expert") + (("distinct",) if rows * topk <= experts else ())


@pytest.mark.parametrize("rows", ROWS)
def test_qg_chain_matches_the_reference(setup, rows):  # noqa: F811 (the imported fixture)
    shape, chain, pool_ids, shards, stream = setup
    pair = _pair(chain)
    for kind in _kinds(rows, len(pool_ids), shape.topk):
        seed = np.random.SeedSequence().entropy
        rng = np.random.default_rng(seed)
        what = (f"{shape.tag()} {pair} {kind} R={rows} (seeds: pool {POOL_SEEDS[id(chain)]}, "
                f"inputs {seed})")
        ids = _routing(rng, kind, rows, pool_ids, shape.topk).astype(np.int32)
        weights = rng.random((rows, shape.topk)).astype(np.float32)
        x = moe_ref.round_bf16(rng.normal(0, 1, (rows, shape.hidden)))
        chain.upload_inputs((x.view(np.uint32) >> 16).astype(np.uint16), ids, weights)
        got, sched = _run(chain, rows, stream, pair)
        _assert_deterministic(got, sched, what)
        routing = moe_ref.RouterOutput(ids.astype(np.int64), weights)
        parts = moe_ref.routed_parts(x, routing, shards, shape.swiglu_limit)
        h = (got[0][0].astype(np.uint32) << 16).view(np.float32)
        moe_ref.check_two_stage(got[0][1], h, parts, routing, shards, shape.swiglu_limit,
                                f"QGMMA y ({what})")


@pytest.fixture(scope="module")
def chains(dev, preset_bundle):
    """A MoeChain per MoE shape with random weights in every expert and random x."""
    yield from random_chains(dev, preset_bundle[1])


@pytest.mark.parametrize("rows", ROWS)
def test_qg_chain_at_every_shape(chains, stream, rows):
    for chain in chains:
        s = chain.shape
        pair = _pair(chain)
        for kind in _kinds(rows, s.num_experts, s.topk):
            seed = np.random.SeedSequence().entropy
            rng = np.random.default_rng(seed)
            ids = _routing(rng, kind, rows, np.arange(s.num_experts), s.topk).astype(np.int32)
            x_bits = chain.download("x", np.uint16, (rows, s.hidden))
            chain.upload_inputs(x_bits, ids, rng.random((rows, s.topk)).astype(np.float32))
            what = f"{s.tag()} {pair} {kind} R={rows} (inputs seed {seed})"
            got, sched = _run(chain, rows, stream, pair)
            _assert_deterministic(got, sched, what)
            chain.poison_outputs()
            for spec in chain.launches_queued(rows):       # the mma.sync pair
                spec.launch(stream)
            stream.synchronize()
            want = chain.download("y", np.float32, (rows, s.hidden)).astype(np.float64)
            rel = np.linalg.norm(got[0][1] - want) / max(np.linalg.norm(want), 1e-30)
            assert rel <= 2.0**-7, f"QGMMA vs mma.sync pair: relative error {rel:.3g}, {what}"
