"""Compressor kernels for SM90 in the CuTe DSL: the A2 projection GEMV and the A7-A9 publish.

Specs, byte formulas, the batched reference and the tolerances: `kernels/compressor_kernel_ref.py`.

Projection: one warp per output column and 8 rows; lane l reads the 16-byte (fp32) or 8-byte (bf16)
weight chunks l, l + 32, ... of its column (coalesced 512 / 256 B per warp load), multiplies them by
the rows' bf16 x chunks (L1/L2 hits: every warp of the grid reads the same x) and accumulates with
fma in fp32; a 5-step xor butterfly finishes, lane 0 stores. Weight loads come in groups of 8
chunks, double-buffered (group g+1 requested before group g is used: 8 KB in flight per warp at
fp32), and the first group is requested before `griddepcontrol.wait`.

Publish: one CTA of 128 threads per row, thread t owns dims 4t..4t+3 (and index-key dim t).
Ring write, pair pooling (softmax over the pair with ex2.approx), fp32 RMSNorm (two-level sum:
per-thread fma, warp butterfly, 4 warp partials in shared memory), RoPE of dims 448..511 at
r (p // r), the 584-byte record (group amax by a 16-lane butterfly, ceil power-of-two scale, RNE
E4M3; RNE bf16 rope), then the index key: 32 dot products of 512 per warp (lane l multiplies dims
16l..16l+15), RMSNorm_k, RoPE of key dims 64..127 (the pair partner is the xor-1 lane), one
power-of-two scale over 128, FP8 bytes. Rows with seq_index < 0, or whose entry falls on an
unallocated page, write nothing; r = 2 rows at even positions only write the ring.
The PTX helpers come from `kernels.indexer_ptx` and `kernels.kv_publish`.
"""
from __future__ import annotations

import cutlass
from cuda.bindings import driver as cuda
from cutlass import Float32, Int32, Int64, cute
from cutlass.cutlass_dsl import T

from kernels import compressor_kernel_ref as ck
from kernels import kvrecord_ref as rec
from kernels.indexer_ptx import _addr, _asm, exp2_f32, fmax_f32, imin, pack_e4m3, pow2_exponent
from kernels.kv_publish import rstd_of, select_f32, st_u8
from kernels.ptx import (
    bf16_pair,
    fabs_max,
    ld_s32,
    ld_v4_f32,
    lds_f32,
    shfl_xor_f32,
    shfl_xor_max,
    st_f32,
    st_v2_b32,
    st_v4_f32,
    sts_f32,
    void,
)

LANES = 32
UNROLL = 8            # weight chunks in flight per lane
E4M3_MANT = 0x600000  # 1.75: E4M3's largest mantissa
E4M3_TOP = 8


def ld_nc_v4_f32(addr: Int64):
    v = _asm(4, [Int64(addr)], "ld.global.nc.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,l",
             kind=T.f32())
    return [Float32(x) for x in v]


def ld_nc_v2_u32(addr: Int64):
    v = _asm(2, [Int64(addr)], "ld.global.nc.v2.u32 {$0, $1}, [$2];", "=r,=r,l")
    return [Int32(x) for x in v]


def prefetch_l2(addr: Int64):
    void([Int64(addr)], "prefetch.global.L2 [$0];", "l")


def bf16x4(addr: Int64):
    """4 bf16 values (8 bytes, read-only data) as floats."""
    w = ld_nc_v2_u32(addr)
    a, b = bf16_pair(w[0])
    c, d = bf16_pair(w[1])
    return [a, b, c, d]


def pack_bf16_rn(lo: Float32, hi: Float32):
    return Int32(_asm(1, [Float32(lo), Float32(hi)], "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f"))


def e4m3_byte(x: Float32):
    return Int32(_asm(1, [Float32(x)], "{ .reg .b16 h; .reg .b32 w; mov.f32 w, 0f00000000;\n"
                      "cvt.rn.satfinite.e4m3x2.f32 h, w, $1; cvt.u32.u16 $0, h;\n"
                      "and.b32 $0, $0, 0xFF; }", "=r,f"))


