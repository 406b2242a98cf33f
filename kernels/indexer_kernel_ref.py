"""Indexer kernels (A10-A12): specs, layouts, byte formulas and the NumPy reference of what they compute.

Three kernels per index-source layer (model doc §2.2 A10-A12; `kernels/indexer_ref.py` is the
model-level oracle, `executor/reference/attention.py:index_topk` composes it):

    indexer_prep    q bf16 [R, nh, 128] (after RoPE) -> FP4 quantize-dequantize per 32 values,
                    stored as E4M3 codes (every E2M1 value is an E4M3 value) in mma fragment order
                    + one power-of-two scale per (row, head, group); head weights
                    w = f32(bf16 weights_proj) * weight_scale; CTA 0 writes the work plan.
    indexer_scores  score[r, e] = sum_h w[r, h] * ReLU(q[r, h] . K[e]), fp32 [R, ld], over the
                    132-byte key records (128 FP8 + f32 scale) through the block tables.
                    dense: one scan per sequence shared by its rows (entries e < n of the sequence);
                    candidates (reindex layers): per row, only the entries of its candidate blocks.
    indexer_topk    per row the top-k items (ties to the lower index), ascending, -1 padded:
                    entries (e < visible), candidate entries, or blocks of 8 (block score = max of
                    its visible entries, the row's own block forced in) for the candidate source.

Scores: `mma.sync.m16n8k32.e4m3` with keys as A (16 keys x 32 dims) and the query as B (32 dims x
8 heads): one k-step is exactly one FP4 group, so each k-step's fp32 partial is multiplied by its
group scale before the next; then x key scale, ReLU, x w[h], summed over heads. The tensor core sums
32 exact products per k-step with its own (truncating) adder, so scores match `index_scores` within
`score_tolerance`, not bitwise; the top-k kernel is exact on the scores it is given.

Top-k: exact radix select on the order-preserving 32-bit key of each score (-0 canonicalised to +0):
three histogram passes (11, 11, 10 bits) find the k-th largest key T and how many items equal to T
are taken (the lowest indices); a final pass in item order writes the selected indices with a block
scan, so the output is ascending without a sort. `radix_select_ref` replays it.

Layouts (int32 words unless stated):
- qfrag  [R, nh/8, 4 groups, 32 lanes, 2 words]: word j of lane l = E4M3 codes of dims
         32g + 16j + 4(l % 4) .. +3 of head 8t + l // 4 (the B fragment of k-step g, n-tile t).
- qscale f32 [R, nh/8, 4 groups, 4, 2]: scale of head 8t + 2c + j, group g at [r, t, g, c, j].
- qw     f32 [R, nh/8, 4, 2]: w of head 8t + 2c + j at [r, t, c, j].
- plan   [1 + (R + 1) + 4R]: total work items, item prefix per unit, then (row0, rows, seq,
         entries) per unit; a unit is a sequence (dense) or a row (candidates); an item is 32 keys
         (dense: entries 32i..32i+31; candidates: candidate blocks 4i..4i+3 of the row).
Keys in a 32-key item sit at 132-byte stride in shared memory; fragment row m of tile t holds key
4(m % 8) + 2t + m // 8, which makes every A-fragment shared load bank-conflict free
(132 B = 33 words, so key 4i lands i*4 banks further on).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import ml_dtypes
import numpy as np

from kernels import indexer_ref, kvrecord_ref
from kernels.common_ref import H200_NUM_SMS, ceil_div, check_rows, params_dict
from loader import formats

INDEX_DIM = kvrecord_ref.INDEX_DIM                 # 128
KEY_BYTES = kvrecord_ref.INDEX_RECORD_BYTES        # 132
KEY_WORDS = KEY_BYTES // 4                         # 33
GROUP = indexer_ref.FP4_GROUP                      # 32 dims = one mma k-step
GROUPS = INDEX_DIM // GROUP                        # 4
HEADS_PER_TILE = 8                                 # mma n
ITEM_KEYS = 32                                     # keys per work item (two m16 tiles)
ITEM_VECTORS = ITEM_KEYS * KEY_BYTES // 16         # 264 16-byte vectors
CAND_BLOCKS_PER_ITEM = 4                           # candidate blocks of 8 keys per item
LANES = 32
SCORE_WARPS = 4
SCORE_STAGES = 4                                   # per-warp cp.async ring of 32-key items
SCORE_CTAS_PER_SM = 2
PREP_THREADS = 256
TOPK_THREADS = 1024
TOPK_BINS = 2048
RADIX_PASSES = ((21, 11), (10, 11), (0, 10))       # (shift, bits) from the top
MODES_SCORES = ("dense", "candidates")
MODES_TOPK = ("entries", "candidates", "blocks")
# Cluster top-k (variant): one cluster of TOPKC_CLUSTER CTAs per row, each holding its slice of the
# row in shared memory (TOPKC_SLICE entries, whole blocks of 8); histograms merged over DSMEM.
# Mode "both" selects the entries and the candidate blocks from one read of the row; mode
# "candidates" (reindex layers) keeps the default's ABI and holds TOPKC_SLICE / 2 slots per CTA.
TOPKC_THREADS = 512
TOPKC_CLUSTER = 8
TOPKC_SLICE = 16384
MODES_TOPKC = ("entries", "blocks", "both", "candidates")


# ---- specs -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class IndexerSpec:
    """One compiled indexer kernel; `kind` is prep | scores | topk, `mode` its variant."""

    name: str
    kind: str
    heads: int
    mode: str
    ratio: int
    topk: int                      # k (topk kind), else 0
    block_size: int                # candidate block size (8)
    page_size: int                 # entries per cache page
    params: tuple[tuple[str, str], ...]
    block: tuple[int, int, int]
    smem_bytes: int
    cluster_ctas: int = 0          # topkc: CTAs of the row's thread-block cluster
    topk_blocks: int = 0           # topkc "both": k of the candidate blocks (topk: of entries)
    timeline: bool = False         # per-CTA stamps (TIMELINE_POINTS[kind]): `timeline_twin`
    # topk entries / blocks (round 7 candidate): the first `held` items' ordered keys are kept in
    # shared memory by radix pass 1, so passes 2, 3 and the output pass read them there instead
    # of the scores from L2 (the rest of a longer row is read from global, as before).
    held: int = 0

    def stamp_rows(self, rows: int) -> int:
        """Timeline builds: CTAs of a launch on `rows` rows (one stamp row each)."""
        x, y, z = self.grid(rows)
        return x * y * z

    @property
    def cluster(self) -> tuple[int, int, int] | None:
        return (self.cluster_ctas, 1, 1) if self.cluster_ctas else None

    @property
    def max_ctas(self) -> int:
        return H200_NUM_SMS * SCORE_CTAS_PER_SM

    def grid(self, rows: int) -> tuple[int, int, int]:
        check_rows(rows, self.name)
        if rows > PREP_THREADS:
            raise ValueError(f"{self.name}: {rows} rows; the plan (one prep thread per row) "
                             f"holds at most {PREP_THREADS}")
        if self.kind == "prep":
            warps = PREP_THREADS // LANES
            return (1 + ceil_div(rows * padded_heads(self.heads), warps), 1, 1)
        if self.kind == "scores":
            return (self.max_ctas, 1, 1)
        if self.kind == "topkc":
            return (self.cluster_ctas, rows, 1)
        return (rows, 1, 1)

    def to_dict(self) -> dict:
        return {"family": "indexer", "name": self.name, "kind": self.kind, "heads": self.heads,
                "mode": self.mode, "ratio": self.ratio, "topk": self.topk,
                "block_size": self.block_size, "page_size": self.page_size,
                "params": params_dict(self.params), "block": list(self.block),
                "smem_bytes": self.smem_bytes, "cluster_ctas": self.cluster_ctas,
                "topk_blocks": self.topk_blocks} | ({"timeline": True} if self.timeline else {}) | (
                    {"held": self.held} if self.held else {})


PREP_PARAMS = (("q", "u64"), ("w_raw", "u64"), ("positions", "u64"), ("seq_index", "u64"),
               ("cands", "u64"), ("qfrag", "u64"), ("qscale", "u64"), ("qw", "u64"),
               ("plan", "u64"), ("rows", "u32"), ("num_cands", "u32"), ("weight_scale", "f32"))
SCORES_PARAMS = (("qfrag", "u64"), ("qscale", "u64"), ("qw", "u64"), ("plan", "u64"),
                 ("keys", "u64"), ("block_tables", "u64"), ("cands", "u64"),
                 ("seq_index", "u64"), ("scores", "u64"), ("rows", "u32"), ("ld", "u32"),
                 ("max_pages", "u32"), ("num_cands", "u32"))
TOPK_PARAMS = (("scores", "u64"), ("positions", "u64"), ("seq_index", "u64"), ("cands", "u64"),
               ("out", "u64"), ("rows", "u32"), ("ld", "u32"), ("num_cands", "u32"))
TOPKC_PARAMS = (("scores", "u64"), ("positions", "u64"), ("seq_index", "u64"),
                ("out_entries", "u64"), ("out_blocks", "u64"), ("rows", "u32"), ("ld", "u32"))


# Timeline builds (name suffix "_timeline"; never launched by the step): the production kernel with
# (u64 stamps) before its first 32-bit parameter. Thread 0 of CTA c (the linear block index:
# x + grid_x * y) writes %smid into word 0 of row c of stamps (u64 [stamp_rows, TIMELINE_WORDS];
# word 1 padding) and (%globaltimer, %clock64) of point i into words 2 + 2i, 3 + 2i (16-byte
# aligned, one st.global.v2.u64). Points, by kernel kind:
# prep: the CTA's quantize items or the plan written ("work"). scores: "prologue" (the plan's
# item count read, the first stages issued), "first_landed" (warp 0's first item in smem; at the
# loop's end if it had none), "items" (warp 0's last item scored), "drained" (every copy waited).
# topk / topkc: "meta" (the row's count read; topkc: the slice or candidates in smem, CTA
# barrier), one point per radix pass (a pass skipped by take-all stamps when skipped), "output"
# (selection written, topk: and the -1 tail), exit (topkc: after the final cluster barrier).
TIMELINE_POINTS = {
    "prep": ("entry", "before_wait", "after_wait", "work", "exit"),
    "scores": ("entry", "before_wait", "after_wait", "prologue", "first_landed", "items",
               "drained", "exit"),
    "topk": ("entry", "before_wait", "after_wait", "meta", "pass1", "pass2", "pass3", "output",
             "exit"),
    "topkc": ("entry", "before_wait", "after_wait", "meta", "pass1", "pass2", "pass3", "output",
              "exit"),
}
TIMELINE_WORDS = 32
TIMELINE_HEAD_WORDS = 2            # %smid, padding


def timeline_twin(spec: IndexerSpec) -> IndexerSpec:
    """The `_timeline` build of a production spec: (u64 stamps) before the first u32/f32."""
    if spec.timeline:
        raise ValueError(f"{spec.name} is already a timeline build")
    at = next(i for i, (_, kind) in enumerate(spec.params) if kind != "u64")
    params = spec.params[:at] + (("stamps", "u64"),) + spec.params[at:]
    return replace(spec, name=spec.name + "_timeline", params=params, timeline=True)


def production_of(spec: IndexerSpec) -> IndexerSpec:
    """The production spec of a timeline build (inverse of timeline_twin)."""
    params = tuple(p for p in spec.params if p[0] != "stamps")
    return replace(spec, name=spec.name.removesuffix("_timeline"), params=params, timeline=False)


def score_smem_bytes() -> int:
    return SCORE_WARPS * SCORE_STAGES * ITEM_KEYS * KEY_BYTES


def topk_smem_bytes() -> int:
    return 4 * (TOPK_BINS + 2 * (TOPK_THREADS // LANES) + 8)


def make_prep_spec(heads: int, mode: str, ratio: int, page_size: int) -> IndexerSpec:
    _check_heads(heads)
    return IndexerSpec(f"indexer_prep_{mode}_h{heads}_r{ratio}", "prep", heads, mode, ratio, 0,
                       8, page_size, PREP_PARAMS, (PREP_THREADS, 1, 1), 4 * 3 * PREP_THREADS)


def make_scores_spec(heads: int, mode: str, ratio: int, page_size: int) -> IndexerSpec:
    _check_heads(heads)
    if mode not in MODES_SCORES:
        raise ValueError(f"indexer scores mode {mode!r}; expected one of {MODES_SCORES}")
    if page_size % ITEM_KEYS:
        raise ValueError(f"indexer: page_size {page_size} must be a multiple of {ITEM_KEYS} so a "
                         "32-key item never straddles a page")
    return IndexerSpec(f"indexer_scores_{mode}_h{heads}_r{ratio}_p{page_size}", "scores", heads,
                       mode, ratio, 0, 8, page_size, SCORES_PARAMS,
                       (SCORE_WARPS * LANES, 1, 1), score_smem_bytes())


TOPK_HELD = 16384                  # the held candidate: 64 KB of keys (a 128k row at ratio 2)


def make_topk_spec(mode: str, k: int, ratio: int, block_size: int = 8,
                   held: int = 0) -> IndexerSpec:
    """held > 0: the candidate keeping the first `held` item keys in shared memory (name suffix
    `_s{held}`; entries and blocks modes)."""
    if mode not in MODES_TOPK:
        raise ValueError(f"indexer top-k mode {mode!r}; expected one of {MODES_TOPK}")
    if not 1 <= k <= 4096:
        raise ValueError(f"indexer top-k: k = {k} outside [1, 4096]")
    if held and (mode == "candidates" or held % TOPK_THREADS or held > TOPK_HELD):
        raise ValueError(f"indexer top-k {mode}: held {held} must be a multiple of "
                         f"{TOPK_THREADS} <= {TOPK_HELD}, entries or blocks mode")
    return IndexerSpec(f"indexer_topk_{mode}_k{k}_r{ratio}" + (f"_s{held}" if held else ""),
                       "topk", 0, mode, ratio, k, block_size, 0, TOPK_PARAMS,
                       (TOPK_THREADS, 1, 1), topk_smem_bytes() + 4 * held, held=held)


def topkc_smem_layout() -> dict[str, int]:
    """Byte offsets of the cluster top-k's shared memory: the slice (keys, or raw scores in blocks
    mode), block keys, two histograms (passes alternate, so a pass never clears a histogram
    another CTA may still read), scan totals, the found bin, this CTA's (above, tie) counts."""
    warps = TOPKC_THREADS // LANES
    sizes = (("slice", 4 * TOPKC_SLICE), ("block_keys", 4 * TOPKC_SLICE // 8),
             ("hist", 2 * 4 * TOPK_BINS), ("totals", 4 * warps), ("found", 16), ("counts", 16))
    out, at = {}, 0
    for name, size in sizes:
        out[name] = at
        at += size
    out["end"] = at
    return out


def make_topk_cluster_spec(mode: str, k: int, ratio: int, block_size: int = 8,
                           k_blocks: int = 0) -> IndexerSpec:
    """The cluster top-k variant: entries (k into out_entries), blocks (k into out_blocks) or
    both (k entries and k_blocks blocks from one read of the row). Outputs as `topk_ref`."""
    if mode not in MODES_TOPKC:
        raise ValueError(f"indexer cluster top-k mode {mode!r}; expected one of {MODES_TOPKC}")
    for what, value in (("k", k), ("k_blocks", k_blocks if mode == "both" else 1)):
        if not 1 <= value <= 4096:
            raise ValueError(f"indexer cluster top-k: {what} = {value} outside [1, 4096]")
    if TOPKC_SLICE % block_size:
        raise ValueError(f"indexer cluster top-k: block size {block_size} must divide "
                         f"{TOPKC_SLICE}")
    tail = f"_b{k_blocks}" if mode == "both" else ""
    params = TOPK_PARAMS if mode == "candidates" else TOPKC_PARAMS
    return IndexerSpec(f"indexer_topkc_{mode}_k{k}{tail}_r{ratio}_c{TOPKC_CLUSTER}", "topkc", 0,
                       mode, ratio, k, block_size, 0, params, (TOPKC_THREADS, 1, 1),
                       topkc_smem_layout()["end"], TOPKC_CLUSTER,
                       k_blocks if mode == "both" else 0)


def topkc_slices(n: int, block_size: int = 8, ctas: int = TOPKC_CLUSTER):
    """Per CTA of a row with n visible entries: (first block, blocks, blocks held in shared
    memory, first entry, entries, entries held). Slices are whole blocks, so one read serves the
    entries and the blocks selections; items past TOPKC_SLICE entries are read from global."""
    nb = ceil_div(n, block_size)
    per = ceil_div(nb, ctas)
    out = []
    for c in range(ctas):
        first = c * per
        count = max(0, min(per, nb - first))
        held = min(count, TOPKC_SLICE // block_size)
        e0 = first * block_size
        count_e = max(0, min(count * block_size, n - e0))
        out.append((first, count, held, e0, count_e, min(count_e, held * block_size)))
    return out


def topkc_candidate_slices(num_cands: int, block_size: int = 8, ctas: int = TOPKC_CLUSTER):
    """Candidates mode, per CTA: (first slot, slots, slots held in shared memory); a slot is one
    entry of one candidate block (slot i: entry i % block_size of block cands[i // block_size])."""
    per = ceil_div(num_cands, ctas) * block_size
    out = []
    for c in range(ctas):
        count = max(0, min(per, num_cands * block_size - c * per))
        out.append((c * per, count, min(count, TOPKC_SLICE // 2)))
    return out


def _check_heads(heads: int) -> None:
    if heads < 1 or heads > 256:
        raise ValueError(f"indexer: {heads} index heads; expected 1..256")


def padded_heads(heads: int) -> int:
    """Heads rounded up to whole mma n-tiles of 8; padding heads get q = 0 and w = 0."""
    return ceil_div(heads, HEADS_PER_TILE) * HEADS_PER_TILE


def plan_words(rows: int) -> int:
    return 1 + (rows + 1) + 4 * rows


# ---- byte formulas ---------------------------------------------------------------------------

def scores_bytes(num_entries_per_unit, rows: int, heads: int) -> int:
    """Bytes the scores kernel must move: every key record of each unit once, q/scales/w per row,
    the scores it writes (fp32 per row and entry of its unit)."""
    keys = sum(int(n) for n in num_entries_per_unit) * KEY_BYTES
    q = rows * padded_heads(heads) * (INDEX_DIM + 4 * GROUPS + 4)
    return keys + q


def topk_bytes(items_per_row, k: int) -> int:
    """Floor: one read of each row's scores, the k indices written."""
    return sum(4 * int(n) + 4 * k for n in items_per_row)


# ---- references ------------------------------------------------------------------------------

def pow2_exponent(amax: np.ndarray, max_code: float) -> np.ndarray:
    """Exponent a of the smallest 2^a with max(amax, 1e-4) / 2^a <= max_code (the ceil rule)."""
    floored = np.maximum(np.asarray(amax, np.float32), np.float32(1e-4))
    return formats.ue8m0_scale_for_amax(floored, max_code).astype(np.int32) - 127


def prep_query(q: np.ndarray, w_raw: np.ndarray, weight_scale: float):
    """(codes uint8 [R, nh, 128] E4M3, scales f32 [R, nh, 4], w f32 [R, nh]) the prep kernel makes.

    q holds bf16 values (float32 array), w_raw bf16 values; codes * scale is exactly
    `indexer_ref.fp4_quantize_dequantize(q)`.
    """
    r, nh, d = q.shape
    g = q.astype(np.float32).reshape(r, nh, GROUPS, GROUP)
    exp = pow2_exponent(np.abs(g).max(axis=-1), indexer_ref.FP4_MAX)          # [R, nh, 4]
    vals = formats.e2m1_decode(formats.e2m1_encode(np.ldexp(g, -exp[..., None])))
    codes = vals.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).reshape(r, nh, d)
    scales = np.ldexp(np.float32(1), exp).astype(np.float32)
    w = (w_raw.astype(np.float32) * np.float32(weight_scale)).astype(np.float32)
    return codes, scales, w


def dequantized_query(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    r, nh, _ = codes.shape
    vals = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(r, nh, GROUPS, GROUP)
    return (vals * scales[..., None]).reshape(r, nh, INDEX_DIM)


def pad_heads(x: np.ndarray, fill) -> np.ndarray:
    """Axis 1 (heads) padded to whole n-tiles of 8 with `fill` (what the prep kernel writes)."""
    nh = x.shape[1]
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, padded_heads(nh) - nh)
    return np.pad(x, pad, constant_values=fill)


def fragment_order(codes: np.ndarray) -> np.ndarray:
    """uint8 [R, nh, 128] -> uint8 [R, nh/8, 4, 32, 8]: the qfrag layout (module docstring)."""
    codes = pad_heads(codes, 0)
    r, nh, _ = codes.shape
    c = codes.reshape(r, nh // 8, 8, GROUPS, 2, 4, 4)       # [r, t, n, g, j, quad, byte]
    return np.ascontiguousarray(c.transpose(0, 1, 3, 2, 5, 4, 6)).reshape(
        r, nh // 8, GROUPS, LANES, 8)


def scale_order(scales: np.ndarray) -> np.ndarray:
    """f32 [R, nh, 4] -> [R, nh/8, 4, 4, 2] (padding heads: scale 1)."""
    scales = pad_heads(scales, 1.0)
    r, nh, _ = scales.shape
    return np.ascontiguousarray(scales.reshape(r, nh // 8, 4, 2, GROUPS).transpose(0, 1, 4, 2, 3))


def weight_order(w: np.ndarray) -> np.ndarray:
    """f32 [R, nh] -> [R, nh/8, 4, 2] (padding heads: 0)."""
    w = pad_heads(w, 0.0)
    r, nh = w.shape
    return np.ascontiguousarray(w.reshape(r, nh // 8, 4, 2))


def visible_counts(positions: np.ndarray, seq_index: np.ndarray, ratio: int) -> np.ndarray:
    """Entries each row sees: (p + 1) // ratio; 0 for padding rows (sequence -1)."""
    pos = np.asarray(positions, np.int64)
    return np.where(np.asarray(seq_index) >= 0, (pos + 1) // ratio, 0)


def work_plan(positions, seq_index, ratio: int, mode: str, cands=None) -> np.ndarray:
    """The int32 plan the prep kernel's CTA 0 writes (layout in the module docstring)."""
    pos, seq = np.asarray(positions, np.int64), np.asarray(seq_index, np.int64)
    rows = pos.shape[0]
    units = np.zeros((rows, 4), np.int64)
    items = np.zeros(rows, np.int64)
    for u in range(rows):
        if mode == "dense":
            idx = np.flatnonzero(seq == u)
            if idx.size == 0:
                continue
            n = (pos[idx[-1]] + 1) // ratio
            units[u] = (idx[0], idx.size, u, n)
            items[u] = ceil_div(int(n), ITEM_KEYS)
        else:
            if seq[u] < 0:
                continue
            valid = int(np.count_nonzero(np.asarray(cands)[u] >= 0))
            units[u] = (u, 1, seq[u], (pos[u] + 1) // ratio)
            items[u] = ceil_div(valid, CAND_BLOCKS_PER_ITEM)
    prefix = np.concatenate([[0], np.cumsum(items)])
    return np.concatenate([[prefix[-1]], prefix, units.reshape(-1)]).astype(np.int32)


def decoded_keys(cache: np.ndarray, block_table: np.ndarray, n: int, page_size: int):
    """[n, 128] f32 keys of entries 0..n-1 of one sequence (what the kernel reads)."""
    e = np.arange(n)
    phys = block_table[e // page_size].astype(np.int64) * page_size + e % page_size
    return kvrecord_ref.decode_index_key(cache[phys])


def score_tolerance(q: np.ndarray, w: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """[R, N] bound on |kernel - index_scores|: 2^-12 of sum_h |w_h| sum_d |q_hd K_d|.

    The tensor core adds 32 exact products per k-step with an fp32-or-narrower (about 13-14 bit,
    truncating) adder; the fp32 epilogue adds 4 group partials, 32 heads and a 4-lane butterfly
    (about 40 roundings of 2^-24 each). 2^-12 of the magnitude covers a 14-bit adder with margin
    and still catches a wrong key, head, group scale or row (those are O(1) of the magnitude).
    """
    mag = np.einsum("rhd,nd->rhn", np.abs(q).astype(np.float64), np.abs(keys).astype(np.float64))
    return np.einsum("rhn,rh->rn", mag, np.abs(w).astype(np.float64)) * 2.0**-12 + 1e-30


def ordered_key(scores: np.ndarray) -> np.ndarray:
    """uint32 keys ordered as the fp32 scores (-0 as +0): bits ^ (sign ? 0xFFFFFFFF : 0x80000000)."""
    s = (np.asarray(scores, np.float32) + np.float32(0.0)).view(np.uint32)
    return np.where(s >> 31, ~s, s | np.uint32(0x80000000)).astype(np.uint32)


def radix_select_ref(keys: np.ndarray, k: int) -> tuple[int, int, bool]:
    """(T, take_equal, take_all) exactly as the kernel's three histogram passes find them."""
    keys = np.asarray(keys, np.uint32)
    if keys.size <= k:
        return 0, 0, True
    prefix, mask, need = 0, 0, k
    for shift, bits in RADIX_PASSES:
        match = (keys & np.uint32(mask)) == np.uint32(prefix)
        digits = (keys[match] >> np.uint32(shift)) & np.uint32((1 << bits) - 1)
        hist = np.bincount(digits, minlength=1 << bits)
        above = np.cumsum(hist[::-1])[::-1] - hist           # count with a larger digit
        d = int(np.flatnonzero((above < need) & (above + hist >= need))[0])
        need -= int(above[d])
        prefix |= d << shift
        mask |= ((1 << bits) - 1) << shift
    return prefix, need, False


def select_in_order(keys: np.ndarray, k: int) -> np.ndarray:
    """Item positions the kernel's ordered output pass selects (ascending), -1 padded to k."""
    t, need, take_all = radix_select_ref(keys, k)
    if take_all:
        chosen = np.arange(keys.size)
    else:
        above = keys > np.uint32(t)
        tie = keys == np.uint32(t)
        tie_rank = np.cumsum(tie) - tie
        chosen = np.flatnonzero(above | (tie & (tie_rank < need)))
    out = np.full(k, -1, np.int64)
    out[:chosen.size] = chosen
    return out


def cluster_select_ref(keys: np.ndarray, k: int, starts) -> np.ndarray:
    """The cluster top-k's algorithm on item keys cut into slices at `starts` (one per CTA):
    per-CTA histograms summed (what each CTA reads over DSMEM), then each CTA writes its slice's
    selections at offsets given by the (above, tie) counts of the CTAs before it."""
    keys = np.asarray(keys, np.uint32)
    bounds = list(starts) + [keys.size]
    slices = [keys[bounds[c]:bounds[c + 1]] for c in range(len(starts))]
    prefix, mask, need, take_all = 0, 0, k, False
    for p, (shift, bits) in enumerate(RADIX_PASSES):
        hist = np.zeros(1 << bits, np.int64)
        for part in slices:
            match = part[(part & np.uint32(mask)) == np.uint32(prefix)]
            hist += np.bincount((match >> np.uint32(shift)) & np.uint32((1 << bits) - 1),
                                minlength=1 << bits)
        if p == 0 and hist.sum() <= need:
            take_all = True
            break
        above = np.cumsum(hist[::-1])[::-1] - hist
        d = int(np.flatnonzero((above < need) & (above + hist >= need))[0])
        need -= int(above[d])
        prefix |= d << shift
        mask |= ((1 << bits) - 1) << shift
    out = np.full(k, -1, np.int64)
    run_above, run_tie = 0, 0
    for c, part in enumerate(slices):
        above = np.ones(part.size, bool) if take_all else part > np.uint32(prefix)
        tie = np.zeros(part.size, bool) if take_all else part == np.uint32(prefix)
        a_before = run_above + np.cumsum(above) - above
        t_before = run_tie + np.cumsum(tie) - tie
        for j in np.flatnonzero(above):
            out[a_before[j] + min(t_before[j], need)] = bounds[c] + j
        for j in np.flatnonzero(tie & (t_before < need)):
            out[a_before[j] + t_before[j]] = bounds[c] + j
        run_above += int(above.sum())
        run_tie += int(tie.sum())
    return out


def topk_ref(scores: np.ndarray, positions, seq_index, mode: str, k: int, ratio: int,
             cands=None, block_size: int = 8) -> np.ndarray:
    """int32 [R, k]: what indexer_topk writes, from the model-level `indexer_ref` functions.

    entries: the top-k of e < visible; candidates: of e < visible inside the row's candidate
    blocks; blocks: the candidate blocks (own block = (visible - 1) // block_size, which is the
    block of the row's position on the ratio-1 candidate source).
    Only the scores the kernel reads need to be finite; the rest may be poison.
    """
    rows, ld = scores.shape
    vis = visible_counts(positions, seq_index, ratio)
    out = np.full((rows, k), -1, np.int32)
    for r in range(rows):
        n = int(vis[r])
        if n == 0:
            continue
        row = np.where(np.arange(ld) < n, scores[r], np.float32(0))[None, :n]
        allowed = np.ones((1, n), bool)
        if mode == "candidates":
            allowed = indexer_ref.candidate_entry_mask(np.asarray(cands)[r:r + 1], n, block_size)
        if mode == "blocks":
            out[r] = indexer_ref.candidate_blocks(row, allowed, np.array([n - 1]), block_size, k)
        else:
            out[r] = indexer_ref.topk_entries(row, allowed, k)
    return out
