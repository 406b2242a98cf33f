"""kernels.allreduce on the host: the one-shot all-reduce and the cross-rank pick, per rank.

On the GPU the ranks' launches run at once: each pushes its (sanitized) input into slot
[gen][rank] of every rank's receive buffer, then polls its own slots [gen][0..world). Launches
emulated one after another cannot poll, so a launch here is split at the wait, exactly where the
kernel splits it:
- push: at once, the bytes the kernel stores into the peers' buffers (through `peers`, the same
  addresses the GPU uses: all ranks' buffers live in one AddressSpace);
- completion: as soon as every slot it reads holds data (no -0.0 lane), which is when the last
  rank's push lands: the rank-ordered sum (`allreduce_ref`), out written, its slots reset to
  -0.0, control's generation flipped and its arrival count left at 0, as the last CTA leaves
  them. Until then the launch is *waiting* and its out is unwritten.
The cross-rank pick (`allreduce_pick_*`) rides on the same buffers, control and generations: its
push is one u64 key per row (`ordered_key` of the lm_head pairs), its completion `pick_ref` over
the keys read back, tokens int64 [rows] written, the generation flipped (no arrival count).
The all-gather (`allreduce_gather_*`) pushes its [rows, C] block packed at the slot's start; its
completion writes the slots side by side into out [rows, world * C] (`gather_ref`).
The wait itself always succeeds (no timeout is modelled: status and control[2] are never
written); a launch on a rank whose control says failed is refused.

`run_ranks` runs one launch list per rank as the GPUs would: each rank runs until one of its
all-reduces waits, then the next rank, and a rank resumes when its all-reduce completed; ranks
that can never complete (a rank missing a call, or calling with other rows) raise `Deadlock`.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from executor.emulate import NoEmulator, emulate_launch, record_of
from kernels import allreduce_ref as ref
from kernels.common_ref import BF16

# space -> {control address: the launch waiting for its peers}
_WAITING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Deadlock(RuntimeError):
    """Emulated ranks wait on all-reduces that no remaining launch can complete."""


@dataclass(frozen=True)
class _Waiting:
    """A launch past its push, before its poll succeeded: what it reads and how it finishes."""

    spec: ref.OneShotSpec | ref.PickSpec | ref.GatherSpec
    args: dict
    generation: int

    @property
    def pick(self) -> bool:
        return isinstance(self.spec, ref.PickSpec)

    @property
    def lanes(self) -> int:
        """bf16 lanes per row in a slot (all-reduce: the width; all-gather: C)."""
        return self.spec.cols if isinstance(self.spec, ref.GatherSpec) else self.spec.width

    def slots(self, space) -> list[np.ndarray]:
        """Views of what this rank polls, one per source rank: rows x width bf16 lanes (as
        uint16), or one u64 key per row for the pick."""
        base = int(space.array(self.args["peers"], np.uint64, self.spec.world)[self.args["rank"]])
        rows = self.args["rows"]
        dtype, shape = (np.uint64, rows) if self.pick else (np.uint16, (rows, self.lanes))
        return [space.array(base + _slot_offset(self.spec, self.generation, s), dtype, shape)
                for s in range(self.spec.world)]

    def missing(self, space) -> list[int]:
        sentinel = ref.PICK_SENTINEL if self.pick else ref.SENTINEL_BITS
        return [s for s, slot in enumerate(self.slots(space)) if np.any(slot == sentinel)]

    def describe(self, space) -> str:
        return (f"rank {self.args['rank']} ({self.spec.name}, rows={self.args['rows']}, "
                f"generation {self.generation}) waits for rank(s) {self.missing(space)}")


def _slot_offset(spec, generation: int, source: int) -> int:
    return (generation * spec.world + source) * spec.slot_bytes


def _spec_of(record) -> ref.OneShotSpec | ref.PickSpec:
    s = record.spec or {}
    if not {"world", "width", "max_rows"} <= set(s):
        raise NoEmulator(f"kernels.allreduce: no emulator for kernel {record.name!r}")
    if s.get("kind") == "pick":
        spec = ref.make_pick_spec(s["world"], s["width"], s["max_rows"])
    elif s.get("kind") == "gather":
        spec = ref.make_gather_spec(s["world"], s["width"], s["cols"], s["max_rows"])
    elif "epilogue" in s:
        spec = ref.make_spec(s["world"], s["width"], s["epilogue"], s["max_rows"])
    else:
        raise NoEmulator(f"kernels.allreduce: no emulator for kernel {record.name!r}")
    if spec.name != record.name:
        raise NoEmulator(f"kernels.allreduce: kernel {record.name!r} is not the kernel its spec "
                         f"describes ({spec.name})")
    return spec


def waiting(space) -> list[str]:
    """The all-reduce / pick launches of `space` still waiting for peers, described."""
    return [w.describe(space) for w in _WAITING.get(space, {}).values()]


def is_waiting(space, control: int) -> bool:
    return control in _WAITING.get(space, {})


def emulate(record, grid, args, space) -> None:
    spec = _spec_of(record)
    rank, rows = args["rank"], args["rows"]
    spec.grid(rows)                                       # rows within the slot capacity
    if not 0 <= rank < spec.world:
        raise ValueError(f"{spec.name}: rank {rank} outside 0..{spec.world - 1}")
    control = space.array(args["control"], np.uint32, ref.CONTROL_WORDS)
    generation, failed = int(control[0]), int(control[2])
    if failed or generation >= ref.GENERATIONS:
        raise ValueError(f"{spec.name} rank {rank}: control at {space.name_of(args['control'])} "
                         f"holds generation {generation}, failed {failed}: a failed or "
                         f"uninitialised all-reduce (the emulator models no timeout)")
    pending = _WAITING.setdefault(space, {})
    if args["control"] in pending:
        raise Deadlock(f"{spec.name} rank {rank}: launched while its previous all-reduce still "
                       f"waits ({pending[args['control']].describe(space)}); on a GPU it "
                       "would not have started: emulate the ranks with run_ranks")
    w = _Waiting(spec, dict(args), generation)
    _push(w, space)
    pending[args["control"]] = w
    for ctl, w in list(pending.items()):
        if not w.missing(space):
            _complete(w, space)
            del pending[ctl]


def _push(w: _Waiting, space) -> None:
    """Store this rank's data into slot [generation][rank] of every rank's buffer: the
    sanitized input, or the pick's u64 key per row."""
    spec, rows, rank = w.spec, w.args["rows"], w.args["rank"]
    if w.pick:
        data = ref.ordered_key(space.array(w.args["pairs"], np.int32, (rows, 2)))
    else:
        data = ref.sanitize_ref(space.array(w.args["inp"], BF16, (rows, w.lanes)))
    data = data.view(np.uint16)
    offset = _slot_offset(spec, w.generation, rank)
    for s, base in enumerate(space.array(w.args["peers"], np.uint64, spec.world)):
        slot = space.array(int(base) + offset, np.uint16, data.shape)
        if np.any(slot != ref.SENTINEL_BITS):
            raise Deadlock(f"{spec.name} rank {rank}: slot [{w.generation}][{rank}] of rank "
                           f"{s}'s buffer still holds data: rank {s} has not consumed this "
                           "rank's previous push (a call missing on that rank?)")
        slot[...] = data


