"""Stages of the head, the mHC steps and norms, Engram and the tail, on one rank's arena.

Roles (executor/plan.py): head.rows_prep, head.embed, head.engram_hash; per layer engram.lookup,
engram.wkv, engram.gate, attn.mhc_pre, attn.norm, ffn.mhc_pre, ffn.norm; tail.mhc_post_collapse,
tail.norm, tail.lm_head_argmax. The delayed mHC of executor/reference/step.py on the boundary
buffers of executor/wiring.py:

  attn.mhc_pre   post mode: streams += the previous FFN's post (sub_out `ffn.out`, coeff_prev
                 `coeff.ffn`), this sublayer's coefficients -> `coeff.attn`, collapse with the
                 carried pre -> `x`. Engram layers: plain mode (the post ran before the gate).
                 The first layer: the embedding broadcast into the streams, then the 1-stream
                 plain kernel on `embed.out` (fn summed over streams, one-hot carried pre).
  ffn.mhc_pre    post mode: the attention post (sub_out `attn.out`, coeff_prev `coeff.attn`)
                 -> `coeff.ffn`, `x`.
  *.norm         `x` -> `xn` (RMSNorm with the sublayer's weight).
  engram.lookup  this rank's hash columns -> `engram.local_heads` [R, cols * head_dim]; the
                 all-gather engram.heads_allgather (executor/stages/collectives.py) puts every
                 rank's into `engram.heads` [R, total_cols * head_dim], rank r at columns
                 [r * cols * head_dim, (r + 1) * cols * head_dim), on every rank.
  engram.wkv     `engram.heads` -> `engram.kv_local` [R, (n + 1) D / tp]: this rank's output
                 columns (W8A16, column-sharded weight: engram_kernel_ref.kv_rank_rows, P
                 row-interleaved pieces); engram.kv_allgather puts every rank's into
                 `engram.kv` [R, (n + 1) D], the replicated wkv's output column for column.
  engram.gate    the pending FFN post (postonly; not at the first layer, which broadcasts the
                 embedding instead), then the gate updates `streams` in place.
  tail           postonly with the last FFN's post and carried pre -> `x`; RMSNorm -> `hidden`;
                 lm_head argmax -> `pick` int32 [R, 2] (+ logits into a bound `logits`).

Counters: mhc_pre, the split-K dense and the argmax lm_head keep row-block counters (`mhc.counters`,
`engram.wkv_counters`, `tail.keys`, `tail.counters`) that must be zero before their first launch
and are left zero by every launch. cuMemAlloc does not zero: the Executor zeroes the whole arena
before packing weights (executor/executor.py, `arena.zero()`); `HostArena` is zeroed at creation.
"""
from __future__ import annotations

import numpy as np

from executor.launch import LaunchSpec
from executor.launches import dense as dl
from executor.launches.embed_engram import (
    embed_launch,
    engram_gate_launch,
    engram_hash_launch,
    engram_lookup_launch,
)
from executor.launches.mhc import mhc_norm_launch, mhc_pre_launch
from executor.launches.rows import rows_prep_launch
from executor.wiring import MHC_COEFFS, Buffer, byte_tensor, packed_layers, weight_prefix
from kernels import dense_ref as dr
from kernels import elementwise_ref as el
from kernels import embed_ref as er
from kernels import engram_kernel_ref as ek
from kernels import lm_head_ref as lr
from kernels import mhc_kernel_ref as mk
from kernels import mhc_ref, rows_ref
from kernels import norm_ref as nr
from loader import engram_vocab
from loader.schema import UNCERTAIN

ONE_HOT = "mhc.one_hot_coeff"       # constant packed coefficients whose pre is one-hot (stream 0)
POLL_EXCHANGE = "mhc.exchange"      # `_lean_poll`'s workspace: tagged words, zero between launches
POLL_STATUS = "mhc.poll_status"     # `_lean_poll`'s counters: [0] = a consumer timed out (sticky)
SMALL_ROWS = 8                      # post mhc_pre: `_lean` up to here, `_lr_rcp` above (S = 4
                                    # plain: `_lean` at every R). 64 measured faster alone (35.3 vs
                                    # 40.4 us at R = 48) but made the emulated DSpark draft's U
                                    # leave its 0.08 bound once in 10 runs (0.20; 10-row draft
                                    # blocks): back to 8 until that is understood
