"""The FFN stages with tiled experts, the DSpark stages' included (the round benchmark only).

`executor.stages.ffn_tiled` packs the backbone's FFNs with expert e holding expert e % 16's
values; the DSpark draft needs its three stages' FFNs too (mtp.{s}.ffn: gate, shared expert,
128 routed experts each), tiled the same way over their own expert count. Buffers and builders
are `executor.stages.ffn`'s: list this module instead of ffn_tiled.
"""
from __future__ import annotations

from executor.stages import ffn, ffn_tiled

BUILDERS = ffn.BUILDERS
buffers = ffn.buffers


def weights(cfg, tp: int, rank: int, fetch, layers=None):
    return ffn_tiled.weights(cfg, tp, rank, fetch, layers, dspark_stages=True)
