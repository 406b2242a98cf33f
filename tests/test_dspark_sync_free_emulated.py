"""Sync-free DSpark rounds on four emulated ranks (tiny, CPU): the device writes every step's rows.

The row advance (kernels/dspark_ref.py's advance; stages dspark.advance_draft, the last of
decode_plan(dspark=True, sync_free=True), and dspark.advance_verify, the last of
draft_plan(sync_free=True)) rewrites the bound row tensors for the next step, so a round is
verify graph, draft graph, verify graph ... with no host write between them.

test_advance_ref_gives_the_rows_from_blocks_gives: the reference advance of random verify rows
(random state lines, positions, accepted counts, one padding slot) equals RowBatch.from_blocks of
the draft blocks at P + a + 1, and its advance back the verify blocks at the same position; this
is the independent definition of the rows the executor's caller would have written.

test_rounds_run_with_rows_from_the_device: two sequences, ROUNDS rounds. The host writes the rows
once, before the first verify (the reference's drafts as its token_ids); after that the emulated
ranks run the whole wired verify plan, then the whole wired draft plan, and so on, on the rows the
previous plan left. Checked every round, on every rank:
- (accepted, bonus) equal the reference's verify_and_accept of the same drafts, unless the
  reference's deciding row is a near tie (top-2 margin <= LOGIT_BOUND, as
  tests/test_dspark_round_emulated.py), after which the rounds stop (the device's caches then hold
  another accepted length than the reference's: later rounds would compare nothing);
- after the verify plan the rows (token_ids, positions, seq_index, slot_mapping, block_kind,
  context_lens) are exactly RowBatch.from_blocks of the draft blocks [bonus, noise x (k - 1)] at
  the new bonus position;
- after the draft plan the draft tokens equal the reference's draft() (near-tie rule of
  tests/test_dspark_draft_emulated.py: where they first differ, the reference's Markov logits of the
  two tokens are within the U difference plus the Markov sum's rounding; the rounds stop there),
  and the rows are exactly from_blocks of the next verify blocks [bonus, d_1..d_k].

Not the device's yet: the Engram token history (`token_history`, a caller tensor the verify step's
head hashes). The host writes it before each verify step here; see the report of issue 10.
"""
from __future__ import annotations

import numpy as np
import pytest
from emulated_dspark import EmulatedDSparkRanks
from ref_model import random_prompt, token_history
from test_dspark_draft_emulated import _check_drafts

from executor.emulate import run_lockstep
from executor.plan import decode_plan, draft_plan
from executor.reference import dspark as ref_dspark
from executor.reference import step as ref_step
from executor.reference.rows import RowBatch, RowBlock
from executor.wiring import wire
from kernels import dspark_ref

TP = 4
ROUNDS = 4
SEQS = 2
MAX_ROWS = 192              # EmulatedRanks' default: the bound tensors' row capacity
LOGIT_BOUND = 0.25          # tests/test_dspark_round_emulated.py: emulated vs reference logits
ROW_ARRAYS = (("token_ids", np.int64), ("positions", np.int64), ("seq_index", np.int32),
              ("slot_mapping", np.int64), ("block_kind", np.int8))


# ---- the reference advance against RowBatch.from_blocks -----------------------------------------

def _as_arrays(rows: RowBatch, seqs: int, width: int) -> dict:
    """The bound-tensor view of `rows`: seqs * width rows (padding past), seqs context_lens."""
    out = {}
    for name, dtype in ROW_ARRAYS:
        fill = -1 if name in ("seq_index", "slot_mapping") else 0
        arr = np.full(seqs * width, fill, dtype)
        arr[:rows.num_rows] = getattr(rows, name)
        out[name] = arr
    out["context_lens"] = np.zeros(seqs, np.int64)
    out["context_lens"][:rows.num_seqs] = rows.context_lens
    return out


