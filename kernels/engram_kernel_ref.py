"""The Engram kernels: specs, grid rules, byte formulas, references and the gate's error bound.

Three launches per Engram layer on each rank (model doc §2.1 item 3, §2.2 E1 and E3; E2, `wkv`,
is the W8A16 dense family; the all-gather of the looked-up heads is a collective):

- `engram_hash_l{layer}`: token history -> hash ids. Inputs: tokens int32 [R, max_ngram] (RAW
  token ids, column k = the token at position p-k, newest first, as `step.ngram_lookback` lays it
  out and the rows prep / DSpark history kernels write it; entries with p-k < 0 are ignored),
  positions int32 [R] and the compressed-vocabulary map int32 [vocab_size]
  (`loader/engram_vocab.py`). Each history token goes through the map; the pad (p-k < 0) is the
  RAW pad id `engram_pad_token_id` put in before the map, i.e. the compressed pad is
  map[pad_id], as DeepSeek's `NgramHashMapping` sets `pad_id = lookup_table[pad_id]` and pads
  the compressed ids with it. A token outside [0, vocab_size) is read as the pad too: never a
  read off the map (the reference step refuses such ids before). Output: ids int64
  [R, orders·heads], `engram_ref.hash_ids` of that compressed history exactly: int64 products that
  wrap, XOR, a floored `mod` (a non-negative remainder, as NumPy's), plus the column's row offset.
  The layer's multipliers, primes, offsets, pad id and vocabulary size are compile-time
  constants, so each Engram layer has its own (tiny) kernel. `HASH_READS_MAP = False` builds the
  round-4 kernel instead (raw ids hashed as they are, the map pointer unread; same ABI).
- `engram_lookup`: ids of this rank's `cols` columns (starting at `first_col`) -> BF16
  [R, cols, head_dim] = FP8 E4M3 code x 2^(UE8M0 - 127), bitwise `engram_ref.lookup` rounded to
  BF16 for scale bytes <= 134 (values up to 448·2^7) and finite codes (the product is exact in
  BF16 from scale byte 3; below, both round the same way). An id
  outside this rank's rows [row_offset, row_offset + table_rows) writes NaN for its head instead of
  reading out of bounds. The table may be in device memory or in pinned host memory through UVA:
  the kernel only dereferences its pointers.
- `engram_gate`: streams X [R, n, D] BF16 and the `wkv` output [R, (n+1)·D] BF16 (n keys, then v)
  -> X_i += σ(sgnsqrt(max(|d_i|, 1e-6)))·v in one fp32 pass (`engram_ref.gate_update`; the kernel's
  summation order differs, so tests compare within `gate_error_bound`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels import engram_ref
from kernels.allreduce_ref import gather_pieces
from kernels.common_ref import (
    H200_NUM_SMS,
    ceil_div,
    check_rows,
    params_dict,
    persistent_grid,
    to_bf16,
)
from kernels.norm_ref import WARP, row_geometry

HASH_THREADS = 64                  # one thread per row: 3 CTAs at R = 192
LOOKUP_THREADS = 128
CODES_PER_THREAD = 16              # one 16-byte load of FP8 codes -> two 16-byte BF16 stores
MAX_SCALE_BYTE = 134               # 2^(s-7) must be a normal bf16 (the exact conversion trick)
GATE_SUMS = 3                      # Σx², Σk², Σ(x·q_w)(k·k_w) per stream
SQRT_CLAMP = 1e-6
FP8_BLOCK_ROWS = 32                 # the wkv's 32x32 scale blocks: a rank's pieces are whole ones
HASH_PARAMS = (("tokens", "u64"), ("positions", "u64"), ("vocab_map", "u64"), ("ids", "u64"),
               ("rows", "u32"))
HASH_READS_MAP = True              # False: the round-4 hash (raw ids; revert switch, same ABI)
LOOKUP_PARAMS = (("ids", "u64"), ("codes", "u64"), ("scales", "u64"), ("out", "u64"),
                 ("rows", "u32"), ("first_col", "u32"), ("row_offset", "u32"),
                 ("table_rows", "u32"))
GATE_PARAMS = (("streams", "u64"), ("keys_and_value", "u64"), ("q_weight", "u64"),
               ("k_weight", "u64"), ("out", "u64"), ("rows", "u32"), ("eps", "f32"))


@dataclass(frozen=True)
class EngramHashSpec:
    """Hash ids of one Engram layer: its constants are baked into the kernel."""

    name: str
    layer: int
    max_ngram: int
    heads: int
    multipliers: tuple[int, ...]          # [max_ngram], odd int64
    primes: tuple[int, ...]               # [orders·heads], column (n-2)·heads + h
    offsets: tuple[int, ...]              # first table row of each column
    pad_id: int                           # raw token id (mapped like any other token)
    vocab_size: int                       # map entries; tokens outside [0, vocab) read as pad
    mapped: bool = True                   # False: raw ids hashed, the map pointer never read
    params: tuple[tuple[str, str], ...] = HASH_PARAMS
    block: tuple[int, int, int] = (HASH_THREADS, 1, 1)
    smem_bytes: int = 0

    @property
    def cols(self) -> int:
        return (self.max_ngram - 1) * self.heads

    def grid(self, rows: int) -> tuple[int, int, int]:
        check_rows(rows, self.name)
        return (ceil_div(rows, HASH_THREADS), 1, 1)

    def bytes_moved(self, rows: int) -> int:
        """Tokens, positions, one map entry per token (mapped), ids written."""
        map_reads = 4 * self.max_ngram if self.mapped else 0
        return rows * (4 * self.max_ngram + 4 + map_reads + 8 * self.cols)

    def to_dict(self) -> dict:
        return {"family": "engram", "name": self.name, "layer": self.layer,
                "max_ngram": self.max_ngram, "heads": self.heads,
                "multipliers": list(self.multipliers), "primes": list(self.primes),
                "offsets": list(self.offsets), "pad_id": self.pad_id,
                "vocab_size": self.vocab_size, "mapped": self.mapped,
                "params": params_dict(self.params), "block": list(self.block),
                "smem_bytes": self.smem_bytes}


@dataclass(frozen=True)
class EngramLookupSpec:
    """FP8 table lookup of `cols` consecutive hash columns (one rank's heads) of `total_cols`."""

    name: str
    head_dim: int
    cols: int
    total_cols: int
    params: tuple[tuple[str, str], ...] = LOOKUP_PARAMS
    block: tuple[int, int, int] = (LOOKUP_THREADS, 1, 1)
    smem_bytes: int = 0

    @property
    def threads_per_head(self) -> int:
        return self.head_dim // CODES_PER_THREAD

    @property
    def max_ctas(self) -> int:
        return H200_NUM_SMS * 4

    def grid(self, rows: int) -> tuple[int, int, int]:
        check_rows(rows, self.name)
        return persistent_grid(rows * self.cols * self.threads_per_head, LOOKUP_THREADS,
                               self.max_ctas)

    def bytes_moved(self, rows: int) -> int:
        return lookup_bytes(rows, self.cols, self.head_dim)

    def to_dict(self) -> dict:
        return {"family": "engram", "name": self.name, "head_dim": self.head_dim,
                "cols": self.cols, "total_cols": self.total_cols,
                "params": params_dict(self.params), "block": list(self.block),
                "smem_bytes": self.smem_bytes, "max_ctas": self.max_ctas}


@dataclass(frozen=True)
class EngramGateSpec:
    """The gate over `streams` streams of width D: one CTA per row (grid-stride over rows)."""

    name: str
    width: int
    streams: int
    threads_per_row: int
    vecs_per_thread: int
    params: tuple[tuple[str, str], ...] = GATE_PARAMS
    smem_bytes: int = 0

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.threads_per_row, 1, 1)

    @property
    def warps(self) -> int:
        return ceil_div(self.threads_per_row, WARP)

    @property
    def max_ctas(self) -> int:
        return H200_NUM_SMS * 4

    def grid(self, rows: int) -> tuple[int, int, int]:
        check_rows(rows, self.name)
        return (min(rows, self.max_ctas), 1, 1)

    def bytes_moved(self, rows: int) -> int:
        return gate_bytes(rows, self.streams, self.width)

    def to_dict(self) -> dict:
        return {"family": "engram", "name": self.name, "width": self.width,
                "streams": self.streams, "threads_per_row": self.threads_per_row,
                "vecs_per_thread": self.vecs_per_thread, "params": params_dict(self.params),
                "block": list(self.block), "smem_bytes": self.smem_bytes,
                "max_ctas": self.max_ctas}


