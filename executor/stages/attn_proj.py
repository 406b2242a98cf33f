"""The attention sublayer's projections, KV-cache writes and output on one rank (group A).

Model doc §2.2 A1-A9 and A15 with `executor/reference/attention.py`'s roundings, from the
boundary buffer `xn` (bf16 [R, D], the normed attention input) to `attn.partial` (bf16 [R, D],
this rank's wo_b output, which the attention all-reduce sums):

  attn.wq_a_wkv        dense wqa_wkv    xn -> attn.qkv bf16 [R, q_lora + 512]  (replicated)
  attn.q_kv_norm       attn_prep        attn.qkv -> attn.qr = bf16(q_norm(q half)) [R, q_lora],
                       (kv_publish)     and the kv half -> kv_norm, RoPE, 584-byte record at
                                        slot_mapping[r] of swa_{l} (slot -1: padding, no write)
  attn.compressor      compressor       (kv sources) xn -> ring, compressed_{l}, index_keys_{l}
                       proj + publish   (ratio 2 pools pairs through compressor_ring_{l})
  attn.wq_b            dense wq_b       attn.qr -> attn.q bf16 [R, H_l, 512] (a 1-row bucket:
                                        kernels.dense_qgmma's `_sqg`, QGMMA_WQ_B_ROWS)
  attn.rope_swa_insert RoPE in place    attn.q's rope dims at positions32 (the layer's table)

With FUSED_ATTN_PREP = False (round 4's chain) attn.q_kv_norm is the split RMSNorm (attn.qr, and
attn.kv = the kv half, copied) and attn.rope_swa_insert adds the SWA insert from attn.kv.
With FOLD_Q_NORM (session 8, 2 <= R <= 8; a 1-row bucket keeps attn_prep, FOLD_MIN_ROWS):
attn.wq_b is kernels.dense_qnorm, q_norm of attn.qkv's q half in its x prologue (bitwise
attn.qr; the indexer's wq_b likewise), attn.q_kv_norm the SWA insert alone from the kv half of
attn.qkv (kv_swa_insert_d512_s<q_lora + 512>; a side stage where the layer has no compressor /
indexer, plan.kv_insert_on_side), attn.qr not written. Above 8 rows attn.wq_a_wkv ends with
split_rmsnorm (attn.qr for the r32 kernels).
  attn.wo_a            grouped wo_a     attn.o (group B, inverse-RoPE'd) -> attn.z [R, G_l lora]
  attn.wo_b            dense wo_b       attn.z -> attn.partial (bf16 epilogue: the reference's
                                        AR-1 rounds each rank's fp32 partial to bf16 first; a
                                        1-row bucket: `_sqg`, QGMMA_WO_B_ROWS)

`attn.qr` and `attn.q` are group B's inputs (indexer query, sparse MQA query); `attn.o` its
output, declared by B. Kernel choices: the fused linear's two halves go through one launch
(one warp a row per half); the SWA record is written before wq_b, since only this layer's sparse
MQA reads swa_{l}. Dense launches pick their kernel by rows (8 rows per pass
up to 8 rows, 32 above) and share one split-K workspace and counters: each launch touches them
only after griddepcontrol.wait, when its predecessor has finished. `attn.dense_counters` must be
ZERO before the first launch (HostArena is zeroed at creation; the GPU Executor must zero it).

Padding rows (past the real ones in a bucket) run through every row-wise kernel; the SWA insert
and the compressor write no cache for them (slot -1, seq_index -1). The reference zeroes a
padding row's partial; here it is wo_b of whatever `attn.o` holds in that row (zeros if B writes
zeros there, as the sparse MQA kernel does).

The KV cache geometry (page size, block-table width) is `ctx.geometry` (a CacheGeometry). The
compressor kernels keep RING_ROWS = 8 ring rows per line: the bound compressor_ring_{l} must have
ring_rows 8 (the reference's caches for blocks of up to 6 rows).

Weights per backbone layer l (fp32 where the kernel reads fp32; widening bf16 is exact; W8A16
weights stored [G, N, K] with scale bytes [G, N/32, K/32], G = 1 except wo_a):
  layers.{l}.attn.wq_a_wkv.weight / .scale   e4m3 [q_lora + 512, D] / ue8m0 (wq_a rows, then wkv)
  layers.{l}.attn.q_norm.weight.f32 [q_lora], layers.{l}.attn.kv_norm.weight.f32 [512]
  layers.{l}.attn.wq_b.weight / .scale       e4m3 [H_l 512, q_lora] (this rank's heads)
  layers.{l}.attn.wo_a.weight / .scale       e4m3 [G_l, lora, hpg 512] (this rank's groups)
  layers.{l}.attn.wo_b.weight / .scale       e4m3 [D, G_l lora] (this rank's input columns)
  kv sources: layers.{l}.attn.compressor.wkv_wgate.weight f32 [1024, D] (ratio 2) or
  layers.{l}.attn.compressor.wkv.weight bf16 [512, D] (ratio 1); compressor.norm.weight.f32,
  indexer.wk.weight bf16 [128, 512], indexer.k_norm.weight.f32 (the index-key projection runs in
  the compressor's publish)
  DSpark stage s (layer L + s, SWA only): the same under `mtp.{s}.attn.` (wiring.weight_prefix)
  rope.plain / rope.yarn f32 [max_position_embeddings, 32, 2]: the (cos, sin) tables of ratio-0
  and compressed layers (attention.rope_for); group B reads them by these names.
"""
from __future__ import annotations

