"""BF16 lm_head for SM90 in the CuTe DSL: mma.sync GEMV, split-vocab argmax or fp32 logits.

Spec, ABI, reference and the argmax ordering rules: `kernels/lm_head_ref.py`.

How: warp w of the grid owns vocab tiles w, w + W, ... (W = every warp of the grid, three CTAs per
SM); for each it streams the tile's 16 x D bf16 weights as the A operand of mma.sync.m16n8k16,
PREFETCH chunks of 32 hidden values in flight per thread, and the ring runs straight on into the
next tile, so the stream never drains between tiles. The mma's logical K is a permutation of the
actual hidden index (the same for weights and x): thread t's 16-byte load holds actual offsets
8t..8t+7; mma step j uses its words 2j (logical 2t, 2t+1) and 2j+1 (logical 2t+8, 2t+9), and the
matching x words are read from the same offsets, so no shuffle is needed. The whole hidden
dimension of a tile is summed by one warp in chunk order: equal weight rows give equal logits.

Argmax: per tile, each thread turns its 4 logits into 64-bit keys (ordered value << 32 | ~index),
a butterfly max over the 8 lanes of a row gives the tile's best, a running max keeps the warp's
best; the CTA combines its warps in shared memory and issues one `red.max.u64` per row; the last
CTA to arrive (acq_rel counter per pass) decodes the keys into (value, index + vocab_offset) and
resets keys and counter to zero. Weights are loaded before `griddepcontrol.wait`, x after it.

PTX ABI: (u64 x, u64 weight, u64 out, u64 keys, u64 counters, u32 rows, u32 vocab_offset).
"""
from __future__ import annotations

from functools import partial

import cutlass
from cuda.bindings import driver as cuda
from cutlass import BFloat16, Float32, Int32, Int64, cute
from cutlass.cutlass_dsl import T

from kernels.lm_head_ref import (
    CHUNK_K,
    CTA_WARPS,
    ROW_TILE,
    TILE_N,
    WARP,
    LmHeadSpec,
    lm_head_specs,
)
from kernels.ptx import asm, ld_v4_u32, mma_bf16_16816_ordered, st_f32, st_v2_b32, void

WORDS = 8                        # u32 words of weight per thread per chunk (2 rows x 16 bytes)

# Side effects on every asm, as the dense family this kernel grew from.
_asm = partial(asm, side_effects=True)


def argmax_key(value: Float32, index: Int32) -> Int64:
    """(ordered(value) << 32) | ~index, with -0 made +0: u64 max = max value, then lowest index."""
    text = ("{ .reg .f32 f; .reg .b32 u, m, lo; add.rn.f32 f, $1, 0f00000000; mov.b32 u, f; "
            "shr.s32 m, u, 31; or.b32 m, m, 0x80000000; xor.b32 u, u, m; not.b32 lo, $2; "
            "mov.b64 $0, {lo, u}; }")
    return Int64(_asm(1, [value, index], text, "=l,f,r", kind=T.i64()))


def key_max_bfly(key: Int64, offset: int) -> Int64:
    """max(key, key of lane ^ offset) as unsigned 64-bit."""
    text = ("{ .reg .b32 lo, hi; .reg .b64 o; mov.b64 {lo, hi}, $1; "
            f"shfl.sync.bfly.b32 lo, lo, {offset}, 0x1f, 0xffffffff; "
            f"shfl.sync.bfly.b32 hi, hi, {offset}, 0x1f, 0xffffffff; "
            "mov.b64 o, {lo, hi}; max.u64 $0, $1, o; }")
    return Int64(_asm(1, [key], text, "=l,l", kind=T.i64()))


def key_max(a: Int64, b: Int64) -> Int64:
    return Int64(_asm(1, [a, b], "max.u64 $0, $1, $2;", "=l,l,l", kind=T.i64()))


def decode_key(key: Int64, vocab_offset: Int32):
    """key -> (f32 bits of the value, ~lo + vocab_offset) as two Int32."""
    text = ("{ .reg .b32 lo, hi, m; .reg .pred neg; mov.b64 {lo, hi}, $2; "
            "setp.lt.s32 neg, hi, 0; xor.b32 m, hi, 0x80000000; not.b32 hi, hi; "
            "selp.b32 $0, m, hi, neg; not.b32 lo, lo; add.u32 $1, lo, $3; }")
    bits, index = _asm(2, [key, vocab_offset], text, "=r,=r,l,r")
    return Int32(bits), Int32(index)


def red_max_u64(addr: Int64, key: Int64) -> None:
    void([addr, key], "red.relaxed.gpu.global.max.u64 [$0], $1;", "l,l")


def ld_u64_gpu(addr: Int64) -> Int64:
    return Int64(_asm(1, [addr], "ld.relaxed.gpu.global.u64 $0, [$1];", "=l,l",
                      kind=T.i64()))


