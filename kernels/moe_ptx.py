"""Device helpers of the routed-MoE kernels: inline PTX groups and the fragment math built on them.

Each helper is one instruction group that `kernels/moe_kernel_ref.py` replays bit for bit: FP4 +
UE8M0 -> E4M3 row decode, the FP8 activation scale and quantization, SwiGLU, the 128-group mma.
Used by `kernels/moe.py`, `kernels/moe_selfroute.py` and `kernels/swiglu.py`.
"""
from __future__ import annotations

from functools import partial

import cutlass
from cutlass import Float32, Int32, Int64, cute
from cutlass.cutlass_dsl import T

from kernels import moe_kernel_ref as mk
from kernels import ptx
from kernels.ptx import asm, bf16_pair, f32_imm, fabs_max, mma_e4m3, shfl_xor_max, void

_F448 = "0f43E00000"
_F_FLOOR = "0f0DA24260"       # 1e-30 (quantize_act_fp8's scale floor)
_F_NEG_LOG2E = "0fBFB8AA3B"


# ---- inline PTX helpers (each one instruction group; the reference replays them) ---------------

# Pure by default (this family's arithmetic); its loads opt in with side_effects=True.
_asm = partial(asm, side_effects=False)


def ld_v2(addr: Int64, pred: Int32):
    """8 bytes written by an earlier kernel (coherent path); zeros where pred == 0."""
    v = _asm(2, [Int64(addr), Int32(pred)],
             "{ .reg .pred p; setp.ne.s32 p, $3, 0; mov.b32 $0, 0; mov.b32 $1, 0;\n"
             "@p ld.global.v2.u32 {$0, $1}, [$2]; }", "=r,=r,l,r", side_effects=True)
    return [Int32(x) for x in v]


def ld_u32(addr: Int64, pred: Int32):
    return Int32(_asm(1, [Int64(addr), Int32(pred)],
                      "{ .reg .pred p; setp.ne.s32 p, $2, 0; mov.b32 $0, 0;\n"
                      "@p ld.global.u32 $0, [$1]; }", "=r,l,r", side_effects=True))


def ld_relaxed_u32(addr: Int64, pred: Int32):
    """A word written two kernels back, read before griddepcontrol.wait (never a stale L1 line);
    0 where pred == 0."""
    return Int32(_asm(1, [Int64(addr), Int32(pred)],
                      "{ .reg .pred p; setp.ne.s32 p, $2, 0; mov.b32 $0, 0;\n"
                      "@p ld.relaxed.gpu.global.u32 $0, [$1]; }", "=r,l,r", side_effects=True))


def st_u32(addr: Int64, value: Int32):
    void([Int64(addr), Int32(value)], "st.global.u32 [$0], $1;", "l,r")


def lds_v2(saddr: Int32):
    v = _asm(2, [Int32(saddr)], "ld.shared.v2.u32 {$0, $1}, [$2];", "=r,=r,r", side_effects=True)
    return [Int32(x) for x in v]


# moe's cp.async group clobbers memory (see kernels/ptx.py), as these kernels were built.
cp_async_16 = partial(ptx.cp_async_16, memory_clobber=True)
cp_async_8 = partial(ptx.cp_async_8, memory_clobber=True)
cp_async_commit = partial(ptx.cp_async_commit, memory_clobber=True)
cp_async_wait = partial(ptx.cp_async_wait, memory_clobber=True)


# ---- mbarrier + bulk copy (TMA engine, no tensor map): kernels/moe_bulk.py -------------------
# A bulk copy's bytes land through the async proxy and are counted on an mbarrier in shared
# memory: the consumer waits on the barrier's phase, never on a per-thread cp.async group.

def mbar_init(saddr: Int32, arrivals: int):
    """Initialise the 8-byte mbarrier at saddr: a phase completes after `arrivals` arrivals and
    once every byte announced with expect_tx has landed."""
    void([Int32(saddr)], f"mbarrier.init.shared::cta.b64 [$0], {arrivals};", "r")


def mbar_init_fence():
    """Make this thread's mbarrier.init visible to the async proxy (the bulk-copy engine) before
    a copy names the barrier."""
    void([], "fence.mbarrier_init.release.cluster;", "~{memory}")


def mbar_arrive_expect_tx(saddr: Int32, nbytes: int):
    """One arrival on the barrier that also announces `nbytes` more bytes for its current phase
    (the phase cannot complete before they land)."""
    void([Int32(saddr)], f"mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], {nbytes};",
         "r,~{memory}")


def bulk_copy_g2s(sdst: Int32, gsrc: Int64, nbytes: int, mbar: Int32):
    """cp.async.bulk: `nbytes` (a multiple of 16; both addresses 16-aligned) global -> shared,
    one instruction for the whole range, counted as complete_tx on the mbarrier at `mbar`."""
    void([Int32(sdst), Int64(gsrc), Int32(mbar)],
         "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
         f"[$0], [$1], {nbytes}, [$2];", "r,l,r,~{memory}")


