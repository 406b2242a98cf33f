"""Engram kernels for SM90 in the CuTe DSL: n-gram hash ids, FP8 table lookup, and the gate.

Specs, byte formulas, references and the gate's error bound: `kernels/engram_kernel_ref.py`.

- Hash (`EngramHashSm90`): one thread per row; the layer's multipliers, primes and offsets are PTX
  immediates, so every `rem.s64` is by a constant. Exact int64: `mul.lo.s64` wraps as NumPy's
  int64 product does, the remainder is made non-negative as NumPy's floored `%` is. The row's
  max_ngram raw tokens are loaded first, then each is replaced by the raw pad id where p - k < 0
  or it lies off the map, then read through the compressed-vocab map (`ld.global.nc`: the map
  is a weight, never written in the step): two dependent load latencies, not max_ngram.
- Lookup (`EngramLookupSm90`): one thread per 16 FP8 codes of one (row, column): one 16-byte load
  of codes, one scale byte, two 16-byte BF16 stores. E4M3 -> BF16 is exact bit placement (byte
  s.eeee.mmm -> bf16 s.0000eeee.mmm0000 = the value x 2^-120, subnormals included), then one
  bf16x2 multiply by 2^(scale-7) rounds the exact product once, as the reference does. The table
  pointers may be device memory or pinned host memory (UVA): nothing else differs.
- Gate (`EngramGateSm90`): one CTA per row (grid-stride), the norm family's row geometry
  (D = 5120: 128 threads x 5 vectors). Pass 1 accumulates, per stream, Σx², Σk² and Σ(x·q_w)(k·k_w)
  in fp32 (thread order, warp butterfly, warps in order through shared memory); every thread then
  forms the 4 gates; pass 2 re-reads X (an L1/L2 hit) and v and stores bf16(X + g·v). A thread
  reads and writes only its own elements, so out may alias streams.

Inline PTX helpers are local to this module (a shared `kernels/ptx.py` did not exist yet).

PTX ABIs: hash (u64 tokens, u64 positions, u64 vocab_map, u64 ids, u32 rows); lookup (u64 ids,
u64 codes, u64 scales, u64 out, u32 rows, u32 first_col, u32 row_offset, u32 table_rows), codes
and out 16-byte aligned; gate (u64 streams, u64 keys_and_value, u64 q_weight, u64 k_weight, u64 out,
u32 rows, f32 eps), all 16-byte aligned, eps > 0.
"""
from __future__ import annotations

import math

import cutlass
from cuda.bindings import driver as cuda
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T

from kernels.common_ref import BF16_PER_VECTOR
from kernels.engram_kernel_ref import (
    CODES_PER_THREAD,
    GATE_SUMS,
    HASH_THREADS,
    LOOKUP_THREADS,
    SQRT_CLAMP,
    EngramGateSpec,
    EngramHashSpec,
    EngramLookupSpec,
    engram_specs,
)
from kernels.norm_ref import WARP

VEC = BF16_PER_VECTOR
BF16_NAN_PAIR = 0x7FC07FC0


# ---- PTX helpers -------------------------------------------------------------------------------

def _asm(result_types, operands, text: str, constraints: str):
    struct = llvm.StructType.get_literal(result_types)
    res = llvm.inline_asm(struct, [op.ir_value() for op in operands], text, constraints,
                          has_side_effects=True)
    return [llvm.extractvalue(ty, res, [i]) for i, ty in enumerate(result_types)]


def _ld_s32(addr: Int64) -> Int32:
    return Int32(_asm([T.i32()], [addr], "ld.global.s32 $0, [$1];", "=r,l")[0])


def _ld_s64(addr: Int64) -> Int64:
    return Int64(_asm([T.i64()], [addr], "ld.global.s64 $0, [$1];", "=l,l")[0])


# Table reads: plain ld.global (not .nc), so nothing depends on the read-only path also serving
# mapped host memory; L1::no_allocate as each table row is read once.

def _ld_u8(addr: Int64) -> Int32:
    return Int32(_asm([T.i32()], [addr], "ld.global.L1::no_allocate.u8 $0, [$1];", "=r,l")[0])


def _ld_v4(addr: Int64):
    """16-byte load that does not allocate in L1."""
    words = _asm([T.i32()] * 4, [addr], "ld.global.L1::no_allocate.v4.u32 "
                 "{$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l")
    return [Int32(w) for w in words]