def st_u64(addr: Int64, value: Int64) -> None:
    void([addr, value], "st.relaxed.gpu.global.u64 [$0], $1;", "l,l")


class LmHeadSm90:
    """Kernel object for one LmHeadSpec."""

    def __init__(self, spec: LmHeadSpec):
        self.spec = spec
        self.chunks = spec.hidden // CHUNK_K
        # 4 chunks (32 registers, 128 B per thread) in flight; 8 made ptxas spill the argmax.
        self.prefetch = 4
        if self.chunks % self.prefetch:
            raise ValueError(f"{spec.name}: hidden {spec.hidden} is not a multiple of "
                             f"{CHUNK_K * self.prefetch}")
        self.total_warps = spec.num_ctas * CTA_WARPS
        self.row_bytes = spec.hidden * 2

    @cute.jit
    def __call__(self, x: cute.Pointer, weight: cute.Pointer, out: cute.Pointer,
                 keys: cute.Pointer, counters: cute.Pointer, rows: Int32, vocab_offset: Int32,
                 stream: cuda.CUstream):
        self.kernel(x, weight, out, keys, counters, rows, vocab_offset).launch(
            grid=[self.spec.num_ctas, 1, 1], block=list(self.spec.block), stream=stream,
            use_pdl=True)

    @cute.kernel
    def kernel(self, x: cute.Pointer, weight: cute.Pointer, out: cute.Pointer,
               keys: cute.Pointer, counters: cute.Pointer, rows: Int32, vocab_offset: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp, lane = tidx // WARP, tidx % WARP
        g, t = lane // 4, lane % 4
        first_tile = bidx * CTA_WARPS + warp
        wbuf = cute.make_rmem_tensor((WORDS, self.prefetch), Int32)
        acc = cute.make_rmem_tensor((4, self.spec.row_tiles), Float32)
        best = cute.make_rmem_tensor((2, self.spec.row_tiles), Int64)
        smem = cutlass.memory.SmemAllocator()
        cta_best = smem.allocate_tensor(Int64, cute.make_layout(
            (self.spec.rows_per_pass, CTA_WARPS)), byte_alignment=16)
        flag = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)
        w_base = weight.toint() + Int64(g * self.row_bytes + 16 * t)

        for i in cutlass.range_constexpr(self.prefetch):      # before the PDL wait
            self._load_chunk(wbuf, i, w_base, first_tile, i)
        cute.arch.griddepcontrol_wait()                        # x is the final norm's output

        passes = (rows + self.spec.rows_per_pass - 1) // self.spec.rows_per_pass
        p = Int32(0)
        while p < passes:
            if p > 0:
                for i in cutlass.range_constexpr(self.prefetch):
                    self._load_chunk(wbuf, i, w_base, first_tile, i)
            best.fill(0)
            tile = first_tile
            while tile < self.spec.tiles:
                acc.fill(0.0)
                for step in cutlass.range(self.chunks // self.prefetch, unroll=1):
                    for i in cutlass.range_constexpr(self.prefetch):
                        c = step * self.prefetch + i
                        self._mma_chunk(acc, wbuf, i, x, c, p, rows, g, t)
                        nxt = c + self.prefetch
                        wrap = nxt >= self.chunks
                        self._load_chunk(wbuf, i, w_base,
                                         tile + Int32(wrap) * self.total_warps,
                                         nxt - Int32(wrap) * self.chunks)
                self._tile_epilogue(acc, best, out, tile, p, rows, g, t)
                tile += self.total_warps
            if cutlass.const_expr(self.spec.mode == "argmax"):
                self._publish(best, cta_best, flag, keys, counters, out, tidx, warp, lane, p,
                              rows, vocab_offset)
            p += 1
        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def _load_chunk(self, wbuf, i: cutlass.Constexpr, w_base: Int64, tile: Int32, c: Int32):
        """Chunk c of vocab tile `tile` (clamped to the last tile: harmless extra reads)."""
        tt = cutlass.min(tile, self.spec.tiles - 1)
        addr = w_base + Int64(tt * TILE_N) * self.row_bytes + Int64(c * CHUNK_K * 2)
        lo = ld_v4_u32(addr, streaming=True)
        hi = ld_v4_u32(addr + Int64(8 * self.row_bytes), streaming=True)
        for w in cutlass.range_constexpr(4):
            wbuf[w, i] = lo[w]
            wbuf[4 + w, i] = hi[w]

    @cute.jit
    def _mma_chunk(self, acc, wbuf, i: cutlass.Constexpr, x: cute.Pointer, c: Int32, p: Int32,
                   rows: Int32, g: Int32, t: Int32):
        for rt in cutlass.range_constexpr(self.spec.row_tiles):
            r = cutlass.min(p * self.spec.rows_per_pass + rt * ROW_TILE + g, rows - 1)
            xw = ld_v4_u32(x.toint() + Int64(r * self.row_bytes + c * CHUNK_K * 2 + 16 * t))
            for j in cutlass.range_constexpr(2):
                a = (wbuf[2 * j, i], wbuf[4 + 2 * j, i], wbuf[2 * j + 1, i],
                     wbuf[4 + 2 * j + 1, i])
                d = mma_bf16_16816_ordered(a, (xw[2 * j], xw[2 * j + 1]),
                                           [acc[q, rt] for q in range(4)])
                for q in cutlass.range_constexpr(4):
                    acc[q, rt] = d[q]

    @cute.jit
    def _tile_epilogue(self, acc, best, out: cute.Pointer, tile: Int32, p: Int32, rows: Int32,
                       g: Int32, t: Int32):
        """logits: store the tile; argmax: fold the tile's best per row into `best`."""
        n0 = tile * TILE_N
        for rt in cutlass.range_constexpr(self.spec.row_tiles):
            r0 = p * self.spec.rows_per_pass + rt * ROW_TILE + 2 * t
            if cutlass.const_expr(self.spec.mode == "logits"):
                for q in cutlass.range_constexpr(4):
                    r = r0 + q % 2
                    if r < rows:
                        n = n0 + g + 8 * (q // 2)
                        st_f32(out.toint() + Int64(r * self.spec.vocab + n) * 4, acc[q, rt])
            else:
                for e in cutlass.range_constexpr(2):       # row r0 + e: vocab g and g + 8
                    key = key_max(argmax_key(acc[e, rt], n0 + g),
                                  argmax_key(acc[2 + e, rt], n0 + g + 8))
                    for off in (4, 8, 16):
                        key = key_max_bfly(key, off)
                    best[e, rt] = key_max(best[e, rt], key)

    @cute.jit
    def _publish(self, best, cta_best, flag, keys: cute.Pointer, counters: cute.Pointer,
                 out: cute.Pointer, tidx: Int32, warp: Int32, lane: Int32, p: Int32,
                 rows: Int32, vocab_offset: Int32):
        """CTA max per row -> red.max on the row key; the last CTA decodes and resets."""
        if lane < 4:
            for rt in cutlass.range_constexpr(self.spec.row_tiles):
                for e in cutlass.range_constexpr(2):
                    cta_best[rt * ROW_TILE + 2 * lane + e, warp] = best[e, rt]
        cute.arch.sync_threads()
        r = p * self.spec.rows_per_pass + tidx
        if (tidx < self.spec.rows_per_pass) & (r < rows):
            key = cta_best[tidx, 0]
            for w in cutlass.range_constexpr(1, CTA_WARPS):
                key = key_max(key, cta_best[tidx, w])
            red_max_u64(keys.toint() + Int64(r) * 8, key)
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()
        counter = counters + p
        if tidx == 0:
            old = cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu")
            flag[0] = Int32(old == self.spec.num_ctas - 1)
        cute.arch.sync_threads()
        if flag[0] != 0:
            cute.arch.fence_acq_rel_gpu()
            if (tidx < self.spec.rows_per_pass) & (r < rows):
                key_addr = keys.toint() + Int64(r) * 8
                bits, index = decode_key(ld_u64_gpu(key_addr), vocab_offset)
                st_v2_b32(out.toint() + Int64(r) * 8, bits, index)
                st_u64(key_addr, Int64(0))
            if tidx == 0:
                cute.arch.store(counter.llvm_ptr, Int32(0), sem="relaxed", scope="gpu")
        cute.arch.sync_threads()                  # smem is rewritten by the next pass


def kernel_class(spec: LmHeadSpec):
    """The kernel object class of a spec's variant (kernels/lm_head_stream.py for "stream")."""
    if spec.variant == "stream":
        from kernels.lm_head_stream import LmHeadStreamSm90
        return LmHeadStreamSm90
    return LmHeadSm90


def kernel_function(spec: LmHeadSpec):
    """The @cute.kernel whose Python signature the build checks against spec.params."""
    return kernel_class(spec).kernel


def specs(cfg, tp: int) -> list[LmHeadSpec]:
    return lm_head_specs(cfg, tp)


def compile_spec(spec: LmHeadSpec, options: str = "--gpu-arch sm_90a"):
    from cutlass.cute.runtime import make_ptr

    def ptr(dtype):
        return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=16)

    out_type = Float32 if spec.mode == "logits" else Int32
    return cute.compile(kernel_class(spec)(spec), ptr(BFloat16), ptr(BFloat16), ptr(out_type),
                        ptr(Int64), ptr(Int32), Int32(1), Int32(0), cuda.CUstream(0),
                        options=options)
