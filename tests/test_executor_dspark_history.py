"""The device-side Engram lookback of a sync-free DSpark round (kernels/dspark_ref.py's history):
the ref against the reference step's own definition, the emulated launch against the ref, the
plans that run it.

The independent definition: executor.reference.step's ngram_lookback / engram_ref.ngram_history
of a RowBatch built by RowBatch.from_blocks (what a caller would write for those rows), with the
sequence's earlier tokens as `prior`. A round is the history to the draft rows (after the verify
step) then to the verify rows (after the draft step); both are checked over random positions (some near 0, so the pad id appears), random accepted counts,
random state lines and a padding slot, and chained over several rounds with nothing but the
previous kernels' outputs as input. Integer copies: the results are compared exactly.
"""
import dspark_cases as cases
import numpy as np
import pytest

from executor.emulate import run
from executor.hostmem import AddressSpace, HostArena, ManifestBundle
from executor.launches.dspark import history_launch
from executor.plan import decode_plan, draft_plan
from executor.reference import step as ref_step
from executor.reference.rows import RowBatch, RowBlock
from kernels import dspark_ref as ref
from kernels import engram_ref
from loader.config import ModelConfig

CAP = 192
K, NGRAM, PAD, NOISE = 5, 4, 2, 1023          # tiny's dspark_block_size, max_ngram, noise id
COLS = NGRAM - 1


def _lookback(blocks, priors) -> np.ndarray:
    """token_history [R, COLS] of `blocks` (RowBlocks) by the reference step's definition."""
    tables = np.zeros((16, 1), np.int32)
    rows = RowBatch.from_blocks(blocks, tables, 64)
    raw = ref_step.ngram_lookback(rows, priors, NGRAM)
    return engram_ref.ngram_history(raw, rows.positions, NGRAM, PAD)[:, 1:]


class Round:
    """Random sequences (a token list each, position = its length) and one padding slot."""

    def __init__(self, rng, live: int):
        self.rng, self.live = rng, live
        self.seqs = [list(rng.integers(3, 900, int(rng.integers(0, 9)))) for _ in range(live)]
        self.bonus = np.r_[rng.integers(3, 900, live), -1].astype(np.int64)

    def draft_blocks(self):
        return [RowBlock(q, len(seq), (int(self.bonus[q]),) + (NOISE,) * (K - 1), "draft")
                for q, seq in enumerate(self.seqs)]

    def verify_blocks(self, drafts):
        return [RowBlock(q, len(seq), (int(self.bonus[q]), *map(int, drafts[q])), "verify")
                for q, seq in enumerate(self.seqs)]

    def priors(self, extra=None):
        return [np.array(seq + list(extra[q] if extra is not None else []), np.int64)
                for q, seq in enumerate(self.seqs)]


def _history_ref(to_verify, ids, hist, accepted, bonus, seqs):
    spec = ref.make_history_spec(K, to_verify, COLS, NOISE)
    ref.history_ref(spec, ids, hist, accepted, bonus, seqs)


def test_history_ref_gives_the_reference_lookback_round_after_round():
    rng = np.random.default_rng()
    for _ in range(5):
        r = Round(rng, int(rng.integers(1, 6)))
        seqs = r.live + 1
        hist = np.full((CAP, COLS), -9, np.int64)
        hist[:r.live * K] = _lookback(r.draft_blocks(), r.priors())     # the caller's, once
        for _ in range(4):
            drafts = rng.integers(3, 900, (r.live, K))
            ids = np.full(CAP, -9, np.int64)
            for q in range(r.live):                     # what the Markov stages write
                ids[q * (K + 1):(q + 1) * (K + 1)] = [r.bonus[q], *drafts[q]]
            _history_ref(True, ids, hist, None, r.bonus, seqs)
            want = _lookback(r.verify_blocks(drafts), r.priors())
            assert np.array_equal(hist[:r.live * (K + 1)], want), "verify rows' history"
            assert (hist[seqs * (K + 1):] == -9).all(), "rows past the slots written"
            tokens = rng.integers(3, 900, CAP)
            accepted = np.r_[rng.integers(0, K + 1, r.live), 0].astype(np.int32)
            old_bonus = r.bonus.copy()
            r.bonus[:r.live] = tokens[:r.live]          # the acceptance's new bonus
            _history_ref(False, ids, hist, accepted, r.bonus, seqs)
            for q in range(r.live):
                r.seqs[q] += [int(old_bonus[q]), *map(int, drafts[q][:accepted[q]])]
            want = _lookback(r.draft_blocks(), r.priors())
            assert np.array_equal(hist[:r.live * K], want), "draft rows' history"


def test_make_history_spec_refuses_bad_arguments():
    with pytest.raises(ValueError, match="steps"):
        ref.make_history_spec(0, False, 3, 1)
    with pytest.raises(TypeError, match="to_verify"):
        ref.make_history_spec(5, 1, 3, 1)
    for cols in (-1, 0, 9):
        with pytest.raises(ValueError, match="cols"):
            ref.make_history_spec(5, False, cols, 1)
    with pytest.raises(ValueError, match="noise_token"):
        ref.make_history_spec(5, False, 3, -1)
    with pytest.raises(ValueError, match="one CTA"):
        ref.make_history_spec(5, False, 3, 1).grid(ref.CTA_THREADS + 1)


@pytest.mark.parametrize("to_verify", [False, True])
@pytest.mark.parametrize("seqs", [1, 3, 32])
def test_emulated_history_launch_is_the_ref(tiny_bundle_dir, to_verify, seqs):
    rng = np.random.default_rng()
    spec = ref.make_history_spec(K, to_verify, COLS, NOISE)
    arrays = {"token_ids": rng.integers(0, 1000, CAP),
              "token_history": rng.integers(0, 1000, (CAP, COLS)),
              "accepted": rng.integers(0, K + 1, CAP).astype(np.int32),
              "bonus": rng.integers(-1, 1000, CAP)}
    space = AddressSpace()
    arena = HostArena(space, [(n, a.nbytes) for n, a in arrays.items()])
    for name, a in arrays.items():
        arena.upload(name, a)
    ptrs = {n: arena.ptr(n) for n in arrays}
    run([history_launch(ManifestBundle(tiny_bundle_dir), spec, ptrs, seqs)], space)
    want = cases.history_want(spec, arrays, seqs)
    for name, a in want.items():
        assert np.array_equal(arena.download(name, a.dtype, a.shape), a), name


def test_sync_free_plans_write_the_history_before_each_advance():
    cfg = ModelConfig.preset("tiny")
    verify = [s.name for s in decode_plan(cfg, dspark=True, sync_free=True).stages]
    assert verify[-2:] == ["dspark.history_draft", "dspark.advance_draft"]
    assert "dspark.history_draft" not in [s.name for s in decode_plan(cfg, dspark=True).stages]
    draft = [s.name for s in draft_plan(cfg, sync_free=True).stages]
    assert draft[-3:] == [f"dspark.markov{K}", "dspark.history_verify", "dspark.advance_verify"]
    assert "dspark.history_verify" not in [s.name for s in draft_plan(cfg).stages]
