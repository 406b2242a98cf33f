"""Sparse MQA decode (A13 + A14): spec, launch geometry, byte formulas and the reference on cache bytes.

What one launch computes, per row r of a step (model doc §2.2 A13-A14; `kernels/attention_ref.py`):

    entries(r) = SWA positions swa_lo..swa_hi of the row's ring  ++  topk[r, :] (-1 = none),
                 each one 584-byte record (kernels/kvrecord_ref.py), dequantized: K = V = entry
    logit[h, n] = q[r, h] . entry[n] / sqrt(512)          (fp32)
    M_h = max(sink_h, max_n logit);  L_h = sum_n exp(logit - M_h) + exp(sink_h - M_h)
    P[h, n] = bf16(exp(logit[h, n] - M_h) / L_h)          (normalized, then rounded: the reference's
                                                            choice, uncertain in attention_ref)
    o[r, h] = bf16(sum_n P[h, n] * entry[n])  ->  inverse RoPE on dims 448..511 at the row's position
              (fp32 on the bf16 values, as the reference's A14) -> bf16 out [R, H, 512] (wo_a input)

Inputs (device buffers, all caller-owned; PTX ABI in `PARAMS`):
    q            bf16  [R, H, 512]   rank's heads, rope dims rotated
    out          bf16  [R, H, 512]
    swa          u8    [lines * ring_slots, 584]   the layer's SWA ring
    compressed   u8    [pages * page_size, 584]    the kv source's compressed cache (topk specs)
    topk         i32   [R, topk]                   entry ids, -1 padded (topk specs)
    block_tables i32   [S, pages_per_seq]          pages of each sequence, -1 = none
    row_info     i32   [R, 4]  (position, swa_lo, swa_hi, seq): `row_info()` builds it from a
                               RowBatch; seq = -1 marks a padding row (o = 0, nothing read)
    state_lines  i32   [S]     SWA slot of position x: state_lines[seq] * ring_slots + x % ring_slots
    sink         f32   [H]
    rope_table   f32   [num_positions, 32, 2]      the layer's (cos, sin) table (rope_ref)

Bad input shows as NaN in the row's output, never as an out-of-bounds read: a top-k entry on a
page beyond `pages_per_seq` or on an unallocated (-1) page, an SWA range wider than `swa_cols`,
a position outside the RoPE table, or a launch without the compiled cluster shape.

Launch geometry: one thread-block cluster of `cluster_ctas` CTAs per row (grid = (cluster_ctas,
R, 1), cluster = (cluster_ctas, 1, 1)); CTA s takes entries [s * per, (s + 1) * per) of the row,
per = round_up(ceil(C / cluster_ctas), 16), C = (swa_hi - swa_lo + 1) + topk. The cluster shares
(max, sum) per head through distributed shared memory, so every CTA rounds the NORMALIZED
probabilities exactly as the reference does, and each record is read from memory once per row.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels import attention_ref, rope_ref
from kernels import kvrecord_ref as rec
from kernels.common_ref import H200_HBM_BYTES_PER_S, ceil_div, check_rows, params_dict, to_bf16

HEAD_DIM = rec.HEAD_DIM
RECORD_BYTES = rec.KV_RECORD_BYTES
MMA_M = 16                       # heads per mma tile: the rank's heads, zero-padded to 16
CTAS_PER_SM = 2                  # minctasm; 3 (85 registers) spilled 16-40 bytes
SM_SMEM_BYTES = 228 * 1024       # per SM, 1 KB of it reserved per CTA
CTA_THREADS = 256                # 8 warps: warp w owns output dims 64w..64w+63 in the PV product
ENTRY_TILE = 16                  # entries per PV k-step; a CTA's share is a multiple of it
Q_ROW_BYTES = HEAD_DIM * 2 + 16  # padded q row in shared memory (conflict-free fragment loads)
O_ROW_BYTES = HEAD_DIM * 4 + 16  # padded fp32 partial-o row (DSMEM reduction source)
STATS_BYTES = 16                 # per head: (max, sum, bad, pad) f32
# Push exchange: a CTA's 64 output dims of one sender's partial o per head, padded by 16 bytes.
INBOX_ROW_BYTES = 64 * 4 + 16
CONSTS_BYTES = MMA_M * 4 + 32 * 2 * 4   # sink [16] f32 + one RoPE table row [32, 2] f32
CLUSTER_TOPK = 8                 # portable maximum: 640 entries -> 80 per CTA
CLUSTER_SWA = 4                  # SWA-only layers: <= 133 entries -> 48 per CTA
DEFAULT_MAX_BLOCK_ROWS = 6       # KVCaches.allocate's default (verify block)
SPLITS = ("balanced", "fixed")   # how a row's entries split over the cluster (SparseMqaSpec.split)
EXCHANGES = ("pull", "push")     # how the cluster shares statistics and partial o (.exchange)
# Timing-only ablations of the step's push kernel (wrong outputs, never tested for values), each
# skipping loops so that the benchmark attributes the measured time without hardware counters:
# gather (the record copy), qk, pv (the mma loops). The exchange cannot be skipped: a store into a
# CTA that has left is undefined. (Session 1's ablations of the balanced kernel, run 17 and the
# 15:55 run of session 3, are in this note's tables; deleted with their code paths.)
PHASES = ("gather", "qk", "pv")
PUSH_ABLATIONS = (("gather",), ("qk",), ("pv",), ("gather", "qk", "pv"))
INFO_FIELDS = 4                  # row_info: position, swa_lo, swa_hi, seq

PARAMS = (("q", "u64"), ("out", "u64"), ("swa", "u64"), ("compressed", "u64"), ("topk", "u64"),
          ("block_tables", "u64"), ("row_info", "u64"), ("state_lines", "u64"), ("sink", "u64"),
          ("rope_table", "u64"), ("rows", "u32"), ("pages_per_seq", "u32"), ("page_size", "u32"),
          ("num_positions", "u32"))
# Timeline builds (SparseMqaSpec.timeline, name suffix "_timeline", of the step's two kernels; never
# launched by the step): the production kernel with (u64 stamps) before (u32 rows). Thread 0 of CTA
# (s, r) writes %smid into word 0 of row r * cluster_ctas + s of stamps (u64 [ctas, TIMELINE_WORDS];
# word 1 is padding) and (%globaltimer, %clock64) of point i into words 2 + 2i, 3 + 2i (one 16-byte
# aligned st.global.v2.u64; run r7a's first layout at words 1 + 2i faulted as misaligned). The points follow the phases of
# the module docstring: entry; before / after griddepcontrol.wait; addresses (the metadata, top-k id
# and block-table loads done, CTA barrier); issued (thread 0's record copies issued); landed (every
# record and q in smem, CTA barrier); qk (logits, CTA barrier); stats (thread 0's (max, sum) stored
# or pushed); exchange1 (cluster barrier 1 returned); probs (P in smem, CTA barrier); pv (thread 0's
# partial o stored or pushed); exchange2 (cluster barrier 2 returned); exit (thread 0's output
# stored; the pull kernel: after its third cluster barrier).
TIMELINE_POINTS = ("entry", "before_wait", "after_wait", "addresses", "issued", "landed", "qk",
                   "stats", "exchange1", "probs", "pv", "exchange2", "exit")
TIMELINE_WORDS = 32                 # 2 + 2 * 13 used: a 256-byte row per CTA
TIMELINE_HEAD_WORDS = 2            # %smid, padding
TIMELINE_PARAMS = PARAMS[:10] + (("stamps", "u64"),) + PARAMS[10:]


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def round_up(n: int, m: int) -> int:
    return ceil_div(n, m) * m


@dataclass(frozen=True)
class SmemLayout:
    """Byte offsets of one CTA's dynamic shared memory (the kernel and the tests share them)."""

    records: int          # [entries_per_cta, 584] u8 raw records; later [H, O_ROW_BYTES] partial o
    addresses: int        # [entries_per_cta] i64 record address; 0 = masked, 1 = bad input
    q: int                # [16, Q_ROW_BYTES] bf16 rows (rows >= H zero)
    logits: int           # [16, entries_per_cta] f32
    probs: int            # [16, probs_row_bytes] bf16
    stats: int            # [16] (max, sum, bad, pad) f32: what the other CTAs of the cluster read
    norm: int             # [16] (M, L) f32 pairs of the whole row
    total: int
    probs_row_bytes: int
    consts: int = -1      # fixed split only: [16] f32 sink, then the row's RoPE row [32, 2] f32,
                          # prefetched off the critical path (-1: none, read from global late)
    inbox: int = -1       # push exchange only: [S senders, 16, INBOX_ROW_BYTES] f32, this CTA's
                          # dims of every CTA's partial o, stored there by the senders (-1: none)


