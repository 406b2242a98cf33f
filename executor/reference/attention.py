"""The V4.1 attention sublayer of the reference step on one rank (model doc §2.2 A1-A16).

    x [R, D] (BF16 values) -> wq_a|wkv (W8A16, replicated) -> q_norm, kv_norm -> RoPE(kv)
      -> SWA insert
      -> compressor (kv sources: ratio-2 ring pooling / ratio 1) -> publish entry + index key
      -> indexer (index sources): FP4 query, scores over the kv source's keys, top-k (+ candidates)
      -> per rank: wq_b -> RoPE(q) -> sparse MQA over SWA window + top-k entries (sink)
      -> inverse RoPE -> wo_a (grouped) -> wo_b partial [R, D] float32 (summed over ranks by AR-1)

Rounding (stock SM90): linear outputs and norms are BF16 (products summed in float64 and rounded to
float32 first, an order-independent stand-in for fp32 accumulation); compressor latents and index
keys stay float32 until their records; the query is BF16 after RoPE; attention probabilities BF16
before PV; o BF16; the returned wo_b partial is float32 (the step rounds after AR-1).
`exact=True` (must match `caches.exact`) keeps KV entries and index keys as BF16 values instead of
records and skips the FP4 index-query quantization; every BF16 rounding stays.

Write-then-read order per layer: SWA insert, compressor ring and published entries, index keys,
then index scan and attention. With the block rules of `kernels.attention_ref` this equals running
the rows of a causal block one at a time (tests/test_ref_attention.py checks it).

Weights read from `lw` (executor.reference.weights.LayerWeights): `lw.spec` (LayerSpec);
`lw.dense(name)` for attn.wq_a, attn.wkv, attn.wq_b (rank's heads), attn.wo_a (rank's groups),
attn.wo_b (rank's input columns), attn.indexer.wq_b; `lw.vector(name)` for attn.q_norm.weight,
attn.kv_norm.weight, attn.attn_sink (rank's heads), attn.compressor.{wkv,wgate,norm}.weight,
attn.indexer.{weights_proj,wk,k_norm}.weight.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import numpy as np

from executor.reference.kvcache import KVCaches
from executor.reference.rows import KIND_DRAFT, RowBatch
from kernels import attention_ref, compressor_ref, indexer_ref, rope_ref
from kernels.norm_ref import rmsnorm_ref
from loader.formats import bf16_round, to_bf16


@dataclass(frozen=True)
class SharedAttention:
    """The rank-independent half of one layer's attention (replicated work, done once per step)."""

    qr: np.ndarray     # [R, q_lora] BF16 values after q_norm
    kv: np.ndarray     # [R, C, 512] gathered entries (SWA window, then top-k compressed)
    valid: np.ndarray  # [R, C] bool


@functools.lru_cache(maxsize=8)
def rope_for(cfg, ratio: int) -> rope_ref.RopeTable:
    """A layer's RoPE: plain theta 1e4 on ratio-0 layers, theta 1.6e5 + YaRN on compressed ones."""
    return rope_ref.RopeTable.for_ratio(cfg, ratio)


def _rope(x: np.ndarray, positions: np.ndarray, table, inverse: bool = False) -> np.ndarray:
    return rope_ref.apply_rope(x, positions, table, inverse=inverse)


