"""The DSpark round launches on pointers: aux, acceptance, rollback, Markov, row advance.

    aux_launch(bundle, spec, {streams, aux}, rows, target)
        streams bf16 [R, S, D] -> aux bf16 [R, T, D] at slot `target`
    accept_launch(bundle, spec, {token_ids, tokens, seq_index, slot_mapping, accepted, bonus,
                  context_slots}, rows)
        int64 [R] verify tokens and greedy picks -> accepted int32 [S], bonus int64 [S],
        context_slots int64 [R] (slot_mapping up to the accepted count, -1 past it)
    rollback_launch(bundle, spec, {ring, positions, seq_index, state_lines, accepted}, rows)
        NaN into the ring rows of rejected positions of one ratio-2 kv source
    markov_launch(bundle, spec, {base, w1, w2, prev, pairs, ids}, seqs, step, vocab_offset)
        Markov step `step` of every sequence: this rank's argmax pair, and prev into the next
        verify step's token_ids (step = k: only that copy)
    advance_launch(bundle, spec, {token_ids, positions, seq_index, slot_mapping, block_kind,
                   context_lens, state_lines, accepted, bonus}, seqs, ring_slots)
        the next step's rows (draft after a verify, verify after a draft) of `seqs` sequence
        slots, in place in the bound row tensors
    history_launch(bundle, spec, {token_ids, token_history, accepted, bonus}, seqs)
        the next step's Engram lookback (token_history) in place, before its row advance

Each returns one LaunchSpec (PDL on), allocates nothing (kernels/dspark_ref.py has the ABIs).
"""
from __future__ import annotations

from collections.abc import Mapping

from executor.launch import LaunchSpec
from kernels.dspark_ref import (
    AcceptSpec,
    AdvanceSpec,
    AuxSpec,
    HistorySpec,
    MarkovSpec,
    RollbackSpec,
)


def _pointers(spec, ptrs: Mapping[str, int], scalars: int = 1) -> list[int]:
    names = [name for name, _ in spec.params[:-scalars]]
    missing = [n for n in names if n not in ptrs]
    if missing:
        raise KeyError(f"{spec.name}: no pointer for {missing}")
    return [ptrs[n] for n in names]


def aux_launch(bundle, spec: AuxSpec, ptrs: Mapping[str, int], rows: int,
               target: int) -> LaunchSpec:
    if not 0 <= target < spec.targets:
        raise ValueError(f"{spec.name}: target slot {target} outside 0..{spec.targets - 1}")
    return LaunchSpec(bundle.kernel(spec.name), spec.grid(rows),
                      (*_pointers(spec, ptrs, 2), target, rows), pdl=True)


def accept_launch(bundle, spec: AcceptSpec, ptrs: Mapping[str, int], rows: int) -> LaunchSpec:
    return LaunchSpec(bundle.kernel(spec.name), spec.grid(rows), (*_pointers(spec, ptrs), rows),
                      pdl=True)


def rollback_launch(bundle, spec: RollbackSpec, ptrs: Mapping[str, int],
                    rows: int) -> LaunchSpec:
    return LaunchSpec(bundle.kernel(spec.name), spec.grid(rows), (*_pointers(spec, ptrs), rows),
                      pdl=True)


def markov_launch(bundle, spec: MarkovSpec, ptrs: Mapping[str, int], seqs: int, step: int,
                  vocab_offset: int) -> LaunchSpec:
    if not 0 <= step <= spec.steps:
        raise ValueError(f"{spec.name}: step {step} outside 0..{spec.steps}")
    return LaunchSpec(bundle.kernel(spec.name), spec.grid(seqs),
                      (*_pointers(spec, ptrs, 3), step, vocab_offset, seqs), pdl=True)


def advance_launch(bundle, spec: AdvanceSpec, ptrs: Mapping[str, int], seqs: int,
                   ring_slots: int) -> LaunchSpec:
    if isinstance(ring_slots, bool) or not isinstance(ring_slots, int) \
            or not 0 < ring_slots < 2**31:
        raise ValueError(f"{spec.name}: ring_slots {ring_slots!r} must be a positive u32")
    return LaunchSpec(bundle.kernel(spec.name), spec.grid(seqs),
                      (*_pointers(spec, ptrs, 2), ring_slots, seqs), pdl=True)


def history_launch(bundle, spec: HistorySpec, ptrs: Mapping[str, int], seqs: int) -> LaunchSpec:
    return LaunchSpec(bundle.kernel(spec.name), spec.grid(seqs), (*_pointers(spec, ptrs), seqs),
                      pdl=True)
