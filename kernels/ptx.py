"""The inline-PTX primitives every SM90 kernel family shares: memory, cp.async, mma, shuffles.

Each helper emits exactly one instruction group: one `llvm.inline_asm` whose text is a single PTX
instruction, or a `{ ... }` scope of a few that must stay together (a predicated load and its
default, a convert-and-scale); `shfl_max`/`shfl_add` add the DSL's own max/add to the shuffle.
The families compose them; a family keeps its own helpers when only it uses them, or when its copy
differs in semantics (then the difference stays visible by name or by parameter). The exact text,
constraints and side effects are part of each helper's contract: moving a copy here was accepted
only when every cubin of both bundles stayed byte-identical.

`side_effects` is LLVM's `has_side_effects` on the asm. With it, LLVM may not delete the asm when
its result looks unused, merge it with an identical one, or move it across other side-effecting
operations (barriers, stores, `griddepcontrol.wait`): every load of data another thread, CTA or
kernel writes, and every store, needs it. Pure arithmetic goes without, so LLVM may schedule, merge
or drop it. `asm` therefore takes it as a required keyword: a family that binds a default (e.g.
`partial(asm, side_effects=False)`) says so where it binds it.
"""
from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T

_BFLY = "0x1f, 0xffffffff"   # shfl.sync.bfly clamp and member mask: the full warp


def f32_imm(x: float) -> str:
    """x as a PTX fp32 immediate (0fXXXXXXXX: its exact bits, rounded to float32 first)."""
    import numpy as np
    return f"0f{int(np.float32(x).view(np.uint32)):08X}"


def asm(results: int, operands, text: str, constraints: str, kind=None, *, side_effects: bool):
    """`results` values of type `kind` (default i32): one value, or a list when results > 1."""
    ty = kind or T.i32()
    ret = ty if results == 1 else llvm.StructType.get_literal([ty] * results)
    out = llvm.inline_asm(ret, [o.ir_value() for o in operands], text, constraints,
                          has_side_effects=side_effects, is_align_stack=False,
                          asm_dialect=llvm.AsmDialect.AD_ATT)
    if results == 1:
        return out
    return [llvm.extractvalue(ty, out, [i]) for i in range(results)]


def void(operands, text: str, constraints: str):
    """An asm without results: always with side effects (else LLVM would delete it)."""
    llvm.inline_asm(None, [o.ir_value() for o in operands], text, constraints,
                    has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)


# ---- global memory (coherent: data an earlier kernel or another CTA wrote) ----------------------

def ld_s32(addr: Int64) -> Int32:
    return Int32(asm(1, [Int64(addr)], "ld.global.s32 $0, [$1];", "=r,l", side_effects=True))


def ld_f32(addr: Int64) -> Float32:
    return Float32(asm(1, [Int64(addr)], "ld.global.f32 $0, [$1];", "=f,l", kind=T.f32(),
                       side_effects=True))


def ld_f32_if(addr: Int64, pred: Int32) -> Float32:
    """f32 at addr where pred != 0, else 0 (predicated: no branch, so loads batch)."""
    return Float32(asm(1, [Int64(addr), Int32(pred)],
                       "{ .reg .pred p; setp.ne.s32 p, $2, 0; mov.b32 $0, 0f00000000;\n"
                       "@p ld.global.f32 $0, [$1]; }", "=f,l,r", kind=T.f32(),
                       side_effects=True))


def ld_v4_s32(addr: Int64):
    v = asm(4, [Int64(addr)], "ld.global.v4.s32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l",
            side_effects=True)
    return [Int32(x) for x in v]


def ld_v4_u32(addr: Int64, streaming: bool = False):
    """16 bytes -> 4 x Int32; `streaming` reads through the non-coherent path without allocating
    in L1 (weights, read once: never data written since the kernel started)."""
    op = "ld.global.nc.L1::no_allocate.v4.u32" if streaming else "ld.global.v4.u32"
    v = asm(4, [Int64(addr)], f"{op} {{$0, $1, $2, $3}}, [$4];", "=r,=r,=r,=r,l",
            side_effects=True)
    return [Int32(x) for x in v]