import numpy as np

from executor.launches import dense as dl
from executor.launches import dense_qnorm as ql
from executor.launches.compressor import CompressorShape, compressor_launches
from executor.launches.small import (
    attn_prep_launches,
    kernel_for,
    rope_launches,
    swa_insert_launches,
)
from executor.launches.split_norm import split_norm_launch
from executor.wiring import Buffer, packed_layers, weight_prefix
from kernels import compressor_kernel_ref as ck
from kernels import dense_qgmma_ref as qr
from kernels import dense_ref as dr
from kernels import kv_publish_ref, rope_ref, split_norm_ref
from kernels.common_ref import BF16
from kernels.wo_a_ref import wo_a_shape, wo_a_specs

DENSE_LABELS = ("wqa_wkv", "wq_b", "wo_b")
# attn.q_kv_norm runs kv_publish's attn_prep (q_norm -> attn.qr, and kv_norm + RoPE + the SWA
# record), and attn.rope_swa_insert only q's RoPE: 2 launches a layer instead of 3
# (docs/notes/attn-fusion.md). False: split_rmsnorm, then RoPE + kv_swa_insert, as measured in
# round 4.
FUSED_ATTN_PREP = True
# q_norm folded into its readers (docs/notes/attn-fusion.md, "q_norm folded"): at 2..8 rows wq_b and
# the indexer's wq_b are kernels.dense_qnorm (RMSNorm of attn.qkv's q half in their x prologue,
# bitwise attn.qr), and attn.q_kv_norm is the kv half's SWA insert alone (kv_swa_insert_d512_s<W
# + 512>, reading attn.qkv in place) on the side stream: no launch between wq_a|wkv and wq_b. Above
# 8 rows q_norm is split_rmsnorm at the end of attn.wq_a_wkv (the r32 kernels read attn.qr).
FOLD_Q_NORM = True                  # revert: False (attn_prep between wq_a|wkv and wq_b)
# Run r9b (H100): the fold saves 175 us a step at R = 6 but costs 85 us at R = 1, where the
# prologue's norm (+1.2 us on wq_b) and the kv insert's fork and join cost more than the launch
# they remove. So a 1-row bucket keeps round 8's arrangement: attn_prep (qr and the SWA record)
# on the main chain, at the end of attn.wq_a_wkv's launches, and attn.q_kv_norm launches nothing
# (an empty side stage forks nothing: executor.plan.Plan.record).
FOLD_MIN_ROWS = 2
# Round 9 (QGMMA, docs/notes/dense-design.md): a bucket of these row counts runs attn.wq_b as
# kernels.dense_qgmma's `_sqg` (W8A16 on FP8 wgmma, x split into two E4M3 parts) on attn.qr.
# Run r9d (H100, family PDL chain): 3.99 us against the plain kernel's 5.18 at R = 1; 6.40
# against 5.69 at R = 6, so 1-row buckets only (2..8 keep the fold, R > 8 the r32 kernel).
# Numerics: within 2^-11 sum|W||x~| + half a bf16 ulp of the split x's product, not the dense
# family's fp32 bound (dense_qgmma_ref.qgmma_tolerance).
QGMMA_WQ_B_ROWS = (1,)              # revert: () (bench_step variant "wq_b_xtwp")
# Session 9: attn.wo_b the same way (whole K = 2048 per CTA, one CTA per SM on 80 SMs). Run r9f
# (H100, family PDL chain): 5.02 us against the plain kernel's 5.35 at R = 1, 7.40 against 5.54
# at R = 6: 1-row buckets only. Same numerics as wq_b's QGMMA (qgmma_tolerance).
QGMMA_WO_B_ROWS = (1,)              # revert: () (bench_step variant "wo_b_xtu")
ROPE_TABLES = {"plain": "rope.plain", "yarn": "rope.yarn"}


