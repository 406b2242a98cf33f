"""Stages of the DSpark round's verify side on one rank: aux states, acceptance, rollback, context KV.

Model doc §4 and executor/reference/dspark.py (`verify_and_accept`), on the device, no host read:

  layerTT.dspark.aux     after a target layer's attn.mhc_pre (which applied the pending FFN post
                         to `streams` in place): the mean of the streams -> `dspark.aux` [R, T, D]
                         at the target's slot (decode_step's `aux`)
  dspark.accept          after the greedy pick: the verify rows' token_ids (bonus, drafts) and
                         `tokens` -> the caller's `accepted` int32 / `bonus` int64 per sequence,
                         and `dspark.context_slots` int64 [R] (slot_mapping up to the accepted
                         count, -1 past it: those rows write no context KV)
  dspark.ring_rollback   every ratio-2 kv source: NaN into the ring rows of rejected positions
                         (KVCaches.rollback_compressor_rings)
  dspark.main_proj       dense main_proj: `dspark.aux` read as [R, T D] -> `dspark.main_raw`
  dspark.main_norm       main_norm (RMSNorm) -> `dspark.main_x`
  layerSS.dspark.context_kv  per DSpark stage: wq_a|wkv over main_x -> split (q half normed into
                         scratch, the kv half copied) -> kv_norm, RoPE, SWA insert at
                         `dspark.context_slots` into swa_{S} (write_context_kv)

The draft step's Markov correction (roles dspark.markov0 .. dspark.markov{k}, in
executor/plan.py's draft_plan): step i < k: this rank's argmax pair of U_i + markov_w2 ·
markov_w1[prev] into `dspark.pairs` (prev = the bound `bonus` at i = 0, else `dspark.prev`), then
the cross-rank pick (kernels.allreduce) -> `dspark.prev`; each step also writes prev into the
bound `token_ids` at row s (k + 1) + i, so after step k the next verify step's rows (bonus,
d_1..d_k) are in place with no host round trip. U is `dspark.base` fp32 [R, V_l] (the draft rows'
base logits, written by the draft forward's head).

Row advance, so a round (verify graph, draft graph, verify graph ...) needs no host write between
steps (kernels/dspark_ref.py's advance):

  dspark.advance_draft   last stage of decode_plan(dspark=True, sync_free=True): the bound row
                         tensors (token_ids, positions, seq_index, slot_mapping, block_kind,
                         context_lens) become the draft step's, k rows per sequence at
                         P + a + 1 .. P + a + k, from `accepted` and `bonus`
  dspark.advance_verify  last stage of draft_plan(sync_free=True), after the Markov stages wrote
                         the token_ids: the rows become the next verify step's, k + 1 per
                         sequence at the bonus position

Before each advance (Engram models), the next step's Engram lookback (kernels/dspark_ref.py's
history), so `token_history` needs no host write either:

  dspark.history_draft   before dspark.advance_draft: the draft rows' token_history, whose first
                         row per sequence carries the c = max_ngram - 1 tokens before the new
                         bonus (from the verify rows, their history and the accepted count)
  dspark.history_verify  before dspark.advance_verify: the verify rows' token_history from that
                         carried tail and the Markov stages' token_ids

Both rewrite the rows in place. That is safe because every reader of the step's rows (rows_prep,
the rollback, the acceptance) is an earlier kernel of the same graph, complete at the advance's
PDL wait, and the next graph, which reads the new rows, starts after this one in stream order.
The verify bucket holds k + 1 rows per sequence slot, the draft bucket k: slot s's block starts
at row s (k + 1) or s k; a slot whose `bonus` is negative is padding (seq -1, slot -1).

The caller binds `accepted` and `bonus` (executor.bind.binding_rules(..., dspark=True)). The
context KV projects the DSpark stage's fused wq_a|wkv (the q half is wasted work: dense_shapes has
no wkv-only label) with the weights executor/stages/attn_proj.py packs for the draft forward
(`mtp.{s}.attn.wq_a_wkv`, `q_norm.weight.f32`, `kv_norm.weight.f32`): list that module too.
"""
from __future__ import annotations

import numpy as np

