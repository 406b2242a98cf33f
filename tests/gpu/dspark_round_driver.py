"""DSpark k=5 rounds on DeviceRanks (TP ranks in lockstep on one GPU) checked against the reference.

The driver of tests/gpu/test_dspark_round.py (tiny) and tests/gpu/test_dspark_round_real_slice.py
(v41-flash layers 0-3 at real dimensions): the device twin of
tests/test_dspark_sync_free_emulated.py, with the checks of tests/test_dspark_round_emulated.py's
whole-verify test and of tests/test_dspark_draft_emulated.py. tests/gpu/device_ranks.py runs
every rank's wired plans (DeviceRanks.wire_dspark: decode_plan(dspark=True, sync_free=True) and
draft_plan(sync_free=True)) stage by stage on one stream; the cross-rank stages (all-reduces,
greedy picks, each Markov step's pick) run on the host between segments (their kernels:
tests/gpu/test_collectives.py).

`seqs` sequences (state lines 0..seqs-1) in a bucket of `slots` sequence slots (slots seqs..
are padding: `bonus` -1), ROUNDS rounds of: the draft step (head, the DSpark stages, base logits
U, 5 Markov steps writing the next verify rows' token_ids, their Engram lookback, the row
advance to the verify rows), then the verify step (the whole target forward, the pick,
device-side acceptance, the ratio-2 ring rollback, the draft stages' context KV at the accepted
positions, the draft rows' Engram lookback, the row advance to the next draft rows). The host
writes the rows once, before round 0 (their `token_history` included); afterwards nothing but,
in the SCRIPTED rounds, the drafts and their lookback (so that long accepted counts occur: the
synthetic drafter rarely matches the target). The reference follows the device's drafts: it
drafts with draft_base_logits / markov_drafts (for the comparison) and verifies the drafts the
device made, every sequence of a round in one batch (draft_base_logits_many,
verify_and_accept_many: equal to one call per sequence, at one read of the weights; that is what
keeps the real-dimension slice's reference inside its time budget).

`token_history` holds RAW token ids (the caller's binding; the Engram hash kernel maps every
history token, the row's own included, through the compressed-vocab map), so the lookback is
compared raw; the reference's decode_step maps the same ids through the same map
(ReferenceModel.vocab_map), whatever id of the vocabulary a Markov draft or a pick fed back.

Checked every round, on every rank:
- draft step: every rank wrote the same token_ids rows, row 0 the bonus, and the verify rows'
  `token_history` exactly the reference's lookback (dspark.history); U (`dspark.base`) within
  U_BOUND of the reference's; the 5 drafts equal markov_drafts(reference U) except at a near tie
  (test_dspark_draft_emulated's rule: the reference's Markov logits of the two tokens differ by
  no more than the U difference on those columns plus the Markov sum's rounding), after which
  that sequence's later drafts of the round are not compared; the rows are exactly
  RowBatch.from_blocks of the verify blocks [bonus, d_1..d_5] (advance_verify);
- verify step: (accepted, bonus) equal the reference's verify_and_accept of the same drafts,
  unless the reference's deciding row is a near tie (top-2 margin <= LOGIT_BOUND, the rule of
  test_dspark_round_emulated / sync_free); after such a tie the host reloads the reference's
  caches and rows (the device accepted another length: its caches no longer match) and the
  rounds go on; otherwise `tokens` holds each sequence's accepted drafts then its bonus at its
  first accepted + 1 verify rows (where a caller reads the round's tokens), the padding slots'
  `bonus` is still -1, the rows are exactly from_blocks of the next draft blocks
  (advance_draft), every ratio-2 ring row is NaN (rolled back) exactly where the reference's is,
  the draft stages' SWA slots written are the reference's, every rank holds the same bytes in
  every SWA cache, and the context KV is the reference's composition on the device's own aux
  (see _check_context: the device's aux comes from its own target forward, so it is not the
  reference's bitwise).
Over the run: at least half of the draft tokens and of the verify steps compared equal. A
SCRIPTED round exposes all 6 verify rows to a near tie (each row's argmax decides), so one parts
there more often than elsewhere (tiny, emulated: 2 of 6 scripted sequence-rounds, at top-2
margins of 0.0006 and 0.002): the accepted counts are printed, not asserted.
"""
from __future__ import annotations

import time

