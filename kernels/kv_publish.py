"""KV publish for SM90 in the CuTe DSL: kv RMSNorm + RoPE + the 584-byte SWA record, one warp a row.

Spec, byte formula and the reference whose bytes the kernel reproduces: `kernels/kv_publish_ref.py`.
Lane l holds dims 8l..8l+7 and 256+8l..256+8l+7 (two 16-byte loads): the squares are summed in the
order of `norm_ref.rmsnorm_ref` at width 512 (fma of exact bf16 squares, then a butterfly), rstd
with div.rn / sqrt.rn, y = bf16((x * rstd) * w). Lanes 24..31 own the 64 rope dims: each pair is
rotated in float64 (exact products, one rounding) and rounded to fp32 then bf16, as the reference.
The 7 nope groups of 64 dims are 8 lanes each: amax by a 3-step butterfly, the ceil power-of-two
scale, RNE E4M3 casts; the record is written with 8-byte stores (records are 8-byte aligned).
Rows whose slot is negative (padding) write nothing. Loads: the position, kv and weight are
issued together, the table (which waits only for the position) before the reduction, so a row
costs about two memory round trips, not four.

`AttnPrepSm90` (attn_prep, kernels/kv_publish_ref.py) runs this insert and split_norm's q head in
one launch over the fused wq_a|wkv rows: per row one warp of each, the kv one reading its half at
the fused row stride; kv_norm's weight is loaded before `griddepcontrol.wait`, and the slot,
position and kv loads go out together after it.

The PTX helpers come from `kernels.indexer_ptx` (the build hashes it into this family's
cache key).
PTX ABI: (u64 kv, u64 weight, u64 table, u64 positions, u64 slots, u64 cache, u32 rows,
u32 num_positions, f32 eps); attn_prep: kernels/kv_publish_ref.py.
"""
from __future__ import annotations

import cutlass
from cuda.bindings import driver as cuda
from cutlass import BFloat16, Float32, Int32, Int64, Uint32, cute
from cutlass.cutlass_dsl import T

from kernels import kv_publish_ref as kp
from kernels import split_norm_ref
from kernels.indexer_ptx import _addr, _asm, exp2_f32, ld_v2_f32, pack_e4m3, pow2_exponent
from kernels.ptx import (
    bf16_pair,
    f32_imm,
    fabs_max,
    ld_s32,
    ld_v4_u32,
    shfl_xor_f32,
    shfl_xor_max,
    st_v2_b32,
    void,
)
from kernels.split_norm import VEC, SplitNormSm90

LANES = 32
ROPE_LANE0 = (kp.HEAD_DIM - 64 - 256) // 8        # 24: lanes whose second vector is rope dims


def ld_s64(addr: Int64):
    return Int64(_asm(1, [Int64(addr)], "ld.global.s64 $0, [$1];", "=l,l", kind=T.i64(),
                      side_effects=True))


def st_u8(addr: Int64, value: Int32):
    void([Int64(addr), Int32(value)], "{ .reg .b16 h; cvt.u16.u32 h, $1;\n"
         "st.global.u8 [$0], h; }", "l,r")


def sq_acc(acc: Float32, x: Float32):
    """acc + x*x with one rounding (x*x of a bf16 value is exact)."""
    return Float32(_asm(1, [Float32(x), Float32(acc)], "fma.rn.f32 $0, $1, $1, $2;", "=f,f,f",
                        kind=T.f32()))


def rstd_of(total: Float32, eps: Float32, width: int):
    return Float32(_asm(1, [Float32(total), Float32(eps)],
                        "{ .reg .f32 m; div.rn.f32 m, $1, " + f32_imm(float(width)) + ";\n"
                        "add.rn.f32 m, m, $2; sqrt.rn.f32 m, m; div.rn.f32 $0, 0f3F800000, m; }",
                        "=f,f,f", kind=T.f32()))


def norm_bf16(x: Float32, rstd: Float32, w: Float32):
    """bf16((x * rstd) * w) as a float."""
    return Float32(_asm(1, [Float32(x), Float32(rstd), Float32(w)],
                        "{ .reg .f32 t; .reg .b16 h; mul.rn.f32 t, $1, $2; mul.rn.f32 t, t, $3;\n"
                        "cvt.rn.bf16.f32 h, t; cvt.f32.bf16 $0, h; }", "=f,f,f,f", kind=T.f32()))