def ld_bf16(addr: Int64) -> Float32:
    return Float32(asm(1, [Int64(addr)],
                       "{ .reg .b16 h; ld.global.b16 h, [$1]; cvt.f32.bf16 $0, h; }", "=f,l",
                       kind=T.f32(), side_effects=True))


def ld_v4_f32(addr: Int64):
    v = asm(4, [Int64(addr)], "ld.global.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,l",
            kind=T.f32(), side_effects=True)
    return [Float32(x) for x in v]


def ld_f32_gpu(addr: Int64) -> Float32:
    """A value another CTA wrote (read after the acquire): at L2, never a stale L1 line."""
    return Float32(asm(1, [Int64(addr)], "ld.relaxed.gpu.global.f32 $0, [$1];", "=f,l",
                       kind=T.f32(), side_effects=True))


def st_s32(addr: Int64, value: Int32):
    void([Int64(addr), Int32(value)], "st.global.s32 [$0], $1;", "l,r")


def st_f32(addr: Int64, value: Float32):
    void([Int64(addr), Float32(value)], "st.global.f32 [$0], $1;", "l,f")


def st_bf16(addr: Int64, value: Float32):
    """value rounded to bf16 (rn) and stored."""
    void([Int64(addr), Float32(value)],
         "{ .reg .b16 h; cvt.rn.bf16.f32 h, $1; st.global.b16 [$0], h; }", "l,f")


def st_v4_f32(addr: Int64, a: Float32, b: Float32, c: Float32, d: Float32):
    void([Int64(addr), Float32(a), Float32(b), Float32(c), Float32(d)],
         "st.global.v4.f32 [$0], {$1, $2, $3, $4};", "l,f,f,f,f")


def st_v2_b32(addr: Int64, a: Int32, b: Int32):
    void([Int64(addr), Int32(a), Int32(b)], "st.global.v2.b32 [$0], {$1, $2};", "l,r,r")


# ---- shared memory (32-bit shared-window addresses) ----------------------------------------------

def lds_u8(saddr: Int32) -> Int32:
    return Int32(asm(1, [Int32(saddr)], "ld.shared.u8 $0, [$1];", "=r,r", side_effects=True))


def lds_u16(saddr: Int32) -> Int32:
    return Int32(asm(1, [Int32(saddr)], "ld.shared.u16 $0, [$1];", "=r,r", side_effects=True))


def lds_u32(saddr: Int32) -> Int32:
    return Int32(asm(1, [Int32(saddr)], "ld.shared.u32 $0, [$1];", "=r,r", side_effects=True))


def lds_s32(saddr: Int32) -> Int32:
    return Int32(asm(1, [Int32(saddr)], "ld.shared.s32 $0, [$1];", "=r,r", side_effects=True))


def lds_s64(saddr: Int32) -> Int64:
    return Int64(asm(1, [Int32(saddr)], "ld.shared.s64 $0, [$1];", "=l,r", kind=T.i64(),
                     side_effects=True))


def lds_v4_u32(saddr: Int32):
    v = asm(4, [Int32(saddr)], "ld.shared.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r",
            side_effects=True)
    return [Int32(x) for x in v]


def lds_f32(saddr: Int32) -> Float32:
    return Float32(asm(1, [Int32(saddr)], "ld.shared.f32 $0, [$1];", "=f,r", kind=T.f32(),
                       side_effects=True))


def sts_u32(saddr: Int32, value: Int32):
    void([Int32(saddr), Int32(value)], "st.shared.u32 [$0], $1;", "r,r")


def sts_s32(saddr: Int32, value: Int32):
    void([Int32(saddr), Int32(value)], "st.shared.s32 [$0], $1;", "r,r")


def sts_v2_u32(saddr: Int32, a: Int32, b: Int32):
    void([Int32(saddr), Int32(a), Int32(b)], "st.shared.v2.u32 [$0], {$1, $2};", "r,r,r")


def sts_s64(saddr: Int32, value: Int64):
    void([Int32(saddr), Int64(value)], "st.shared.s64 [$0], $1;", "r,l")


