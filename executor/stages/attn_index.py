"""Stages of the attention sublayer's indexer and sparse MQA on one rank's arena (wire-attn group B).

Roles (executor/plan.py), model doc §2.2 A3, A10-A14, executor/reference/attention.py:

  attn.indexer     (index sources: full and reindex layers)
                   indexer wq_b (W8A16) `attn.qr` -> `attn.index_q` [R, nh, 128] (with
                   attn_proj.FOLD_Q_NORM at R <= 8: kernels.dense_qnorm from the q half of
                   `attn.qkv`, q_norm in its prologue, the same bytes); RoPE in place
                   (the compressed layers' YaRN table `rope.yarn`, dims 64..127 of each head);
                   head weights (BF16 linear, kernels.linear_bf16) `xn` -> `attn.index_w`
                   [R, nh]; then prep, scores over the kv source's `index_keys_{k}`, top-k ->
                   `attn.topk.{l}` (+ candidate blocks -> `attn.candidates.{l}` on the candidate
                   source; the reindex layers read those of cfg.candidate_source_layer_id).
  attn.sparse_mqa  (every backbone layer) `attn.q` [R, H_l, 512] over the layer's SWA ring
                   `swa_{l}` (+ the top-k entries `attn.topk.{topk_source}` of the kv source's
                   `compressed_{k}`) -> `attn.o` [R, H_l, 512], already inverse-RoPE'd (the
                   kernel does A14), the wo_a input.

Inputs from the other groups: `attn.qr` and `attn.q` (group A, attn_proj), `xn`, `positions32`
and `row_info` (head.rows_prep), the RoPE tables `rope.plain` / `rope.yarn` (group A's weights, fp32
[cfg.max_position_embeddings, 32, 2]), and the bound row metadata and caches. The top-k buffers
persist across layers: a REUSE layer reads its topk_source's, which ran earlier in the step.

The KV cache geometry (page size, block-table width, SWA ring size) comes from `ctx.geometry`
(executor.bind.CacheGeometry): the indexer kernels are compiled for kernels.indexer.PAGE_SIZE
and the sparse MQA kernels for one ring size, and a mismatch is refused at wiring time.

Arena: the scores scratch is f32 [max_rows, cfg.max_position_embeddings] (buffers() does not see
the cache geometry; 768 MiB at v41-flash's 1M positions and 192 rows), its row stride at wiring
the block tables' reach. The split-K counters `attn.indexer.wq_b_counters` must be zero before
the first launch (HostArena is zeroed; on the GPU the Executor zeroes them once after allocating).
"""
from __future__ import annotations

import numpy as np

from executor.launches import dense as dl
from executor.launches import indexer as il
from executor.launches.linear_bf16 import linear_bf16_launch
from executor.launches.small import rope_launches
from executor.launches.sparse_mqa import sparse_mqa_launch
from executor.stages import attn_proj
from executor.wiring import Buffer, byte_tensor, packed_layers, weight_prefix
from kernels import dense_ref as dr
from kernels import linear_bf16_ref as lr
from kernels import rope_ref
from kernels import sparse_mqa_ref as sm
from kernels.common_ref import BF16

INDEX_PAGE_SIZE = 64             # kernels.indexer.PAGE_SIZE: the page size its kernels are built for
CLUSTER_TOPK_MAX_ROWS = 6        # reindex top-k: the cluster kernel wins up to here (docs/perf.md
                                 # run 17), the default one at R = 48
SCRATCH = il.SCRATCH             # prep -> scores -> top-k scratch, shared by every index layer


def _scratch_name(name: str) -> str:
    return f"attn.indexer.{name}"


def _topk_name(layer: int) -> str:
    return f"attn.topk.{layer}"


def _candidates_name(layer: int) -> str:
    return f"attn.candidates.{layer}"


def _rope_name(ratio: int) -> str:
    return "rope.yarn" if ratio > 0 else "rope.plain"


def _geometry(ctx):
    geometry = getattr(ctx, "geometry", None)
    if geometry is None:
        raise ValueError("attn_index stages need the KV cache geometry: StepContext.geometry "
                         "(executor.bind.CacheGeometry) is not set")
    return geometry


def _max_entries(cfg) -> int:
    """Scores row capacity: a ratio >= 1 layer has at most one entry per position."""
    return cfg.max_position_embeddings


