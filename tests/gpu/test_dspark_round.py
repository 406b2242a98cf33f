"""DSpark k=5 rounds on the GPU (tiny, 4 TP ranks in lockstep on one device) vs the reference.

Issue 10's "identical accepted tokens and counts to the NumPy reference over 16 rounds for
several sequences at once (tiny)": SEQS sequences, ROUNDS rounds through the wired sync-free
plans on DeviceRanks, driven and checked by tests/gpu/dspark_round_driver.py (its docstring says
what runs and what every round checks). The real-dimension twin is
tests/gpu/test_dspark_round_real_slice.py.
"""
from __future__ import annotations

import numpy as np
import pytest
from device_ranks import DeviceRanks
from dspark_round_driver import ROUNDS, DeviceRound, run_rounds, start_sequences
from ref_model import new_caches, tiny_checkpoint, tiny_model

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

TP, SEQS = 4, 2
MAX_ROWS = 192              # DeviceRanks' default: the bound tensors' row capacity
SCRIPTED = {3: (5, 2), 9: (3, 4)}   # round -> greedy tokens leading each sequence's drafts


@pytest.fixture(scope="module")
def device_round(dev, stream, tiny_bundle):
    model = tiny_model(TP)
    caches = new_caches(model, max_seqs=SEQS)
    ranks = DeviceRanks(dev, tiny_checkpoint(), tiny_bundle, TP, caches, stream, MAX_ROWS,
                        dspark=True)
    try:
        yield DeviceRound(model, caches, ranks, SEQS, scripted=SCRIPTED)
    finally:
        ranks.close()


def test_dspark_rounds_on_the_device_accept_what_the_reference_accepts(device_round):
    s, rng = device_round, np.random.default_rng()
    run_rounds(s, start_sequences(s.model, s.caches, SEQS, rng), rng)
    print("\n" + s.summary(ROUNDS))