from executor.launches import dense as dl
from executor.launches.allreduce import pick_launches
from executor.launches.dspark import (
    accept_launch,
    advance_launch,
    aux_launch,
    history_launch,
    markov_launch,
    rollback_launch,
)
from executor.launches.mhc import mhc_norm_launch
from executor.launches.small import kernel_for, swa_insert_launches
from executor.launches.split_norm import split_norm_launch
from executor.wiring import Buffer
from kernels import allreduce_ref, dspark_ref, kv_publish_ref, split_norm_ref
from kernels import dense_ref as dr
from kernels import norm_ref as nr
from kernels.common_ref import BF16
from loader.schema import UNCERTAIN

ROPE_PLAIN = "rope.plain"           # executor/stages/attn_proj.py packs it (ratio-0 layers)
MAX_DRAFTS = 8                      # roles dspark.markov0 .. dspark.markov{MAX_DRAFTS} exist


def _stages(cfg) -> list:
    return [spec for spec in cfg.layers if spec.is_dspark]


def _prefix(cfg, index: int) -> str:
    return f"mtp.{index - cfg.num_hidden_layers}."


def _norm_dtype() -> str:
    return {"BF16": "bf16", "F32": "f32"}[UNCERTAIN["norm_dtype"]]


def _dense_specs(cfg, tp: int) -> list[dr.DenseSpec]:
    shapes = dr.dense_shapes(cfg, tp)
    return [dr.make_spec(label, *shapes[label][:2], row_tiles=rt)
            for label in ("main_proj", "wqa_wkv") for rt in dr.ROW_TILE_CHOICES]


# ---- arena ----------------------------------------------------------------------------------

