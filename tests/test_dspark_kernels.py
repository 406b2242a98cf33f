"""kernels.dspark: aux states, greedy acceptance and ring rollback; refs against the reference
model's own formulation, emulated launches against the refs (CPU; the GPU kernels are compiled
into the bundle but not run here)."""

import dspark_cases as cases
import numpy as np
import pytest

from executor.emulate import run
from executor.hostmem import AddressSpace, HostArena, ManifestBundle
from executor.launches.dspark import accept_launch, aux_launch, markov_launch, rollback_launch
from executor.reference.kvcache import KVCaches
from kernels import dspark_ref as ref
from kernels.common_ref import BF16
from loader.config import ModelConfig

CAP = 192


def _blocks(rng, num_seqs: int, block: int, rows_cap: int):
    """seq_index of adjacent blocks of 1..block rows (random lengths), padded with -1."""
    lengths = rng.integers(1, block + 1, num_seqs)
    seq = np.full(rows_cap, -1, np.int32)
    seq[:lengths.sum()] = np.repeat(np.arange(num_seqs), lengths)
    return seq, int(lengths.sum())


def _arena(space, arrays: dict):
    arena = HostArena(space, [(n, max(a.nbytes, 16)) for n, a in arrays.items()])
    for name, a in arrays.items():
        arena.upload(name, a)
    return arena


# ---- aux -------------------------------------------------------------------------------------

