"""The FFN stages with the routed experts packed once per distinct value (the step benchmark only).

`executor.stages.ffn` packs every expert of a layer through Humming's padding and fused-E8M0 step:
about 0.5 s per expert on one core, so 384 experts x 8 representative layers would take half an
hour before a whole-rank benchmark could start. Here expert e of every layer holds the values of
expert e % UNIQUE_EXPERTS: the first UNIQUE_EXPERTS are packed by `ffn.weights` itself (on the
config cut to that many experts) and their packed rows repeated. Packing works expert by expert
(per-expert exponent range, per-expert rows), so the result equals `ffn.weights` on a fetch
that aliases the experts that way, byte for byte (tests/test_bench_step_cpu.py checks it on
tiny). Every expert still has its own bytes in the arena, so the MoE kernels read as many bytes
as with 384 distinct experts; only the router weights are the config's own (all 384 rows), so
routing spreads over every expert.

The expert arrays come as read-only [E / unique, unique, ...] views that repeat the unique
experts (stride 0 along the first axis; E x the bytes once made contiguous, which arena_contents
does): 1.2 GB per layer on rank 0 that the step benchmark need not write on the host, it uploads
one repeat and copies it on the device (`bench_step.upload_all`).

Buffers and builders are `executor.stages.ffn`'s: list this module instead of that one.
"""
from __future__ import annotations

import numpy as np

from executor.stages import ffn
from loader.config import ModelConfig

UNIQUE_EXPERTS = 16
BUILDERS = ffn.BUILDERS
buffers = ffn.buffers


def with_experts(cfg, num_experts: int):
    """`cfg` with `num_experts` routed experts (everything else, names and shapes, unchanged)."""
    data = cfg.to_dict()
    data["n_routed_experts"] = num_experts
    data["num_experts_per_tok"] = min(cfg.num_experts_per_tok, num_experts)   # router-only key
    return ModelConfig.from_dict(data, source=f"the config cut to {num_experts} routed experts")


def weights(cfg, tp: int, rank: int, fetch, layers=None, unique: int = UNIQUE_EXPERTS):
    """`ffn.weights` of `layers` with expert e holding expert (e % unique)'s values."""
    total = cfg.n_routed_experts
    unique = min(unique, total)
    if total % unique:
        raise ValueError(f"ffn_tiled: {total} routed experts are not a whole number of "
                         f"repeats of {unique}")
    small = with_experts(cfg, unique)
    # The backbone's FFNs only: the DSpark stages' experts (their own count) are not tiled.
    backbone = [spec.index for spec in cfg.layers if not spec.is_dspark]
    layers = [i for i in backbone if layers is None or i in layers]
    gate_names = (".ffn.gate.weight", ".ffn.gate.bias")
    expert_names = tuple(f".ffn.experts.{key}" for key in ffn.EXPERT_KEYS)

    def small_fetch(name):              # the cut config's router reads its first `unique` rows
        array = fetch(name)
        return array[:unique] if name.endswith(gate_names) else array

    for index in layers:                # layer by layer: a one-layer call is a slice of this
        for name, array in ffn.weights(small, tp, rank, small_fetch, [index]):
            if name.endswith(gate_names):
                continue
            if name.endswith(expert_names) and total > unique:   # a view: [E / unique, ...]
                array = np.broadcast_to(array, (total // unique, *array.shape))
            yield name, array
        yield from ffn._gate_weights(cfg, fetch, cfg.layer(index))   # every row: real routing
