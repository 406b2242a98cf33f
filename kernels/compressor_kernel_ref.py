"""Compressor kernels (A2, A7-A9): specs, byte formulas, the batched reference and its tolerances.

Two kernels per ratio (model doc §2.2, `kernels/compressor_ref.py` for the per-row maths):

`compressor_proj_r{r}_k{D}`: kv_score fp32 [R, 512 r] = x bf16 [R, D] @ W^T, W = wkv|wgate fp32
[1024, D] (r = 2) or wkv bf16 [512, D] (r = 1). One warp per output column and tile of 8 rows:
lane l sums the 4-dim chunks l, l + 32, ... in order with fma, then a 5-step xor butterfly.
Bandwidth-bound: the weight is read once per 8 rows (21 MB fp32 at r = 2, D = 5120).

`compressor_publish_r{r}_d512`: one CTA of 128 threads per row, thread t owns dims 4t..4t+3.
  r = 2: write the row's (kv | score) to the fp32 ring, row p % 8 of its state line; at odd p pool
         the pair (p-1, p): the even partner comes from this launch's kv_score when the previous
         row is position p-1 of the same sequence (so rows of one launch never race on the ring),
         from the ring otherwise (it was written by an earlier step).
  r = 1: the row's kv is the pooled value, every row publishes.
  latent = RMSNorm_c(pooled) in fp32; entry p // r of the sequence (through its block table)
  <- 584-byte record of RoPE(latent, r (p // r)); its 132-byte index key
  <- FP8(RoPE(RMSNorm_k(latent @ wk^T))) with wk bf16 [128, 512] on the un-rotated latent.
Padding rows (seq_index < 0) and entries on an unallocated page (-1) write nothing.

Numerics are fp32 in the kernels (ex2.approx in the softmax, fp32 dot products), the reference is
`compressor_ref` (float64 dots); records are compared decoded, with `entry_tolerance` /
`key_tolerance` below, not bytewise (an FP8 rounding boundary can fall either side).
PTX ABIs: see PROJ_PARAMS / PUBLISH_PARAMS.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels import compressor_ref, kvrecord_ref, rope_ref
from kernels.common_ref import ceil_div, check_rows, params_dict

HEAD_DIM = compressor_ref.HEAD_DIM            # 512
INDEX_DIM = kvrecord_ref.INDEX_DIM            # 128
RING_ROWS = 8                                  # pow2 >= max block rows (6) + 2
RING_WIDTH = 2 * HEAD_DIM                      # (kv | score) fp32
PROJ_ROW_TILE = 8                              # rows per warp in the projection
PROJ_WARPS = 4                                 # output columns per CTA
PUBLISH_THREADS = 128
PUBLISH_SMEM = 2 * 1024 + 64                   # latent fp32 [512] + three 4-warp partials
MAX_ROWS = 4096

# Round 9 variants (docs/notes/compressor-design.md "Round 9"); "" is the session-1 kernel.
# "bulk" projection: one CTA per 4 output columns streams its weight rows and the 8-row x tile
# through a ring of shared-memory slots (bulk copies on mbarriers) and loops over the row tiles;
# "bulk16" the same with 16-row tiles (half the weight re-reads from L2 above R = 8).
# "staged" publish: wk bulk-copied into shared memory at the start, independent loads first, a
# grid of at most PUBLISH_STAGED_CTAS CTAs looping over the rows.
PROJ_VARIANTS = ("", "bulk", "bulk16", "bulkr")  # bulk16: 16-row tiles; bulkr: real x rows
PUBLISH_VARIANTS = ("", "staged")
PROJ_BULK_COLS = 4                             # output columns per CTA
PROJ_BULK_STAGE_K = 512                        # dims per ring slot (4 per thread, 128 threads)
PROJ_BULK_ROW_TILES = {"bulk": 8, "bulk16": 16, "bulkr": 8}
# "bulkr": "bulk" that copies only the x rows < R into a slot (the clamped duplicates of the
# last row were 7/8 of the x copies at R = 1, all of the same L2 lines; rows >= R compute on
# stale shared memory and are never stored). Round 9b, after run r9b; run r9d (H100,
# alone): r = 2 12.86 / 12.96 us at R = 1 / 6 against bulk's 15.15 / 13.33.
FAST_PROJ_16_ABOVE = 8                         # the step's r = 2 projection: bulk16 above R = 8
PUBLISH_STAGED_CTAS = 128
PUBLISH_STAGED_WK_AT = 2176                    # latent, partials, mbarrier, then wk bf16 [128, 512]
PUBLISH_STAGED_SMEM = PUBLISH_STAGED_WK_AT + 128 * 512 * 2


@dataclass(frozen=True)
class ProjBulkLayout:
    """Shared memory of the bulk projection: `slots` slots of [W cols x stage_k | x row_tile x
    stage_k bf16], then the warp partials f32 [warps, cols x row_tile], one mbarrier per slot."""
    row_tile: int
    threads: int
    stage_k: int
    stages: int              # ring slots a pass over K takes (hidden / stage_k)
    slots: int
    w_bytes: int             # per slot
    x_bytes: int
    parts_at: int
    bars_at: int
    smem_bytes: int

    @property
    def slot_bytes(self) -> int:
        return self.w_bytes + self.x_bytes

    @property
    def warps(self) -> int:
        return self.threads // 32


def proj_bulk_layout(ratio: int, hidden: int, row_tile: int = PROJ_ROW_TILE) -> ProjBulkLayout:
    """Slots: r = 2 4 x 16 KB (24 KB with 16-row tiles; 2 CTAs an SM: 64 KB of weights in flight
    an SM); r = 1 has half the weight bytes a slot and one CTA an SM, so 8 slots of 12 (20) KB."""
    stage_k = min(PROJ_BULK_STAGE_K, hidden)
    threads = stage_k // 4
    wb = 4 if ratio == 2 else 2
    slots = 4 if ratio == 2 else 8
    w_bytes = PROJ_BULK_COLS * stage_k * wb
    x_bytes = row_tile * stage_k * 2
    parts_at = slots * (w_bytes + x_bytes)
    bars_at = parts_at + (threads // 32) * PROJ_BULK_COLS * row_tile * 4
    return ProjBulkLayout(row_tile, threads, stage_k, hidden // stage_k, slots, w_bytes, x_bytes, parts_at,
                          bars_at, bars_at + 8 * slots)

PROJ_PARAMS = (("x", "u64"), ("w", "u64"), ("out", "u64"), ("rows", "u32"))
PUBLISH_PARAMS = (("kv_score", "u64"), ("ring", "u64"), ("positions", "u64"),
                  ("seq_index", "u64"), ("state_lines", "u64"), ("block_tables", "u64"),
                  ("norm_w", "u64"), ("wk", "u64"), ("k_norm", "u64"), ("table", "u64"),
                  ("cache", "u64"), ("keys", "u64"), ("rows", "u32"), ("pages_per_seq", "u32"),
                  ("page_size", "u32"), ("num_positions", "u32"), ("eps", "f32"))


@dataclass(frozen=True)
class CompressorSpec:
    name: str
    kind: str               # "proj" | "publish"
    ratio: int
    hidden: int             # D of the projection input (publish: 512)
    params: tuple[tuple[str, str], ...]
    block: tuple[int, int, int] = (PUBLISH_THREADS, 1, 1)
    smem_bytes: int = 0
    variant: str = ""       # PROJ_VARIANTS / PUBLISH_VARIANTS

    @property
    def out_cols(self) -> int:
        return HEAD_DIM * self.ratio

    @property
    def weight_bytes_per_value(self) -> int:
        return 4 if self.ratio == 2 else 2

    def grid(self, rows: int) -> tuple[int, int, int]:
        check_rows(rows, self.name)
        if rows > MAX_ROWS:
            raise ValueError(f"{self.name}: {rows} rows, at most {MAX_ROWS}")
        if self.kind == "proj" and self.variant:                # loops over the row tiles
            return (self.out_cols // PROJ_BULK_COLS, 1, 1)
        if self.kind == "proj":
            return (self.out_cols // PROJ_WARPS, ceil_div(rows, PROJ_ROW_TILE), 1)
        if self.variant == "staged":                              # loops over the rows
            return (min(rows, PUBLISH_STAGED_CTAS), 1, 1)
        return (rows, 1, 1)

    def bytes_moved(self, rows: int, publishing: int | None = None) -> int:
        """HBM bytes the kernel must move: the floor, weights once (the session-1 projection
        re-reads them per tile of 8 rows, from L2 after the first: 21 MB fit the 50 MB L2; the
        bulk one streams them once per tile through its ring, also from L2 after the first)."""
        if self.kind == "proj":
            return (self.out_cols * self.hidden * self.weight_bytes_per_value
                    + rows * self.hidden * 2 + rows * self.out_cols * 4)
        publishing = rows if publishing is None else publishing
        ring = rows * RING_WIDTH * 4 * (2 if self.ratio == 2 else 0)   # write + partner read
        per_pub = (kvrecord_ref.KV_RECORD_BYTES + kvrecord_ref.INDEX_RECORD_BYTES
                   + 2 * rope_ref.TABLE_BYTES_PER_POSITION)
        weights = HEAD_DIM * 4 + INDEX_DIM * HEAD_DIM * 2 + INDEX_DIM * 4
        return rows * (self.out_cols * 4 + 12) + ring + publishing * per_pub + weights

    def to_dict(self) -> dict:
        out = {"family": "compressor", "name": self.name, "kind": self.kind,
               "ratio": self.ratio, "hidden": self.hidden, "params": params_dict(self.params),
               "block": list(self.block), "smem_bytes": self.smem_bytes}
        if self.variant:            # session-1 records stay as they were
            out["variant"] = self.variant
        return out


def _suffix(variant: str) -> str:
    return f"_{variant}" if variant else ""


def make_proj_spec(ratio: int, hidden: int, variant: str = "") -> CompressorSpec:
    if ratio not in (1, 2) or hidden % 128 or variant not in PROJ_VARIANTS:
        raise ValueError(f"compressor projection: ratio {ratio} (1 or 2), hidden {hidden} "
                         f"(a multiple of 128), variant {variant!r} (one of {PROJ_VARIANTS})")
    name = f"compressor_proj_r{ratio}_k{hidden}{_suffix(variant)}"
    if variant == "bulk16" and ratio == 1:
        # 16 rows x bf16 unpacking spill at v41 widths; 5 MB re-read from L2 per 8-row tile is
        # cheap, so r = 1 takes "bulk" at every R.
        raise ValueError(f"{name}: the 16-row bulk projection is built for ratio 2 only")
    if variant:
        if hidden % min(PROJ_BULK_STAGE_K, hidden) or hidden < 128:
            raise ValueError(f"{name}: hidden {hidden} is not a multiple of "
                             f"{PROJ_BULK_STAGE_K} (or below it)")
        lay = proj_bulk_layout(ratio, hidden, PROJ_BULK_ROW_TILES[variant])
        return CompressorSpec(name, "proj", ratio, hidden, PROJ_PARAMS, (lay.threads, 1, 1),
                              lay.smem_bytes, variant)
    return CompressorSpec(name, "proj", ratio, hidden, PROJ_PARAMS, (32 * PROJ_WARPS, 1, 1))


def make_publish_spec(ratio: int, variant: str = "") -> CompressorSpec:
    if ratio not in (1, 2) or variant not in PUBLISH_VARIANTS:
        raise ValueError(f"compressor publish: ratio {ratio}, expected 1 or 2; variant "
                         f"{variant!r} (one of {PUBLISH_VARIANTS})")
    name = f"compressor_publish_r{ratio}_d{HEAD_DIM}{_suffix(variant)}"
    smem = PUBLISH_STAGED_SMEM if variant == "staged" else PUBLISH_SMEM
    return CompressorSpec(name, "publish", ratio, HEAD_DIM, PUBLISH_PARAMS, smem_bytes=smem,
                          variant=variant)


# ---- batched reference (GPU layouts) ---------------------------------------------------------

def proj_tolerance(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """[R, N] bound of the fp32 projection: gamma_n sum |x||w|, n = D/128 chunks x 4 + 5 + 1.

    Each lane adds D/32 products in sequence (one rounding each, the fma's) and the butterfly
    adds 5 more: the standard recursive-summation bound with n = D/32 + 6 terms.
    """
    n = x.shape[1] // 32 + 6
    mag = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
    return n * 2.0 ** -24 * mag + 1e-30


@dataclass
class PublishState:
    """The GPU-side state the publish kernel reads and writes (float32 ring, record caches)."""
    ring: np.ndarray          # f32 [lines, 8, 1024]
    cache: np.ndarray         # u8 [slots, 584]
    keys: np.ndarray          # u8 [slots, 132]


def pooled_rows(kv_score: np.ndarray, ring: np.ndarray, positions: np.ndarray,
                seq_index: np.ndarray, state_lines: np.ndarray, ratio: int):
    """(row ids that publish, their pooled [N, 512]); ring (r = 2) is updated in place.

    Replays the kernel's partner rule: the previous row when it is position p-1 of the same
    sequence, else the ring row (p-1) % 8 of the sequence's state line.
    """
    positions = np.asarray(positions, np.int64)
    seq_index = np.asarray(seq_index, np.int64)
    real = np.flatnonzero(seq_index >= 0)
    if ratio == 1:
        return real, kv_score[real, :HEAD_DIM].astype(np.float32)
    before = ring.copy()
    lines = np.asarray(state_lines, np.int64)[seq_index[real]]
    ring[lines, positions[real] % RING_ROWS] = kv_score[real]
    pub = [r for r in real if positions[r] % 2 == 1]
    pairs = np.empty((len(pub), 2, RING_WIDTH), np.float32)
    for i, r in enumerate(pub):
        p, s = positions[r], seq_index[r]
        same_step = r > 0 and seq_index[r - 1] == s and positions[r - 1] == p - 1
        line = state_lines[s]
        pairs[i, 0] = kv_score[r - 1] if same_step else before[line, (p - 1) % RING_ROWS]
        pairs[i, 1] = kv_score[r]
    pooled = compressor_ref.pool_pairs(pairs[:, :, :HEAD_DIM], pairs[:, :, HEAD_DIM:])
    return np.array(pub, np.int64), pooled.astype(np.float32)


def entry_slots(positions: np.ndarray, seq_index: np.ndarray, rows: np.ndarray,
                block_tables: np.ndarray, page_size: int, ratio: int) -> np.ndarray:
    """Physical record row of entry p // r of each publishing row; -1 (nothing written) when the
    page is unallocated (-1) or past the block table (the kernel checks both)."""
    e = np.asarray(positions, np.int64)[rows] // ratio
    page_idx = e // page_size
    inside = page_idx < block_tables.shape[1]
    pages = np.full(e.shape, -1, np.int64)
    pages[inside] = block_tables[np.asarray(seq_index)[rows][inside], page_idx[inside]]
    return np.where(pages >= 0, pages * page_size + e % page_size, -1)


def publish_values(pooled: np.ndarray, positions: np.ndarray, norm_w: np.ndarray,
                   wk: np.ndarray, k_norm: np.ndarray, eps: float, table: rope_ref.RopeTable,
                   ratio: int) -> tuple[np.ndarray, np.ndarray]:
    """(entries [N, 512], keys [N, 128]) fp32 before quantization, per `compressor_ref`."""
    latent = compressor_ref.rmsnorm_f32(pooled, norm_w, eps)
    pos = compressor_ref.entry_positions(positions, ratio)
    entry = compressor_ref.rotate(latent, pos, table)
    keys = compressor_ref.index_key(latent, wk, k_norm, eps, pos, table)
    return entry, keys


def publish_ref(state: PublishState, kv_score: np.ndarray, positions: np.ndarray,
                seq_index: np.ndarray, state_lines: np.ndarray, block_tables: np.ndarray,
                page_size: int, norm_w: np.ndarray, wk: np.ndarray, k_norm: np.ndarray,
                eps: float, table: rope_ref.RopeTable, ratio: int):
    """Apply one publish launch to `state` in place; returns (slots, entries, keys) written."""
    rows, pooled = pooled_rows(kv_score, state.ring, positions, seq_index, state_lines, ratio)
    if rows.size == 0:
        return rows, np.zeros((0, HEAD_DIM), np.float32), np.zeros((0, INDEX_DIM), np.float32)
    entry, keys = publish_values(pooled, np.asarray(positions)[rows], norm_w, wk, k_norm, eps,
                                 table, ratio)
    slots = entry_slots(positions, seq_index, rows, block_tables, page_size, ratio)
    ok = slots >= 0
    state.cache[slots[ok]] = kvrecord_ref.encode_kv_record(entry[ok])
    state.keys[slots[ok]] = kvrecord_ref.encode_index_key(keys[ok])
    return slots, entry, keys


def record_tolerance(want: np.ndarray, groups: int, group: int, rel: float) -> np.ndarray:
    """Per-element bound on |decode(kernel record) - want| for FP8 groups of `group` values.

    The kernel's fp32 value differs from `want` by a relative `rel` (fp32 pipeline vs float64
    dots, ex2.approx); FP8 E4M3 rounding adds half an ulp (2^-4 relative) in the normal range,
    and half the subnormal step (2^-10 of the group's scale) below it; a scale one power higher
    than the reference's (amax within `rel` of a power of two) doubles the step.
    """
    w = want.reshape(want.shape[0], groups, group).astype(np.float64)
    scale = np.exp2(np.ceil(np.log2(np.maximum(np.abs(w).max(axis=2, keepdims=True)
                                               * (1 + rel), kvrecord_ref.AMAX_FLOOR) / 448.0)))
    bound = np.abs(w) * (2.0 ** -3 + rel) + 2.0 * scale * 2.0 ** -9 + rel * np.abs(w).max(
        axis=2, keepdims=True)
    return bound.reshape(want.shape)


def entry_tolerance(want: np.ndarray, rel: float = 2.0 ** -16) -> np.ndarray:
    """[N, 512]: FP8 nope dims per `record_tolerance`, BF16 rope dims half a bf16 ulp + rel."""
    nope = record_tolerance(want[:, :kvrecord_ref.NOPE_DIM], kvrecord_ref.KV_NUM_SCALES,
                            kvrecord_ref.KV_SCALE_GROUP, rel)
    rope = np.abs(want[:, kvrecord_ref.NOPE_DIM:]).astype(np.float64) * (2.0 ** -8 + 2 * rel)
    rope += rel * np.abs(want).max(axis=1, keepdims=True)
    return np.concatenate([nope, rope], axis=1)


def key_tolerance(want: np.ndarray, rel: float = 2.0 ** -14) -> np.ndarray:
    """[N, 128]: one FP8 group of 128 with a power-of-two fp32 scale."""
    return record_tolerance(want, 1, INDEX_DIM, rel)
