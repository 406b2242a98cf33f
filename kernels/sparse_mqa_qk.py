"""QK of the sparse MQA decode kernel with lane-run k order (`kernels/sparse_mqa.py`, qk_runs).

The mma's k index is free to map onto any head dim as long as A (q) and B (the record) agree. In
group grp (64 dims = one UE8M0 scale) and k-step kk, lane t's logical k pairs (2t, 2t + 1) and
(2t + 8, 2t + 9) are the physical dims 64 grp + 16 t + 4 kk + (0, 1) and (2, 3). So over the
group's 4 k-steps a lane needs one 16-dim run: 32 bytes of each q row (two 16-byte loads) and
16 bytes of its record (two 8-byte loads) instead of 16 + 8 scalar loads; each record word holds
both B registers of a k-step. Two accumulator chains (k-steps of even / odd index, summed in that
order at the end) halve the dependent mma chain. The logits are the same dot products summed in
another fp32 order: within `error_bound`, not bit-equal to the plain k order.
"""
from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, cute

from kernels import sparse_mqa_ref as ref
from kernels.ptx import (
    e4m3x2_to_bf16x2,
    lds_s64,
    lds_u8,
    lds_v4_u32,
    mma_bf16_16816,
    sts_f32,
    ue8m0_to_f32,
)
from kernels.sparse_mqa_push import lds_v2_u32

WARP = 32
WARPS = ref.CTA_THREADS // WARP
REC = ref.RECORD_BYTES
SCALE_OFF = 576
ROPE_OFF = 448
GROUPS = ref.HEAD_DIM // 64         # 7 FP8 groups, then the bf16 rope group
SOFTMAX_SCALE = ref.HEAD_DIM ** -0.5
CHAINS = 2


class SparseMqaQkRuns:
    """`_logits_runs`, mixed into SparseMqaSm90 (reads `lay`, `E`, `skip`)."""

    @cute.jit
    def _logits_runs(self, base: Int32, tidx: Int32):
        """logits[h, n] = q[h] . entry[n] / sqrt(512); warp w takes 8-entry tiles w, w + 8, .."""
        warp, lane = tidx // WARP, tidx % WARP
        g, t = lane // 4, lane % 4
        acc = cute.make_rmem_tensor((4 * CHAINS,), Float32)
        tile = warp
        while tile < self.E // 8:
            entry = base + self.lay.records + (tile * 8 + g) * REC
            acc.fill(0.0)
            for grp in cutlass.range_constexpr(0 if "qk" in self.skip else GROUPS):
                qa = base + self.lay.q + g * ref.Q_ROW_BYTES + (64 * grp + 16 * t) * 2
                qb = qa + 8 * ref.Q_ROW_BYTES
                rg = lds_v4_u32(qa) + lds_v4_u32(qa + 16)      # row g: dims 16t .. 16t + 15
                rh = lds_v4_u32(qb) + lds_v4_u32(qb + 16)      # row g + 8
                b = []
                if cutlass.const_expr(grp < GROUPS - 1):
                    scale = ue8m0_to_f32(lds_u8(entry + SCALE_OFF + grp))
                    words = (lds_v2_u32(entry + 64 * grp + 16 * t)
                             + lds_v2_u32(entry + 64 * grp + 16 * t + 8))
                    for kk in cutlass.range_constexpr(4):         # word kk: dims 4kk .. 4kk + 3
                        b.append((e4m3x2_to_bf16x2(words[kk], scale, scale),
                                  e4m3x2_to_bf16x2(words[kk] >> 16, scale, scale)))
                else:                       # bf16 rope dims: 8 bytes per k-step
                    for kk in cutlass.range_constexpr(4):
                        b.append(tuple(lds_v2_u32(entry + ROPE_OFF + 32 * t + 8 * kk)))
                for kk in cutlass.range_constexpr(4):
                    a = (rg[2 * kk], rh[2 * kk], rg[2 * kk + 1], rh[2 * kk + 1])
                    c = 4 * ((4 * grp + kk) % CHAINS)
                    d = mma_bf16_16816(a, b[kk], [acc[c + i] for i in range(4)])
                    for i in cutlass.range_constexpr(4):
                        acc[c + i] = d[i]
            for i in cutlass.range_constexpr(4):           # fixed order: chain 0 + chain 1
                acc[i] = acc[i] + acc[4 + i]
            n0 = tile * 8 + 2 * t
            for e in cutlass.range_constexpr(2):
                valid = lds_s64(base + self.lay.addresses + (n0 + e) * 8) > 1
                for half in cutlass.range_constexpr(2):
                    value = Float32(float("-inf"))
                    if valid:
                        value = acc[2 * half + e] * Float32(SOFTMAX_SCALE)
                    h = g + 8 * half
                    sts_f32(base + self.lay.logits + (h * self.E + n0 + e) * 4, value)
            tile += WARPS
