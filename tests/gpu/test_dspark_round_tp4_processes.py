"""DSpark rounds through the real Executor and the real collectives: 4 processes, TP 4, tiny.

Issue 10's acceptance, the Executor way: four spawned processes (collectives.launcher.run_ranks),
one rank each (executor.tp_run.TPRank(dspark=True): one-shot all-reduce over IPC,
Executor(dspark=True, comm=ar.state()), CuPy caller tensors, bind, capture of the verify and
draft graphs of sequence-slot buckets 1, 4 and 32). All on device 0 (time-sliced contexts), or
one rank per GPU of HOPDEC_TP4_DEVICES=0,1,2,3.

SEQS = 3 sequences in the slot bucket of 4 (slot 3 is padding: `bonus` -1). The parent prefills
them with the NumPy reference and hands every rank the caches, the first draft rows (their
Engram `token_history` included) and `bonus`, written once. Then each rank runs ROUNDS rounds
with NO host write: Executor.draft(3), then Executor.step(18) (the verify graph); between and
after them the rank only reads (a stream sync outside the executor's calls, then copies): the
verify rows the draft step left (drafts, token_history, rows), this rank's base logits U, and
after the verify the greedy tokens, accepted, bonus, the next draft rows, every cache's digest.
Last, the round API itself: from a device copy of every bound tensor, draft + step once more and
Executor.round(3) once (a restore between), which must leave bit-identical bound tensors.
Before the first round the declines (round(0): NO_ROWS, round(33) / draft(33): TOO_MANY_ROWS,
a PREFILL step) change no byte of any bound tensor.

The parent then replays the rounds on the reference and checks, every round, every sequence:
- every rank drafted the same tokens, wrote the same greedy tokens, accepted, bonus and rows, and
  holds the same bytes in every cache; no collective timed out;
- U within U_BOUND of draft_base_logits (test_dspark_round.py's bound and why), the drafts equal
  markov_drafts of the reference's U except at a near tie (test_dspark_draft_emulated's rule);
- the verify rows are exactly RowBatch.from_blocks of [bonus, drafts] and their token_history
  exactly the reference's lookback (the device wrote it: dspark.history_verify);
- the greedy tokens of the 6 verify rows equal the reference's verify of the device's drafts
  except at a near tie (top-2 margin <= LOGIT_BOUND, test_dspark_round.py's rule); (accepted,
  bonus) are exactly the acceptance rule over the device's drafts and greedy tokens, and equal
  the reference's unless a near tie parted them; the reference then follows the device's count
  (the device's caches hold it: without a host write the device cannot be put back), so the
  rounds after a tie are still compared;
- the next draft rows are exactly from_blocks of [bonus, noise x 4] at the new position, and
  their token_history the reference's lookback (dspark.history_draft).
Over the run at least half the drafts and half the verify steps compare equal. The synthetic
drafter rarely matches the target, so most accepted counts are small (long ones: the scripted
rounds of tests/gpu/test_dspark_round.py); they are printed.
Expected time on one H200: the parent's prefills and 48 reference draft + verify steps ~40 s,
spawn, packing and 6 graph captures per rank ~20 s, 16 rounds of ~50 collectives each on four
time-sliced contexts ~0.6 s a round.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
from ref_model import new_caches, random_prompt, tiny_checkpoint, tiny_model
from test_dspark_draft_emulated import _check_drafts
from test_dspark_round_emulated import _history

from collectives.launcher import run_ranks
from executor.reasons import StepFeature, StepResult
from executor.reference import dspark as ref_dspark
from executor.reference import step as ref_step
from executor.reference.rows import RowBatch, RowBlock
from executor.tp_run import RankSpec, TPRank, WeightSource, host_inputs, is_cache, parse_devices
from kernels import dspark_ref

pytestmark = pytest.mark.gpu

BUNDLE = Path(os.environ.get("HOPDEC_BUNDLE", "build/bundle-tiny"))
WORLD, SEQS, ROUNDS = 4, 3, 16
BUCKETS = (8, 24, 192)          # sequence-slot buckets 1, 4, 32: SEQS runs in 4 (one padding)
LOGIT_BOUND = 0.25              # tests/gpu/test_dspark_round.py
U_BOUND = 0.25                  # tests/gpu/test_dspark_round.py (U over the device's own KV)
TIMEOUT_MS = 60_000
RUN_TIMEOUT_S = 540
ROWS = ("token_ids", "positions", "seq_index", "slot_mapping", "block_kind")


# ---- one rank (runs in a spawned process) ---------------------------------------------------------

def _digest(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()[:16]


def _rows(rank: TPRank, n: int, seqs: int) -> dict:
    out = {name: rank.read(name)[:n] for name in (*ROWS, "token_history")}
    out["context_lens"] = rank.read("context_lens")[:seqs]
    return out


def _declines(rank: TPRank, slots: int) -> dict:
    before = {name: _digest(rank.read(name)) for name in rank.tensors}
    codes = [rank.round(0), rank.round(slots + 1), rank.draft(slots + 1),
             int(rank.executor.step(6, rank.stream.handle, int(StepFeature.PREFILL)))]
    changed = sorted(n for n in before if _digest(rank.read(n)) != before[n])
    return {"codes": codes, "changed": changed}


def _one_round(rank: TPRank, k: int) -> dict:
    """draft(SEQS), reads, the verify step, reads: what the parent checks."""
    verify_rows, draft_rows = SEQS * (k + 1), SEQS * k
    out = {"draft_code": rank.draft(SEQS)}
    out["verify_in"] = _rows(rank, verify_rows, SEQS)
    vocab_l = rank.cfg.vocab_size // WORLD
    out["base"] = rank.scratch("dspark.base", np.float32, (draft_rows, vocab_l))
    out["verify_code"] = int(rank.executor.step(verify_rows, rank.stream.handle))
    out["tokens"] = rank.read("tokens")[:verify_rows]
    out["accepted"] = rank.read("accepted")[:SEQS]
    out["bonus"] = rank.read("bonus")[:SEQS + 1]
    out["draft_in"] = _rows(rank, draft_rows, SEQS)
    out["caches"] = {n: _digest(rank.read(n)) for n in rank.tensors if is_cache(n)}
    return out


def _round_api(rank: TPRank, k: int) -> dict:
    """From one saved state: draft + step, then (restored) round: the bound tensors' digests."""
    saved = rank.save(list(rank.tensors))
    runs = []
    for use_round in (False, True):
        if use_round:
            rank.restore(saved)
            codes = [rank.round(SEQS)]
        else:
            codes = [rank.draft(SEQS), int(rank.executor.step(SEQS * (k + 1),
                                                              rank.stream.handle))]
        runs.append({"codes": codes,
                     "digests": {n: _digest(rank.read(n)) for n in rank.tensors}})
    return {"split": runs[0], "round": runs[1]}


