"""CTA-wide exclusive prefix sum of one Int32 per thread, shared by the indexer and MoE families.

A warp scan by `shfl.sync.up` (5 steps), each warp's total to shared memory, one barrier, then
every thread sums the totals of the warps before its own. The caller syncs before it reuses
`totals` (a scratch of `warps` words): the function ends without a barrier.
"""
from __future__ import annotations

import cutlass
from cutlass import Int32, cute

from kernels.ptx import lds_u32, sts_u32

LANES = 32


@cute.jit
def block_scan(value: Int32, totals: Int32, tidx: Int32, warps: cutlass.Constexpr):
    """(exclusive prefix, total) of `value` over the CTA's `warps` warps, in thread order."""
    lane = tidx % LANES
    warp = tidx // LANES
    inclusive = value
    for k in cutlass.range_constexpr(5):
        up = cute.arch.shuffle_sync_up(inclusive, offset=1 << k)
        if lane >= (1 << k):
            inclusive = inclusive + up
    if lane == LANES - 1:
        sts_u32(totals + 4 * warp, inclusive)
    cute.arch.sync_threads()
    before = Int32(0)
    total = Int32(0)
    for w in cutlass.range_constexpr(warps):
        t = lds_u32(totals + 4 * w)
        if w < warp:
            before = before + t
        total = total + t
    return before + inclusive - value, total