def smem_layout(heads: int, entries_per_cta: int, consts: bool = False,
                push_ctas: int = 0) -> SmemLayout:
    """push_ctas > 0: the push exchange of a cluster of that many CTAs (stats per sender, inbox)."""
    records = max(entries_per_cta * RECORD_BYTES, heads * O_ROW_BYTES)
    # P rows padded so that the 8 row groups of an mma fragment load hit distinct banks.
    probs_row = entries_per_cta * 2 + 16
    off = round_up(records, 16)
    addresses = off
    off += entries_per_cta * 8
    q = off
    off += MMA_M * Q_ROW_BYTES
    logits = off
    off += MMA_M * entries_per_cta * 4
    probs = off
    off += MMA_M * probs_row
    stats = off
    off += MMA_M * STATS_BYTES * max(push_ctas, 1)
    norm = off
    off += MMA_M * 8
    const_off = off if consts else -1
    off += CONSTS_BYTES if consts else 0
    inbox = round_up(off, 16) if push_ctas else -1
    off = inbox + push_ctas * MMA_M * INBOX_ROW_BYTES if push_ctas else off
    return SmemLayout(0, addresses, q, logits, probs, stats, norm, round_up(off, 16), probs_row,
                      const_off, inbox)


@dataclass(frozen=True)
class SparseMqaSpec:
    """One compiled sparse MQA kernel: heads, window, top-k and the split are baked in."""

    name: str
    heads: int                 # per rank
    window: int                # sliding window W
    swa_cols: int              # most SWA entries a row may see: W (+ the draft block, SWA-only)
    topk: int                  # 0: SWA-only layer (compressed/topk/block_tables unused)
    ring_slots: int            # SWA ring slots per state line (power of two)
    cluster_ctas: int
    entries_per_cta: int
    smem_bytes: int
    params: tuple[tuple[str, str], ...] = PARAMS
    block: tuple[int, int, int] = (CTA_THREADS, 1, 1)
    # balanced: CTA s takes [s * per, ..) of the row's list, per from the row's count (needs
    # row_info before any top-k load: a 4-hop address chain). fixed: CTA s takes SWA slots
    # [s * swa_share, ..) and top-k slots [s * topk_share, ..) whatever the row, so the top-k
    # ids load in the same wave as row_info (3 hops: top-k id -> block table -> record).
    split: str = "balanced"
    skip: tuple[str, ...] = ()         # timing-only ablation (PUSH_ABLATIONS); () for real kernels
    # pull: every CTA reads the others' (max, sum) and its dims of their partial o through DSMEM
    # loads after a cluster barrier (3 barriers; the loads are serial round trips). push: every
    # CTA stores its (max, sum) into each CTA's smem and the dims CTA c owns of its partial o into
    # CTA c's inbox before the barrier, so each barrier is followed by local loads only (2
    # barriers). Needs split="fixed" and 8 CTAs (warp w's 64 PV dims are CTA w's output dims).
    exchange: str = "pull"
    # QK with lane-run k order (kernels/sparse_mqa_qk.py): 16-dim runs per lane, vector loads,
    # two accumulator chains. The logits' fp32 summation order differs from the plain order.
    qk_runs: bool = False
    timeline: bool = False             # per-CTA stamps (TIMELINE_POINTS); params TIMELINE_PARAMS
    # Round 7 candidate, the step's kernel since round 8: resolve the addresses and issue every
    # record copy BEFORE griddepcontrol.wait, q after it. Valid only where everything but q was
    # written by kernels that completed before this one started: the step's wiring guarantees it
    # when the kernel launched right before (attn.rope_swa_insert: kernels/rope.py) triggers its
    # dependents after its own wait (so wq_b, the indexer, the compressor, the SWA insert and
    # rows_prep have completed). Needs split="fixed" and the push exchange.
    early: bool = False

    @property
    def swa_share(self) -> int:
        return ceil_div(self.swa_cols, self.cluster_ctas)

    @property
    def topk_share(self) -> int:
        return ceil_div(self.topk, self.cluster_ctas)

    @property
    def ablation(self) -> bool:
        return bool(self.skip)

    @property
    def cluster(self) -> tuple[int, int, int]:
        return (self.cluster_ctas, 1, 1)

    @property
    def max_entries(self) -> int:
        return self.swa_cols + self.topk

    @property
    def layout(self) -> SmemLayout:
        return smem_layout(self.heads, self.entries_per_cta, self.split == "fixed",
                           self.cluster_ctas if self.exchange == "push" else 0)

    def stamp_rows(self, rows: int) -> int:
        """Timeline builds: rows of TIMELINE_WORDS u64 the stamps buffer needs for `rows`."""
        return self.cluster_ctas * rows

    def grid(self, rows: int) -> tuple[int, int, int]:
        check_rows(rows, self.name)
        if rows > 65535:
            raise ValueError(f"{self.name}: {rows} rows exceed grid.y")
        return (self.cluster_ctas, rows, 1)

    def to_dict(self) -> dict:
        return {"family": "sparse_mqa", "name": self.name, "heads": self.heads,
                "window": self.window, "swa_cols": self.swa_cols, "topk": self.topk,
                "ring_slots": self.ring_slots, "cluster": list(self.cluster),
                "entries_per_cta": self.entries_per_cta, "params": params_dict(self.params),
                "block": list(self.block), "smem_bytes": self.smem_bytes, "split": self.split,
                "skip": list(self.skip), "exchange": self.exchange,
                "qk_runs": self.qk_runs} | ({"timeline": True} if self.timeline else {}) | (
                    {"early": True} if self.early else {})