def sts_f32(saddr: Int32, value: Float32):
    void([Int32(saddr), Float32(value)], "st.shared.f32 [$0], $1;", "r,f")


def sts_v2_f32(saddr: Int32, a: Float32, b: Float32):
    void([Int32(saddr), Float32(a), Float32(b)], "st.shared.v2.f32 [$0], {$1, $2};", "r,f,f")


# ---- cp.async ------------------------------------------------------------------------------------
# `memory_clobber` adds "~{memory}": LLVM then treats the asm as reading and writing any memory, so
# it keeps ordinary loads and stores on their side of it (kernels/moe.py was built that way).

def _with_clobber(constraints: str, memory_clobber: bool) -> str:
    if not memory_clobber:
        return constraints
    return f"{constraints},~{{memory}}" if constraints else "~{memory}"


def cp_async_4(saddr: Int32, gaddr: Int64):
    void([Int32(saddr), Int64(gaddr)], "cp.async.ca.shared.global [$0], [$1], 4;", "r,l")


def cp_async_8(saddr: Int32, gaddr: Int64, *, memory_clobber: bool = False):
    void([Int32(saddr), Int64(gaddr)], "cp.async.ca.shared.global [$0], [$1], 8;",
         _with_clobber("r,l", memory_clobber))


def cp_async_16(saddr: Int32, gaddr: Int64, *, memory_clobber: bool = False):
    """16 bytes global -> shared, L2 only (.cg)."""
    void([Int32(saddr), Int64(gaddr)], "cp.async.cg.shared.global [$0], [$1], 16;",
         _with_clobber("r,l", memory_clobber))


def cp_async_16_zfill(saddr: Int32, gaddr: Int64, nbytes: Int32):
    """16 bytes global -> shared, L2 only; nbytes 0 zero-fills (nothing is read)."""
    void([Int32(saddr), Int64(gaddr), Int32(nbytes)],
         "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r")


def cp_async_commit(*, memory_clobber: bool = False):
    void([], "cp.async.commit_group;", _with_clobber("", memory_clobber))


def cp_async_wait(pending: int, *, memory_clobber: bool = False):
    """Until at most `pending` of this thread's newest commit groups are still in flight."""
    void([], f"cp.async.wait_group {pending};", _with_clobber("", memory_clobber))


def cp_async_wait_all():
    """Commit and drain in one asm group."""
    void([], "cp.async.commit_group;\n\tcp.async.wait_group 0;", "")


# ---- cluster / DSMEM -----------------------------------------------------------------------------

def cluster_sync():
    """All threads of every CTA of the cluster; release/acquire orders shared-memory accesses."""
    void([], "barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;", "")


def cluster_nctarank(*, side_effects: bool) -> Int32:
    """CTAs in the cluster. A launch constant, so pure is enough; sparse_mqa reads it with side
    effects (as built and measured), indexer_topk_cluster without."""
    return Int32(asm(1, [], "mov.u32 $0, %cluster_nctarank;", "=r", side_effects=side_effects))


def ld_cluster_f32(saddr: Int32, rank: int) -> Float32:
    """f32 at the same shared offset in CTA `rank` (a constant) of the cluster (DSMEM)."""
    return Float32(asm(1, [Int32(saddr)],
                       "{ .reg .b32 a; mapa.shared::cluster.u32 a, $1, " + str(rank) + ";\n"
                       "ld.shared::cluster.f32 $0, [a]; }", "=f,r", kind=T.f32(),
                       side_effects=True))


def ld_cluster_v4_f32(saddr: Int32, rank: int):
    v = asm(4, [Int32(saddr)],
            "{ .reg .b32 a; mapa.shared::cluster.u32 a, $4, " + str(rank) + ";\n"
            "ld.shared::cluster.v4.f32 {$0, $1, $2, $3}, [a]; }", "=f,=f,=f,=f,r",
            kind=T.f32(), side_effects=True)
    return [Float32(x) for x in v]


# ---- mma.sync ------------------------------------------------------------------------------------