def _st_v4(addr: Int64, words) -> None:
    llvm.inline_asm(None, [addr.ir_value()] + [w.ir_value() for w in words],
                    "st.global.v4.u32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r",
                    has_side_effects=True)


def _st_s64(addr: Int64, value: Int64) -> None:
    llvm.inline_asm(None, [addr.ir_value(), value.ir_value()], "st.global.s64 [$0], $1;", "l,l",
                    has_side_effects=True)


def _history_token(token: Int32, position: Int32, back: int, pad_id: int) -> Int32:
    """The token at position p - back, or the pad id when p - back < 0."""
    text = (f"{{ .reg .pred p; setp.lt.s32 p, $2, {back}; "
            f"selp.b32 $0, {pad_id}, $1, p; }}")
    return Int32(_asm([T.i32()], [token, position], text, "=r,r,r")[0])


def _mapped_token(vocab_map: Int64, token: Int32, position: Int32, back: int, pad_id: int,
                  vocab: int) -> Int32:
    """map[t] with t = the raw pad id when p - back < 0 or the token is off [0, vocab), else the
    token (the pad goes in before the map: the compressed pad is map[pad_id])."""
    text = (f"{{ .reg .pred p, q; .reg .b32 t; .reg .b64 a; setp.lt.s32 p, $2, {back}; "
            f"setp.ge.u32 q, $1, {vocab}; or.pred p, p, q; selp.b32 t, {pad_id}, $1, p; "
            f"mul.wide.u32 a, t, 4; add.s64 a, a, $3; ld.global.nc.s32 $0, [a]; }}")
    return Int32(_asm([T.i32()], [token, position, vocab_map], text, "=r,r,r,l")[0])


def _mix_in(mix: Int64, token: Int32, multiplier: int, first: bool) -> Int64:
    """mix ^ (int64(token) * multiplier), the product wrapping mod 2^64 (NumPy int64)."""
    text = (f"{{ .reg .s64 t; cvt.s64.s32 t, $1; mul.lo.s64 t, t, {multiplier}; "
            + ("mov.b64 $0, t; }" if first else "xor.b64 $0, $2, t; }"))
    return Int64(_asm([T.i64()], [token, mix], text, "=l,r,l")[0])


def _bucket(mix: Int64, prime: int, offset: int) -> Int64:
    """mix mod prime, floored (in [0, prime) as NumPy's %), plus the column's first row."""
    text = (f"{{ .reg .s64 r; .reg .pred p; rem.s64 r, $1, {prime}; setp.lt.s64 p, r, 0; "
            f"@p add.s64 r, r, {prime}; add.s64 $0, r, {offset}; }}")
    return Int64(_asm([T.i64()], [mix], text, "=l,l")[0])


def _local_row(row_id: Int64, row_offset: Int32, table_rows: Int32):
    """(row_id - row_offset, 1 if that is in [0, table_rows) else 0); both offsets unsigned."""
    text = ("{ .reg .s64 o, n; .reg .pred p; cvt.u64.u32 o, $2; cvt.u64.u32 n, $3; "
            "sub.s64 $0, $4, o; setp.lt.u64 p, $0, n; selp.u32 $1, 1, 0, p; }")
    local, valid = _asm([T.i64(), T.i32()], [row_offset, table_rows, row_id], text,
                        "=l,=r,r,r,l")
    return Int64(local), Int32(valid)


def _scale_bf16x2(sbyte: Int32) -> Int32:
    """bf16x2 (2^(s-7), 2^(s-7)) for a UE8M0 byte s <= 134."""
    text = "{ .reg .b32 e; add.u32 e, $1, 120; shl.b32 e, e, 7; mul.lo.u32 $0, e, 65537; }"
    return Int32(_asm([T.i32()], [sbyte], text, "=r,r")[0])


