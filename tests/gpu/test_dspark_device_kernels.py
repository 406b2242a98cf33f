"""GPU test of kernels/dspark.py (aux states, greedy acceptance, ring rollback, Markov step)
against its refs.

All four are exact (the Markov step: bf16 products are exact in fp32, summed in order): the aux mean is one sequential fp32 sum, an exact * 0.25 and one bf16
rounding (bitwise), the acceptance compares integers, the rollback stores the canonical NaN. Every
output buffer starts poisoned; what a launch must not write (rows past `rows`, other aux slots,
sequences without rows, accepted rows' ring rows) must keep its poison. Bundles: HOPDEC_BUNDLE
(tiny) and HOPDEC_BUNDLE_V41 (v41-flash widths), which need kernels.dspark in
kernels.manifest.FAMILIES. Written while no GPU was available: not yet run on one.
"""
from __future__ import annotations

import dspark_cases as cases
import numpy as np
import pytest
from arena_io import launch_on_arrays

from executor.launches.dspark import accept_launch, aux_launch, markov_launch, rollback_launch
from kernels import dspark_ref as ref
from kernels.common_ref import BF16

pytestmark = pytest.mark.gpu
pytest.importorskip("cupy")                 # arena_io moves the arrays with CuPy

CAP = 192
RNG = np.random.default_rng()


@pytest.mark.parametrize("rows", [1, 6, 13, 192])
def test_aux_is_the_bitwise_stream_mean(dev, stream, preset_bundle, rows):
    cfg, bundle = preset_bundle
    spec = ref.specs_for(cfg)[0]
    d, t = cfg.hidden_size, spec.targets
    streams = (RNG.standard_normal((CAP, cfg.hc_mult, d)) * 8).astype(BF16)
    aux = np.full((CAP, t, d), 0xFFFF, np.uint16)
    target = int(RNG.integers(0, t))
    got = launch_on_arrays(dev, stream, {"streams": streams, "aux": aux},
                           lambda p: aux_launch(bundle, spec, p, rows, target))["aux"]
    assert np.array_equal(got[:rows, target], ref.aux_ref(streams[:rows]).view(np.uint16))
    poisoned = np.ones((CAP, t), bool)
    poisoned[:rows, target] = False
    assert (got[poisoned] == 0xFFFF).all(), "aux written outside (rows, target)"


@pytest.mark.parametrize("num_seqs", [1, 2, 32])
def test_accept_is_the_reference_rule(dev, stream, preset_bundle, num_seqs):
    cfg, bundle = preset_bundle
    spec = ref.specs_for(cfg)[1]
    lengths = RNG.integers(1, spec.max_block + 1, num_seqs)
    n = int(lengths.sum())
    seq = np.full(CAP, -1, np.int32)
    seq[:n] = np.repeat(np.arange(num_seqs), lengths)
    tokens, ids = RNG.integers(0, 50, CAP), RNG.integers(0, 50, CAP)
    for s in range(num_seqs):              # a random matching prefix, then a mismatch
        rows = np.flatnonzero(seq == s)
        keep = int(RNG.integers(0, rows.size))
        ids[rows[1:1 + keep]] = tokens[rows[:keep]]
        if keep + 1 < rows.size:
            ids[rows[keep + 1]] = tokens[rows[keep]] + 1
    slots = RNG.integers(0, 1 << 40, CAP)
    arrays = {"token_ids": ids, "tokens": tokens, "seq_index": seq, "slot_mapping": slots,
              "accepted": np.full(CAP, -7, np.int32), "bonus": np.full(CAP, -7, np.int64),
              "context_slots": np.full(CAP, -7, np.int64)}
    got = launch_on_arrays(dev, stream, arrays, lambda p: accept_launch(bundle, spec, p, n))
    accepted, bonus, context = ref.accept_ref(ids[:n], tokens[:n], seq[:n], slots[:n], num_seqs)
    assert np.array_equal(got["accepted"][:num_seqs], accepted)
    assert np.array_equal(got["bonus"][:num_seqs], bonus)
    assert np.array_equal(got["context_slots"][:n], context)
    assert (got["accepted"][num_seqs:] == -7).all() and (got["bonus"][num_seqs:] == -7).all()
    assert (got["context_slots"][n:] == -7).all()


@pytest.mark.parametrize("num_seqs", [1, 3])
def test_rollback_poisons_exactly_the_rejected_ring_rows(dev, stream, preset_bundle, num_seqs):
    cfg, bundle = preset_bundle
    spec = ref.specs_for(cfg)[2]
    lines = 4
    ring = RNG.standard_normal((lines, spec.ring_rows, ref.RING_WIDTH)).astype(np.float32)
    lengths = RNG.integers(1, spec.max_block + 1, num_seqs)
    n = int(lengths.sum())
    seq = np.full(CAP, -1, np.int32)
    seq[:n] = np.repeat(np.arange(num_seqs), lengths)
    positions = np.zeros(CAP, np.int64)
    accepted = np.zeros(CAP, np.int32)
    state_lines = np.zeros(CAP, np.int32)
    state_lines[:num_seqs] = RNG.permutation(lines)[:num_seqs]
    for s in range(num_seqs):
        rows = np.flatnonzero(seq == s)
        positions[rows] = int(RNG.integers(0, 1000)) + np.arange(rows.size)
        accepted[s] = RNG.integers(0, rows.size)
    arrays = {"ring": ring, "positions": positions, "seq_index": seq,
              "state_lines": state_lines, "accepted": accepted}
    got = launch_on_arrays(dev, stream, arrays,
                           lambda p: rollback_launch(bundle, spec, p, n))["ring"]
    want = ring.copy()
    ref.rollback_ref(want, positions[:n], seq[:n], state_lines, accepted)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("step", [0, 4, 5])
def test_markov_step_is_the_ref_bitwise(dev, stream, preset_bundle, step):
    """Pairs bitwise markov_ref (exact bf16 products summed in order in fp32, first maximum),
    ids rows exactly prev, the counter left zero, padding sequences (prev -1) without a pair."""
    cfg, bundle = preset_bundle
    tp = 4
    spec = ref.markov_specs_for(cfg, tp)[0]
    seqs = int(RNG.integers(1, 33))
    base = (RNG.standard_normal((CAP, spec.vocab)) * 2).astype(np.float32)
    w1 = (RNG.standard_normal((cfg.vocab_size, spec.rank)) * 0.2).astype(BF16)
    w2 = (RNG.standard_normal((spec.vocab, spec.rank)) * 0.2).astype(BF16)
    prev = np.full(CAP, -1, np.int64)
    prev[:seqs] = RNG.integers(0, cfg.vocab_size, seqs)
    prev[int(RNG.integers(0, seqs))] = -1
    offset = spec.vocab * int(RNG.integers(0, tp))
    arrays = {"base": base, "w1": w1, "w2": w2, "prev": prev,
              "pairs": np.full((CAP, 2), -7, np.int32), "ids": np.full(CAP, -7, np.int64),
              "partials": np.zeros((CAP, spec.tiles, 2), np.float32),
              "counter": np.zeros(4, np.uint32)}
    got = launch_on_arrays(dev, stream, arrays,
                           lambda p: markov_launch(bundle, spec, p, seqs, step, offset))
    pairs, ids = ref.markov_ref(base, w1, w2, prev[:seqs], step, spec.steps, offset)
    want_pairs, want_ids = cases.markov_want(pairs, ids, CAP)
    assert np.array_equal(got["pairs"], want_pairs)
    assert np.array_equal(got["ids"], want_ids)
    assert (got["counter"] == 0).all(), "the last CTA must re-zero the counter"
