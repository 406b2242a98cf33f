"""Inline-PTX helpers of the sparse MQA kernel: global/shared/DSMEM access, cp.async, mma, FP8 dequant.

Each is one PTX instruction (or a few) wrapped for the CuTe DSL; `kernels/sparse_mqa.py` composes
them. Loads and stores keep `has_side_effects` so LLVM does not move them across the barriers.
"""
from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T


def _asm(results: int, operands, text: str, constraints: str, kind=None, side_effects=True):
    ty = kind or T.i32()
    ret = ty if results == 1 else llvm.StructType.get_literal([ty] * results)
    out = llvm.inline_asm(ret, [o.ir_value() for o in operands], text, constraints,
                          has_side_effects=side_effects, is_align_stack=False,
                          asm_dialect=llvm.AsmDialect.AD_ATT)
    if results == 1:
        return out
    return [llvm.extractvalue(ty, out, [i]) for i in range(results)]


def _void(operands, text: str, constraints: str):
    llvm.inline_asm(None, [o.ir_value() for o in operands], text, constraints,
                    has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)


def ldg_s32(addr: Int64) -> Int32:
    return Int32(_asm(1, [Int64(addr)], "ld.global.s32 $0, [$1];", "=r,l"))


def ldg_v4_s32(addr: Int64):
    v = _asm(4, [Int64(addr)], "ld.global.v4.s32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l")
    return [Int32(x) for x in v]


def ldg_f32(addr: Int64) -> Float32:
    return Float32(_asm(1, [Int64(addr)], "ld.global.f32 $0, [$1];", "=f,l", kind=T.f32()))


def ldg_v4_f32(addr: Int64):
    v = _asm(4, [Int64(addr)], "ld.global.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,l",
             kind=T.f32())
    return [Float32(x) for x in v]


def stg_v2(addr: Int64, a: Int32, b: Int32):
    _void([Int64(addr), Int32(a), Int32(b)], "st.global.v2.b32 [$0], {$1, $2};", "l,r,r")


def lds_u8(saddr: Int32) -> Int32:
    return Int32(_asm(1, [Int32(saddr)], "ld.shared.u8 $0, [$1];", "=r,r"))


def lds_u16(saddr: Int32) -> Int32:
    return Int32(_asm(1, [Int32(saddr)], "ld.shared.u16 $0, [$1];", "=r,r"))


def lds_u32(saddr: Int32) -> Int32:
    return Int32(_asm(1, [Int32(saddr)], "ld.shared.u32 $0, [$1];", "=r,r"))


def lds_s64(saddr: Int32) -> Int64:
    return Int64(_asm(1, [Int32(saddr)], "ld.shared.s64 $0, [$1];", "=l,r", kind=T.i64()))


def lds_f32(saddr: Int32) -> Float32:
    return Float32(_asm(1, [Int32(saddr)], "ld.shared.f32 $0, [$1];", "=f,r", kind=T.f32()))


def sts_u32(saddr: Int32, v: Int32):
    _void([Int32(saddr), Int32(v)], "st.shared.u32 [$0], $1;", "r,r")


def sts_v2_u32(saddr: Int32, a: Int32, b: Int32):
    _void([Int32(saddr), Int32(a), Int32(b)], "st.shared.v2.u32 [$0], {$1, $2};", "r,r,r")


def sts_s64(saddr: Int32, v: Int64):
    _void([Int32(saddr), Int64(v)], "st.shared.s64 [$0], $1;", "r,l")


def sts_f32(saddr: Int32, v: Float32):
    _void([Int32(saddr), Float32(v)], "st.shared.f32 [$0], $1;", "r,f")


def sts_v2_f32(saddr: Int32, a: Float32, b: Float32):
    _void([Int32(saddr), Float32(a), Float32(b)], "st.shared.v2.f32 [$0], {$1, $2};", "r,f,f")


def cp_async_8(saddr: Int32, gaddr: Int64):
    _void([Int32(saddr), Int64(gaddr)], "cp.async.ca.shared.global [$0], [$1], 8;", "r,l")


def cp_async_4(saddr: Int32, gaddr: Int64):
    _void([Int32(saddr), Int64(gaddr)], "cp.async.ca.shared.global [$0], [$1], 4;", "r,l")


