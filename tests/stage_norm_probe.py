"""A minimal stage module for tests/test_emulate_ranks.py: attn.norm on the boundary buffers."""
from executor.launch import LaunchSpec
from kernels.norm_ref import make_spec
from loader.schema import UNCERTAIN


def _attn_norm(ctx, layer):
    spec = make_spec(ctx.cfg.hidden_size, {"BF16": "bf16", "F32": "f32"}[UNCERTAIN["norm_dtype"]])
    kernel = ctx.kernel(spec.name)
    weight = ctx.ptr(f"layers.{layer.index}.attn_norm.weight")

    def build(rows):
        return [LaunchSpec(kernel, spec.grid(rows), (ctx.ptr("x"), weight, ctx.ptr("xn"), rows,
                                                     ctx.cfg.rms_norm_eps))]
    return build


def weights(cfg, tp, rank, fetch):
    return [(f"layers.{s.index}.attn_norm.weight", fetch(f"layers.{s.index}.attn_norm.weight"))
            for s in cfg.layers if not s.is_dspark]


BUILDERS = {"attn.norm": _attn_norm}
