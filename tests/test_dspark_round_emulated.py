"""DSpark rounds on four emulated ranks (tiny, CPU) against executor/reference/dspark.py: the
verify side (aux states, device-side acceptance, ring rollback, context KV) and the draft step's
Markov correction on the accepted `bonus`.

Two sequences (state lines 0 and 1) share every verify step, for ROUNDS rounds. Each round the
drafts are the reference's greedy continuation for a random number of tokens, then random ones,
so every accepted count 0..5 occurs. The reference runs the verify forward (decode_step's loop,
kept here to expose the streams at each target layer), then `verify_and_accept`'s bookkeeping per
sequence: acceptance, `rollback_compressor_rings`, `write_context_kv`.

In the first test the emulated ranks get the caller's rows and the caches as the reference's
target forward left them (isolating the DSpark stages from the forward's roundings),
the greedy `tokens` and, at each target layer, the streams after its attn.mhc_pre; then they run
the wired DSpark stages of decode_plan(cfg, dspark=True) in lockstep. Checked on every rank:
- dspark.aux bitwise the reference's aux (sequential fp32 sum, exact * 0.25, one rounding);
- accepted / bonus exactly the reference's, for both sequences, every round;
- every ratio-2 compressor ring bitwise the reference's after its rollback (NaN included);
- main_proj within 2 x dense_tolerance of the reference's bf16(aux · main_projᵀ) (each within one
  bound of the exact product), main_x bitwise rms_norm of the emulated main_proj output;
- per DSpark stage: the kv half within 2 x dense_tolerance of the reference's wkv on the emulated
  main_x; the SWA records at the accepted rows bitwise the reference insert_swa composition on the
  emulated kv, and bitwise the reference caches' records wherever the emulated kv row equals the
  one write_context_kv projected (from the reference's own main_x); every other slot (rejected
  rows, other lines) keeps its bytes;
- the draft step's Markov stages (draft_plan's dspark.markov0..k: local argmax + cross-rank pick,
  k times) on the reference's base logits U of the next draft block and the device's `bonus`:
  the next verify step's token_ids rows (bonus, d_1..d_k) equal reference draft()'s tokens; a
  token may differ only at a near tie of its Markov logits (the kernel sums the m exact products
  in fp32, the reference in float64: m 2^-24 sum |w1 w2| apart at most), after which that
  sequence's later drafts are not compared. (The draft stages' forward that produces U is not
  wired: the reference's U is written into `dspark.base`.)

test_whole_verify_steps_accept_what_the_reference_accepts runs the whole wired verify step
(every stage module: the target forward, the pick, then the DSpark stages) for the same two
sequences over ROUNDS rounds, the emulated caches carried from round to round, against the
reference's own verify_and_accept per sequence (see its docstring for the near-tie rule).
"""
from __future__ import annotations

import numpy as np
import pytest
from emulated_dspark import EmulatedDSparkRanks
from ref_model import random_prompt, token_history

from executor.emulate import run_lockstep
from executor.plan import draft_plan
from executor.reference import attention as ra
from executor.reference import dspark as ref_dspark
from executor.reference import step as ref_step
from executor.reference.rows import RowBatch, RowBlock
from executor.wiring import Buffer, wire
from kernels import dense_ref as dr
from kernels import kvrecord_ref, moe_ref
from kernels.common_ref import BF16
from loader.formats import bf16_round

TP = 4
ROUNDS = 5
BUCKET = 16
MODULES = ("executor.stages.mhc", "executor.stages.ffn", "executor.stages.collectives",
           "executor.stages.attn_proj", "executor.stages.dspark", __name__)
DSPARK_ROLES = {"dspark.accept", "dspark.ring_rollback", "dspark.main_proj", "dspark.main_norm"}


# This module doubles as a stand-in stage module: attn_proj's wo_a reads `attn.o`, which the
# attention-index group declares (executor/stages/attn_index.py, not wired here).
BUILDERS: dict = {}


def buffers(cfg, tp, max_rows):
    heads = cfg.rank_shapes(tp).heads
    return [Buffer("attn.o", BF16, (max_rows, heads, cfg.head_dim), "stand-in: group B's")]