def buffers(cfg, tp: int, max_rows: int) -> list[Buffer]:
    """The aux states, context slots, main_x and the context KV's scratch (none without DSpark)."""
    if not cfg.dspark_target_layer_ids:
        return []
    r, d, hd, q_lora = max_rows, cfg.hidden_size, cfg.head_dim, cfg.q_lora_rank
    dense = _dense_specs(cfg, tp)
    return [
        Buffer("dspark.aux", BF16, (r, len(cfg.dspark_target_layer_ids), d),
               "mean of the streams at each target layer's input"),
        Buffer("dspark.context_slots", np.int64, (r,), "SWA slot of accepted rows, -1 past"),
        Buffer("dspark.main_raw", BF16, (r, d), "main_proj output"),
        Buffer("dspark.main_x", BF16, (r, d), "main_norm output: the context KV's input"),
        Buffer("dspark.qkv", BF16, (r, q_lora + hd), "a stage's wq_a | wkv of main_x"),
        Buffer("dspark.qr", BF16, (r, q_lora), "q half (unread: the split writes it)"),
        Buffer("dspark.kv", BF16, (r, hd), "kv half before kv_norm"),
        Buffer("dspark.dense_workspace", np.float32,
               (max(1, max(s.workspace_bytes() for s in dense) // 4),), "split-K partials"),
        Buffer("dspark.dense_counters", np.uint32,
               (max(1, max(s.counters_bytes() for s in dense) // 4),),
               "split-K counters: zero before the first launch"),
        *_markov_buffers(cfg, tp, max_rows)]


def _markov_spec(cfg, tp: int) -> dspark_ref.MarkovSpec:
    return dspark_ref.make_markov_spec(cfg.vocab_size // tp, cfg.dspark_markov_rank,
                                       cfg.dspark_block_size)


def _markov_buffers(cfg, tp: int, max_rows: int) -> list[Buffer]:
    spec = _markov_spec(cfg, tp)
    return [Buffer("dspark.base", np.float32, (max_rows, spec.vocab),
                   "draft rows' base logits U (this rank's vocab columns)"),
            Buffer("dspark.pairs", np.int32, (max_rows, 2), "Markov step's argmax pair"),
            Buffer("dspark.prev", np.int64, (max_rows,), "the last Markov step's pick"),
            Buffer("dspark.markov_partials", np.float32, (max_rows, spec.tiles, 2),
                   "per-tile bests (value, index)"),
            Buffer("dspark.markov_counter", np.uint32, (4,), "zero before the first launch")]


def _fp8(fetch, name: str, n: int, k: int) -> list[tuple[str, np.ndarray]]:
    w, s = np.asarray(fetch(name + ".weight")), np.asarray(fetch(name + ".scale"))
    nb, kb = n // dr.FP8_BLOCK, k // dr.FP8_BLOCK
    if w.shape != (n, k) or s.shape != (nb, kb) or s.dtype.itemsize != 1:
        raise TypeError(f"{name}: expected weight [{n}, {k}] and one-byte scales [{nb}, {kb}], "
                        f"got {w.dtype} {list(w.shape)} and {s.dtype} {list(s.shape)}")
    w, s = w.reshape(1, n, k), s.view(np.uint8).reshape(1, nb, kb)
    dr.check_weight(w, s, 1, n, k, name)
    return [(name + ".weight", w), (name + ".scale", s)]


def weights(cfg, tp: int, rank: int, fetch, layers=None) -> list[tuple[str, np.ndarray]]:
    """main_proj, main_norm (replicated), the Markov head (w1 replicated, w2 this rank's vocab
    rows). The stages' attention weights are attn_proj's (the draft forward's). `layers` selects
    backbone layers, of which this module packs none: all of it is packed whatever it says."""
    del rank, layers
    stages = _stages(cfg)
    if not stages or not cfg.dspark_target_layer_ids:
        return []
    first = _prefix(cfg, stages[0].index)
    n, k = dr.dense_shapes(cfg, tp)["main_proj"][:2]
    out = _fp8(fetch, first + "main_proj", n, k)
    out.append((first + "main_norm.weight", np.asarray(fetch(first + "main_norm.weight"))))
    head = _prefix(cfg, stages[-1].index) + "markov_head."
    spec = _markov_spec(cfg, tp)
    for name, shape in (("markov_w1", (cfg.vocab_size, spec.rank)),
                        ("markov_w2", (spec.vocab, spec.rank))):
        w = np.asarray(fetch(head + name + ".weight"))
        if w.dtype != BF16 or w.shape != shape:
            raise TypeError(f"{head}{name}.weight: the Markov kernel reads bf16 {list(shape)}, "
                            f"got {w.dtype} {list(w.shape)}")
        out.append((head + name + ".weight", w))
    return out


# ---- builders -------------------------------------------------------------------------------

def _target_slot(cfg, layer) -> int:
    targets = tuple(cfg.dspark_target_layer_ids)
    if layer is None or layer.index not in targets:
        raise ValueError(f"dspark.aux: layer {getattr(layer, 'index', None)} is not a DSpark "
                         f"target layer {targets}")
    if layer.has_engram:
        # The reference takes the mean between the pending post and the Engram gate, which run
        # inside one stage (engram.gate) here: no boundary to read them at.
        raise NotImplementedError(f"dspark.aux at Engram layer {layer.index}: not wired")
    return targets.index(layer.index)


def _aux(ctx, layer):
    cfg = ctx.cfg
    slot = _target_slot(cfg, layer)
    spec = dspark_ref.make_aux_spec(cfg.hidden_size, cfg.hc_mult,
                                    len(cfg.dspark_target_layer_ids))
    ctx.kernel(spec.name)
    ptrs = {"streams": ctx.ptr("streams"), "aux": ctx.ptr("dspark.aux")}
    return lambda rows: [aux_launch(ctx.bundle, spec, ptrs, rows, slot)]


def _block_rows(cfg) -> int:
    return cfg.dspark_block_size + 1            # bonus + k drafts


def _accept(ctx, layer):
    del layer
    spec = dspark_ref.make_accept_spec(_block_rows(ctx.cfg))
    ctx.kernel(spec.name)
    ptrs = {name: ctx.ptr(name) for name in ("token_ids", "tokens", "seq_index", "slot_mapping",
                                             "accepted", "bonus")}
    ptrs["context_slots"] = ctx.ptr("dspark.context_slots")
    return lambda rows: [accept_launch(ctx.bundle, spec, ptrs, rows)]


def _ring_rollback(ctx, layer):
    del layer
    cfg, geometry = ctx.cfg, getattr(ctx, "geometry", None)
    if geometry is None:
        raise ValueError("dspark.ring_rollback needs the KV cache geometry: StepContext.geometry "
                         "(an executor.bind.CacheGeometry) is not set")
    spec = dspark_ref.make_rollback_spec(geometry.ring_rows, _block_rows(cfg))
    ctx.kernel(spec.name)
    common = {name: ctx.ptr(name) for name in ("positions", "seq_index", "state_lines",
                                               "accepted")}
    rings = [dict(common, ring=ctx.ptr(f"compressor_ring_{s.index}"))
             for s in cfg.layers if s.owns_compressor and s.ratio == 2]
    return lambda rows: [rollback_launch(ctx.bundle, spec, p, rows) for p in rings]


def _dense(ctx, label: str, x: str, weight: str, out: str):
    specs = {dl.row_tiles_for(rows): dl.dense_spec(ctx.bundle, label, rows)
             for rows in (1, ctx.max_rows)}
    ptrs = {"x": ctx.ptr(x), "weight": ctx.ptr(weight + ".weight"),
            "scales": ctx.ptr(weight + ".scale"), "out": ctx.ptr(out),
            "workspace": ctx.ptr("dspark.dense_workspace"),
            "counters": ctx.ptr("dspark.dense_counters")}
    return lambda rows: [dl.dense_launch(ctx.bundle, specs[dl.row_tiles_for(rows)], ptrs, rows)]


def _first_stage(cfg) -> str:
    return _prefix(cfg, _stages(cfg)[0].index)


def _main_proj(ctx, layer):
    del layer
    return _dense(ctx, "main_proj", "dspark.aux", _first_stage(ctx.cfg) + "main_proj",
                  "dspark.main_raw")


def _main_norm(ctx, layer):
    del layer
    spec = nr.make_spec(ctx.cfg.hidden_size, _norm_dtype())
    ctx.kernel(spec.name)
    ptrs = {"x_out": ctx.ptr("dspark.main_raw"),
            "norm_weight": ctx.ptr(_first_stage(ctx.cfg) + "main_norm.weight"),
            "x_normed": ctx.ptr("dspark.main_x")}
    eps = ctx.cfg.rms_norm_eps
    return lambda rows: [mhc_norm_launch(ctx.bundle, spec, ptrs, rows, eps)]


def _context_kv(ctx, layer):
    cfg = ctx.cfg
    if layer is None or not layer.is_dspark:
        raise ValueError("dspark.context_kv runs at a DSpark stage layer")
    base = _prefix(cfg, layer.index) + "attn."
    proj = _dense(ctx, "wqa_wkv", "dspark.main_x", base + "wq_a_wkv", "dspark.qkv")
    split = split_norm_ref.make_spec(cfg.q_lora_rank, cfg.head_dim)
    insert = kv_publish_ref.make_swa_spec(cfg.head_dim)
    kernel_for(ctx.bundle, split)
    kernel_for(ctx.bundle, insert)
    p_split = {"x": ctx.ptr("dspark.qkv"), "weight": ctx.ptr(base + "q_norm.weight.f32"),
               "out": ctx.ptr("dspark.qr"), "tail": ctx.ptr("dspark.kv")}
    p_insert = {"kv": ctx.ptr("dspark.kv"), "weight": ctx.ptr(base + "kv_norm.weight.f32"),
                "table": ctx.ptr(ROPE_PLAIN), "positions": ctx.ptr("positions32"),
                "slots": ctx.ptr("dspark.context_slots"), "cache": ctx.ptr(f"swa_{layer.index}")}
    num_positions, eps = cfg.max_position_embeddings, cfg.rms_norm_eps

    def build(rows):
        return [*proj(rows), split_norm_launch(ctx.bundle, split, p_split, rows, eps),
                *swa_insert_launches(ctx.bundle, insert, p_insert, rows, num_positions, eps)]
    return build


def _markov(step: int):
    """Markov step `step`: the argmax pairs and the cross-rank pick (step < k), the ids copy."""
    def factory(ctx, layer):
        del layer
        cfg, k = ctx.cfg, ctx.cfg.dspark_block_size
        if step > k:
            raise ValueError(f"dspark.markov{step}: the draft has {k} steps")
        spec = _markov_spec(cfg, ctx.tp)
        ctx.kernel(spec.name)
        head = _prefix(cfg, _stages(cfg)[-1].index) + "markov_head."
        ptrs = {"base": ctx.ptr("dspark.base"), "w1": ctx.ptr(head + "markov_w1.weight"),
                "w2": ctx.ptr(head + "markov_w2.weight"),
                "prev": ctx.ptr("bonus" if step == 0 else "dspark.prev"),
                "pairs": ctx.ptr("dspark.pairs"), "ids": ctx.ptr("token_ids"),
                "partials": ctx.ptr("dspark.markov_partials"),
                "counter": ctx.ptr("dspark.markov_counter")}
        offset = ctx.shapes.vocab_offset(ctx.rank)
        pick = None
        if step < k:
            state = ctx.collectives
            if state is None:
                raise RuntimeError(f"rank {ctx.rank}: dspark.markov{step} needs ctx.collectives")
            pick = (allreduce_ref.make_pick_spec(state.world, cfg.hidden_size, ctx.max_rows),
                    dict(state.pointers, pairs=ctx.ptr("dspark.pairs"),
                         tokens=ctx.ptr("dspark.prev")), state)

        def build(rows):
            if rows % k or (rows // k) * (k + 1) > ctx.max_rows:
                raise ValueError(f"dspark.markov{step}: a draft bucket of {rows} rows is not "
                                 f"{k} rows per sequence within {ctx.max_rows} verify rows")
            seqs = rows // k
            out = [markov_launch(ctx.bundle, spec, ptrs, seqs, step, offset)]
            if pick is not None:
                p_spec, p_ptrs, state = pick
                out += pick_launches(ctx.bundle, p_spec, p_ptrs, state.rank, seqs,
                                     state.timeout_us)
            return out
        return build
    return factory


def _advance(to_verify: bool):
    """The next step's rows: the draft's after a verify step, the next verify's after a draft."""
    def factory(ctx, layer):
        del layer
        cfg, geometry = ctx.cfg, getattr(ctx, "geometry", None)
        role = "dspark.advance_verify" if to_verify else "dspark.advance_draft"
        if geometry is None:
            raise ValueError(f"{role} needs the KV cache geometry (SWA ring slots): "
                             f"StepContext.geometry is not set")
        spec = dspark_ref.make_advance_spec(cfg.dspark_block_size, to_verify,
                                            cfg.dspark_noise_token_id)
        ctx.kernel(spec.name)
        ptrs = {name: ctx.ptr(name) for name, _ in spec.params[:-2]}
        # rows of this step per sequence slot: a draft step's k, a verify step's k + 1
        per_seq = cfg.dspark_block_size + (0 if to_verify else 1)

        def build(rows):
            seqs = rows // per_seq
            if seqs < 1 or seqs * spec.width > ctx.max_rows:
                raise ValueError(f"{role}: a bucket of {rows} rows holds {seqs} sequence slots "
                                 f"of {per_seq} rows; the next step's {spec.width} rows each "
                                 f"must fit {ctx.max_rows} rows")
            return [advance_launch(ctx.bundle, spec, ptrs, seqs, geometry.ring_slots)]
        return build
    return factory


def _history(to_verify: bool):
    """The next step's token_history, before its advance (Engram models)."""
    def factory(ctx, layer):
        del layer
        cfg = ctx.cfg
        k, cols = cfg.dspark_block_size, dspark_ref.history_cols(cfg)
        spec = dspark_ref.make_history_spec(k, to_verify, cols, cfg.dspark_noise_token_id)
        ctx.kernel(spec.name)
        ptrs = {name: ctx.ptr(name) for name in ("token_ids", "token_history", "accepted",
                                                 "bonus")}
        per_seq = k if to_verify else k + 1            # this step's rows per sequence slot

        def build(rows):
            seqs = rows // per_seq
            if seqs < 1 or seqs * (k + 1) > ctx.max_rows:
                raise ValueError(f"{spec.name}: a bucket of {rows} rows holds {seqs} sequence "
                                 f"slots of {per_seq} rows; their verify rows must fit "
                                 f"{ctx.max_rows}")
            return [history_launch(ctx.bundle, spec, ptrs, seqs)]
        return build
    return factory


BUILDERS = {
    "dspark.history_draft": _history(False),
    "dspark.history_verify": _history(True),
    "dspark.advance_draft": _advance(False),
    "dspark.advance_verify": _advance(True),
    **{f"dspark.markov{i}": _markov(i) for i in range(MAX_DRAFTS + 1)},
    "dspark.aux": _aux,
    "dspark.accept": _accept,
    "dspark.ring_rollback": _ring_rollback,
    "dspark.main_proj": _main_proj,
    "dspark.main_norm": _main_norm,
    "dspark.context_kv": _context_kv,
}