def mma_e4m3(a, b, c):
    """c + A(16x32 e4m3) x B(32x8 e4m3), fp32: mma.sync.aligned.m16n8k32.row.col."""
    ops = [Int32(x) for x in a] + [Int32(x) for x in b] + [Float32(x) for x in c]
    v = asm(4, ops, "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
            "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
            "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", kind=T.f32(), side_effects=False)
    return [Float32(x) for x in v]


def mma_e4m3_from_zero(a, b):
    """A(16x32 e4m3) x B(32x8 e4m3) from a zero accumulator (immediates), fp32."""
    ops = [Int32(x) for x in a] + [Int32(x) for x in b]
    v = asm(4, ops, "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
            "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
            "{0f00000000, 0f00000000, 0f00000000, 0f00000000};",
            "=f,=f,=f,=f,r,r,r,r,r,r", kind=T.f32(), side_effects=False)
    return [Float32(x) for x in v]


def _mma_bf16_16816(a, b, c, side_effects: bool):
    text = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, "
            "{$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")
    out = asm(4, list(a) + list(b) + list(c), text, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
              kind=T.f32(), side_effects=side_effects)
    return [Float32(v) for v in out]


def mma_bf16_16816(a, b, c):
    """D = A(16x16 bf16, 4 regs) x B(16x8 bf16, 2 regs) + C(16x8 f32, 4 regs), pure."""
    return _mma_bf16_16816(a, b, c, side_effects=False)


def mma_bf16_16816_ordered(a, b, c):
    """The same mma with side effects: LLVM keeps it in program order among the loads and
    stores (the dense and lm_head families were built and measured that way)."""
    return _mma_bf16_16816(a, b, c, side_effects=True)


# ---- warp shuffles (every lane of the warp must execute them) ------------------------------------

def shfl_xor_f32(v: Float32, offset: int) -> Float32:
    return Float32(asm(1, [Float32(v)], f"shfl.sync.bfly.b32 $0, $1, {offset}, {_BFLY};",
                       "=f,f", kind=T.f32(), side_effects=True))


def shfl_xor_max(v: Float32, offset: int) -> Float32:
    """max(v, v of lane ^ offset) as one asm group (max.f32 in PTX)."""
    return Float32(asm(1, [Float32(v)], "{ .reg .f32 t; shfl.sync.bfly.b32 t, $1, "
                       + str(offset) + f", {_BFLY}; max.f32 $0, $1, t; }}", "=f,f",
                       kind=T.f32(), side_effects=True))


def shfl_max(x: Float32, offset: int) -> Float32:
    """max(x, x of lane ^ offset): the shuffle in asm, the max in the DSL (cutlass.max)."""
    return cutlass.max(x, shfl_xor_f32(x, offset))


def shfl_add(x: Float32, offset: int) -> Float32:
    return x + shfl_xor_f32(x, offset)


# ---- conversions (pure) --------------------------------------------------------------------------

def bf16_pair(word: Int32):
    """The two bf16 of a word as fp32 (low half first)."""
    v = asm(2, [Int32(word)], "{ .reg .b32 t; shl.b32 t, $2, 16; mov.b32 $0, t;\n"
            "and.b32 t, $2, 0xFFFF0000; mov.b32 $1, t; }", "=f,=f,r", kind=T.f32(),
            side_effects=False)
    return Float32(v[0]), Float32(v[1])


def pack_bf16x2(lo: Float32, hi: Float32) -> Int32:
    return Int32(asm(1, [Float32(hi), Float32(lo)], "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f",
                     side_effects=False))


def round_bf16(x: Float32) -> Float32:
    return Float32(asm(1, [Float32(x)],
                       "{ .reg .b16 h; cvt.rn.bf16.f32 h, $1; cvt.f32.bf16 $0, h; }", "=f,f",
                       kind=T.f32(), side_effects=False))


def fabs_max(a: Float32, b: Float32) -> Float32:
    """max(a, |b|)."""
    return Float32(asm(1, [Float32(a), Float32(b)],
                       "{ .reg .f32 t; abs.f32 t, $2; max.f32 $0, $1, t; }", "=f,f,f",
                       kind=T.f32(), side_effects=False))


