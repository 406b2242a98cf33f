"""The first layers of v41-flash at real dimensions on 4 TP ranks: config, weights, reference run.

Used by tests/gpu/test_step_real_slice.py: `slice_config_v41`, `SharedSynth` (+ `prefetch`),
`pack_ranks` (the ranks' arena contents), `reference_in_process` (the TP4 reference's prefill
and steps in a spawned process, over the same drawn tensors).

What the slice keeps and what it cuts (each cut changes no value the test's steps compute):
- Layers 0..N-1 of v41-flash (`loader.synth.slice_config`): with N = 4 that is layer 0 (SWA, the
  first layer: summed mHC fn, broadcast streams), 1 (SWA + Engram), 2 (ratio 2, kv and index
  source: compressor, indexer, its own top-k) and 3 (ratio 2, reuse: layer 2's cache and top-k).
  Every role refers only to layers at or below it (model doc §1.2), so the slice's roles are
  v41's. The ratio-1 layers, the re-indexing layers and the candidate blocks start at layer 20.
- Real widths, 384 routed experts, top-6, the real 129280-token vocabulary (embed and lm_head).
- One DSpark stage, targeting layer N-1, instead of v41's three: the step's buffers are sized by
  the DSpark widths (loader.synth's slice drops DSpark altogether, which the dense specs cannot
  size: main_proj would have K = 0); the decode step never runs a DSpark stage. The DSpark round
  test (tests/gpu/test_dspark_round_real_slice.py) takes v41's three stages on layers 0-4,
  targeting layers 2-4 (`slice_config_v41(ROUND_LAYERS, 3)`; layer 4 is a ratio-2 reuse layer
  like 3): its kernels are then exactly v41's (one stage would need a main_proj of K = 5120 and
  an aux kernel of one target that no bundle builds; the aux is not wired at the Engram layer
  1), and `ROUND_MODULES` packs the stages' FFNs (128 experts each, e % 4's values) and the
  DSpark heads.
- Engram tables cut as the step benchmark cuts them (`bench_step.bench_config`, 16384 buckets a
  column instead of 16M; hashed and read the same way), and RoPE tables of 64k positions instead
  of 1M (the steps' positions are < 100; the table length is all it changes).
- Synthetic weights (`loader.synth`'s values), each tensor drawn ONCE and cut for every rank
  (`SharedSynth`), routed expert e holding expert e % 4's values (tests/stage_ffn_few_experts.py;
  the reference reads the same values through an aliasing fetch).
- Engram's compressed-vocab map: the caller's (`SharedSynth.set_vocab_map`; the GPU test draws a
  random non-identity one each run), served to the packing and to the reference alike.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import multiprocessing
import os
import re
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import numpy as np
import stage_ffn_few_experts

from executor.bench_step import bench_config
from executor.reference.step import ReferenceModel
from executor.reference.weights import RankWeights
from executor.wiring import arena_contents
from loader import engram_vocab, sharding
from loader.config import ModelConfig
from loader.schema import Fmt, checkpoint_schema
from loader.synth import ValueSource, slice_config

TP = 4
LAYERS = 4
DSPARK_STAGES = 1
ROUND_DSPARK_STAGES = 3         # v41's: the round test's kernels are v41-flash's (docstring)
ROUND_LAYERS = 5                # its targets 2-4: dspark.aux is not wired at an Engram layer (1)
ROPE_POSITIONS = 65536
SEED = 0
MODULES = ("executor.stages.mhc", "executor.stages.attn_proj", "executor.stages.attn_index",
           "stage_ffn_few_experts")
# the round test: + the DSpark stages' FFNs (tests/gpu/stage_ffn_few_experts_dspark.py), the
# verify plan's DSpark stages and the draft plan's
ROUND_MODULES = (*MODULES[:3], "stage_ffn_few_experts_dspark", "executor.stages.dspark",
                 "executor.stages.draft")
EXPERT = re.compile(r"((?:layers|mtp)\.\d+\.ffn\.experts\.)(\d+)(\..*)")


def slice_config_v41(layers: int = LAYERS, dspark_stages: int = DSPARK_STAGES) -> ModelConfig:
    """v41-flash (Engram tables cut as bench_config cuts them), layers 0..layers-1,
    `dspark_stages` DSpark stages targeting the last of them, RoPE tables of ROPE_POSITIONS."""
    full = bench_config()
    if not 1 <= dspark_stages <= min(layers, full.num_nextn_predict_layers):
        raise ValueError(f"slice_config_v41: {dspark_stages} DSpark stages; v41-flash has "
                         f"{full.num_nextn_predict_layers} and the slice {layers} layers")
    data = slice_config(full, layers).to_dict()
    top = full.num_hidden_layers
    data.update(num_nextn_predict_layers=dspark_stages,
                compress_ratios=[*full.compress_ratios[:layers],
                                 *full.compress_ratios[top:top + dspark_stages]],
                dspark_target_layer_ids=list(range(layers - dspark_stages, layers)),
                max_position_embeddings=ROPE_POSITIONS)
    return ModelConfig.from_dict(data, source=f"v41-flash layers 0..{layers - 1}, "
                                              f"{dspark_stages} DSpark stage(s) (test slice)")


class SharedSynth:
    """loader.synth's values of every tensor, drawn once and cut for each rank (synth_fetch draws
    a column-cut tensor whole for every rank: 4x the work). Thread-safe: the ranks pack in
    parallel; an FP8 weight and its scale come from one draw (one ValueSource per pair)."""

    def __init__(self, cfg: ModelConfig, seed: int = SEED):
        self.cfg, self.seed = cfg, seed
        self.specs = {t.name: t for t in checkpoint_schema(cfg)}
        self._full: dict[str, np.ndarray] = {}
        self._sources: dict[str, tuple[threading.Lock, ValueSource]] = {}
        self._lock = threading.Lock()

    def full(self, name: str) -> np.ndarray:
        try:
            spec = self.specs[name]
        except KeyError:
            raise KeyError(f"synthetic {self.cfg.model_type} slice: no tensor {name!r}") from None
        key = spec.base if spec.fmt in (Fmt.FP8, Fmt.FP8_SCALE) else name
        with self._lock:
            lock, source = self._sources.setdefault(key, (threading.Lock(), ValueSource(self.seed)))
        with lock:
            if name not in self._full:
                self._full[name] = source(spec)
            return self._full[name]

    def prefetch(self, unique_experts: int, workers: int | None = None) -> float:
        """Draw every tensor the slice reads (routed experts 0..unique_experts-1 only) in
        `workers` spawned processes (default: one per core, at most 16); returns the seconds.
        An FP8 weight and its scale are drawn together."""
        t0 = time.perf_counter()
        groups: dict[str, list[str]] = {}
        for name, spec in self.specs.items():
            m = EXPERT.fullmatch(name)
            if m and int(m[2]) >= unique_experts:
                continue
            key = spec.base if spec.fmt in (Fmt.FP8, Fmt.FP8_SCALE) else name
            groups.setdefault(key, []).append(name)
        # the largest draws first, so the long poles (embed, head) start at once
        jobs = sorted(groups.values(), key=lambda g: -sum(self.specs[n].nbytes for n in g))
        workers = workers or min(16, os.cpu_count() or 1)
        ctx = multiprocessing.get_context("spawn")     # the parent holds a CUDA context
        with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            for drawn in pool.map(_draw, [(self.cfg, self.seed, names) for names in jobs]):
                self._full.update(drawn)
        return time.perf_counter() - t0

    def set_vocab_map(self, vocab_map: np.ndarray) -> None:
        """Engram's compressed-vocab map for every fetch (shipped with the drawn tensors)."""
        self._full[engram_vocab.VOCAB_MAP_NAME] = engram_vocab.check_vocab_map(
            self.cfg, vocab_map, "SharedSynth.set_vocab_map")

    def fetch(self, rank: int, alias_experts: int | None = None):
        """fetch(name) -> rank's slice; alias_experts=u: expert e reads expert e % u."""
        def fetch(name: str) -> np.ndarray:
            if name == engram_vocab.VOCAB_MAP_NAME:     # replicated; KeyError when none is set
                if name not in self._full:
                    raise KeyError(f"synthetic slice: no Engram vocab map set ({name!r})")
                return self._full[name]
            m = EXPERT.fullmatch(name) if alias_experts else None
            if m:
                name = f"{m[1]}{int(m[2]) % alias_experts}{m[3]}"
            return sharding.shard(self.full(name), self.specs[name], TP, rank)
        return fetch

    def release(self) -> None:
        self._full.clear()
        self._sources.clear()


