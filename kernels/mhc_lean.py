"""The lean split-K tail of the mHC step (variant `_lean`): work in proportion to the live rows.

`MhcPreSm90` (kernels/mhc.py) inherits these methods; spec, layouts and bounds are in
`kernels/mhc_kernel_ref.py`, the design in docs/notes/mhc-router-design.md ("Round 4").

What differs from the default tail, and why (the ncu page of Round 4: the default runs its whole
unrolled 32-row tail on one SM whatever R is):
- Election: one thread fences, bumps the row block's counter (acq_rel) and publishes the result
  through shared memory (the cooperative-groups grid-barrier pattern), not three fences in
  every thread.
- Reduce: the (row, partial) sums of the live rows only, spread over all 128 threads: a thread
  sums REDUCE_CHUNK consecutive slices in slice order, REDUCE_BATCH such units at once (64
  independent L2 loads in flight), the chunk sums land in the (now free) fn region, and one
  thread per (row, partial) adds its chunks in chunk order. The order is fixed, so the mixes do
  not depend on timing.
- Coefficients: one thread per live row holds the whole 4 x 4 Sinkhorn matrix in registers: row
  and column sums are register adds (no shuffles), each normalisation is v·rcp.approx(total)
  (as variant `_rcp`), and the 8 rows of a warp run side by side instead of 16 lanes per row.
- Fused RMSNorm (`norm_weight` set): the same last CTA re-reads its rows' x from L2 and
  normalises them with the thread geometry and summation order of `kernels.norm`
  (`norm_ref.row_geometry`: at D = 5120, 128 threads x 5 vectors, butterfly 16..1, warp totals
  in warp order), so x_normed equals `norm_ref.rmsnorm_ref` bitwise; every CTA prefetches its
  slice of the weight into L2 before the PDL wait. This saves the norm's launch.
"""
from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, Int64, cute
from cutlass.cutlass_dsl import T

from kernels import norm_ref
from kernels.mhc_kernel_ref import (
    CTA_THREADS,
    HC_MULT,
    MIX_DIM,
    PARTIAL_STRIDE,
    PARTIALS,
    REDUCE_CHUNK,
    ROWS_PER_CTA,
    SLICE_WIDTH,
)
from kernels.ptx import (
    asm,
    atomic_add_acq_rel,
    bf16x2_to_f32,
    fence_gpu,
    ld_f32,
    ld_f32_gpu,
    ld_v4_f32,
    ld_v4_u32,
    lds_f32,
    lds_s32,
    pack_bf16x2,
    shfl_xor_f32,
    st_s32,
    st_v4_f32,
    sts_f32,
    sts_s32,
    void,
)

# ---- inline PTX of the lean tail (the election's atomic and fence: kernels.ptx) ----------------


def rcp_approx(x: Float32) -> Float32:
    """1/x by one MUFU.RCP (rcp.approx.ftz: <= 1 ulp), no div.rn fast-path check or branch."""
    return Float32(asm(1, [Float32(x)], "rcp.approx.ftz.f32 $0, $1;", "=f,f", kind=T.f32(),
                       side_effects=False))


def stg_v4(addr: Int64, w):
    void([Int64(addr)] + [Int32(x) for x in w], "st.global.v4.b32 [$0], {$1, $2, $3, $4};",
         "l,r,r,r,r")


def ld_v4_u32_l2(addr: Int64):
    """16 bytes another CTA of this launch wrote (read after the acquire): L2, never L1."""
    v = asm(4, [Int64(addr)], "ld.global.cg.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l",
            side_effects=True)
    return [Int32(x) for x in v]


def prefetch_l2(addr: Int64):
    void([Int64(addr)], "prefetch.global.L2 [$0];", "l")


BUTTERFLY_STEPS = {1: 0, 2: 1, 4: 2, 8: 3, 16: 4, 32: 5}