def _prefix(cfg, spec) -> str:
    return weight_prefix(cfg, spec) + "attn."


def rope_name(ratio: int) -> str:
    """The RoPE table slice of a layer of `ratio` (plain on ratio 0, YaRN on compressed layers)."""
    return ROPE_TABLES["yarn" if ratio > 0 else "plain"]


def _backbone(cfg):
    return [spec for spec in cfg.layers if not spec.is_dspark]


# ---- buffers --------------------------------------------------------------------------------

def _dense_specs(cfg, tp: int) -> list[dr.DenseSpec]:
    """Every dense / wo_a kernel the group may launch (bf16 epilogue, both row tilings)."""
    shapes = dr.dense_shapes(cfg, tp)
    return [dr.make_spec(label, *shapes[label][:2], row_tiles=rt)
            for label in DENSE_LABELS for rt in dr.ROW_TILE_CHOICES] + wo_a_specs(cfg, tp)


def _qgmma_specs(cfg, tp: int) -> list[qr.QgSpec]:
    """The QGMMA kernels wq_b and wo_b may launch (QGMMA_WQ_B_ROWS, QGMMA_WO_B_ROWS): sized
    whether or not the switches are on, so a step variant re-wired without them keeps the same
    arena."""
    return [s for s in qr.qg_specs(cfg, tp)
            if s.variant == qr.VARIANT and ("_wq_b_" in s.name or "_wo_b_" in s.name)]