FUSED_NORM_ROWS = 2                 # post mhc_pre with its RMSNorm inside (`_lean_norm*`, no norm
                                    # launch) up to here; 0 = never (run 16:25, R = 1: 13.2 us vs
                                    # `_lean` + rmsnorm 14.4; R = 6: 19.0 vs 16.2)
MHC_POLL_ROWS = mk.MAX_ROWS         # post mhc_pre up to here: `_lean_poll_norm*` (tagged-word
                                    # handoff, a consumer CTA a row and a norm, so the RMSNorm is
                                    # inside at every such R; bitwise `_lean`'s outputs). Run r5a,
                                    # alone, us: 11.9 / 12.5 / 24.0 / 49.1 at R = 1 / 6 / 48 / 192
                                    # vs `_lr_rcp` + rmsnorm 20.7 / 21.9 / 44.6 / 62.6. 8 keeps
                                    # `_lr_rcp` above 8 rows; 0 reverts to round 4 (`_lean`, fused
                                    # norm at R <= FUSED_NORM_ROWS)
BROADCAST_LEAN = True               # layer 0's 1-stream plain mhc_pre: `_lean` (the default tail ran
                                    # 35 us cold in the round-5 ncu probe: 4 Sinkhorn rounds of
                                    # garbage rows, 3 fences); False: the default `plain`
MHC_POLL_SPLIT_ROWS = 4             # the polled post up to here takes `_lean_poll_ms_norm*` (4 warps
                                    # share a row's mixes GEMV in passes of 4 rows: one pass), above
                                    # `_lean_poll_norm*` (R = 5..8: one pass of two warps, not two
                                    # split passes and X round trips); 0: never split


# ---- names ---------------------------------------------------------------------------------------

def _first_layer(cfg, layer=None) -> int:
    """The first layer of `layer`'s forward: the first backbone layer, or for a DSpark stage the
    first stage (the draft step embeds its own rows and starts its streams there)."""
    dspark = layer is not None and layer.is_dspark
    return min(s.index for s in cfg.layers if s.is_dspark == dspark)


def _fn_name(prefix: str, sublayer: str, summed: bool) -> str:
    return f"{prefix}hc_{sublayer}_fn" + (".summed" if summed else "")


def draft_norm_name(cfg) -> str:
    """The draft's final norm: the last DSpark stage's `norm` (executor/reference/dspark.py)."""
    return weight_prefix(cfg, cfg.layers[cfg.num_layers_total - 1]) + "norm.weight"


def _ids_name(layer: int) -> str:
    return f"engram.ids.l{layer}"


def _norm_dtype() -> str:
    return {"BF16": "bf16", "F32": "f32"}[UNCERTAIN["norm_dtype"]]


def _broadcasts(cfg, layer) -> bool:
    """The first layer without Engram mixes the embedding by the 1-stream kernel."""
    return layer.index == _first_layer(cfg, layer) and not layer.has_engram


# ---- mHC ------------------------------------------------------------------------------------------

def _mhc_spec(ctx, streams: int, mode: str, live_rows=False, approx_rcp=False,
              lean=False, norm_weight="", polled=False, mix_split=False) -> mk.MhcPreSpec:
    cfg = ctx.cfg
    spec = mk.make_spec(cfg.hidden_size, streams, mode, cfg.hc_sinkhorn_iters,
                        live_rows=live_rows, approx_rcp=approx_rcp, lean=lean,
                        norm_weight=norm_weight, polled=polled, mix_split=mix_split)
    ctx.kernel(spec.name)           # in the bundle, or a clear error at wiring time
    return spec


def _mhc_scratch(ctx) -> dict[str, int]:
    return {"mixes": ctx.ptr("mhc.mixes"), "workspace": ctx.ptr("mhc.workspace"),
            "counters": ctx.ptr("mhc.counters")}


