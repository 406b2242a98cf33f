"""The fused mHC step for SM90 in the CuTe DSL: post, mixes GEMV, Sinkhorn and collapse in one launch.

Spec, packed-coefficient layout, reference and error bounds: `kernels/mhc_kernel_ref.py`.

How (grid = (D / 64 slices, row blocks of 32); 128 threads; 8 threads own a row's 64-wide slice):
- Before the PDL wait the CTA copies its fn slice, fn[m, j·D + slice] for the 24 m and S streams,
  into shared memory as fp32 (24.6 KB at S = 4): fn is a model constant, so this 1.97 MB read of
  the whole grid overlaps the previous kernel's tail.
- Per row (two passes of 16 rows): a thread loads its 8 d of every stream, applies the previous
  sublayer's post/comb (mode "post"), rounds X' to BF16 and stores it, writes the collapse with
  the previous pre, and accumulates its 32 values' contributions to the 24 dot products and Σx².
  The 8 threads of a row meet in a butterfly; one writes the 25 partials to the workspace.
- Split-K reduce: every CTA bumps its row block's counter (acq_rel); the last to arrive sums the
  slices' partials in slice order (the result does not depend on timing), scales by rstd, writes
  mixes, and turns them into pre/post/comb: a half-warp per row, lane (j, k) holds comb[j, k],
  row sums over lanes xor 1, 2 and column sums over xor 4, 8 (20 Sinkhorn rounds ~ 1 us). It
  then resets the counter for the next launch.
- PDL trigger at exit. Variants: `_lr` / `_rcp` (live rounds only, Sinkhorn by rcp.approx),
  `_lean` (kernels/mhc_lean.py: work in proportion to the live rows, optional fused RMSNorm),
  `_lean_poll` (kernels/mhc_poll.py: `_lean`'s arithmetic, tagged words instead of the election).
"""
from __future__ import annotations

from functools import partial

import cutlass
from cuda.bindings import driver as cuda
from cutlass import Float32, Int32, Int64, cute
from cutlass.cutlass_dsl import T

from kernels.mhc_kernel_ref import (
    CTA_THREADS,
    HC_MULT,
    MIX_DIM,
    PARTIAL_STRIDE,
    PARTIALS,
    ROW_GROUPS,
    ROWS_PER_CTA,
    SLICE_WIDTH,
    THREADS_PER_ROW,
    MhcPreSpec,
    mhc_specs,
)
from kernels.mhc_lean import MhcLeanTail, rcp_approx, stg_v4
from kernels.mhc_poll import MIX_SPLIT, MhcPollTail
from kernels.ptx import (  # shfl_xor_i32: kernels.dspark still imports it from here
    asm,
    atomic_add_acq_rel,
    bf16x2_to_f32,
    fence_gpu,
    ld_f32,
    ld_f32_gpu,
    ld_v4_u32,
    lds_f32,
    lds_s32,
    pack_bf16x2,
    shfl_xor_f32,
    shfl_xor_i32,  # noqa: F401
    st_f32,
    st_s32,
    sts_f32,
    sts_s32,
    void,
)

VEC = 8                              # bf16 per 16-byte vector


# ---- inline PTX of this family's body (shared ones: kernels.ptx) -------------------------------

# Side effects by default (this family's asm is mostly loads and stores); pure math opts out.
_asm = partial(asm, side_effects=True)


def lds_v4_f32(saddr: Int32):
    v = _asm(4, [Int32(saddr)], "ld.shared.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,r",
             kind=T.f32())
    return [Float32(x) for x in v]


def sts_v4(saddr: Int32, w):
    void([Int32(saddr)] + [Int32(x) for x in w], "st.shared.v4.b32 [$0], {$1, $2, $3, $4};",
         "r,r,r,r,r")


# ---- kernel --------------------------------------------------------------------------------------