def test_advance_ref_gives_the_rows_from_blocks_gives():
    rng = np.random.default_rng()
    k, noise, ring_slots, pages = 5, 7, 256, 4
    tables = rng.integers(0, 100, (8, pages)).astype(np.int32)
    for _ in range(20):
        live = int(rng.integers(1, 5))
        lines = rng.permutation(8)[:live]
        starts = rng.integers(0, 1000, live)
        accepted = rng.integers(0, k + 1, live).astype(np.int32)
        bonus = rng.integers(0, 5000, live)
        verify = RowBatch.from_blocks(
            [RowBlock(int(ln), int(p), tuple(int(t) for t in rng.integers(0, 5000, k + 1)),
                      "verify") for ln, p in zip(lines, starts)], tables, ring_slots)
        seqs = live + 1                 # one padding slot: bonus -1
        arrays = _as_arrays(verify, seqs, k + 1)
        state_lines = np.r_[lines, 0].astype(np.int32)
        acc, bon = np.r_[accepted, 0].astype(np.int32), np.r_[bonus, -1].astype(np.int64)
        to_draft = dspark_ref.make_advance_spec(k, False, noise)
        dspark_ref.advance_ref(to_draft, arrays, state_lines, acc, bon, ring_slots, seqs)
        new = starts + accepted + 1
        draft = RowBatch.from_blocks(
            [RowBlock(int(ln), int(p), (int(b),) + (noise,) * (k - 1), "draft")
             for ln, p, b in zip(lines, new, bonus)], tables, ring_slots)
        want = _as_arrays(draft, seqs, k)
        for name, arr in want.items():
            assert np.array_equal(arrays[name][:arr.size], arr), f"to the draft: {name}"
        drafts = rng.integers(0, 5000, (live, k))
        for q in range(live):                           # what the Markov stages write
            arrays["token_ids"][q * (k + 1):(q + 1) * (k + 1)] = [bonus[q], *drafts[q]]
        to_verify = dspark_ref.make_advance_spec(k, True, noise)
        dspark_ref.advance_ref(to_verify, arrays, state_lines, acc, bon, ring_slots, seqs)
        again = RowBatch.from_blocks(
            [RowBlock(int(ln), int(p), (int(b), *map(int, d)), "verify")
             for ln, p, b, d in zip(lines, new, bonus, drafts)], tables, ring_slots)
        want = _as_arrays(again, seqs, k + 1)
        want["token_ids"][live * (k + 1):] = arrays["token_ids"][live * (k + 1):]  # not written
        for name, arr in want.items():
            assert np.array_equal(arrays[name], arr), f"to the verify: {name}"


def test_make_advance_spec_refuses_bad_arguments():
    with pytest.raises(ValueError, match="steps"):
        dspark_ref.make_advance_spec(0, False, 1)
    with pytest.raises(TypeError, match="to_verify"):
        dspark_ref.make_advance_spec(5, 1, 1)
    with pytest.raises(ValueError, match="noise_token"):
        dspark_ref.make_advance_spec(5, True, -1)


# ---- whole rounds on the emulated ranks ---------------------------------------------------------

class SyncFree(EmulatedDSparkRanks):
    """The reference model and caches; four emulated ranks with the sync-free plans wired."""

    def __init__(self, bundle_dir):
        super().__init__(bundle_dir, TP, SEQS)
        cfg = self.cfg
        self.verify = [wire(decode_plan(cfg, dspark=True, sync_free=True), ctx)
                       for ctx in self.ranks.contexts]
        self.draft = [wire(draft_plan(cfg, sync_free=True), ctx) for ctx in self.ranks.contexts]
        for plan in self.verify + self.draft:
            plan.require_complete()
        for tensors in self.ranks.tensors:
            tensors["accepted"][...] = -1
            tensors["bonus"][...] = -1


@pytest.fixture(scope="module")
def sync_free(tiny_bundle_dir):
    return SyncFree(tiny_bundle_dir)


def _history(s: SyncFree, rows: RowBatch, seqs, drafts) -> np.ndarray:
    """The verify step's Engram token history (the host's still: see the module docstring)."""
    cfg = s.cfg
    prior = [np.array(q.tokens + [q.bonus, *d], np.int64) for q, d in zip(seqs, drafts)]
    return token_history(cfg, rows, prior)


def _assert_rows(s: SyncFree, want: RowBatch, what: str) -> None:
    """The bound rows on every rank are exactly `want`'s (its rows, its sequences)."""
    n = want.num_rows
    for r in range(TP):
        for name, dtype in ROW_ARRAYS:
            got = s.ranks.read(r, name, dtype, (MAX_ROWS,))[:n]
            assert np.array_equal(got, getattr(want, name)), (
                f"{what} rank {r}: {name} {got.tolist()}, want {getattr(want, name).tolist()}")
        got = s.ranks.read(r, "context_lens", np.int64, (MAX_ROWS,))[:want.num_seqs]
        assert np.array_equal(got, want.context_lens), f"{what} rank {r}: context_lens {got}"


def _verify_rows(s: SyncFree, seqs, drafts) -> RowBatch:
    return RowBatch.from_blocks([RowBlock(q.state_line, q.position, (q.bonus, *d), "verify")
                                 for q, d in zip(seqs, drafts)],
                                s.caches.block_tables, s.caches.ring_slots)


