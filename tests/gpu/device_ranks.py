"""All TP ranks of the wired step on ONE GPU, in one process: the device twin of EmulatedRanks.

Each rank gets its own Arena (weights packed by the stage modules, zeroed first) and its own CuPy
copy of every caller tensor, like executor.emulate.ranks.EmulatedRanks on the host. The stages run
in lockstep on one stream: every rank's launches of stage i, then stage i + 1. The cross-rank
stages cannot run as kernels here (a one-shot all-reduce spins until its peers push, and four
ranks on one stream would wait forever), so they run on the host between segments: synchronize,
read the ranks' inputs, apply exactly what the kernel computes (allreduce_ref, gather_ref,
gather_pieces_ref, pick_ref), write the outputs. The collective kernels themselves are tested
across processes
(tests/gpu/test_collectives.py). What this proves on the GPU: every other kernel of the step,
launched by the step's own wiring on the step's own buffers, computes what the reference step
computes. Weights come from an open checkpoint, or packed by the caller (`PackedRanks`).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from collectives.oneshot import CollectiveState
from executor.bind import CacheGeometry
from executor.emulate.ranks import caller_tensors, fill_caller_tensors
from executor.plan import Plan, decode_plan, draft_plan
from executor.runtime import Arena
from executor.wiring import STAGE_MODULES, StepContext, arena_contents, wire
from kernels import allreduce_ref as ar
from kernels import engram_kernel_ref as ek
from kernels.common_ref import BF16

COLLECTIVES = "executor.stages.collectives"
HOST_ROLES = {
    "head.embed_allreduce": ("sum", "embed.partial", "embed.out"),
    "attn.allreduce": ("sum", "attn.partial", "attn.out"),
    "ffn.allreduce": ("sum", "ffn.partial", "ffn.out"),
    "engram.heads_allgather": ("gather", "engram.local_heads", "engram.heads"),
    "engram.kv_allgather": ("gather_pieces", "engram.kv_local", "engram.kv"),
    "tail.argmax_pick": ("pick", "pick", "tokens"),
}
COLLECTIVE_FAMILY = "kernels.allreduce"         # the cross-rank kernels: never launched here


@dataclass(frozen=True)
class PackedRanks:
    """Every rank's arena contents, packed by the caller (tests/real_slice.py packs the ranks
    of a real-dimension slice in parallel, with its own FFN module): contents[rank] =
    wiring.arena_contents(cfg, tp, rank, fetch, max_rows, modules) = (requests, uploads)."""

    cfg: object
    modules: tuple[str, ...]
    contents: tuple

    def __post_init__(self):
        if COLLECTIVES in self.modules:
            raise ValueError(f"PackedRanks: {COLLECTIVES} cannot run on one stream (the "
                             f"cross-rank stages run on the host here)")


class DeviceRanks:
    """`tp` ranks of one step on one device (tests only: the collectives are host-side)."""

    def __init__(self, dev, ckpt, bundle, tp: int, caches, stream, max_rows: int = 192,
                 dspark: bool = False, packed: PackedRanks | None = None):
        """ckpt: an open checkpoint, each rank packed here by the step's stage modules; or None
        and `packed`, each rank's contents packed by the caller."""
        import cupy as cp

        if (ckpt is None) == (packed is None):
            raise ValueError("DeviceRanks: give exactly one of ckpt and packed")
        if packed is not None and len(packed.contents) != tp:
            raise ValueError(f"DeviceRanks: {len(packed.contents)} packed ranks for tp={tp}")
        self.cp, self.stream = cp, stream
        self.cfg = ckpt.config if packed is None else packed.cfg
        self.tp, self.max_rows = tp, max_rows
        self.dspark = dspark            # bind `accepted` / `bonus`; plans: decode_plan(dspark=)
        self.geometry = CacheGeometry.of(caches)
        modules = (tuple(m for m in STAGE_MODULES if m != COLLECTIVES) if packed is None
                   else packed.modules)
        self.arenas, self.tensors, self.contexts, self.plans = [], [], [], []
        for rank in range(tp):
            requests, uploads = (packed.contents[rank] if packed is not None else
                                 _checkpoint_contents(ckpt, tp, rank, max_rows, modules))
            arena = Arena(dev, requests)
            arena.zero()
            for name, array in uploads:
                arena.upload(name, array)
            del uploads
            host = caller_tensors(self.cfg, tp, self.geometry, max_rows, dspark)
            tensors = {name: cp.asarray(a) for name, a in host.items()}
            bound = {name: int(t.data.ptr) for name, t in tensors.items()}
            ctx = StepContext(self.cfg, tp, rank, bundle, arena, bound, max_rows,
                              geometry=self.geometry)
            self.arenas.append(arena)
            self.tensors.append(tensors)
            self.contexts.append(ctx)
            self.plans.append(wire(decode_plan(self.cfg, dspark=dspark), ctx, modules))
        cp.cuda.Device().synchronize()

    def close(self) -> None:
        for arena in self.arenas:
            arena.close()

    def load(self, rows, caches=None, history=None) -> None:
        """Row metadata (and, when given, every cache) into every rank's tensors."""
        host = caller_tensors(self.cfg, self.tp, self.geometry, self.max_rows, self.dspark)
        fill_caller_tensors(host, rows, caches, history)
        for tensors in self.tensors:
            for name, t in tensors.items():
                if caches is not None or not _is_cache(name):
                    t.set(host[name])
        self.cp.cuda.Device().synchronize()

    def run(self, rows: int) -> int:
        """The whole step for a bucket of `rows`; returns the kernel launches made."""
        stages = [plan.stages for plan in self.plans]
        count = 0
        for i, stage in enumerate(stages[0]):
            if stage.build is None:
                if stage.range_name not in HOST_ROLES:
                    raise NotImplementedError(f"stage {stage.name} is not wired")
                self._host_collective(stage.range_name, rows)
                continue
            for r in range(self.tp):
                for spec in stages[r][i].build(rows):
                    spec.launch(self.stream)
                    count += 1
        self.stream.synchronize()
        return count

    def _host_collective(self, role: str, rows: int) -> None:
        kind, inp, out = HOST_ROLES[role]
        self.stream.synchronize()
        if kind == "pick":
            pairs = [self.read(r, inp, np.int32, (rows, 2)) for r in range(self.tp)]
            result = ar.pick_ref(pairs)
        else:
            cols = self.contexts[0].arena.nbytes(inp) // (2 * self.max_rows)
            parts = [self.read(r, inp, BF16, (rows, cols)) for r in range(self.tp)]
            if kind == "sum":
                result = ar.allreduce_ref(parts)
            elif kind == "gather":
                result = ar.gather_ref(parts)
            else:                               # the sharded wkv's row-interleaved pieces
                result = ar.gather_pieces_ref(parts, ek.kv_pieces(self.cfg, self.tp)[0])
        for r in range(self.tp):
            self.write(out, result, ranks=[r])

    def read(self, rank: int, name: str, dtype, shape) -> np.ndarray:
        ctx = self.contexts[rank]
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        raw = np.empty(nbytes, np.uint8)
        mem = self.cp.cuda.UnownedMemory(ctx.ptr(name), nbytes, self)
        self.cp.ndarray((nbytes,), self.cp.uint8, self.cp.cuda.MemoryPointer(mem, 0)).get(out=raw)
        return raw.view(dtype).reshape(shape)

    def write(self, name: str, array, ranks=None) -> None:
        raw = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        for rank in range(self.tp) if ranks is None else ranks:
            mem = self.cp.cuda.UnownedMemory(self.contexts[rank].ptr(name), raw.size, self)
            view = self.cp.ndarray((raw.size,), self.cp.uint8, self.cp.cuda.MemoryPointer(mem, 0))
            view.set(raw)
        self.cp.cuda.Device().synchronize()

    # ---- DSpark rounds (tests/gpu/test_dspark_round.py) ------------------------------------------

    def wire_dspark(self, sync_free: bool = False) -> tuple[list[Plan], list[Plan]]:
        """Every rank's DSpark verify plan (decode_plan(dspark=True)) and draft plan (draft_plan),
        wired with every stage module, for run_plans (needs dspark=True: `accepted`, `bonus`).

        The cross-rank builders (the all-reduces, the picks, the Markov steps' pick) need a
        collective state: each rank's context is copied with a stand-in one (pointers into one
        zeroed scratch allocation, a 1 ms timeout), whose launches run_plans never makes."""
        if not self.dspark:
            raise ValueError("wire_dspark: build DeviceRanks(..., dspark=True) (it binds the "
                             "caller's `accepted` and `bonus`)")
        self._standin = self.cp.zeros(4096, self.cp.uint8)
        scratch = int(self._standin.data.ptr)
        verify, draft = [], []
        for ctx in self.contexts:
            standin = copy.copy(ctx)
            standin.collectives = CollectiveState(
                ctx.rank, self.tp, {"peers": scratch, "control": scratch, "status": scratch},
                timeout_us=1000)
            verify.append(wire(decode_plan(self.cfg, dspark=True, sync_free=sync_free), standin))
            draft.append(wire(draft_plan(self.cfg, sync_free=sync_free), standin))
        for plan in verify + draft:
            plan.require_complete()
        return verify, draft

    def run_plans(self, plans, rows: int, roles=None, layers=None) -> int:
        """Every rank's `plans` (wire_dspark's) for a bucket of `rows`, in lockstep on the stream,
        with the cross-rank stages on the host: the HOST_ROLES (a draft stage's under its
        `draft.` role too) and each Markov step's pick (the step's own kernel launches, then
        pick_ref of every rank's `dspark.pairs` into `dspark.prev`). No other launch of the
        collective family is made (it would spin on peers a single stream never runs): raises.
        roles / layers: only those stages (subplan). Returns the kernel launches made."""
        if roles is not None or layers is not None:
            plans = [self.subplan(p, roles, layers) for p in plans]
        built = [plan.launches(rows) for plan in plans]
        if any([s.name for s, _ in b] != [s.name for s, _ in built[0]] for b in built):
            raise ValueError("run_plans: the ranks' plans differ in their stages")
        for stage, specs in built[0]:                   # refuse before launching anything
            cross = [s.kernel.name for s in specs if _family(s) == COLLECTIVE_FAMILY]
            if cross and not stage.range_name.startswith("dspark.markov") \
                    and stage.range_name.removeprefix("draft.") not in HOST_ROLES:
                raise NotImplementedError(f"stage {stage.name}: launches {cross} have no host "
                                          f"stand-in here")
        count = 0
        for i, (stage, _) in enumerate(built[0]):
            role = stage.range_name.removeprefix("draft.")
            if role in HOST_ROLES:
                self._host_collective(role, rows)
                continue
            picks = 0
            for rank_built in built:
                for spec in rank_built[i][1]:
                    if _family(spec) == COLLECTIVE_FAMILY:      # a Markov step's pick
                        picks += 1
                        continue
                    spec.launch(self.stream)
                    count += 1
            if picks:
                self._host_markov_pick(stage.name, rows)
        self.stream.synchronize()
        return count

    @staticmethod
    def subplan(plan: Plan, roles=None, layers=None) -> Plan:
        """The stages of `plan` whose role is in `roles` and layer in `layers` (None: any; head
        and tail stages have layer None and are kept only when `layers` is None), as
        EmulatedRanks.subplan."""
        keep = [s for s in plan.stages if (roles is None or s.range_name in roles)
                and (layers is None or s.layer in layers)]
        if not keep:
            raise ValueError(f"no stage matches roles={roles} layers={layers}")
        return Plan(keep)

    def _host_markov_pick(self, name: str, rows: int) -> None:
        """The pick of a Markov step: a draft bucket holds k rows per sequence."""
        k = self.cfg.dspark_block_size
        if rows % k:
            raise ValueError(f"{name}: a draft bucket of {rows} rows is not {k} per sequence")
        self.stream.synchronize()
        pairs = [self.read(r, "dspark.pairs", np.int32, (rows // k, 2)) for r in range(self.tp)]
        self.write("dspark.prev", ar.pick_ref(pairs))


def _family(spec) -> str:
    return getattr(spec.kernel, "record", spec.kernel).family


def _checkpoint_contents(ckpt, tp: int, rank: int, max_rows: int, modules):
    from loader.sharding import shard

    def fetch(name):
        return shard(ckpt, ckpt.spec(name), tp, rank)

    return arena_contents(ckpt.config, tp, rank, fetch, max_rows, modules)


def _is_cache(name: str) -> bool:
    return name.startswith(("swa_", "compressed_", "index_keys_", "compressor_ring_"))
