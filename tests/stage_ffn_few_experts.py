"""The FFN stage module with 4 distinct routed-expert values per layer (the real-dimension slice test).

`executor.stages.ffn_tiled` with UNIQUE_EXPERTS = 4 instead of 16: expert e of every layer holds
expert e % 4's values, packed once and repeated, so every one of the 384 experts still has its own
bytes in the arena and the router (all 384 rows of the config's own weights) spreads over all of
them. Why 4: packing one expert slice through Humming's padding and fused-E8M0 step costs ~0.3 s
on one core, and the test packs 4 ranks x 4 layers before its device time starts. The reference
side reads the same values through an aliasing fetch (tests/real_slice.py); that the tiled
packing equals packing such a fetch byte for byte is tests/test_bench_step_cpu.py's check.
"""
from __future__ import annotations

from executor.stages import ffn, ffn_tiled

UNIQUE_EXPERTS = 4
BUILDERS = ffn.BUILDERS
buffers = ffn.buffers


def weights(cfg, tp: int, rank: int, fetch, layers=None):
    return ffn_tiled.weights(cfg, tp, rank, fetch, layers, unique=UNIQUE_EXPERTS)
