"""Stages of the DSpark draft forward on one rank: the `draft.*` roles of executor.plan.draft_plan.

Model doc §4, executor/reference/dspark.py `draft_base_logits`: the draft rows [bonus, noise x
(k - 1)] per sequence (kind "draft": non-causal inside the block; the caller binds their
positions, slots, seq_index and block_kind) are embedded by the head stages (head.rows_prep,
head.embed, head.embed_allreduce: the decode step's own builders), then run through the DSpark
stages as backbone layers run through the target, then collapse to the base logits U:

  layerSS.draft.<role>     the backbone builder of <role> (attn.mhc_pre .. ffn.allreduce) on
                           DSpark stage SS: the stage modules name its weights `mtp.{s}.`
                           (wiring.weight_prefix) and size its router / experts by the dspark_*
                           keys; the first stage starts the streams from the embedding as the
                           first backbone layer does (mhc's broadcast path)
  draft.mhc_post_collapse  the last stage's pending FFN post, collapse with its pre -> `x`
  draft.norm               the last stage's `norm` -> `hidden`
  draft.lm_head_logits     the shared head, logits mode -> `dspark.base` fp32 [R, V_l] (this
                           rank's vocab columns), which the Markov stages (stages/dspark.py) read

The roles live here, not in the backbone modules, so that a `draft.` role is a DSpark stage's by
name and is refused on a backbone layer; every builder is the backbone module's own. The
weights and buffers are the backbone modules' (they pack the DSpark stages too) and dspark's
(`dspark.base`); this module has none.
"""
from __future__ import annotations

from executor.launches import dense as dl
from executor.stages import attn_index, attn_proj, collectives, ffn, mhc
from kernels import lm_head_ref as lr

PREFIX = "draft."
LAYER_GROUPS = ("engram.", "attn.", "ffn.")     # per-layer roles (plan._layer_stages)


def _on_stage(role: str, build):
    """The backbone builder of `role`, applied to DSpark stage layers only."""
    def factory(ctx, layer):
        if layer is None or not layer.is_dspark:
            raise ValueError(f"{PREFIX}{role} runs at a DSpark stage layer, got layer "
                             f"{getattr(layer, 'index', None)}")
        return build(ctx, layer)
    factory.__name__ = f"draft_{role.replace('.', '_')}"
    return factory


def _layer_builders() -> dict:
    out = {}
    for mod in (mhc, attn_proj, attn_index, ffn, collectives):
        for role, build in mod.BUILDERS.items():
            if role.startswith(LAYER_GROUPS):
                out[PREFIX + role] = _on_stage(role, build)
    return out


def _post_collapse(ctx, layer):
    del layer
    return mhc._postonly(ctx)


def _norm(ctx, layer):
    del layer
    return mhc._norm(ctx, mhc.draft_norm_name(ctx.cfg), "hidden")


def _lm_head_logits(ctx, layer):
    """The shared head over `hidden`: this rank's fp32 logits into `dspark.base`."""
    del layer
    ptrs = {"x": ctx.ptr("hidden"), "weight": ctx.ptr("head.weight"),
            "out": ctx.ptr("dspark.base")}
    specs = {rows: dl.lm_head_spec(ctx.bundle, "logits", rows) for rows in (1, ctx.max_rows)}
    offset = ctx.shapes.vocab_offset(ctx.rank)

    def build(rows):
        spec = specs[1 if rows <= lr.ROW_TILE else ctx.max_rows]
        return [dl.lm_head_launch(ctx.bundle, spec, ptrs, rows, offset)]
    return build


BUILDERS = {
    **_layer_builders(),
    "draft.mhc_post_collapse": _post_collapse,
    "draft.norm": _norm,
    "draft.lm_head_logits": _lm_head_logits,
}
