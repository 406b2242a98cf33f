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

Buffers and builders are `executor.stages.ffn`'s: list this module instead of that one. It packs
the backbone's FFNs only; `executor.stages.ffn_tiled_dspark` (the round benchmark) also packs the
DSpark stages' (`weights(..., dspark_stages=True)`), tiled over their own 128 experts.
"""
from __future__ import annotations

import numpy as np

from executor.stages import ffn
from loader.config import ModelConfig

UNIQUE_EXPERTS = 16
BUILDERS = ffn.BUILDERS
buffers = ffn.buffers


def with_experts(cfg, num_experts: int, dspark_experts: int | None = None):
    """`cfg` with `num_experts` routed experts, and `dspark_experts` in the DSpark stages if given
    (everything else, names and shapes, unchanged)."""
    data = cfg.to_dict()
    data["n_routed_experts"] = num_experts
    data["num_experts_per_tok"] = min(cfg.num_experts_per_tok, num_experts)   # router-only key
    if dspark_experts is not None:
        data["dspark_n_routed_experts"] = dspark_experts
        data["dspark_num_experts_per_tok"] = min(cfg.dspark_num_experts_per_tok, dspark_experts)
    return ModelConfig.from_dict(data, source=f"the config cut to {num_experts} routed experts")


def weights(cfg, tp: int, rank: int, fetch, layers=None, unique: int = UNIQUE_EXPERTS,
            dspark_stages: bool = False):
    """`ffn.weights` of `layers` with expert e holding expert (e % unique)'s values: the
    backbone's FFNs, and (dspark_stages=True: the round benchmark) the DSpark stages' too, each
    tiled over its own expert count. Without it the DSpark stages' FFNs are not packed."""
    totals = {False: cfg.n_routed_experts}
    if dspark_stages and cfg.dspark_target_layer_ids:
        totals[True] = cfg.dspark_n_routed_experts
    cuts = {}
    for dspark, total in totals.items():
        cuts[dspark] = min(unique, total)
        if total % cuts[dspark]:
            raise ValueError(f"ffn_tiled: {total} routed experts are not a whole number of "
                             f"repeats of {cuts[dspark]}")
    small = with_experts(cfg, cuts[False], cuts.get(True))
    chosen = [spec for spec in cfg.layers if spec.is_dspark in totals
              and (layers is None or spec.index in layers)]
    gate_names = (".ffn.gate.weight", ".ffn.gate.bias")
    expert_names = tuple(f".ffn.experts.{key}" for key in ffn.EXPERT_KEYS)

    for spec in chosen:                 # layer by layer: a one-layer call is a slice of this
        total, cut = totals[spec.is_dspark], cuts[spec.is_dspark]

        def small_fetch(name, cut=cut):     # the cut config's router reads its first rows
            array = fetch(name)
            return array[:cut] if name.endswith(gate_names) else array

        for name, array in ffn.weights(small, tp, rank, small_fetch, [spec.index]):
            if name.endswith(gate_names):
                continue
            if name.endswith(expert_names) and total > cut:      # a view: [E / cut, ...]
                array = np.broadcast_to(array, (total // cut, *array.shape))
            yield name, array
        yield from ffn._gate_weights(cfg, fetch, spec)            # every row: real routing