import numpy as np
from test_dspark_draft_emulated import _check_drafts, _record_bound
from test_dspark_round_emulated import _within

from executor.reference import attention as ra
from executor.reference import dspark as ref_dspark
from executor.reference import step as ref_step
from executor.reference.rows import RowBatch, RowBlock
from kernels import dense_ref as dr
from kernels import engram_ref
from kernels import kvrecord_ref as kr
from kernels.common_ref import BF16
from loader.formats import bf16_round

ROUNDS = 16
LOGIT_BOUND = 0.25          # test_dspark_round_emulated / sync_free: device vs reference logits
# U reads the context KV the device's own verify steps wrote from their aux, not the
# reference's caches as in test_dspark_draft_emulated (0.08 there, measured 0.017): the bound of
# logits computed over caches another implementation wrote (test_emulate_step's 0.25). The tiny
# round over emulated ranks measured 0.107 (docs/notes/step-wiring.md); a wrong draft forward is
# off by whole logits (|U| <= ~5). At real dimensions the same bound holds for the reason
# tests/gpu/test_step_real_slice.py gives for its logits (an fp32 reordering moves a BF16
# activation by 1 ulp; the head's dot products over D of them move a logit by ~0.01).
U_BOUND = 0.25
ROW_ARRAYS = (("token_ids", np.int64), ("positions", np.int64), ("seq_index", np.int32),
              ("slot_mapping", np.int64), ("block_kind", np.int8))


class DeviceRound:
    """The reference model and caches, DeviceRanks with the sync-free DSpark plans wired, and the
    run's tallies. `seqs` sequences in a bucket of `slots` sequence slots (default: seqs);
    `scripted`: round -> the greedy tokens leading each sequence's drafts that round."""

    def __init__(self, model, caches, ranks, seqs: int, slots: int | None = None,
                 scripted: dict | None = None):
        self.model, self.cfg, self.caches, self.ranks = model, model.cfg, caches, ranks
        self.tp, self.max_rows = ranks.tp, ranks.max_rows
        self.seqs, self.slots = seqs, seqs if slots is None else slots
        if not 1 <= self.seqs <= self.slots or caches.block_tables.shape[0] < seqs:
            raise ValueError(f"DeviceRound: {seqs} sequences in {self.slots} slots, "
                             f"{caches.block_tables.shape[0]} cache lines")
        self.scripted = dict(scripted or {})
        if any(len(goods) != seqs for goods in self.scripted.values()):
            raise ValueError(f"DeviceRound: a scripted round needs {seqs} greedy leads")
        self.verify, self.draft = ranks.wire_dspark(sync_free=True)
        self.k = self.cfg.dspark_block_size
        self.draft_equal = self.draft_total = self.verify_equal = 0
        self.accepted: list[int] = []
        self.ties: list[tuple] = []     # (round, seq, device's, reference's, top-2 margin)
        self.worst_u = 0.0
        self.launches = 0

    def summary(self, rounds: int = ROUNDS) -> str:
        return (f"{rounds} rounds x {self.seqs} sequences ({self.slots} slots): accepted "
                f"{self.accepted}, drafts equal {self.draft_equal}/{self.draft_total}, verify "
                f"equal {self.verify_equal}, near ties {self.ties}, worst U {self.worst_u}, "
                f"{self.launches} kernel launches")


def start_sequences(model, caches, seqs: int, rng, lengths=None) -> list:
    """Prefill `seqs` random prompts (lengths[line] tokens, default 9 + 4 line; ids below the
    vocabulary's last) on state lines 0..seqs-1: the reference sequences."""
    vocab = model.cfg.vocab_size
    lengths = [9 + 4 * line for line in range(seqs)] if lengths is None else list(lengths)
    if len(lengths) != seqs:
        raise ValueError(f"start_sequences: {len(lengths)} prompt lengths for {seqs} sequences")
    return [ref_dspark.start_sequence(model, caches, line,
                                      [int(t) for t in rng.integers(0, vocab - 1, n)])[0]
            for line, n in enumerate(lengths)]


def raw_lookback(cfg, rows: RowBatch, prior) -> np.ndarray:
    """[R, max_ngram] RAW ids at p-k of each row (the pad id where p-k < 0): what the caller's
    `token_history` holds in columns 1.. (the hash kernel maps them)."""
    raw = ref_step.ngram_lookback(rows, prior, cfg.engram_max_ngram_size)
    return engram_ref.ngram_history(raw, rows.positions, cfg.engram_max_ngram_size,
                                    cfg.engram_pad_token_id)


