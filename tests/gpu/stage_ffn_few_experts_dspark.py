"""tests/stage_ffn_few_experts.py with the DSpark stages' FFNs packed too (the real-slice round).

The real-dimension DSpark round (tests/gpu/test_dspark_round_real_slice.py) runs the draft plan,
whose three stages each have an FFN (gate, shared expert, 128 routed experts). Expert e of every
layer and stage holds expert e % UNIQUE_EXPERTS's values, as in stage_ffn_few_experts (same
packing cost per expert, same aliasing fetch on the reference side: tests/real_slice.py).
Buffers and builders are `executor.stages.ffn`'s.
"""
from __future__ import annotations

from stage_ffn_few_experts import UNIQUE_EXPERTS

from executor.stages import ffn, ffn_tiled

BUILDERS = ffn.BUILDERS
buffers = ffn.buffers


def weights(cfg, tp: int, rank: int, fetch, layers=None):
    return ffn_tiled.weights(cfg, tp, rank, fetch, layers, unique=UNIQUE_EXPERTS,
                             dspark_stages=True)
