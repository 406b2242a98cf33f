"""W8A16 GEMV for R <= 8 on native FP8 wgmma (QGMMA, SM90a): no weight conversion at all.

Why (docs/notes/dense-design.md, rounds 6-7 and 9): after griddepcontrol.wait the streamed bf16-HMMA
kernels spend ~93 SASS per 64-K chunk a warp owns, 72 of them turning E4M3 weights into scaled
bf16. Here the E4M3 bytes go to the tensor core as they are: `wgmma.mma_async.m64n8k32.f32.e4m3
.e4m3` with A (64 weight rows x 32 K) from registers, one 8-byte shared load per row pair, and B
(32 K x 8 tokens) from shared memory by descriptor, where the CTA has put its activations as two
E4M3 parts (x * s = hi + lo, one power-of-two s per row and K slice: W8A16 kept to ~2^-17 of the
row's largest |x|; kernels/dense_qgmma_ref.py has the arithmetic, the reference and the bound).

    CTA = one 64-row tile x one K slice (kc bytes), 2 or 4 warpgroups (`_sqg` / `_sqg4`), one
      wave.
    before griddepcontrol.wait: warp 0 bulk-copies the 64 rows (one cp.async.bulk a row, rows
      kc + 32 bytes apart) on one mbarrier; the two 32-row blocks' scale bytes by cp.async; each
      thread forms its warpgroup's fold factors 2^(s - 63) (fp32 registers).
    after the wait: every thread loads 8 bf16 of x (rows < R only), the row maxima meet by
      red.shared.max, then each thread writes its 8 values' hi / lo E4M3 bytes into the B layout,
      fence.proxy.async, CTA barrier; mbarrier wait for the weights.
    per k32 step (warpgroup j takes steps [j S/W, (j+1) S/W)): 2 LDS.64 (rows g / g+8, bytes
      8t..8t+7 of the 32-K block: the registers a0..a3), wgmma.fence, QGMMA hi (scale-d 0),
      QGMMA lo (scale-d 1), commit; 4 steps in flight (2 with 4 warpgroups), then wait_group
      3 (1) and 4 FFMA fold the oldest step's fp32 partial with its block scale (one 32-row x
      32-K block per warp).
    end: warpgroups 1.. put their sums in smem, warpgroup 0 adds them in order, * 2^-64
      * (1 / s_row), bf16 store
      (split 1) or the slice partial to the workspace and the last CTA of the tile sums the
      slices in order (split > 1: wq_a|wkv), resetting the counter.

The A fragment of m64nNk32 e4m3 in registers is, per warp (rows 16w..16w+15), mma.m16n8k32's
A layout (CUTLASS ALayout_64x32: m = 16 warp + g + 8 v1, k = 4 t + v0 + 16 v2, register
v1 + 2 v2): a0 = row g, k 4t..4t+3; a1 = row g+8, same k; a2 = row g, k 16+4t..; a3 = row g+8.
The sum over a 32-K block does not care how K is ordered, so logical k 4t..4t+3 / 16+4t.. are
actual bytes 8t..8t+3 / 8t+4..8t+7 of the block (one 8-byte load per row), and the CTA writes x
in that same logical order (dense_qgmma_ref.b_offset; tests/test_dense_qgmma_cpu.py replays it).

PTX ABI: that of the dense family (kernels/dense_ref.PARAMS); bf16 epilogue only; weight and x
16-byte aligned; K % 128 == 0, N % 64 == 0.
"""
from __future__ import annotations

import cutlass
from cuda.bindings import driver as cuda
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, cute
from cutlass.cutlass_dsl import T

from kernels.dense_qgmma_ref import (
    B_STEP_BYTES,
    KSTEP,
    SCALE_BIAS,
    TILE_M,
    WG_THREADS,
    X_EXP_MIN,
    X_GROUP,
    QgSpec,
    descriptor,
    qg_specs,
)
from kernels.dense_ref import ROW_TILE
from kernels.moe_ptx import (
    bulk_copy_g2s,
    mbar_arrive_expect_tx,
    mbar_init,
    mbar_init_fence,
    mbar_wait,
)
from kernels.ptx import (
    asm,
    cp_async_4,
    cp_async_commit,
    cp_async_wait,
    ld_f32_gpu,
    ld_v4_u32,
    lds_u8,
    lds_u32,
    st_bf16,
    st_v4_f32,
    sts_s32,
    sts_u32,
    void,
)