def _mhc_weights(ctx, prefix: str, sublayer: str, summed: bool = False) -> dict[str, int]:
    return {"fn": ctx.ptr(_fn_name(prefix, sublayer, summed)),
            "scale": ctx.ptr(f"{prefix}hc_{sublayer}_scale.padded"),
            "base": ctx.ptr(f"{prefix}hc_{sublayer}_base")}


def _fused_norm_rows() -> int:
    """Rows up to which the post mhc_pre normalises x itself (its norm stage has no launch)."""
    return max(MHC_POLL_ROWS, FUSED_NORM_ROWS)


def _fuses_norm(ctx, layer, sublayer: str) -> bool:
    """Whether this sublayer's mhc_pre is a post step that normalises x itself (at rows <=
    _fused_norm_rows()): every FFN; attention except the first layer and Engram layers (plain)."""
    if not _fused_norm_rows():
        return False
    return sublayer == "ffn" or not (layer.has_engram or layer.index == _first_layer(ctx.cfg,
                                                                                     layer))


def _post_step(ctx, prefix: str, sublayer: str, sub_out: str, coeff_prev: str, coeff_out: str):
    """rows -> the post-mode mhc_pre: pending post of `sub_out`, new coefficients, collapse;
    at rows <= _fused_norm_rows() also the sublayer's RMSNorm into `xn` (its norm stage is
    empty): `_lean_poll_norm*` up to MHC_POLL_ROWS (its own exchange and timeout flag)."""
    small = _mhc_spec(ctx, mk.HC_MULT, "post", lean=True)
    large = _mhc_spec(ctx, mk.HC_MULT, "post", live_rows=True, approx_rcp=True)
    ptrs = {"streams": ctx.ptr("streams"), "sub_out": ctx.ptr(sub_out),
            "coeff_prev": ctx.ptr(coeff_prev), "streams_out": ctx.ptr("streams"),
            "x_out": ctx.ptr("x"), "coeff_out": ctx.ptr(coeff_out),
            **_mhc_weights(ctx, prefix, sublayer), **_mhc_scratch(ctx)}
    eps = (ctx.cfg.rms_norm_eps, ctx.cfg.hc_eps)
    fused = None
    if FUSED_NORM_ROWS:
        fused = _mhc_spec(ctx, mk.HC_MULT, "post", lean=True, norm_weight=_norm_dtype())
    fused_ptrs = {**ptrs, "norm_weight": ctx.ptr(f"{prefix}{sublayer}_norm.weight"),
                  "x_normed": ctx.ptr("xn")}
    polled = split = None
    if MHC_POLL_ROWS:
        polled = _mhc_spec(ctx, mk.HC_MULT, "post", lean=True, polled=True,
                           norm_weight=_norm_dtype())
        if MHC_POLL_SPLIT_ROWS:
            split = _mhc_spec(ctx, mk.HC_MULT, "post", lean=True, polled=True,
                              norm_weight=_norm_dtype(), mix_split=True)
        polled_ptrs = {**fused_ptrs, "workspace": ctx.ptr(POLL_EXCHANGE),
                       "counters": ctx.ptr(POLL_STATUS)}

    def build(rows):
        if split is not None and rows <= min(MHC_POLL_SPLIT_ROWS, MHC_POLL_ROWS):
            return [mhc_pre_launch(ctx.bundle, split, polled_ptrs, rows, *eps)]
        if polled is not None and rows <= MHC_POLL_ROWS:
            return [mhc_pre_launch(ctx.bundle, polled, polled_ptrs, rows, *eps)]
        if fused is not None and rows <= FUSED_NORM_ROWS:
            return [mhc_pre_launch(ctx.bundle, fused, fused_ptrs, rows, *eps)]
        spec = small if rows <= SMALL_ROWS else large
        return [mhc_pre_launch(ctx.bundle, spec, ptrs, rows, *eps)]
    return build