def flag_ge(a: Int32, b: int):
    """1 if a >= b else 0."""
    return Int32(_asm(1, [Int32(a)], "{ .reg .pred p; setp.ge.s32 p, $1, " + str(b)
                      + "; selp.s32 $0, 1, 0, p; }", "=r,r"))


def exp_f32(x: Float32):
    """e^x by ex2.approx (relative error ~2^-22)."""
    return Float32(_asm(1, [Float32(x)], "{ .reg .f32 t; mul.rn.f32 t, $1, 0f3FB8AA3B;\n"
                        "ex2.approx.ftz.f32 $0, t; }", "=f,f", kind=T.f32()))


def div_f32(a: Float32, b: Float32):
    return Float32(_asm(1, [Float32(a), Float32(b)], "div.rn.f32 $0, $1, $2;", "=f,f,f",
                        kind=T.f32()))


class CompressorProjSm90:
    """kv_score [R, 512 r] fp32 = x [R, D] bf16 @ W^T (W fp32 at r = 2, bf16 at r = 1)."""

    def __init__(self, spec: ck.CompressorSpec):
        self.spec = spec

    @cute.jit
    def __call__(self, x: cute.Pointer, w: cute.Pointer, out: cute.Pointer, rows: Int32,
                 stream: cuda.CUstream):
        cols = self.spec.out_cols // ck.PROJ_WARPS
        self.kernel(x, w, out, rows).launch(
            grid=[cols, (rows + ck.PROJ_ROW_TILE - 1) // ck.PROJ_ROW_TILE, 1],
            block=list(self.spec.block), stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, x: cute.Pointer, w: cute.Pointer, out: cute.Pointer, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, _ = cute.arch.block_idx()
        lane = tidx % LANES
        col = bidx * ck.PROJ_WARPS + tidx // LANES
        row0 = bidy * ck.PROJ_ROW_TILE
        d = self.spec.hidden
        wb = self.spec.weight_bytes_per_value
        wrow = _addr(w) + Int64(col) * (d * wb)
        chunks = d // 128
        unroll = UNROLL if chunks % UNROLL == 0 else 1
        # The weights do not depend on earlier kernels: the first group is in flight before the
        # wait, overlapping the previous kernel's tail (PDL).
        wv = self.load_weights(wrow, 0, unroll, lane)
        cute.arch.griddepcontrol_wait()        # x comes from the previous kernel
        # Rows past the batch read the last row (valid memory) and are not stored.
        xrow = []
        for i in cutlass.range_constexpr(ck.PROJ_ROW_TILE):
            xrow.append(_addr(x) + Int64(imin(row0 + i, rows - 1)) * (d * 2))
        acc = [Float32(0.0)] * ck.PROJ_ROW_TILE
        groups = chunks // unroll
        for g in cutlass.range_constexpr(groups):
            # Double buffer: group g+1 is requested before group g is multiplied.
            nxt = wv
            if cutlass.const_expr(g + 1 < groups):
                nxt = self.load_weights(wrow, g + 1, unroll, lane)
            for u in cutlass.range_constexpr(unroll):
                c = (g * unroll + u) * LANES + lane
                for i in cutlass.range_constexpr(ck.PROJ_ROW_TILE):
                    xv = bf16x4(xrow[i] + Int64(c) * 8)
                    a = acc[i]
                    for k in cutlass.range_constexpr(4):
                        a = a + xv[k] * wv[u][k]
                    acc[i] = a
            wv = nxt
        for i in cutlass.range_constexpr(ck.PROJ_ROW_TILE):
            a = acc[i]
            for k in cutlass.range_constexpr(5):
                a = a + shfl_xor_f32(a, 16 >> k)
            if lane == 0 and row0 + i < rows:
                st_f32(_addr(out) + (Int64(row0 + i) * self.spec.out_cols + col) * 4, a)
        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def load_weights(self, wrow: Int64, g: cutlass.Constexpr, unroll: cutlass.Constexpr,
                     lane: Int32):
        """The lane's `unroll` 4-value weight chunks of group g, as floats."""
        wv = []
        for u in cutlass.range_constexpr(unroll):
            c = (g * unroll + u) * LANES + lane
            if cutlass.const_expr(self.spec.weight_bytes_per_value == 4):
                wv.append(ld_nc_v4_f32(wrow + Int64(c) * 16))
            else:
                wv.append(bf16x4(wrow + Int64(c) * 8))
        return wv


class CompressorPublishSm90:
    """One CTA per row: ring, pooling, RMSNorm, RoPE, 584-byte entry and 132-byte index key."""

    def __init__(self, spec: ck.CompressorSpec):
        self.spec = spec

    @cute.jit
    def __call__(self, kv_score: cute.Pointer, ring: cute.Pointer, positions: cute.Pointer,
                 seq_index: cute.Pointer, state_lines: cute.Pointer, block_tables: cute.Pointer,
                 norm_w: cute.Pointer, wk: cute.Pointer, k_norm: cute.Pointer,
                 table: cute.Pointer, cache: cute.Pointer, keys: cute.Pointer, rows: Int32,
                 pages_per_seq: Int32, page_size: Int32, num_positions: Int32, eps: Float32,
                 stream: cuda.CUstream):
        self.kernel(kv_score, ring, positions, seq_index, state_lines, block_tables, norm_w, wk,
                    k_norm, table, cache, keys, rows, pages_per_seq, page_size, num_positions,
                    eps).launch(grid=[self.grid(rows), 1, 1], block=list(self.spec.block),
                                smem=self.spec.smem_bytes, stream=stream, use_pdl=True)

    def grid(self, rows: Int32):
        """CTAs of a launch: one per row."""
        return rows

    @cute.kernel
    def kernel(self, kv_score: cute.Pointer, ring: cute.Pointer, positions: cute.Pointer,
               seq_index: cute.Pointer, state_lines: cute.Pointer, block_tables: cute.Pointer,
               norm_w: cute.Pointer, wk: cute.Pointer, k_norm: cute.Pointer,
               table: cute.Pointer, cache: cute.Pointer, keys: cute.Pointer, rows: Int32,
               pages_per_seq: Int32, page_size: Int32, num_positions: Int32, eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        base = smem.allocate(self.spec.smem_bytes, byte_alignment=16).toint()   # latent + partials
        # wk (128 KB) is read late, in a dependent chain: pull it into L2 while waiting (PDL).
        for i in cutlass.range_constexpr(ck.INDEX_DIM * ck.HEAD_DIM * 2 // 128 // 128):
            prefetch_l2(_addr(wk) + Int64((tidx + 128 * i) * 128))
        cute.arch.griddepcontrol_wait()        # kv_score, positions and the tables come earlier
        seq = ld_s32(_addr(seq_index) + Int64(row) * 4)
        if seq >= 0:
            pos = ld_s32(_addr(positions) + Int64(row) * 4)
            r = self.spec.ratio
            e = pos // r
            page_idx = e // page_size
            page = Int32(-1)
            if page_idx < pages_per_seq:
                page = ld_s32(_addr(block_tables) + (Int64(seq) * pages_per_seq + page_idx) * 4)
            slot = Int64(page) * page_size + e % page_size
            src = _addr(kv_score) + Int64(row) * (ck.HEAD_DIM * r * 4) + Int64(tidx * 16)
            kv = ld_v4_f32(src)
            publish = Int32(1)
            if cutlass.const_expr(r == 2):
                sc = ld_v4_f32(src + ck.HEAD_DIM * 4)
                line = ld_s32(_addr(state_lines) + Int64(seq) * 4)
                ring_line = _addr(ring) + Int64(line) * (ck.RING_ROWS * ck.RING_WIDTH * 4)
                dst = ring_line + Int64(pos % ck.RING_ROWS) * (ck.RING_WIDTH * 4) + Int64(tidx * 16)
                st_v4_f32(dst, *kv)
                st_v4_f32(dst + ck.HEAD_DIM * 4, *sc)
                publish = pos % 2
                # Pooled for every row (uniform code); even rows discard it.
                kv = self.pool(kv, sc, ring_line, _addr(kv_score), _addr(positions),
                               _addr(seq_index), row, seq, pos, tidx)
            if page < 0:
                publish = Int32(0)
            if publish == 1:
                self.publish(kv, _addr(norm_w), _addr(wk), _addr(k_norm), _addr(table),
                             _addr(cache) + slot * rec.KV_RECORD_BYTES,
                             _addr(keys) + slot * rec.INDEX_RECORD_BYTES, e * r, num_positions,
                             eps, base, tidx)
        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def pool(self, kv1, s1, ring_line: Int64, kv_score: Int64, positions: Int64,
             seq_index: Int64, row: Int32, seq: Int32, pos: Int32, tidx: Int32):
        """Softmax pooling of (p-1, p) per channel; p-1 from this launch when it is the previous
        row of the sequence, from the ring otherwise."""
        prev = ring_line + Int64((pos - 1) & (ck.RING_ROWS - 1)) * (ck.RING_WIDTH * 4)
        if row > 0:
            pseq = ld_s32(seq_index + Int64(row - 1) * 4)
            ppos = ld_s32(positions + Int64(row - 1) * 4)
            if pseq == seq and ppos == pos - 1:
                prev = kv_score + Int64(row - 1) * (ck.RING_WIDTH * 4)
        kv0 = ld_v4_f32(prev + Int64(tidx * 16))
        s0 = ld_v4_f32(prev + ck.HEAD_DIM * 4 + Int64(tidx * 16))
        return pool_pair(kv0, s0, kv1, s1)

    @cute.jit
    def block_sum(self, v: Float32, base: Int32, tidx: Int32, slot: int):
        """Sum over the 128 threads: warp butterfly, then the 4 warp partials in order."""
        for k in cutlass.range_constexpr(5):
            v = v + shfl_xor_f32(v, 16 >> k)
        part = base + 2048 + 16 * slot
        if tidx % LANES == 0:
            sts_f32(part + (tidx // LANES) * 4, v)
        cute.arch.sync_threads()
        return (lds_f32(part) + lds_f32(part + 4)) + (lds_f32(part + 8) + lds_f32(part + 12))

    @cute.jit
    def publish(self, x, norm_w: Int64, wk: Int64, k_norm: Int64, table: Int64, entry: Int64,
                key: Int64, epos: Int32, num_positions: Int32, eps: Float32, base: Int32,
                tidx: Int32):
        rstd = self.latent_rstd(x, eps, base, tidx)
        w = ld_v4_f32(norm_w + Int64(tidx * 16))
        lat = latent_store(x, rstd, w, base, tidx)
        valid = Int32(0)
        if epos >= 0 and epos < num_positions:
            valid = Int32(1)
        trow = table + Int64(valid * epos) * (rec.ROPE_DIM * 4)
        # Entry: threads 112..127 own the rope dims 448..511 (pairs 2(t-112), 2(t-112)+1).
        y = list(lat)
        pair = 2 * (tidx % 16)
        for q in cutlass.range_constexpr(2):
            c, s = self.cos_sin(trow, pair + q, valid)
            y[2 * q], y[2 * q + 1] = rope_entry_pair(lat[2 * q], lat[2 * q + 1], c, s, tidx)
        self.store_entry(y, entry, tidx)
        cute.arch.sync_threads()               # latent complete in shared memory
        self.index_key(wk, k_norm, trow, valid, key, eps, base, tidx)

    @cute.jit
    def latent_rstd(self, x, eps: Float32, base: Int32, tidx: Int32):
        """1 / rms over the row's 512 dims (this thread's are x[0..3])."""
        acc = Float32(0.0)
        for k in cutlass.range_constexpr(4):
            acc = acc + x[k] * x[k]
        return rstd_of(self.block_sum(acc, base, tidx, 0), eps, ck.HEAD_DIM)

    @cute.jit
    def store_entry(self, y, entry: Int64, tidx: Int32):
        """The 584-byte record from the roped latent y (this thread's 4 dims)."""
        rope_t = rec.NOPE_DIM // 4
        amax = Float32(0.0)
        for k in cutlass.range_constexpr(4):
            amax = fabs_max(amax, y[k])
        for k in cutlass.range_constexpr(4):
            amax = shfl_xor_max(amax, 1 << k)
        ex = pow2_exponent(amax, E4M3_MANT, E4M3_TOP)
        inv = exp2_f32(-ex)
        if tidx < rope_t:
            void([Int64(entry + Int64(tidx * 4)), pack_e4m3(y[0] * inv, y[1] * inv, y[2] * inv,
                                                      y[3] * inv)],
                 "st.global.u32 [$0], $1;", "l,r")
            if tidx % 16 == 0:
                st_u8(entry + rec.KV_SCALE_OFFSET + tidx // 16, ex + 127)
        else:
            st_v2_b32(entry + rec.KV_ROPE_OFFSET + Int64(8 * (tidx - rope_t)),
                      pack_bf16_rn(y[0], y[1]), pack_bf16_rn(y[2], y[3]))
            if tidx == ck.PUBLISH_THREADS - 1:
                st_u8(entry + rec.KV_RECORD_BYTES - 1, Int32(0))

    @cute.jit
    def cos_sin(self, trow: Int64, pair: Int32, valid: Int32):
        v = _asm(2, [Int64(trow + Int64(pair) * 8)], "ld.global.nc.v2.f32 {$0, $1}, [$2];",
                 "=f,=f,l", kind=T.f32())
        return select_f32(valid, Float32(v[0]), Float32(float("nan"))), Float32(v[1])

    @cute.jit
    def index_key(self, wk: Int64, k_norm: Int64, trow: Int64, valid: Int32, key: Int64,
                  eps: Float32, base: Int32, tidx: Int32):
        lane = tidx % LANES
        warp = tidx // LANES
        lat = key_latent(base, lane)
        mine = Float32(0.0)
        for jj in cutlass.range(LANES, unroll=8):
            j = warp * LANES + jj
            wrow = wk + Int64(j) * (ck.HEAD_DIM * 2) + Int64(lane * 32)
            part = Float32(0.0)
            for v in cutlass.range_constexpr(4):
                wv = bf16x4(wrow + 8 * v)
                for k in cutlass.range_constexpr(4):
                    part = part + lat[4 * v + k] * wv[k]
            for k in cutlass.range_constexpr(5):
                part = part + shfl_xor_f32(part, 16 >> k)
            if lane == jj:
                mine = part
        rstd = rstd_of(self.block_sum(mine * mine, base, tidx, 1), eps, ck.INDEX_DIM)
        kn = (mine * rstd) * _ld_f32_nc(k_norm + Int64(tidx * 4))
        other = shfl_xor_f32(kn, 1)
        c, s = self.cos_sin(trow, (tidx % 64) // 2, valid)
        self.store_key(kn, other, c, s, key, base, tidx)

    @cute.jit
    def store_key(self, kn: Float32, other: Float32, c: Float32, s: Float32, key: Int64,
                  base: Int32, tidx: Int32):
        """The index key from the normed key dim kn (other: the xor-1 lane's): RoPE of dims
        64..127, one power-of-two scale over 128, FP8 bytes."""
        lane = tidx % LANES
        warp = tidx // LANES
        odd = Int32(tidx % 2)
        x0 = select_f32(odd, other, kn)
        x1 = select_f32(odd, kn, other)
        rot = select_f32(odd, x0 * s + x1 * c, x0 * c - x1 * s)
        is_rope = flag_ge(tidx, ck.INDEX_DIM - rec.ROPE_DIM)
        kr = select_f32(is_rope, rot, kn)
        amax = fabs_max(Float32(0.0), kr)
        for k in cutlass.range_constexpr(5):
            amax = shfl_xor_max(amax, 1 << k)
        part = base + 2048 + 32
        if lane == 0:
            sts_f32(part + warp * 4, amax)
        cute.arch.sync_threads()
        amax = fmax_f32(fmax_f32(lds_f32(part), lds_f32(part + 4)),
                              fmax_f32(lds_f32(part + 8), lds_f32(part + 12)))
        ex = pow2_exponent(amax, E4M3_MANT, E4M3_TOP)
        st_u8(key + Int64(tidx), e4m3_byte(kr * exp2_f32(-ex)))
        if tidx == 0:
            st_f32(key + rec.INDEX_SCALE_OFFSET, exp2_f32(ex))


def pool_pair(kv0, s0, kv1, s1):
    """Softmax pooling of the pair (p-1, p) per channel (4 a thread)."""
    out = []
    for k in range(4):
        m = fmax_f32(s0[k], s1[k])
        e0 = exp_f32(s0[k] - m)
        e1 = exp_f32(s1[k] - m)
        out.append(div_f32(e0 * kv0[k] + e1 * kv1[k], e0 + e1))
    return out


def latent_store(x, rstd: Float32, w, base: Int32, tidx: Int32):
    """RMSNorm'd latent (this thread's 4 dims), also into shared memory for the index key."""
    lat = [(x[k] * rstd) * w[k] for k in range(4)]
    for k in range(4):
        sts_f32(base + tidx * 16 + 4 * k, lat[k])
    return lat


def rope_entry_pair(a: Float32, b: Float32, c: Float32, s: Float32, tidx: Int32):
    """The pair (a, b) rotated on the threads that own rope dims (tidx >= NOPE_DIM / 4)."""
    y0 = a * c - b * s
    y1 = a * s + b * c
    is_rope = flag_ge(tidx, rec.NOPE_DIM // 4)
    return select_f32(is_rope, y0, a), select_f32(is_rope, y1, b)


def key_latent(base: Int32, lane: Int32):
    """Latent dims 16 lane .. 16 lane + 15 from shared memory (the index key's dot products)."""
    return [lds_f32(base + (16 * lane + k) * 4) for k in range(16)]


def _ld_f32_nc(addr: Int64):
    return Float32(_asm(1, [Int64(addr)], "ld.global.nc.f32 $0, [$1];", "=f,l", kind=T.f32()))


_CLASSES = {("proj", ""): CompressorProjSm90, ("publish", ""): CompressorPublishSm90}


def _class(spec: ck.CompressorSpec):
    if spec.variant:                    # round 9: kernels/compressor_fast.py
        from kernels import compressor_fast
        return compressor_fast.CLASSES[(spec.kind, spec.variant)]
    return _CLASSES[(spec.kind, "")]


def kernel_function(spec: ck.CompressorSpec):
    return _class(spec).kernel


def specs(cfg, tp: int) -> list[ck.CompressorSpec]:
    """Projection + publish per compressor ratio present in the model (replicated: tp unused),
    the session-1 kernels first, then round 9's bulk projections (8-row tiles; 16-row tiles at
    r = 2) and staged publish."""
    del tp
    ratios = sorted({layer.ratio for layer in cfg.layers if layer.owns_compressor})
    out = []
    for r in ratios:
        out += [ck.make_proj_spec(r, cfg.hidden_size), ck.make_publish_spec(r)]
    for r in ratios:
        out.append(ck.make_proj_spec(r, cfg.hidden_size, "bulk"))
        out.append(ck.make_proj_spec(r, cfg.hidden_size, "bulkr"))
        if r == 2:
            out.append(ck.make_proj_spec(r, cfg.hidden_size, "bulk16"))
        out.append(ck.make_publish_spec(r, "staged"))
    return out


def compile_spec(spec: ck.CompressorSpec, options: str = "--gpu-arch sm_90a"):
    from cutlass.cute.runtime import make_ptr

    def ptr():
        return make_ptr(Int32, 0, cute.AddressSpace.gmem, assumed_align=16)

    args = [ptr() if k == "u64" else Float32(1e-6) if k == "f32" else Int32(1)
            for _, k in spec.params]
    return cute.compile(_class(spec)(spec), *args, cuda.CUstream(0), options=options)