# ---- spec construction ---------------------------------------------------------------------------

def make_hash_spec(cfg, layer: int, mapped: bool = HASH_READS_MAP) -> EngramHashSpec:
    multipliers = tuple(int(m) for m in cfg.engram_hash_multipliers(layer))
    primes = tuple(int(p) for p in cfg.engram_primes_flat(layer))
    offsets = tuple(int(o) for o in cfg.engram_offsets(layer))
    if offsets[-1] + primes[-1] >= 2**31:
        raise ValueError(f"engram layer {layer}: {offsets[-1] + primes[-1]} table rows exceed "
                         "the lookup kernel's u32 row ids")
    return EngramHashSpec(f"engram_hash_l{layer}_n{cfg.engram_max_ngram_size}"
                          f"_h{cfg.engram_n_heads}" + ("_map" if mapped else ""), layer,
                          cfg.engram_max_ngram_size, cfg.engram_n_heads, multipliers, primes,
                          offsets, int(cfg.engram_pad_token_id), int(cfg.vocab_size), mapped)


def hash_spec_from_dict(name: str, sp: dict) -> EngramHashSpec:
    """The EngramHashSpec a manifest record (`to_dict`) describes."""
    return EngramHashSpec(name, sp["layer"], sp["max_ngram"], sp["heads"],
                          tuple(sp["multipliers"]), tuple(sp["primes"]), tuple(sp["offsets"]),
                          sp["pad_id"], sp["vocab_size"], sp["mapped"])


