"""kernels.allreduce on the host: the one-shot all-reduce's pushes, waits and epilogue, per rank.

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
    spec: ref.OneShotSpec
    args: dict
    generation: int

    def slots(self, space) -> list[np.ndarray]:
        """Views of the rows x width lanes this rank reads, one per source rank."""
        base = int(space.array(self.args["peers"], np.uint64, self.spec.world)[self.args["rank"]])
        shape = (self.args["rows"], self.spec.width)
        return [space.array(base + self.spec.slot_offset(self.generation, s), np.uint16, shape)
                for s in range(self.spec.world)]

    def missing(self, space) -> list[int]:
        return [s for s, slot in enumerate(self.slots(space))
                if np.any(slot == ref.SENTINEL_BITS)]

    def describe(self, space) -> str:
        return (f"rank {self.args['rank']} ({self.spec.name}, rows={self.args['rows']}, "
                f"generation {self.generation}) waits for rank(s) {self.missing(space)}")


def _spec_of(record) -> ref.OneShotSpec:
    s = record.spec or {}
    if not {"world", "width", "max_rows", "epilogue"} <= set(s):
        raise NoEmulator(f"kernels.allreduce: no emulator for kernel {record.name!r}")
    spec = ref.make_spec(s["world"], s["width"], s["epilogue"], s["max_rows"])
    if spec.name != record.name:
        raise NoEmulator(f"kernels.allreduce: kernel {record.name!r} is not the one-shot kernel "
                         f"its spec describes ({spec.name})")
    return spec


def waiting(space) -> list[str]:
    """The all-reduce launches of `space` still waiting for peers, described."""
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
    _push(spec, args, generation, space)
    pending[args["control"]] = _Waiting(spec, dict(args), generation)
    for ctl, w in list(pending.items()):
        if not w.missing(space):
            _complete(w, space)
            del pending[ctl]


def _push(spec: ref.OneShotSpec, args: dict, generation: int, space) -> None:
    """Store this rank's sanitized input into slot [generation][rank] of every rank's buffer."""
    rows, rank = args["rows"], args["rank"]
    data = ref.sanitize_ref(space.array(args["inp"], BF16, (rows, spec.width))).view(np.uint16)
    offset = spec.slot_offset(generation, rank)
    for s, base in enumerate(space.array(args["peers"], np.uint64, spec.world)):
        slot = space.array(int(base) + offset, np.uint16, (rows, spec.width))
        if np.any(slot != ref.SENTINEL_BITS):
            raise Deadlock(f"{spec.name} rank {rank}: slot [{generation}][{rank}] of rank {s}'s "
                           f"buffer still holds data: rank {s} has not consumed this rank's "
                           "previous push (a call missing on that rank?)")
        slot[...] = data


def _complete(w: _Waiting, space) -> None:
    """The poll succeeded everywhere: sum in rank order, epilogue, reset, flip the generation."""
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
    control[1] = 0
    control[0] = w.generation ^ 1


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