def _rank_program(ctx, bundle_dir: str, ckpt_dir: str, geometry, inputs: dict) -> dict:
    rank = TPRank(RankSpec(ctx.rank, ctx.world, ctx.device), bundle_dir,
                  WeightSource(checkpoint=ckpt_dir), geometry, ctx.exchange, buckets=BUCKETS,
                  bind_logits=False, timeout_ms=TIMEOUT_MS, dspark=True)
    try:
        k = rank.cfg.dspark_block_size
        rank.write(inputs)                      # the only host write: before round 0
        declined = _declines(rank, rank.executor.round_slots[-1])
        rounds = [_one_round(rank, k) for _ in range(ROUNDS)]
        api = _round_api(rank, k)
        return {"declined": declined, "rounds": rounds, "api": api,
                "slots": rank.executor.round_slots, "failed_sources": rank.failed_sources()}
    finally:
        rank.close()


# ---- the parent: reference, launch, checks ----------------------------------------------------------

class Reference:
    """The reference model, its caches and sequences, replayed round by round after the ranks."""

    def __init__(self, rng):
        self.model = tiny_model(WORLD)
        self.cfg = self.model.cfg
        self.k = self.cfg.dspark_block_size
        self.caches = new_caches(self.model, max_seqs=SEQS)
        self.seqs = [ref_dspark.start_sequence(self.model, self.caches, line,
                                               random_prompt(rng, 9 + 4 * line))[0]
                     for line in range(SEQS)]
        self.draft_equal = self.draft_total = self.verify_equal = 0
        self.accepted, self.ties, self.worst_u = [], [], 0.0

    def draft_blocks(self) -> RowBatch:
        noise = (self.cfg.dspark_noise_token_id,) * (self.k - 1)
        return RowBatch.from_blocks(
            [RowBlock(q.state_line, q.position, (q.bonus, *noise), "draft") for q in self.seqs],
            self.caches.block_tables, self.caches.ring_slots)

    def verify_blocks(self, drafts) -> RowBatch:
        return RowBatch.from_blocks(
            [RowBlock(q.state_line, q.position, (q.bonus, *d), "verify")
             for q, d in zip(self.seqs, drafts)], self.caches.block_tables,
            self.caches.ring_slots)

    def lookback(self, rows: RowBatch, drafts=None) -> np.ndarray:
        extra = drafts or [()] * SEQS
        prior = [np.array(q.tokens + [q.bonus, *d], np.int64) for q, d in zip(self.seqs, extra)]
        return _history(self.cfg, rows, prior)[:, 1:]

    def initial_inputs(self, geometry) -> dict:
        rows = self.draft_blocks()
        prior = [np.array(q.tokens + list(rows.token_ids[i * self.k:(i + 1) * self.k]),
                          np.int64) for i, q in enumerate(self.seqs)]
        inputs = host_inputs(self.cfg, WORLD, geometry, rows, _history(self.cfg, rows, prior),
                             self.caches)
        inputs["bonus"] = np.full(192, -1, np.int64)
        inputs["bonus"][:SEQS] = [q.bonus for q in self.seqs]
        inputs["accepted"] = np.zeros(192, np.int32)
        return inputs