class MhcPreSm90(MhcLeanTail, MhcPollTail):
    """Kernel object for one MhcPreSpec (config-only __init__, jit launcher, kernel)."""

    def __init__(self, spec: MhcPreSpec):
        self.spec = spec
        self.D, self.S = spec.width, spec.streams
        self.post = spec.mode in ("post", "postonly")
        self.mixes_on = spec.mode != "postonly"
        self.fn_floats = MIX_DIM * self.S * SLICE_WIDTH
        self.red_offset = spec.fn_region_bytes                 # bytes: reduced [rows, 32] sums
        self.flag_offset = self.red_offset + 4 * ROWS_PER_CTA * PARTIAL_STRIDE
        self.norm_offset = self.flag_offset + 16               # fused norm: 4 warp totals
        self.const_offset = self.norm_offset + 16              # lean: scale[3], base[24]

    @cute.jit
    def __call__(self, streams: cute.Pointer, sub_out: cute.Pointer, coeff_prev: cute.Pointer,
                 fn: cute.Pointer, scale: cute.Pointer, base: cute.Pointer,
                 streams_out: cute.Pointer, x_out: cute.Pointer, coeff_out: cute.Pointer,
                 mixes: cute.Pointer, workspace: cute.Pointer, counters: cute.Pointer,
                 norm_weight: cute.Pointer, x_normed: cute.Pointer,
                 rows: Int32, norm_eps: Float32, hc_eps: Float32, stream: cuda.CUstream):
        self.kernel(streams, sub_out, coeff_prev, fn, scale, base, streams_out, x_out, coeff_out,
                    mixes, workspace, counters, norm_weight, x_normed, rows, norm_eps,
                    hc_eps).launch(
            grid=[self.spec.slices, 1, 1], block=list(self.spec.block), stream=stream,
            smem=self.spec.smem_bytes, use_pdl=True)

    @cute.kernel
    def kernel(self, streams: cute.Pointer, sub_out: cute.Pointer, coeff_prev: cute.Pointer,
               fn: cute.Pointer, scale: cute.Pointer, base: cute.Pointer,
               streams_out: cute.Pointer, x_out: cute.Pointer, coeff_out: cute.Pointer,
               mixes: cute.Pointer, workspace: cute.Pointer, counters: cute.Pointer,
               norm_weight: cute.Pointer, x_normed: cute.Pointer,
               rows: Int32, norm_eps: Float32, hc_eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        slice_idx, block_row, _ = cute.arch.block_idx()
        sbase = Int32(0)                     # postonly: no shared memory at all
        if cutlass.const_expr(self.mixes_on):
            smem = cutlass.memory.SmemAllocator()
            sbase = Int32(smem.allocate(self.spec.smem_bytes, byte_alignment=16).toint())
            self._stage_fn(fn, sbase, slice_idx, tidx)
            if cutlass.const_expr(self.spec.norm_weight != ""):
                self._prefetch_norm_weight(norm_weight, slice_idx, tidx)
            if cutlass.const_expr(self.spec.lean):
                self._stage_consts(scale, base, sbase, tidx)
            cute.arch.sync_threads()
        cute.arch.griddepcontrol_wait()     # streams, sub_out, coeff_prev: earlier kernels

        dv = tidx % THREADS_PER_ROW
        d0 = slice_idx * SLICE_WIDTH + dv * VEC
        # lean: a warp runs a pass only if one of its 4 rows is real (warp-uniform, so the
        # row's full-warp butterflies stay converged); rows past the end load a real row.
        warp_rows = (tidx // 32) * (32 // THREADS_PER_ROW)
        live = rows - block_row * ROWS_PER_CTA
        args = (streams, sub_out, coeff_prev, streams_out, x_out, workspace, sbase, rows)
        if cutlass.const_expr(self.spec.mix_split):
            # Passes of 4 rows (a warp's row slots) that every warp runs, warp w the mixes
            # [6w, 6w + 6) (warp 0 also Σx² and the stores): 4 warps share a row's 768 fma
            # instead of one; R <= 4 is one pass, R <= 8 two.
            quad = 32 // THREADS_PER_ROW
            for q in cutlass.range(0, cutlass.min(live, ROWS_PER_CTA), quad, unroll=1):
                row = block_row * ROWS_PER_CTA + q + (tidx % 32) // THREADS_PER_ROW
                self._row_partials(*args, row, slice_idx, d0, dv, tidx // 32, MIX_SPLIT)
        elif cutlass.const_expr(self.spec.lean):
            self._lean_passes(args, block_row, live, warp_rows, slice_idx, d0, dv, tidx)
        else:
            for p in cutlass.range_constexpr(ROWS_PER_CTA // ROW_GROUPS):
                row = block_row * ROWS_PER_CTA + p * ROW_GROUPS + tidx // THREADS_PER_ROW
                self._row_partials(*args, row, slice_idx, d0, dv, Int32(0), 1)

        if cutlass.const_expr(self.spec.polled):
            # x_out, the partials and x words of this CTA are stored: the next kernel may
            # launch (its wait covers this grid); then this CTA's consumer tasks, if any.
            cute.arch.griddepcontrol_launch_dependents()
            self._poll_tail(scale, base, coeff_out, mixes, workspace, counters, norm_weight,
                            x_normed, sbase, slice_idx, block_row, rows, tidx, norm_eps, hc_eps)
        elif cutlass.const_expr(self.spec.lean):
            self._lean_tail(scale, base, coeff_out, mixes, workspace, counters, x_out,
                            norm_weight, x_normed, sbase, block_row, rows, tidx, norm_eps,
                            hc_eps)
        else:
            if cutlass.const_expr(self.mixes_on):
                self._split_k_tail(scale, base, coeff_out, mixes, workspace, counters, sbase,
                                   block_row, rows, tidx, norm_eps, hc_eps)
            cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def _split_k_tail(self, scale: cute.Pointer, base: cute.Pointer, coeff_out: cute.Pointer,
                      mixes: cute.Pointer, workspace: cute.Pointer, counters: cute.Pointer,
                      sbase: Int32, block_row: Int32, rows: Int32, tidx: Int32,
                      norm_eps: Float32, hc_eps: Float32):
        """The last CTA of this row block to arrive (acq_rel counter) reduces it: mixes, then
        pre/post/comb; it resets the counter for the next launch."""
        fence_gpu()
        cute.arch.sync_threads()
        counter = counters.toint() + Int64(block_row) * 4
        if tidx == 0:
            old = atomic_add_acq_rel(counter, Int32(1))
            sts_s32(sbase + self.flag_offset, Int32(old == self.spec.slices - 1))
        cute.arch.sync_threads()
        if lds_s32(sbase + self.flag_offset) != 0:
            fence_gpu()
            self._reduce_slices(workspace, sbase, block_row, rows, tidx)
            cute.arch.sync_threads()
            self._coefficients(scale, base, coeff_out, mixes, sbase, block_row, rows, tidx,
                               norm_eps, hc_eps)
            if tidx == 0:
                st_s32(counter, Int32(0))

    @cute.jit
    def _stage_fn(self, fn: cute.Pointer, sbase: Int32, slice_idx: Int32, tidx: Int32):
        """fn[m, j·D + slice·64 : +64] -> smem [(m·S + j)·64 + w], 16-byte pieces."""
        pieces_per_line = SLICE_WIDTH // 4
        total = MIX_DIM * self.S * pieces_per_line
        for c in cutlass.range_constexpr(0, total, CTA_THREADS):
            i = tidx + c
            if i < total:
                line, piece = i // pieces_per_line, i % pieces_per_line
                src = fn.toint() + Int64(
                    (line * self.D + slice_idx * SLICE_WIDTH + piece * 4) * 4)
                sts_v4(sbase + i * 16, ld_v4_u32(src, streaming=True))

    @cute.jit
    def _lean_passes(self, args, block_row: Int32, live: Int32, warp_rows: Int32,
                     slice_idx: Int32, d0: Int32, dv: Int32, tidx: Int32):
        """lean: a warp runs a 16-row pass only if one of its 4 rows is real."""
        for p in cutlass.range_constexpr(ROWS_PER_CTA // ROW_GROUPS):
            row = block_row * ROWS_PER_CTA + p * ROW_GROUPS + tidx // THREADS_PER_ROW
            if p * ROW_GROUPS + warp_rows < live:
                self._row_partials(*args, row, slice_idx, d0, dv, Int32(0), 1)

    @cute.jit
    def _row_partials(self, streams: cute.Pointer, sub_out: cute.Pointer,
                      coeff_prev: cute.Pointer, streams_out: cute.Pointer, x_out: cute.Pointer,
                      workspace: cute.Pointer, sbase: Int32, rows: Int32, row: Int32,
                      slice_idx: Int32, d0: Int32, dv: Int32, group: Int32,
                      groups: cutlass.Constexpr):
        """X' (and its store), the collapse, and the row's partials over this thread's 8 d:
        all 25 (groups = 1), or with the mixes split over `groups` warps this warp's share
        (`group`; warp 0 also Σx² and the stores)."""
        r = cutlass.min(row, rows - 1)                 # out-of-range rows load a real row
        valid = row < rows
        if cutlass.const_expr(groups > 1):
            valid = valid & (group == 0)
        xs = cute.make_rmem_tensor((self.S, VEC), Float32)
        for j in cutlass.range_constexpr(self.S):
            w = ld_v4_u32(streams.toint() + Int64(((r * self.S + j) * self.D + d0) * 2))
            for q in cutlass.range_constexpr(4):
                lo, hi = bf16x2_to_f32(w[q])
                xs[j, 2 * q] = lo
                xs[j, 2 * q + 1] = hi
        crow = coeff_prev.toint() + Int64(r * MIX_DIM * 4)
        # The previous sublayer's pre, loaded with X (the post's stores below are ordered asm:
        # a load after them would be a second round trip before the collapse).
        pre = [ld_f32(crow + Int64(4 * i)) for i in range(self.S)]
        if cutlass.const_expr(self.post):
            self._apply_post(xs, sub_out, crow, streams_out, r, d0, valid, groups > 1)
        # Collapse with the previous sublayer's pre (the delayed mHC), rounded to BF16.
        packed = []
        for q in cutlass.range_constexpr(4):
            pair = []
            for h in cutlass.range_constexpr(2):
                acc = pre[0] * xs[0, 2 * q + h]
                for i in cutlass.range_constexpr(1, self.S):
                    acc = acc + pre[i] * xs[i, 2 * q + h]
                pair.append(acc)
            packed.append(pack_bf16x2(pair[0], pair[1]))
        if valid:
            stg_v4(x_out.toint() + Int64((r * self.D + d0) * 2), packed)
            if cutlass.const_expr(self.spec.polled):
                self._poll_store_x(packed, workspace, r, d0)

        if cutlass.const_expr(self.mixes_on):
            self._partials(xs, workspace, sbase, rows, r, row < rows, slice_idx, dv, group,
                           groups)

    @cute.jit
    def _partials(self, xs, workspace: cute.Pointer, sbase: Int32, rows: Int32, r: Int32,
                  valid, slice_idx: Int32, dv: Int32, group: Int32, groups: cutlass.Constexpr):
        """The row's dot products (mixes [group·n, group·n + n), n = 24 / groups) and Σx² over
        this thread's 8 d, each summed in the same order whatever groups is; the 8 threads of
        the row meet in a butterfly and write them to the workspace."""
        n_m = MIX_DIM // groups
        part = cute.make_rmem_tensor((n_m + 1,), Float32)
        part.fill(0.0)
        for j in cutlass.range_constexpr(self.S):
            for e in cutlass.range_constexpr(VEC):
                part[n_m] = part[n_m] + xs[j, e] * xs[j, e]
        for m in cutlass.range_constexpr(n_m):
            mix = m if cutlass.const_expr(groups == 1) else group * n_m + m
            for j in cutlass.range_constexpr(self.S):
                for h in cutlass.range_constexpr(2):
                    f = lds_v4_f32(sbase + (((mix * self.S + j) * SLICE_WIDTH + dv * VEC
                                             + 4 * h) * 4))
                    for e in cutlass.range_constexpr(4):
                        part[m] = part[m] + xs[j, 4 * h + e] * f[e]
        for v in cutlass.range_constexpr(n_m + 1):
            total = part[v]
            for sh in cutlass.range_constexpr(3):
                total = total + shfl_xor_f32(total, THREADS_PER_ROW >> (sh + 1))
            part[v] = total
        if cutlass.const_expr(self.spec.polled):
            if valid:
                self._poll_store_partials(part, workspace, r, slice_idx, dv, group, groups)
        elif valid & (dv == 0):
            ws = workspace.toint() + Int64((slice_idx * rows + r) * PARTIAL_STRIDE * 4)
            for v in cutlass.range_constexpr(PARTIALS):
                st_f32(ws + Int64(4 * v), part[v])

    @cute.jit
    def _apply_post(self, xs, sub_out: cute.Pointer, crow: Int64, streams_out: cute.Pointer,
                    r: Int32, d0: Int32, valid, barrier: cutlass.Constexpr):
        """X'_k = bf16(post_k·f + Σ_j comb[j, k]·X_j) in place in xs, and stored. `barrier`
        (every warp of the CTA reads the same X, one stores X', maybe in place): the stores
        wait until every warp holds its X'."""
        n = HC_MULT
        post = [ld_f32(crow + Int64(4 * (n + k))) for k in range(n)]
        comb = [ld_f32(crow + Int64(4 * (2 * n + i))) for i in range(n * n)]
        fw = ld_v4_u32(sub_out.toint() + Int64((r * self.D + d0) * 2))
        f = []
        for q in cutlass.range_constexpr(4):
            lo, hi = bf16x2_to_f32(fw[q])
            f.append(lo)
            f.append(hi)
        new = cute.make_rmem_tensor((n, VEC), Float32)
        for k in cutlass.range_constexpr(n):
            for e in cutlass.range_constexpr(VEC):
                acc = post[k] * f[e]
                for j in cutlass.range_constexpr(n):
                    acc = acc + comb[j * n + k] * xs[j, e]
                new[k, e] = acc
        if cutlass.const_expr(barrier):
            cute.arch.sync_threads()
        for k in cutlass.range_constexpr(n):
            words = []
            for q in cutlass.range_constexpr(4):
                words.append(pack_bf16x2(new[k, 2 * q], new[k, 2 * q + 1]))
            for q in cutlass.range_constexpr(4):
                lo, hi = bf16x2_to_f32(words[q])       # the BF16 value the stream now holds
                xs[k, 2 * q] = lo
                xs[k, 2 * q + 1] = hi
            if valid:
                stg_v4(streams_out.toint() + Int64(((r * n + k) * self.D + d0) * 2), words)

    @cute.jit
    def _reduce_slices(self, workspace: cute.Pointer, sbase: Int32, block_row: Int32,
                       rows: Int32, tidx: Int32):
        """red[row, v] = Σ over slices in slice order of the workspace partials (rows of this
        block only; other entries are left as they are and never read)."""
        for c in cutlass.range_constexpr(0, ROWS_PER_CTA * PARTIALS, CTA_THREADS):
            i = tidx + c
            rl, v = i // PARTIALS, i % PARTIALS
            row = block_row * ROWS_PER_CTA + rl
            if (i < ROWS_PER_CTA * PARTIALS) & (row < rows):
                stride = Int64(rows * PARTIAL_STRIDE * 4)
                addr = workspace.toint() + Int64((row * PARTIAL_STRIDE + v) * 4)
                total = ld_f32_gpu(addr)
                for s in cutlass.range_constexpr(1, self.spec.slices):
                    total = total + ld_f32_gpu(addr + stride * s)
                sts_f32(sbase + self.red_offset + (rl * PARTIAL_STRIDE + v) * 4, total)

    @cute.jit
    def _coefficients(self, scale: cute.Pointer, base: cute.Pointer, coeff_out: cute.Pointer,
                      mixes: cute.Pointer, sbase: Int32, block_row: Int32, rows: Int32,
                      tidx: Int32, norm_eps: Float32, hc_eps: Float32):
        """A half-warp per row: lane l holds mixes l (l < 8: pre/post) and 8 + l (comb[l/4, l%4]).
        Every lane runs every round (full-warp shuffles); rows past the end store nothing.
        Default: all 4 rounds of 8 rows, rows past the end on the never-written (garbage) sums.
        `live_rows`: only the rounds that hold a real row (a block-uniform test), and rows past
        the end read the last real row's sums, so no lane feeds NaN/Inf/denormals to the
        div.rn / sqrt.rn slow-path subroutines."""
        n = HC_MULT
        lane, group = tidx % 16, tidx // 16
        s0 = ld_f32(scale.toint())
        s1 = ld_f32(scale.toint() + Int64(4))
        s2 = ld_f32(scale.toint() + Int64(8))
        b_pp = ld_f32(base.toint() + Int64(4 * cutlass.min(lane, 2 * n - 1)))
        b_comb = ld_f32(base.toint() + Int64(4 * (2 * n + lane)))
        groups = CTA_THREADS // 16
        live = rows - block_row * ROWS_PER_CTA             # >= 1: the grid has no empty block
        for it in cutlass.range_constexpr(ROWS_PER_CTA // groups):
            rl = group + it * groups
            if cutlass.const_expr(self.spec.live_rows):
                if it * groups < live:
                    self._coefficient_row(coeff_out, mixes, sbase, block_row, rl,
                                          cutlass.min(rl, live - 1), rl < live, lane,
                                          (s0, s1, s2, b_pp, b_comb), norm_eps, hc_eps)
            else:
                self._coefficient_row(coeff_out, mixes, sbase, block_row, rl, rl, rl < live,
                                      lane, (s0, s1, s2, b_pp, b_comb), norm_eps, hc_eps)

    @cute.jit
    def _coefficient_row(self, coeff_out: cute.Pointer, mixes: cute.Pointer, sbase: Int32,
                         block_row: Int32, rl: Int32, rl_read: Int32, valid, lane: Int32,
                         consts, norm_eps: Float32, hc_eps: Float32):
        """Row rl of the block from the reduced sums of row rl_read: rstd, mixes, pre/post
        (sigmoids) and comb (Sinkhorn); stored only where valid."""
        n = HC_MULT
        s0, s1, s2, b_pp, b_comb = consts
        row = block_row * ROWS_PER_CTA + rl
        red = sbase + self.red_offset + rl_read * PARTIAL_STRIDE * 4
        mean = lds_f32(red + MIX_DIM * 4) / Float32(self.S * self.D)
        rstd = Float32(1.0) / cute.math.sqrt(mean + norm_eps)
        m_pp = lds_f32(red + cutlass.min(lane, 2 * n - 1) * 4) * rstd
        m_comb = lds_f32(red + (2 * n + lane) * 4) * rstd
        # pre = σ(m·s0 + b) + hc_eps, post = 2σ(m·s1 + b)
        s_pp = s1
        if lane < n:
            s_pp = s0
        sig = Float32(1.0) / (Float32(1.0) + cute.math.exp(-(m_pp * s_pp + b_pp)))
        coeff_pp = Float32(2.0) * sig
        if lane < n:
            coeff_pp = sig + hc_eps
        comb = self._sinkhorn(m_comb * s2 + b_comb, hc_eps)
        out = coeff_out.toint() + Int64(row * MIX_DIM * 4)
        mix_row = mixes.toint() + Int64(row * MIX_DIM * 4)
        if valid:
            st_f32(out + Int64((2 * n + lane) * 4), comb)
            st_f32(mix_row + Int64((2 * n + lane) * 4), m_comb)
            if lane < 2 * n:
                st_f32(out + Int64(lane * 4), coeff_pp)
                st_f32(mix_row + Int64(lane * 4), m_pp)

    @cute.jit
    def _sinkhorn(self, logit: Float32, eps: Float32) -> Float32:
        """Lane (j, k) = (l/4, l%4) of a half-warp: row softmax + eps, column normalise, then
        (iters - 1) x (row, column) normalisations, each denominator + eps (mhc_ref.sinkhorn)."""
        mx = cutlass.max(logit, shfl_xor_f32(logit, 1))
        mx = cutlass.max(mx, shfl_xor_f32(mx, 2))
        e = cute.math.exp(logit - mx)
        c = self._normalise(e, self._sum4(e, 1)) + eps
        c = self._normalise(c, self._sum4(c, 4) + eps)
        for _ in cutlass.range_constexpr(self.spec.sinkhorn_iters - 1):
            c = self._normalise(c, self._sum4(c, 1) + eps)
            c = self._normalise(c, self._sum4(c, 4) + eps)
        return c

    @cute.jit
    def _normalise(self, v: Float32, total: Float32) -> Float32:
        """v / total: div.rn (default), or v·rcp.approx(total) (`approx_rcp`: <= 2 ulp more per
        normalisation, one MUFU instead of the div.rn sequence on the dependent chain)."""
        if cutlass.const_expr(self.spec.approx_rcp):
            return v * rcp_approx(total)
        return v / total

    @cute.jit
    def _sum4(self, v: Float32, stride: cutlass.Constexpr) -> Float32:
        """Sum over the 4 lanes l ^ {0, stride, 2·stride, 3·stride}: a row (1) or column (4)."""
        t = v + shfl_xor_f32(v, stride)
        return t + shfl_xor_f32(t, 2 * stride)


def kernel_function(spec: MhcPreSpec):
    """The @cute.kernel whose Python signature the build checks against spec.params."""
    del spec
    return MhcPreSm90.kernel


def specs(cfg, tp: int) -> list[MhcPreSpec]:
    """The mHC step at the hidden width: post (every sublayer), plain (after Engram), broadcast."""
    del tp
    return mhc_specs(cfg)


def compile_spec(spec: MhcPreSpec, options: str = "--gpu-arch sm_90a"):
    """cute.compile one mHC step with pointer / Int32 / Float32 arguments only."""
    from cutlass.cute.runtime import make_ptr

    def ptr():
        return make_ptr(Float32, 0, cute.AddressSpace.gmem, assumed_align=16)

    return cute.compile(MhcPreSm90(spec), *[ptr() for _ in range(14)], Int32(1),
                        Float32(1e-20), Float32(1e-6), cuda.CUstream(0), options=options)
