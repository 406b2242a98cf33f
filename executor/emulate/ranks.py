"""All TP ranks of the step on one CPU: arenas, bound caller tensors and wired plans, emulated.

    ranks = EmulatedRanks(ckpt, bundle_dir, tp=4, caches=KVCaches.allocate(...))
    ranks.load(rows, caches, history)              # the caller's tensors of this step, every rank
    ranks.run(rows.num_rows, roles={...})          # the wired stages (all, or these roles)
    ranks.read(rank, "ffn.out", BF16, (R, D))      # any arena slice or bound tensor

Each rank gets its own arena (weights packed by the stage modules, boundary buffers, scratch) and
its own copy of every caller tensor (KV caches included: on the GPU each rank owns its caches and
writes the same bytes, so diverging copies are a bug the tests can see), all in one
AddressSpace, so an all-reduce emulator reads its peers' memory through their addresses. The plan
is `decode_plan(cfg)` wired by `executor.wiring.wire`; `run` emulates it in lockstep, optionally
restricted to some roles and layers (a sublayer test fills its inputs, runs its stages, reads).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from collectives.oneshot import CollectiveState
from executor.bind import CacheGeometry, binding_rules
from executor.emulate import bind_host, run_lockstep
from executor.hostmem import AddressSpace, HostArena, ManifestBundle
from executor.launches.allreduce import init_host_ranks, rank_requests
from executor.plan import Plan, decode_plan
from executor.wiring import StepContext, arena_contents, wire
from kernels import allreduce_ref


def caller_tensors(cfg, tp: int, geometry: CacheGeometry, max_rows: int,
                   dspark: bool = False) -> dict[str, np.ndarray]:
    """Zeroed host arrays for every tensor bind() takes (optional logits included)."""
    return {name: np.zeros(rule.shape, np.dtype(rule.dtype))
            for name, rule in binding_rules(cfg, tp, geometry, max_rows, dspark).items()}


def fill_caller_tensors(tensors: dict, rows, caches=None, history=None) -> None:
    """Row metadata of `rows` (RowBatch; rows past it are padding: slot -1, sequence -1) and,
    when `caches` is given, a copy of every cache of it (reference KVCaches, record layout)
    into `tensors` (without: the caches keep what earlier emulated steps wrote).

    token_history holds the tokens at positions p-1 .. p-(n-1) of each row (history[:, 1:] of
    engram_ref.ngram_history, pad id where p-k < 0): the kernel hashes token_ids with it.
    """
    r, s = rows.num_rows, rows.num_seqs
    pad = {"token_ids": 0, "positions": 0, "slot_mapping": -1, "seq_index": -1, "block_kind": 0}
    for name, value in pad.items():
        tensors[name][...] = value
        tensors[name][:r] = getattr(rows, name)
    tensors["state_lines"][...] = 0
    tensors["state_lines"][:s] = rows.state_lines
    tensors["context_lens"][...] = 0
    tensors["context_lens"][:s] = rows.context_lens
    tensors["block_tables"][...] = 0
    width = rows.block_tables.shape[1]
    tensors["block_tables"][:s, :width] = rows.block_tables
    if "token_history" in tensors:
        if history is None:
            raise ValueError("this model has Engram: pass the step's token history")
        tensors["token_history"][...] = 0
        tensors["token_history"][:r] = history[:, 1:]
    if caches is None:
        return
    for layer, arr in caches.swa.items():
        tensors[f"swa_{layer}"][...] = arr
    for layer, arr in caches.compressed.items():
        tensors[f"compressed_{layer}"][...] = arr
        tensors[f"index_keys_{layer}"][...] = caches.index_keys[layer]
    for layer, arr in caches.ring.items():
        tensors[f"compressor_ring_{layer}"][...] = arr


class EmulatedRanks:
    """`tp` ranks of one step in one AddressSpace."""

    def __init__(self, ckpt, bundle_dir, tp: int, caches, max_rows: int = 192,
                 modules=None, dspark: bool = False):
        from loader.sharding import shard

        self.cfg, self.tp, self.max_rows = ckpt.config, tp, max_rows
        self.geometry = CacheGeometry.of(caches)
        self.space = AddressSpace()
        self.bundle = ManifestBundle(bundle_dir)
        # The one-shot all-reduce's state lives in each rank's arena here (IPC memory on GPUs).
        ar_spec = (allreduce_ref.make_spec(tp, self.cfg.hidden_size, "none", max_rows)
                   if tp in allreduce_ref.WORLD_SIZES else None)
        self.arenas, self.tensors, self.contexts, self.plans = [], [], [], []
        bounds = []
        for rank in range(tp):
            def fetch(name, rank=rank):
                return shard(ckpt, ckpt.spec(name), tp, rank)

            requests, uploads = arena_contents(self.cfg, tp, rank, fetch, max_rows, modules)
            if ar_spec is not None:
                requests += rank_requests(ar_spec)
            arena = HostArena(self.space, requests, name=f"rank{rank}.arena")
            for name, array in uploads:
                arena.upload(name, array)
            tensors = caller_tensors(self.cfg, tp, self.geometry, max_rows, dspark)
            bounds.append(bind_host(self.space, tensors, prefix=f"rank{rank}."))
            self.arenas.append(arena)
            self.tensors.append(tensors)
        states = init_host_ranks(self.arenas, ar_spec) if ar_spec is not None else [None] * tp
        for rank in range(tp):
            collectives = (None if states[rank] is None
                           else CollectiveState(rank, tp, states[rank]))
            self.contexts.append(StepContext(self.cfg, tp, rank, self.bundle, self.arenas[rank],
                                             bounds[rank], max_rows, collectives, self.geometry))
        for ctx in self.contexts:
            ctx.peers = self.contexts
            self.plans.append(wire(decode_plan(self.cfg, dspark=dspark), ctx, modules))

    def load(self, rows, caches=None, history=None) -> None:
        for tensors in self.tensors:
            fill_caller_tensors(tensors, rows, caches, history)

    def subplan(self, plan: Plan, roles=None, layers=None) -> Plan:
        """The wired stages of `plan` whose role is in `roles` and layer in `layers` (None: any;
        head/tail stages have layer None and are kept only when `layers` is None)."""
        keep = [replace(s, side=False, joins=False) for s in plan.stages if s.build is not None
                and (roles is None or s.range_name in roles)
                and (layers is None or s.layer in layers)]
        if not keep:
            raise ValueError(f"no wired stage matches roles={roles} layers={layers}")
        return Plan(keep)          # in stage order, no branches (a subset may lack their joins)

    def run(self, rows: int, roles=None, layers=None, side_last: bool = False) -> int:
        """Emulate the wired stages (all of them, or those matching roles/layers) on every rank;
        side_last: the whole plan's other serial order (Plan.launches)."""
        if roles is None and layers is None:
            return run_lockstep(self.plans, rows, self.space, side_last)
        return run_lockstep([self.subplan(p, roles, layers) for p in self.plans], rows,
                            self.space)

    def read(self, rank: int, name: str, dtype, shape) -> np.ndarray:
        ctx = self.contexts[rank]
        return self.space.array(ctx.ptr(name), dtype, shape).copy()

    def write(self, name: str, array, ranks=None) -> None:
        """Put `array` at the start of `name` on every rank (or `ranks`)."""
        raw = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        for rank in range(self.tp) if ranks is None else ranks:
            self.space.bytes(self.contexts[rank].ptr(name), raw.size)[...] = raw