def _same_on_every_rank(values: list, rnd: int) -> None:
    first = values[0]
    for r, v in enumerate(values[1:], 1):
        for key in ("tokens", "accepted", "bonus", "caches"):
            assert _equal(v[key], first[key]), f"round {rnd}: rank {r} {key} differ from rank 0"
        for key in ("verify_in", "draft_in"):
            for name, arr in v[key].items():
                assert np.array_equal(arr, first[key][name]), f"round {rnd}: rank {r} {name}"


def _equal(a, b) -> bool:
    return a == b if isinstance(a, dict) else np.array_equal(a, b)


def _assert_rows(got: dict, want: RowBatch, history: np.ndarray, what: str) -> None:
    for name in ROWS:
        assert np.array_equal(got[name], getattr(want, name)), (
            f"{what}: {name} {got[name].tolist()}, want {getattr(want, name).tolist()}")
    assert np.array_equal(got["context_lens"], want.context_lens), f"{what}: context_lens"
    assert np.array_equal(got["token_history"], history), (
        f"{what}: token_history {got['token_history'].tolist()}, want {history.tolist()}")


def _check_drafts_of(ref: Reference, rnd: int, values: list) -> list[tuple[int, ...]]:
    """The device's drafts (rank 0's verify rows), checked against the reference's; returns them.
    draft_base_logits writes the reference's draft SWA records, as the device's draft did."""
    k, first = ref.k, values[0]
    ids = first["verify_in"]["token_ids"]
    drafts = []
    for q, seq in enumerate(ref.seqs):
        mine = ids[q * (k + 1):(q + 1) * (k + 1)]
        assert mine[0] == seq.bonus, f"round {rnd} seq {q}: verify row 0 is not the bonus"
        ref_base = ref_dspark.draft_base_logits(ref.model, ref.caches, seq)
        emu_base = [v["base"][q * k:(q + 1) * k] for v in values]
        for r in range(WORLD):
            err = float(np.abs(emu_base[r].astype(np.float64) - ref_base[r]).max())
            ref.worst_u = max(ref.worst_u, err)
            assert err <= U_BOUND, f"round {rnd} seq {q} rank {r}: U off by {err} > {U_BOUND}"
        want = ref_dspark.markov_drafts(ref.model, ref_base, seq.bonus)
        d = tuple(int(t) for t in mine[1:])
        ref.draft_equal += _check_drafts(ref.model, list(d), want, ref_base, emu_base, seq.bonus)
        ref.draft_total += k
        drafts.append(d)
    return drafts


def _follow_verify(ref: Reference, rnd: int, q: int, drafts, tokens, accepted, bonus) -> None:
    """The reference verify of the device's drafts, checked (module docstring); its caches and
    sequence then take the device's accepted count and bonus."""
    seq, k = ref.seqs[q], ref.k
    rows = RowBatch.from_blocks([RowBlock(seq.state_line, seq.position, (seq.bonus, *drafts),
                                          "verify")], ref.caches.block_tables,
                                ref.caches.ring_slots)
    out = ref_step.decode_step(ref.model, rows, ref.caches, [np.array(seq.tokens, np.int64)])
    for row in np.flatnonzero(tokens != out.tokens[:k + 1]):
        top2 = np.sort(out.logits[row].astype(np.float64))[-2:]
        assert top2[1] - top2[0] <= LOGIT_BOUND, (
            f"round {rnd} seq {q} verify row {row}: device {tokens[row]}, reference "
            f"{out.tokens[row]} at a top-2 margin {top2[1] - top2[0]}")
    rule_a = 0
    while rule_a < k and drafts[rule_a] == tokens[rule_a]:
        rule_a += 1
    assert (accepted, bonus) == (rule_a, int(tokens[rule_a])), (
        f"round {rnd} seq {q}: (accepted, bonus) {(accepted, bonus)}, the acceptance rule over "
        f"the device's drafts and greedy tokens gives {(rule_a, int(tokens[rule_a]))}")
    ref_a = 0
    while ref_a < k and drafts[ref_a] == out.tokens[ref_a]:
        ref_a += 1
    if (accepted, bonus) == (ref_a, int(out.tokens[ref_a])):
        ref.verify_equal += 1
        ref.accepted.append(accepted)
    else:
        ref.ties.append((rnd, q, (accepted, bonus), (ref_a, int(out.tokens[ref_a]))))
    start, block = seq.position, (seq.bonus, *drafts)      # as verify_and_accept, with the
    seq.tokens.extend(block[:accepted + 1])                 # device's count and bonus
    seq.bonus = bonus
    ref.caches.rollback_compressor_rings(seq.state_line, seq.position)
    ref_dspark.write_context_kv(ref.model, ref.caches, seq.state_line, start,
                                out.aux[:accepted + 1])