def mbar_try_wait(saddr: Int32, parity: Int32):
    """1 once the barrier's phase of parity `parity` has completed (the current phase has the
    other parity), else 0 after a bounded hardware wait. Acquire: shared-memory reads after it
    see the bytes the completed phase counted."""
    return Int32(_asm(1, [Int32(saddr), Int32(parity)],
                      "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2;\n"
                      "selp.u32 $0, 1, 0, p; }", "=r,r,r,~{memory}", side_effects=True))


@cute.jit
def mbar_wait(saddr: Int32, parity: Int32):
    """Spin on `mbar_try_wait` until the phase of parity `parity` has completed."""
    done = mbar_try_wait(saddr, parity)
    while done == 0:
        done = mbar_try_wait(saddr, parity)


def syncwarp():
    """All 32 lanes reach this point (and their earlier shared-memory accesses are ordered)."""
    void([], "bar.warp.sync -1;", "~{memory}")


def atom_or_shared(saddr: Int32, value: Int32):
    void([Int32(saddr), Int32(value)], "red.shared.or.b32 [$0], $1;", "r,r")


def decode_row(word: Int32, offsets: Int32, byte: int):
    """(lo, hi) E4M3 registers of one row and k-step: 8 E2M1 codes + the offset byte `byte`."""
    v = _asm(2, [Int32(word), Int32(offsets)],
             "{ .reg .b32 o, l0, l1, sel, sh, t, s;\n"
             f"bfe.u32 o, $3, {8 * byte}, 8;\n"
             f"mad.lo.u32 l0, o, 0x01010100, {mk.LUT_LO_BASE:#x};\n"
             f"mad.lo.u32 l1, o, 0x01010101, {mk.LUT_HI_BASE:#x};\n"
             "and.b32 sel, $2, 0x77777777;\n"
             "prmt.b32 t, l0, l1, sel;\n"
             "and.b32 s, $2, 0x80808080;\n"
             "or.b32 $0, t, s;\n"
             "shr.u32 sh, sel, 16;\n"
             "prmt.b32 t, l0, l1, sh;\n"
             "shl.b32 s, $2, 4;\n"
             "and.b32 s, s, 0x80808080;\n"
             "or.b32 $1, t, s; }", "=r,=r,r,r")
    return Int32(v[0]), Int32(v[1])


def act_scale(amax: Float32):
    """(s, 1/s): s = max(amax / 448, 1e-30) with div.rn, 1/s with rcp.rn (quantize_act_fp8)."""
    v = _asm(2, [Float32(amax)], "{ .reg .f32 t; div.rn.f32 t, $2, " + _F448 + ";\n"
             "max.f32 $0, t, " + _F_FLOOR + "; rcp.rn.f32 $1, $0; }", "=f,=f,f", kind=T.f32())
    return Float32(v[0]), Float32(v[1])


def quantize4(x0, x1, x2, x3, inv):
    """4 E4M3 bytes (x0 lowest) of x * inv: mul.rn then cvt.rn.satfinite."""
    return Int32(_asm(1, [Float32(x0), Float32(x1), Float32(x2), Float32(x3), Float32(inv)],
                      "{ .reg .f32 y0, y1, y2, y3; .reg .b16 lo, hi;\n"
                      "mul.rn.f32 y0, $1, $5; mul.rn.f32 y1, $2, $5;\n"
                      "mul.rn.f32 y2, $3, $5; mul.rn.f32 y3, $4, $5;\n"
                      "cvt.rn.satfinite.e4m3x2.f32 lo, y1, y0;\n"
                      "cvt.rn.satfinite.e4m3x2.f32 hi, y3, y2;\n"
                      "mov.b32 $0, {lo, hi}; }", "=r,f,f,f,f,f"))


def swiglu(gate: Float32, up: Float32, limit: float):
    """bf16-valued silu(min(gate, L)) * clip(up, -L, L) (gate, up already bf16 values)."""
    lim = f32_imm(limit)
    nlim = f32_imm(-limit)
    return Float32(_asm(1, [Float32(gate), Float32(up)],
                        "{ .reg .f32 g, u, t; min.f32 g, $1, " + lim + ";\n"
                        "max.f32 u, $2, " + nlim + "; min.f32 u, u, " + lim + ";\n"
                        "mul.rn.f32 t, g, " + _F_NEG_LOG2E + "; ex2.approx.f32 t, t;\n"
                        "add.rn.f32 t, t, 0f3F800000; div.rn.f32 t, g, t;\n"
                        "mul.rn.f32 $0, t, u; }", "=f,f,f", kind=T.f32()))


def fmul_add(acc: Float32, a: Float32, b: Float32):
    """acc + a * b with two roundings (mul.rn, add.rn), as NumPy's `acc + a * b`."""
    return Float32(_asm(1, [Float32(acc), Float32(a), Float32(b)],
                        "{ .reg .f32 t; mul.rn.f32 t, $2, $3; add.rn.f32 $0, $1, t; }",
                        "=f,f,f,f", kind=T.f32()))


