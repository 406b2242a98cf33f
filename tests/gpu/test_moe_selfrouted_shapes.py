"""GPU: the step's self-routed MoE chain (xquant -> w13sr "bulk" -> w2sr "early" -> combine) at
EVERY MoE shape of the preset's bundle, random weights in every expert and top-k ids drawn over
all experts: h and y bitwise the default chain's (prep -> w13 -> w2 -> combine) on the same
inputs, both from NaN-poisoned buffers.

Why its own module: test_moe_kernel.py runs one shape per bundle (the first moe_w13_ name, at
v41 the DSpark stages' e128_k3, never the backbone's e384_k6) with weights in a pool of 12
experts. The deleted polled-pair modules (docs/notes/moe-design.md "Round 8") ran exactly this
chain, ids over all experts, before the kernel they blamed for run r7b / r7c's illegal address;
a fault here names this chain instead."""
from __future__ import annotations

import numpy as np
import pytest
from moe_cases import random_chains

from executor.launches import moe as ml

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

ROWS = (1, 3, 6, 16, 48)


@pytest.fixture(scope="module")
def chains(dev, preset_bundle):
    """A MoeChain per MoE shape with random weights in every expert and random x."""
    yield from random_chains(dev, preset_bundle[1])


def _run(chain, specs, stream, rows):
    chain.poison_outputs()
    for spec in specs:
        spec.launch(stream)
    stream.synchronize()
    s = chain.shape
    return (chain.download("h", np.uint16, (rows * s.topk, s.inter)),
            chain.download("y", np.float32, (rows, s.hidden)))


@pytest.mark.parametrize("rows", ROWS)
def test_selfrouted_chain_at_every_shape_matches_the_default_chain(chains, stream, rows):
    for chain in chains:
        s = chain.shape
        seed = 1000 + rows
        rng = np.random.default_rng(seed)
        ids = np.stack([rng.choice(s.num_experts, s.topk, replace=False)
                        for _ in range(rows)]).astype(np.int32)
        x_bits = chain.download("x", np.uint16, (rows, s.hidden))
        chain.upload_inputs(x_bits, ids, rng.random((rows, s.topk)).astype(np.float32))
        what = f"{s.tag()} R={rows} (ids seed {seed})"
        want_h, want_y = _run(chain, chain.launches(rows), stream, rows)
        got_h, got_y = _run(chain, chain.launches_selfrouted(rows, "bulk", ml.SELFROUTED_EARLY),
                            stream, rows)
        np.testing.assert_array_equal(got_h, want_h, err_msg=f"self-routed h, {what}")
        np.testing.assert_array_equal(got_y, want_y, err_msg=f"self-routed y, {what}")