class Round(EmulatedDSparkRanks):
    """The reference model, its caches and the emulated ranks wired for the verify step."""

    def __init__(self, bundle_dir):
        super().__init__(bundle_dir, TP, 2, MODULES)
        cfg = self.cfg
        for tensors in self.ranks.tensors:                 # the caller's DSpark outputs
            tensors["accepted"][...] = -1
            tensors["bonus"][...] = -1
        markov = {f"dspark.markov{i}" for i in range(cfg.dspark_block_size + 1)}
        self.markov = [self.ranks.subplan(wire(draft_plan(cfg), ctx, MODULES), roles=markov)
                       for ctx in self.ranks.contexts]


_history = token_history     # the name tests/gpu/test_dspark_round_tp4_processes.py imports


@pytest.fixture(scope="module")
def setup(tiny_bundle_dir):
    return Round(tiny_bundle_dir)


def _forward(model, rows, caches, history):
    """decode_step's loop, also returning the streams each target layer's aux is taken from."""
    cfg = model.cfg
    state = ref_step.start_streams(ref_step.embed(model, rows.token_ids), cfg.hc_mult)
    aux, streams = [], []
    for layer in range(cfg.num_hidden_layers):
        if layer in cfg.dspark_target_layer_ids:
            ref_step.apply_pending(state)
            streams.append(state.streams.copy())
            aux.append(ref_step.bf16(state.streams.mean(axis=1)))
        ref_step.run_layer(model, layer, state, rows, caches, history)
    hidden = ref_step.finish(model, state, model.ranks[0].norm)
    tokens, _ = ref_step.head_and_argmax(model, hidden)
    return tokens, np.stack(aux, axis=1), streams


def _greedy(model, caches, seq, n):
    """The next n greedy tokens after seq.bonus by plain decode steps (on a copy)."""
    caches, tokens, out = caches.copy(), list(seq.tokens) + [seq.bonus], []
    for _ in range(n):
        rows = RowBatch.from_blocks([RowBlock(seq.state_line, len(tokens) - 1, (tokens[-1],),
                                              "decode")], caches.block_tables, caches.ring_slots)
        t = int(ref_step.decode_step(model, rows, caches, [np.array(tokens[:-1])]).tokens[0])
        tokens.append(t)
        out.append(t)
    return out


def _drafts(rng, s: Round, seq, k: int) -> tuple[tuple[int, ...], int]:
    """(drafts, how many of them are the greedy continuation)."""
    good = int(rng.integers(0, k + 1))
    noise = [int(t) for t in rng.integers(0, s.cfg.vocab_size - 1, k - good)]
    return tuple(_greedy(s.model, s.caches, seq, good) + noise), good


def _within(got, want, bound, what):
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    bad = ~(err <= bound)
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements off, first at "
                           f"{np.argwhere(bad)[0].tolist()}")


def _check_context(s: Round, rows, before, accepted, kvs):
    """main_proj, main_x, and each stage's kv and SWA records (see the module docstring)."""
    cfg = s.cfg
    lw0 = s.model.ranks[0].layer(cfg.num_hidden_layers)
    n, d = rows.num_rows, cfg.hidden_size
    slots = np.full(BUCKET, -1, np.int64)
    for q, a in enumerate(accepted):
        mine = rows.seq_rows(q)[:a + 1]
        slots[mine] = rows.slot_mapping[mine]
    keep = slots >= 0
    for r in range(TP):
        aux = s.ranks.read(r, "dspark.aux", BF16, (BUCKET, 3 * d)).astype(np.float32)
        raw = s.ranks.read(r, "dspark.main_raw", BF16, (BUCKET, d))
        w = lw0.dense("main_proj")
        want = bf16_round(moe_ref.matmul_t(aux, w))
        _within(raw[:n], want[:n], 2 * dr.dense_tolerance(aux[:n], w, "bf16"), "main_proj")
        main_x = s.ranks.read(r, "dspark.main_x", BF16, (BUCKET, d))
        norm = ref_step.rms_norm(raw.astype(np.float32), lw0.vector("main_norm.weight"),
                                 cfg.rms_norm_eps)
        assert np.array_equal(main_x.astype(np.float32), norm), f"rank {r}: main_x"
    # the main_x the reference's write_context_kv projected (aux of the verify rows, bitwise ours)
    aux0 = s.ranks.read(0, "dspark.aux", BF16, (BUCKET, 3 * d)).astype(np.float32)
    main_ref = ref_step.rms_norm(bf16_round(moe_ref.matmul_t(aux0, lw0.dense("main_proj"))),
                                 lw0.vector("main_norm.weight"), cfg.rms_norm_eps)
    matched = 0
    for layer in (spec.index for spec in cfg.layers if spec.is_dspark):
        lw = s.model.ranks[0].layer(layer)
        main_x = s.ranks.read(0, "dspark.main_x", BF16, (BUCKET, d)).astype(np.float32)
        want_swa = before.swa[layer].copy()
        kv = kvs[layer]
        kv_ref = ra._linear(main_x, lw, "attn.wkv")
        _within(kv[:n], kv_ref[:n], 2 * dr.dense_tolerance(main_x[:n], ra._weight(lw, "attn.wkv"),
                                                           "bf16"), f"layer {layer} kv")
        y = ra._norm(kv.astype(np.float32), lw.vector("attn.kv_norm.weight"), cfg.rms_norm_eps)
        entries = bf16_round(ra._rope(y[keep], rows.positions[keep], ra.rope_for(cfg, 0)))
        want_swa[slots[keep]] = kvrecord_ref.encode_kv_record(entries)
        kv_true = ra._linear(main_ref, lw, "attn.wkv")     # what wrote the reference's record
        same = (kv[keep].astype(BF16).view(np.uint16)
                == kv_true[keep].astype(BF16).view(np.uint16)).all(axis=1)
        for r in range(TP):
            got = s.ranks.tensors[r][f"swa_{layer}"]
            np.testing.assert_array_equal(got, want_swa, err_msg=f"rank {r}: swa_{layer}")
            np.testing.assert_array_equal(got[slots[keep][same]],
                                          s.caches.swa[layer][slots[keep][same]],
                                          err_msg=f"rank {r}: swa_{layer} vs write_context_kv")
        matched += int(same.sum())
    return matched