# ---- rows ---------------------------------------------------------------------------------------

def _blocks(s: DeviceRound, seqs, drafts=None) -> RowBatch:
    """The draft blocks [bonus, noise x (k - 1)] (drafts None) or the verify blocks."""
    if drafts is None:
        noise = (s.cfg.dspark_noise_token_id,) * (s.k - 1)
        blocks = [RowBlock(q.state_line, q.position, (q.bonus, *noise), "draft") for q in seqs]
    else:
        blocks = [RowBlock(q.state_line, q.position, (q.bonus, *d), "verify")
                  for q, d in zip(seqs, drafts)]
    return RowBatch.from_blocks(blocks, s.caches.block_tables, s.caches.ring_slots)


def _assert_rows(s: DeviceRound, want: RowBatch, what: str) -> None:
    """The bound rows on every rank are exactly `want`'s (its rows, its sequences)."""
    n = want.num_rows
    for r in range(s.tp):
        for name, dtype in ROW_ARRAYS:
            got = s.ranks.read(r, name, dtype, (s.max_rows,))[:n]
            assert np.array_equal(got, getattr(want, name)), (
                f"{what} rank {r}: {name} {got.tolist()}, want {getattr(want, name).tolist()}")
        got = s.ranks.read(r, "context_lens", np.int64, (s.max_rows,))[:want.num_seqs]
        assert np.array_equal(got, want.context_lens), f"{what} rank {r}: context_lens {got}"


def _assert_history(s: DeviceRound, want: np.ndarray, what: str) -> None:
    """The bound token_history rows on every rank are exactly `want` (the reference lookback)."""
    cols = s.cfg.engram_max_ngram_size - 1
    for r in range(s.tp):
        got = s.ranks.read(r, "token_history", np.int64, (s.max_rows, cols))[:want.shape[0]]
        assert np.array_equal(got, want), f"{what} rank {r}: token_history {got.tolist()}, " \
                                          f"want {want.tolist()}"


def _assert_committed(s: DeviceRound, drafts, accepted, seqs, rnd: int) -> None:
    """The round's committed tokens, where a caller reads them: tokens[s (k + 1) + j] for j <=
    accepted[s] are the accepted drafts, then the new bonus (every rank); the padding slots'
    bonus is still -1."""
    k = s.k
    for r in range(s.tp):
        got = s.ranks.read(r, "tokens", np.int64, (s.max_rows,))
        for q, (seq, d, a) in enumerate(zip(seqs, drafts, accepted)):
            assert got[q * (k + 1):q * (k + 1) + a + 1].tolist() == [*d[:a], seq.bonus], (
                f"round {rnd} rank {r} seq {q}: committed tokens")
        pad = s.ranks.read(r, "bonus", np.int64, (s.max_rows,))[s.seqs:s.slots]
        assert (pad == -1).all(), f"round {rnd} rank {r}: a padding slot's bonus {pad.tolist()}"


def _load(s: DeviceRound, seqs) -> None:
    """The host's full write: the reference's caches, the draft rows, the sequences' bonus (-1
    in the padding slots)."""
    rows = _blocks(s, seqs)
    prior = [np.array(q.tokens + list(rows.token_ids[i * s.k:(i + 1) * s.k]), np.int64)
             for i, q in enumerate(seqs)]
    s.ranks.load(rows, s.caches, raw_lookback(s.cfg, rows, prior))
    bonus = np.full(s.slots, -1, np.int64)
    bonus[:s.seqs] = [q.bonus for q in seqs]
    s.ranks.write("bonus", bonus)


# ---- the draft step -----------------------------------------------------------------------------