def rope_pair_f64(x0: Float32, x1: Float32, c: Float32, s: Float32):
    """(bf16(f32(x0 c - x1 s)), bf16(f32(x0 s + x1 c))) with the products and the sum in float64."""
    v = _asm(2, [Float32(x0), Float32(x1), Float32(c), Float32(s)],
             "{ .reg .f64 a, b, c, s, t, u; .reg .f32 r; .reg .b16 h;\n"
             "cvt.f64.f32 a, $2; cvt.f64.f32 b, $3; cvt.f64.f32 c, $4; cvt.f64.f32 s, $5;\n"
             "mul.rn.f64 t, a, c; mul.rn.f64 u, b, s; sub.rn.f64 t, t, u;\n"
             "cvt.rn.f32.f64 r, t; cvt.rn.bf16.f32 h, r; cvt.f32.bf16 $0, h;\n"
             "mul.rn.f64 t, a, s; mul.rn.f64 u, b, c; add.rn.f64 t, t, u;\n"
             "cvt.rn.f32.f64 r, t; cvt.rn.bf16.f32 h, r; cvt.f32.bf16 $1, h; }",
             "=f,=f,f,f,f,f", kind=T.f32())
    return Float32(v[0]), Float32(v[1])


def select_f32(flag: Int32, a: Float32, b: Float32):
    """flag != 0 ? a : b."""
    return Float32(_asm(1, [Int32(flag), Float32(a), Float32(b)],
                        "{ .reg .pred p; setp.ne.s32 p, $1, 0; selp.f32 $0, $2, $3, p; }",
                        "=f,r,f,f", kind=T.f32()))


def pack_bf16(lo: Float32, hi: Float32):
    """Two bf16-valued floats as one word (lo in the low half)."""
    return Int32(_asm(1, [Float32(lo), Float32(hi)],
                      "{ .reg .b32 a, b; mov.b32 a, $1; mov.b32 b, $2; shr.u32 a, a, 16;\n"
                      "and.b32 b, b, 0xFFFF0000; or.b32 $0, a, b; }", "=r,f,f"))