def _markov_margin(s: Round, base, prev: int, token: int, want: int) -> None:
    """A Markov token that differs from the reference's must be a near tie of its logits: the
    kernel sums the m exact products in order in fp32, the reference in float64."""
    cfg = s.cfg
    last = s.model.ranks[0].layer(cfg.num_layers_total - 1)
    w1 = last.vector("markov_head.markov_w1.weight")[prev].astype(np.float64)
    logits, bound = [], []
    for r, rank in enumerate(s.model.ranks):
        w2 = rank.layer(cfg.num_layers_total - 1).vector("markov_head.markov_w2.weight")
        logits.append(base[r].astype(np.float64) + w2.astype(np.float64) @ w1)
        bound.append(cfg.dspark_markov_rank * 2.0**-24 * (np.abs(w2) @ np.abs(w1)))
    logits, bound = np.concatenate(logits), np.concatenate(bound)
    assert abs(logits[token] - logits[want]) <= bound[token] + bound[want] + 2.0**-22 * abs(
        logits[want]), f"Markov token {token} vs reference {want}: not a near tie"


def _check_markov(s: Round, seqs, rnd: int) -> None:
    """The draft step's Markov correction on the device `bonus` vs reference draft()."""
    cfg, k = s.cfg, s.cfg.dspark_block_size
    vocab = cfg.vocab_size // TP
    bases = [ref_dspark.draft_base_logits(s.model, s.caches.copy(), q) for q in seqs]
    for r in range(TP):
        u = np.zeros((BUCKET * k, vocab), np.float32)
        for q, base in enumerate(bases):
            u[q * k:(q + 1) * k] = base[r]
        s.ranks.write("dspark.base", u, ranks=[r])
    run_lockstep(s.markov, len(seqs) * k, s.ranks.space)
    for q, (seq, base) in enumerate(zip(seqs, bases)):
        want = ref_dspark.markov_drafts(s.model, base, seq.bonus)
        for r in range(TP):
            ids = s.ranks.read(r, "token_ids", np.int64, (192,))[q * (k + 1):(q + 1) * (k + 1)]
            assert ids[0] == seq.bonus, f"round {rnd} rank {r} seq {q}: verify row 0"
            for i in range(k):
                if ids[i + 1] != want[i]:
                    prev = int(ids[i])
                    _markov_margin(s, [b[i] for b in base], prev, int(ids[i + 1]), want[i])
                    break                       # later steps follow a different prev


