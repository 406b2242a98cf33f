"""Whole-rank decode step benchmark on one GPU: rank 0 of TP4, 40 layers at real dimensions.

    hopdec devicecheck --only step --bundle build/bundle-v41-bench-step-tp4 ...
    HOPDEC_STEP_CASES=1x4k,6x4k hopdec devicecheck --only step ...     # those cases only

Environment: HOPDEC_STEP_CASES ("ROWSxCONTEXT,...", e.g. "1x4k,6x64k"; ROWS a bucket of CASES,
CONTEXT in tokens, k = 1024) runs only those (bucket, context) pairs; unset, every bucket (quick:
R = 1, 5) at every context. HOPDEC_PACK_WORKERS: threads packing the weights (default every core;
1 = `wiring.arena_contents` on one thread).

What runs: `decode_plan(cfg)` wired by the step's own stage modules (BENCH_MODULES) on one
rank's arena, with synthetic weights (`loader.synth.synth_fetch`, no checkpoint file), for
buckets R = 1, 5, 6, 48, 192 (CASES) at 4k and 64k tokens of context (CONTEXTS). What differs
from a real TP4 step, and why:
- Config: `bench_config` = v41-flash with engram_vocab_size cut to BENCH_ENGRAM_VOCAB, so each
  Engram table is ~100 MB (25 MB on this rank) instead of 98 GB; the hash, lookup and gate run
  and read the same way (a bundle built for this config carries its hash constants).
- Weights: layers of one role share the bytes of a representative (`wiring.representatives`,
  8 of 40 are packed), each layer in its own slices, so the step reads 40 layers' bytes; routed
  expert e holds expert e % 16's values (`stages.ffn_tiled`; packing 384 x 8 experts would take
  half an hour). `pack_parallel` packs each (stage module, representative layer) on its own
  thread, the same arrays in the same arena order as arena_contents; the repeated experts go up
  once per layer and are copied on the device (`upload_all`).
- Cross-rank stages: `stages.local_collectives` (a copy per all-reduce, no-op gather and pick);
  the one-shot all-reduce's own latency (collectives benchmark: peers pre-arrived, one GPU) is
  added in the "+ AR" column, 81 calls (embedding + 2 per layer). Not added: the Engram
  all-gathers (heads and, since round 8, the column-sharded wkv's output: 4 calls a step at
  R <= 96, 6 above) and the pick; the four-GPU step (executor/bench_tp.py) runs them all.
- KV caches: zero records (valid: they decode to zeros) and random finite index keys (so top-k
  sees distinct scores); every sequence has its own pages; block tables, slots and context
  lengths are consistent (RowBatch validates them).

Timed per (bucket, context): graph replay (CUDA events, median of GRAPH_REPS; the plan's side
stages beside the chain, executor/branches.py), the same graph captured without PDL, the graphs
of the STEP_VARIANTS (HOPDEC_STEP_VARIANTS; the step re-wired with a switch at its previous
choice, e.g. "serial": no side branches), the same launches eagerly on one stream with and
without PDL (host-bound: Python issues ~4 us per launch), and per stage role a graph of that
role's launches over all layers (the per-family breakdown, with launches per step and us per
launch; replayed alone, so boundaries with the neighbours are not in it: the whole graph minus
the sum of the roles is their cost). Each graph's time is the median of TIMING_ROUNDS
round-robin rounds. No L2 flush: a step reads ~4-10 GB, 70-170x the 60 MB L2. Bytes that must be
read: the dense weights the step touches, the distinct experts the router picked (counted per
layer in an eager pass), KV (`kv_read_bytes`); against 4.8 TB/s and model doc §3's floors (0.85 /
1.97 ms at R = 1 / 6). The KV caches are sized for the selected cases (their capacity is not read).
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import importlib
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from executor.bench_step_pack import pack_parallel, pack_workers, repeats
from executor.bind import CacheGeometry, binding_rules
from executor.branches import SideStream
from executor.plan import decode_plan
from executor.reference.kvcache import next_pow2
from executor.reference.rows import RowBatch, RowBlock
from executor.wiring import StepContext, arena_contents, representatives, wire
from kernels import engram_kernel_ref
from kernels.kvrecord_ref import INDEX_RECORD_BYTES, KV_RECORD_BYTES
from loader.config import ModelConfig

TP, RANK, MAX_ROWS, PAGE_SIZE, SEED = 4, 0, 192, 64, 0
BENCH_ENGRAM_VOCAB = 16384
BENCH_MODULES = ("executor.stages.mhc", "executor.stages.attn_proj", "executor.stages.attn_index",
                 "executor.stages.ffn_tiled", "executor.stages.local_collectives")
CONTEXTS = (4096, 65536)
CASES_ENV = "HOPDEC_STEP_CASES"        # "1x4k,6x64k": those (rows x context) only
GRAPH_REPS, EAGER_REPS = 30, 8
TIMING_ROUNDS = 5                      # each graph's time: the median of 5 round-robin medians
HBM_BYTES_PER_S = 4.8e12
DOC_FLOOR_MS = {1: 0.85, 6: 1.97}              # model doc §3
TARGET_MS = {1: 1.1, 6: 2.4}                   # issue 8
ALLREDUCES = 81                                # embedding + attention and FFN of 40 layers
# one-shot all-reduce, 1 rank with peers pre-arrived (docs/perf.md run 16): rows -> us
ONESHOT_US = {1: 3.0, 8: 3.5, 32: 3.8, 192: 8.1}
ONESHOT_METRIC = "one-shot kernel, 1 rank, peers pre-arrived (floor): {} rows"


@dataclass(frozen=True)
class Case:
    """One bucket: `seqs` sequences of `rows // seqs` rows each (decode: one row each)."""

    rows: int
    seqs: int
    kind: str                 # executor.reference.rows.BLOCK_KINDS

    @property
    def block(self) -> int:
        return self.rows // self.seqs


CASES = (Case(1, 1, "decode"), Case(5, 1, "verify"), Case(6, 1, "verify"),
         Case(48, 8, "verify"), Case(192, 32, "verify"))


def selected_cases(spec: str | None = None, quick: bool = False):
    """[(case, contexts)] to run: `spec` (default: CASES_ENV) "ROWSxCONTEXT,..." such as
    "1x4k,6x64k" (k = 1024; ROWS a bucket of CASES, CONTEXT from a block up to max(CONTEXTS)),
    grouped by case in the order given; unset or empty: every case (quick: the first two) at
    every context of CONTEXTS."""
    spec = os.environ.get(CASES_ENV, "") if spec is None else spec
    if not spec.strip():
        return [(case, CONTEXTS) for case in (CASES[:2] if quick else CASES)]
    by_rows, chosen = {c.rows: c for c in CASES}, {}
    for item in spec.split(","):
        rows, _, context = item.strip().lower().partition("x")
        scale = 1024 if context.endswith("k") else 1
        context = context.removesuffix("k")
        case = by_rows.get(int(rows)) if rows.isdigit() else None
        if case is None or not context.isdigit() or not (
                case.block <= int(context) * scale <= max(CONTEXTS)):
            raise ValueError(f"{CASES_ENV}: {item.strip()!r} is not ROWSxCONTEXT with ROWS one "
                             f"of {sorted(by_rows)} and CONTEXT (4k = 4096) from the block up "
                             f"to {max(CONTEXTS)}")
        contexts = chosen.setdefault(case, [])
        if int(context) * scale not in contexts:
            contexts.append(int(context) * scale)
    return [(case, tuple(contexts)) for case, contexts in chosen.items()]


def bench_config(cfg: ModelConfig | None = None) -> ModelConfig:
    """`cfg` (default v41-flash) with the Engram tables cut to BENCH_ENGRAM_VOCAB buckets per
    hash column (the prime walk starts there): engram_num_embeddings follows."""
    cfg = cfg or ModelConfig.preset("v41-flash")
    if cfg.engram_vocab_size <= BENCH_ENGRAM_VOCAB:
        return cfg
    data = cfg.to_dict()
    data["engram_vocab_size"] = BENCH_ENGRAM_VOCAB
    del data["engram_num_embeddings"]                          # derived again from the walk
    return ModelConfig.from_dict(data, source=f"step benchmark config (engram_vocab_size "
                                              f"{BENCH_ENGRAM_VOCAB})")


def cache_geometry(cfg, cases=CASES, contexts=CONTEXTS, extra_tokens: int = 0) -> CacheGeometry:
    """One geometry for every case: a line and its own pages for each sequence of the widest
    (`extra_tokens` past the longest context: rows that advance themselves, the round's)."""
    block, seqs = max(c.block for c in cases), max(c.seqs for c in cases)
    pages = -(-(max(contexts) + extra_tokens) // PAGE_SIZE)
    return CacheGeometry(max_seqs=seqs, ring_slots=next_pow2(cfg.sliding_window + block),
                         ring_rows=next_pow2(block + 2), page_size=PAGE_SIZE,
                         num_pages=seqs * pages, pages_per_seq=pages)


def row_batch(cfg, geometry: CacheGeometry, case: Case, context: int, rng):
    """(RowBatch, Engram history [R, max_ngram]): sequence s on line s and its own pages, rows
    at positions context - block .. context - 1 (context_lens = context)."""
    if context < case.block:
        raise ValueError(f"context {context} is shorter than a block of {case.block} rows")
    # Tokens from rank 0's vocabulary shard: the benchmark's all-reduces are local copies, so a
    # token of another shard would embed to zeros here and every such row would route alike
    # (run 22 saw 6 distinct experts at R = 5 where uniform routing gives ~26).
    shard = cfg.vocab_size // TP
    blocks = [RowBlock(s, context - case.block,
                       tuple(int(t) for t in rng.integers(0, shard, case.block)),
                       case.kind) for s in range(case.seqs)]
    tables = np.arange(geometry.num_pages, dtype=np.int32).reshape(geometry.max_seqs, -1)
    rows = RowBatch.from_blocks(blocks, tables, geometry.ring_slots)
    vocab = min(cfg.vocab_size, cfg.engram_compressed_vocab_size)
    history = rng.integers(0, vocab, (case.rows, max(cfg.engram_max_ngram_size, 1)))
    return rows, history


def bound_rules(cfg, geometry, dspark: bool = False) -> dict:
    """The caller tensors the benchmark binds: the required ones (no `logits`: bound, it would
    add the logits-mode lm_head, 331 MB more per step, which greedy decoding does not run);
    dspark: the round's too (`accepted`, `bonus`)."""
    return {n: r for n, r in binding_rules(cfg, TP, geometry, MAX_ROWS, dspark).items()
            if r.required}


def metadata_names(cfg, geometry, dspark: bool = False) -> list[str]:
    """The bound tensors the row metadata fills (everything but caches and outputs)."""
    cache = ("swa_", "compressed_", "index_keys_", "compressor_ring_")
    outputs = ("tokens", "logits", "accepted", "bonus")
    return [n for n in binding_rules(cfg, TP, geometry, MAX_ROWS, dspark)
            if not n.startswith(cache) and n not in outputs]


# ---- bytes that must be read ----------------------------------------------------------------------

@dataclass(frozen=True)
class WeightBytes:
    dense: int            # every weight slice a step reads whole (layers, head, Engram wkv...)
    per_expert: int       # one routed expert of one layer, all its packed arrays
    engram_row: int       # one Engram table row: codes + scales


def weight_bytes(cfg, uploads) -> WeightBytes:
    """From arena_contents' uploads: what a step reads whole, and the per-row/per-expert parts
    read only where the rows lead (experts, Engram tables, embedding rows, RoPE rows)."""
    dense = experts = 0
    for name, array in uploads:
        if ".ffn.experts." in name:
            experts += array.nbytes
        elif not (".engram.embed." in name or name == "embed.weight" or name.startswith("rope.")):
            dense += array.nbytes
    layers = sum(1 for s in cfg.layers if not s.is_dspark)
    return WeightBytes(dense, experts // (layers * cfg.n_routed_experts),
                       cfg.engram_head_dim + cfg.engram_head_dim // 32)


def kv_read_bytes(cfg, case: Case, context: int) -> int:
    """KV bytes a step must read (a floor): per sequence and layer its SWA window (+ the block's
    earlier rows), top-k gathered entries of the compressed cache, and the index keys its
    indexer scores (the candidate blocks only on candidate-masked layers)."""
    total = 0
    for spec in cfg.layers:
        if spec.is_dspark:
            continue
        total += min(context, cfg.sliding_window + case.block - 1) * KV_RECORD_BYTES
        if spec.ratio:
            total += min(cfg.index_topk, context // spec.ratio) * KV_RECORD_BYTES
        if spec.has_indexer:
            entries = context // cfg.layer(spec.kv_source).ratio
            if spec.uses_candidates:
                entries = min(entries, cfg.candidate_topk_blocks * cfg.candidate_block_size)
            total += entries * INDEX_RECORD_BYTES
    return case.seqs * total


def step_weights(cfg, dev, specs) -> WeightBytes:
    """`dev.weights` with `dense` counted from the slices `specs` point into: the arena also
    holds weights a plain step never reads (the DSpark stages', main_proj, the Markov head)."""
    touched = touched_slices(specs, dev.arena)
    return replace(dev.weights, dense=plan_weights(cfg, dev.upload_bytes, touched).dense)


def step_bytes(cfg, weights: WeightBytes, case: Case, context: int, distinct: list[int]) -> int:
    engram = 0
    if cfg.engram_layer_ids:
        cols = cfg.rank_shapes(TP).engram_hash_cols
        engram = len(cfg.engram_layer_ids) * case.rows * cols * weights.engram_row
    embed = case.rows * cfg.hidden_size * 2
    return (weights.dense + weights.per_expert * sum(distinct) + engram + embed
            + kv_read_bytes(cfg, case, context))


ROW_TABLES = ("embed.weight", ".engram.embed.", "rope.", "markov_w1")   # read by the rows only


def touched_slices(specs, arena) -> set[str]:
    """The arena slices the launches' pointer arguments point into."""
    spans = sorted((arena.ptr(name), arena.ptr(name) + s.nbytes, name)
                   for name, s in arena.slices.items())
    starts = [start for start, _, _ in spans]
    out = set()
    for spec in specs:
        for (_, kind), value in zip(spec.kernel.params, spec.args):
            if kind != "u64":
                continue
            i = bisect.bisect_right(starts, value) - 1
            if i >= 0 and value < spans[i][1]:
                out.add(spans[i][2])
    return out


@dataclass(frozen=True)
class PlanWeights:
    """The weights one plan reads: whole (dense), and one routed expert of its layers."""

    dense: int
    per_expert: int
    expert_slices: int      # layers whose experts it reads (check: 40 verify, 3 draft)


def plan_weights(cfg, upload_bytes: dict[str, int], touched: set[str]) -> PlanWeights:
    """From the packed weights' sizes and the slices a plan's launches touch."""
    dense = experts = 0
    layers = set()
    for name in touched & set(upload_bytes):
        if ".ffn.experts." in name:
            experts += upload_bytes[name]
            layers.add(name.split(".ffn.experts.")[0])
        elif not any(key in name for key in ROW_TABLES):
            dense += upload_bytes[name]
    dspark = any(name.startswith("mtp.") for name in layers)
    count = cfg.dspark_n_routed_experts if dspark else cfg.n_routed_experts
    return PlanWeights(dense, experts // max(1, len(layers) * count), len(layers))


def allreduce_us(rows: int, measured: dict[int, float] | None = None) -> float:
    """One one-shot all-reduce at `rows`, interpolated in rows between measured points."""
    table = measured or ONESHOT_US
    xs = sorted(table)
    return float(np.interp(rows, xs, [table[x] for x in xs]))


# ---- the rank's memory ----------------------------------------------------------------------------

def host_contents(cfg, seed: int = SEED, workers: int | None = None, modules=BENCH_MODULES,
                  rank: int = RANK):
    """(requests, uploads, seconds): rank `rank`'s arena contents of the stage `modules` from
    synthetic weights, packed on `workers` threads (default: PACK_WORKERS_ENV, else every core;
    1: arena_contents itself; see executor.bench_step_pack)."""
    from loader.synth import synth_fetch

    t0 = time.perf_counter()
    fetch = synth_fetch(cfg, seed, TP, rank)
    workers = workers or pack_workers()
    if workers == 1:
        requests, uploads = arena_contents(cfg, TP, rank, fetch, MAX_ROWS, modules,
                                           representatives(cfg))
    else:
        requests, uploads = pack_parallel(cfg, TP, rank, fetch, MAX_ROWS, modules,
                                          representatives(cfg), workers)
    return requests, uploads, time.perf_counter() - t0


def upload_all(arena, uploads) -> None:
    """H2D once per distinct array; the layers sharing it get a device-to-device copy, and an
    array that repeats along its first axis (stride 0: ffn_tiled's experts) goes up as one
    repeat, copied along the slice on the device."""
    first: dict[int, str] = {}
    for name, array in uploads:
        source = first.setdefault(id(array), name)
        if source != name:
            nbytes = array.nbytes
            arena.view(name, np.uint8, (nbytes,))[...] = arena.view(source, np.uint8, (nbytes,))
        elif repeats(array):
            arena.upload(name, array[0])
            whole = arena.view(name, np.uint8, (array.shape[0], array[0].nbytes))
            whole[1:] = whole[0]
        else:
            arena.upload(name, array)


def role_groups(built) -> dict[str, list]:
    """Stage role -> its launches over the whole step, in step order."""
    groups: dict[str, list] = {}
    for stage, specs in built:
        groups.setdefault(stage.range_name, []).extend(specs)
    return groups


def without_pdl(specs) -> list:
    return [no_pdl(s) for s in specs]


def no_pdl(spec):
    from executor.launch import LaunchSpec

    return LaunchSpec(spec.kernel, spec.grid, spec.args, pdl=False, smem=spec.smem,
                      cluster=spec.cluster)


# Variants the step benchmark times beside the step's own wiring (HOPDEC_STEP_VARIANTS, e.g.
# "serial"; "none" for none): each re-wires the plan with module constants set as listed, so
# one run compares them on the same weights, caches and GPU (the kernels must be in the bundle).
# A variant is the previous choice of a switch, kept until the switch has been measured.
STEP_VARIANTS: dict[str, Callable[[], dict[tuple[str, str], object]]] = {
    "serial": lambda: {("executor.plan", "STEP_BRANCHES"): False},
    "attn_branch_only": lambda: {("executor.plan", "SIDE_ROLES"):
                                 frozenset({"attn.compressor", "attn.indexer"})},
    "ffn_branch_only": lambda: {("executor.plan", "SIDE_ROLES"):
                                frozenset({"ffn.shared_w13", "ffn.shared_expert"})},
    # round 8's revert: the shared w2 ("add_f32") on the main chain after the plain combine
    "shared_w2_main": lambda: {("executor.plan", "SHARED_ON_SIDE"): False},
    # session 8's revert: q_norm in attn_prep between wq_a|wkv and wq_b (not folded into wq_b)
    "q_kv_norm_launch": lambda: {("executor.stages.attn_proj", "FOLD_Q_NORM"): False},
    # round 9's revert: wq_b at R = 1 on the step's plain dense kernel (xtwp), not QGMMA's _sqg
    "wq_b_xtwp": lambda: {("executor.stages.attn_proj", "QGMMA_WQ_B_ROWS"): ()},
    # session 9's revert: wo_b at R = 1 on the step's plain dense kernel, not QGMMA's _sqg
    "wo_b_xtu": lambda: {("executor.stages.attn_proj", "QGMMA_WO_B_ROWS"): ()},
    # compressor round 9's revert: the session-1 projection + publish (compressor-design.md)
    "compressor_round1": lambda: {("executor.launches.compressor", "FAST_KERNELS"): False},
    # compressor round 9 at every R (bulk16 above 8 rows at r = 2): FAST_MAX_ROWS's revert
    "compressor_fast_all": lambda: {("executor.launches.compressor", "FAST_MAX_ROWS"): 10**9},
    # compressor round 9b's revert: r9b's bulk projection (x copies of all 8 rows of a tile)
    "compressor_bulk": lambda: {("executor.launches.compressor", "FAST_PROJ"): "bulk"},
    # round 9's revert: the self-routed MoE pair with static items (w13sr bulk, w2sr early)
    "moe_static": lambda: {("executor.launches.moe", "STEP_QUEUE"): False},
    "mqa_round7": lambda: {("kernels.sparse_mqa_ref", "STEP_TOPK_VARIANT"):
                           _constant("kernels.sparse_mqa_ref", "STEP_TOPK_VARIANT_ROUND7")},
}
VARIANTS_ENV = "HOPDEC_STEP_VARIANTS"


def _constant(module: str, attr: str):
    return getattr(importlib.import_module(module), attr)


def selected_variants() -> list[str]:
    raw = os.environ.get(VARIANTS_ENV, ",".join(STEP_VARIANTS))
    names = [] if raw.strip() == "none" else [v.strip() for v in raw.split(",") if v.strip()]
    unknown = [v for v in names if v not in STEP_VARIANTS]
    if unknown:
        raise ValueError(f"{VARIANTS_ENV}: unknown variant(s) {unknown}; known: "
                         f"{sorted(STEP_VARIANTS)} or 'none'")
    return names


@contextlib.contextmanager
def overrides(settings: dict[tuple[str, str], object]):
    """Module constants set for the body, restored after (also on error)."""
    saved = []
    try:
        for (module, attr), value in settings.items():
            mod = importlib.import_module(module)
            if not hasattr(mod, attr):
                raise AttributeError(f"step variant: {module} has no {attr}")
            saved.append((mod, attr, getattr(mod, attr)))
            setattr(mod, attr, value)
        yield
    finally:
        for mod, attr, value in reversed(saved):
            setattr(mod, attr, value)


# ---- the benchmark (GPU) --------------------------------------------------------------------------

def find_bundle(ctx, cfg):
    """The loaded bundle built for `cfg`: its Engram hash kernels carry cfg's primes."""
    names = [engram_kernel_ref.make_hash_spec(cfg, i) for i in cfg.engram_layer_ids]
    for bundle in ctx.bundles.values():
        records = bundle.manifest.kernels
        if all(s.name in records and list((records[s.name].spec or {}).get("primes", ())) ==
               list(s.primes) for s in names) and "residual_add_bf16_bf16_d5120" in records:
            return bundle
    raise LookupError("step benchmark: no loaded bundle is built for the benchmark config "
                      "(build it: python -m executor.bench_step --write-config "
                      "build/v41-flash-bench-step.json, then python -m kernels.build --config "
                      "build/v41-flash-bench-step.json --tp 4 --out "
                      "build/bundle-v41-bench-step-tp4)")


class DeviceStep:
    """One rank's arena, bound caller tensors and wired plan on the device: rank 0 on one GPU
    (the local stand-in collectives), or rank `rank` of a TP world in its own process with its
    one-shot `collectives` state and `executor.stages.collectives` (executor/bench_tp.py).

    The round benchmark (executor/bench_round.py) reuses it with its own stage `modules`, cache
    `geometry` and the DSpark tensors (`dspark`), and wires its own plans (`wire_plans`).
    `ctx` needs `stream` and `device` (a devicecheck context, or bench_tp's per rank)."""

    def __init__(self, ctx, cfg, bundle, modules=BENCH_MODULES, geometry=None,
                 dspark: bool = False, rank: int = RANK, collectives=None):
        import cupy as cp

        from executor.arena import plan_slices
        from executor.runtime import Arena

        self.cp, self.cfg, self.stream, self.dspark = cp, cfg, ctx.stream, dspark
        self.side = SideStream.create(ctx.device)         # the plan's side branches
        self.modules, self.rank = tuple(modules), rank
        self.pack_workers = pack_workers()
        requests, uploads, self.pack_s = host_contents(cfg, workers=self.pack_workers,
                                                       modules=modules, rank=rank)
        self.upload_bytes = {name: array.nbytes for name, array in uploads}
        self.weights = weight_bytes(cfg, uploads)
        self.geometry = geometry or cache_geometry(cfg)
        rules = bound_rules(cfg, self.geometry, dspark)
        need = plan_slices(requests)[1] + sum(int(np.prod(r.shape)) * np.dtype(r.dtype).itemsize
                                              for r in rules.values())
        if need > ctx.device.mem_free_bytes():
            raise MemoryError(f"step benchmark: the rank's arena and caches need {need / 2**30:.1f}"
                              f" GiB, the device has {ctx.device.mem_free_bytes() / 2**30:.1f} "
                              f"GiB free")
        t0 = time.perf_counter()
        self.arena = Arena(ctx.device, requests)
        try:
            self.arena.zero()
            upload_all(self.arena, uploads)
            del uploads
            self.tensors = {n: cp.zeros(r.shape, np.dtype(r.dtype)) for n, r in rules.items()}
            for name, keys in self.tensors.items():
                if name.startswith("index_keys_"):   # finite FP8 codes (no 0x7F/0xFF), scale 1
                    bits = cp.random.randint(0, 2**31, size=keys.size // 4, dtype=cp.int32)
                    keys[...] = bits.view(cp.uint8).reshape(keys.shape) & 0x77
                    keys[:, 128:132] = cp.asarray(np.frombuffer(np.float32(1).tobytes(),
                                                                np.uint8))
            cp.get_default_memory_pool().free_all_blocks()
            cp.cuda.Device().synchronize()
            self.upload_s = time.perf_counter() - t0
            bound = {n: int(t.data.ptr) for n, t in self.tensors.items()}
            step = StepContext(cfg, TP, rank, bundle, self.arena, bound, MAX_ROWS,
                               collectives=collectives, geometry=self.geometry)
            self.wire_plans(step)
        except BaseException:
            self.close()
            raise

    def wire_plans(self, step) -> None:
        """The decode step on the benchmark's stage modules (BENCH_MODULES unless given)."""
        self.step = step
        self.plan = wire(decode_plan(self.cfg), step, self.modules)
        self.plan.require_complete()

    def capture(self, plan, rows: int, relaunch=None):
        """A graph of `plan`'s step for `rows`: side stages beside the chain (executor/branches)."""
        from executor.graphs import Graph

        with Graph.capture(self.stream) as graph:
            plan.record(self.stream, rows, side=self.side, relaunch=relaunch)
        return graph

    def variant_graph(self, name: str, rows: int):
        """The step re-wired under STEP_VARIANTS[name], captured (constants restored after)."""
        with overrides(STEP_VARIANTS[name]()):
            plan = wire(decode_plan(self.cfg), self.step, self.modules)
            return self.capture(plan, rows)

    def load(self, case: Case, context: int, seed: int = SEED) -> None:
        from executor.emulate.ranks import fill_caller_tensors

        rows, history = row_batch(self.cfg, self.geometry, case, context,
                                  np.random.default_rng(seed))
        host = {n: np.zeros(self.tensors[n].shape, self.tensors[n].dtype)
                for n in metadata_names(self.cfg, self.geometry, self.dspark)}
        fill_caller_tensors(host, rows, history=history)
        for name, array in host.items():
            self.tensors[name].set(array)
        self.cp.cuda.Device().synchronize()

    def distinct_experts(self, built, rows: int) -> list[int]:
        """Run the step eagerly stage by stage; after each router, the distinct experts it
        picked for the `rows` rows (a host read: this pass is not timed, so it runs serial on
        one stream, side stages in their plan place)."""
        k = self.cfg.num_experts_per_tok
        out = []
        for stage, specs in built:
            for spec in specs:
                spec.launch(self.stream)
            if stage.range_name == "ffn.router":
                self.stream.synchronize()
                ids = self.arena.download("ffn.topk_ids", np.int32, (rows, k))
                if ids.min() < 0 or ids.max() >= self.cfg.n_routed_experts:
                    raise RuntimeError(f"{stage.name}: expert ids outside 0.."
                                       f"{self.cfg.n_routed_experts - 1}: {np.unique(ids)}")
                out.append(len(np.unique(ids)))
        self.stream.synchronize()
        return out

    def nonfinite(self, rows: int) -> int:
        from kernels.common_ref import BF16

        hidden = self.arena.download("hidden", BF16, (rows, self.cfg.hidden_size))
        return int(np.count_nonzero(~np.isfinite(hidden.astype(np.float32))))

    def close(self) -> None:
        getattr(self, "tensors", {}).clear()
        self.arena.close()
        self.cp.get_default_memory_pool().free_all_blocks()


def _capture(stream, specs):
    """A graph of `specs` in order on `stream` alone (serial): for the role-alone graphs, whose
    launches are one role's; whole steps go through `DeviceStep.capture` (side branches)."""
    from executor.graphs import Graph

    with Graph.capture(stream) as graph:
        for spec in specs:
            spec.launch(stream)
    return graph


# ---- a case's whole-step graphs, timed (also executor/bench_tp.py, one rank of four) ------------

# name -> the relaunch the step graph is captured with (Plan.record): the step's own launches, the
# same without the PDL attribute
STEP_RELAUNCHES = {"pdl": None, "plain": no_pdl}


@dataclass(frozen=True)
class CaseLaunches:
    """The step's launches for one bucket, built before anything is captured or timed."""

    built: list             # [(Stage, [LaunchSpec])] in stage order
    specs: list             # the same, flat
    weights: WeightBytes


def case_launches(cfg, dev, rows: int) -> CaseLaunches:
    built = dev.plan.launches(rows)
    specs = [s for _, group in built for s in group]
    return CaseLaunches(built, specs, step_weights(cfg, dev, specs))


def capture_step(dev, rows: int, relaunches: dict, graphs: dict) -> dict:
    """Into `graphs` (its caller closes them, also when a later capture fails): dev.plan's step
    graph per relaunch of `relaunches` (name -> relaunch, None for the launches as built)."""
    for name, relaunch in relaunches.items():
        graphs[name] = dev.capture(dev.plan, rows, relaunch=relaunch)
    return graphs


def close_graphs(graphs: dict) -> None:
    while graphs:
        graphs.popitem()[1].close()


@dataclass(frozen=True)
class ContextRun:
    """One (bucket, context) of the step: graph medians, distinct experts per router, bytes."""

    times: dict             # graph name -> median us (of the round medians)
    distinct: list          # distinct experts per layer
    nbytes: int             # bytes that must be read (step_bytes)
    rounds: dict = dataclasses.field(default_factory=dict)   # graph name -> each round's median


def _no_sync() -> None:
    pass


def run_context(dev, timer, case: Case, context: int, launches: CaseLaunches, graphs: dict,
                sync=_no_sync) -> ContextRun:
    """Load the case's rows at `context`, count the routers' distinct experts in an eager pass
    (serial, untimed), then each graph's time: the median over TIMING_ROUNDS round-robin rounds
    of the median of GRAPH_REPS replays queued back to back. `sync()` runs after the load and
    before each timing (bench_tp: a barrier of the ranks, which meet at every collective)."""
    dev.load(case, context)
    sync()
    distinct = dev.distinct_experts(launches.built, case.rows)
    rounds: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(TIMING_ROUNDS):            # round-robin: drift (clocks, heat) hits every graph
        for name, graph in graphs.items():
            sync()
            rounds[name].append(timer.median_us(lambda g=graph: g.launch(dev.stream),
                                                reps=GRAPH_REPS))
    times = {name: statistics.median(values) for name, values in rounds.items()}
    return ContextRun(times, distinct,
                      step_bytes(dev.cfg, launches.weights, case, context, distinct), rounds)


def _spread(rounds: dict[str, list[float]], name: str) -> str:
    values = rounds.get(name) or []
    return f"[{min(values):.1f}..{max(values):.1f}]" if values else ""


def case_tag(prefix: str, rows: int, context: int) -> str:
    """The metric prefix of one (bucket, context): "step R=6 ctx=64k"."""
    return f"{prefix} R={rows} ctx={_context_label(context)}"


def _measured_allreduce(ctx) -> dict[int, float] | None:
    """The collectives benchmark's one-shot floor from this run, when it ran first."""
    found = {}
    for row in ctx.metric_rows:
        for rows in ONESHOT_US:
            if row.metric == ONESHOT_METRIC.format(rows):
                found[rows] = row.value
    return found if len(found) >= 2 else None


def bench_step(ctx) -> None:
    """The whole-rank step per bucket and context (see the module docstring)."""
    cases = selected_cases(quick=ctx.quick)          # a bad CASES_ENV fails before packing
    cfg = bench_config()
    bundle = find_bundle(ctx, cfg)
    ar_table = _measured_allreduce(ctx)
    ar_source = "this run" if ar_table else "docs/perf.md run 16"
    t0 = time.perf_counter()
    # Caches for the selected cases only: what a step reads depends on its context, not on the
    # cache's capacity, and the capacity of every case (192 sequences x 64k) does not fit an
    # 80 GB H100 beside the rank's weights.
    # The rings keep every case's sizes (the kernels are built for them).
    chosen = cache_geometry(cfg, [case for case, _ in cases],
                            sorted({c for _, contexts in cases for c in contexts}))
    geometry = replace(cache_geometry(cfg), max_seqs=chosen.max_seqs,
                       num_pages=chosen.num_pages, pages_per_seq=chosen.pages_per_seq)
    dev = DeviceStep(ctx, cfg, bundle, geometry=geometry)
    ctx.metric("step: host packing of the representative layers (8 of 40)", dev.pack_s, "s")
    ctx.metric("step: host packing threads", dev.pack_workers, "")
    ctx.metric("step: arena upload + cache set-up", dev.upload_s, "s")
    lines = []
    try:
        for case, contexts in cases:
            lines += _bench_case(ctx, dev, case, contexts, cfg, ar_table)
    finally:
        dev.close()
    ctx.metric("step: benchmark wall time", time.perf_counter() - t0, "s")
    header = (f"{'R':>4s} {'ctx':>4s} {'graph us':>9s} {'+AR us':>8s} {'no-PDL g':>9s} "
              f"{'eager':>8s} {'eager-noPDL':>11s} {'GB read':>8s} {'GB/s':>6s} {'%4.8':>5s} "
              f"{'floor us':>8s} {'doc floor':>9s} {'experts':>7s}")
    print(f"step benchmark (rank 0 of TP4, 1 GPU; + AR: {ALLREDUCES} one-shot calls from "
          f"{ar_source})\n" + header + "\n" + "\n".join(lines), flush=True)


def _bench_case(ctx, dev, case: Case, contexts, cfg, ar_table) -> list[str]:
    launches = case_launches(cfg, dev, case.rows)
    specs = launches.specs
    ctx.metric(f"step R={case.rows}: dense weight bytes (the slices its launches read)",
               launches.weights.dense / 1e9, "GB")
    plain = without_pdl(specs)
    variants = selected_variants()
    graphs, roles, lines = {}, {}, []
    try:
        capture_step(dev, case.rows, STEP_RELAUNCHES, graphs)
        for name in variants:
            graphs[f"variant {name}"] = dev.variant_graph(name, case.rows)
        groups = {role: group for role, group in role_groups(launches.built).items() if group}
        for role, group in groups.items():            # each role alone: serial, one stream
            roles[role] = _capture(dev.stream, group)
        for context in contexts:
            run = run_context(dev, ctx.timer, case, context, launches, graphs)
            times, distinct, nbytes = run.times, run.distinct, run.nbytes
            # eager: the launches on one stream in stage order (no side branches), host-bound
            for name, group in (("eager", specs), ("eager_plain", plain)):
                times[name] = ctx.timer.median_us(lambda group=group: _eager(group, dev.stream),
                                                  reps=EAGER_REPS, warmup=1)
            label = _context_label(context)
            tag = case_tag("step", case.rows, context)
            row = ctx.bandwidth("step graph (rank 0 of TP4)", f"R{case.rows} {label}",
                                case.rows, times["pdl"], nbytes)
            with_ar = times["pdl"] + ALLREDUCES * allreduce_us(case.rows, ar_table)
            target = TARGET_MS.get(case.rows)
            ctx.metric(f"{tag}: graph replay", times["pdl"], "us")
            ctx.metric(f"{tag}: graph + AR (measured one-shot, {ALLREDUCES} calls)", with_ar, "us",
                       f"<= {target * 1e3:.0f}" if target else "",
                       with_ar <= target * 1e3 if target else None)
            ctx.metric(f"{tag}: graph without PDL", times["plain"], "us")
            for name in variants:
                us, spread = times[f"variant {name}"], _spread(run.rounds, f"variant {name}")
                ctx.metric(f"{tag}: graph of variant {name} (the step's wiring: "
                           f"{times['pdl']:.1f} us {_spread(run.rounds, 'pdl')}, "
                           f"{us - times['pdl']:+.1f} us; rounds {spread})", us, "us")
            ctx.metric(f"{tag}: eager with PDL", times["eager"], "us")
            ctx.metric(f"{tag}: eager without PDL", times["eager_plain"], "us")
            floor = nbytes / HBM_BYTES_PER_S * 1e6
            ctx.metric(f"{tag}: HBM floor of its bytes at 4.8 TB/s", floor, "us")
            ctx.metric(f"{tag}: distinct experts per layer (mean)", statistics.mean(distinct), "")
            ctx.metric(f"{tag}: non-finite values in the final hidden state",
                       dev.nonfinite(case.rows), "")
            _role_breakdown(ctx, dev, roles, {r: len(g) for r, g in groups.items()}, tag,
                            times["pdl"])
            doc = DOC_FLOOR_MS.get(case.rows)
            lines.append(f"{case.rows:>4d} {label:>4s} {times['pdl']:>9.1f} "
                         f"{with_ar:>8.1f} {times['plain']:>9.1f} {times['eager']:>8.1f} "
                         f"{times['eager_plain']:>11.1f} {nbytes / 1e9:>8.2f} {row.gbps:>6.0f} "
                         f"{row.pct_hbm:>5.1f} {floor:>8.1f} "
                         f"{f'{doc * 1e3:.0f}' if doc else '-':>9s} "
                         f"{statistics.mean(distinct):>7.1f}")
    finally:
        close_graphs(graphs)
        close_graphs(roles)
    return lines


def _role_breakdown(ctx, dev, roles: dict, launches: dict[str, int], tag: str,
                    graph_us: float) -> None:
    """Each role's launches alone in a graph: us per step and per launch (metrics and a table),
    and their sum against the whole-step graph: the difference is what the boundaries between
    roles cost (positive) or what overlapping them gains (negative: PDL across roles)."""
    rows, total_us = [], 0.0
    for role, graph in roles.items():
        us = ctx.timer.median_us(lambda g=graph: g.launch(dev.stream), reps=GRAPH_REPS)
        count = launches[role]
        ctx.metric(f"{tag}: role {role} (its launches alone, graph)", us, "us")
        ctx.metric(f"{tag}: role {role}: us per launch ({count} launches per step)",
                   us / count, "us")
        rows.append((role, count, us))
        total_us += us
    count = sum(launches.values())
    ctx.metric(f"{tag}: sum of the role graphs ({count} launches)", total_us, "us")
    ctx.metric(f"{tag}: graph minus the sum of the roles (boundaries, overlap)",
               graph_us - total_us, "us")
    lines = [f"{tag}, by role (its launches alone in a graph):",
             f"  {'role':<28s} {'launches':>8s} {'us/step':>9s} {'us/launch':>9s} {'%sum':>5s}"]
    lines += [f"  {role:<28s} {n:>8d} {us:>9.1f} {us / n:>9.2f} {100 * us / total_us:>5.1f}"
              for role, n, us in sorted(rows, key=lambda row: -row[2])]
    lines += [f"  {'sum of the roles':<28s} {count:>8d} {total_us:>9.1f} {total_us / count:>9.2f}",
              f"  {'whole-step graph':<28s} {'':>8s} {graph_us:>9.1f}",
              f"  {'graph - sum (boundaries)':<28s} {'':>8s} {graph_us - total_us:>9.1f}"]
    print("\n".join(lines), flush=True)


def _context_label(context: int) -> str:
    return f"{context // 1024}k" if context % 1024 == 0 else str(context)


def _eager(specs, stream) -> None:
    for spec in specs:
        spec.launch(stream)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m executor.bench_step",
                                     description="write the step benchmark's model config")
    parser.add_argument("--write-config", required=True, help="config.json path to write")
    args = parser.parse_args(argv)
    bench_config().to_json(args.write_config)
    print(f"wrote {args.write_config}: build its bundle with python -m kernels.build --config "
          f"{args.write_config} --tp 4 --out build/bundle-v41-bench-step-tp4")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