def _complete(w: _Waiting, space) -> None:
    if w.pick:
        _complete_pick(w, space)
    elif isinstance(w.spec, ref.GatherSpec):
        _complete_gather(w, space)
    else:
        _complete_sum(w, space)


def _complete_gather(w: _Waiting, space) -> None:
    """The polls succeeded: the slots side by side into out, reset, flip the generation."""
    slots = w.slots(space)
    out = ref.gather_ref([slot.view(BF16).copy() for slot in slots])
    for slot in slots:
        slot[...] = ref.SENTINEL_BITS
    space.array(w.args["out"], BF16, out.shape)[...] = out
    control = space.array(w.args["control"], np.uint32, ref.CONTROL_WORDS)
    control[1] = 0
    control[0] = w.generation ^ 1


def _complete_sum(w: _Waiting, space) -> None:
    """The polls succeeded: sum in rank order, epilogue, reset, flip the generation."""
    args, rows, width = w.args, w.args["rows"], w.spec.width
    slots = w.slots(space)
    inputs = [slot.view(BF16).copy() for slot in slots]
    if w.spec.epilogue == "residual":
        residual = space.array(args["residual"], BF16, (rows, width)).copy()
        out = ref.allreduce_residual_ref(inputs, residual)
    else:
        out = ref.allreduce_ref(inputs)
    for slot in slots:
        slot[...] = ref.SENTINEL_BITS
    space.array(args["out"], BF16, (rows, width))[...] = out
    control = space.array(args["control"], np.uint32, ref.CONTROL_WORDS)
    control[1] = 0                                    # the last CTA's arrival count, reset
    control[0] = w.generation ^ 1


def _pairs_of_keys(keys: np.ndarray) -> np.ndarray:
    """int32 [rows, 2] (f32 bits, index) whose `ordered_key` is `keys` (-0 comes back as +0,
    which orders the same)."""
    ordered = (keys >> np.uint64(32)).astype(np.uint32)
    bits = np.where(ordered & np.uint32(0x80000000), ordered ^ np.uint32(0x80000000), ~ordered)
    index = ~(keys & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    return np.stack([bits.view(np.int32), index.view(np.int32)], axis=1)


def _complete_pick(w: _Waiting, space) -> None:
    """The polls succeeded: the greedy pick over the ranks' keys, reset, flip the generation
    (the pick's single CTA does not count arrivals)."""
    slots = w.slots(space)
    tokens = ref.pick_ref([_pairs_of_keys(slot.copy()) for slot in slots])
    for slot in slots:
        slot[...] = np.uint64(ref.PICK_SENTINEL)
    space.array(w.args["tokens"], np.int64, w.args["rows"])[...] = tokens
    space.array(w.args["control"], np.uint32, ref.CONTROL_WORDS)[0] = w.generation ^ 1


def _control_of(launch) -> int | None:
    rec = record_of(launch.kernel)
    if rec.family != "kernels.allreduce":
        return None
    return dict(zip((name for name, _ in rec.params), launch.args))["control"]


def run_ranks(rank_launches: Sequence[Sequence], space) -> int:
    """Emulate one launch list per rank, interleaved at the all-reduces; returns launches run."""
    lists = [list(launches) for launches in rank_launches]
    cursor = [0] * len(lists)
    blocked: list[int | None] = [None] * len(lists)
    count, progress = 0, True
    while progress:
        progress = False
        for r, launches in enumerate(lists):
            if blocked[r] is not None:
                if is_waiting(space, blocked[r]):
                    continue
                blocked[r] = None
            while cursor[r] < len(launches):
                launch = launches[cursor[r]]
                emulate_launch(launch, space)
                cursor[r] += 1
                count += 1
                progress = True
                control = _control_of(launch)
                if control is not None and is_waiting(space, control):
                    blocked[r] = control
                    break
    stuck = [r for r, b in enumerate(blocked) if b is not None and is_waiting(space, b)]
    if stuck:
        raise Deadlock(f"launch lists of rank(s) {stuck} cannot finish: "
                       + "; ".join(waiting(space)))
    return count
