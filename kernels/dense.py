"""W8A16 dense linears for SM90 in the CuTe DSL: FP8 E4M3 x BF16 on mma.sync tensor cores, fp32 acc.

Computes `y = x @ (e4m3(w) * 2^(s-127))^T` per group with the "bf16", "f32" or "residual" epilogue;
`kernels/dense_ref.py` holds the spec, the grid/workspace rules, the byte formula, the reference
and the error bound the tests use.

How (one warp = one 16-row weight tile = the A operand of mma.sync.m16n8k16):
- Thread (g = lane/4, t = lane%4) loads 16 bytes of weight row n0+g and of row n0+g+8 at K offset
  chunk*64 + 16t: every 16-byte load is whole, a warp load covers 16 rows x 64 bytes.
- The sum over K does not care how K is ordered, so the mma's logical K is a permutation of the
  actual K (the same for W and x): for mma step j of a chunk, logical columns (2t, 2t+1, 2t+8,
  2t+9) are actual offsets 16t + 4j + (0, 2, 1, 3). Then a thread's A operand comes from its own
  16 bytes, and its B operand from x[row g, the same 16 K], two 16-byte loads of x.
- E4M3 -> BF16 is exact bit placement: byte s.eeee.mmm -> bf16 bits s.0000eeee.mmm0000, which is
  the value times 2^-120 (subnormals included), then one bf16x2 multiply by 2^(scale-7) gives the
  scaled weight exactly. Both scale blocks a thread touches are its own 32-K group.
- A CTA of 4 warps owns one tile and a K slice (split_k slices per tile); warps take every 4th
  chunk, PREFETCH chunks in flight per thread. Weights are loaded before `griddepcontrol.wait`
  (they are constants), x only after it.
- Partials meet in shared memory in warp order, then (split_k > 1) in a workspace summed in slice
  order by the last CTA to arrive (acq_rel counter per pass and tile, reset by that CTA): the
  result does not depend on timing.

PTX ABI: (u64 x, u64 weight, u64 scales, u64 residual, u64 out, u64 workspace, u64 counters,
u32 rows); x, weight, residual and out 16-byte aligned.
"""
from __future__ import annotations

import cutlass
from cuda.bindings import driver as cuda
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T

from kernels.dense_ref import (
    CHUNK_K,
    CTA_WARPS,
    FP8_BLOCK,
    ROW_TILE,
    TILE_N,
    WARP,
    DenseSpec,
    dense_specs,
)
from kernels.moe_ptx import swiglu
from kernels.ptx import (
    ld_bf16,
    ld_f32,
    ld_f32_gpu,
    ld_v4_u32,
    mma_bf16_16816_ordered,
    st_bf16,
    st_f32,
)

PREFETCH = 4                      # weight chunks in flight per thread (4 x 32 bytes)
WORDS = 8                         # u32 words of weight per thread per chunk (2 rows x 16 bytes)


# ---- PTX helpers (inline asm: exact instructions, ordered with griddepcontrol) ---------------

# Not kernels.ptx.asm: every result comes back through a struct (one-result asm included) and
# every asm has side effects. Routing the one-result helpers through ptx.asm changed 3 cubins.
def _asm(result_types, operands, text: str, constraints: str):
    struct = llvm.StructType.get_literal(result_types)
    res = llvm.inline_asm(struct, [op.ir_value() for op in operands], text, constraints,
                          has_side_effects=True)
    return [llvm.extractvalue(ty, res, [i]) for i, ty in enumerate(result_types)]


def ld_u8(addr: Int64) -> Int32:
    return Int32(_asm([T.i32()], [addr], "ld.global.nc.u8 $0, [$1];", "=r,l")[0])


def scale_bf16x2(sbyte: Int32, valid) -> Int32:
    """bf16x2 (2^(s-7), 2^(s-7)) for a UE8M0 byte s, or 0 when `valid` is false (K tail)."""
    v = Int32(valid)
    text = ("{ .reg .b32 e; .reg .pred p; add.u32 e, $1, 120; shl.b32 e, e, 7; "
            "mul.lo.u32 e, e, 65537; setp.ne.s32 p, $2, 0; selp.b32 $0, e, 0, p; }")
    return Int32(_asm([T.i32()], [sbyte, v], text, "=r,r,r")[0])