def _check_draft_step(s: DeviceRound, seqs, rnd: int) -> list[tuple[int, ...]]:
    """The device's drafts per sequence, checked against the reference's (module docstring).
    The reference's draft_base_logits writes its draft rows' SWA records, as the device did."""
    k, vocab_l = s.k, s.cfg.vocab_size // s.tp
    ids = [s.ranks.read(r, "token_ids", np.int64, (s.max_rows,)) for r in range(s.tp)]
    rows = s.slots * k
    emu = [s.ranks.read(r, "dspark.base", np.float32, (rows, vocab_l)) for r in range(s.tp)]
    bases = ref_dspark.draft_base_logits_many(s.model, s.caches, seqs)
    out = []
    for q, (seq, ref_base) in enumerate(zip(seqs, bases)):
        mine = ids[0][q * (k + 1):(q + 1) * (k + 1)]
        for r in range(s.tp):
            assert np.array_equal(ids[r][q * (k + 1):(q + 1) * (k + 1)], mine), (
                f"round {rnd} seq {q}: rank {r} drafted other tokens than rank 0")
        assert mine[0] == seq.bonus, f"round {rnd} seq {q}: verify row 0 is not the bonus"
        emu_base = [e[q * k:(q + 1) * k] for e in emu]
        for r in range(s.tp):
            err = float(np.abs(emu_base[r].astype(np.float64) - ref_base[r]).max())
            s.worst_u = max(s.worst_u, err)
            assert err <= U_BOUND, f"round {rnd} seq {q} rank {r}: U off by {err} > {U_BOUND}"
        want = ref_dspark.markov_drafts(s.model, ref_base, seq.bonus)
        drafts = tuple(int(t) for t in mine[1:])
        s.draft_equal += _check_drafts(s.model, list(drafts), want, ref_base, emu_base,
                                       seq.bonus)
        s.draft_total += k
        out.append(drafts)
    return out


def _greedy(s: DeviceRound, seqs, goods) -> list[list[int]]:
    """The next goods[q] greedy tokens after each sequence's bonus, by plain decode steps of
    the sequences still wanting one, batched (on a copy of the caches)."""
    caches = s.caches.copy()
    tokens = [list(q.tokens) + [q.bonus] for q in seqs]
    for i in range(max(goods)):
        active = [q for q, good in enumerate(goods) if good > i]
        rows = RowBatch.from_blocks([RowBlock(seqs[q].state_line, len(tokens[q]) - 1,
                                              (tokens[q][-1],), "decode") for q in active],
                                    caches.block_tables, caches.ring_slots)
        out = ref_step.decode_step(s.model, rows, caches,
                                   [np.array(tokens[q][:-1], np.int64) for q in active])
        for j, q in enumerate(active):
            tokens[q].append(int(out.tokens[j]))
    return [t[len(q.tokens) + 1:] for q, t in zip(seqs, tokens)]


def _script(s: DeviceRound, seqs, goods, rng) -> list[tuple[int, ...]]:
    """Drafts led by `good` greedy tokens (then random ones), written over the device's."""
    k = s.k
    drafts = []
    for lead, good in zip(_greedy(s, seqs, goods), goods):
        noise = [int(t) for t in rng.integers(0, s.cfg.vocab_size - 1, k - good)]
        drafts.append(tuple(lead + noise))
    ids = s.ranks.read(0, "token_ids", np.int64, (s.seqs * (k + 1),))
    for q, d in enumerate(drafts):
        ids[q * (k + 1) + 1:(q + 1) * (k + 1)] = d
    s.ranks.write("token_ids", ids)
    return drafts


# ---- the verify step ----------------------------------------------------------------------------

def _check_verify(s: DeviceRound, seqs, drafts, rnd: int, goods=None) -> list[int] | None:
    """The device's (accepted, bonus) vs the reference's verify_and_accept per sequence: the
    accepted counts, or None after a near tie where they differ (module docstring). goods: the
    scripted drafts' greedy lead per sequence, which the reference accepts."""
    accepted = [s.ranks.read(r, "accepted", np.int32, (s.max_rows,))[:s.seqs]
                for r in range(s.tp)]
    bonus = [s.ranks.read(r, "bonus", np.int64, (s.max_rows,))[:s.seqs] for r in range(s.tp)]
    same, counts = True, []
    results, out = ref_dspark.verify_and_accept_many(s.model, s.caches, seqs, drafts)
    k = s.k
    for q, (a, emitted) in enumerate(results):
        counts.append(a)
        if goods is not None:
            assert a >= goods[q], f"round {rnd} seq {q}: the reference rejected its own greedy"
        mismatch, logits = False, out.logits[q * (k + 1):(q + 1) * (k + 1)]
        for r in range(s.tp):
            got = (int(accepted[r][q]), int(bonus[r][q]))
            if got == (a, emitted[-1]):
                continue
            row = min(max(got[0], 0), a)    # where the two runs first part: must be a near tie
            top2 = np.sort(logits[row].astype(np.float64))[-2:]
            assert top2[1] - top2[0] <= LOGIT_BOUND, (
                f"round {rnd} rank {r} seq {q}: device (accepted, bonus) {got}, reference "
                f"{(a, emitted[-1])} at a top-2 margin {top2[1] - top2[0]}")
            if not mismatch:
                s.ties.append((rnd, q, got, (a, emitted[-1]), float(top2[1] - top2[0])))
            mismatch = True
        if mismatch:
            same = False
        else:
            s.verify_equal += 1
            s.accepted.append(a)
    return counts if same else None