def fadd_rn(a: Float32, b: Float32):
    """a + b with one rounding (add.rn: never contracted into an fma), as NumPy's `a + b`."""
    return Float32(_asm(1, [Float32(a), Float32(b)], "add.rn.f32 $0, $1, $2;", "=f,f,f",
                        kind=T.f32()))


def ctz(x: Int32):
    return Int32(_asm(1, [Int32(x)], "{ .reg .b32 t; brev.b32 t, $1; clz.b32 $0, t; }",
                      "=r,r"))


def popc(x: Int32):
    return Int32(_asm(1, [Int32(x)], "popc.b32 $0, $1;", "=r,r"))


def _addr(ptr: cute.Pointer) -> Int64:
    return Int64(ptr.toint())


# ---- per-CTA timeline (kernels/moe_timeline.py builds; None in production) ---------------------
# `tl` is None in every production kernel, so `mark` and `timeline_of` emit nothing there (the
# cubins stay byte-identical); in a timeline build it is (this CTA's record, thread-0 predicate).

@cute.jit
def timeline_record(stamps: Int64, bidx: Int32, tidx: Int32):
    """(record address, 1 on thread 0 else 0); the SM id written at once."""
    record = stamps + Int64(bidx) * mk.TIMELINE_RECORD_BYTES
    writer = Int32(1) if tidx == 0 else Int32(0)
    ptx.stamp_smid(record, writer)
    return record, writer


def timeline_of(stamps, bidx, tidx):
    """None (production: stamps None) or the CTA's timeline handle."""
    return None if stamps is None else timeline_record(stamps, bidx, tidx)


def mark(tl, event: str, when=None):
    """Thread 0 stamps `event` (mk.TIMELINE_EVENTS) where when() != 0; nothing when tl is None.
    `when` is a callable so that production code does not even build its predicate."""
    if tl is None:
        return
    record, writer = tl
    pred = writer if when is None else writer & Int32(when())
    ptx.stamp_time(record + 16 * (1 + mk.timeline_event(event)), pred)


@cute.jit
def quantize_quad(w0: Int32, w1: Int32):
    """One lane's 4 bf16 of a 128-group (x0 lowest) -> (4 E4M3 bytes, group scale); the warp's 32
    lanes hold the group, so amax is a butterfly over the whole warp."""
    x0, x1 = bf16_pair(w0)
    x2, x3 = bf16_pair(w1)
    amax = fabs_max(fabs_max(fabs_max(fabs_max(Float32(0.0), x0), x1), x2), x3)
    for k in cutlass.range_constexpr(5):
        amax = shfl_xor_max(amax, 16 >> k)
    scale, inverse = act_scale(amax)
    return quantize4(x0, x1, x2, x3, inverse), scale


def fragment_position(kstep_of_lane, lane):
    """Byte offset of lane's 4 consecutive K values (4*lane..) inside the fragment-ordered row."""
    quad = lane % 8
    return kstep_of_lane * mk.KSTEP + 8 * (quad % 4) + 4 * (quad // 4)


def decode_group(words, offs, ksteps: int):
    """`group_mma`'s A fragments of one 128-group (the lane's code words of its two columns, its
    two offset words), decoded ahead of the mma: [k-step][a0, a1, a2, a3]."""
    frags = []
    for s4 in range(ksteps):
        col, s = s4 // 2, s4 % 2
        byte_g, byte_g8 = 2 * s4, 2 * s4 + 1
        a0, a2 = decode_row(words[4 * col + 2 * s], offs[byte_g // 4], byte_g % 4)
        a1, a3 = decode_row(words[4 * col + 2 * s + 1], offs[byte_g8 // 4], byte_g8 % 4)
        frags.append([a0, a1, a2, a3])
    return frags


@cute.jit
def group_mma_decoded(frags, b_regs):
    """`group_mma` on fragments `decode_group` produced: the same mmas in the same order."""
    part = [Float32(0.0)] * 4
    for s4 in cutlass.range_constexpr(len(frags)):
        part = mma_e4m3(frags[s4], b_regs[s4], part)
    return part


@cute.jit
def group_mma(words, offs, ksteps: int, b_regs):
    """fp32 partial of one 128-group: `ksteps` k-steps of the warp's weight tile (the lane's code
    words of the group's two columns, its two offset words) against the B fragments b_regs[s4]."""
    part = [Float32(0.0)] * 4
    for s4 in cutlass.range_constexpr(ksteps):
        col, s = s4 // 2, s4 % 2
        byte_g, byte_g8 = 2 * s4, 2 * s4 + 1
        a0, a2 = decode_row(words[4 * col + 2 * s], offs[byte_g // 4], byte_g % 4)
        a1, a3 = decode_row(words[4 * col + 2 * s + 1], offs[byte_g8 // 4], byte_g8 % 4)
        part = mma_e4m3([a0, a1, a2, a3], b_regs[s4], part)
    return part