def buffers(cfg, tp: int, max_rows: int) -> list[Buffer]:
    """The group's intermediates and scratch, sized for max_rows; `attn.qr` and `attn.q` are
    group B's inputs."""
    r, shapes = max_rows, cfg.rank_shapes(tp)
    q_lora, hd = cfg.q_lora_rank, cfg.head_dim
    dense = _dense_specs(cfg, tp) + _qgmma_specs(cfg, tp)
    workspace = max(s.workspace_bytes() for s in dense)
    counters = max(s.counters_bytes() for s in dense)
    out = [Buffer("attn.qkv", BF16, (r, q_lora + hd), "wq_a | wkv output"),
           Buffer("attn.qr", BF16, (r, q_lora), "q latent after q_norm (indexer, wq_b input)"),
           Buffer("attn.kv", BF16, (r, hd), "kv latent before kv_norm (SWA insert input)"),
           Buffer("attn.q", BF16, (r, shapes.heads, hd), "queries after wq_b and RoPE"),
           Buffer("attn.z", BF16, (r, shapes.o_groups * cfg.o_lora_rank), "wo_a output"),
           Buffer("attn.dense_workspace", np.float32, (max(workspace // 4, 1),),
                  "split-K partials of the group's linears"),
           Buffer("attn.dense_counters", np.uint32, (max(counters // 4, 1),),
                  "split-K counters: zero before the first launch")]
    ratios = {spec.ratio for spec in _backbone(cfg) if spec.owns_compressor}
    if ratios:
        out.append(Buffer("attn.kv_score", np.float32, (r, ck.HEAD_DIM * max(ratios)),
                          "compressor projection (kv | score)"))
    return out


# ---- weights --------------------------------------------------------------------------------

def _fp8(fetch, name: str, groups: int, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """A W8A16 weight and its scale bytes as the dense kernels read them: [G, N, K], [G, N/32,
    K/32] (the checkpoint's row-major [G N, K] / [G N/32, K/32], reshaped)."""
    w, s = np.asarray(fetch(name + ".weight")), np.asarray(fetch(name + ".scale"))
    if s.dtype.itemsize != 1:
        raise TypeError(f"{name}.scale: UE8M0 scales must be one byte each, got {s.dtype}")
    nb, kb = n // dr.FP8_BLOCK, k // dr.FP8_BLOCK
    if w.shape != (groups * n, k) or s.shape != (groups * nb, kb):
        raise TypeError(f"{name}: expected weight [{groups * n}, {k}] and scale [{groups * nb}, "
                        f"{kb}] on this rank, got {list(w.shape)} and {list(s.shape)}")
    w, s = w.reshape(groups, n, k), s.view(np.uint8).reshape(groups, nb, kb)
    dr.check_weight(w, s, groups, n, k, name)
    return w, s


def _f32(fetch, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A plain BF16/F32 tensor widened to fp32 (exact), checked against `shape`."""
    array = np.asarray(fetch(name))
    if array.shape != shape or array.dtype.kind not in "fV" or array.dtype.itemsize > 4:
        raise TypeError(f"{name}: expected a bf16/f32 tensor {list(shape)}, got {array.dtype} "
                        f"{array.shape}")
    return array.astype(np.float32)


def _compressor_weights(cfg, fetch, spec) -> list[tuple[str, np.ndarray]]:
    base, d, hd = _prefix(cfg, spec), cfg.hidden_size, ck.HEAD_DIM
    if spec.ratio == 2:         # fp32 in the checkpoint (schema UNCERTAIN): the kernel reads fp32
        parts = [np.asarray(fetch(f"{base}compressor.{w}.weight")) for w in ("wkv", "wgate")]
        for w, part in zip(("wkv", "wgate"), parts):
            if part.dtype != np.float32 or part.shape != (hd, d):
                raise TypeError(f"{base}compressor.{w}.weight: the ratio-2 projection reads f32 "
                                f"[{hd}, {d}], got {part.dtype} {part.shape}")
        out = [(f"{base}compressor.wkv_wgate.weight", np.concatenate(parts))]
    else:
        wkv = np.asarray(fetch(f"{base}compressor.wkv.weight"))
        if wkv.dtype != BF16 or wkv.shape != (hd, d):
            raise TypeError(f"{base}compressor.wkv.weight: the ratio-1 projection reads bf16 "
                            f"[{hd}, {d}], got {wkv.dtype} {wkv.shape}")
        out = [(f"{base}compressor.wkv.weight", wkv)]
    wk = np.asarray(fetch(f"{base}indexer.wk.weight"))
    if wk.dtype != BF16 or wk.shape != (ck.INDEX_DIM, hd):
        raise TypeError(f"{base}indexer.wk.weight: the publish reads bf16 [{ck.INDEX_DIM}, "
                        f"{hd}], got {wk.dtype} {wk.shape}")
    return out + [
        (f"{base}compressor.norm.weight.f32", _f32(fetch, f"{base}compressor.norm.weight", (hd,))),
        (f"{base}indexer.wk.weight", wk),
        (f"{base}indexer.k_norm.weight.f32",
         _f32(fetch, f"{base}indexer.k_norm.weight", (ck.INDEX_DIM,)))]


def _layer_weights(cfg, tp: int, fetch, spec) -> list[tuple[str, np.ndarray]]:
    base, shapes = _prefix(cfg, spec), dr.dense_shapes(cfg, tp)
    q_lora, hd, d = cfg.q_lora_rank, cfg.head_dim, cfg.hidden_size
    wq_a, sq_a = _fp8(fetch, base + "wq_a", 1, q_lora, d)
    wkv, skv = _fp8(fetch, base + "wkv", 1, hd, d)
    wq_b, sq_b = _fp8(fetch, base + "wq_b", 1, *shapes["wq_b"][:2])
    wo_a, so_a = _fp8(fetch, base + "wo_a", *wo_a_shape(cfg, tp))
    wo_b, so_b = _fp8(fetch, base + "wo_b", 1, *shapes["wo_b"][:2])
    out = [(base + "wq_a_wkv.weight", np.concatenate([wq_a, wkv], axis=1)),
           (base + "wq_a_wkv.scale", np.concatenate([sq_a, skv], axis=1)),
           (base + "q_norm.weight.f32", _f32(fetch, base + "q_norm.weight", (q_lora,))),
           (base + "kv_norm.weight.f32", _f32(fetch, base + "kv_norm.weight", (hd,))),
           (base + "wq_b.weight", wq_b), (base + "wq_b.scale", sq_b),
           (base + "wo_a.weight", wo_a), (base + "wo_a.scale", so_a),
           (base + "wo_b.weight", wo_b), (base + "wo_b.scale", so_b)]
    if spec.owns_compressor:
        out += _compressor_weights(cfg, fetch, spec)
    return out


def weights(cfg, tp: int, rank: int, fetch, layers=None):
    """The attention projections on this rank of `layers` (None: every backbone layer and the
    DSpark stages, wiring.packed_layers), then the RoPE tables."""
    del rank                            # fetch already cuts this rank's slices
    for spec in packed_layers(cfg, layers):
        yield from _layer_weights(cfg, tp, fetch, spec)
    for kind, name in ROPE_TABLES.items():
        if any((spec.ratio > 0) == (kind == "yarn") for spec in cfg.layers):
            yield name, rope_ref.RopeTable.for_ratio(cfg, 1 if kind == "yarn" else 0).cos_sin


# ---- builders -------------------------------------------------------------------------------

def _geometry(ctx):
    geometry = getattr(ctx, "geometry", None)
    if geometry is None:
        raise ValueError("attn_proj stages need the KV cache geometry: StepContext.geometry "
                         "(an executor.bind.CacheGeometry) is not set")
    return geometry


def _dense_by_row_tiles(ctx, label: str, wo_a: bool = False) -> dict[int, dr.DenseSpec]:
    """row_tiles -> the bundle's spec of `label`, checked against the arena's scratch."""
    out = {}
    for rows in (1, ctx.max_rows):
        spec = dl.wo_a_spec(ctx.bundle, rows) if wo_a else dl.dense_spec(ctx.bundle, label, rows)
        for name, need in (("attn.dense_workspace", spec.workspace_bytes()),
                           ("attn.dense_counters", spec.counters_bytes())):
            if need > ctx.arena.nbytes(name):
                raise ValueError(f"{spec.name} needs {need} bytes of {name}; the arena has "
                                 f"{ctx.arena.nbytes(name)} (buffers() built for another shape?)")
        out[dl.row_tiles_for(rows)] = spec
    return out


def _dense(ctx, label: str, x: str, weight: str, out: str, wo_a: bool = False):
    """rows -> [one dense launch of `label`] from slice `x` to slice `out`."""
    specs = _dense_by_row_tiles(ctx, label, wo_a)
    ptrs = {"x": ctx.ptr(x), "weight": ctx.ptr(weight + ".weight"),
            "scales": ctx.ptr(weight + ".scale"), "out": ctx.ptr(out),
            "workspace": ctx.ptr("attn.dense_workspace"),
            "counters": ctx.ptr("attn.dense_counters")}

    def build(rows):
        return [dl.dense_launch(ctx.bundle, specs[dl.row_tiles_for(rows)], ptrs, rows)]
    return build


def q_norm_folded() -> bool:
    """FOLD_Q_NORM in effect (it builds on attn_prep's arrangement: FUSED_ATTN_PREP)."""
    return FOLD_Q_NORM and FUSED_ATTN_PREP


def folded_rows(rows: int) -> bool:
    """Whether a bucket of `rows` runs q_norm inside wq_b / the indexer's wq_b
    (FOLD_MIN_ROWS <= R <= 8)."""
    return q_norm_folded() and FOLD_MIN_ROWS <= rows <= dr.ROW_TILE


def _wq_a_wkv(ctx, layer):
    dense = _dense(ctx, "wqa_wkv", "xn", _prefix(ctx.cfg, layer) + "wq_a_wkv", "attn.qkv")
    if not q_norm_folded():
        return dense
    q_norm = _split_norm(ctx, layer)          # R > 8: the r32 kernels read attn.qr
    prep = _attn_prep(ctx, layer)             # R < FOLD_MIN_ROWS: qr and the SWA record

    def build(rows):
        if folded_rows(rows):
            return dense(rows)
        return dense(rows) + (prep(rows) if rows < FOLD_MIN_ROWS else q_norm(rows))
    return build


def _split_norm(ctx, layer):
    """split_rmsnorm: attn.qkv -> attn.qr (q_norm) and attn.kv (the kv half, copied)."""
    cfg = ctx.cfg
    spec = split_norm_ref.make_spec(cfg.q_lora_rank, cfg.head_dim)
    kernel_for(ctx.bundle, spec)
    ptrs = {"x": ctx.ptr("attn.qkv"),
            "weight": ctx.ptr(_prefix(cfg, layer) + "q_norm.weight.f32"),
            "out": ctx.ptr("attn.qr"), "tail": ctx.ptr("attn.kv")}
    return lambda rows: [split_norm_launch(ctx.bundle, spec, ptrs, rows, cfg.rms_norm_eps)]


def _q_kv_norm(ctx, layer):
    if q_norm_folded():                       # below FOLD_MIN_ROWS attn.wq_a_wkv inserts
        insert = _kv_insert(ctx, layer)
        return lambda rows: insert(rows) if rows >= FOLD_MIN_ROWS else []
    if FUSED_ATTN_PREP:
        return _attn_prep(ctx, layer)
    return _split_norm(ctx, layer)


def _kv_insert(ctx, layer):
    """attn.q_kv_norm with q_norm folded: the SWA record from the kv half of attn.qkv (a side
    stage: only this layer's sparse MQA, after the join, reads swa_{l})."""
    cfg, i = ctx.cfg, layer.index
    spec = kv_publish_ref.make_swa_spec(cfg.head_dim, cfg.q_lora_rank + cfg.head_dim)
    kernel_for(ctx.bundle, spec)
    ptrs = {"kv": ctx.ptr("attn.qkv") + 2 * cfg.q_lora_rank,
            "weight": ctx.ptr(_prefix(cfg, layer) + "kv_norm.weight.f32"),
            "table": ctx.ptr(rope_name(layer.ratio)), "positions": ctx.ptr("positions32"),
            "slots": ctx.ptr("slot_mapping"), "cache": ctx.ptr(f"swa_{i}")}
    num_positions, eps = cfg.max_position_embeddings, cfg.rms_norm_eps
    return lambda rows: swa_insert_launches(ctx.bundle, spec, ptrs, rows, num_positions, eps)


def qnorm_dense(ctx, label: str, weight: str, out: str, norm_weight: str):
    """rows -> [the folded kernel of `label`] from attn.qkv (R <= 8 only)."""
    spec = ql.qnorm_spec(ctx.bundle, label)
    ptrs = {"x": ctx.ptr("attn.qkv"), "weight": ctx.ptr(weight + ".weight"),
            "scales": ctx.ptr(weight + ".scale"), "norm_weight": ctx.ptr(norm_weight),
            "out": ctx.ptr(out)}
    eps = ctx.cfg.rms_norm_eps
    return lambda rows: [ql.qnorm_launch(ctx.bundle, spec, ptrs, rows, eps)]


def _attn_prep(ctx, layer):
    """attn.q_kv_norm when fused: qr and the layer's SWA record in one launch (kv_publish)."""
    cfg, i = ctx.cfg, layer.index
    spec = kv_publish_ref.make_attn_prep_spec(cfg.q_lora_rank, cfg.head_dim)
    kernel_for(ctx.bundle, spec)
    base = _prefix(cfg, layer)
    ptrs = {"qkv": ctx.ptr("attn.qkv"), "q_weight": ctx.ptr(base + "q_norm.weight.f32"),
            "kv_weight": ctx.ptr(base + "kv_norm.weight.f32"),
            "table": ctx.ptr(rope_name(layer.ratio)), "positions": ctx.ptr("positions32"),
            "slots": ctx.ptr("slot_mapping"), "qr": ctx.ptr("attn.qr"),
            "cache": ctx.ptr(f"swa_{i}")}
    num_positions, eps = cfg.max_position_embeddings, cfg.rms_norm_eps
    return lambda rows: attn_prep_launches(ctx.bundle, spec, ptrs, rows, num_positions, eps)


def _compressor(ctx, layer):
    cfg, geometry, base = ctx.cfg, _geometry(ctx), _prefix(ctx.cfg, layer)
    i = layer.index
    if layer.ratio == 2 and geometry.ring_rows != ck.RING_ROWS:
        raise ValueError(f"layer {i} compressor: the bound compressor_ring_{i} has "
                         f"{geometry.ring_rows} rows per line; the kernels index {ck.RING_ROWS}")
    shape = CompressorShape(layer.ratio, cfg.hidden_size, ctx.max_rows, geometry.max_seqs,
                            geometry.pages_per_seq, geometry.page_size, geometry.num_pages,
                            cfg.max_position_embeddings)
    for spec in (ck.make_proj_spec(shape.ratio, shape.hidden), ck.make_publish_spec(shape.ratio)):
        ctx.kernel(spec.name)                     # in the bundle, or a clear error now
    weight = "compressor.wkv_wgate.weight" if layer.ratio == 2 else "compressor.wkv.weight"
    ptrs = {"x": ctx.ptr("xn"), "w": ctx.ptr(base + weight),
            "kv_score": ctx.ptr("attn.kv_score"),
            # ratio 1 never touches the ring (the kernel is handed kv_score instead)
            "ring": ctx.ptr(f"compressor_ring_{i}" if layer.ratio == 2 else "attn.kv_score"),
            "positions": ctx.ptr("positions32"), "seq_index": ctx.ptr("seq_index"),
            "state_lines": ctx.ptr("state_lines"), "block_tables": ctx.ptr("block_tables"),
            "norm_w": ctx.ptr(base + "compressor.norm.weight.f32"),
            "wk": ctx.ptr(base + "indexer.wk.weight"),
            "k_norm": ctx.ptr(base + "indexer.k_norm.weight.f32"),
            "table": ctx.ptr(rope_name(layer.ratio)),
            "cache": ctx.ptr(f"compressed_{i}"), "keys": ctx.ptr(f"index_keys_{i}")}
    return lambda rows: compressor_launches(ctx.bundle, shape, ptrs, rows, cfg.rms_norm_eps)


def _qgmma(ctx, label: str, x: str, weight: str, out: str):
    """rows -> [one kernels.dense_qgmma launch of `label`] (R <= 8), on the group's split-K
    scratch like the dense launches (the tiny preset's wq_b splits K in 2)."""
    spec = dl.qgmma_spec(ctx.bundle, label)
    for name, need in (("attn.dense_workspace", spec.workspace_bytes()),
                       ("attn.dense_counters", spec.counters_bytes())):
        if need > ctx.arena.nbytes(name):
            raise ValueError(f"{spec.name} needs {need} bytes of {name}; the arena has "
                             f"{ctx.arena.nbytes(name)} (buffers() built for another shape?)")
    ptrs = {"x": ctx.ptr(x), "weight": ctx.ptr(weight + ".weight"),
            "scales": ctx.ptr(weight + ".scale"), "out": ctx.ptr(out),
            "workspace": ctx.ptr("attn.dense_workspace"),
            "counters": ctx.ptr("attn.dense_counters")}
    return lambda rows: [dl.dense_launch(ctx.bundle, spec, ptrs, rows)]


def _wq_b(ctx, layer):
    base = _prefix(ctx.cfg, layer)
    plain = _dense(ctx, "wq_b", "attn.qr", base + "wq_b", "attn.q")
    fold = q_norm_folded()
    folded = (qnorm_dense(ctx, "wq_b", base + "wq_b", "attn.q", base + "q_norm.weight.f32")
              if fold else None)
    qg_rows = frozenset(QGMMA_WQ_B_ROWS)
    bad = [r for r in qg_rows if not 1 <= r <= dr.ROW_TILE or (fold and r >= FOLD_MIN_ROWS)]
    if bad:                             # the QGMMA kernel reads attn.qr: R <= 8, not folded
        raise ValueError(f"QGMMA_WQ_B_ROWS {sorted(qg_rows)}: rows {sorted(bad)} are past "
                         f"{dr.ROW_TILE} or fold q_norm into wq_b (attn.qr unwritten)")
    qg = _qgmma(ctx, "wq_b", "attn.qr", base + "wq_b", "attn.q") if qg_rows else None

    def build(rows):
        if fold and folded_rows(rows):
            return folded(rows)
        return qg(rows) if rows in qg_rows else plain(rows)
    return build


def _rope_swa_insert(ctx, layer):
    cfg, i = ctx.cfg, layer.index
    rope = rope_ref.make_spec(ctx.shapes.heads, cfg.head_dim, inverse=False, in_place=True)
    insert = kv_publish_ref.make_swa_spec(cfg.head_dim)
    kernel_for(ctx.bundle, rope)
    kernel_for(ctx.bundle, insert)
    table, positions = ctx.ptr(rope_name(layer.ratio)), ctx.ptr("positions32")
    p_rope = {"x": ctx.ptr("attn.q"), "table": table, "positions": positions}
    p_insert = {"kv": ctx.ptr("attn.kv"),
                "weight": ctx.ptr(_prefix(cfg, layer) + "kv_norm.weight.f32"),
                "table": table, "positions": positions, "slots": ctx.ptr("slot_mapping"),
                "cache": ctx.ptr(f"swa_{i}")}
    num_positions, eps = cfg.max_position_embeddings, cfg.rms_norm_eps

    def build(rows):
        if FUSED_ATTN_PREP:                 # attn.q_kv_norm wrote the SWA record already
            return rope_launches(ctx.bundle, rope, p_rope, rows, num_positions)
        return [*rope_launches(ctx.bundle, rope, p_rope, rows, num_positions),
                *swa_insert_launches(ctx.bundle, insert, p_insert, rows, num_positions, eps)]
    return build


def _wo_a(ctx, layer):
    return _dense(ctx, "grouped", "attn.o", _prefix(ctx.cfg, layer) + "wo_a", "attn.z",
                  wo_a=True)


def _wo_b(ctx, layer):
    args = ("wo_b", "attn.z", _prefix(ctx.cfg, layer) + "wo_b", "attn.partial")
    plain = _dense(ctx, *args)
    qg_rows = frozenset(QGMMA_WO_B_ROWS)
    bad = [r for r in qg_rows if not 1 <= r <= dr.ROW_TILE]
    if bad:
        raise ValueError(f"QGMMA_WO_B_ROWS {sorted(qg_rows)}: rows {sorted(bad)} are past "
                         f"{dr.ROW_TILE} (the QGMMA kernel's tile)")
    qg = _qgmma(ctx, *args) if qg_rows else None
    return lambda rows: qg(rows) if rows in qg_rows else plain(rows)


BUILDERS = {"attn.wq_a_wkv": _wq_a_wkv, "attn.q_kv_norm": _q_kv_norm,
            "attn.compressor": _compressor, "attn.wq_b": _wq_b,
            "attn.rope_swa_insert": _rope_swa_insert, "attn.wo_a": _wo_a, "attn.wo_b": _wo_b}