def _check_context(s: DeviceRound, rows: RowBatch, accepted, rnd: int) -> None:
    """The context KV from the device's own aux (test_dspark_round_emulated's _check_context
    rules, on the device's intermediate buffers): main_proj within 2 x dense_tolerance of
    bf16(aux · main_projᵀ), main_x bitwise rms_norm of it, on every rank (once per distinct
    (aux, main_proj, main_x) bytes: the ranks compute them alike); per DSpark stage, the
    records at the accepted rows' slots: the last stage's (its kv is still in `dspark.kv`) kv
    within 2 x dense_tolerance of wkv(main_x) and its records bitwise the reference composition
    (kv_norm, RoPE, encode) on that kv; the other stages' records within two E4M3 steps
    (test_dspark_draft_emulated's _record_bound: the encoding's rounding, and a kv within bf16
    ulps of wkv(main_x)) of the composition on wkv(main_x)."""
    cfg, n, d = s.cfg, rows.num_rows, s.cfg.hidden_size
    targets = len(cfg.dspark_target_layer_ids)
    first = s.model.ranks[0].layer(cfg.num_hidden_layers)
    slots = np.full(n, -1, np.int64)
    for q, a in enumerate(accepted):
        mine = rows.seq_rows(q)[:a + 1]
        slots[mine] = rows.slot_mapping[mine]
    keep = slots >= 0
    checked = []                # (aux, raw, x) bytes already checked: the ranks' usually agree
    for r in range(s.tp):
        aux = s.ranks.read(r, "dspark.aux", BF16, (n, targets * d))
        raw = s.ranks.read(r, "dspark.main_raw", BF16, (n, d))
        x = s.ranks.read(r, "dspark.main_x", BF16, (n, d))
        key = aux.tobytes() + raw.tobytes() + x.tobytes()
        if r == 0:
            main_x = x.astype(np.float32)       # rank 0's: its records are read below
        if key in checked:
            continue
        checked.append(key)
        aux = aux.astype(np.float32)
        w = first.dense("main_proj")
        _within(raw, bf16_round(s.model.float64.matmul_t(aux, w)),
                2 * dr.dense_tolerance(aux, w, "bf16"), f"round {rnd} rank {r}: main_proj")
        norm = ref_step.rms_norm(raw.astype(np.float32), first.vector("main_norm.weight"),
                                 cfg.rms_norm_eps)
        assert np.array_equal(x.astype(np.float32), norm), f"round {rnd} rank {r}: main_x"
    stages = [spec.index for spec in cfg.layers if spec.is_dspark]
    for layer in stages:
        lw = s.model.ranks[0].layer(layer)
        kv = ra._linear(main_x, lw, "attn.wkv")
        if layer == stages[-1]:
            got_kv = s.ranks.read(0, "dspark.kv", BF16, (n, cfg.head_dim))
            _within(got_kv, kv, 2 * dr.dense_tolerance(main_x, ra._weight(lw, "attn.wkv"),
                                                       "bf16"), f"round {rnd}: layer {layer} kv")
            kv = got_kv.astype(np.float32)
        y = ra._norm(kv.astype(np.float32), lw.vector("attn.kv_norm.weight"), cfg.rms_norm_eps)
        want = kr.encode_kv_record(bf16_round(ra._rope(y[keep], rows.positions[keep],
                                                       ra.rope_for(cfg, 0))))
        swa = s.caches.swa[layer]
        got = s.ranks.read(0, f"swa_{layer}", swa.dtype, swa.shape)[slots[keep]]
        if layer == stages[-1]:
            assert np.array_equal(got, want), f"round {rnd}: swa_{layer} context records"
            continue
        mine, ref = kr.decode_kv_record(got), kr.decode_kv_record(want)
        err = np.abs(mine - ref)
        bound = _record_bound(np.maximum(np.abs(mine), np.abs(ref)))
        assert (err <= bound).all(), (f"round {rnd}: swa_{layer} context record of row "
                                      f"{np.argwhere(err > bound)[0].tolist()} off")