def index_shape(cfg, layer, geometry, max_rows: int) -> il.IndexerShape:
    """The indexer chain of an index-source layer on caches of `geometry`: the scores row stride
    is the block table's reach (pages_per_seq * page_size), so the scores kernel walks the bound
    block tables with their own row stride."""
    if geometry.page_size != INDEX_PAGE_SIZE:
        raise ValueError(f"layer {layer.index} indexer: the KV caches have page_size "
                         f"{geometry.page_size}; the indexer kernels are built for "
                         f"{INDEX_PAGE_SIZE}")
    entries = geometry.pages_per_seq * geometry.page_size
    if entries > _max_entries(cfg):
        raise ValueError(f"layer {layer.index} indexer: the block tables reach {entries} entries "
                         f"per sequence, the scores buffer holds {_max_entries(cfg)} "
                         f"(cfg.max_position_embeddings)")
    return il.IndexerShape.for_layer(cfg, layer, geometry.page_size, max_rows, max_rows, entries)


# ---- attn.indexer ---------------------------------------------------------------------------------

def _indexer(ctx, layer):
    cfg, i = ctx.cfg, layer.index
    nh, hd = cfg.index_n_heads, cfg.index_head_dim
    shape = index_shape(cfg, layer, _geometry(ctx), ctx.max_rows)
    wq_b = {"x": ctx.ptr("attn.qr"), "weight": ctx.ptr(f"layers.{i}.attn.indexer.wq_b.weight"),
            "scales": ctx.ptr(f"layers.{i}.attn.indexer.wq_b.scale"),
            "out": ctx.ptr("attn.index_q"), "workspace": ctx.ptr("attn.indexer.wq_b_workspace"),
            "counters": ctx.ptr("attn.indexer.wq_b_counters")}
    wq_b_specs = (dl.dense_spec(ctx.bundle, "indexer_wq_b", 1),
                  dl.dense_spec(ctx.bundle, "indexer_wq_b", ctx.max_rows))
    folded = None                 # R <= 8 with q_norm folded: from attn.qkv (attn_proj)
    if attn_proj.q_norm_folded():
        folded = attn_proj.qnorm_dense(
            ctx, "indexer_wq_b", f"layers.{i}.attn.indexer.wq_b", "attn.index_q",
            weight_prefix(cfg, layer) + "attn.q_norm.weight.f32")
    rope_spec = rope_ref.make_spec(nh, hd, inverse=False, in_place=True)
    rope = {"x": ctx.ptr("attn.index_q"), "table": ctx.ptr(_rope_name(layer.ratio)),
            "positions": ctx.ptr("positions32")}
    ctx.kernel(rope_spec.name)
    weights_spec = lr.indexer_weights_spec(cfg)
    weights = {"x": ctx.ptr("xn"), "w": ctx.ptr(f"layers.{i}.attn.indexer.weights_proj.weight"),
               "out": ctx.ptr("attn.index_w")}
    ptrs = {name: ctx.ptr(_scratch_name(name)) for name in SCRATCH}
    ptrs.update(q=ctx.ptr("attn.index_q"), w_raw=ctx.ptr("attn.index_w"),
                positions=ctx.ptr("positions32"), seq_index=ctx.ptr("seq_index"),
                keys=ctx.ptr(f"index_keys_{layer.kv_source}"),
                block_tables=ctx.ptr("block_tables"), topk=ctx.ptr(_topk_name(i)))
    # Dense layers never dereference cands (the ABI takes an address): hand them their own topk.
    ptrs["cands"] = (ctx.ptr(_candidates_name(cfg.candidate_source_layer_id))
                     if layer.uses_candidates else ptrs["topk"])
    if layer.is_candidate_source:
        ptrs["blocks_out"] = ctx.ptr(_candidates_name(i))
    scale = float(np.float32((hd * nh) ** -0.5))      # the reference's fp32 weight scale
    num_positions = cfg.max_position_embeddings

    def build(rows):
        wq_b_spec = wq_b_specs[0] if rows <= dr.ROW_TILE else wq_b_specs[1]
        cluster = layer.uses_candidates and rows <= CLUSTER_TOPK_MAX_ROWS
        query = (folded(rows) if attn_proj.folded_rows(rows)
                 else [dl.dense_launch(ctx.bundle, wq_b_spec, wq_b, rows)])
        return [*query,
                *rope_launches(ctx.bundle, rope_spec, rope, rows, num_positions),
                linear_bf16_launch(ctx.bundle, weights_spec, weights, rows),
                *il.indexer_launches(ctx.bundle, shape, ptrs, rows, scale, cluster_topk=cluster)]
    return build


# ---- attn.sparse_mqa ------------------------------------------------------------------------------

def mqa_spec(cfg, tp: int, layer, geometry) -> sm.SparseMqaSpec:
    """The layer's sparse MQA kernel: SWA-only on ratio-0 layers, SWA + top-k on the others."""
    spec = sm.sparse_mqa_specs(cfg, tp)[1 if layer.ratio else 0]
    if spec.ring_slots != geometry.ring_slots:
        raise ValueError(f"layer {layer.index} sparse MQA: the SWA caches have "
                         f"{geometry.ring_slots} ring slots per line; kernel {spec.name} is built "
                         f"for {spec.ring_slots}")
    return spec