WG_BARRIER = 2                     # named barrier of warpgroup 0 (the epilogue)
_QGMMA = "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {$0, $1, $2, $3}, {$4, $5, $6, $7}"


# ---- PTX helpers (side effects: kept in program order with the loads, stores and barriers) ---

def qgmma_hi_lo(a, desc_hi: Int64, desc_lo: Int64):
    """One k-step: D = A . B_hi (scale-d 0), D += A . B_lo, committed as one wgmma group. The
    4 fp32 of D are valid only after a wgmma_wait that covers this group."""
    text = ("wgmma.fence.sync.aligned;\n"
            f"{_QGMMA}, $8, 0, 1, 1;\n"
            f"{_QGMMA}, $9, 1, 1, 1;\n"
            "wgmma.commit_group.sync.aligned;")
    v = asm(4, [Int32(r) for r in a] + [Int64(desc_hi), Int64(desc_lo)], text,
            "=f,=f,=f,=f,r,r,r,r,l,l", kind=T.f32(), side_effects=True)
    return [Float32(r) for r in v]


def wgmma_wait(pending: int, d):
    """wgmma.wait_group `pending`; D passes through it (tied operands) so nothing reads the
    accumulators before the wait."""
    v = asm(4, [Float32(r) for r in d], f"wgmma.wait_group.sync.aligned {pending};",
            "=f,=f,=f,=f,0,1,2,3", kind=T.f32(), side_effects=True)
    return [Float32(r) for r in v]


def fence_proxy_async():
    """Generic-proxy smem writes (x parts) become visible to the async proxy (wgmma's B)."""
    void([], "fence.proxy.async.shared::cta;", "~{memory}")


def lds_v2_u32(saddr: Int32):
    v = asm(2, [Int32(saddr)], "ld.shared.v2.u32 {$0, $1}, [$2];", "=r,=r,r", side_effects=True)
    return [Int32(r) for r in v]


def lds_v4_f32(saddr: Int32):
    v = asm(4, [Int32(saddr)], "ld.shared.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,r",
            kind=T.f32(), side_effects=True)
    return [Float32(r) for r in v]


def sts_v4_f32(saddr: Int32, v):
    void([Int32(saddr)] + [Float32(r) for r in v], "st.shared.v4.f32 [$0], {$1, $2, $3, $4};",
         "r,f,f,f,f")


def red_max_shared(saddr: Int32, value: Int32):
    void([Int32(saddr), Int32(value)], "red.shared.max.u32 [$0], $1;", "r,r")


def absmax8(w):
    """The largest |x| of 4 bf16x2 words as its bf16 bit pattern (positive bf16 order = u16
    order; a NaN wins)."""
    return Int32(asm(1, [Int32(r) for r in w],
                     "{ .reg .b32 a, b, c, d;\n"
                     "and.b32 a, $1, 0x7FFF7FFF; and.b32 b, $2, 0x7FFF7FFF;\n"
                     "and.b32 c, $3, 0x7FFF7FFF; and.b32 d, $4, 0x7FFF7FFF;\n"
                     "max.u16x2 a, a, b; max.u16x2 c, c, d; max.u16x2 a, a, c;\n"
                     "shr.u32 b, a, 16; and.b32 a, a, 0xFFFF; max.u32 $0, a, b; }",
                     "=r,r,r,r,r", side_effects=False))


def exp_scale(bits: Int32, base: int):
    """fp32 2^(base - e - 127 + ...) as bits (base - max(e, X_EXP_MIN)) << 23, e = the bf16
    exponent field of `bits`: base 261 gives s = 2^(134 - e), base -7 (negated) 1 / s."""
    if base > 0:
        text = (f"{{ .reg .b32 e; bfe.u32 e, $1, 7, 8; max.u32 e, e, {X_EXP_MIN};\n"
                f"sub.u32 e, {base}, e; shl.b32 e, e, 23; mov.b32 $0, e; }}")
    else:
        text = (f"{{ .reg .b32 e; bfe.u32 e, $1, 7, 8; max.u32 e, e, {X_EXP_MIN};\n"
                f"sub.u32 e, e, {-base}; shl.b32 e, e, 23; mov.b32 $0, e; }}")
    return Float32(asm(1, [Int32(bits)], text, "=f,r", kind=T.f32(), side_effects=False))


def fold_factor(sbyte: Int32) -> Float32:
    """2^(s - 127 + SCALE_BIAS) for a UE8M0 byte s <= 134 (never subnormal, never inf)."""
    return Float32(asm(1, [Int32(sbyte)],
                       f"{{ .reg .b32 b; add.u32 b, $1, {SCALE_BIAS}; shl.b32 b, b, 23;\n"
                       "mov.b32 $0, b; }", "=f,r", kind=T.f32(), side_effects=False))