class KvSwaInsertSm90:
    """One warp per row: RMSNorm, RoPE, record encode, store at the row's slot. `kv_row_stride`:
    the elements between two rows' kv (512 here; the fused wq_a|wkv row in AttnPrepSm90)."""

    def __init__(self, spec: kp.KvPublishSpec, kv_row_stride: int = kp.HEAD_DIM):
        self.spec = spec
        self.kv_row_stride = kv_row_stride

    @cute.jit
    def __call__(self, kv: cute.Pointer, weight: cute.Pointer, table: cute.Pointer,
                 positions: cute.Pointer, slots: cute.Pointer, cache: cute.Pointer, rows: Int32,
                 num_positions: Int32, eps: Float32, stream: cuda.CUstream):
        self.kernel(kv, weight, table, positions, slots, cache, rows, num_positions, eps).launch(
            grid=[1, 1, 1], block=list(self.spec.block), stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, kv: cute.Pointer, weight: cute.Pointer, table: cute.Pointer,
               positions: cute.Pointer, slots: cute.Pointer, cache: cute.Pointer, rows: Int32,
               num_positions: Int32, eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % LANES
        row = bidx * kp.ROWS_PER_CTA + tidx // LANES
        cute.arch.griddepcontrol_wait()        # kv, positions and slots come from earlier
        if row < rows:
            slot = ld_s64(_addr(slots) + Int64(row) * 8)
            if slot >= Int64(0):
                self.insert(_addr(kv), _addr(weight), _addr(table), _addr(positions),
                            _addr(cache) + slot * kp.kvrecord_ref.KV_RECORD_BYTES, row,
                            num_positions, eps, lane)
        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def insert(self, kv: Int64, weight: Int64, table: Int64, positions: Int64, rec: Int64,
               row: Int32, num_positions: Int32, eps: Float32, lane: Int32):
        """The whole insert of one row: every independent load issued first, then encode."""
        pos = ld_s32(positions + Int64(row) * 4)
        x = self.load_kv(kv, row, lane)
        w = self.load_weight(weight, lane)
        self.encode_store(x, w, table, pos, rec, num_positions, eps, lane)

    def load_kv(self, kv: Int64, row: Int32, lane: Int32) -> list:
        """Lane l's 16 kv values (dims 8l.. and 256 + 8l..) as fp32: two 16-byte loads."""
        x = []
        for half in range(2):
            words = ld_v4_u32(kv + Int64(row * self.kv_row_stride + 256 * half + 8 * lane) * 2)
            for w in range(4):
                lo, hi = bf16_pair(words[w])
                x += [lo, hi]
        return x

    def load_weight(self, weight: Int64, lane: Int32) -> list:
        """kv_norm's fp32 weight at lane l's 16 dims (a model constant: loadable before the wait)."""
        w = []
        for half in range(2):
            for q in range(4):
                w0, w1 = ld_v2_f32(weight + Int64(256 * half + 8 * lane + 2 * q) * 4)
                w += [w0, w1]
        return w

    @cute.jit
    def encode_store(self, x, w, table: Int64, pos: Int32, rec: Int64, num_positions: Int32,
                     eps: Float32, lane: Int32):
        """RMSNorm, RoPE, record encode and store of one row from its loaded kv, weight, position.
        The table loads (they wait only for the position) go out before the reduction."""
        # Every lane rotates (uniform code); only lanes 24..31 keep it: their second vector is
        # the rope dims. A position outside the table reads row 0 and yields NaN.
        valid = Int32(0)
        if pos >= 0 and pos < num_positions:
            valid = Int32(1)
        pair0 = 4 * (lane % (LANES - ROPE_LANE0))
        cs = []
        for q in cutlass.range_constexpr(4):
            c, s = ld_v2_f32(table + Int64(valid * pos * 64 + 2 * (pair0 + q)) * 4)
            cs += [select_f32(valid, c, Float32(float("nan"))), s]
        acc = Float32(0.0)
        for i in cutlass.range_constexpr(16):
            acc = sq_acc(acc, x[i])
        for k in cutlass.range_constexpr(5):
            acc = acc + shfl_xor_f32(acc, 16 >> k)
        rstd = rstd_of(acc, eps, kp.HEAD_DIM)
        y = [norm_bf16(x[i], rstd, w[i]) for i in range(16)]
        rope_lane = Int32(0)
        if lane >= ROPE_LANE0:
            rope_lane = Int32(1)
        for q in cutlass.range_constexpr(4):
            r0, r1 = rope_pair_f64(y[8 + 2 * q], y[9 + 2 * q], cs[2 * q], cs[2 * q + 1])
            y[8 + 2 * q] = select_f32(rope_lane, r0, y[8 + 2 * q])
            y[9 + 2 * q] = select_f32(rope_lane, r1, y[9 + 2 * q])
        for half in cutlass.range_constexpr(2):
            amax = Float32(0.0)
            for i in cutlass.range_constexpr(8):
                amax = fabs_max(amax, y[8 * half + i])
            for k in cutlass.range_constexpr(3):
                amax = shfl_xor_max(amax, 1 << k)
            e = pow2_exponent(amax, 0x600000, 8)
            inv = exp2_f32(-e)
            v = [y[8 * half + i] * inv for i in range(8)]
            if cutlass.const_expr(half == 0):
                self.store_nope(rec, v, e, half, lane)
            else:
                if lane < ROPE_LANE0:
                    self.store_nope(rec, v, e, half, lane)
                else:
                    rope = rec + Int64(kp.kvrecord_ref.KV_ROPE_OFFSET + 16 * (lane - ROPE_LANE0))
                    b = [pack_bf16(y[8 + 2 * i], y[9 + 2 * i]) for i in range(4)]
                    st_v2_b32(rope, b[0], b[1])
                    st_v2_b32(rope + Int64(8), b[2], b[3])
        if lane == LANES - 1:
            st_u8(rec + Int64(kp.kvrecord_ref.KV_RECORD_BYTES - 1), Int32(0))

    @cute.jit
    def store_nope(self, rec: Int64, v, e: Int32, half: cutlass.Constexpr, lane: Int32):
        """8 E4M3 bytes of this lane's vector and, from the group's first lane, its scale byte."""
        st_v2_b32(rec + Int64(256 * half + 8 * lane), pack_e4m3(v[0], v[1], v[2], v[3]),
                  pack_e4m3(v[4], v[5], v[6], v[7]))
        if lane % 8 == 0:
            st_u8(rec + Int64(kp.kvrecord_ref.KV_SCALE_OFFSET + 4 * half + lane // 8), e + 127)


class AttnPrepSm90(SplitNormSm90):
    """attn_prep: per row, warp 2j normalises the q head (SplitNormSm90's load, sum and store
    helpers, unchanged) and warp 2j + 1 inserts the kv tail (KvSwaInsertSm90.insert at the fused
    row stride). The roles are warp-uniform, so each warp's shuffles stay inside its role."""

    def __init__(self, spec: kp.AttnPrepSpec):
        super().__init__(split_norm_ref.make_spec(spec.q_width, spec.head_dim))
        assert self.threads_per_row == LANES and self.split.block == spec.block, spec
        self.prep = spec
        self.kv_insert = KvSwaInsertSm90(kp.make_swa_spec(spec.head_dim), spec.row_stride)

    @cute.jit
    def __call__(self, qkv: cute.Pointer, q_weight: cute.Pointer, kv_weight: cute.Pointer,
                 table: cute.Pointer, positions: cute.Pointer, slots: cute.Pointer,
                 qr: cute.Pointer, cache: cute.Pointer, rows: Int32, num_positions: Int32,
                 eps: Float32, stream: cuda.CUstream):
        self.prep_kernel(qkv, q_weight, kv_weight, table, positions, slots, qr, cache, rows,
                         num_positions, eps).launch(
            grid=[1, 1, 1], block=list(self.prep.block), stream=stream, use_pdl=True)

    @cute.kernel
    def prep_kernel(self, qkv: cute.Pointer, q_weight: cute.Pointer, kv_weight: cute.Pointer,
                    table: cute.Pointer, positions: cute.Pointer, slots: cute.Pointer,
                    qr: cute.Pointer, cache: cute.Pointer, rows: Int32, num_positions: Int32,
                    eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp, lane = tidx // LANES, tidx % LANES
        row = bidx * kp.PREP_ROWS_PER_CTA + warp // 2

        smem = cutlass.memory.SmemAllocator()
        w_smem = smem.allocate_tensor(Float32, cute.make_layout((self.width,)), byte_alignment=16)
        # Model constants, before the wait: q_norm's weight into shared memory (the q warps read
        # it as vectors), kv_norm's into registers (every warp loads it: 64 bytes a lane, so the
        # roles need not split before the wait).
        self._stage_weight(q_weight, w_smem, tidx)
        kv_w = self.kv_insert.load_weight(_addr(kv_weight), lane)

        cute.arch.griddepcontrol_wait()    # qkv, positions and slots come from earlier kernels
        if row < rows:
            if warp % 2 == 0:
                x_regs = cute.make_rmem_tensor((VEC // 2, self.vecs_per_thread), Uint32)
                self._load_row(qkv, x_regs, row, lane)
                rstd = self._row_rstd(x_regs, None, tidx, Int32(0), eps)
                self._normalise_store(x_regs, rstd, w_smem, qr, row, lane)
            else:
                # slot, position and kv in flight together; the table waits only for pos
                slot = ld_s64(_addr(slots) + Int64(row) * 8)
                pos = ld_s32(_addr(positions) + Int64(row) * 4)
                x = self.kv_insert.load_kv(_addr(qkv) + Int64(2 * self.width), row, lane)
                if slot >= Int64(0):
                    self.kv_insert.encode_store(
                        x, kv_w, _addr(table), pos,
                        _addr(cache) + slot * kp.kvrecord_ref.KV_RECORD_BYTES, num_positions,
                        eps, lane)
        cute.arch.griddepcontrol_launch_dependents()


def kernel_function(spec):
    if spec.kind == "attn_prep":
        return AttnPrepSm90.prep_kernel
    return KvSwaInsertSm90.kernel


def specs(cfg, tp: int) -> list:
    """The insert (raw kv rows), attn_prep, and the insert reading the kv half of attn.qkv in
    place (q_norm folded into wq_b: executor/stages/attn_proj.FOLD_Q_NORM)."""
    del tp
    return [kp.make_swa_spec(cfg.head_dim), kp.make_attn_prep_spec(cfg.q_lora_rank, cfg.head_dim),
            kp.make_swa_spec(cfg.head_dim, cfg.q_lora_rank + cfg.head_dim)]


def compile_spec(spec, options: str = "--gpu-arch sm_90a"):
    from cutlass.cute.runtime import make_ptr

    # attn_prep's q helpers index typed pointers (elements, not bytes); the rest take addresses.
    types = {"qkv": BFloat16, "qr": BFloat16, "q_weight": Float32}

    def ptr(name):
        return make_ptr(types.get(name, Int32), 0, cute.AddressSpace.gmem, assumed_align=16)

    args = [ptr(n) if k == "u64" else Float32(1e-6) if k == "f32" else Int32(1)
            for n, k in spec.params]
    kernel = (AttnPrepSm90(spec) if spec.kind == "attn_prep"
              else KvSwaInsertSm90(spec, spec.kv_row_stride))
    return cute.compile(kernel, *args, cuda.CUstream(0), options=options)