@functools.lru_cache(maxsize=2)
def _specs(cfg: ModelConfig) -> dict:
    return {t.name: t for t in checkpoint_schema(cfg)}


def _draw(job) -> dict[str, np.ndarray]:
    """(cfg, seed, names) -> {name: full tensor} (a worker process of SharedSynth.prefetch)."""
    cfg, seed, names = job
    specs = _specs(cfg)
    source = ValueSource(seed)
    return {name: source(specs[name]) for name in names}


def pack_ranks(cfg: ModelConfig, synth: SharedSynth, max_rows: int,
               workers: int | None = None, modules=MODULES) -> tuple[list, float]:
    """Every rank's (requests, uploads), each (rank, stage module) packed on its own thread (the
    NumPy work releases the GIL); and the seconds it took. A rank's contents are the boundary
    buffers, then per module its buffers and weights: arena_contents' slices and arrays, in
    another order (the arena places slices by name)."""
    t0 = time.perf_counter()
    boundary = len(arena_contents(cfg, TP, 0, synth.fetch(0), max_rows, ())[0])

    def part(rank: int, module: str):
        requests, uploads = arena_contents(cfg, TP, rank, synth.fetch(rank), max_rows, (module,))
        return requests[boundary:], uploads

    jobs = [(rank, module) for rank in range(TP) for module in modules]
    with ThreadPoolExecutor(workers or min(len(jobs), os.cpu_count() or 1)) as pool:
        parts = dict(zip(jobs, pool.map(lambda job: part(*job), jobs)))
    contents = []
    for rank in range(TP):
        requests = arena_contents(cfg, TP, rank, synth.fetch(rank), max_rows, ())[0]
        uploads = []
        for module in modules:
            requests += parts[rank, module][0]
            uploads += parts[rank, module][1]
        contents.append((requests, uploads))
    return contents, time.perf_counter() - t0