def _e4m3x4_to_bf16x2x2(word: Int32, scale2: Int32):
    """4 e4m3 bytes b0..b3 -> (bf16x2(b0, b1), bf16x2(b2, b3)), each times the bf16x2 scale."""
    def pair(selector: str, out: str) -> str:
        return (f"prmt.b32 t, $2, 0, {selector}; shl.b32 a, t, 4; and.b32 a, a, 0x07F007F0; "
                f"shl.b32 b, t, 8; and.b32 b, b, 0x80008000; or.b32 a, a, b; "
                f"mul.rn.bf16x2 {out}, a, $3; ")
    text = "{ .reg .b32 t, a, b; " + pair("0x4140", "$0") + pair("0x4342", "$1") + "}"
    lo, hi = _asm([T.i32(), T.i32()], [word, scale2], text, "=r,=r,r,r")
    return Int32(lo), Int32(hi)


# ---- hash ids ----------------------------------------------------------------------------------

class EngramHashSm90:
    """Kernel object for one EngramHashSpec (one Engram layer's constants)."""

    def __init__(self, spec: EngramHashSpec):
        self.spec = spec

    @cute.jit
    def __call__(self, tokens: cute.Pointer, positions: cute.Pointer, vocab_map: cute.Pointer,
                 ids: cute.Pointer, rows: Int32, stream: cuda.CUstream):
        self.kernel(tokens, positions, vocab_map, ids, rows).launch(
            grid=[1, 1, 1], block=list(self.spec.block), stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, tokens: cute.Pointer, positions: cute.Pointer, vocab_map: cute.Pointer,
               ids: cute.Pointer, rows: Int32):
        spec = self.spec
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        row = bidx * HASH_THREADS + tidx

        cute.arch.griddepcontrol_wait()     # the tokens may be the previous step's argmax

        if row < rows:
            position = _ld_s32(positions.toint() + Int64(row) * 4)
            tok_row = tokens.toint() + Int64(row) * (4 * spec.max_ngram)
            out_row = ids.toint() + Int64(row) * (8 * spec.cols)
            raw = []                        # every token load in flight before the first use
            for back in cutlass.range_constexpr(spec.max_ngram):
                raw.append(_ld_s32(tok_row + back * 4))
            history = []
            for back in cutlass.range_constexpr(spec.max_ngram):
                if cutlass.const_expr(spec.mapped):
                    history.append(_mapped_token(vocab_map.toint(), raw[back], position, back,
                                                 spec.pad_id, spec.vocab_size))
                else:
                    history.append(_history_token(raw[back], position, back, spec.pad_id))
            mix = Int64(0)
            for back in cutlass.range_constexpr(spec.max_ngram):
                mix = _mix_in(mix, history[back], spec.multipliers[back], back == 0)
                if cutlass.const_expr(back > 0):
                    for head in cutlass.range_constexpr(spec.heads):
                        col = (back - 1) * spec.heads + head
                        _st_s64(out_row + col * 8,
                                _bucket(mix, spec.primes[col], spec.offsets[col]))

        cute.arch.griddepcontrol_launch_dependents()


# ---- table lookup ------------------------------------------------------------------------------