def _written(cache: np.ndarray) -> np.ndarray:
    return (cache != 0xFF).any(axis=1)


def _check_caches(s: DeviceRound, seqs, rnd: int) -> None:
    """Ring rollback, the draft stages' context slots, replicated SWA bytes (module docstring)."""
    for layer, ring in s.caches.ring.items():
        for r in range(s.tp):
            got = s.ranks.read(r, f"compressor_ring_{layer}", ring.dtype, ring.shape)
            for q in seqs:
                line = q.state_line
                assert np.array_equal(np.isnan(got[line]).all(axis=1),
                                      np.isnan(ring[line]).all(axis=1)), (
                    f"round {rnd} rank {r} line {line}: ring {layer} rollback")
    stages = {spec.index for spec in s.cfg.layers if spec.is_dspark}
    for layer, swa in s.caches.swa.items():
        got = [s.ranks.read(r, f"swa_{layer}", swa.dtype, swa.shape) for r in range(s.tp)]
        for r in range(1, s.tp):
            assert np.array_equal(got[r], got[0]), f"round {rnd}: swa_{layer} rank {r} != rank 0"
        if layer not in stages:
            continue
        for q in seqs:
            mine = slice(q.state_line * s.caches.ring_slots,
                         (q.state_line + 1) * s.caches.ring_slots)
            assert np.array_equal(_written(got[0][mine]), _written(swa[mine])), (
                f"round {rnd} line {q.state_line}: swa_{layer} context slots")


# ---- the rounds ---------------------------------------------------------------------------------

def run_rounds(s: DeviceRound, seqs, rng, rounds: int = ROUNDS,
               deadline: float | None = None) -> None:
    """`rounds` DSpark rounds of the reference sequences `seqs` (start_sequences') on s.ranks,
    checked as the module docstring says. `deadline` (time.perf_counter()): a round that would
    start after it fails the run instead (a test's time budget, kept for the whole suite)."""
    cfg, k = s.cfg, s.k
    if len(seqs) != s.seqs:
        raise ValueError(f"run_rounds: {len(seqs)} sequences for a DeviceRound of {s.seqs}")
    _load(s, seqs)                          # the host's row write: the first draft step's rows
    for rnd in range(rounds):
        assert deadline is None or time.perf_counter() < deadline, (
            f"over the time budget after {rnd} of {rounds} rounds: {s.summary(rnd)}")
        s.launches += s.ranks.run_plans(s.draft, s.slots * k)
        drafts = _check_draft_step(s, seqs, rnd)
        rows = _blocks(s, seqs, drafts)
        _assert_rows(s, rows, f"round {rnd} verify rows")
        if rnd in s.scripted:
            drafts = _script(s, seqs, s.scripted[rnd], rng)
            rows = _blocks(s, seqs, drafts)
        prior = [np.array(q.tokens + [q.bonus, *d], np.int64) for q, d in zip(seqs, drafts)]
        history = raw_lookback(cfg, rows, prior)[:, 1:]
        if rnd in s.scripted:               # the host's drafts: their lookback is the host's too
            s.ranks.write("token_history", history)
        _assert_history(s, history, f"round {rnd} verify rows")
        s.launches += s.ranks.run_plans(s.verify, s.slots * (k + 1))
        accepted = _check_verify(s, seqs, drafts, rnd, s.scripted.get(rnd))
        if accepted is not None:
            _assert_committed(s, drafts, accepted, seqs, rnd)
            _assert_rows(s, _blocks(s, seqs), f"round {rnd} draft rows")
            _check_caches(s, seqs, rnd)
            _check_context(s, rows, accepted, rnd)
        else:
            _load(s, seqs)                  # a near tie parted them: the reference's state
    total = rounds * s.seqs
    assert s.draft_equal >= s.draft_total // 2, (
        f"only {s.draft_equal} of {s.draft_total} draft tokens equal (worst U {s.worst_u})")
    assert s.verify_equal >= total // 2, f"only {s.verify_equal} of {total} verify steps equal"
