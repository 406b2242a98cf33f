"""Inline PTX helpers of the indexer family (arithmetic, loads, E2M1/E4M3 packing, radix keys).

Used by the indexer kernels (`kernels/indexer.py`, `kernels/indexer_topk.py`,
`kernels/indexer_topk_cluster.py`) and reused by `compressor`, `kv_publish` and `linear_bf16`.
"""
from __future__ import annotations

from functools import partial

from cutlass import Float32, Int32, Int64, cute
from cutlass.cutlass_dsl import T

from kernels.ptx import asm, stamp_smid, stamp_time, void

# Pure by default (this family's arithmetic); its loads opt in with side_effects=True.
_asm = partial(asm, side_effects=False)


def ld_v2(addr: Int64):
    v = _asm(2, [Int64(addr)], "ld.global.v2.u32 {$0, $1}, [$2];", "=r,=r,l", side_effects=True)
    return Int32(v[0]), Int32(v[1])


def ld_v2_f32(addr: Int64):
    v = _asm(2, [Int64(addr)], "ld.global.v2.f32 {$0, $1}, [$2];", "=f,=f,l", kind=T.f32(),
             side_effects=True)
    return Float32(v[0]), Float32(v[1])


def atom_add_shared(saddr: Int32, value: Int32):
    void([Int32(saddr), Int32(value)], "red.shared.add.u32 [$0], $1;", "r,r")


def syncwarp():
    void([], "bar.warp.sync 0xffffffff;", "")


def relu_mul(x: Float32, scale: Float32, w: Float32, acc: Float32):
    """acc + max(x * scale, 0) * w."""
    return Float32(_asm(1, [Float32(x), Float32(scale), Float32(w), Float32(acc)],
                        "{ .reg .f32 t; mul.rn.f32 t, $1, $2; max.f32 t, t, 0f00000000;\n"
                        "fma.rn.f32 $0, t, $3, $4; }", "=f,f,f,f,f", kind=T.f32()))


def ordered_key(score: Float32):
    """uint32 key ordered as the float (-0 -> +0), as indexer_kernel_ref.ordered_key."""
    return Int32(_asm(1, [Float32(score)],
                      "{ .reg .f32 z; .reg .b32 b, m; add.rn.f32 z, $1, 0f00000000;\n"
                      "mov.b32 b, z; shr.s32 m, b, 31; or.b32 m, m, 0x80000000;\n"
                      "xor.b32 $0, b, m; }", "=r,f"))


def fmax_f32(a: Float32, b: Float32):
    return Float32(_asm(1, [Float32(a), Float32(b)], "max.f32 $0, $1, $2;", "=f,f,f",
                        kind=T.f32()))


def imin(a: Int32, b: Int32):
    return Int32(_asm(1, [Int32(a), Int32(b)], "min.s32 $0, $1, $2;", "=r,r,r"))


def select_flags(key: Int32, threshold: Int32, take_all: Int32, allowed: Int32):
    """(above, tie) of one item: allowed and (take_all or key > T); allowed, not take_all, key == T."""
    v = _asm(2, [Int32(key), Int32(threshold), Int32(take_all), Int32(allowed)],
             "{ .reg .pred gt, eq, all, ok; setp.hi.u32 gt, $2, $3; setp.eq.u32 eq, $2, $3;\n"
             "setp.ne.s32 all, $4, 0; setp.ne.s32 ok, $5, 0;\n"
             "or.pred gt, gt, all; and.pred gt, gt, ok; not.pred all, all;\n"
             "and.pred eq, eq, all; and.pred eq, eq, ok;\n"
             "selp.s32 $0, 1, 0, gt; selp.s32 $1, 1, 0, eq; }", "=r,=r,r,r,r,r")
    return Int32(v[0]), Int32(v[1])


def ushr(a: Int32, shift: int):
    return Int32(_asm(1, [Int32(a)], f"shr.b32 $0, $1, {shift};", "=r,r"))