class _Experts:
    """A layer's routed experts for the reference, dequantized on first use, once per distinct
    value (expert e is e % unique's): the reference's own list dequantizes all 384."""

    def __init__(self, layer_weights, total: int, unique: int):
        self.lw, self.total, self.unique, self._done = layer_weights, total, unique, {}

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, e: int):
        if not 0 <= e < self.total:
            raise IndexError(f"expert {e} outside 0..{self.total - 1}")
        u = e % self.unique
        if u not in self._done:
            self._done[u] = self.lw._expert(u)
        return self._done[u]


def reference_model(cfg: ModelConfig, synth: SharedSynth, rank_workers: int = 1,
                    float64_cache_bytes: int = 0) -> ReferenceModel:
    """The NumPy reference of the slice at TP 4 over the same values the ranks pack
    (`rank_workers`, `float64_cache_bytes`: ReferenceModel's threads for the ranks' parts and
    its float64 weight copies; the same values either way)."""
    unique = stage_ffn_few_experts.UNIQUE_EXPERTS
    ranks = tuple(RankWeights(cfg, synth.fetch(r, alias_experts=unique), TP, r)
                  for r in range(TP))
    for rank in ranks:
        for spec in cfg.layers:                 # the DSpark stages' too (128 experts each)
            lw = rank.layer(spec.index)
            lw.experts = _Experts(lw, lw.num_experts, unique)       # overrides the cached list
    return ReferenceModel(cfg, ranks, rank_workers=rank_workers,
                          float64_cache_bytes=float64_cache_bytes)


