"""Reference DSpark (k = 5) greedy speculative decoding for one sequence (model doc §4).

A round, for a sequence whose tokens 0..P-1 are in the caches and whose next token `bonus` (at
position P) is known but not yet run:

  draft    rows [bonus, noise x 4] at P..P+4 (kind "draft": non-causal inside the block) through
           the 3 DSpark stages (embed -> 4 streams -> stages chained with delayed mHC -> collapse
           with the last stage's FFN pre -> that stage's `norm` -> the shared `head`) = U [5, V];
           then the Markov head, sequentially: logit_i = U_i + markov_w2 · markov_w1[prev],
           d_{i+1} = split-vocab argmax, prev = d_{i+1} (prev starts at the anchor `bonus`).
  verify   target rows [bonus, d_1..d_5] at P..P+5 (causal): greedy g_j; accept d_{j+1} while it
           equals g_j; the new bonus is g at the first mismatch (or g_5): 1..6 tokens per round.
  accept   roll the ratio-2 compressor rings back to the accepted length P + a + 1 (stale SWA,
           compressed and index entries are overwritten before any row can see them), then write
           the draft stages' context KV for the accepted positions P..P+a:
           main_x = main_norm(main_proj([aux_37; aux_38; aux_39])) -> each stage's kv_norm(wkv) ->
           RoPE -> SWA (executor.reference.attention.insert_swa).

Greedy acceptance with batch-invariant arithmetic means DSpark emits exactly the tokens of plain
greedy decoding; only the number of target forwards changes. The optional confidence head is not
used (fixed k = 5, as vLLM's first pass).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from executor.reference import step as ref_step
from executor.reference.attention import insert_swa
from executor.reference.prefill import prefill
from executor.reference.rows import RowBatch, RowBlock
from kernels import head_ref


@dataclass
class DsparkSequence:
    """One sequence under DSpark: accepted tokens (all cached) and the pending bonus token."""

    state_line: int
    tokens: list[int]
    bonus: int

    @property
    def position(self) -> int:
        """Position of the bonus token (= number of cached tokens)."""
        return len(self.tokens)


@dataclass(frozen=True)
class RoundResult:
    drafts: tuple[int, ...]
    accepted: int            # drafts accepted (0..5); the round emits accepted + 1 tokens
    emitted: tuple[int, ...]
    verify_s: float
    draft_s: float


@dataclass
class GenerationResult:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)   # generated tokens, in order
    rounds: list[RoundResult] = field(default_factory=list)
    prefill_s: float = 0.0


def _stage_layers(cfg) -> range:
    return range(cfg.num_hidden_layers, cfg.num_layers_total)


def write_context_kv(model: ref_step.ReferenceModel, caches, state_line: int, first_position: int,
                     aux: np.ndarray) -> None:
    """Draft stages' SWA KV at positions first_position.. from the target's aux states [N, 3, D]."""
    cfg = model.cfg
    keep = min(aux.shape[0], cfg.sliding_window)  # older positions fall out of every draft window
    first_position += aux.shape[0] - keep
    aux = aux[aux.shape[0] - keep:]
    stage0 = model.ranks[0].layer(cfg.num_hidden_layers)
    projected = ref_step.bf16(model.float64.matmul_t(aux.reshape(keep, -1),
                                                     stage0.dense("main_proj")))
    main_x = ref_step.rms_norm(projected, stage0.vector("main_norm.weight"), cfg.rms_norm_eps)
    for start in range(0, keep, caches.ring_rows - 2):  # at most one block of rows per write
        n = min(caches.ring_rows - 2, keep - start)
        rows = RowBatch.from_blocks(
            [RowBlock(state_line, first_position + start, (0,) * n, "verify" if n > 1 else "decode")],
            caches.block_tables, caches.ring_slots)
        for layer in _stage_layers(cfg):
            insert_swa(model.ranks[0].layer(layer), main_x[start:start + n], rows, caches, cfg)


def draft_base_logits(model: ref_step.ReferenceModel, caches,
                      seq: DsparkSequence) -> list[np.ndarray]:
    """Per rank: base logits U [5, V_l] of the draft block [bonus, noise x 4] through the stages."""
    return draft_base_logits_many(model, caches, [seq])[0]


def draft_base_logits_many(model: ref_step.ReferenceModel, caches,
                           seqs: list[DsparkSequence]) -> list[list[np.ndarray]]:
    """draft_base_logits of every sequence of `seqs` in one batch of draft blocks: per sequence,
    per rank U [5, V_l]. Equal to one call per sequence (every sum of the reference is rounded
    once, independent of the batch; rows meet only their own sequence's caches), at one read of
    the weights instead of one per sequence."""
    cfg = model.cfg
    noise = (cfg.dspark_noise_token_id,) * (cfg.dspark_block_size - 1)
    rows = RowBatch.from_blocks([RowBlock(q.state_line, q.position, (q.bonus, *noise), "draft")
                                 for q in seqs], caches.block_tables, caches.ring_slots)
    state = ref_step.start_streams(ref_step.embed(model, rows.token_ids), cfg.hc_mult)
    for layer in _stage_layers(cfg):
        ref_step.run_layer(model, layer, state, rows, caches, history=None)
    last = cfg.num_layers_total - 1
    hidden = ref_step.finish(model, state, model.ranks[0].layer(last).vector("norm.weight"))
    logits = model.map_ranks(lambda rank: model.float64.matmul_t(hidden, rank.head), model.ranks)
    return [[part[rows.seq_rows(q)] for part in logits] for q in range(len(seqs))]


def markov_drafts(model: ref_step.ReferenceModel, base: list[np.ndarray], anchor: int) -> tuple[int, ...]:
    """Sequential Markov correction: d_{i+1} = argmax(U_i + markov_w2 · markov_w1[prev]), split-vocab."""
    last = model.cfg.num_layers_total - 1
    markov_w1 = model.ranks[0].layer(last).vector("markov_head.markov_w1.weight")
    markov_w2 = [rank.layer(last).vector("markov_head.markov_w2.weight") for rank in model.ranks]
    drafts, prev = [], int(anchor)
    for i in range(base[0].shape[0]):
        values, indices = [], []
        for r, rank in enumerate(model.ranks):
            logits = base[r][i:i + 1] + model.float64.matmul_t(markov_w1[prev][None, :],
                                                                markov_w2[r])
            v, idx = head_ref.local_argmax(logits, rank.vocab_offset)
            values.append(v)
            indices.append(idx)
        prev = int(head_ref.pick_across_ranks(np.stack(values), np.stack(indices))[0])
        drafts.append(prev)
    return tuple(drafts)


def draft(model: ref_step.ReferenceModel, caches, seq: DsparkSequence) -> tuple[int, ...]:
    """The 5 draft tokens after `seq.bonus` (base logits of the stages + the Markov head)."""
    return markov_drafts(model, draft_base_logits(model, caches, seq), seq.bonus)


def verify_and_accept(model: ref_step.ReferenceModel, caches, seq: DsparkSequence,
                      drafts: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """Target verify of [bonus, drafts]; updates `seq` and the caches. Returns (accepted, emitted)."""
    return verify_and_accept_many(model, caches, [seq], [drafts])[0][0]


def verify_and_accept_many(model: ref_step.ReferenceModel, caches, seqs: list[DsparkSequence],
                           drafts: list[tuple[int, ...]]):
    """verify_and_accept of every sequence in one target forward of their verify blocks (equal
    to one call per sequence, as draft_base_logits_many). Returns ([(accepted, emitted)] per
    sequence, the forward's StepOutput: sequence q's rows are RowBatch.seq_rows(q) of the
    blocks, in order)."""
    if len(seqs) != len(drafts):
        raise ValueError(f"{len(seqs)} sequences, {len(drafts)} draft blocks")
    rows = RowBatch.from_blocks([RowBlock(q.state_line, q.position, (q.bonus, *d), "verify")
                                 for q, d in zip(seqs, drafts)],
                                caches.block_tables, caches.ring_slots)
    out = ref_step.decode_step(model, rows, caches,
                               [np.array(q.tokens, np.int64) for q in seqs])
    results = []
    for i, (seq, d) in enumerate(zip(seqs, drafts)):
        mine = rows.seq_rows(i)
        target, p, block = out.tokens[mine], seq.position, (seq.bonus, *d)
        accepted = 0
        while accepted < len(d) and d[accepted] == target[accepted]:
            accepted += 1
        emitted = (*d[:accepted], int(target[accepted]))
        seq.tokens.extend(block[:accepted + 1])
        seq.bonus = emitted[-1]
        caches.rollback_compressor_rings(seq.state_line, seq.position)
        write_context_kv(model, caches, seq.state_line, p, out.aux[mine][:accepted + 1])
        results.append((accepted, emitted))
    return results, out


def start_sequence(model: ref_step.ReferenceModel, caches, state_line: int,
                   prompt) -> tuple[DsparkSequence, np.ndarray]:
    """Prefill the prompt, write its draft context KV; returns the sequence and the prompt logits."""
    result = prefill(model, caches, state_line, prompt)
    write_context_kv(model, caches, state_line, 0, result.aux)
    return DsparkSequence(state_line, [int(t) for t in prompt], result.next_token), result.logits


def generate(model: ref_step.ReferenceModel, caches, prompt, max_new_tokens: int,
             state_line: int = 0) -> GenerationResult:
    """Greedy DSpark decoding of at least `max_new_tokens` tokens (the last round may overshoot)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    result = GenerationResult(prompt=[int(t) for t in prompt])
    t0 = time.perf_counter()
    seq, _ = start_sequence(model, caches, state_line, prompt)
    result.prefill_s = time.perf_counter() - t0
    result.tokens.append(seq.bonus)
    while len(result.tokens) < max_new_tokens:
        t0 = time.perf_counter()
        drafts = draft(model, caches, seq)
        t1 = time.perf_counter()
        accepted, emitted = verify_and_accept(model, caches, seq, drafts)
        t2 = time.perf_counter()
        result.tokens.extend(emitted)
        result.rounds.append(RoundResult(drafts, accepted, emitted, t2 - t1, t1 - t0))
    return result