def _verify_matches(s: SyncFree, seqs, drafts, rnd: int) -> bool:
    """The reference's verify_and_accept per sequence vs the device's (accepted, bonus); False
    after a near tie where they differ (the rounds stop)."""
    same = True
    for q, (seq, d) in enumerate(zip(seqs, drafts)):
        alone = RowBatch.from_blocks([RowBlock(seq.state_line, seq.position, (seq.bonus, *d),
                                               "verify")],
                                     s.caches.block_tables, s.caches.ring_slots)
        logits = ref_step.decode_step(s.model, alone, s.caches.copy(),
                                      [np.array(seq.tokens, np.int64)]).logits
        a, emitted = ref_dspark.verify_and_accept(s.model, s.caches, seq, d)
        for r in range(TP):
            got = (int(s.ranks.read(r, "accepted", np.int32, (MAX_ROWS,))[q]),
                   int(s.ranks.read(r, "bonus", np.int64, (MAX_ROWS,))[q]))
            if got != (a, emitted[-1]):
                row = min(max(got[0], 0), a)     # where the two runs first part: a near tie
                top2 = np.sort(logits[row].astype(np.float64))[-2:]
                assert top2[1] - top2[0] <= LOGIT_BOUND, (
                    f"round {rnd} rank {r} seq {q}: device (accepted, bonus) {got}, reference "
                    f"{(a, emitted[-1])} at a top-2 margin {top2[1] - top2[0]}")
                same = False
    return same


def _device_drafts(s: SyncFree, seqs, rnd: int):
    """The draft plan's tokens per sequence, checked against the reference's draft(); None after
    a near tie where they differ (the rounds stop)."""
    k, vocab_l = s.cfg.dspark_block_size, s.cfg.vocab_size // TP
    ids = [s.ranks.read(r, "token_ids", np.int64, (MAX_ROWS,)) for r in range(TP)]
    emu = [s.ranks.read(r, "dspark.base", np.float32, (MAX_ROWS, vocab_l)) for r in range(TP)]
    out = []
    for q, seq in enumerate(seqs):
        mine = ids[0][q * (k + 1):(q + 1) * (k + 1)]
        for r in range(TP):
            assert np.array_equal(ids[r][q * (k + 1):(q + 1) * (k + 1)], mine), (
                f"round {rnd} seq {q}: rank {r} drafted other tokens than rank 0")
        assert mine[0] == seq.bonus, f"round {rnd} seq {q}: verify row 0 is not the bonus"
        ref_base = ref_dspark.draft_base_logits(s.model, s.caches, seq)
        want = ref_dspark.markov_drafts(s.model, ref_base, seq.bonus)
        emu_base = [e[q * k:(q + 1) * k] for e in emu]
        drafts = tuple(int(t) for t in mine[1:])
        if _check_drafts(s.model, list(drafts), want, ref_base, emu_base, seq.bonus) < k:
            return None
        out.append(drafts)
    return out


def test_rounds_run_with_rows_from_the_device(sync_free):
    s, cfg = sync_free, sync_free.cfg
    rng = np.random.default_rng()
    k, noise = cfg.dspark_block_size, cfg.dspark_noise_token_id
    seqs = [ref_dspark.start_sequence(s.model, s.caches, line, random_prompt(rng, 9 + 4 * line))[0]
            for line in range(SEQS)]
    drafts = [ref_dspark.draft(s.model, s.caches.copy(), q) for q in seqs]
    rows = _verify_rows(s, seqs, drafts)
    s.ranks.load(rows, s.caches, _history(s, rows, seqs, drafts))   # the host's only row write
    compared, accepted = 0, []
    for rnd in range(ROUNDS):
        if rnd:
            history = _history(s, rows, seqs, drafts)
            for tensors in s.ranks.tensors:
                tensors["token_history"][:rows.num_rows] = history[:, 1:]
        run_lockstep(s.verify, SEQS * (k + 1), s.ranks.space)
        if not _verify_matches(s, seqs, drafts, rnd):
            break
        accepted += [int(a) for a in s.ranks.read(0, "accepted", np.int32, (MAX_ROWS,))[:SEQS]]
        _assert_rows(s, RowBatch.from_blocks(
            [RowBlock(q.state_line, q.position, (q.bonus,) + (noise,) * (k - 1), "draft")
             for q in seqs], s.caches.block_tables, s.caches.ring_slots),
            f"round {rnd} draft rows")
        run_lockstep(s.draft, SEQS * k, s.ranks.space)
        drafts = _device_drafts(s, seqs, rnd)
        if drafts is None:
            break
        rows = _verify_rows(s, seqs, drafts)
        _assert_rows(s, rows, f"round {rnd} next verify rows")
        compared += 1
    assert compared > 0, f"no round compared (accepted so far {accepted})"