def e4m3x4_to_bf16x2x2(word: Int32, scale2: Int32):
    """4 e4m3 bytes (b0..b3) -> (bf16x2(b0, b2), bf16x2(b1, b3)), each times the bf16x2 scale."""
    text = ("{ .reg .b32 a, b; "
            "shl.b32 a, $2, 4; and.b32 a, a, 0x07F007F0; shl.b32 b, $2, 8; "
            "and.b32 b, b, 0x80008000; or.b32 a, a, b; mul.rn.bf16x2 $0, a, $3; "
            "shr.u32 a, $2, 4; and.b32 a, a, 0x07F007F0; and.b32 b, $2, 0x80008000; "
            "or.b32 a, a, b; mul.rn.bf16x2 $1, a, $3; }")
    even, odd = _asm([T.i32(), T.i32()], [word, scale2], text, "=r,=r,r,r")
    return Int32(even), Int32(odd)


def round_bf16(v: Float32) -> Float32:
    """v rounded to bf16 (rn), back in fp32: the reference's intermediate bf16 roundings."""
    return Float32(_asm([T.f32()], [Float32(v)],
                        "{ .reg .b16 h; cvt.rn.bf16.f32 h, $1; cvt.f32.bf16 $0, h; }",
                        "=f,f")[0])


def prmt(a: Int32, b: Int32, selector: int) -> Int32:
    return Int32(_asm([T.i32()], [a, b], f"prmt.b32 $0, $1, $2, {selector:#x};", "=r,r,r")[0])


# ---- kernel ------------------------------------------------------------------------------------

