"""kernels.dspark on the host: aux, accept, rollback, Markov, advance, history (dspark_ref.py)."""
from __future__ import annotations

import numpy as np

from executor.emulate import NoEmulator
from kernels import dspark_ref as ref
from kernels.common_ref import BF16


def _check(spec, record, grid, rows) -> None:
    if spec.name != record.name:
        raise NoEmulator(f"kernels.dspark: kernel {record.name!r} rebuilds as {spec.name!r}")
    if tuple(grid) != spec.grid(rows):
        raise ValueError(f"{spec.name}: launched with grid {tuple(grid)}, the kernel needs "
                         f"{spec.grid(rows)}")


def _aux(record, grid, args, space) -> None:
    s = record.spec
    spec = ref.make_aux_spec(s["width"], s["streams"], s["targets"])
    rows, target = args["rows"], args["target"]
    _check(spec, record, grid, rows)
    if not 0 <= target < spec.targets:
        raise ValueError(f"{spec.name}: target {target} outside 0..{spec.targets - 1} (the "
                         f"kernel would write another row's slot)")
    streams = space.array(args["streams"], BF16, (rows, spec.streams, spec.width))
    aux = space.array(args["aux"], BF16, (rows, spec.targets, spec.width))
    aux[:, target] = ref.aux_ref(streams)


def _seq_rows(space, args, rows):
    seq = space.array(args["seq_index"], np.int32, rows).copy()
    starts = np.count_nonzero((seq >= 0) & np.r_[True, seq[1:] != seq[:-1]])
    if starts != np.unique(seq[seq >= 0]).size:
        raise ValueError("kernels.dspark: the rows of a sequence must be adjacent in seq_index")
    return seq


def _check_blocks(spec, seq) -> None:
    first = ref.block_starts(seq)
    length = np.arange(seq.size) - first
    if np.any(length[seq >= 0] >= spec.max_block):
        raise ValueError(f"{spec.name}: a sequence has more than {spec.max_block} rows (the "
                         f"kernel scans back at most {spec.max_block - 1})")


def _accept(record, grid, args, space) -> None:
    spec = ref.make_accept_spec(record.spec["max_block"])
    rows = args["rows"]
    _check(spec, record, grid, rows)
    seq = _seq_rows(space, args, rows)
    _check_blocks(spec, seq)
    num_seqs = int(seq.max()) + 1 if (seq >= 0).any() else 0
    accepted, bonus, slots = ref.accept_ref(
        space.array(args["token_ids"], np.int64, rows), space.array(args["tokens"], np.int64, rows),
        seq, space.array(args["slot_mapping"], np.int64, rows), num_seqs)
    mine = np.unique(seq[seq >= 0])
    space.array(args["accepted"], np.int32, num_seqs)[mine] = accepted[mine]
    space.array(args["bonus"], np.int64, num_seqs)[mine] = bonus[mine]
    space.array(args["context_slots"], np.int64, rows)[...] = slots


def _rollback(record, grid, args, space) -> None:
    spec = ref.make_rollback_spec(record.spec["ring_rows"], record.spec["max_block"])
    rows = args["rows"]
    _check(spec, record, grid, rows)
    seq = _seq_rows(space, args, rows)
    _check_blocks(spec, seq)
    if not (seq >= 0).any():
        return
    num_seqs = int(seq.max()) + 1
    lines = space.array(args["state_lines"], np.int32, num_seqs)
    accepted = space.array(args["accepted"], np.int32, num_seqs)
    ring = space.array(args["ring"], np.float32, (int(lines[np.unique(seq[seq >= 0])].max()) + 1,
                                                  spec.ring_rows, ref.RING_WIDTH))
    ref.rollback_ref(ring, space.array(args["positions"], np.int64, rows), seq, lines, accepted)


def _markov(record, grid, args, space) -> None:
    s = record.spec
    spec = ref.make_markov_spec(s["vocab"], s["rank"], s["steps"])
    seqs, step = args["seqs"], args["step"]
    _check(spec, record, grid, seqs)
    if not 0 <= step <= spec.steps:
        raise ValueError(f"{spec.name}: step {step} outside 0..{spec.steps}")
    counter = space.array(args["counter"], np.int32, 1)
    if counter[0] != 0:
        raise ValueError(f"{spec.name}: counter is {counter[0]}, must be zero before a launch "
                         f"(zero the arena once; every launch leaves it zero)")
    prev = space.array(args["prev"], np.int64, seqs).copy()
    base = w1 = w2 = None
    if step < spec.steps:
        m = spec.rank
        w1 = {int(p): space.array(args["w1"] + int(p) * m * 2, BF16, m) for p in prev if p >= 0}
        base = space.array(args["base"], np.float32, (seqs * spec.steps, spec.vocab))
        w2 = space.array(args["w2"], BF16, (spec.vocab, m))
    pairs, written = ref.markov_ref(base, w1, w2, prev, step, spec.steps, args["vocab_offset"])
    out = space.array(args["pairs"], np.int32, (seqs, 2))
    for seq, pair in pairs.items():
        out[seq] = pair
    ids = space.array(args["ids"], np.int64, seqs * (spec.steps + 1))
    for row, token in written.items():
        ids[row] = token


ROW_ARRAYS = (("token_ids", np.int64), ("positions", np.int64), ("seq_index", np.int32),
              ("slot_mapping", np.int64), ("block_kind", np.int8))


def _advance(record, grid, args, space) -> None:
    s = record.spec
    spec = ref.make_advance_spec(s["steps"], s["to_verify"], s["noise_token"])
    seqs, ring_slots = args["seqs"], args["ring_slots"]
    _check(spec, record, grid, seqs)
    if ring_slots < 1:
        raise ValueError(f"{spec.name}: ring_slots {ring_slots} must be positive")
    rows = {name: space.array(args[name], dtype, seqs * spec.width) for name, dtype in ROW_ARRAYS}
    rows["context_lens"] = space.array(args["context_lens"], np.int64, seqs)
    ref.advance_ref(spec, rows, space.array(args["state_lines"], np.int32, seqs),
                    space.array(args["accepted"], np.int32, seqs),
                    space.array(args["bonus"], np.int64, seqs), ring_slots, seqs)


def _history(record, grid, args, space) -> None:
    s = record.spec
    spec = ref.make_history_spec(s["steps"], s["to_verify"], s["cols"], s["noise_token"])
    seqs = args["seqs"]
    _check(spec, record, grid, seqs)
    rows = seqs * (spec.steps + 1)          # the verify layout spans both layouts' rows
    ref.history_ref(spec, space.array(args["token_ids"], np.int64, rows),
                    space.array(args["token_history"], np.int64, (rows, spec.cols)),
                    space.array(args["accepted"], np.int32, seqs),
                    space.array(args["bonus"], np.int64, seqs), seqs)


_KINDS = {"aux": _aux, "accept": _accept, "rollback": _rollback, "markov": _markov,
          "advance": _advance, "history": _history}


def emulate(record, grid, args, space) -> None:
    kind = (record.spec or {}).get("kind")
    if kind not in _KINDS:
        raise NoEmulator(f"kernels.dspark: no emulator for kernel {record.name!r}")
    _KINDS[kind](record, grid, args, space)