def cp_async_16(saddr: Int32, gaddr: Int64):
    _void([Int32(saddr), Int64(gaddr)], "cp.async.cg.shared.global [$0], [$1], 16;", "r,l")


def cp_async_wait_all():
    _void([], "cp.async.commit_group;\n\tcp.async.wait_group 0;", "")


def cluster_sync():
    """All threads of every CTA of the cluster; release/acquire orders shared-memory writes."""
    _void([], "barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;", "")


def cluster_nctarank() -> Int32:
    return Int32(_asm(1, [], "mov.u32 $0, %cluster_nctarank;", "=r"))


def ld_cluster_f32(saddr: Int32, rank: int) -> Float32:
    """f32 at the same shared offset in CTA `rank` of the cluster (DSMEM)."""
    return Float32(_asm(1, [Int32(saddr)],
                        "{ .reg .b32 a; mapa.shared::cluster.u32 a, $1, " + str(rank) + ";\n"
                        "ld.shared::cluster.f32 $0, [a]; }", "=f,r", kind=T.f32()))


def ld_cluster_v4_f32(saddr: Int32, rank: int):
    v = _asm(4, [Int32(saddr)],
             "{ .reg .b32 a; mapa.shared::cluster.u32 a, $4, " + str(rank) + ";\n"
             "ld.shared::cluster.v4.f32 {$0, $1, $2, $3}, [a]; }", "=f,=f,=f,=f,r",
             kind=T.f32())
    return [Float32(x) for x in v]


def e4m3x2_to_bf16x2(pair: Int32, scale_lo: Float32, scale_hi: Float32) -> Int32:
    """Two e4m3 (low byte = lower k) times their power-of-two scales -> bf16x2 (exact)."""
    text = ("{ .reg .b16 p, h0, h1; .reg .b32 hh; .reg .f32 f0, f1;\n"
            "cvt.u16.u32 p, $1;\n cvt.rn.f16x2.e4m3x2 hh, p;\n mov.b32 {h0, h1}, hh;\n"
            "cvt.f32.f16 f0, h0;\n cvt.f32.f16 f1, h1;\n"
            "mul.rn.f32 f0, f0, $2;\n mul.rn.f32 f1, f1, $3;\n cvt.rn.bf16x2.f32 $0, f1, f0; }")
    return Int32(_asm(1, [Int32(pair), Float32(scale_lo), Float32(scale_hi)], text, "=r,r,f,f",
                      side_effects=False))


def ue8m0_to_f32(byte: Int32) -> Float32:
    """2^(byte - 127) as fp32 bits byte << 23 (0 -> 0.0: zero-filled records stay zero)."""
    return Float32(_asm(1, [Int32(byte)], "{ .reg .b32 b; shl.b32 b, $1, 23; mov.b32 $0, b; }",
                        "=f,r", kind=T.f32(), side_effects=False))


def pack_bf16x2(lo: Float32, hi: Float32) -> Int32:
    return Int32(_asm(1, [Float32(hi), Float32(lo)], "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f",
                      side_effects=False))


def round_bf16(x: Float32) -> Float32:
    return Float32(_asm(1, [Float32(x)],
                        "{ .reg .b16 h; cvt.rn.bf16.f32 h, $1; cvt.f32.bf16 $0, h; }", "=f,f",
                        kind=T.f32(), side_effects=False))


def mma_bf16_16816(a, b, c):
    """D = A(16x16 bf16, 4 regs) x B(16x8 bf16, 2 regs) + C(16x8 f32, 4 regs)."""
    text = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, "
            "{$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")
    out = _asm(4, list(a) + list(b) + list(c), text, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
               kind=T.f32(), side_effects=False)
    return [Float32(v) for v in out]


def shfl_max(x: Float32, offset: int) -> Float32:
    y = Float32(_asm(1, [Float32(x)], f"shfl.sync.bfly.b32 $0, $1, {offset}, 0x1f, 0xffffffff;",
                     "=f,f", kind=T.f32()))
    return cutlass.max(x, y)


def shfl_add(x: Float32, offset: int) -> Float32:
    y = Float32(_asm(1, [Float32(x)], f"shfl.sync.bfly.b32 $0, $1, {offset}, 0x1f, 0xffffffff;",
                     "=f,f", kind=T.f32()))
    return x + y