def test_dspark_verify_rounds_match_the_reference(setup):
    s, cfg = setup, setup.cfg
    rng = np.random.default_rng()
    k = cfg.dspark_block_size
    seqs = [ref_dspark.start_sequence(s.model, s.caches, line, random_prompt(rng, 10 + 3 * line))[0]
            for line in range(2)]
    first_round, matched, accepted = True, 0, []
    for rnd in range(ROUNDS):
        drafts, good = zip(*[_drafts(rng, s, seq, k) for seq in seqs])
        rows = RowBatch.from_blocks(
            [RowBlock(q.state_line, q.position, (q.bonus, *d), "verify")
             for q, d in zip(seqs, drafts)], s.caches.block_tables, s.caches.ring_slots,
            pad_to=BUCKET)
        prior = [np.array(q.tokens + [q.bonus, *d], np.int64) for q, d in zip(seqs, drafts)]
        history = token_history(cfg, rows, prior)
        if first_round:         # the loop above is decode_step's: same tokens and aux
            check = ref_step.decode_step(s.model, rows, s.caches.copy(),
                                         [np.array(q.tokens, np.int64) for q in seqs])
        tokens, aux, streams = _forward(s.model, rows, s.caches, history)
        if first_round:
            assert np.array_equal(tokens, check.tokens) and np.array_equal(aux, check.aux)
            first_round = False
        before = s.caches.copy()              # the caches the target forward left
        # reference: verify_and_accept's bookkeeping per sequence
        want = []
        for q, (seq, d) in enumerate(zip(seqs, drafts)):
            mine = rows.seq_rows(q)
            g = tokens[mine]
            a = 0
            while a < k and d[a] == g[a]:
                a += 1
            p = seq.position
            seq.tokens.extend((seq.bonus, *d)[:a + 1])
            seq.bonus = int(g[a])
            want.append((a, seq.bonus))
            assert a >= good[q], "the reference rejected its own greedy continuation"
            s.caches.rollback_compressor_rings(seq.state_line, seq.position)
            ref_dspark.write_context_kv(s.model, s.caches, seq.state_line, p, aux[mine][:a + 1])
        # emulated: the caller's rows and caches, the greedy pick, the target streams
        s.ranks.load(rows, before, history)
        for tensors in s.ranks.tensors:
            tensors["tokens"][...] = 0
            tensors["tokens"][:rows.num_rows] = tokens
        s.ranks.run(rows.num_rows, roles={"head.rows_prep"})
        for t, layer in enumerate(cfg.dspark_target_layer_ids):
            padded = np.zeros((BUCKET, cfg.hc_mult, cfg.hidden_size), BF16)
            padded[:rows.num_rows] = streams[t]
            s.ranks.write("streams", padded)
            s.ranks.run(rows.num_rows, roles={"dspark.aux"}, layers={layer})
        for r in range(TP):
            got = s.ranks.read(r, "dspark.aux", BF16, (BUCKET, 3, cfg.hidden_size))
            assert np.array_equal(got[:rows.num_rows].view(np.uint16),
                                  aux.astype(BF16).view(np.uint16)), f"round {rnd} rank {r} aux"
        s.ranks.run(rows.num_rows, roles=DSPARK_ROLES)
        kvs = {}
        for spec in cfg.layers:
            if spec.is_dspark:
                s.ranks.run(rows.num_rows, roles={"dspark.context_kv"}, layers={spec.index})
                kvs[spec.index] = s.ranks.read(0, "dspark.kv", BF16, (BUCKET, cfg.head_dim))
        for r in range(TP):
            got = list(zip(s.ranks.read(r, "accepted", np.int32, (192,))[:2].tolist(),
                           s.ranks.read(r, "bonus", np.int64, (192,))[:2].tolist()))
            assert got == want, f"round {rnd} rank {r}: (accepted, bonus) {got}, reference {want}"
            for layer, ring in s.caches.ring.items():
                assert np.array_equal(s.ranks.tensors[r][f"compressor_ring_{layer}"].view(np.uint32),
                                      ring.view(np.uint32)), f"round {rnd} rank {r} ring {layer}"
        matched += _check_context(s, rows, before, [a for a, _ in want], kvs)
        _check_markov(s, seqs, rnd)
        accepted += [a for a, _ in want]
    # the comparison with write_context_kv's own records ran (rows whose kv matched bitwise)
    assert matched > 0, f"no context row matched the reference's kv bitwise ({accepted})"


# ---- the whole verify step ----------------------------------------------------------------------

LOGIT_BOUND = 0.25          # tests/test_emulate_step.py: emulated vs reference step logits


class WholeStep(EmulatedDSparkRanks):
    """Every stage module (the whole target forward) plus the DSpark stages, 4 emulated ranks."""

    def __init__(self, bundle_dir):
        from executor.wiring import STAGE_MODULES

        super().__init__(bundle_dir, TP, 2, STAGE_MODULES)
        for tensors in self.ranks.tensors:
            tensors["accepted"][...] = -1
            tensors["bonus"][...] = -1
        for plan in self.ranks.plans:
            plan.require_complete()         # the whole verify step is wired