def make_lookup_spec(head_dim: int, cols: int, total_cols: int) -> EngramLookupSpec:
    if head_dim <= 0 or head_dim % 32:
        raise ValueError(f"engram head_dim {head_dim} must be a positive multiple of 32 "
                         "(one UE8M0 scale per 32 codes)")
    if not 1 <= cols <= total_cols:
        raise ValueError(f"engram lookup: {cols} columns of {total_cols}")
    return EngramLookupSpec(f"engram_lookup_d{head_dim}_c{cols}of{total_cols}", head_dim, cols,
                            total_cols)


def make_gate_spec(width: int, streams: int) -> EngramGateSpec:
    threads, vecs = row_geometry(width)
    warps = ceil_div(threads, WARP)
    smem = 2 * 4 * warps * streams * GATE_SUMS if warps > 1 else 0
    return EngramGateSpec(f"engram_gate_d{width}_s{streams}", width, streams, threads, vecs,
                          smem_bytes=smem)


def engram_specs(cfg, tp: int) -> list:
    """Per Engram layer its hash kernel; one lookup for this TP's columns; one gate."""
    if not cfg.engram_layer_ids:
        return []
    total = cfg.engram_num_hash_cols
    if total % tp:
        raise ValueError(f"engram: {total} hash columns do not split over tp = {tp}")
    return ([make_hash_spec(cfg, layer) for layer in cfg.engram_layer_ids]
            + [make_lookup_spec(cfg.engram_head_dim, total // tp, total),
               make_gate_spec(cfg.hidden_size, cfg.hc_mult)])


# ---- byte formulas -------------------------------------------------------------------------------

# ---- the wkv output, column-sharded over TP (round 8) --------------------------------------------
#
# Each rank computes (n + 1) D / tp of the wkv's output columns (its weight rows and their 32x32
# scale rows) and the all-gather `engram.kv_allgather` puts every rank's columns in place. A rank's
# block is wider than the all-reduce's slot (6400 > D = 5120 at TP 4), so it is gathered as P
# row-interleaved pieces (allreduce_ref.gather_pieces): rank s owns the output columns
# h * (N / P) + s * C + [0, C) for h < P (C = N / (P * tp)), whole 32-row FP8 blocks, and the
# gathered [R, N] is the replicated wkv's output column for column. Each bf16 output column is
# one fp32 dot product rounded once, whichever rank computes it: sharding N changes no rounding.


def kv_pieces(cfg, tp: int) -> tuple[int, int]:
    """(P, C): a rank's wkv output columns as P pieces of C columns (C <= D, whole FP8 blocks)."""
    n = (cfg.hc_mult + 1) * cfg.hidden_size
    if n % tp:
        raise ValueError(f"Engram wkv: {n} output columns do not split over tp={tp}")
    pieces = gather_pieces(cfg.hidden_size, n // tp, FP8_BLOCK_ROWS) if tp > 1 else 1
    return pieces, n // tp // pieces


def kv_rank_rows(cfg, tp: int, rank: int) -> np.ndarray:
    """The wkv weight rows (= output columns) rank `rank` computes, in its local order: piece h's
    C rows h * (N / P) + rank * C + [0, C), pieces in order."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside 0..{tp - 1}")
    pieces, c = kv_pieces(cfg, tp)
    stride = tp * c
    return np.concatenate([np.arange(h * stride + rank * c, h * stride + (rank + 1) * c)
                           for h in range(pieces)])


def kv_rank_weight(cfg, tp: int, rank: int, weight: np.ndarray, scale: np.ndarray):
    """The rank's wkv weight [N / tp, K] and scale [N / (32 tp), K / 32] rows (copies) of the
    replicated checkpoint pair, in the order of `kv_rank_rows`."""
    rows = kv_rank_rows(cfg, tp, rank)
    weight, scale = np.asarray(weight), np.asarray(scale)
    n = (cfg.hc_mult + 1) * cfg.hidden_size
    if weight.shape[0] != n or scale.shape[0] * FP8_BLOCK_ROWS != n:
        raise ValueError(f"Engram wkv: weight {weight.shape} / scale {scale.shape}, expected "
                         f"{n} rows (the replicated checkpoint tensor)")
    return (np.ascontiguousarray(weight[rows]),
            np.ascontiguousarray(scale[rows[::FP8_BLOCK_ROWS] // FP8_BLOCK_ROWS]))


def lookup_bytes(rows: int, cols: int, head_dim: int) -> int:
    """Ids read, FP8 codes and UE8M0 scales read, BF16 values written."""
    return rows * cols * (8 + head_dim + head_dim // 32 + 2 * head_dim)


def gate_bytes(rows: int, streams: int, width: int) -> int:
    """X read and written, the wkv output read, q_weight and k_weight read once."""
    return rows * width * 2 * (2 * streams + streams + 1) + 2 * streams * width * 2


# ---- references ----------------------------------------------------------------------------------

def hash_ref(spec: EngramHashSpec, tokens: np.ndarray, positions: np.ndarray,
             vocab_map: np.ndarray) -> np.ndarray:
    """What the hash kernel writes: int64 [R, cols] (`engram_ref`, exactly): raw tokens (pad at
    p-k < 0 and for ids off the map) through `vocab_map` int32 [vocab_size], then hashed."""
    tokens, positions = np.asarray(tokens), np.asarray(positions)
    vocab_map = np.asarray(vocab_map)
    if tokens.dtype != np.int32 or positions.dtype != np.int32 or vocab_map.dtype != np.int32:
        raise TypeError(f"{spec.name}: tokens, positions and vocab_map must be int32, got "
                        f"{tokens.dtype}, {positions.dtype}, {vocab_map.dtype}")
    if vocab_map.shape != (spec.vocab_size,):
        raise ValueError(f"{spec.name}: vocab_map must be [{spec.vocab_size}], got "
                         f"{list(vocab_map.shape)}")
    history = engram_ref.ngram_history(tokens, positions.astype(np.int64), spec.max_ngram,
                                       spec.pad_id)
    if spec.mapped:
        off_map = (history < 0) | (history >= spec.vocab_size)
        history = engram_ref.compress(np.where(off_map, spec.pad_id, history), vocab_map)
    primes = np.array(spec.primes, np.int64).reshape(spec.max_ngram - 1, spec.heads)
    return engram_ref.hash_ids(history, np.array(spec.multipliers, np.int64), primes)


def lookup_ref(spec: EngramLookupSpec, ids: np.ndarray, codes: np.ndarray, scales: np.ndarray,
               first_col: int, row_offset: int) -> np.ndarray:
    """What the lookup kernel writes: BF16 [R, cols, head_dim]; NaN heads for ids off the table."""
    ids = np.asarray(ids, np.int64)
    if ids.ndim != 2 or ids.shape[1] != spec.total_cols:
        raise ValueError(f"{spec.name}: ids must be [R, {spec.total_cols}], got {ids.shape}")
    mine = ids[:, first_col:first_col + spec.cols]
    local = mine - int(row_offset)
    valid = (local >= 0) & (local < codes.shape[0])
    safe = np.where(valid, mine, int(row_offset))
    values = engram_ref.lookup(safe, codes, scales, row_offset)
    values[~valid] = np.nan
    return to_bf16(values)


def gate_ref(streams: np.ndarray, keys_and_value: np.ndarray, q_weight: np.ndarray,
             k_weight: np.ndarray, eps: float) -> np.ndarray:
    """The model reference of the gate: BF16 [R, n, D]."""
    return to_bf16(engram_ref.gate_update(streams, keys_and_value, q_weight, k_weight, eps))


def gate_exact(streams, keys_and_value, q_weight, k_weight, eps: float):
    """Float64 (out, d, t, v): out = X + g·v unrounded, d the gate logits [R, n], t = the same sum
    over |terms| (scale of d's rounding error), v the value broadcast [R, 1, D]."""
    rows, n, dim = streams.shape
    x = np.asarray(streams, np.float64)
    kv = np.asarray(keys_and_value, np.float64)
    keys, value = kv[:, :n * dim].reshape(rows, n, dim), kv[:, n * dim:][:, None, :]
    rx = 1.0 / np.sqrt(np.mean(x * x, axis=-1) + eps)
    rk = 1.0 / np.sqrt(np.mean(keys * keys, axis=-1) + eps)
    terms = (x * np.asarray(q_weight, np.float64)) * (keys * np.asarray(k_weight, np.float64))
    d = rx * rk * terms.sum(axis=-1) / np.sqrt(dim)
    t = rx * rk * np.abs(terms).sum(axis=-1) / np.sqrt(dim)
    s = np.sign(d) * np.sqrt(np.maximum(np.abs(d), SQRT_CLAMP))
    g = 1.0 / (1.0 + np.exp(-s))
    return x + g[:, :, None] * value, d, t, value


def gate_sum_depth(spec: EngramGateSpec) -> int:
    """Additions a term of the kernel's sums goes through at most: its thread's sequential fma
    chain (8 per vector), the warp butterfly (5), the warp totals in order (warps - 1)."""
    return 8 * spec.vecs_per_thread + 5 + spec.warps - 1


def gate_error_bound(streams, keys_and_value, q_weight, k_weight, eps: float,
                     spec: EngramGateSpec) -> tuple:
    """(exact float64 output, per-element bound) for the kernel's fp32 evaluation of the gate
    (and for the NumPy reference's, whose pairwise sums are no deeper).

    With u = 2^-24 and h = `gate_sum_depth(spec)` + 8 (the products' three roundings and the
    scalar tail), Σ(x·q_w)(k·k_w) is within h·u·Σ|terms| and each rstd within h·u/2 + 2u
    relative (a sum of squares, sqrt, reciprocal), so |δd| <= 3·h·u·t with t = rx·rk·Σ|terms|/√D
    (>= |d|). The signed root magnifies δd by at most 1/(2√m), m = max(|d| - δd, 1e-6); σ' <= 1/4;
    exp (ex2.approx of x·log2 e) adds <= 2^-20 to g. X + g·v, rounded in fp32 (at most twice) and
    once to BF16, is then within |v|·δg + 2^-22·(|X| + |v|) + half a BF16 ulp of the exact value.
    """
    exact, d, t, value = gate_exact(streams, keys_and_value, q_weight, k_weight, eps)
    depth = gate_sum_depth(spec) + 8
    dd = 3.0 * depth * 2.0**-24 * t
    m = np.maximum(np.abs(d) - dd, SQRT_CLAMP)
    dg = 0.25 * dd / (2.0 * np.sqrt(m)) + 2.0**-20
    half_ulp = 0.5 * bf16_ulp(exact)
    x = np.abs(np.asarray(streams, np.float64))
    bound = np.abs(value) * dg[:, :, None] + 2.0**-22 * (x + np.abs(value)) + half_ulp
    return exact, bound


def bf16_ulp(x: np.ndarray) -> np.ndarray:
    """The BF16 ulp at |x| (normal range; 2^-133 below it)."""
    ax = np.abs(np.asarray(x, np.float64))
    exp = np.floor(np.log2(np.maximum(ax, 2.0**-126)))
    return np.exp2(exp - 7)


def check_lookup_table(codes: np.ndarray, scales: np.ndarray, head_dim: int) -> None:
    """Host-side check of a table shard against the kernel's exactness conditions."""
    if codes.dtype != np.uint8 or codes.ndim != 2 or codes.shape[1] != head_dim:
        raise ValueError(f"engram table codes must be uint8 [rows, {head_dim}], got "
                         f"{codes.dtype} {codes.shape}")
    if scales.dtype != np.uint8 or scales.shape != (codes.shape[0], head_dim // 32):
        raise ValueError(f"engram table scales must be uint8 [{codes.shape[0]}, {head_dim // 32}],"
                         f" got {scales.dtype} {scales.shape}")
    if scales.size and int(scales.max()) > MAX_SCALE_BYTE:
        raise ValueError(f"engram table scales: byte {int(scales.max())} > {MAX_SCALE_BYTE} "
                         "(the kernel's exact FP8 -> BF16 conversion needs 2^(s-7) normal)")


def predicted_us(rows: int, width: int = 5120, cols: int = 6, head_dim: int = 256,
                 streams: int = 4) -> float:
    """Three launches, each latency-bound at decode sizes (~2-3 us each) plus its HBM bytes."""
    return 7.0 + (lookup_bytes(rows, cols, head_dim) + gate_bytes(rows, streams, width)) / 4.8e6
