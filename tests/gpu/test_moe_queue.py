"""GPU: the work-queue self-routed MoE chain (round 9, kernels/moe_queue.py: xquant -> w13sr "bulkq"
-> w2sr "earlyq" -> combine) against the static one (xquant -> w13sr "bulk" -> w2sr "early" ->
combine) and the reference.

Claiming changes which CTA runs an item, never the item's bytes or arithmetic, so h and y must be
bitwise the static chain's. Each case launches the queued chain THREE times back to back (no
synchronisation between them, each into its own NaN-poisoned h / ye / y), so a launch that starts
with counters the previous one left would skip or repeat items; then every result is compared
bitwise and the four sched words must be zero.
- `test_queued_chain_matches_the_reference`: test_moe_kernel's setup (both bundles, the first MoE
  shape, a pool of experts with host weights): the first queued result against the reference as
  test_moe_kernel checks its chains (moe_ref.check_two_stage), every result bitwise the static
  chain's.
- `test_queued_chain_at_every_shape`: every MoE shape of each preset bundle, random weights in
  every expert, ids over all experts (uniform, all rows on one expert set, all pairs distinct
  where rows * k <= E): bitwise the static chain's and the default (prep) chain's.
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


def _static(chain, rows, stream):
    """(h bits, y) of the static self-routed chain from NaN-poisoned buffers."""
    chain.poison_outputs()
    for spec in chain.launches_selfrouted(rows, ml.STEP_SELFROUTED_W13, ml.SELFROUTED_EARLY):
        spec.launch(stream)
    stream.synchronize()
    s = chain.shape
    return (chain.download("h", np.uint16, (rows * s.topk, s.inter)),
            chain.download("y", np.float32, (rows, s.hidden)))


def _queued_back_to_back(chain, rows, stream):
    """The queued chain LAUNCHES times with no synchronisation between launches, launch i into
    its own NaN-poisoned h, ye, y (launch 0 into the arena's); [(h bits, y)] per launch, and the
    sched words after the last."""
    s = chain.shape
    assert chain.has_queued(), "the bundle lacks w13sr bulkq / w2sr earlyq"
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
        for spec in ml.selfrouted_launches(chain.bundle, s, p, rows, *ml.QUEUED_PAIR,
                                           chain.available):
            spec.launch(stream)
    stream.synchronize()
    out = [(chain.download("h", np.uint16, (rows * s.topk, s.inter)),
            chain.download("y", np.float32, (rows, s.hidden)))]
    for bufs in extra:
        out.append((cp.asnumpy(bufs["h"]).view(np.uint16).reshape(rows * s.topk, s.inter),
                    cp.asnumpy(bufs["y"]).view(np.float32).reshape(rows, s.hidden)))
    return out, chain.sched()


def _assert_queued_equals(got, sched, want, what):
    h_want, y_want = want
    for i, (h, y) in enumerate(got):
        np.testing.assert_array_equal(h, h_want, err_msg=f"h of queued launch {i}, {what}")
        np.testing.assert_array_equal(y, y_want, err_msg=f"y of queued launch {i}, {what}")
    assert not sched.any(), f"sched after {LAUNCHES} queued launches: {sched.tolist()}, {what}"


def _kinds(rows, experts, topk):
    return ("uniform", "one_expert") + (("distinct",) if rows * topk <= experts else ())


@pytest.mark.parametrize("rows", ROWS)
def test_queued_chain_matches_the_reference(setup, rows):  # noqa: F811 (the imported fixture)
    shape, chain, pool_ids, shards, stream = setup
    for kind in _kinds(rows, len(pool_ids), shape.topk):
        seed = np.random.SeedSequence().entropy
        rng = np.random.default_rng(seed)
        what = (f"{shape.tag()} {kind} R={rows} (seeds: pool {POOL_SEEDS[id(chain)]}, "
                f"inputs {seed})")
        ids = _routing(rng, kind, rows, pool_ids, shape.topk).astype(np.int32)
        weights = rng.random((rows, shape.topk)).astype(np.float32)
        x = moe_ref.round_bf16(rng.normal(0, 1, (rows, shape.hidden)))
        chain.upload_inputs((x.view(np.uint32) >> 16).astype(np.uint16), ids, weights)
        want = _static(chain, rows, stream)
        got, sched = _queued_back_to_back(chain, rows, stream)
        routing = moe_ref.RouterOutput(ids.astype(np.int64), weights)
        parts = moe_ref.routed_parts(x, routing, shards, shape.swiglu_limit)
        h = (got[0][0].astype(np.uint32) << 16).view(np.float32)
        moe_ref.check_two_stage(got[0][1], h, parts, routing, shards, shape.swiglu_limit,
                                f"queued y ({what})")
        _assert_queued_equals(got, sched, want, what)


@pytest.fixture(scope="module")
def chains(dev, preset_bundle):
    """A MoeChain per MoE shape with random weights in every expert and random x."""
    yield from random_chains(dev, preset_bundle[1])


@pytest.mark.parametrize("rows", ROWS)
def test_queued_chain_at_every_shape(chains, stream, rows):
    for chain in chains:
        s = chain.shape
        for kind in _kinds(rows, s.num_experts, s.topk):
            seed = np.random.SeedSequence().entropy
            rng = np.random.default_rng(seed)
            ids = _routing(rng, kind, rows, np.arange(s.num_experts), s.topk).astype(np.int32)
            x_bits = chain.download("x", np.uint16, (rows, s.hidden))
            chain.upload_inputs(x_bits, ids, rng.random((rows, s.topk)).astype(np.float32))
            what = f"{s.tag()} {kind} R={rows} (inputs seed {seed})"
            want = _static(chain, rows, stream)
            chain.poison_outputs()
            for spec in chain.launches(rows):          # the default chain (prep, w13, w2)
                spec.launch(stream)
            stream.synchronize()
            np.testing.assert_array_equal(chain.download("y", np.float32, (rows, s.hidden)),
                                          want[1], err_msg=f"static vs default chain, {what}")
            got, sched = _queued_back_to_back(chain, rows, stream)
            _assert_queued_equals(got, sched, want, what)