# Linear weights as float64, per LayerWeights object (dropped with it).
_WEIGHTS_F64: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_DENSE = ("attn.wq_a", "attn.wkv", "attn.wq_b", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b")


def _weight(lw, name: str) -> np.ndarray:
    """float64 copy of a linear weight (`lw.dense` for FP8 ones, `lw.vector` for the rest)."""
    cache = _WEIGHTS_F64.setdefault(lw, {})
    if name not in cache:
        if name == "attn.compressor.wkv|wgate":
            w = np.concatenate([lw.vector("attn.compressor.wkv.weight"),
                                lw.vector("attn.compressor.wgate.weight")])
        else:
            w = lw.dense(name) if name in _DENSE else lw.vector(name)
        cache[name] = w.astype(np.float64)
    return cache[name]


def _dot(x: np.ndarray, w64: np.ndarray) -> np.ndarray:
    """x @ w^T with exact products summed in float64, rounded once to float32.

    The oracle for the kernels' fp32 accumulation: order-independent, so a row's result does not
    depend on which other rows share the batch (a verify block equals its rows run one by one).
    """
    return (x.astype(np.float64) @ w64.T).astype(np.float32)


def _linear(x: np.ndarray, lw, name: str) -> np.ndarray:
    """W8A16: BF16 input values x dequantized weights, fp32-or-better accumulation, BF16 output."""
    return bf16_round(_dot(x, _weight(lw, name)))


def _norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return rmsnorm_ref(to_bf16(x), w, eps).astype(np.float32)


def _step_key(rows: RowBatch) -> tuple:
    return (rows.positions.tobytes(), rows.seq_index.tobytes(), rows.state_lines.tobytes())


def _check_inputs(lw, x: np.ndarray, rows: RowBatch, caches: KVCaches, cfg, exact: bool) -> None:
    if x.shape != (rows.num_rows, cfg.hidden_size) or x.dtype != np.float32:
        raise ValueError(
            f"layer {lw.spec.index} attention input: expected float32 [{rows.num_rows}, "
            f"{cfg.hidden_size}], got {x.dtype} {x.shape}"
        )
    if bool(exact) != caches.exact:
        raise ValueError(
            f"attention exact={exact} but the KV caches were allocated exact={caches.exact}")
    if lw.spec.ratio and np.any(rows.block_kind[rows.real] == KIND_DRAFT):
        raise ValueError(f"layer {lw.spec.index}: draft rows run only the SWA-only DSpark stages")
    _check_slots(rows, caches)
    too_long = [s for s in range(rows.num_seqs) if rows.seq_rows(s).size > caches.ring_slots
                - cfg.sliding_window or rows.seq_rows(s).size > caches.ring_rows - 2]
    if too_long:
        raise ValueError(
            f"sequences {too_long} have more rows in one step than these caches allow "
            f"(allocate with a larger max_block_rows, or split the block)"
        )


def _check_slots(rows: RowBatch, caches: KVCaches) -> None:
    real = rows.real
    want = caches.swa_slots(rows.state_lines[rows.seq_index[real]], rows.positions[real])
    if np.any(rows.slot_mapping[real] != want):
        bad = np.flatnonzero(real)[rows.slot_mapping[real] != want]
        raise ValueError(
            f"slot_mapping of rows {bad.tolist()} is not state_line * {caches.ring_slots} + "
            f"position % {caches.ring_slots} (the SWA ring layout of these caches)"
        )


def insert_swa(lw, x: np.ndarray, rows: RowBatch, caches: KVCaches, cfg) -> None:
    """A1 (kv half), kv_norm, RoPE, A6: write the real rows' SWA entries.

    Also the DSpark context KV (model doc §4 step 2): x = main_x of the accepted positions, rows a
    causal block of them, lw a DSpark stage.
    """
    _check_slots(rows, caches)
    kv = _norm(_linear(x, lw, "attn.wkv"), lw.vector("attn.kv_norm.weight"), cfg.rms_norm_eps)
    real = rows.real
    entries = bf16_round(_rope(kv[real], rows.positions[real], rope_for(cfg, lw.spec.ratio)))
    # The record keeps the rope dims as BF16 and quantizes the (BF16) nope dims to FP8.
    caches.store_kv(caches.swa[lw.spec.index], rows.slot_mapping[real], entries)


def _publish(lw, latent: np.ndarray, positions: np.ndarray, rows_idx: np.ndarray, rows: RowBatch,
             caches: KVCaches, cfg) -> None:
    """A8/A9: entry p // r <- RoPE(latent) and its index key, for the publishing rows `rows_idx`."""
    spec, eps = lw.spec, cfg.rms_norm_eps
    if rows_idx.size == 0:
        return
    table = rope_for(cfg, spec.ratio)
    entry_pos = compressor_ref.entry_positions(positions, spec.ratio)
    entry = compressor_ref.rotate(latent, entry_pos, table)
    keys = compressor_ref.index_key(latent, lw.vector("attn.indexer.wk.weight"),
                                    lw.vector("attn.indexer.k_norm.weight"), eps, entry_pos, table)
    if caches.exact:
        entry, keys = bf16_round(entry), bf16_round(keys)
    for s in np.unique(rows.seq_index[rows_idx]):
        mine = rows.seq_index[rows_idx] == s
        phys = caches.entry_rows(rows.block_tables[s], positions[mine] // spec.ratio)
        caches.store_kv(caches.compressed[spec.index], phys, entry[mine])
        caches.store_keys(spec.index, phys, keys[mine])


def compress(lw, x: np.ndarray, rows: RowBatch, caches: KVCaches, cfg) -> None:
    """A2, A7-A9 for a kv source: fill the ring (ratio 2) and publish entries and index keys."""
    spec, eps = lw.spec, cfg.rms_norm_eps
    real = np.flatnonzero(rows.real)
    pos = rows.positions[real]
    norm_w = lw.vector("attn.compressor.norm.weight")
    if spec.ratio == 1:
        score = compressor_ref.project(x[real], _weight(lw, "attn.compressor.wkv.weight"))
        latent = compressor_ref.rmsnorm_f32(score, norm_w, eps)
        _publish(lw, latent, pos, real, rows, caches, cfg)
        return
    kv_score = compressor_ref.project(x[real], _weight(lw, "attn.compressor.wkv|wgate"))
    lines = rows.state_lines[rows.seq_index[real]]
    ring, ring_pos, rr = caches.ring[spec.index], caches.ring_pos[spec.index], caches.ring_rows
    ring[lines, pos % rr] = kv_score
    ring_pos[lines, pos % rr] = pos
    odd = compressor_ref.publishes(pos, 2)
    lines, pos = lines[odd], pos[odd]
    pair_rows = np.stack([(pos - 1) % rr, pos % rr], axis=1)
    held = ring_pos[lines[:, None], pair_rows]
    if np.any(held != np.stack([pos - 1, pos], axis=1)):
        bad = pos[(held != np.stack([pos - 1, pos], axis=1)).any(axis=1)]
        raise ValueError(
            f"layer {spec.index}: the compressor ring lacks the even predecessor of odd positions "
            f"{bad.tolist()} (skipped position, or rolled back past it)"
        )
    pairs = ring[lines[:, None], pair_rows]  # [N, 2, 1024]
    half = compressor_ref.HEAD_DIM
    pooled = compressor_ref.pool_pairs(pairs[:, :, :half], pairs[:, :, half:])
    latent = compressor_ref.rmsnorm_f32(pooled, norm_w, eps)
    _publish(lw, latent, pos, real[odd], rows, caches, cfg)


def index_topk(lw, x: np.ndarray, qr: np.ndarray, rows: RowBatch, caches: KVCaches, cfg,
               exact: bool) -> np.ndarray:
    """A3, A10-A12: [R, topk] int32 entry ids of the kv source's cache, -1 padded (+ candidates)."""
    spec = lw.spec
    nh, hd = cfg.index_n_heads, cfg.index_head_dim
    q = _linear(qr, lw, "attn.indexer.wq_b").reshape(-1, nh, hd)
    # uncertain: index queries and keys use the layer's compress RoPE (theta 1.6e5 + YaRN).
    q = bf16_round(_rope(q, rows.positions, rope_for(cfg, spec.ratio)))
    if not exact:
        q = indexer_ref.fp4_quantize_dequantize(q)
    # uncertain: weights_proj output rounded to BF16 (a BF16 linear), then scaled in fp32.
    w = _linear(x, lw, "attn.indexer.weights_proj.weight") * np.float32((hd * nh) ** -0.5)
    topk = np.full((rows.num_rows, cfg.index_topk), -1, np.int32)
    cands = np.full((rows.num_rows, cfg.candidate_topk_blocks), -1, np.int32)
    prior = None
    if spec.uses_candidates:
        prior = _step_scratch(caches.step_candidates, cfg.candidate_source_layer_id, rows, spec)
    for s in range(rows.num_seqs):
        idx = rows.seq_rows(s)
        pos = rows.positions[idx]
        n = int(pos[-1] + 1) // spec.ratio
        if n == 0:
            continue
        phys = caches.entry_rows(rows.block_tables[s], np.arange(n))
        keys = caches.load_keys(spec.kv_source, phys)
        # One scan for all rows of the block; each row keeps its own visible prefix.
        scores = indexer_ref.index_scores(q[idx], w[idx], keys)
        visible = indexer_ref.visible_mask((pos + 1) // spec.ratio, n)
        if not np.isfinite(scores[visible]).all():  # poison: a visible key was never written
            raise ValueError(f"layer {spec.index}: sequence {s} scores an index key of layer "
                             f"{spec.kv_source} that was never written")
        allowed = visible
        if prior is not None:
            inside = indexer_ref.candidate_entry_mask(prior[idx], n, cfg.candidate_block_size)
            allowed = visible & inside
        topk[idx] = indexer_ref.topk_entries(scores, allowed, cfg.index_topk)
        if spec.is_candidate_source:
            cands[idx] = indexer_ref.candidate_blocks(
                scores, visible, pos, cfg.candidate_block_size, cfg.candidate_topk_blocks)
    if spec.is_candidate_source:
        caches.step_candidates[spec.index] = (_step_key(rows), cands)
    caches.step_topk[spec.index] = (_step_key(rows), topk)
    return topk


def _step_scratch(scratch: dict, source: int, rows: RowBatch, spec) -> np.ndarray:
    key, value = scratch.get(source, (None, None))
    if key != _step_key(rows):
        raise ValueError(f"layer {spec.index} needs this step's output of layer {source}, "
                         f"which has not run on these rows yet")
    return value


def gather(spec, topk: np.ndarray | None, rows: RowBatch, caches: KVCaches, cfg):
    """([R, C, 512] entries, [R, C] valid): the SWA window (block rules) then the top-k entries."""
    real = rows.real
    seq = np.where(real, rows.seq_index, 0)
    # One extra slot so padding rows (seq -> 0) index something even in an all-padding step.
    firsts = np.array([rows.positions[rows.seq_rows(s)[0]] for s in range(rows.num_seqs)] + [0])
    lasts = np.append(rows.context_lens - 1, 0)
    lines = np.append(rows.state_lines, 0)
    cols, valid = attention_ref.swa_positions(rows.positions, firsts[seq], lasts[seq],
                                              rows.block_kind == KIND_DRAFT, cfg.sliding_window)
    valid &= real[:, None]
    slots = caches.swa_slots(lines[seq][:, None], cols)
    kv = caches.load_kv(caches.swa[spec.index], slots)
    if topk is None:
        _check_written(spec, kv, valid, rows)
        return kv, valid
    ok = (topk >= 0) & real[:, None]
    ent = np.where(ok, topk, 0)
    tables = np.concatenate([rows.block_tables, np.zeros_like(rows.block_tables[:1])])[seq]
    page = ent // caches.page_size
    if np.any(page >= tables.shape[1]):
        raise ValueError(f"layer {spec.index}: a top-k entry lies beyond the block tables' "
                         f"{tables.shape[1]} pages")
    pages = np.take_along_axis(tables, page, axis=1).astype(np.int64)
    if np.any(ok & (pages < 0)):
        raise ValueError(f"layer {spec.index}: a top-k entry falls on an unallocated page (-1)")
    phys = np.where(ok, pages * caches.page_size + ent % caches.page_size, 0)
    comp = caches.load_kv(caches.compressed[spec.kv_source], phys)
    kv, valid = np.concatenate([kv, comp], axis=1), np.concatenate([valid, ok], axis=1)
    _check_written(spec, kv, valid, rows)
    return kv, valid


def _check_written(spec, kv: np.ndarray, valid: np.ndarray, rows: RowBatch) -> None:
    """Unwritten cache memory is poison (NaN): a row that would attend to it is a caller bug."""
    bad = ~np.isfinite(kv).all(axis=2) & valid
    if bad.any():
        r = int(np.flatnonzero(bad.any(axis=1))[0])
        raise ValueError(f"layer {spec.index}: row {r} (position {rows.positions[r]}) attends to a "
                         f"KV entry that was never written (missing prefill or skipped position?)")


def attention_shared(lw, x: np.ndarray, rows: RowBatch, caches: KVCaches, cfg,
                     exact: bool = False) -> SharedAttention:
    """Everything replicated across ranks: cache writes, index top-k and the gathered entries."""
    _check_inputs(lw, x, rows, caches, cfg, exact)
    spec = lw.spec
    qr = _norm(_linear(x, lw, "attn.wq_a"), lw.vector("attn.q_norm.weight"), cfg.rms_norm_eps)
    insert_swa(lw, x, rows, caches, cfg)
    if spec.owns_compressor:
        compress(lw, x, rows, caches, cfg)
    topk = None
    if spec.has_indexer:
        topk = index_topk(lw, x, qr, rows, caches, cfg, exact)
    elif spec.ratio:
        topk = _step_scratch(caches.step_topk, spec.topk_source, rows, spec)
    kv, valid = gather(spec, topk, rows, caches, cfg)
    return SharedAttention(qr=qr, kv=kv, valid=valid)


def attention_heads(lw, shared: SharedAttention, rows: RowBatch, cfg, tp: int) -> np.ndarray:
    """A4, A5 (q), A13-A15 on one rank: the wo_b input [R, G_l * o_lora] (BF16 values)."""
    shapes = cfg.rank_shapes(tp)
    r, hd = rows.num_rows, cfg.head_dim
    table = rope_for(cfg, lw.spec.ratio)
    q = _linear(shared.qr, lw, "attn.wq_b").reshape(r, shapes.heads, hd)
    q = bf16_round(_rope(q, rows.positions, table))
    o = attention_ref.sparse_mqa(q, shared.kv, shared.valid, lw.vector("attn.attn_sink"))
    o = bf16_round(_rope(o, rows.positions, table, inverse=True))
    # wo_a: group g of this rank maps its heads' outputs [hpg * 512] to o_lora (block-diagonal).
    wo_a = _weight(lw, "attn.wo_a").reshape(shapes.o_groups, cfg.o_lora_rank, cfg.o_group_in_dim)
    grouped = o.reshape(r, shapes.o_groups, cfg.o_group_in_dim).transpose(1, 0, 2)
    z = bf16_round(np.matmul(grouped.astype(np.float64), wo_a.transpose(0, 2, 1)))  # [G_l, R, lora]
    return z.transpose(1, 0, 2).reshape(r, -1)


def attention_rank(lw, shared: SharedAttention, rows: RowBatch, cfg, tp: int,
                   rank: int) -> np.ndarray:
    """One rank's wo_b partial [R, D] float32, not rounded (AR-1 sums, then rounds once)."""
    partial = _dot(attention_heads(lw, shared, rows, cfg, tp), _weight(lw, "attn.wo_b"))
    partial[~rows.real] = 0.0
    return partial


def attention_sublayer(lw, x: np.ndarray, rows: RowBatch, caches: KVCaches, cfg, tp: int,
                       rank: int, exact: bool = False) -> np.ndarray:
    """One rank's attention partial [R, D] float32 (AR-1 sums them over ranks).

    The replicated half runs once per layer and step: a call for a rank not yet served with the same
    (layer, rows, x) reuses `caches.shared_memo` instead of recomputing (its cache writes are
    idempotent, so this changes time, not values); serving a rank twice recomputes.
    """
    key = (lw.spec.index, _step_key(rows), x.tobytes(), bool(exact))
    memo = caches.shared_memo
    if memo.get("key") != key or rank in memo["ranks"]:
        memo.update(key=key, ranks=set(), shared=attention_shared(lw, x, rows, caches, cfg, exact))
    memo["ranks"].add(rank)
    return attention_rank(lw, memo["shared"], rows, cfg, tp, rank)


def attention_sublayer_ranks(lws, x: np.ndarray, rows: RowBatch, caches: KVCaches, cfg, tp: int,
                             exact: bool = False, map_ranks=None) -> list[np.ndarray]:
    """Every rank's partial, with the replicated half computed once (same values as per rank).
    `map_ranks(fn, items)` (ReferenceModel.map_ranks: threads) runs the ranks' halves; each
    reads only its own weights and the shared half, so the values do not depend on it."""
    shared = attention_shared(lws[0], x, rows, caches, cfg, exact)
    jobs = list(enumerate(lws))
    run = map_ranks or (lambda fn, items: [fn(item) for item in items])
    return run(lambda job: attention_rank(job[1], shared, rows, cfg, tp, job[0]), jobs)