def _postonly(ctx):
    """rows -> the pending FFN post on `streams` in place, and the collapse with the carried pre
    (coeff.ffn's) into `x`: the tail's input; before an Engram gate attn.mhc_pre rewrites it."""
    spec = _mhc_spec(ctx, mk.HC_MULT, "postonly")
    ptrs = {"streams": ctx.ptr("streams"), "sub_out": ctx.ptr("ffn.out"),
            "coeff_prev": ctx.ptr("coeff.ffn"), "streams_out": ctx.ptr("streams"),
            "x_out": ctx.ptr("x")}
    eps = (ctx.cfg.rms_norm_eps, ctx.cfg.hc_eps)
    return lambda rows: [mhc_pre_launch(ctx.bundle, spec, ptrs, rows, *eps)]


def _broadcast_streams(ctx):
    """rows -> the embedding copied into every residual stream (the first layer's X)."""
    spec = el.make_broadcast_spec(ctx.cfg.hidden_size, ctx.cfg.hc_mult)
    kernel = ctx.kernel(spec.name)
    x, out = ctx.ptr("embed.out"), ctx.ptr("streams")
    return lambda rows: [LaunchSpec(kernel, spec.grid(rows), (x, out, rows), pdl=True)]


def _attn_mhc_pre(ctx, layer):
    cfg, i, prefix = ctx.cfg, layer.index, weight_prefix(ctx.cfg, layer)
    eps = (cfg.rms_norm_eps, cfg.hc_eps)
    first = i == _first_layer(cfg, layer)
    if not layer.has_engram and not first:
        return _post_step(ctx, prefix, "attn", "ffn.out", "coeff.ffn", "coeff.attn")
    if ctx.max_rows > mk.MAX_ROWS:
        raise ValueError(f"{ONE_HOT} holds {mk.MAX_ROWS} rows, the step has {ctx.max_rows}")
    carried = ONE_HOT if first else "coeff.ffn"
    summed = _broadcasts(cfg, layer)
    spec = _mhc_spec(ctx, 1 if summed else mk.HC_MULT, "plain", lean=BROADCAST_LEAN or not summed)
    ptrs = {"streams": ctx.ptr("embed.out" if summed else "streams"),
            "coeff_prev": ctx.ptr(carried), "x_out": ctx.ptr("x"),
            "coeff_out": ctx.ptr("coeff.attn"),
            **_mhc_weights(ctx, prefix, "attn", summed), **_mhc_scratch(ctx)}
    broadcast = _broadcast_streams(ctx) if summed else (lambda rows: [])

    def build(rows):
        return [*broadcast(rows), mhc_pre_launch(ctx.bundle, spec, ptrs, rows, *eps)]
    return build


def _ffn_mhc_pre(ctx, layer):
    return _post_step(ctx, weight_prefix(ctx.cfg, layer), "ffn", "attn.out", "coeff.attn",
                      "coeff.ffn")


def _norm(ctx, weight: str, out: str, fused: bool = False):
    """rows -> the RMSNorm of `x` into `out`; none where the mhc_pre before it (`fused`) did it."""
    spec = nr.make_spec(ctx.cfg.hidden_size, _norm_dtype())
    ctx.kernel(spec.name)
    ptrs = {"x_out": ctx.ptr("x"), "norm_weight": ctx.ptr(weight), "x_normed": ctx.ptr(out)}
    eps = ctx.cfg.rms_norm_eps

    def build(rows):
        if fused and rows <= _fused_norm_rows():
            return []
        return [mhc_norm_launch(ctx.bundle, spec, ptrs, rows, eps)]
    return build


def _attn_norm(ctx, layer):
    return _norm(ctx, weight_prefix(ctx.cfg, layer) + "attn_norm.weight", "xn",
                 _fuses_norm(ctx, layer, "attn"))


def _ffn_norm(ctx, layer):
    return _norm(ctx, weight_prefix(ctx.cfg, layer) + "ffn_norm.weight", "xn",
                 _fuses_norm(ctx, layer, "ffn"))


# ---- head -----------------------------------------------------------------------------------------

def _rows_prep(ctx, layer):
    spec = rows_ref.spec_for(ctx.cfg)
    ptrs = {name: ctx.ptr(name) for name in ("token_ids", "positions", "seq_index", "block_kind",
                                             "tokens32", "positions32", "row_info")}
    if spec.history_cols:
        ptrs.update(token_history=ctx.ptr("token_history"), history32=ctx.ptr("history32"))
    ctx.kernel(spec.name)
    return lambda rows: [rows_prep_launch(ctx.bundle, spec, ptrs, rows)]