def check_round(ref: Reference, rnd: int, values: list) -> None:
    k = ref.k
    for r, v in enumerate(values):
        assert (v["draft_code"], v["verify_code"]) == (StepResult.SERVED,) * 2, (rnd, r)
    _same_on_every_rank(values, rnd)
    first = values[0]
    drafts = _check_drafts_of(ref, rnd, values)
    verify = ref.verify_blocks(drafts)
    _assert_rows(first["verify_in"], verify, ref.lookback(verify, drafts),
                 f"round {rnd} verify rows")
    assert first["bonus"][SEQS] == -1, f"round {rnd}: the padding slot's bonus was written"
    for q in range(SEQS):
        _follow_verify(ref, rnd, q, drafts[q], first["tokens"][q * (k + 1):(q + 1) * (k + 1)],
                       int(first["accepted"][q]), int(first["bonus"][q]))
    nxt = ref.draft_blocks()
    _assert_rows(first["draft_in"], nxt, ref.lookback(nxt), f"round {rnd} draft rows")


def test_dspark_rounds_through_four_executors_follow_the_reference():
    if not (BUNDLE / "manifest.json").is_file():
        pytest.skip(f"no kernel bundle at {BUNDLE} (set HOPDEC_BUNDLE or run make bundle)")
    from executor.bind import CacheGeometry

    devices = parse_devices(os.environ.get("HOPDEC_TP4_DEVICES"), WORLD)
    ref = Reference(np.random.default_rng())
    geometry = CacheGeometry.of(ref.caches)
    results = run_ranks(_rank_program, WORLD, devices=devices, timeout_s=RUN_TIMEOUT_S,
                        args=(str(BUNDLE), str(tiny_checkpoint().path), geometry,
                              ref.initial_inputs(geometry)))
    assert all(r.ok for r in results), "\n".join(r.describe() + "\n" + r.traceback
                                                 for r in results if not r.ok)
    values = [r.value for r in results]
    for r, v in enumerate(values):
        assert v["failed_sources"] == [], f"rank {r}: collectives timed out"
        assert v["slots"] == (1, 4, 32)
        assert v["declined"]["codes"] == [StepResult.NO_ROWS, StepResult.TOO_MANY_ROWS,
                                          StepResult.TOO_MANY_ROWS, StepResult.PREFILL_ROWS]
        assert v["declined"]["changed"] == [], f"rank {r}: a declined call wrote"
        api = v["api"]
        assert api["split"]["codes"] == [0, 0] and api["round"]["codes"] == [0], (r, api)
        moved = sorted(n for n in api["split"]["digests"]
                       if api["split"]["digests"][n] != api["round"]["digests"][n])
        assert not moved, f"rank {r}: round() left other bytes than draft() + step() in {moved}"
    for rnd in range(ROUNDS):
        check_round(ref, rnd, [v["rounds"][rnd] for v in values])
    total = ROUNDS * SEQS
    print(f"\n{ROUNDS} rounds x {SEQS} sequences through 4 Executors: accepted {ref.accepted}, "
          f"drafts equal {ref.draft_equal}/{ref.draft_total}, verify equal "
          f"{ref.verify_equal}/{total}, near ties {ref.ties}, worst U {ref.worst_u}")
    assert ref.draft_equal >= ref.draft_total // 2, ref.draft_equal
    assert ref.verify_equal >= total // 2, ref.verify_equal
    assert dspark_ref.history_cols(ref.cfg) == 3       # tiny has Engram: the lookback is checked