@functools.lru_cache(maxsize=1)
def _openblas():
    """(get, set) of the thread count of numpy's own OpenBLAS (the wheel's numpy.libs copy, the
    library numpy already loaded), or None where numpy's BLAS is another or not found there."""
    libs = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
    for path in sorted(glob.glob(os.path.join(libs, "*openblas*.so*"))):
        lib = ctypes.CDLL(path)
        for prefix, suffix in (("scipy_openblas_", "64_"), ("openblas_", "")):
            try:
                get = getattr(lib, f"{prefix}get_num_threads{suffix}")
                put = getattr(lib, f"{prefix}set_num_threads{suffix}")
            except AttributeError:
                continue
            get.restype, put.argtypes = ctypes.c_int, [ctypes.c_int]
            return get, put
    return None


@contextlib.contextmanager
def blas_threads(count: int):
    """numpy's OpenBLAS on `count` threads inside the block, its previous count after; yields
    that previous count (None: numpy's BLAS could not be set, the block runs as it is).

    The reference runs the ranks' parts on rank_workers Python threads, each calling BLAS for
    many small products (a W4A8 expert is 45 of them); an OpenBLAS pool of one thread per core
    under each of them oversubscribes the cores, and its threads spin (on this CPU machine, one
    reference round: 59 s with 2 BLAS threads, 13 s with 1). A dgemm's threads split its rows
    and columns, never the sums, so the values do not depend on the count."""
    blas = _openblas()
    if blas is None:
        yield None
        return
    get, put = blas
    before = int(get())
    put(count)
    try:
        yield before
    finally:
        put(before)


# ---- the reference run, in its own process (overlapping the ranks' packing) ----------------------

MAX_CONTEXT = 128


def new_caches(cfg):
    """The sequence's reference caches (seeded page permutation: the same tables every call)."""
    from executor.reference.kvcache import KVCaches
    return KVCaches.allocate(cfg, max_seqs=1, max_context=MAX_CONTEXT)


def block_rows(caches, start: int, tokens, kind: str, pad_to: int = 8):
    """One block of line 0 at positions start.., padded to a bucket of `pad_to` rows."""
    from executor.reference.rows import RowBatch, RowBlock
    return RowBatch.from_blocks([RowBlock(0, start, tuple(tokens), kind)], caches.block_tables,
                                caches.ring_slots, pad_to=pad_to)


def reference_run(job):
    """(cfg, seed, drawn tensors, prompt, blocks) -> (caches after the prompt, [StepOutput] of
    each block): the reference prefills `prompt`, then runs each (kind, tokens) block at the next
    positions, every block accepted whole. Runs in a spawned process (reference_in_process); the
    Engram vocab map, when set, travels in the drawn tensors."""
    import copy

    import executor.reference.step as reference_step
    from executor.reference.prefill import prefill

    cfg, seed, drawn, prompt, blocks = job
    synth = SharedSynth(cfg, seed)
    synth._full.update(drawn)
    model = reference_model(cfg, synth)
    caches = new_caches(cfg)
    prefill(model, caches, 0, prompt)
    initial = copy.deepcopy(caches)
    seq, outs = list(prompt), []
    for kind, tokens in blocks:
        rows = block_rows(caches, len(seq), tokens, kind)
        seq += list(tokens)
        outs.append(reference_step.decode_step(model, rows, caches,
                                               [np.asarray(seq, np.int64)]))
    return initial, outs


def reference_in_process(cfg, synth: SharedSynth, prompt, blocks):
    """Start reference_run in a spawned process over synth's drawn tensors; a Future of its
    result (the caller packs and runs the ranks meanwhile)."""
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    future = pool.submit(reference_run, (cfg, synth.seed, dict(synth._full), list(prompt),
                                         list(blocks)))
    pool.shutdown(wait=False)
    return future
