"""The lean split-K tail of the mHC step (variant `_lean`): work in proportion to the live rows.

`MhcPreSm90` (kernels/mhc.py) inherits these methods; spec, layouts and bounds are in
`kernels/mhc_kernel_ref.py`, the design in docs/notes/mhc-router-design.md ("Round 4").

What differs from the default tail, and why (the ncu page of Round 4: the default runs its whole
unrolled 32-row tail on one SM whatever R is):
- Election: one thread fences, bumps the row block's counter (acq_rel) and publishes the result
  through shared memory (the cooperative-groups grid-barrier pattern), not three fences in
  every thread.
- Reduce: the (row, partial) sums of the live rows only, spread over all 128 threads: a thread
  sums REDUCE_CHUNK consecutive slices in slice order (16 independent L2 loads in flight), the
  chunk sums land in the (now free) fn region, and one thread per (row, partial) adds its chunks
  in chunk order. The order is fixed, so the mixes do not depend on timing.
- Coefficients: one thread per live row holds the whole 4 x 4 Sinkhorn matrix in registers: row
  and column sums are register adds (no shuffles), each normalisation is v·rcp.approx(total)
  (as variant `_rcp`), and the 8 rows of a warp run side by side instead of 16 lanes per row.
"""
from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, Int64, cute
from cutlass.cutlass_dsl import T

from kernels.mhc_kernel_ref import (
    CTA_THREADS,
    HC_MULT,
    MIX_DIM,
    PARTIAL_STRIDE,
    PARTIALS,
    REDUCE_CHUNK,
    ROWS_PER_CTA,
)
from kernels.ptx import (
    asm,
    ld_f32,
    ld_f32_gpu,
    lds_f32,
    lds_s32,
    st_s32,
    st_v4_f32,
    sts_f32,
    sts_s32,
    void,
)

# ---- inline PTX of the split-K election and Sinkhorn (kernels.mhc re-exports them) -------------


def atomic_add_acq_rel(addr: Int64, v: Int32) -> Int32:
    return Int32(asm(1, [Int64(addr), Int32(v)], "atom.acq_rel.gpu.global.add.s32 $0, [$1], $2;",
                     "=r,l,r", side_effects=True))


def rcp_approx(x: Float32) -> Float32:
    """1/x by one MUFU.RCP (rcp.approx.ftz: <= 1 ulp), no div.rn fast-path check or branch."""
    return Float32(asm(1, [Float32(x)], "rcp.approx.ftz.f32 $0, $1;", "=f,f", kind=T.f32(),
                       side_effects=False))


def fence_gpu():
    void([], "fence.acq_rel.gpu;", "")


# ---- tail ----------------------------------------------------------------------------------------