def _sparse_mqa(ctx, layer):
    cfg, i = ctx.cfg, layer.index
    geometry = _geometry(ctx)
    spec = mqa_spec(cfg, ctx.tp, layer, geometry)
    ptrs = {"q": ctx.ptr("attn.q"), "out": ctx.ptr("attn.o"), "swa": ctx.ptr(f"swa_{i}"),
            "row_info": ctx.ptr("row_info"), "state_lines": ctx.ptr("state_lines"),
            "sink": ctx.ptr(weight_prefix(cfg, layer) + "attn.attn_sink"),
            "rope_table": ctx.ptr(_rope_name(layer.ratio))}
    if spec.topk:
        ptrs.update(compressed=ctx.ptr(f"compressed_{layer.kv_source}"),
                    topk=ctx.ptr(_topk_name(layer.topk_source)),
                    block_tables=ctx.ptr("block_tables"))
    ctx.kernel(spec.name)
    sizes = {"pages_per_seq": geometry.pages_per_seq, "page_size": geometry.page_size,
             "num_positions": cfg.max_position_embeddings}
    return lambda rows: [sparse_mqa_launch(ctx.bundle, spec, ptrs, rows, **sizes)]


BUILDERS = {"attn.indexer": _indexer, "attn.sparse_mqa": _sparse_mqa}


# ---- arena ----------------------------------------------------------------------------------------

def _backbone(cfg):
    return [layer for layer in cfg.layers if not layer.is_dspark]


def buffers(cfg, tp: int, max_rows: int) -> list[Buffer]:
    """`attn.o`, the index query / weights, the indexer's scratch, the persistent top-k outputs."""
    r, shapes = max_rows, cfg.rank_shapes(tp)
    out = [Buffer("attn.o", BF16, (r, shapes.heads, sm.HEAD_DIM),
                  "attention output after the inverse RoPE (wo_a input)")]
    index_layers = [layer for layer in _backbone(cfg) if layer.has_indexer]
    if not index_layers:
        return out
    nh, hd = cfg.index_n_heads, cfg.index_head_dim
    out += [Buffer("attn.index_q", BF16, (r, nh, hd), "index query after RoPE"),
            Buffer("attn.index_w", BF16, (r, nh), "index head weights (weights_proj output)")]
    # Scratch sizes do not depend on the layer's mode or ratio; scores on the row capacity.
    shape = il.IndexerShape(nh, 1, "dense", cfg.index_topk, cfg.candidate_topk_blocks,
                            cfg.candidate_block_size, INDEX_PAGE_SIZE, r, r, _max_entries(cfg))
    sizes = il.buffers(shape)
    out += [Buffer(_scratch_name(name), np.uint8, (sizes[name][0],), sizes[name][1])
            for name in SCRATCH]
    wq_b = [s for s in dr.dense_specs(cfg, tp) if s.name.startswith("dense_w8a16_indexer_wq_b_")]
    out += [Buffer("attn.indexer.wq_b_workspace", np.float32,
                   (max(1, max(s.workspace_bytes() for s in wq_b) // 4),), "split-K partials"),
            Buffer("attn.indexer.wq_b_counters", np.uint32,
                   (max(1, max(s.counters_bytes() for s in wq_b) // 4),), "zeroed once")]
    out += [Buffer(_topk_name(layer.index), np.int32, (r, cfg.index_topk),
                   "top-k entry ids (-1 padded), read by the reuse layers")
            for layer in index_layers]
    out += [Buffer(_candidates_name(layer.index), np.int32, (r, cfg.candidate_topk_blocks),
                   "candidate blocks (ascending, -1 tail), read by the reindex layers")
            for layer in index_layers if layer.is_candidate_source]
    return out


def weights(cfg, tp: int, rank: int, fetch, layers=None) -> list[tuple[str, np.ndarray]]:
    """The rank's attention sinks (its heads), the indexer's wq_b (E4M3 + UE8M0 bytes, checkpoint
    layout) and head weights (bf16 [nh, D]); all but the sinks replicated; of `layers` (None:
    every backbone layer and the DSpark stages, wiring.packed_layers)."""
    del tp, rank                                    # fetch cuts this rank's slices
    out = []
    for layer in packed_layers(cfg, layers):
        pre = weight_prefix(cfg, layer) + "attn."
        out.append((pre + "attn_sink", np.asarray(fetch(pre + "attn_sink"), np.float32)))
        if layer.has_indexer:
            out += [(pre + name, byte_tensor(fetch(pre + name), pre + name))
                    for name in ("indexer.wq_b.weight", "indexer.wq_b.scale")]
            out.append((pre + "indexer.weights_proj.weight",
                        np.asarray(fetch(pre + "indexer.weights_proj.weight"), BF16)))
    return out