def norm_geometry(width: int) -> tuple[int, int, int, int, int]:
    """`kernels.norm`'s row geometry (threads per row, vectors a thread) and what follows from
    it: butterfly lanes, warps per row, rows a CTA normalises at once (plain Python ints)."""
    tpr, vecs = norm_ref.row_geometry(width)
    return tpr, vecs, min(tpr, 32), max(1, tpr // 32), CTA_THREADS // tpr


# ---- tail ----------------------------------------------------------------------------------------

REDUCE_BATCH = 4                     # reduce units a thread loads at once (4 x 16 in flight)


class MhcLeanTail:
    """Lean tail methods; the kernel class provides spec, S, D, red_offset and flag_offset."""

    @cute.jit
    def _lean_tail(self, scale: cute.Pointer, base: cute.Pointer, coeff_out: cute.Pointer,
                   mixes: cute.Pointer, workspace: cute.Pointer, counters: cute.Pointer,
                   x_out: cute.Pointer, norm_weight: cute.Pointer, x_normed: cute.Pointer,
                   sbase: Int32, block_row: Int32, rows: Int32, tidx: Int32,
                   norm_eps: Float32, hc_eps: Float32):
        """Elect the last CTA of the row block; it reduces the live rows and writes their
        coefficients (and with the fused norm their x_normed), then resets the counter."""
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
            weight, first = None, None
            if cutlass.const_expr(self.spec.norm_weight != ""):    # in flight meanwhile
                weight = self._lean_norm_weight(norm_weight, tidx)
                first = self._lean_norm_load(x_out, block_row, live, Int32(0), tidx)
            self._lean_reduce(workspace, sbase, block_row, rows, live, tidx)
            if tidx < live:
                self._lean_row(scale, base, coeff_out, mixes, sbase, block_row * ROWS_PER_CTA
                               + tidx, tidx, norm_eps, hc_eps)
            if cutlass.const_expr(self.spec.norm_weight != ""):
                self._lean_norm(x_out, first, weight, x_normed, sbase, block_row, live, tidx,
                                norm_eps)
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
        # REDUCE_BATCH units a thread at once, all their loads issued before any sum, so a
        # batch costs one L2 round trip (the loads are ordered asm: a loop would serialise them).
        for start in cutlass.range(0, units, CTA_THREADS * REDUCE_BATCH, unroll=1):
            vals = []
            for j in cutlass.range_constexpr(REDUCE_BATCH):
                u = cutlass.min(start + tidx + j * CTA_THREADS, units - 1)   # clamped: real
                item, c = u // chunks, u % chunks
                rl, v = item // PARTIALS, item % PARTIALS
                row = block_row * ROWS_PER_CTA + rl
                addr = (workspace.toint() + Int64((row * PARTIAL_STRIDE + v) * 4)
                        + stride * Int64(c * chunk))
                vals.append([ld_f32_gpu(addr + stride * s) for s in range(chunk)])
            for j in cutlass.range_constexpr(REDUCE_BATCH):
                total = vals[j][0]
                for s in cutlass.range_constexpr(1, chunk):
                    total = total + vals[j][s]
                u = start + tidx + j * CTA_THREADS
                if u < units:
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
        consts = sbase + self.const_offset                 # staged before the PDL wait
        s = [lds_f32(consts + 4 * i) for i in range(3)]
        b = [lds_f32(consts + 4 * (3 + v)) for v in range(MIX_DIM)]
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

    @cute.jit
    def _stage_consts(self, scale: cute.Pointer, base: cute.Pointer, sbase: Int32, tidx: Int32):
        """scale[0:3] and base[0:24] (model constants) into shared memory before the PDL wait,
        so the last CTA's coefficient rows do not wait on a cold HBM round trip."""
        if tidx < 3:
            sts_f32(sbase + self.const_offset + tidx * 4, ld_f32(scale.toint() + Int64(4 * tidx)))
        elif tidx < 3 + MIX_DIM:
            sts_f32(sbase + self.const_offset + tidx * 4,
                    ld_f32(base.toint() + Int64(4 * (tidx - 3))))

    @cute.jit
    def _prefetch_norm_weight(self, norm_weight: cute.Pointer, slice_idx: Int32, tidx: Int32):
        """This CTA's slice of the norm weight into L2 (the last CTA reads the whole row)."""
        nbytes = SLICE_WIDTH * (2 if self.spec.norm_weight == "bf16" else 4)
        if tidx * 128 < nbytes:
            prefetch_l2(norm_weight.toint() + Int64(slice_idx * nbytes + tidx * 128))

    @cute.jit
    def _lean_norm_weight(self, norm_weight: cute.Pointer, tidx: Int32):
        """This thread's weights (fp32), vectors k·tpr + t: the same for every row."""
        tpr, vecs, _, _, _ = norm_geometry(self.D)
        t = tidx % tpr
        w = []
        for k in cutlass.range_constexpr(vecs):
            d0 = (k * tpr + t) * 8
            if cutlass.const_expr(self.spec.norm_weight == "bf16"):
                raw = ld_v4_u32(norm_weight.toint() + Int64(d0 * 2))
                for q in cutlass.range_constexpr(4):
                    lo, hi = bf16x2_to_f32(raw[q])
                    w.append(lo)
                    w.append(hi)
            else:
                w += ld_v4_f32(norm_weight.toint() + Int64(d0 * 4))
                w += ld_v4_f32(norm_weight.toint() + Int64(d0 * 4 + 16))
        return w

    @cute.jit
    def _lean_norm_load(self, x_out: cute.Pointer, block_row: Int32, live: Int32, it: Int32,
                        tidx: Int32):
        """Iteration `it`'s row of this thread's group (clamped to a real row): its x words."""
        tpr, vecs, _, _, groups = norm_geometry(self.D)
        rl = it * groups + tidx // tpr
        row = block_row * ROWS_PER_CTA + cutlass.min(rl, live - 1)
        xrow = x_out.toint() + Int64(row * self.D * 2)
        return [ld_v4_u32_l2(xrow + Int64((k * tpr + tidx % tpr) * 16)) for k in range(vecs)]

    @cute.jit
    def _lean_norm(self, x_out: cute.Pointer, first, weight, x_normed: cute.Pointer,
                   sbase: Int32, block_row: Int32, live: Int32, tidx: Int32, eps: Float32):
        """x_normed = (x·rstd)·w in bf16 for the live rows, exactly as `kernels.norm`: a group
        of `tpr` threads per row, thread t sums the squares of vectors k·tpr + t in order, the
        group's butterfly (offsets lanes/2 .. 1), then warp totals in warp order. `first`: the
        x words of iteration 0, loaded before the reduce."""
        _, _, _, _, groups = norm_geometry(self.D)
        self._lean_norm_row(first, Int32(0), weight, x_normed, sbase, block_row, live, tidx, eps)
        for it in cutlass.range(1, (live + groups - 1) // groups, unroll=1):
            words = self._lean_norm_load(x_out, block_row, live, it, tidx)
            self._lean_norm_row(words, it, weight, x_normed, sbase, block_row, live, tidx, eps)

    @cute.jit
    def _lean_norm_row(self, words, it: Int32, weight, x_normed: cute.Pointer, sbase: Int32,
                       block_row: Int32, live: Int32, tidx: Int32, eps: Float32):
        """One iteration: Σx² in the norm's order, rstd, and the store of the real rows."""
        tpr, _, _, _, groups = norm_geometry(self.D)
        rl = it * groups + tidx // tpr
        row = block_row * ROWS_PER_CTA + cutlass.min(rl, live - 1)
        self._norm_row(words, row, rl < live, weight, x_normed, sbase, tidx, eps)

    @cute.jit
    def _norm_row(self, words, row: Int32, store, weight, x_normed: cute.Pointer, sbase: Int32,
                  tidx: Int32, eps: Float32):
        """Σx² of this thread's words in the norm's order, its group's butterfly, the warp
        totals in warp order (every thread must call it), rstd; stores row where `store`."""
        tpr, vecs, lanes, warps_per_row, _ = norm_geometry(self.D)
        acc = Float32(0.0)
        for k in cutlass.range_constexpr(vecs):
            for q in cutlass.range_constexpr(4):
                lo, hi = bf16x2_to_f32(words[k][q])
                acc = acc + lo * lo
                acc = acc + hi * hi
        for i in cutlass.range_constexpr(BUTTERFLY_STEPS[lanes]):
            acc = acc + shfl_xor_f32(acc, lanes >> (i + 1))
        total = acc
        if cutlass.const_expr(warps_per_row > 1):
            if tidx % 32 == 0:
                sts_f32(sbase + self.norm_offset + (tidx // 32) * 4, acc)
            cute.arch.sync_threads()
            total = lds_f32(sbase + self.norm_offset)
            for w in cutlass.range_constexpr(1, warps_per_row):
                total = total + lds_f32(sbase + self.norm_offset + w * 4)
            cute.arch.sync_threads()            # the slots are rewritten by the next row
        rstd = Float32(1.0) / cute.math.sqrt(total / Float32(self.D) + eps)
        if store:
            self._lean_norm_store(words, rstd, weight, x_normed, row, tidx % tpr, tpr, vecs)

    @cute.jit
    def _lean_norm_store(self, words, rstd: Float32, w, x_normed: cute.Pointer, row: Int32,
                         t: Int32, tpr: int, vecs: int):
        """y = (x·rstd)·w rounded to bf16, vector k·tpr + t of the row."""
        for k in cutlass.range_constexpr(vecs):
            packed = []
            for q in cutlass.range_constexpr(4):
                lo, hi = bf16x2_to_f32(words[k][q])
                packed.append(pack_bf16x2((lo * rstd) * w[8 * k + 2 * q],
                                          (hi * rstd) * w[8 * k + 2 * q + 1]))
            stg_v4(x_normed.toint() + Int64((row * self.D + (k * tpr + t) * 8) * 2), packed)