def e4m3x2_to_bf16x2(pair: Int32, scale_lo: Float32, scale_hi: Float32) -> Int32:
    """Two e4m3 (low byte = lower k) times their power-of-two scales -> bf16x2 (exact)."""
    text = ("{ .reg .b16 p, h0, h1; .reg .b32 hh; .reg .f32 f0, f1;\n"
            "cvt.u16.u32 p, $1;\n cvt.rn.f16x2.e4m3x2 hh, p;\n mov.b32 {h0, h1}, hh;\n"
            "cvt.f32.f16 f0, h0;\n cvt.f32.f16 f1, h1;\n"
            "mul.rn.f32 f0, f0, $2;\n mul.rn.f32 f1, f1, $3;\n cvt.rn.bf16x2.f32 $0, f1, f0; }")
    return Int32(asm(1, [Int32(pair), Float32(scale_lo), Float32(scale_hi)], text, "=r,r,f,f",
                     side_effects=False))


def ue8m0_to_f32(byte: Int32) -> Float32:
    """2^(byte - 127) as fp32 bits byte << 23 (0 -> 0.0: zero-filled records stay zero)."""
    return Float32(asm(1, [Int32(byte)], "{ .reg .b32 b; shl.b32 b, $1, 23; mov.b32 $0, b; }",
                       "=f,r", kind=T.f32(), side_effects=False))


# ---- split-K election, integer shuffle, bf16 pair (mhc, router, dspark; were in kernels/mhc*) ---

def atomic_add_acq_rel(addr: Int64, v: Int32) -> Int32:
    return Int32(asm(1, [Int64(addr), Int32(v)], "atom.acq_rel.gpu.global.add.s32 $0, [$1], $2;",
                     "=r,l,r", side_effects=True))


def fence_gpu():
    void([], "fence.acq_rel.gpu;", "")


def bf16x2_to_f32(word: Int32):
    """A packed bf16 pair -> (low, high) as fp32 (exact: bit placement). Two pure asm where
    `bf16_pair` is one group: the same instructions, kept apart so both families' cubins stay
    as they were measured."""
    lo = Float32(asm(1, [Int32(word)], "shl.b32 $0, $1, 16;", "=f,r", kind=T.f32(),
                     side_effects=False))
    hi = Float32(asm(1, [Int32(word)], "and.b32 $0, $1, 0xFFFF0000;", "=f,r", kind=T.f32(),
                     side_effects=False))
    return lo, hi


def shfl_xor_i32(x: Int32, offset: int) -> Int32:
    """Butterfly exchange of an integer over the full warp (every lane must execute it)."""
    return Int32(asm(1, [Int32(x)], f"shfl.sync.bfly.b32 $0, $1, {offset}, 0x1f, 0xffffffff;",
                     "=r,r", side_effects=True))


# ---- timeline stamps (diagnostic builds only: kernels/moe_timeline.py) --------------------------

def stamp_time(addr: Int64, pred: Int32):
    """Where pred != 0: %globaltimer (ns; its update period is the GPU's, often 1 us) and
    %clock64 (SM cycles) as two u64 at addr. Both registers are read whatever pred is, so the
    instruction stream of every thread is the same."""
    void([Int64(addr), Int32(pred)],
         "{ .reg .pred p; .reg .u64 g, c; setp.ne.s32 p, $1, 0;\n"
         "mov.u64 g, %globaltimer; mov.u64 c, %clock64;\n"
         "@p st.global.v2.u64 [$0], {g, c}; }", "l,r,~{memory}")


def stamp_smid(addr: Int64, pred: Int32):
    """Where pred != 0: %smid (the SM this CTA runs on) as a u32 at addr."""
    void([Int64(addr), Int32(pred)],
         "{ .reg .pred p; .reg .u32 s; setp.ne.s32 p, $1, 0; mov.u32 s, %smid;\n"
         "@p st.global.u32 [$0], s; }", "l,r,~{memory}")
