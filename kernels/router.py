"""The MoE router for SM90 in the CuTe DSL: fp32 GEMV, sqrtsoftplus, biased top-k, normalisation.

Spec, reference and error bounds: `kernels/router_ref.py`.

How (grid = (E / 2, row blocks of 16 or 32); T = min(128, D / 8) threads):
- A CTA owns 2 experts. Before the PDL wait each thread loads its 16-byte vectors t, t + T, ...
  of both weight rows into registers (2 x 5 vectors at D = 5120): the 3.9 MB gate weight is read
  once per row block, overlapping the previous kernel's tail.
- Rows go 2 at a time: a thread's 8·(D/8/T) products per (expert, row) are fma'd in order, a warp
  butterfly and the warps' totals in warp order (two-slot smem, one barrier per step) give the
  fp32 logit, which the CTA stores.
- The last CTA of a row block to arrive (acq_rel counter, then reset) selects: a warp per row,
  lane l holds experts l + 32c; k rounds of (lane-local best, butterfly arg-max with ties to the
  lower index), the winner's owner masks it; weights = s / (Σ s + 1e-20) · scaling.
"""
from __future__ import annotations

import cutlass
from cuda.bindings import driver as cuda
from cutlass import BFloat16, Float32, Int32, Int64, cute

from kernels.ptx import (
    atomic_add_acq_rel,
    bf16x2_to_f32,
    fence_gpu,
    ld_f32,
    ld_f32_gpu,
    ld_v4_u32,
    lds_f32,
    lds_s32,
    shfl_xor_f32,
    shfl_xor_i32,
    st_f32,
    st_s32,
    sts_f32,
    sts_s32,
)
from kernels.router_ref import (
    EXPERTS_PER_CTA,
    ONE_PASS_ROWS,
    ROWS_PER_STEP,
    WARP,
    RouterSpec,
    make_spec,
    router_specs,
)

NEG_INF = float("-inf")