class MhcLeanTail:
    """Lean tail methods; the kernel class provides spec, S, D, red_offset and flag_offset."""

    @cute.jit
    def _lean_tail(self, scale: cute.Pointer, base: cute.Pointer, coeff_out: cute.Pointer,
                   mixes: cute.Pointer, workspace: cute.Pointer, counters: cute.Pointer,
                   sbase: Int32, block_row: Int32, rows: Int32, tidx: Int32,
                   norm_eps: Float32, hc_eps: Float32):
        """Elect the last CTA of the row block; it reduces the live rows and writes their
        coefficients, then resets the counter."""
        cute.arch.sync_threads()             # every partial of this CTA is issued
        counter = counters.toint() + Int64(block_row) * 4
        if tidx == 0:
            fence_gpu()                      # cumulative: the CTA's partials before the bump
            old = atomic_add_acq_rel(counter, Int32(1))
            sts_s32(sbase + self.flag_offset, Int32(old == self.spec.slices - 1))
        cute.arch.sync_threads()
        # x_out is complete in this CTA: the next kernel may launch (its wait covers the tail).
        cute.arch.griddepcontrol_launch_dependents()
        if lds_s32(sbase + self.flag_offset) != 0:
            live = cutlass.min(rows - block_row * ROWS_PER_CTA, ROWS_PER_CTA)
            self._lean_reduce(workspace, sbase, block_row, rows, live, tidx)
            if tidx < live:
                self._lean_row(scale, base, coeff_out, mixes, sbase, block_row * ROWS_PER_CTA
                               + tidx, tidx, norm_eps, hc_eps)
            if tidx == 0:
                st_s32(counter, Int32(0))

    @cute.jit
    def _lean_reduce(self, workspace: cute.Pointer, sbase: Int32, block_row: Int32,
                     rows: Int32, live: Int32, tidx: Int32):
        """red[rl, v] = Σ_chunks (Σ_slices of the chunk, in order) for the live rows rl."""
        chunk = min(REDUCE_CHUNK, self.spec.slices)
        chunks = self.spec.reduce_chunks
        stride = Int64(rows * PARTIAL_STRIDE * 4)            # one slice of the workspace
        units = live * PARTIALS * chunks
        for u in cutlass.range(tidx, units, CTA_THREADS, unroll=1):
            item, c = u // chunks, u % chunks
            rl, v = item // PARTIALS, item % PARTIALS
            row = block_row * ROWS_PER_CTA + rl
            addr = (workspace.toint() + Int64((row * PARTIAL_STRIDE + v) * 4)
                    + stride * Int64(c * chunk))
            vals = [ld_f32_gpu(addr + stride * s) for s in range(chunk)]
            total = vals[0]
            for s in cutlass.range_constexpr(1, chunk):
                total = total + vals[s]
            sts_f32(sbase + u * 4, total)
        cute.arch.sync_threads()
        for item in cutlass.range(tidx, live * PARTIALS, CTA_THREADS, unroll=1):
            total = lds_f32(sbase + item * chunks * 4)
            for c in cutlass.range_constexpr(1, chunks):
                total = total + lds_f32(sbase + (item * chunks + c) * 4)
            rl, v = item // PARTIALS, item % PARTIALS
            sts_f32(sbase + self.red_offset + (rl * PARTIAL_STRIDE + v) * 4, total)
        cute.arch.sync_threads()

    @cute.jit
    def _lean_row(self, scale: cute.Pointer, base: cute.Pointer, coeff_out: cute.Pointer,
                  mixes: cute.Pointer, sbase: Int32, row: Int32, rl: Int32,
                  norm_eps: Float32, hc_eps: Float32):
        """One row: rstd, the 24 mixes, pre/post (sigmoids, div.rn as the default) and comb
        (Sinkhorn in registers); stores mixes and the packed coefficients."""
        n = HC_MULT
        red = sbase + self.red_offset + rl * PARTIAL_STRIDE * 4
        mean = lds_f32(red + MIX_DIM * 4) / Float32(self.S * self.D)
        rstd = Float32(1.0) / cute.math.sqrt(mean + norm_eps)
        m = [lds_f32(red + 4 * v) * rstd for v in range(MIX_DIM)]
        s = [ld_f32(scale.toint() + Int64(4 * i)) for i in range(3)]
        b = [ld_f32(base.toint() + Int64(4 * v)) for v in range(MIX_DIM)]
        coeff = []
        for k in cutlass.range_constexpr(n):               # pre = σ(m·s0 + b) + hc_eps
            z = m[k] * s[0] + b[k]
            coeff.append(Float32(1.0) / (Float32(1.0) + cute.math.exp(-z)) + hc_eps)
        for k in cutlass.range_constexpr(n):               # post = 2σ(m·s1 + b)
            z = m[n + k] * s[1] + b[n + k]
            coeff.append(Float32(2.0) * (Float32(1.0) / (Float32(1.0) + cute.math.exp(-z))))
        logits = [m[2 * n + i] * s[2] + b[2 * n + i] for i in range(n * n)]
        coeff += self._lean_sinkhorn(logits, hc_eps)
        out = coeff_out.toint() + Int64(row * MIX_DIM * 4)
        mix_row = mixes.toint() + Int64(row * MIX_DIM * 4)
        for q in cutlass.range_constexpr(MIX_DIM // 4):
            st_v4_f32(out + Int64(16 * q), *coeff[4 * q:4 * q + 4])
            st_v4_f32(mix_row + Int64(16 * q), *m[4 * q:4 * q + 4])

    @cute.jit
    def _lean_sinkhorn(self, logits, eps: Float32):
        """c[j·4 + k] (j the source stream): row softmax + eps, column normalise, then
        (iters - 1) x (row, column) normalisations, each denominator + eps (mhc_ref.sinkhorn).
        Sums pair as (a + b) + (c + d), the half-warp kernel's order for its lane 0."""
        n = HC_MULT
        rcp = rcp_approx
        c = []
        for j in cutlass.range_constexpr(n):
            row = logits[n * j:n * j + n]
            mx = cutlass.max(cutlass.max(row[0], row[1]), cutlass.max(row[2], row[3]))
            e = [cute.math.exp(v - mx) for v in row]
            inv = rcp((e[0] + e[1]) + (e[2] + e[3]))
            c += [v * inv + eps for v in e]
        c = self._lean_normalise_columns(c, eps, rcp)
        for _ in cutlass.range_constexpr(self.spec.sinkhorn_iters - 1):
            for j in cutlass.range_constexpr(n):
                inv = rcp(((c[n * j] + c[n * j + 1]) + (c[n * j + 2] + c[n * j + 3])) + eps)
                for k in cutlass.range_constexpr(n):
                    c[n * j + k] = c[n * j + k] * inv
            c = self._lean_normalise_columns(c, eps, rcp)
        return c

    @cute.jit
    def _lean_normalise_columns(self, c, eps: Float32, rcp):
        n = HC_MULT
        out = list(c)
        for k in cutlass.range_constexpr(n):
            inv = rcp(((c[k] + c[n + k]) + (c[2 * n + k] + c[3 * n + k])) + eps)
            for j in cutlass.range_constexpr(n):
                out[n * j + k] = c[n * j + k] * inv
        return out