class EngramLookupSm90:
    """Kernel object for one EngramLookupSpec."""

    def __init__(self, spec: EngramLookupSpec):
        self.spec = spec

    @cute.jit
    def __call__(self, ids: cute.Pointer, codes: cute.Pointer, scales: cute.Pointer,
                 out: cute.Pointer, rows: Int32, first_col: Int32, row_offset: Int32,
                 table_rows: Int32, stream: cuda.CUstream):
        self.kernel(ids, codes, scales, out, rows, first_col, row_offset, table_rows).launch(
            grid=[self.spec.max_ctas, 1, 1], block=list(self.spec.block), stream=stream,
            use_pdl=True)

    @cute.kernel
    def kernel(self, ids: cute.Pointer, codes: cute.Pointer, scales: cute.Pointer,
               out: cute.Pointer, rows: Int32, first_col: Int32, row_offset: Int32,
               table_rows: Int32):
        spec = self.spec
        tph, head_dim = spec.threads_per_head, spec.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        total = rows * spec.cols * tph
        i = bidx * LOOKUP_THREADS + tidx

        cute.arch.griddepcontrol_wait()     # the ids are the hash kernel's output

        while i < total:
            slot = i // tph                 # (row, column) pair, row-major
            part = i - slot * tph           # which 16 codes of the head
            row = slot // spec.cols
            col = slot - row * spec.cols
            row_id = _ld_s64(ids.toint() + Int64(row * spec.total_cols + first_col + col) * 8)
            local, valid = _local_row(row_id, row_offset, table_rows)
            dst = out.toint() + Int64(slot * head_dim + part * CODES_PER_THREAD) * 2
            if valid != 0:
                src = codes.toint() + local * head_dim + Int64(part * CODES_PER_THREAD)
                sbyte = _ld_u8(scales.toint() + local * (head_dim // 32) + Int64(part // 2))
                words = _ld_v4(src)
                scale2 = _scale_bf16x2(sbyte)
                pairs = []
                for w in cutlass.range_constexpr(4):
                    lo, hi = _e4m3x4_to_bf16x2x2(words[w], scale2)
                    pairs.append(lo)
                    pairs.append(hi)
                _st_v4(dst, pairs[0:4])
                _st_v4(dst + 16, pairs[4:8])
            else:                           # an id off this rank's rows: NaN, never a wild read
                nan = Int32(BF16_NAN_PAIR)
                _st_v4(dst, [nan, nan, nan, nan])
                _st_v4(dst + 16, [nan, nan, nan, nan])
            i += gdim * LOOKUP_THREADS

        cute.arch.griddepcontrol_launch_dependents()


# ---- gate --------------------------------------------------------------------------------------

class EngramGateSm90:
    """Kernel object for one EngramGateSpec."""

    def __init__(self, spec: EngramGateSpec):
        self.spec = spec
        self.width, self.streams = spec.width, spec.streams
        self.threads, self.vecs = spec.threads_per_row, spec.vecs_per_thread

    @cute.jit
    def __call__(self, streams: cute.Pointer, keys_and_value: cute.Pointer,
                 q_weight: cute.Pointer, k_weight: cute.Pointer, out: cute.Pointer, rows: Int32,
                 eps: Float32, stream: cuda.CUstream):
        self.kernel(streams, keys_and_value, q_weight, k_weight, out, rows, eps).launch(
            grid=[self.spec.max_ctas, 1, 1], block=list(self.spec.block), stream=stream,
            use_pdl=True)

    def _vector(self, base: cute.Pointer, element: Int32) -> cute.Tensor:
        return cute.make_tensor(base + cute.assume(element, divby=VEC), cute.make_layout((VEC,)))

    @cute.jit
    def _load_f32(self, base: cute.Pointer, element: Int32):
        raw = cute.make_rmem_tensor(cute.make_layout((VEC,)), BFloat16)
        cute.autovec_copy(self._vector(base, element), raw)
        return raw.load().to(Float32)

    @cute.kernel
    def kernel(self, streams: cute.Pointer, keys_and_value: cute.Pointer,
               q_weight: cute.Pointer, k_weight: cute.Pointer, out: cute.Pointer, rows: Int32,
               eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        d, n = self.width, self.streams
        partials = None
        if cutlass.const_expr(self.spec.warps > 1):
            smem = cutlass.memory.SmemAllocator()
            partials = smem.allocate_tensor(
                Float32, cute.make_layout((self.spec.warps, n * GATE_SUMS, 2)), byte_alignment=16)

        cute.arch.griddepcontrol_wait()     # X is the mHC post's output, keys/value wkv's

        row = bidx
        parity = Int32(0)
        while row < rows:
            sums = self._row_sums(streams, keys_and_value, q_weight, k_weight, row, tidx)
            sums = self._block_sums(sums, partials, tidx, parity)
            if cutlass.const_expr(self.spec.warps > 1):
                parity = parity ^ 1
            value_row = row * (n + 1) * d + n * d
            for i in cutlass.range_constexpr(n):
                gate = self._gate(sums[GATE_SUMS * i], sums[GATE_SUMS * i + 1],
                                  sums[GATE_SUMS * i + 2], eps)
                for k in cutlass.range_constexpr(self.vecs):
                    col = (k * self.threads + tidx) * VEC
                    x = self._load_f32(streams, (row * n + i) * d + col)
                    v = self._load_f32(keys_and_value, value_row + col)
                    y = cute.make_rmem_tensor(cute.make_layout((VEC,)), BFloat16)
                    y.store((x + gate * v).to(BFloat16))
                    cute.autovec_copy(y, self._vector(out, (row * n + i) * d + col))
            row += gdim

        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def _row_sums(self, streams: cute.Pointer, keys_and_value: cute.Pointer,
                  q_weight: cute.Pointer, k_weight: cute.Pointer, row: Int32, tidx: Int32):
        """This thread's Σx², Σk², Σ(x·q_w)(k·k_w) per stream, vectors in order, fma."""
        d, n = self.width, self.streams
        sums = []
        for i in cutlass.range_constexpr(n):
            sxx, skk, sxk = Float32(0.0), Float32(0.0), Float32(0.0)
            for k in cutlass.range_constexpr(self.vecs):
                col = (k * self.threads + tidx) * VEC
                x = self._load_f32(streams, (row * n + i) * d + col)
                key = self._load_f32(keys_and_value, row * (n + 1) * d + i * d + col)
                xq = x * self._load_f32(q_weight, i * d + col)
                kk = key * self._load_f32(k_weight, i * d + col)
                for j in cutlass.range_constexpr(VEC):
                    sxx = sxx + x[j] * x[j]
                    skk = skk + key[j] * key[j]
                    sxk = sxk + xq[j] * kk[j]
            sums += [sxx, skk, sxk]
        return sums

    @cute.jit
    def _block_sums(self, sums, partials, tidx: Int32, parity: Int32):
        """Every thread gets the row's totals: warp butterfly, then warp totals in warp order."""
        lanes = min(self.threads, WARP)
        totals = [cute.arch.warp_reduction_sum(s, threads_in_group=lanes) for s in sums]
        if cutlass.const_expr(self.spec.warps > 1):
            if tidx % WARP == 0:
                for j in cutlass.range_constexpr(len(sums)):
                    partials[tidx // WARP, j, parity] = totals[j]
            cute.arch.sync_threads()
            for j in cutlass.range_constexpr(len(sums)):
                total = partials[0, j, parity]
                for warp in cutlass.range_constexpr(1, self.spec.warps):
                    total = total + partials[warp, j, parity]
                totals[j] = total
        return totals

    @cute.jit
    def _gate(self, sxx: Float32, skk: Float32, sxk: Float32, eps: Float32) -> Float32:
        """σ(sign(d)·√max(|d|, 1e-6)) with d = rstd_x·rstd_k·Σ(x·q_w)(k·k_w)/√D; d = 0 -> 0.5."""
        width = Float32(self.width)
        rx = Float32(1.0) / cute.math.sqrt(sxx / width + eps)
        rk = Float32(1.0) / cute.math.sqrt(skk / width + eps)
        dot = sxk * rx * rk / Float32(math.sqrt(self.width))
        root = cute.math.sqrt(cutlass.max(cute.math.absf(dot), Float32(SQRT_CLAMP)))
        signed = Float32(0.0)
        if dot > Float32(0.0):
            signed = root
        if dot < Float32(0.0):
            signed = -root
        return Float32(1.0) / (Float32(1.0) + cute.math.exp(-signed))


# ---- build entry points ------------------------------------------------------------------------

_KERNELS = {EngramHashSpec: EngramHashSm90, EngramLookupSpec: EngramLookupSm90,
            EngramGateSpec: EngramGateSm90}


def kernel_function(spec):
    """The @cute.kernel whose Python signature the build checks against spec.params."""
    return _KERNELS[type(spec)].kernel


def specs(cfg, tp: int) -> list:
    return engram_specs(cfg, tp)


def compile_spec(spec, options: str = "--gpu-arch sm_90a"):
    """cute.compile one Engram kernel with pointer / Int32 / Float32 arguments only."""
    from cutlass.cute.runtime import make_ptr

    def ptr(dtype, align=16):
        return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=align)

    kernel = _KERNELS[type(spec)](spec)
    stream = cuda.CUstream(0)
    if isinstance(spec, EngramHashSpec):
        return cute.compile(kernel, ptr(Int32, 4), ptr(Int32, 4), ptr(Int32, 4), ptr(Int64, 8),
                            Int32(1), stream, options=options)
    if isinstance(spec, EngramLookupSpec):
        return cute.compile(kernel, ptr(Int64, 8), ptr(Uint8), ptr(Uint8, 1), ptr(BFloat16),
                            Int32(1), Int32(0), Int32(0), Int32(1), stream, options=options)
    return cute.compile(kernel, ptr(BFloat16), ptr(BFloat16), ptr(BFloat16), ptr(BFloat16),
                        ptr(BFloat16), Int32(1), Float32(1e-6), stream, options=options)