def split_hi_lo(w0: Int32, w1: Int32, s: Float32):
    """4 bf16 (w0 low half first) -> (hi, lo) words of 4 E4M3 bytes: xs = f16(x * s),
    hi = e4m3(xs), lo = e4m3(xs - hi) (dense_qgmma_ref.split_x).

    Two asm statements, the hi word passed between them as a b32 and unpacked there: with the
    whole round trip in one statement (e4m3x2 .b16 registers both converted back and packed
    into the hi word) the DSL's PTX compiler read the back-conversion of one .b16 of each pair
    from an unrelated register (R0 = blockIdx.x) - lo = e4m3(xs - garbage), NaN where the CTA
    id's byte is 0x7F (standalone ptxas 13.0.88 compiled the same PTX correctly).
    tests/test_dense_qgmma_cpu.py checks every back-conversion's source in the cubins' SASS."""
    text_hi = ("{ .reg .b32 a0, a1, a2, a3;\n"
               ".reg .b16 e01, e23;\n"
               "shl.b32 a0, $3, 16; and.b32 a1, $3, 0xFFFF0000;\n"
               "shl.b32 a2, $4, 16; and.b32 a3, $4, 0xFFFF0000;\n"
               "mul.rn.f32 a0, a0, $5; mul.rn.f32 a1, a1, $5;\n"
               "mul.rn.f32 a2, a2, $5; mul.rn.f32 a3, a3, $5;\n"
               "cvt.rn.f16x2.f32 $1, a1, a0; cvt.rn.f16x2.f32 $2, a3, a2;\n"
               "cvt.rn.satfinite.e4m3x2.f16x2 e01, $1; cvt.rn.satfinite.e4m3x2.f16x2 e23, $2;\n"
               "mov.b32 $0, {e01, e23}; }")
    v = asm(3, [Int32(w0), Int32(w1), Float32(s)], text_hi, "=r,=r,=r,r,r,f",
            side_effects=False)
    hi, h01, h23 = Int32(v[0]), Int32(v[1]), Int32(v[2])        # hi word, xs as 2 f16x2
    text_lo = ("{ .reg .b32 r01, r23; .reg .b16 x01, x23, l01, l23;\n"
               "mov.b32 {x01, x23}, $1;\n"
               "cvt.rn.f16x2.e4m3x2 r01, x01; cvt.rn.f16x2.e4m3x2 r23, x23;\n"
               "sub.rn.f16x2 r01, $2, r01; sub.rn.f16x2 r23, $3, r23;\n"
               "cvt.rn.satfinite.e4m3x2.f16x2 l01, r01; cvt.rn.satfinite.e4m3x2.f16x2 l23, r23;\n"
               "mov.b32 $0, {l01, l23}; }")
    lo = Int32(asm(1, [hi, h01, h23], text_lo, "=r,r,r,r", side_effects=False))
    return hi, lo


# ---- kernel ------------------------------------------------------------------------------------