def make_spec(heads: int, window: int, draft_rows: int, topk: int, ring_slots: int,
              split: str = "balanced", skip: tuple[str, ...] = (),
              exchange: str = "pull", qk_runs: bool = False,
              timeline: bool = False, early: bool = False) -> SparseMqaSpec:
    if not 1 <= heads <= MMA_M:
        raise ValueError(f"sparse MQA: {heads} heads per rank; the kernel holds 1..{MMA_M}")
    if ring_slots & (ring_slots - 1) or ring_slots < window + draft_rows:
        raise ValueError(f"sparse MQA: ring_slots {ring_slots} must be a power of two >= "
                         f"window {window} + draft rows {draft_rows}")
    # Draft rows (W + block entries) run only on SWA-only layers (the reference step refuses them
    # on compressed layers); a top-k kernel sees causal rows, at most W SWA entries.
    swa_cols = window if topk else window + draft_rows
    cluster = CLUSTER_TOPK if topk else CLUSTER_SWA
    if split not in SPLITS or (split == "fixed" and not topk):
        raise ValueError(f"sparse MQA: split {split!r}; splits {SPLITS} (fixed only with top-k)")
    push = exchange == "push"
    if exchange not in EXCHANGES or push and (split != "fixed" or cluster != CTA_THREADS // 32):
        raise ValueError(f"sparse MQA: exchange {exchange!r}; {EXCHANGES}, push only with the "
                         f"fixed split and {CTA_THREADS // 32} CTAs")
    if skip and (not push or not set(skip) <= set(PHASES)):
        raise ValueError(f"sparse MQA: skip {skip!r}: ablations of push kernels only, phases "
                         f"{PHASES}")
    if split == "fixed":
        per = round_up(ceil_div(swa_cols, cluster) + ceil_div(topk, cluster), ENTRY_TILE)
    else:
        per = round_up(ceil_div(swa_cols + topk, cluster), ENTRY_TILE)
    layout = smem_layout(heads, per, split == "fixed", cluster if push else 0)
    kind = f"topk{topk}" if topk else "swa"
    name = f"sparse_mqa_{kind}_h{heads}_w{window}_c{cluster}"
    name += "_fixed" if split == "fixed" else ""
    name += "_push" if push else ""
    name += "_runs" if qk_runs else ""
    if early and not push:
        raise ValueError(f"{name}: early (records before the PDL wait) needs the fixed split and "
                         f"the push exchange")
    name += "_early" if early else ""
    name += "_skip_" + "_".join(skip) if skip else ""
    if timeline and skip:
        raise ValueError(f"{name}: a timeline build of an ablation measures nothing useful")
    name += "_timeline" if timeline else ""
    if CTAS_PER_SM * (layout.total + 1024) > SM_SMEM_BYTES:
        raise ValueError(f"{name}: {CTAS_PER_SM} CTAs per SM of {layout.total} B shared memory")
    return SparseMqaSpec(name, heads, window, swa_cols, topk, ring_slots, cluster, per,
                         layout.total, params=TIMELINE_PARAMS if timeline else PARAMS,
                         split=split, skip=tuple(skip), exchange=exchange, qk_runs=qk_runs,
                         timeline=timeline, early=early)


# Every top-k kernel the bundle carries with outputs that count (GPU-tested), by variant key.
TOPK_VARIANTS = {"balanced": {}, "fixed": {"split": "fixed"},
                 "fixed_push": {"split": "fixed", "exchange": "push"},
                 "fixed_push_runs": {"split": "fixed", "exchange": "push", "qk_runs": True},
                 "fixed_push_runs_early": {"split": "fixed", "exchange": "push", "qk_runs": True,
                                           "early": True}}
# The top-k kernel the step runs. Round 8: fixed_push_runs_early (addresses and record copies
# before griddepcontrol.wait), bitwise equal to fixed_push_runs; run r7c, attn_timeline family PDL
# chain, exit pitch us at 4k R = 1 / 6, 64k R = 1 / 6: 11.07 / 11.01 / 10.82 / 11.07 ->
# 9.73 / 9.63 / 9.41 / 9.60 (-1.3 us a launch; predicted -0.3 to -0.8 in the step, where the
# window before the wait is only the RoPE kernel's tail). Its premise (the kernel launched right
# before it triggers after its own wait) is tests/test_sparse_mqa_early_contract.py.
# One-line revert: STEP_TOPK_VARIANT = STEP_TOPK_VARIANT_ROUND7 (still built: candidate_specs);
# older: TOPK_VARIANTS["fixed_push"], or "fixed" (the best measured in session 1, 12.7 us at R = 1).
STEP_TOPK_VARIANT_ROUND7 = TOPK_VARIANTS["fixed_push_runs"]
STEP_TOPK_VARIANT = TOPK_VARIANTS["fixed_push_runs_early"]


def _topk_spec(cfg, tp: int, max_block_rows: int, **variant) -> SparseMqaSpec:
    heads = cfg.rank_shapes(tp).heads
    ring = next_pow2(cfg.sliding_window + max_block_rows)
    return make_spec(heads, cfg.sliding_window, cfg.dspark_block_size, cfg.index_topk, ring,
                     **variant)


def sparse_mqa_specs(cfg, tp: int, max_block_rows: int = DEFAULT_MAX_BLOCK_ROWS):
    """The SWA-only kernel (layers 0, 1 and the DSpark stages) and the step's SWA + top-k kernel."""
    heads = cfg.rank_shapes(tp).heads
    ring = next_pow2(cfg.sliding_window + max_block_rows)
    return [make_spec(heads, cfg.sliding_window, cfg.dspark_block_size, 0, ring),
            _topk_spec(cfg, tp, max_block_rows, **STEP_TOPK_VARIANT)]


def candidate_specs(cfg, tp: int,
                    max_block_rows: int = DEFAULT_MAX_BLOCK_ROWS) -> dict[str, SparseMqaSpec]:
    """Every top-k kernel whose outputs count, by variant key (TOPK_VARIANTS); the step's is one."""
    return {key: _topk_spec(cfg, tp, max_block_rows, **kw) for key, kw in TOPK_VARIANTS.items()}


def variant_specs(cfg, tp: int, max_block_rows: int = DEFAULT_MAX_BLOCK_ROWS):
    """Beside `sparse_mqa_specs`: the other candidates (tested like the step's kernel) and, when
    the step's kernel pushes, its timing-only ablations (`PUSH_ABLATIONS`), reported side by side."""
    step = sparse_mqa_specs(cfg, tp, max_block_rows)[1]
    others = [s for s in candidate_specs(cfg, tp, max_block_rows).values() if s.name != step.name]
    if step.exchange != "push":
        return others
    return others + [_topk_spec(cfg, tp, max_block_rows, skip=skip, **STEP_TOPK_VARIANT)
                     for skip in PUSH_ABLATIONS]


# Candidates whose timeline twin is built beside the step kernels' (round 7: the early one; round
# 8, the step's now: the round-7 step kernel, so either side of the switch has its twin).
TIMELINE_CANDIDATES = ("fixed_push_runs", "fixed_push_runs_early")


def timeline_specs(cfg, tp: int, max_block_rows: int = DEFAULT_MAX_BLOCK_ROWS):
    """The `_timeline` twins of `sparse_mqa_specs` (the step's SWA-only and top-k kernels), then
    of the TIMELINE_CANDIDATES that are not the step's."""
    heads = cfg.rank_shapes(tp).heads
    ring = next_pow2(cfg.sliding_window + max_block_rows)
    out = [make_spec(heads, cfg.sliding_window, cfg.dspark_block_size, 0, ring, timeline=True),
           _topk_spec(cfg, tp, max_block_rows, timeline=True, **STEP_TOPK_VARIANT)]
    return out + [_topk_spec(cfg, tp, max_block_rows, timeline=True, **TOPK_VARIANTS[key])
                  for key in TIMELINE_CANDIDATES if TOPK_VARIANTS[key] != STEP_TOPK_VARIANT]


def timeline_points(spec: SparseMqaSpec) -> tuple[str, ...]:
    """The order a build's points are reached in: an early build resolves the addresses and
    issues the records before the wait."""
    if not spec.early:
        return TIMELINE_POINTS
    first = ("entry", "addresses", "issued", "before_wait", "after_wait")
    return first + tuple(p for p in TIMELINE_POINTS if p not in first)


# ---- row metadata ------------------------------------------------------------------------------

def row_info(rows, window: int) -> np.ndarray:
    """int32 [R, 4] (position, swa_lo, swa_hi, seq) of a RowBatch (attention_ref block rules).

    Causal rows (decode, verify) see p - W + 1 .. p; draft rows see block_start - W .. block_end.
    Padding rows get (0, 0, -1, -1).
    """
    from executor.reference.rows import KIND_DRAFT
    info = np.zeros((rows.num_rows, INFO_FIELDS), np.int32)
    info[:, 2:] = -1
    for s in range(rows.num_seqs):
        idx = rows.seq_rows(s)
        pos = rows.positions[idx]
        if rows.block_kind[idx[0]] == KIND_DRAFT:
            lo, hi = np.full_like(pos, pos[0] - window), np.full_like(pos, pos[-1])
        else:
            lo, hi = pos - window + 1, pos
        info[idx] = np.stack([pos, np.maximum(lo, 0), hi, np.full_like(pos, s)], axis=1)
    return info


def split_entries(count: int, cluster_ctas: int) -> int:
    """Entries per CTA of a row with `count` entries (the last CTAs may get fewer or none)."""
    return round_up(ceil_div(count, cluster_ctas), ENTRY_TILE) if count > 0 else 0


# ---- reference ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Gathered:
    """The records one launch reads, as the reference sees them."""

    kv: np.ndarray         # [R, C, 512] float32 dequantized entries (0 where masked)
    valid: np.ndarray      # [R, C] bool
    record_ids: list       # per row: list of (cache name, physical row) actually read


def gather(spec: SparseMqaSpec, swa: np.ndarray, compressed: np.ndarray | None,
           topk: np.ndarray | None, block_tables: np.ndarray, info: np.ndarray,
           state_lines: np.ndarray, page_size: int) -> Gathered:
    """Each row's entries from the cache bytes, in the kernel's order (SWA, then top-k).

    Raises ValueError, naming the row, where the kernel writes NaN (bad input); reading a record
    that was never written (poison: NaN after decoding) is also an error, as in the reference step.
    """
    r = info.shape[0]
    kv = np.zeros((r, spec.max_entries, HEAD_DIM), np.float32)
    valid = np.zeros((r, spec.max_entries), bool)
    ids = []
    for i in range(r):
        _pos, lo, hi, seq = (int(v) for v in info[i])
        read = []
        if seq >= 0:
            n_swa = max(hi - lo + 1, 0)
            if lo < 0 or n_swa > spec.swa_cols:
                raise ValueError(f"row {i}: SWA range {lo}..{hi} outside 0.. / wider than "
                                 f"{spec.swa_cols} entries")
            line = int(state_lines[seq])
            slots = line * spec.ring_slots + np.arange(lo, hi + 1) % spec.ring_slots
            read += [("swa", int(s)) for s in slots]
            entries = [swa[slots]] if n_swa > 0 else []
            for j, e in enumerate(topk[i] if spec.topk else ()):
                if e < 0:
                    continue
                page = int(e) // page_size
                if page >= block_tables.shape[1] or block_tables[seq, page] < 0:
                    raise ValueError(f"row {i}: top-k entry {int(e)} (slot {j}) is on page "
                                     f"{page}, outside or unallocated in sequence {seq}'s table")
                phys = int(block_tables[seq, page]) * page_size + int(e) % page_size
                read.append(("compressed", phys))
                entries.append(compressed[phys][None])
                valid[i, n_swa + j] = True
            valid[i, :n_swa] = True
            if entries:
                decoded = rec.decode_kv_record(np.concatenate(entries))
                kv[i, valid[i]] = decoded
        ids.append(read)
    if not np.isfinite(kv[valid]).all():
        row = int(np.flatnonzero((~np.isfinite(kv).all(axis=2) & valid).any(axis=1))[0])
        raise ValueError(f"row {row} attends to a KV record that was never written (poison)")
    return Gathered(kv, valid, ids)


def sparse_mqa_ref(spec: SparseMqaSpec, q: np.ndarray, gathered: Gathered, sink: np.ndarray,
                   info: np.ndarray, table: rope_ref.RopeTable) -> np.ndarray:
    """bf16 [R, H, 512]: attention_ref.sparse_mqa, then inverse RoPE (fp32) and bf16, as A13-A14."""
    o = attention_ref.sparse_mqa(np.asarray(q, np.float32), gathered.kv, gathered.valid,
                                 np.asarray(sink, np.float32))
    real = info[:, 3] >= 0
    positions = np.where(real, info[:, 0], 0)
    o = rope_ref.apply_rope(o, positions, table, inverse=True)
    o[~real] = 0.0
    return to_bf16(o)


def sparse_mqa_f64(spec: SparseMqaSpec, q: np.ndarray, gathered: Gathered, sink: np.ndarray,
                   info: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Float64 ground truth (no roundings at all), for tolerance checks."""
    o = attention_ref.sparse_mqa_f64(np.asarray(q, np.float64), gathered.kv, gathered.valid,
                                     np.asarray(sink, np.float64))
    real = info[:, 3] >= 0
    o = rope_ref.rope_f64(o, np.where(real, info[:, 0], 0), inv_freq, inverse=True)
    o[~real] = 0.0
    return o


def error_bound(q: np.ndarray, gathered: Gathered, sink: np.ndarray, info: np.ndarray,
                inv_freq: np.ndarray) -> np.ndarray:
    """Per-element bound on |kernel - sparse_mqa_ref| (float64 [R, H, 512]).

    Both sides compute the same formula; they differ where an fp32 quantity lands on the other
    side of a BF16 rounding boundary. Kernel logits are fp32 sums of exact BF16 x BF16 products
    (mma), exp is ex2.approx: relative errors ~2^-20, so each probability P_n rounds to the same or
    an adjacent BF16 value on each side: |dP_n| <= 2^-8 P_n in all, i.e. at most
    2^-8 * sum_n P_n |v_nd| =: 2^-8 A_d on o_d. Each side rounds o once to BF16 (2^-9 |o_d|) and,
    on dims 448..511, rotates the BF16 pair (x0, x1) by |c|, |s| <= 1 and rounds again, which
    mixes the pair's errors. Bound: 2^-7 (A_d + |o_d|) (pair summed on rope dims) + 2^-7 |o_rot|
    + 2^-24, o the float64 result.
    """
    kv = np.where(gathered.valid[:, :, None], gathered.kv, 0).astype(np.float64)
    logits = np.matmul(np.asarray(q, np.float64), kv.transpose(0, 2, 1)) * attention_ref.SOFTMAX_SCALE
    logits = np.where(gathered.valid[:, None, :], logits, -np.inf)
    sk = np.asarray(sink, np.float64)[None, :, None]
    m = np.maximum(logits.max(axis=2, keepdims=True), sk)
    e = np.exp(logits - m)
    p = e / (e.sum(axis=2, keepdims=True) + np.exp(sk - m))
    weight = np.matmul(p, np.abs(kv))                                   # A_d
    o = np.matmul(p, kv)
    err = 2.0 ** -7 * (weight + np.abs(o))
    rope = err[..., -rope_ref.ROPE_DIM:]
    pair = rope.reshape(*rope.shape[:-1], -1, 2).sum(axis=-1)
    err[..., -rope_ref.ROPE_DIM:] = np.repeat(pair, 2, axis=-1)
    real = info[:, 3] >= 0
    rotated = rope_ref.rope_f64(o, np.where(real, info[:, 0], 0), inv_freq, inverse=True)
    bound = err + 2.0 ** -7 * np.abs(rotated) + 2.0 ** -24
    bound[~real] = 0.0
    return bound


# ---- bytes and predicted time --------------------------------------------------------------------

def bytes_read(spec: SparseMqaSpec, gathered: Gathered) -> dict:
    """Bytes one launch moves: `records` as the kernel issues them (each row reads its own entries;
    a record shared by rows of a verify block is read once per row, the repeats are L2 hits),
    `unique_records` (the HBM floor: each distinct record once), and the small per-row arrays."""
    r = len(gathered.record_ids)
    per_row = sum(len(ids) for ids in gathered.record_ids)
    unique = len({rid for ids in gathered.record_ids for rid in ids})
    q_out = 2 * r * spec.heads * HEAD_DIM * 2
    meta = r * (INFO_FIELDS * 4 + spec.topk * 4)
    return {"records": per_row * RECORD_BYTES, "unique_records": unique * RECORD_BYTES,
            "q_out": q_out, "meta": meta,
            "must_read": unique * RECORD_BYTES + q_out + meta}


def hbm_floor_us(nbytes: int) -> float:
    return nbytes / H200_HBM_BYTES_PER_S * 1e6