def fp4_round(y: Float32):
    """y (|y| <= 6) rounded to the nearest E2M1 value, ties to even, sign kept."""
    return Float32(_asm(1, [Float32(y)],
                        "{ .reg .f32 a, s, lo; .reg .b32 b, l, sg; .reg .pred big;\n"
                        "abs.f32 a, $1; setp.ge.f32 big, a, 0f3F800000;\n"
                        "mul.rn.f32 s, a, 0f40000000; cvt.rni.f32.f32 s, s;\n"
                        "mul.rn.f32 lo, s, 0f3F000000;\n"
                        "mov.b32 b, a; shr.u32 l, b, 22; and.b32 l, l, 1;\n"
                        "add.u32 b, b, 0x1FFFFF; add.u32 b, b, l; and.b32 b, b, 0xFFC00000;\n"
                        "mov.b32 l, lo; selp.b32 b, b, l, big;\n"
                        "mov.b32 sg, $1; and.b32 sg, sg, 0x80000000; or.b32 b, b, sg;\n"
                        "mov.b32 $0, b; }", "=f,f", kind=T.f32()))


def pow2_exponent(amax: Float32, mant_limit: int, top: int):
    """a with 2^a the smallest power of two >= max(amax, 1e-4) / max_code, where
    max_code = (1 + mant_limit / 2^23) * 2^top (E2M1: 1.5 * 2^2; E4M3: 1.75 * 2^8)."""
    return Int32(_asm(1, [Float32(amax)],
                      "{ .reg .f32 m; .reg .b32 b, e, f; .reg .pred p;\n"
                      "max.f32 m, $1, 0f38D1B717; mov.b32 b, m;\n"
                      "shr.u32 e, b, 23; and.b32 f, b, 0x7FFFFF;\n"
                      f"setp.gt.u32 p, f, {mant_limit};\n"
                      f"sub.s32 e, e, {127 + top}; @p add.s32 e, e, 1; mov.b32 $0, e; }}",
                      "=r,f"))


def exp2_f32(a: Int32):
    """2^a as float (a in the normal range)."""
    return Float32(_asm(1, [Int32(a)], "{ .reg .b32 b; add.s32 b, $1, 127; shl.b32 b, b, 23;\n"
                        "mov.b32 $0, b; }", "=f,r", kind=T.f32()))


def pack_e4m3(x0: Float32, x1: Float32, x2: Float32, x3: Float32):
    return Int32(_asm(1, [Float32(x0), Float32(x1), Float32(x2), Float32(x3)],
                      "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
                      "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }",
                      "=r,f,f,f,f"))


def _as_i32(value: int) -> int:
    """A 32-bit pattern as a Python int in the signed range (so the DSL keeps it Int32)."""
    return value - (1 << 32) if value >= 1 << 31 else value


def _addr(ptr: cute.Pointer) -> Int64:
    return Int64(ptr.toint())


# ---- timeline stamps (the `_timeline` builds only: ik.TIMELINE_POINTS) ---------------------------

@cute.jit
def _thread0(tidx: Int32) -> Int32:
    writer = Int32(0)
    if tidx == 0:
        writer = Int32(1)
    return writer


def timeline_of(stamps, cta, tidx: Int32, words: int):
    """None in production (stamps None: nothing is emitted); else (the CTA's stamp row, 1 on
    thread 0 else 0), the SM id written at once. words: u64 per stamp row."""
    if stamps is None:
        return None
    row = stamps + Int64(cta) * (words * 8)
    writer = _thread0(tidx)
    stamp_smid(row, writer)
    return row, writer


def mark(tl, points: tuple[str, ...], point: str, when=None):
    """Thread 0 writes (%globaltimer, %clock64) of `point` (where `when` != 0, if given)."""
    if tl is not None:
        row, writer = tl
        pred = writer if when is None else writer & when
        stamp_time(row + 16 * (1 + points.index(point)), pred)     # 16-B aligned (v2.u64)