def test_aux_ref_is_the_reference_steps_stream_mean():
    rng = np.random.default_rng()
    streams = (rng.standard_normal((33, 4, 256)) * rng.uniform(0.1, 50)).astype(BF16)
    want = streams.astype(np.float32).mean(axis=1).astype(BF16)   # executor/reference/step.py
    assert np.array_equal(ref.aux_ref(streams).view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("rows", [1, 6, 13, 192])
def test_emulated_aux_writes_one_slot_of_the_rows(tiny_bundle_dir, rows):
    cfg = ModelConfig.preset("tiny")
    spec = ref.specs_for(cfg)[0]
    d, t = cfg.hidden_size, spec.targets
    rng = np.random.default_rng()
    streams = rng.standard_normal((CAP, 4, d)).astype(BF16)
    aux = np.full((CAP, t, d), np.nan, np.float32).astype(BF16)
    space = AddressSpace()
    arena = _arena(space, {"streams": streams, "aux": aux})
    target = int(rng.integers(0, t))
    ptrs = {n: arena.ptr(n) for n in ("streams", "aux")}
    run([aux_launch(ManifestBundle(tiny_bundle_dir), spec, ptrs, rows, target)], space)
    got = arena.download("aux", BF16, (CAP, t, d))
    # bitwise: one sequential fp32 sum, an exact * 0.25, one rounding (kernels/dspark_ref.py)
    assert np.array_equal(got[:rows, target].view(np.uint16),
                          ref.aux_ref(streams[:rows]).view(np.uint16))
    untouched = np.ones((CAP, t), bool)
    untouched[:rows, target] = False
    assert np.isnan(got[untouched].astype(np.float32)).all()
    with pytest.raises(ValueError, match="target slot"):
        aux_launch(ManifestBundle(tiny_bundle_dir), spec, ptrs, rows, t)


# ---- acceptance ------------------------------------------------------------------------------

def _reference_acceptance(block_tokens, greedy):
    """executor/reference/dspark.py verify_and_accept's loop on one block."""
    drafts, accepted = block_tokens[1:], 0
    while accepted < len(drafts) and drafts[accepted] == greedy[accepted]:
        accepted += 1
    return accepted, int(greedy[accepted])


def _verify_rows(rng, seq, n):
    """Verify tokens whose drafts match the greedy picks for a random prefix of each block."""
    tokens = rng.integers(0, 50, CAP)
    ids = rng.integers(0, 50, CAP)
    for s in np.unique(seq[:n]):
        rows = np.flatnonzero(seq == s)
        keep = int(rng.integers(0, rows.size))           # drafts that match the target
        ids[rows[1:1 + keep]] = tokens[rows[:keep]]
        if keep + 1 < rows.size:                         # a guaranteed mismatch after them
            ids[rows[keep + 1]] = tokens[rows[keep]] + 1
    return ids, tokens


@pytest.mark.parametrize("num_seqs", [1, 2, 7, 32])
def test_emulated_accept_matches_the_reference_rule(tiny_bundle_dir, num_seqs):
    spec = ref.make_accept_spec(6)
    rng = np.random.default_rng()
    seq, n = _blocks(rng, num_seqs, 6, CAP)
    ids, tokens = _verify_rows(rng, seq, n)
    slots = rng.integers(0, 1 << 40, CAP)
    space = AddressSpace()
    arena = _arena(space, {"token_ids": ids, "tokens": tokens, "seq_index": seq,
                           "slot_mapping": slots, "accepted": np.full(CAP, -7, np.int32),
                           "bonus": np.full(CAP, -7, np.int64),
                           "context_slots": np.full(CAP, -7, np.int64)})
    ptrs = {n: arena.ptr(n) for n in arena.slices}
    run([accept_launch(ManifestBundle(tiny_bundle_dir), spec, ptrs, n)], space)
    accepted = arena.download("accepted", np.int32, (CAP,))
    bonus = arena.download("bonus", np.int64, (CAP,))
    context = arena.download("context_slots", np.int64, (CAP,))
    for s in range(num_seqs):
        rows = np.flatnonzero(seq == s)
        a, b = _reference_acceptance(ids[rows].tolist(), tokens[rows].tolist())
        assert (accepted[s], bonus[s]) == (a, b), f"sequence {s}"
        assert context[rows].tolist() == [*slots[rows[:a + 1]], *[-1] * (rows.size - a - 1)]
    assert (accepted[num_seqs:] == -7).all() and (bonus[num_seqs:] == -7).all()
    assert (context[n:] == -7).all()


def test_accept_refuses_split_or_overlong_blocks(tiny_bundle_dir):
    spec = ref.make_accept_spec(6)
    bundle = ManifestBundle(tiny_bundle_dir)
    for seq in ([0, 1, 0, -1], [0] * 7):
        seq = np.array(seq + [-1] * (CAP - len(seq)), np.int32)
        space = AddressSpace()
        arena = _arena(space, {"token_ids": np.zeros(CAP, np.int64),
                               "tokens": np.zeros(CAP, np.int64), "seq_index": seq,
                               "slot_mapping": np.zeros(CAP, np.int64),
                               "accepted": np.zeros(CAP, np.int32),
                               "bonus": np.zeros(CAP, np.int64),
                               "context_slots": np.zeros(CAP, np.int64)})
        ptrs = {n: arena.ptr(n) for n in arena.slices}
        with pytest.raises(ValueError, match="adjacent|more than 6 rows"):
            run([accept_launch(bundle, spec, ptrs, 8)], space)


# ---- rollback --------------------------------------------------------------------------------

@pytest.mark.parametrize("num_seqs", [1, 2, 5])
def test_emulated_rollback_forgets_what_the_reference_forgets(tiny_bundle_dir, num_seqs):
    """Rejected rows' ring rows == KVCaches.rollback_compressor_rings(line, P + a + 1)."""
    cfg = ModelConfig.preset("tiny")
    spec = ref.specs_for(cfg)[2]
    rng = np.random.default_rng()
    caches = KVCaches.allocate(cfg, max_seqs=8, max_context=256)
    layer = next(iter(caches.ring))
    lines = rng.permutation(8)[:num_seqs].astype(np.int32)
    lengths = rng.integers(1, 7, num_seqs)
    seq = np.full(CAP, -1, np.int32)
    seq[:lengths.sum()] = np.repeat(np.arange(num_seqs), lengths)
    positions = np.zeros(CAP, np.int64)
    accepted = np.zeros(CAP, np.int32)
    ring, ring_pos = caches.ring[layer], caches.ring_pos[layer]
    for s in range(num_seqs):
        start = int(rng.integers(2, 100))
        rows = np.flatnonzero(seq == s)
        positions[rows] = start + np.arange(rows.size)
        accepted[s] = rng.integers(0, rows.size)
        for p in range(start - 2, start + rows.size):     # the ring after the verify step
            ring[lines[s], p % 8] = rng.standard_normal(1024)
            ring_pos[lines[s], p % 8] = p
    state_lines = np.zeros(CAP, np.int32)
    state_lines[:num_seqs] = lines
    space = AddressSpace()
    arena = _arena(space, {"ring": ring.copy(), "positions": positions, "seq_index": seq,
                           "state_lines": state_lines, "accepted": accepted})
    ptrs = {n: arena.ptr(n) for n in arena.slices}
    n = int(lengths.sum())
    run([rollback_launch(ManifestBundle(tiny_bundle_dir), spec, ptrs, n)], space)
    for s in range(num_seqs):
        first = positions[np.flatnonzero(seq == s)[0]]
        caches.rollback_compressor_rings(int(lines[s]), int(first + accepted[s] + 1))
    got = arena.download("ring", np.float32, ring.shape)
    # bitwise, NaN included: the same canonical quiet NaN and untouched rows elsewhere
    assert np.array_equal(got.view(np.uint32), caches.ring[layer].view(np.uint32))


# ---- Markov correction -----------------------------------------------------------------------

def _markov_arrays(rng, spec, seqs, vocab_total):
    base = rng.standard_normal((CAP, spec.vocab)).astype(np.float32)
    w1 = (rng.standard_normal((vocab_total, spec.rank)) * 0.3).astype(BF16)
    w2 = (rng.standard_normal((spec.vocab, spec.rank)) * 0.3).astype(BF16)
    prev = np.full(CAP, -5, np.int64)
    prev[:seqs] = rng.integers(0, vocab_total, seqs)
    prev[int(rng.integers(0, seqs))] = -1                 # one padding sequence
    return {"base": base, "w1": w1, "w2": w2, "prev": prev,
            "pairs": np.full((CAP, 2), -7, np.int32), "ids": np.full(CAP, -7, np.int64),
            "partials": np.zeros((CAP, spec.tiles, 2), np.float32),
            "counter": np.zeros(4, np.uint32)}


def test_markov_ref_is_the_reference_markov_logits():
    """One rank's pair == head_ref.local_argmax of U_i + w1[prev] · w2ᵀ (the reference's
    markov_drafts) wherever the reference's float64-summed dot gives the same fp32 logits."""
    from kernels import head_ref
    rng = np.random.default_rng()
    spec = ref.make_markov_spec(256, 32, 5)
    a = _markov_arrays(rng, spec, 4, 1024)
    a["prev"][:4] = np.abs(a["prev"][:4])
    pairs, ids = ref.markov_ref(a["base"], a["w1"], a["w2"], a["prev"][:4], 2, 5, 512)
    assert ids == {s * 6 + 2: int(a["prev"][s]) for s in range(4)}
    for s in range(4):
        w1 = a["w1"][a["prev"][s]].astype(np.float32)[None, :]
        logits = a["base"][s * 5 + 2:s * 5 + 3] + (w1.astype(np.float64)
                                                   @ a["w2"].astype(np.float64).T).astype(
                                                       np.float32)
        value, index = head_ref.local_argmax(logits, 512)
        got_value = np.array([pairs[s][0]], np.int32).view(np.float32)[0]
        # the sequential fp32 sum of 32 exact products is within 31 * 2^-24 * sum|x w| of the
        # float64 sum: the argmax may differ only where the top two are that close
        bound = 31 * 2.0**-24 * float((np.abs(w1) @ np.abs(a["w2"].astype(np.float32)).T).max())
        assert abs(got_value - value[0]) <= bound + 2.0**-23 * abs(value[0])
        if pairs[s][1] != index[0]:
            top2 = np.sort(logits[0].astype(np.float64))[-2:]
            assert top2[1] - top2[0] <= 2 * bound, f"sequence {s}: not a near tie"


@pytest.mark.parametrize("step", [0, 3, 5])
def test_emulated_markov_step(tiny_bundle_dir, step):
    cfg = ModelConfig.preset("tiny")
    spec = ref.make_markov_spec(cfg.vocab_size // 4, cfg.dspark_markov_rank, 5)
    rng = np.random.default_rng()
    seqs = int(rng.integers(2, 33))                # one of them padding (below), one real at least
    arrays = _markov_arrays(rng, spec, seqs, cfg.vocab_size)
    space = AddressSpace()
    arena = _arena(space, arrays)
    ptrs = {n: arena.ptr(n) for n in arrays}
    launch = markov_launch(ManifestBundle(tiny_bundle_dir), spec, ptrs, seqs, step, 768)
    assert launch.grid == (spec.tiles, 1, 1)
    run([launch], space)
    pairs, ids = ref.markov_ref(arrays["base"], arrays["w1"], arrays["w2"], arrays["prev"][:seqs],
                                step, 5, 768)
    got_pairs = arena.download("pairs", np.int32, (CAP, 2))
    got_ids = arena.download("ids", np.int64, (CAP,))
    want_pairs, want_ids = cases.markov_want(pairs, ids, CAP)
    assert np.array_equal(got_pairs, want_pairs)
    assert np.array_equal(got_ids, want_ids)
    assert (step == 5) == (len(pairs) == 0)
    arena.upload("counter", np.ones(4, np.uint32))
    with pytest.raises(ValueError, match="counter is 1"):
        run([launch], space)