def _embed(ctx, layer):
    spec = er.make_spec(ctx.cfg.hidden_size, ctx.shapes.vocab)
    ptrs = {"token_ids": ctx.ptr("tokens32"), "table": ctx.ptr("embed.weight"),
            "out": ctx.ptr("embed.partial")}
    offset = ctx.shapes.vocab_offset(ctx.rank)
    return lambda rows: [embed_launch(ctx.bundle, spec, ptrs, rows, offset)]


def _engram_hash(ctx, layer):
    """Every Engram layer's hash ids at the head (they depend on the rows only)."""
    launches = []
    for index in ctx.cfg.engram_layer_ids:
        spec = ek.make_hash_spec(ctx.cfg, index)
        ptrs = {"tokens": ctx.ptr("history32"), "positions": ctx.ptr("positions32"),
                "vocab_map": ctx.ptr(engram_vocab.VOCAB_MAP_NAME),
                "ids": ctx.ptr(_ids_name(index))}
        launches.append((spec, ptrs))
    return lambda rows: [engram_hash_launch(ctx.bundle, spec, ptrs, rows)
                         for spec, ptrs in launches]


# ---- Engram ---------------------------------------------------------------------------------------

def _lookup_spec(cfg, tp: int) -> ek.EngramLookupSpec:
    total = cfg.engram_num_hash_cols
    return ek.make_lookup_spec(cfg.engram_head_dim, total // tp, total)


def _engram_lookup(ctx, layer):
    cfg, i = ctx.cfg, layer.index
    spec = _lookup_spec(cfg, ctx.tp)
    start, stop = cfg.engram_rank_rows(i, ctx.tp, ctx.rank)
    ptrs = {"ids": ctx.ptr(_ids_name(i)), "codes": ctx.ptr(f"layers.{i}.engram.embed.weight"),
            "scales": ctx.ptr(f"layers.{i}.engram.embed.scale"),
            "out": ctx.ptr("engram.local_heads")}
    first_col = ctx.rank * spec.cols
    return lambda rows: [engram_lookup_launch(ctx.bundle, spec, ptrs, rows, first_col, start,
                                              stop - start)]


def _engram_wkv(ctx, layer):
    """This rank's wkv output columns (its weight rows, `weights`) into engram.kv_local."""
    i = layer.index
    small = dl.dense_spec(ctx.bundle, "engram_wkv", 1)
    large = dl.dense_spec(ctx.bundle, "engram_wkv", ctx.max_rows)
    ptrs = {"x": ctx.ptr("engram.heads"), "weight": ctx.ptr(f"layers.{i}.engram.wkv.weight"),
            "scales": ctx.ptr(f"layers.{i}.engram.wkv.scale"), "out": ctx.ptr("engram.kv_local"),
            "workspace": ctx.ptr("engram.wkv_workspace"),
            "counters": ctx.ptr("engram.wkv_counters")}
    return lambda rows: [dl.dense_launch(ctx.bundle, small if rows <= dr.ROW_TILE else large,
                                         ptrs, rows)]


def _engram_gate(ctx, layer):
    cfg, i = ctx.cfg, layer.index
    spec = ek.make_gate_spec(cfg.hidden_size, cfg.hc_mult)
    ptrs = {"streams": ctx.ptr("streams"), "keys_and_value": ctx.ptr("engram.kv"),
            "q_weight": ctx.ptr(f"layers.{i}.engram.q_weight"),
            "k_weight": ctx.ptr(f"layers.{i}.engram.k_weight"), "out": ctx.ptr("streams")}
    # The first layer's streams are the embedding's copies; later ones owe the FFN's post first.
    before = _broadcast_streams(ctx) if i == _first_layer(cfg, layer) else _postonly(ctx)
    eps = cfg.rms_norm_eps
    return lambda rows: [*before(rows), engram_gate_launch(ctx.bundle, spec, ptrs, rows, eps)]


# ---- tail -----------------------------------------------------------------------------------------

def _tail_post_collapse(ctx, layer):
    return _postonly(ctx)


def _tail_norm(ctx, layer):
    return _norm(ctx, "norm.weight", "hidden")


def _lm_head(ctx, layer):
    """The rank's argmax pair into `pick`; also its logits when the caller bound `logits`."""
    offset = ctx.shapes.vocab_offset(ctx.rank)
    common = {"x": ctx.ptr("hidden"), "weight": ctx.ptr("head.weight")}
    argmax = {"out": ctx.ptr("pick"), "keys": ctx.ptr("tail.keys"),
              "counters": ctx.ptr("tail.counters"), **common}
    modes = [("argmax", argmax)]
    if "logits" in ctx.bound:
        modes.append(("logits", {"out": ctx.ptr("logits"), **common}))
    specs = {(mode, rows): dl.lm_head_spec(ctx.bundle, mode, rows)
             for mode, _ in modes for rows in (1, ctx.max_rows)}

    def build(rows):
        bucket = 1 if rows <= lr.ROW_TILE else ctx.max_rows
        return [dl.lm_head_launch(ctx.bundle, specs[mode, bucket], ptrs, rows, offset)
                for mode, ptrs in modes]
    return build


BUILDERS = {
    "head.rows_prep": _rows_prep,
    "head.embed": _embed,
    "head.engram_hash": _engram_hash,
    "engram.lookup": _engram_lookup,
    "engram.wkv": _engram_wkv,
    "engram.gate": _engram_gate,
    "attn.mhc_pre": _attn_mhc_pre,
    "attn.norm": _attn_norm,
    "ffn.mhc_pre": _ffn_mhc_pre,
    "ffn.norm": _ffn_norm,
    "tail.mhc_post_collapse": _tail_post_collapse,
    "tail.norm": _tail_norm,
    "tail.lm_head_argmax": _lm_head,
}


# ---- arena ----------------------------------------------------------------------------------------

def _wkv_specs(cfg, tp: int) -> list[dr.DenseSpec]:
    return [s for s in dr.dense_specs(cfg, tp) if s.name.startswith("dense_w8a16_engram_wkv_")]


def buffers(cfg, tp: int, max_rows: int) -> list[Buffer]:
    """The int32 rows, mHC scratch, Engram ids and wkv scratch, lm_head scratch (the Engram heads
    and wkv outputs, local and gathered, are boundary buffers: executor/wiring.py)."""
    r, d = max_rows, cfg.hidden_size
    spec = mk.make_spec(d, mk.HC_MULT, "post", cfg.hc_sinkhorn_iters)
    out = [Buffer("tokens32", np.int32, (r,), "token ids (rows prep)"),
           Buffer("positions32", np.int32, (r,), "positions (rows prep)"),
           Buffer("row_info", np.int32, (r, rows_ref.INFO_FIELDS),
                  "position, swa_lo, swa_hi, seq (rows prep; sparse MQA reads it)"),
           Buffer("mhc.mixes", np.float32, (r, MHC_COEFFS), "mhc_pre mixes (unread)"),
           Buffer("mhc.workspace", np.float32, (spec.slices, r, mk.PARTIAL_STRIDE),
                  "mhc_pre split-K partials"),
           Buffer("mhc.counters", np.int32, (mk.counter_count(r),), "mhc_pre, zeroed once")]
    if MHC_POLL_ROWS:
        polled = mk.make_spec(d, mk.HC_MULT, "post", cfg.hc_sinkhorn_iters, lean=True,
                              polled=True, norm_weight=_norm_dtype())
        out += [Buffer(POLL_EXCHANGE, np.uint64,
                       (mk.workspace_bytes(polled, min(r, MHC_POLL_ROWS)) // 8,),
                       "mhc_pre _lean_poll tagged words, zeroed once, left zero"),
                Buffer(POLL_STATUS, np.int32, (4,), "mhc_pre _lean_poll timeout flag [0], "
                       "zeroed once: nonzero = a consumer gave up, outputs wrong")]
    heads = lr.lm_head_specs(cfg, tp)
    out += [Buffer("tail.keys", np.uint64, (lr.MAX_ROWS,), "lm_head argmax keys, zeroed once"),
            Buffer("tail.counters", np.uint32,
                   (max(h.counters_bytes() for h in heads) // 4,), "lm_head, zeroed once")]
    if not cfg.engram_layer_ids:
        return out
    n, total = cfg.engram_max_ngram_size, cfg.engram_num_hash_cols
    wkv = _wkv_specs(cfg, tp)
    out.append(Buffer("history32", np.int32, (r, n), "newest-first token history (rows prep)"))
    out += [Buffer(_ids_name(i), np.int64, (r, total), "Engram hash ids (head)")
            for i in cfg.engram_layer_ids]
    out += [Buffer("engram.wkv_workspace", np.float32,
                   (max(1, max(s.workspace_bytes() for s in wkv) // 4),), "wkv split-K partials"),
            Buffer("engram.wkv_counters", np.uint32,
                   (max(1, max(s.counters_bytes() for s in wkv) // 4),), "wkv, zeroed once")]
    return out


def weights(cfg, tp: int, rank: int, fetch, layers=None) -> list[tuple[str, np.ndarray]]:
    """This rank's embed/head vocab rows, norms, mHC fn/base/scale (scale padded to 4 floats, the
    first layer's attention fn summed over streams), Engram tables, wkv rows, q/k weights; the
    per-layer ones of `layers` only (None: every backbone layer and the DSpark stages,
    wiring.packed_layers; the last stage's `norm` too, the draft's final norm).

    fetch cuts this rank's slices, except the Engram wkv: the checkpoint (and vLLM) replicate
    it, the step computes this rank's output columns only, so its rows are cut here
    (engram_kernel_ref.kv_rank_weight)."""
    one_hot = np.zeros((mk.MAX_ROWS, MHC_COEFFS), np.float32)
    one_hot[:, :cfg.hc_mult] = mhc_ref.one_hot_pre(mk.MAX_ROWS, cfg.hc_mult)
    out = [(name, fetch(name)) for name in ("embed.weight", "head.weight", "norm.weight")]
    out.append((ONE_HOT, one_hot))
    if cfg.engram_layer_ids:        # the hash reads raw ids through it (raises if v41 lacks it)
        out.append((engram_vocab.VOCAB_MAP_NAME, engram_vocab.fetch_vocab_map(cfg, fetch)))
    last = cfg.num_layers_total - 1
    for layer in packed_layers(cfg, layers):
        i, pre = layer.index, weight_prefix(cfg, layer)
        out += [(f"{pre}{w}_norm.weight", fetch(f"{pre}{w}_norm.weight"))
                for w in ("attn", "ffn")]
        if layer.is_dspark and i == last:
            out.append((draft_norm_name(cfg), fetch(draft_norm_name(cfg))))
        for sub in ("attn", "ffn"):
            fn = np.asarray(fetch(_fn_name(pre, sub, False)), np.float32)
            if sub == "attn" and _broadcasts(cfg, layer):
                out.append((_fn_name(pre, sub, True),
                            mhc_ref.sum_fn_over_streams(fn, cfg.hc_mult).astype(np.float32)))
            else:
                out.append((_fn_name(pre, sub, False), fn))
            scale = np.zeros(4, np.float32)
            scale[:3] = np.asarray(fetch(f"{pre}hc_{sub}_scale"), np.float32)
            out += [(f"{pre}hc_{sub}_scale.padded", scale),
                    (f"{pre}hc_{sub}_base", np.asarray(fetch(f"{pre}hc_{sub}_base"), np.float32))]
        if layer.has_engram:
            pre = f"layers.{i}.engram."
            out += [(pre + name, byte_tensor(fetch(pre + name), pre + name))
                    for name in ("embed.weight", "embed.scale")]
            wkv = ek.kv_rank_weight(cfg, tp, rank, fetch(pre + "wkv.weight"),
                                    fetch(pre + "wkv.scale"))
            out += [(pre + name, byte_tensor(part, pre + name))
                    for name, part in zip(("wkv.weight", "wkv.scale"), wkv)]
            out += [(pre + name, fetch(pre + name)) for name in ("q_weight", "k_weight")]
    return out