class DenseW8A16Sm90:
    """Kernel object for one DenseSpec (config-only __init__, jit launcher, kernel)."""

    def __init__(self, spec: DenseSpec):
        self.spec = spec
        self.n, self.k, self.groups = spec.n, spec.k, spec.groups
        self.row_tiles, self.split_k = spec.row_tiles, spec.split_k
        self.chunks = -(-spec.k // CHUNK_K)
        self.tiles_per_group = spec.n // TILE_N
        # "swiglu": rows g / g+8 of a tile are a gate / up pair (dense_ref.interleave_gate_up);
        # their scale blocks are gate row n0/64 and up row N/64 + n0/64 of the checkpoint's.
        self.swiglu = spec.epilogue == "swiglu"
        self.halves = 2 if self.swiglu else 1
        self.up_scale_off = (spec.n // 2 // FP8_BLOCK) * (spec.k // FP8_BLOCK)

    @cute.jit
    def __call__(self, x: cute.Pointer, weight: cute.Pointer, scales: cute.Pointer,
                 residual: cute.Pointer, out: cute.Pointer, workspace: cute.Pointer,
                 counters: cute.Pointer, rows: Int32, stream: cuda.CUstream):
        self.kernel(x, weight, scales, residual, out, workspace, counters, rows).launch(
            grid=[self.spec.tiles * self.split_k, 1, 1], block=list(self.spec.block),
            stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, x: cute.Pointer, weight: cute.Pointer, scales: cute.Pointer,
               residual: cute.Pointer, out: cute.Pointer, workspace: cute.Pointer,
               counters: cute.Pointer, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp, lane = tidx // WARP, tidx % WARP
        g, t = lane // 4, lane % 4
        tile, slice_idx = bidx // self.split_k, bidx % self.split_k
        grp, n0 = tile // self.tiles_per_group, (tile % self.tiles_per_group) * TILE_N
        c_begin = slice_idx * self.chunks // self.split_k
        c_end = (slice_idx + 1) * self.chunks // self.split_k
        steps = (c_end - c_begin + CTA_WARPS * PREFETCH - 1) // (CTA_WARPS * PREFETCH)

        w_row = weight.toint() + Int64((grp * self.n + n0 + g) * self.k)
        s_row = scales.toint() + Int64((grp * (self.n // FP8_BLOCK) + n0 // FP8_BLOCK)
                                       * (self.k // FP8_BLOCK))
        if cutlass.const_expr(self.swiglu):
            s_row = scales.toint() + Int64(n0 // (2 * FP8_BLOCK) * (self.k // FP8_BLOCK))
        x_base = x.toint() + Int64(grp * self.k * 2)

        wbuf = cute.make_rmem_tensor((WORDS, PREFETCH), Int32)
        sbuf = cute.make_rmem_tensor((self.halves, PREFETCH), Int32)
        acc = cute.make_rmem_tensor((4, self.row_tiles), Float32)
        smem = cutlass.memory.SmemAllocator()
        red = smem.allocate_tensor(Float32, cute.make_layout(
            (WARP, 4, self.row_tiles, CTA_WARPS)), byte_alignment=16)
        flag = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)

        # Prologue before the PDL wait: the first PREFETCH chunks of weights and scales.
        for i in cutlass.range_constexpr(PREFETCH):
            self._load_chunk(wbuf, sbuf, i, w_row, s_row, c_begin + warp + i * CTA_WARPS,
                             c_end, t)
        cute.arch.griddepcontrol_wait()     # x (and residual) come from earlier kernels

        passes = (rows + self.spec.rows_per_pass - 1) // self.spec.rows_per_pass
        p = Int32(0)
        while p < passes:
            if p > 0:
                for i in cutlass.range_constexpr(PREFETCH):
                    self._load_chunk(wbuf, sbuf, i, w_row, s_row,
                                     c_begin + warp + i * CTA_WARPS, c_end, t)
            acc.fill(0.0)
            step = Int32(0)
            while step < steps:
                c0 = c_begin + warp + step * (CTA_WARPS * PREFETCH)
                for i in cutlass.range_constexpr(PREFETCH):
                    c = c0 + i * CTA_WARPS
                    self._mma_chunk(acc, wbuf, sbuf, i, x_base, c, c_end, p, rows, g, t)
                    self._load_chunk(wbuf, sbuf, i, w_row, s_row,
                                     c + CTA_WARPS * PREFETCH, c_end, t)
                step += 1
            self._reduce_and_store(acc, red, flag, tidx, warp, lane, tile, slice_idx, grp, n0,
                                   p, rows, residual, out, workspace, counters)
            p += 1
        # Trigger at the end: an early trigger measured slower here (run of 2026-11-29: split-K
        # and main_proj chains lost 1.4-8 us), as the dependents' prefetch competes with our tail.
        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def _load_chunk(self, wbuf, sbuf, i: cutlass.Constexpr, w_row: Int64, s_row: Int64,
                    c: Int32, c_end: Int32, t: Int32):
        """Weights + scale of chunk c into ring slot i; past c_end: a clamped, zero-scaled load."""
        valid_chunk = c < c_end
        cc = cutlass.min(c, c_end - 1)
        kk = cc * CHUNK_K + 16 * t
        valid = valid_chunk & (kk < self.k)
        kk = cutlass.min(kk, self.k - 16)
        lo = ld_v4_u32(w_row + Int64(kk), streaming=True)
        hi = ld_v4_u32(w_row + Int64(8 * self.k + kk), streaming=True)
        for w in cutlass.range_constexpr(4):
            wbuf[w, i] = lo[w]
            wbuf[4 + w, i] = hi[w]
        sbuf[0, i] = scale_bf16x2(ld_u8(s_row + Int64(kk // FP8_BLOCK)), valid)
        if cutlass.const_expr(self.swiglu):
            sbuf[1, i] = scale_bf16x2(ld_u8(s_row + Int64(self.up_scale_off + kk // FP8_BLOCK)),
                                      valid)

    @cute.jit
    def _mma_chunk(self, acc, wbuf, sbuf, i: cutlass.Constexpr, x_base: Int64, c: Int32,
                   c_end: Int32, p: Int32, rows: Int32, g: Int32, t: Int32):
        """acc[:, rt] += W(chunk in slot i) x x[rows of tile rt, same K] for every row tile."""
        kk = cutlass.min(cutlass.min(c, c_end - 1) * CHUNK_K + 16 * t, self.k - 16)
        a_even = cute.make_rmem_tensor((4, 2), Int32)    # [word j, row g / g+8]
        a_odd = cute.make_rmem_tensor((4, 2), Int32)
        for j in cutlass.range_constexpr(4):
            for h in cutlass.range_constexpr(2):
                e, o = e4m3x4_to_bf16x2x2(wbuf[4 * h + j, i], sbuf[h % self.halves, i])
                a_even[j, h] = e
                a_odd[j, h] = o
        for rt in cutlass.range_constexpr(self.row_tiles):
            r = cutlass.min(p * self.spec.rows_per_pass + rt * ROW_TILE + g, rows - 1)
            addr = x_base + Int64((r * self.groups * self.k + kk) * 2)
            xw = ld_v4_u32(addr) + ld_v4_u32(addr + Int64(16))
            for j in cutlass.range_constexpr(4):
                b = (prmt(xw[2 * j], xw[2 * j + 1], 0x5410),
                     prmt(xw[2 * j], xw[2 * j + 1], 0x7632))
                a = (a_even[j, 0], a_even[j, 1], a_odd[j, 0], a_odd[j, 1])
                d = mma_bf16_16816_ordered(a, b, [acc[q, rt] for q in range(4)])
                for q in cutlass.range_constexpr(4):
                    acc[q, rt] = d[q]

    @cute.jit
    def _reduce_and_store(self, acc, red, flag, tidx: Int32, warp: Int32, lane: Int32,
                          tile: Int32, slice_idx: Int32, grp: Int32, n0: Int32, p: Int32,
                          rows: Int32, residual: cute.Pointer, out: cute.Pointer,
                          workspace: cute.Pointer, counters: cute.Pointer):
        """Warp partials -> CTA sum (warp order) -> [K-slice sum (slice order)] -> epilogue."""
        for rt in cutlass.range_constexpr(self.row_tiles):
            for q in cutlass.range_constexpr(4):
                red[lane, q, rt, warp] = acc[q, rt]
        cute.arch.sync_threads()
        q, ln = tidx // WARP, tidx % WARP            # this thread's accumulator (q, lane ln)
        # [rt, 0]: accumulator q; [rt, 1] ("swiglu", q < 2): accumulator q + 2, its up row
        totals = cute.make_rmem_tensor((self.row_tiles, self.halves), Float32)
        for rt in cutlass.range_constexpr(self.row_tiles):
            for h in cutlass.range_constexpr(self.halves):
                qh = (q + 2 * h) % 4
                total = red[ln, qh, rt, 0]
                for w in cutlass.range_constexpr(1, CTA_WARPS):
                    total = total + red[ln, qh, rt, w]
                totals[rt, h] = total
        cute.arch.sync_threads()                      # red is rewritten by the next pass
        if cutlass.const_expr(self.split_k == 1):
            self._epilogue(totals, q, ln, grp, n0, p, rows, residual, out)
        else:
            per_tile = TILE_N * self.spec.rows_per_pass
            base = ((p * self.split_k + slice_idx) * self.spec.tiles + tile) * per_tile
            ws = workspace.toint()
            for rt in cutlass.range_constexpr(self.row_tiles):
                st_f32(ws + Int64((base + rt * 128 + tidx) * 4), totals[rt, 0])
            cute.arch.fence_acq_rel_gpu()
            cute.arch.sync_threads()
            counter = counters + (p * self.spec.tiles + tile)
            if tidx == 0:
                old = cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu")
                flag[0] = Int32(old == self.split_k - 1)
            cute.arch.sync_threads()
            if flag[0] != 0:
                cute.arch.fence_acq_rel_gpu()
                for rt in cutlass.range_constexpr(self.row_tiles):
                    first = (p * self.split_k * self.spec.tiles + tile) * per_tile + rt * 128
                    for h in cutlass.range_constexpr(self.halves):
                        slot = first + (tidx + 64 * h) % 128
                        total = ld_f32_gpu(ws + Int64(slot * 4))
                        for s in cutlass.range_constexpr(1, self.split_k):
                            step = s * self.spec.tiles * per_tile
                            total = total + ld_f32_gpu(ws + Int64((slot + step) * 4))
                        totals[rt, h] = total
                self._epilogue(totals, q, ln, grp, n0, p, rows, residual, out)
                if tidx == 0:
                    cute.arch.store(counter.llvm_ptr, Int32(0), sem="relaxed", scope="gpu")
            cute.arch.sync_threads()                  # flag is rewritten by the next pass

    @cute.jit
    def _epilogue(self, totals, q: Int32, ln: Int32, grp: Int32, n0: Int32, p: Int32,
                  rows: Int32, residual: cute.Pointer, out: cute.Pointer):
        """Accumulator (q, lane ln) of row tile rt is y[row, n]; store it with the epilogue
        ("swiglu": threads q < 2 store bf16(SwiGLU(bf16(gate), bf16(up))) of column n0/2 + ln/4)."""
        n = grp * self.n + n0 + ln // 4 + 8 * (q // 2)
        width = self.spec.out_width
        if cutlass.const_expr(self.swiglu):
            n = n0 // 2 + ln // 4
        for rt in cutlass.range_constexpr(self.row_tiles):
            r = p * self.spec.rows_per_pass + rt * ROW_TILE + 2 * (ln % 4) + q % 2
            keep = r < rows
            if cutlass.const_expr(self.swiglu):
                keep = keep & (q < 2)
            if keep:
                idx = Int64(r * width + n)
                y = totals[rt, 0]
                if cutlass.const_expr(self.spec.epilogue == "f32"):
                    st_f32(out.toint() + idx * 4, y)
                elif cutlass.const_expr(self.spec.epilogue == "residual"):
                    res = ld_bf16(residual.toint() + idx * 2)
                    st_bf16(out.toint() + idx * 2, y + res)
                elif cutlass.const_expr(self.spec.epilogue == "add_f32"):
                    routed = ld_f32(residual.toint() + idx * 4)
                    st_bf16(out.toint() + idx * 2, round_bf16(y) + routed)
                elif cutlass.const_expr(self.swiglu):
                    h = swiglu(round_bf16(y), round_bf16(totals[rt, 1]), self.spec.swiglu_limit)
                    st_bf16(out.toint() + idx * 2, h)
                else:
                    st_bf16(out.toint() + idx * 2, y)


def kernel_class(spec: DenseSpec):
    """The kernel object class of a spec's variant (kernels/dense_stream.py: streamed ones)."""
    if spec.unrolled:
        from kernels.dense_tile import DenseTileSm90
        return DenseTileSm90
    if spec.streamed:
        from kernels.dense_stream import DenseStreamSm90
        return DenseStreamSm90
    return DenseW8A16Sm90


def kernel_function(spec: DenseSpec):
    """The @cute.kernel whose Python signature the build checks against spec.params."""
    return kernel_class(spec).kernel


def specs(cfg, tp: int) -> list[DenseSpec]:
    return dense_specs(cfg, tp)


def compile_dense(kernel_object, spec: DenseSpec, options: str):
    """cute.compile a DenseW8A16Sm90-shaped kernel object with pointer / Int32 arguments only."""
    from cutlass.cute.runtime import make_ptr

    def ptr(dtype):
        return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=16)

    out_type = Float32 if spec.out_dtype == "f32" else BFloat16
    return cute.compile(kernel_object, ptr(BFloat16), ptr(Uint8), ptr(Uint8), ptr(BFloat16),
                        ptr(out_type), ptr(Float32), ptr(Int32), Int32(1), cuda.CUstream(0),
                        options=options)


def compile_spec(spec: DenseSpec, options: str = "--gpu-arch sm_90a"):
    return compile_dense(kernel_class(spec)(spec), spec, options)