class DenseQgmmaSm90:
    """Kernel object for one QgSpec (dense_qgmma_ref)."""

    def __init__(self, spec: QgSpec):
        if spec.epilogue != "bf16" or spec.groups != 1:
            raise ValueError(f"{spec.name}: the QGMMA kernel has the bf16 epilogue, one group")
        self.spec = spec
        self.n, self.k, self.kc, self.split = spec.n, spec.k, spec.slice_k, spec.split_k
        self.steps = spec.steps
        self.wgs, self.threads, self.wg_steps = spec.warpgroups, spec.threads, spec.wg_steps
        self.inflight = spec.inflight
        self.stride = spec.row_stride
        self.kb = self.kc // KSTEP                 # scale bytes per 32-row block of the slice
        self.gpr = self.kc // X_GROUP              # x groups (16 bytes) per row of the slice
        self.x_iters = -(-ROW_TILE * self.gpr // self.threads)
        self.red_in_x = spec.red_in_x

    @cute.jit
    def __call__(self, x: cute.Pointer, weight: cute.Pointer, scales: cute.Pointer,
                 residual: cute.Pointer, out: cute.Pointer, workspace: cute.Pointer,
                 counters: cute.Pointer, rows: Int32, stream):
        # Two CTAs per SM (this launch's and the next one's, streaming its weights beside it);
        # a whole-K spec (WHOLE_K_LABELS: wo_b, 166 KB) one, on 80 of the SMs.
        # 4 warpgroups: a launch bound keeps ptxas to 64 registers (unbound: 66 for wq_b); the
        # carveout is any value, it spares the DSL a GPU query at compile time. 2 warpgroups stay
        # unbound (62-66 registers; bound, ptxas spends 124-126 on the same code).
        bound = {"min_blocks_per_mp": 2, "preferred_smem_carveout": 100} if self.wgs > 2 else {}
        self.kernel(x, weight, scales, residual, out, workspace, counters, rows).launch(
            grid=[self.spec.ctas, 1, 1], block=[self.threads, 1, 1], stream=stream,
            use_pdl=True, **bound)

    @cute.kernel
    def kernel(self, x: cute.Pointer, weight: cute.Pointer, scales: cute.Pointer,
               residual: cute.Pointer, out: cute.Pointer, workspace: cute.Pointer,
               counters: cute.Pointer, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        # Trigger at entry (as dense_stream): the next kernel's CTAs stream beside ours.
        cute.arch.griddepcontrol_launch_dependents()
        warp, lane = tidx // 32, tidx % 32
        wg, wq = warp // 4, warp % 4
        tile, sl = cta // self.split, cta % self.split
        n0, k0 = tile * TILE_M, sl * self.kc

        smem = cutlass.memory.SmemAllocator()
        lay = self.spec.layout()
        wt = smem.allocate_tensor(Uint8, cute.make_layout(lay["w"][1]), byte_alignment=128)
        xb = smem.allocate_tensor(Uint8, cute.make_layout(lay["x"][1]), byte_alignment=128)
        sc = smem.allocate_tensor(Uint8, cute.make_layout(lay["scales"][1]), byte_alignment=16)
        # warpgroup j >= 1's partials: its own x part (red_in_x), else region j - 1 of `red`
        red_a = Int32(xb.iterator.toint())
        red_step = self.wg_steps * B_STEP_BYTES
        if cutlass.const_expr(not self.red_in_x):
            red = smem.allocate_tensor(Uint8, cute.make_layout(lay["red"][1]), byte_alignment=16)
            red_a = Int32(red.iterator.toint()) - WG_THREADS * 16
            red_step = WG_THREADS * 16
        rmax = smem.allocate_tensor(Uint8, cute.make_layout(lay["rowmax"][1]), byte_alignment=16)
        mb = smem.allocate_tensor(Uint8, cute.make_layout(8), byte_alignment=8)
        flag = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)
        wt_a, xb_a = Int32(wt.iterator.toint()), Int32(xb.iterator.toint())
        sc_a, rmax_a = Int32(sc.iterator.toint()), Int32(rmax.iterator.toint())
        mbar = Int32(mb.iterator.toint())

        self._prologue(weight, scales, wt_a, sc_a, rmax_a, mbar, n0, k0, tidx, warp, lane)
        fold = cute.make_rmem_tensor((self.wg_steps,), Float32)
        for i in cutlass.range_constexpr(self.wg_steps):      # this warp's 32-row block
            fold[i] = fold_factor(lds_u8(sc_a + (wq // 2) * self.kb + wg * self.wg_steps + i))
        cute.arch.griddepcontrol_wait()          # x comes from the previous kernel
        self._split_x(x, xb_a, rmax_a, rows, k0, tidx)
        mbar_wait(mbar, Int32(0))                # the 64 weight rows have landed

        acc = cute.make_rmem_tensor((4,), Float32)
        acc.fill(0.0)
        self._multiply(acc, fold, wt_a, xb_a, wg, wq, lane)
        if wg > 0:                               # its wgmmas are complete: its x part is free
            sts_v4_f32(red_a + wg * red_step + (tidx % WG_THREADS) * 16,
                       [acc[q] for q in range(4)])
        cute.arch.barrier()
        if wg == 0:
            for j in cutlass.range_constexpr(1, self.wgs):         # warpgroup order
                other = lds_v4_f32(red_a + j * red_step + tidx * 16)
                for q in cutlass.range_constexpr(4):
                    acc[q] = acc[q] + other[q]
            t = lane % 4
            inv0 = exp_scale(lds_u32(rmax_a + 8 * t), -7)          # 1 / s of token 2t
            inv1 = exp_scale(lds_u32(rmax_a + 8 * t + 4), -7)      # ... of token 2t + 1
            y = cute.make_rmem_tensor((4,), Float32)
            for q in cutlass.range_constexpr(4):
                inv = inv0 if q % 2 == 0 else inv1
                # 2^-64 first: acc <= ~2^90 never underflows there, and the 1 / s multiply
                # then overflows only where y itself would
                y[q] = acc[q] * Float32(2.0**-SCALE_BIAS) * inv
            if cutlass.const_expr(self.split == 1):
                self._store(y, out, rows, n0, wq, lane)
            else:
                self._slice_sum(y, out, workspace, counters, flag, rows, cta, tile, n0, tidx,
                                wq, lane)

    @cute.jit
    def _prologue(self, weight: cute.Pointer, scales: cute.Pointer, wt_a: Int32, sc_a: Int32,
                  rmax_a: Int32, mbar: Int32, n0: Int32, k0: Int32, tidx: Int32, warp: Int32,
                  lane: Int32):
        """Everything before griddepcontrol.wait: weight rows (bulk copies on the mbarrier, one
        row per copy, rows row_stride apart), the scale bytes (cp.async), row maxima zeroed."""
        if warp == 0:
            if lane == 0:
                mbar_init(mbar, 1)
                mbar_init_fence()
                mbar_arrive_expect_tx(mbar, TILE_M * self.kc)
            cute.arch.sync_warp()                 # the barrier is initialised for every lane
            for j in cutlass.range_constexpr(TILE_M // 32):
                r = lane + 32 * j
                bulk_copy_g2s(wt_a + r * self.stride,
                              weight.toint() + Int64(n0 + r) * self.k + Int64(k0),
                              self.kc, mbar)
        words = self.kb // 4
        if tidx < 2 * words:                      # rows n0..n0+63: two 32-row scale blocks
            rb, wd = tidx // words, tidx % words
            src = (n0 // 32 + rb) * (self.k // 32) + k0 // 32 + 4 * wd
            cp_async_4(sc_a + rb * self.kb + 4 * wd, scales.toint() + Int64(src))
        cp_async_commit()
        if tidx < ROW_TILE:
            sts_s32(rmax_a + 4 * tidx, Int32(0))
        cp_async_wait(0)
        cute.arch.barrier()

    @cute.jit
    def _split_x(self, x: cute.Pointer, xb_a: Int32, rmax_a: Int32, rows: Int32, k0: Int32,
                 tidx: Int32):
        """x[r, k0 + 8j .. +8) of rows < R, one 16-byte group per thread and pass: the row
        maxima (red.shared.max of bf16 bits), then hi / lo E4M3 into the B layout
        (dense_qgmma_ref.b_offset), then fence.proxy.async and the CTA barrier."""
        xw = cute.make_rmem_tensor((4, self.x_iters), Int32)
        total = rows * self.gpr
        for i in cutlass.range_constexpr(self.x_iters):
            grp = tidx + self.threads * i
            if grp < total:
                r, j = grp // self.gpr, grp % self.gpr
                v = ld_v4_u32(x.toint() + Int64((r * self.k + k0 + X_GROUP * j) * 2))
                for w in cutlass.range_constexpr(4):
                    xw[w, i] = v[w]
                red_max_shared(rmax_a + 4 * r, absmax8([v[0], v[1], v[2], v[3]]))
        cute.arch.barrier()
        for i in cutlass.range_constexpr(self.x_iters):
            grp = tidx + self.threads * i
            if grp < total:
                r, j = grp // self.gpr, grp % self.gpr
                s = exp_scale(lds_u32(rmax_a + 4 * r), 261)           # 2^(134 - e)
                hi0, lo0 = split_hi_lo(xw[0, i], xw[1, i], s)         # actual bytes 8t..8t+3
                hi1, lo1 = split_hi_lo(xw[2, i], xw[3, i], s)         # ... 8t+4..8t+7
                at = xb_a + (j // 4) * B_STEP_BYTES + r * 16 + 4 * (j % 4)
                sts_u32(at, hi0)                  # [hi][k half 0][token r][4t..4t+3]
                sts_u32(at + 128, hi1)            # [hi][k half 1]
                sts_u32(at + 256, lo0)            # [lo][k half 0]
                sts_u32(at + 384, lo1)
        fence_proxy_async()
        cute.arch.barrier()

    @cute.jit
    def _multiply(self, acc, fold, wt_a: Int32, xb_a: Int32, wg: Int32, wq: Int32,
                  lane: Int32):
        """This warpgroup's k-steps: A from 2 LDS.64, QGMMA hi + lo, `inflight` groups in flight,
        the oldest folded: acc += D * 2^(s - 63)."""
        g, t = lane // 4, lane % 4
        first = wg * self.wg_steps
        a_row = wt_a + (16 * wq + g) * self.stride + 8 * t + first * KSTEP
        desc = Int64(descriptor(0)) + Int64((xb_a + first * B_STEP_BYTES) // 16)
        d = cute.make_rmem_tensor((4, self.wg_steps), Float32)
        for i in cutlass.range_constexpr(self.wg_steps):
            lo = lds_v2_u32(a_row + KSTEP * i)
            hi = lds_v2_u32(a_row + 8 * self.stride + KSTEP * i)
            step_desc = desc + Int64(i * B_STEP_BYTES // 16)
            v = qgmma_hi_lo((lo[0], hi[0], lo[1], hi[1]), step_desc, step_desc + Int64(16))
            for q in cutlass.range_constexpr(4):
                d[q, i] = v[q]
            if cutlass.const_expr(i >= self.inflight - 1):
                self._fold(acc, d, fold, i - self.inflight + 1, self.inflight - 1)
        for j in cutlass.range_constexpr(max(0, self.wg_steps - self.inflight + 1),
                                         self.wg_steps):
            self._fold(acc, d, fold, j, self.wg_steps - 1 - j)

    @cute.jit
    def _fold(self, acc, d, fold, j: cutlass.Constexpr, pending: cutlass.Constexpr):
        v = wgmma_wait(pending, [d[q, j] for q in range(4)])
        for q in cutlass.range_constexpr(4):
            acc[q] = acc[q] + v[q] * fold[j]

    @cute.jit
    def _store(self, y, out: cute.Pointer, rows: Int32, n0: Int32, wq: Int32, lane: Int32):
        """y[q] is (row n0 + 16 wq + g + 8 (q // 2), token 2t + q % 2): bf16 for tokens < R."""
        g, t = lane // 4, lane % 4
        for q in cutlass.range_constexpr(4):
            token = 2 * t + q % 2
            if token < rows:
                col = n0 + 16 * wq + g + 8 * (q // 2)
                st_bf16(out.toint() + Int64(token * self.n + col) * 2, y[q])

    @cute.jit
    def _slice_sum(self, y, out: cute.Pointer, workspace: cute.Pointer, counters: cute.Pointer,
                   flag, rows: Int32, cta: Int32, tile: Int32, n0: Int32, tidx: Int32,
                   wq: Int32, lane: Int32):
        """split > 1: the slice's partial to workspace[cta, tidx]; the tile's last CTA to arrive
        sums the slices in slice order (the same bits every launch) and resets the counter."""
        ws = workspace.toint()
        st_v4_f32(ws + Int64(cta * WG_THREADS + tidx) * 16, y[0], y[1], y[2], y[3])
        cute.arch.barrier(barrier_id=WG_BARRIER, number_of_threads=WG_THREADS)
        counter = counters + tile
        if tidx == 0:
            cute.arch.fence_acq_rel_gpu()         # release the warpgroup's partials
            old = cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu")
            cute.arch.fence_acq_rel_gpu()         # acquire the other slices'
            flag[0] = Int32(old == self.split - 1)
        cute.arch.barrier(barrier_id=WG_BARRIER, number_of_threads=WG_THREADS)
        if flag[0] != 0:
            total = cute.make_rmem_tensor((4,), Float32)
            total.fill(0.0)
            for s in cutlass.range_constexpr(self.split):
                at = ws + Int64((tile * self.split + s) * WG_THREADS + tidx) * 16
                for q in cutlass.range_constexpr(4):
                    total[q] = total[q] + ld_f32_gpu(at + Int64(4 * q))
            self._store(total, out, rows, n0, wq, lane)
            if tidx == 0:
                cute.arch.store(counter.llvm_ptr, Int32(0), sem="relaxed", scope="gpu")


def kernel_function(spec: QgSpec):
    return DenseQgmmaSm90.kernel


def specs(cfg, tp: int) -> list[QgSpec]:
    return qg_specs(cfg, tp)


def compile_spec(spec: QgSpec, options: str = "--gpu-arch sm_90a"):
    from cutlass.cute.runtime import make_ptr

    def ptr(dtype):
        return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=16)

    return cute.compile(DenseQgmmaSm90(spec), ptr(BFloat16), ptr(Uint8), ptr(Uint8),
                        ptr(BFloat16), ptr(BFloat16), ptr(Float32), ptr(Int32), Int32(1),
                        cuda.CUstream(0), options=options)