@pytest.fixture(scope="module")
def whole(tiny_bundle_dir):
    return WholeStep(tiny_bundle_dir)


def _written(cache: np.ndarray) -> np.ndarray:
    return (cache != 0xFF).any(axis=1)


def test_whole_verify_steps_accept_what_the_reference_accepts(whole):
    """ROUNDS verify steps of 2 sequences through the whole wired step (caches carried by the
    emulated ranks from round to round) vs the reference's verify_and_accept per sequence:
    (accepted, bonus) equal on every rank, unless the reference's deciding row is a near tie
    (top-2 margin <= LOGIT_BOUND), after which that sequence is no longer compared; the draft
    stages' SWA slots written (context KV) and the ring rows rolled back (NaN) are the
    reference's."""
    s, cfg = whole, whole.cfg
    rng = np.random.default_rng()
    k = cfg.dspark_block_size
    seqs = [ref_dspark.start_sequence(s.model, s.caches, line, random_prompt(rng, 9 + 4 * line))[0]
            for line in range(2)]
    live, first, compared = [True, True], True, 0
    for rnd in range(ROUNDS):
        drafts = [_drafts(rng, s, q, k)[0] for q in seqs]
        rows = RowBatch.from_blocks(
            [RowBlock(q.state_line, q.position, (q.bonus, *d), "verify")
             for q, d in zip(seqs, drafts)], s.caches.block_tables, s.caches.ring_slots,
            pad_to=BUCKET)
        prior = [np.array(q.tokens + [q.bonus, *d], np.int64) for q, d in zip(seqs, drafts)]
        s.ranks.load(rows, s.caches if first else None, token_history(cfg, rows, prior))
        first = False
        s.ranks.run(rows.num_rows)
        for q, (seq, d) in enumerate(zip(seqs, drafts)):
            logits = ref_step.decode_step(
                s.model, RowBatch.from_blocks([RowBlock(seq.state_line, seq.position,
                                                        (seq.bonus, *d), "verify")],
                                              s.caches.block_tables, s.caches.ring_slots),
                s.caches.copy(), [np.array(seq.tokens, np.int64)]).logits
            a, emitted = ref_dspark.verify_and_accept(s.model, s.caches, seq, d)
            if not live[q]:
                continue
            for r in range(TP):
                got = (int(s.ranks.read(r, "accepted", np.int32, (192,))[q]),
                       int(s.ranks.read(r, "bonus", np.int64, (192,))[q]))
                if got != (a, emitted[-1]):
                    # The runs first part at row min(a, a'): one matched the draft there, the
                    # other did not (or picked another bonus): that row must be a near tie.
                    row = min(max(got[0], 0), a)
                    top2 = np.sort(logits[row].astype(np.float64))[-2:]
                    assert top2[1] - top2[0] <= LOGIT_BOUND, (
                        f"round {rnd} rank {r} seq {q}: emulated (accepted, bonus) {got}, "
                        f"reference {(a, emitted[-1])} at a top-2 margin {top2[1] - top2[0]}")
                    live[q] = False
            if live[q]:
                compared += 1
        for layer, ring in s.caches.ring.items():
            for q in (q for q in range(2) if live[q]):
                line = seqs[q].state_line
                for r in range(TP):
                    got = s.ranks.tensors[r][f"compressor_ring_{layer}"][line]
                    assert np.array_equal(np.isnan(got).all(axis=1), np.isnan(ring[line]).all(
                        axis=1)), f"round {rnd} rank {r} seq {q}: ring {layer} rollback"
        for spec in cfg.layers:
            if not spec.is_dspark:
                continue
            want = _written(s.caches.swa[spec.index])
            for q in range(2):
                if not live[q]:
                    continue
                line = seqs[q].state_line
                mine = slice(line * s.caches.ring_slots, (line + 1) * s.caches.ring_slots)
                for r in range(TP):
                    got = _written(s.ranks.tensors[r][f"swa_{spec.index}"][mine])
                    assert np.array_equal(got, want[mine]), (
                        f"round {rnd} rank {r} seq {q}: swa_{spec.index} context slots")
        if not all(live):
            # After a near-tie the emulated ranks accepted another length than the reference:
            # their caches (rolled back to their own count) no longer match the positions the
            # reference's next block starts at, so running further rounds would test nothing.
            break
    assert compared > 0, "no sequence was compared"
