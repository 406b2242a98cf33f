"""The wired DSpark draft step (executor.plan.draft_plan, every stage) on four emulated ranks
(tiny, CPU) against executor/reference/dspark.py's draft_base_logits and markov_drafts.

Two sequences (state lines 0 and 1) draft together, ROUNDS rounds. Each round the emulated ranks
get the caller's draft rows ([bonus, noise x (k - 1)] per sequence, kind "draft", 2k rows, no
padding: the Markov stages take k rows per sequence), the reference's caches (its prefill, its
verify steps and the draft stages' context KV so far) and the sequences' `bonus`, then run the
whole draft plan in lockstep: head (rows prep, embed, all-reduce), the 3 DSpark stages (every
`draft.*` role, through the backbone builders on `mtp.{s}.` weights and the DSpark experts),
collapse, the last stage's norm, the shared head into `dspark.base`, then the k Markov steps,
which write the next verify step's token_ids rows (bonus, d_1..d_k). Checked on every rank:

- `dspark.base` (U, this rank's vocab columns, both sequences' rows) within LOGIT_BOUND of the
  reference's draft_base_logits. Both round to bf16 at the same points but sum in other orders
  (split-K partials, the fp32 all-reduce, the head's dot products), so a bf16 value between two
  layers may land one ulp apart and the difference grows through the 3 stages; it is not derived
  element by element. Measured: worst 0.017 over 5 runs x 8 rounds x 2 sequences (|U| <= ~5; a
  one-ulp flip of a hidden value near 4 is 2^-6 = 0.016 before the head), about the reference's
  own TP1-vs-TP4 spread (tests/test_ref_step.py: 0.076 over 96 whole steps). 0.08 leaves ~5x;
  reading the backbone's final `norm` instead of the last stage's moves U by 0.26 (tried).
- the 5 draft tokens equal markov_drafts(reference U) except at a genuine near tie: where they
  first differ, the reference's Markov logits of the two tokens (U + markov_w2 · markov_w1[prev],
  float64) are apart by no more than the emulated U's difference from the reference's on those
  two columns plus the Markov sum's rounding (m 2^-24 sum |w1 w2| each, the kernel summing the
  m products in fp32); that sequence's later drafts follow another prev and are not compared.
- every rank wrote the same token_ids rows.
- the draft rows' KV in each stage's SWA cache (the draft forward writes it at the rows' slots,
  as the reference does; the verify's context KV later overwrites it): every byte outside those
  slots unchanged, the same bytes on every rank, and each record decoding within two E4M3 steps
  of the reference's at its group's amax, 2^(floor(log2 amax) - 2): one for the encoding's
  rounding, one for a kv row that differs by bf16 ulps before it (measured: at most one step;
  the first stage's records came out bitwise equal).

Between rounds the reference advances each sequence by verify_and_accept of its own drafts.
"""
from __future__ import annotations

import numpy as np
import pytest
from emulated_dspark import EmulatedDSparkRanks
from ref_model import random_prompt, token_history

from executor.emulate import run_lockstep
from executor.plan import draft_plan
from executor.reference import dspark as ref_dspark
from executor.reference.rows import RowBatch, RowBlock
from executor.wiring import wire
from kernels import kvrecord_ref as kr

TP = 4
ROUNDS = 6
SEQS = 2
LOGIT_BOUND = 0.08          # measured worst 0.017 (see the module docstring)
MAX_ROWS = 192              # EmulatedRanks' default: the bound tensors' row capacity


class Draft(EmulatedDSparkRanks):
    """The reference model and caches, and four emulated ranks with the draft plan wired."""

    def __init__(self, bundle_dir):
        super().__init__(bundle_dir, TP, SEQS)
        self.plans = [wire(draft_plan(self.cfg), ctx) for ctx in self.ranks.contexts]


@pytest.fixture(scope="module")
def draft(tiny_bundle_dir):
    return Draft(tiny_bundle_dir)


def test_draft_plan_is_complete_and_each_draft_role_is_a_stage_role(draft):
    """Every stage of draft_plan is wired (the Markov stages and the draft forward), and the
    per-layer stages are the DSpark stages' only."""
    cfg = draft.cfg
    stage_layers = {spec.index for spec in cfg.layers if spec.is_dspark}
    for plan in draft.plans:
        plan.require_complete()
        layers = {s.layer for s in plan.stages if s.range_name.startswith("draft.")}
        assert layers == stage_layers | {None}, layers
    from executor.stages import draft as stages_draft

    backbone = cfg.layers[0]
    with pytest.raises(ValueError, match="DSpark stage layer"):
        stages_draft.BUILDERS["draft.attn.wq_b"](draft.ranks.contexts[0], backbone)


def _markov_logits(model, base, prev: int) -> tuple[np.ndarray, np.ndarray]:
    """One Markov step in float64 over every rank's columns: (logits [V], rounding bound [V])."""
    cfg = model.cfg
    last = cfg.num_layers_total - 1
    w1 = model.ranks[0].layer(last).vector("markov_head.markov_w1.weight")[prev]
    logits, bound = [], []
    for r, rank in enumerate(model.ranks):
        w2 = rank.layer(last).vector("markov_head.markov_w2.weight").astype(np.float64)
        logits.append(base[r].astype(np.float64) + w2 @ w1.astype(np.float64))
        bound.append(cfg.dspark_markov_rank * 2.0**-24 * (np.abs(w2) @ np.abs(w1)))
    return np.concatenate(logits), np.concatenate(bound)