class RouterSm90:
    """Kernel object for one RouterSpec (config-only __init__, jit launcher, kernel)."""

    def __init__(self, spec: RouterSpec):
        self.spec = spec
        self.T, self.V = spec.threads, spec.vecs_per_thread
        self.warps = spec.threads // WARP
        self.lanes_e = -(-spec.experts // WARP)            # experts per lane in the selection
        self.red_floats = self.warps * EXPERTS_PER_CTA * ROWS_PER_STEP
        self.flag_offset = 4 * 2 * self.red_floats

    @cute.jit
    def __call__(self, x: cute.Pointer, weight: cute.Pointer, bias: cute.Pointer,
                 logits: cute.Pointer, ids: cute.Pointer, weights: cute.Pointer,
                 counters: cute.Pointer, rows: Int32, stream: cuda.CUstream):
        self.kernel(x, weight, bias, logits, ids, weights, counters, rows).launch(
            grid=[self.spec.experts // EXPERTS_PER_CTA, 1, 1], block=list(self.spec.block),
            stream=stream, smem=self.spec.smem_bytes, use_pdl=True)

    @cute.kernel
    def kernel(self, x: cute.Pointer, weight: cute.Pointer, bias: cute.Pointer,
               logits: cute.Pointer, ids: cute.Pointer, weights: cute.Pointer,
               counters: cute.Pointer, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta_e, block_row, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        sbase = Int32(smem.allocate(self.spec.smem_bytes, byte_alignment=16).toint())
        e0 = cta_e * EXPERTS_PER_CTA
        wreg = cute.make_rmem_tensor((4, self.V, EXPERTS_PER_CTA), Int32)
        for e in cutlass.range_constexpr(EXPERTS_PER_CTA):
            for i in cutlass.range_constexpr(self.V):
                addr = weight.toint() + Int64(((e0 + e) * self.spec.hidden
                                               + (tidx + i * self.T) * 8) * 2)
                w = ld_v4_u32(addr, streaming=True)
                for q in cutlass.range_constexpr(4):
                    wreg[q, i, e] = w[q]
        cute.arch.griddepcontrol_wait()     # x is an earlier kernel's output

        first = block_row * self.spec.rows_per_cta
        n_rows = cutlass.min(rows - first, self.spec.rows_per_cta)
        steps = (n_rows + ROWS_PER_STEP - 1) // ROWS_PER_STEP
        for step in range(steps):
            self._logits_step(x, logits, wreg, sbase, tidx, e0, first + step * ROWS_PER_STEP,
                              rows, step % 2)

        fence_gpu()
        cute.arch.sync_threads()
        counter = counters.toint() + Int64(block_row) * 4
        if tidx == 0:
            old = atomic_add_acq_rel(counter, Int32(1))
            last = Int32(old == self.spec.experts // EXPERTS_PER_CTA - 1)
            sts_s32(sbase + self.flag_offset, last)
        cute.arch.sync_threads()
        if lds_s32(sbase + self.flag_offset) != 0:
            fence_gpu()
            warp, lane = tidx // WARP, tidx % WARP
            for it in cutlass.range_constexpr(self.spec.rows_per_cta // self.warps):
                row = first + warp + it * self.warps
                if row < rows:                       # uniform over the warp
                    self._select(bias, logits, ids, weights, row, lane)
            if tidx == 0:
                st_s32(counter, Int32(0))
        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def _logits_step(self, x: cute.Pointer, logits: cute.Pointer, wreg, sbase: Int32,
                     tidx: Int32, e0: Int32, r0: Int32, rows: Int32, slot: Int32):
        """Logits of (2 experts) x (rows r0, r0 + 1): thread sums, butterfly, warps in order."""
        acc = cute.make_rmem_tensor((EXPERTS_PER_CTA, ROWS_PER_STEP), Float32)
        acc.fill(0.0)
        for rr in cutlass.range_constexpr(ROWS_PER_STEP):
            r = cutlass.min(r0 + rr, rows - 1)
            for i in cutlass.range_constexpr(self.V):
                xw = ld_v4_u32(x.toint() + Int64((r * self.spec.hidden + (tidx + i * self.T) * 8)
                                              * 2))
                for q in cutlass.range_constexpr(4):
                    x_lo, x_hi = bf16x2_to_f32(xw[q])
                    for e in cutlass.range_constexpr(EXPERTS_PER_CTA):
                        w_lo, w_hi = bf16x2_to_f32(wreg[q, i, e])
                        acc[e, rr] = acc[e, rr] + x_lo * w_lo
                        acc[e, rr] = acc[e, rr] + x_hi * w_hi
        warp, lane = tidx // WARP, tidx % WARP
        red = sbase + slot * (4 * self.red_floats)
        for e in cutlass.range_constexpr(EXPERTS_PER_CTA):
            for rr in cutlass.range_constexpr(ROWS_PER_STEP):
                total = acc[e, rr]
                for sh in cutlass.range_constexpr(5):
                    total = total + shfl_xor_f32(total, 16 >> sh)
                if lane == 0:
                    sts_f32(red + ((warp * EXPERTS_PER_CTA + e) * ROWS_PER_STEP + rr) * 4, total)
        cute.arch.sync_threads()
        if tidx < EXPERTS_PER_CTA * ROWS_PER_STEP:
            e, rr = tidx // ROWS_PER_STEP, tidx % ROWS_PER_STEP
            total = lds_f32(red + (e * ROWS_PER_STEP + rr) * 4)
            for w in cutlass.range_constexpr(1, self.warps):
                total = total + lds_f32(red + ((w * EXPERTS_PER_CTA + e) * ROWS_PER_STEP + rr)
                                        * 4)
            if r0 + rr < rows:
                st_f32(logits.toint() + Int64(((r0 + rr) * self.spec.experts + e0 + e) * 4),
                       total)

    @cute.jit
    def _select(self, bias: cute.Pointer, logits: cute.Pointer, ids: cute.Pointer,
                weights: cute.Pointer, row: Int32, lane: Int32):
        """One warp: sqrt(softplus) scores, top-k of score + bias (ties: lower index), weights."""
        E = self.spec.experts
        sel = cute.make_rmem_tensor((self.lanes_e,), Float32)
        score = cute.make_rmem_tensor((self.lanes_e,), Float32)
        for c in cutlass.range_constexpr(self.lanes_e):
            e = cutlass.min(lane + c * WARP, E - 1)
            lg = ld_f32_gpu(logits.toint() + Int64((row * E + e) * 4))
            softplus = cutlass.max(lg, Float32(0.0)) + cute.math.log1p(
                cute.math.exp(-cute.math.absf(lg)))
            s = cute.math.sqrt(softplus)
            score[c] = s
            sel[c] = s + ld_f32(bias.toint() + Int64(e * 4))
            if lane + c * WARP >= E:
                sel[c] = Float32(NEG_INF)
        chosen_ids = []
        chosen_scores = []
        for k in cutlass.range_constexpr(self.spec.topk):
            best_v = sel[0]
            best_i = lane
            best_s = score[0]
            for c in cutlass.range_constexpr(1, self.lanes_e):
                if sel[c] > best_v:                 # strict: the lower index keeps a tie
                    best_v = sel[c]
                    best_i = lane + c * WARP
                    best_s = score[c]
            for sh in cutlass.range_constexpr(5):
                ov = shfl_xor_f32(best_v, 16 >> sh)
                oi = shfl_xor_i32(best_i, 16 >> sh)
                os_ = shfl_xor_f32(best_s, 16 >> sh)
                if (ov > best_v) | ((ov == best_v) & (oi < best_i)):
                    best_v = ov
                    best_i = oi
                    best_s = os_
            for c in cutlass.range_constexpr(self.lanes_e):
                if best_i == lane + c * WARP:
                    sel[c] = Float32(NEG_INF)
            chosen_ids.append(best_i)
            chosen_scores.append(best_s)
        total = chosen_scores[0]
        for k in cutlass.range_constexpr(1, self.spec.topk):
            total = total + chosen_scores[k]
        denom = total + Float32(1e-20)
        if lane == 0:
            out = Int64(row * self.spec.topk * 4)
            for k in cutlass.range_constexpr(self.spec.topk):
                st_s32(ids.toint() + out + Int64(4 * k), chosen_ids[k])
                st_f32(weights.toint() + out + Int64(4 * k),
                       chosen_scores[k] / denom * Float32(self.spec.scaling))


def kernel_function(spec: RouterSpec):
    """The @cute.kernel whose Python signature the build checks against spec.params."""
    if spec.one_pass:
        from kernels.router_tile import RouterTileSm90
        return RouterTileSm90.kernel
    return RouterSm90.kernel


def specs(cfg, tp: int) -> list[RouterSpec]:
    """The routers of the config's routed experts (replicated on every rank: tp plays no part):
    the default, `_tile8` and `_tile8p`, and the DSpark stages' routers (their own expert count
    and top-k: the default row block, `_tile8`, `_tile8p`) when the config has them."""
    del tp
    out = router_specs(cfg)
    if any(spec.is_dspark for spec in cfg.layers):
        args = (cfg.hidden_size, cfg.dspark_n_routed_experts, cfg.dspark_num_experts_per_tok,
                cfg.routed_scaling_factor)
        for dspark in (make_spec(*args), make_spec(*args, ONE_PASS_ROWS, one_pass=True),
                       make_spec(*args, ONE_PASS_ROWS, one_pass=True, polled=True)):
            out += [dspark] if dspark.name not in {s.name for s in out} else []
    return out


def compile_spec(spec: RouterSpec, options: str = "--gpu-arch sm_90a"):
    """cute.compile the router with pointer / Int32 arguments only (one_pass specs: the
    `_tile8` kernel of kernels/router_tile.py)."""
    from cutlass.cute.runtime import make_ptr

    if spec.one_pass:
        from kernels.router_tile import compile_tile_spec
        return compile_tile_spec(spec, options)

    def ptr(dtype=Float32):
        return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=16)

    return cute.compile(RouterSm90(spec), ptr(BFloat16), ptr(BFloat16), ptr(), ptr(), ptr(Int32),
                        ptr(), ptr(Int32), Int32(1), cuda.CUstream(0), options=options)