def _check_drafts(model, ids, want, ref_base, emu_base, anchor) -> int:
    """Draft tokens vs the reference's; returns how many were compared equal (see docstring)."""
    prev, equal = anchor, 0
    for i, (got, ref) in enumerate(zip(ids, want)):
        if got != ref:
            logits, bound = _markov_logits(model, [b[i] for b in ref_base], prev)
            u_err = np.abs(np.concatenate([b[i] for b in emu_base]).astype(np.float64)
                           - np.concatenate([b[i] for b in ref_base]))
            gap = abs(logits[ref] - logits[got])
            allowed = u_err[got] + u_err[ref] + bound[got] + bound[ref]
            assert gap <= allowed, (f"draft {i}: token {got}, reference {ref}: their reference "
                                    f"Markov logits differ by {gap} > {allowed} (not a near tie)")
            return equal
        prev, equal = ref, equal + 1
    return equal


def _record_bound(entries: np.ndarray) -> np.ndarray:
    """Two E4M3 steps at each group's amax, per element of [N, 512] decoded entries."""
    n = entries.shape[0]
    groups = np.abs(entries).reshape(n, -1, kr.KV_SCALE_GROUP).max(axis=2, keepdims=True)
    step = np.ldexp(1.0, np.floor(np.log2(np.maximum(groups, kr.AMAX_FLOOR))).astype(int) - 2)
    return np.broadcast_to(step, (n, entries.shape[1] // kr.KV_SCALE_GROUP,
                                  kr.KV_SCALE_GROUP)).reshape(n, -1)


def _check_swa(s, rows, before, after, rnd) -> None:
    """The draft rows' SWA records (see the module docstring), every stage, every rank."""
    slots = rows.slot_mapping[rows.slot_mapping >= 0]
    for spec in (spec for spec in s.cfg.layers if spec.is_dspark):
        name = f"swa_{spec.index}"
        got = s.ranks.tensors[0][name]
        for r in range(1, TP):
            assert np.array_equal(s.ranks.tensors[r][name], got), f"round {rnd}: {name} rank {r}"
        other = np.ones(got.shape[0], bool)
        other[slots] = False
        assert np.array_equal(got[other], before.swa[spec.index][other]), (
            f"round {rnd}: {name} changed outside the draft rows' slots")
        mine, want = kr.decode_kv_record(got[slots]), kr.decode_kv_record(after.swa[spec.index][slots])
        err, bound = np.abs(mine - want), _record_bound(np.maximum(np.abs(mine), np.abs(want)))
        assert (err <= bound).all(), (f"round {rnd}: {name} record of row "
                                      f"{np.argwhere(err > bound)[0].tolist()} off the reference's")


def test_draft_steps_produce_the_reference_drafts(draft):
    s, cfg = draft, draft.cfg
    rng = np.random.default_rng()
    k, vocab_l = cfg.dspark_block_size, cfg.vocab_size // TP
    seqs = [ref_dspark.start_sequence(s.model, s.caches, line, random_prompt(rng, 9 + 5 * line))[0]
            for line in range(SEQS)]
    compared, worst = 0, 0.0
    for rnd in range(ROUNDS):
        blocks = [(q.bonus,) + (cfg.dspark_noise_token_id,) * (k - 1) for q in seqs]
        rows = RowBatch.from_blocks([RowBlock(q.state_line, q.position, b, "draft")
                                     for q, b in zip(seqs, blocks)],
                                    s.caches.block_tables, s.caches.ring_slots)
        assert rows.num_rows == SEQS * k
        prior = [np.array(q.tokens + list(b), np.int64) for q, b in zip(seqs, blocks)]
        s.ranks.load(rows, s.caches, token_history(cfg, rows, prior))
        for tensors in s.ranks.tensors:
            tensors["bonus"][...] = -1
            tensors["bonus"][:SEQS] = [q.bonus for q in seqs]
            tensors["token_ids"][SEQS * k:] = -1        # the Markov stages write rows 0..12
        run_lockstep(s.plans, rows.num_rows, s.ranks.space)

        after = s.caches.copy()                 # the reference's draft writes its SWA rows
        ref_bases = [ref_dspark.draft_base_logits(s.model, after, q) for q in seqs]
        _check_swa(s, rows, s.caches, after, rnd)
        emu = [s.ranks.read(r, "dspark.base", np.float32, (MAX_ROWS, vocab_l))[:rows.num_rows]
               for r in range(TP)]
        ids = [s.ranks.read(r, "token_ids", np.int64, (MAX_ROWS,)) for r in range(TP)]
        for r in range(TP):
            assert np.array_equal(ids[r][:SEQS * (k + 1)], ids[0][:SEQS * (k + 1)]), (
                f"round {rnd}: rank {r} wrote other draft tokens than rank 0")
        for q, (seq, ref_base) in enumerate(zip(seqs, ref_bases)):
            emu_base = [e[q * k:(q + 1) * k] for e in emu]
            for r in range(TP):
                err = np.abs(emu_base[r].astype(np.float64) - ref_base[r])
                worst = max(worst, float(err.max()))
                assert err.max() <= LOGIT_BOUND, (
                    f"round {rnd} seq {q} rank {r}: dspark.base off the reference's U by "
                    f"{err.max()} at {np.unravel_index(err.argmax(), err.shape)}")
            want = ref_dspark.markov_drafts(s.model, ref_base, seq.bonus)
            mine = ids[0][q * (k + 1):(q + 1) * (k + 1)]
            assert mine[0] == seq.bonus, f"round {rnd} seq {q}: verify row 0 is not the bonus"
            compared += _check_drafts(s.model, [int(t) for t in mine[1:]], want, ref_base,
                                      emu_base, seq.bonus)
            ref_dspark.verify_and_accept(s.model, s.caches, seq, want)
    assert compared >= ROUNDS * SEQS * k // 2, (
        f"only {compared} of {ROUNDS * SEQS * k} draft tokens compared equal (worst U "
        f"difference {worst})")
