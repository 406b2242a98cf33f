"""One-shot all-reduce for SM90 in the CuTe DSL: push to every peer, poll own slots, rank-ordered sum.

Protocol, buffer layout, ABI and reference: `kernels/allreduce_ref.py`. Every global access is
inline PTX on 64-bit addresses (peer buffers are plain integers loaded from `peers`):
- pushes and slot resets are `st.volatile.global.v4.b32`, polls `ld.volatile.global.v4.b32`: each
  32-bit element is single-copy atomic, so a word is either all sentinel or all data, and the
  per-lane -0.0 test cannot accept a torn value;
- bf16 -> fp32 is a shift/mask, fp32 -> bf16 one `cvt.rn.bf16x2.f32` per pair.

Timeline of one thread:  wait(PDL) | push chunk to W ranks ... | trigger dependents | for s in
0..W-1: poll slot s (bounded by %globaltimer), fold, reset | epilogue, store | CTA arrival.
The dependents are triggered after the pushes: the next kernel may stage its prologue while this
one polls; its own griddepcontrol.wait still orders its reads after this grid.
"""
from __future__ import annotations

import cutlass
from cuda.bindings import driver as cuda
from cutlass import BFloat16, Float32, Int32, Int64, Uint32, cute

from kernels import engram_kernel_ref
from kernels.allreduce_ref import (
    CTA_THREADS,
    MAX_CTAS,
    PICK_SENTINEL,
    WORLD_SIZES,
    GatherSpec,
    OneShotSpec,
    PickSpec,
    make_gather_spec,
    make_pick_spec,
    make_spec,
)

VEC_BYTES = 16
SENTINEL_WORD = 0x80008000          # two bf16 -0.0


# ---- inline PTX on 64-bit global addresses ------------------------------------------------------

@cute.jit
def _ld_v4(addr: Int64):
    return cute.arch.inline_ptx("ld.global.v4.b32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
                                write_only_types=[Uint32] * 4, read_only_args=[addr])


@cute.jit
def _ld_volatile_v4(addr: Int64):
    return cute.arch.inline_ptx(
        "ld.volatile.global.v4.b32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
        write_only_types=[Uint32] * 4, read_only_args=[addr])


@cute.jit
def _st_v4(addr: Int64, w0: Uint32, w1: Uint32, w2: Uint32, w3: Uint32):
    cute.arch.inline_ptx("st.global.v4.b32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
                         read_only_args=[addr, w0, w1, w2, w3])


@cute.jit
def _st_volatile_v4(addr: Int64, w0: Uint32, w1: Uint32, w2: Uint32, w3: Uint32):
    cute.arch.inline_ptx("st.volatile.global.v4.b32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
                         read_only_args=[addr, w0, w1, w2, w3])


@cute.jit
def _ld_volatile_u32(addr: Int64):
    return cute.arch.inline_ptx("ld.volatile.global.b32 {$w0}, [{$r0}];",
                                write_only_types=[Uint32], read_only_args=[addr])


@cute.jit
def _st_volatile_u32(addr: Int64, value: Uint32):
    cute.arch.inline_ptx("st.volatile.global.b32 [{$r0}], {$r1};", read_only_args=[addr, value])


@cute.jit
def _atomic_inc_u32(addr: Int64):
    return cute.arch.inline_ptx("atom.add.acq_rel.gpu.global.u32 {$w0}, [{$r0}], 1;",
                                write_only_types=[Uint32], read_only_args=[addr])


# ---- bf16 lanes of a 32-bit word -----------------------------------------------------------------

@cute.jit
def _sanitize(w: Uint32):
    """-0.0 lanes (0x8000) become +0.0: the sentinel must never be sent as data."""
    return cute.arch.inline_ptx(
        "{ .reg .b32 lo, hi; .reg .pred p, q;\n"
        " and.b32 lo, {$r0}, 0xFFFF; setp.eq.b32 p, lo, 0x8000; selp.b32 lo, 0, lo, p;\n"
        " and.b32 hi, {$r0}, 0xFFFF0000; setp.eq.b32 q, hi, 0x80000000; selp.b32 hi, 0, hi, q;\n"
        " or.b32 {$w0}, lo, hi; }",
        write_only_types=[Uint32], read_only_args=[w])


@cute.jit
def _pending(w0: Uint32, w1: Uint32, w2: Uint32, w3: Uint32):
    """1 if any of the 8 bf16 lanes still holds the sentinel, else 0."""
    return cute.arch.inline_ptx(
        "{ .reg .b32 t; .reg .pred p;\n"
        " and.b32 t, {$r0}, 0xFFFF; setp.eq.b32 p, t, 0x8000;\n"
        " and.b32 t, {$r0}, 0xFFFF0000; setp.eq.or.b32 p, t, 0x80000000, p;\n"
        " and.b32 t, {$r1}, 0xFFFF; setp.eq.or.b32 p, t, 0x8000, p;\n"
        " and.b32 t, {$r1}, 0xFFFF0000; setp.eq.or.b32 p, t, 0x80000000, p;\n"
        " and.b32 t, {$r2}, 0xFFFF; setp.eq.or.b32 p, t, 0x8000, p;\n"
        " and.b32 t, {$r2}, 0xFFFF0000; setp.eq.or.b32 p, t, 0x80000000, p;\n"
        " and.b32 t, {$r3}, 0xFFFF; setp.eq.or.b32 p, t, 0x8000, p;\n"
        " and.b32 t, {$r3}, 0xFFFF0000; setp.eq.or.b32 p, t, 0x80000000, p;\n"
        " selp.u32 {$w0}, 1, 0, p; }",
        write_only_types=[Uint32], read_only_args=[w0, w1, w2, w3])


@cute.jit
def _lo_f32(w: Uint32):
    return cute.arch.inline_ptx("shl.b32 {$w0}, {$r0}, 16;", write_only_types=[Float32],
                                read_only_args=[w])


@cute.jit
def _hi_f32(w: Uint32):
    return cute.arch.inline_ptx("and.b32 {$w0}, {$r0}, 0xFFFF0000;", write_only_types=[Float32],
                                read_only_args=[w])


@cute.jit
def _pack_bf16x2(lo: Float32, hi: Float32):
    return cute.arch.inline_ptx("cvt.rn.bf16x2.f32 {$w0}, {$r0}, {$r1};",
                                write_only_types=[Uint32], read_only_args=[hi, lo])


# ---- the kernel ----------------------------------------------------------------------------------

class OneShotAllReduceSm90:
    """Kernel object for one OneShotSpec (world, width, capacity, epilogue baked in)."""

    def __init__(self, spec: OneShotSpec):
        self.spec = spec
        self.world = spec.world
        self.chunks_per_row = spec.chunks_per_row
        self.slot_bytes = spec.slot_bytes
        self.fused = spec.epilogue == "residual"

    @cute.jit
    def _poll(self, addr: Int64, source: Int32, ctl: Int64, status: Int64, timeout_ns: Int64,
              failed: Uint32):
        """Load a chunk of `source`'s slot until no lane is the sentinel, the rank has failed, or
        timeout_ns pass (then flag `source` in status and the rank in control[2])."""
        w0, w1, w2, w3 = _ld_volatile_v4(addr)
        waiting = _pending(w0, w1, w2, w3) * (Uint32(1) - failed)
        start = cute.arch.globaltimer()
        while waiting != Uint32(0):
            w0, w1, w2, w3 = _ld_volatile_v4(addr)
            pending = _pending(w0, w1, w2, w3)
            if pending != Uint32(0):
                if cute.arch.globaltimer() - start > timeout_ns:
                    _st_volatile_u32(status + Int64(source) * 4, Uint32(1))
                    _st_volatile_u32(ctl + 8, Uint32(1))
                    failed = Uint32(1)
                else:
                    failed = _ld_volatile_u32(ctl + 8)
            waiting = pending * (Uint32(1) - failed)
        return w0, w1, w2, w3, failed

    @cute.jit
    def _push(self, src: Int64, peer_tab, push_offset: Int64, first: Int32, stride: Int32,
              num_chunks: Int32):
        """Every 16-byte chunk of src (grid stride), sanitized, into slot [gen][rank] of every
        rank's buffer (push_offset = that slot's offset)."""
        push_bases = []
        for s in cutlass.range_constexpr(self.world):
            push_bases.append(peer_tab[s] + push_offset)
        i = first
        while i < num_chunks:
            off = Int64(i) * VEC_BYTES
            x0, x1, x2, x3 = _ld_v4(src + off)
            x0, x1, x2, x3 = _sanitize(x0), _sanitize(x1), _sanitize(x2), _sanitize(x3)
            for s in cutlass.range_constexpr(self.world):
                _st_volatile_v4(push_bases[s] + off, x0, x1, x2, x3)
            i += stride

    @cute.jit
    def _finish(self, ctl: Int64, gen: Int64, tidx: Int32, gdim: Int32):
        """The last CTA out flips the generation (read by the next launch after its PDL wait)."""
        cute.arch.sync_threads()
        if tidx == 0:
            arrived = _atomic_inc_u32(ctl + 4)
            if arrived == Uint32(gdim - 1):
                _st_volatile_u32(ctl + 4, Uint32(0))
                _st_volatile_u32(ctl, Uint32(gen ^ 1))

    @cute.jit
    def _body(self, inp: Int64, residual: Int64, out: Int64, peers: cute.Pointer, ctl: Int64,
              status: Int64, rank: Int32, rows: Int32, timeout_us: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        peer_tab = cute.make_tensor(peers, cute.make_layout(self.world))
        num_chunks = rows * self.chunks_per_row
        first = bidx * CTA_THREADS + tidx
        stride = gdim * CTA_THREADS

        cute.arch.griddepcontrol_wait()     # inp/residual come from earlier kernels; so does ctl

        gen = Int64(_ld_volatile_u32(ctl))
        failed = _ld_volatile_u32(ctl + 8)   # a failed rank stays failed: no more waiting
        push_offset = (gen * self.world + Int64(rank)) * self.slot_bytes
        read_base = peer_tab[rank] + gen * (self.world * self.slot_bytes)

        self._push(inp, peer_tab, push_offset, first, stride, num_chunks)

        cute.arch.griddepcontrol_launch_dependents()

        timeout_ns = Int64(timeout_us) * 1000
        sentinel = Uint32(SENTINEL_WORD)
        i = first
        while i < num_chunks:
            off = Int64(i) * VEC_BYTES
            acc = [Float32(0.0)] * 8
            for s in cutlass.range_constexpr(self.world):   # FIXED rank order: same bits everywhere
                addr = read_base + s * self.slot_bytes + off
                w0, w1, w2, w3, failed = self._poll(addr, Int32(s), ctl, status, timeout_ns,
                                                    failed)
                words = (w0, w1, w2, w3)
                for k in cutlass.range_constexpr(4):
                    acc[2 * k] = acc[2 * k] + _lo_f32(words[k])
                    acc[2 * k + 1] = acc[2 * k + 1] + _hi_f32(words[k])
                _st_volatile_v4(addr, sentinel, sentinel, sentinel, sentinel)
            if self.fused:
                r0, r1, r2, r3 = _ld_v4(residual + off)
                res = (r0, r1, r2, r3)
                for k in cutlass.range_constexpr(4):
                    acc[2 * k] = _lo_f32(res[k]) + acc[2 * k]
                    acc[2 * k + 1] = _hi_f32(res[k]) + acc[2 * k + 1]
            _st_v4(out + off, _pack_bf16x2(acc[0], acc[1]), _pack_bf16x2(acc[2], acc[3]),
                   _pack_bf16x2(acc[4], acc[5]), _pack_bf16x2(acc[6], acc[7]))
            i += stride

        self._finish(ctl, gen, tidx, gdim)

    @cute.kernel
    def kernel(self, inp: cute.Pointer, out: cute.Pointer, peers: cute.Pointer,
               control: cute.Pointer, status: cute.Pointer, rank: Int32, rows: Int32,
               timeout_us: Int32):
        self._body(inp.toint(), Int64(0), out.toint(), peers, control.toint(), status.toint(),
                   rank, rows, timeout_us)

    @cute.kernel
    def kernel_residual(self, inp: cute.Pointer, residual: cute.Pointer, out: cute.Pointer,
                        peers: cute.Pointer, control: cute.Pointer, status: cute.Pointer,
                        rank: Int32, rows: Int32, timeout_us: Int32):
        self._body(inp.toint(), residual.toint(), out.toint(), peers, control.toint(),
                   status.toint(), rank, rows, timeout_us)

    @cute.jit
    def launch(self, inp: cute.Pointer, out: cute.Pointer, peers: cute.Pointer,
               control: cute.Pointer, status: cute.Pointer, rank: Int32, rows: Int32,
               timeout_us: Int32, stream: cuda.CUstream):
        self.kernel(inp, out, peers, control, status, rank, rows, timeout_us).launch(
            grid=[MAX_CTAS, 1, 1], block=[CTA_THREADS, 1, 1], stream=stream, use_pdl=True)

    @cute.jit
    def launch_residual(self, inp: cute.Pointer, residual: cute.Pointer, out: cute.Pointer,
                        peers: cute.Pointer, control: cute.Pointer, status: cute.Pointer,
                        rank: Int32, rows: Int32, timeout_us: Int32, stream: cuda.CUstream):
        self.kernel_residual(inp, residual, out, peers, control, status, rank, rows,
                             timeout_us).launch(grid=[MAX_CTAS, 1, 1], block=[CTA_THREADS, 1, 1],
                                                stream=stream, use_pdl=True)


# ---- the all-gather (allreduce_ref GatherSpec: column blocks, the same buffers) -----------------

class AllGatherSm90(OneShotAllReduceSm90):
    """Kernel object for one GatherSpec: push C lanes per row, copy each source's slot into its
    column block of out (the all-reduce's poll, with no arithmetic)."""

    def __init__(self, spec: GatherSpec):
        self.spec = spec
        self.world = spec.world
        self.chunks_per_row = spec.chunks_per_row
        self.slot_bytes = spec.slot_bytes
        self.cols = spec.cols

    @cute.kernel
    def kernel(self, inp: cute.Pointer, out: cute.Pointer, peers: cute.Pointer,
               control: cute.Pointer, status: cute.Pointer, rank: Int32, rows: Int32,
               timeout_us: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        peer_tab = cute.make_tensor(peers, cute.make_layout(self.world))
        ctl, stat, src, dst = control.toint(), status.toint(), inp.toint(), out.toint()
        num_chunks = rows * self.chunks_per_row
        first = bidx * CTA_THREADS + tidx
        stride = gdim * CTA_THREADS

        cute.arch.griddepcontrol_wait()     # inp is the Engram lookup's output

        gen = Int64(_ld_volatile_u32(ctl))
        failed = _ld_volatile_u32(ctl + 8)
        push_offset = (gen * self.world + Int64(rank)) * self.slot_bytes
        read_base = peer_tab[rank] + gen * (self.world * self.slot_bytes)
        self._push(src, peer_tab, push_offset, first, stride, num_chunks)

        cute.arch.griddepcontrol_launch_dependents()

        timeout_ns = Int64(timeout_us) * 1000
        sentinel = Uint32(SENTINEL_WORD)
        i = first
        while i < num_chunks:
            row = i // self.chunks_per_row
            chunk = i - row * self.chunks_per_row
            off = Int64(i) * VEC_BYTES
            out_row = dst + Int64(row) * (self.world * self.cols * 2) + Int64(chunk) * VEC_BYTES
            for s in cutlass.range_constexpr(self.world):
                addr = read_base + s * self.slot_bytes + off
                w0, w1, w2, w3, failed = self._poll(addr, Int32(s), ctl, stat, timeout_ns,
                                                    failed)
                _st_v4(out_row + s * self.cols * 2, w0, w1, w2, w3)
                _st_volatile_v4(addr, sentinel, sentinel, sentinel, sentinel)
            i += stride

        self._finish(ctl, gen, tidx, gdim)

    @cute.jit
    def launch(self, inp: cute.Pointer, out: cute.Pointer, peers: cute.Pointer,
               control: cute.Pointer, status: cute.Pointer, rank: Int32, rows: Int32,
               timeout_us: Int32, stream: cuda.CUstream):
        self.kernel(inp, out, peers, control, status, rank, rows, timeout_us).launch(
            grid=[MAX_CTAS, 1, 1], block=[CTA_THREADS, 1, 1], stream=stream, use_pdl=True)


# ---- the cross-rank greedy pick (allreduce_ref: one u64 key per row on the same buffers) ---------

@cute.jit
def _pick_key(bits: Uint32, index: Uint32):
    """ordered(value) << 32 | ~index, -0 as +0: the lm_head kernel's candidate order."""
    return cute.arch.inline_ptx(
        "{ .reg .b32 b, o, n, i; .reg .pred z, neg;\n"
        " setp.eq.b32 z, {$r0}, 0x80000000; selp.b32 b, 0, {$r0}, z;\n"
        " setp.lt.s32 neg, b, 0; not.b32 n, b; or.b32 o, b, 0x80000000; selp.b32 o, n, o, neg;\n"
        " not.b32 i, {$r1}; mov.b64 {$w0}, {i, o}; }",
        write_only_types=[Int64], read_only_args=[bits, index])


@cute.jit
def _ld_v2(addr: Int64):
    return cute.arch.inline_ptx("ld.global.v2.b32 {{$w0}, {$w1}}, [{$r0}];",
                                write_only_types=[Uint32] * 2, read_only_args=[addr])


@cute.jit
def _ld_volatile_b64(addr: Int64):
    return cute.arch.inline_ptx("ld.volatile.global.b64 {$w0}, [{$r0}];",
                                write_only_types=[Int64], read_only_args=[addr])


@cute.jit
def _st_volatile_b64(addr: Int64, value: Int64):
    cute.arch.inline_ptx("st.volatile.global.b64 [{$r0}], {$r1};", read_only_args=[addr, value])


@cute.jit
def _st_b64(addr: Int64, value: Int64):
    cute.arch.inline_ptx("st.global.b64 [{$r0}], {$r1};", read_only_args=[addr, value])


@cute.jit
def _max_u64(a: Int64, b: Int64):
    return cute.arch.inline_ptx("max.u64 {$w0}, {$r0}, {$r1};", write_only_types=[Int64],
                                read_only_args=[a, b])


@cute.jit
def _token_of(key: Int64):
    """int64(~low 32 bits of the key): the global vocab index."""
    return cute.arch.inline_ptx(
        "{ .reg .b32 lo, hi; mov.b64 {lo, hi}, {$r0}; not.b32 lo, lo;\n"
        " cvt.u64.u32 {$w0}, lo; }", write_only_types=[Int64], read_only_args=[key])


class CrossRankPickSm90:
    """Kernel object for one PickSpec: thread r pushes, polls and picks row r."""

    def __init__(self, spec: PickSpec):
        self.spec = spec
        self.world = spec.world
        self.slot_bytes = spec.slot_bytes

    @cute.kernel
    def kernel(self, pairs: cute.Pointer, tokens: cute.Pointer, peers: cute.Pointer,
               control: cute.Pointer, status: cute.Pointer, rank: Int32, rows: Int32,
               timeout_us: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        peer_tab = cute.make_tensor(peers, cute.make_layout(self.world))
        ctl, stat = control.toint(), status.toint()
        row_off = Int64(tidx) * 8

        cute.arch.griddepcontrol_wait()     # pairs come from the lm_head kernel

        gen = Int64(_ld_volatile_u32(ctl))
        failed = _ld_volatile_u32(ctl + 8)
        push_offset = (gen * self.world + Int64(rank)) * self.slot_bytes + row_off
        if tidx < rows:
            bits, index = _ld_v2(pairs.toint() + row_off)
            key = _pick_key(bits, index)
            for s in cutlass.range_constexpr(self.world):
                _st_volatile_b64(peer_tab[s] + push_offset, key)

        cute.arch.griddepcontrol_launch_dependents()

        if tidx < rows:
            timeout_ns = Int64(timeout_us) * 1000
            sentinel = Int64(PICK_SENTINEL - (1 << 64))
            read_base = peer_tab[rank] + gen * (self.world * self.slot_bytes) + row_off
            best = Int64(0)
            for s in cutlass.range_constexpr(self.world):    # rank order, like the all-reduce
                addr = read_base + s * self.slot_bytes
                key = _ld_volatile_b64(addr)
                start = cute.arch.globaltimer()
                while key == sentinel and failed == Uint32(0):
                    key = _ld_volatile_b64(addr)
                    if key == sentinel:
                        if cute.arch.globaltimer() - start > timeout_ns:
                            _st_volatile_u32(stat + Int64(s) * 4, Uint32(1))
                            _st_volatile_u32(ctl + 8, Uint32(1))
                            failed = Uint32(1)
                        else:
                            failed = _ld_volatile_u32(ctl + 8)
                best = _max_u64(best, key)
                _st_volatile_b64(addr, sentinel)
            _st_b64(tokens.toint() + row_off, _token_of(best))

        cute.arch.sync_threads()
        if tidx == 0:                       # one CTA: it is the last to finish
            _st_volatile_u32(ctl, Uint32(gen ^ 1))

    @cute.jit
    def launch(self, pairs: cute.Pointer, tokens: cute.Pointer, peers: cute.Pointer,
               control: cute.Pointer, status: cute.Pointer, rank: Int32, rows: Int32,
               timeout_us: Int32, stream: cuda.CUstream):
        self.kernel(pairs, tokens, peers, control, status, rank, rows, timeout_us).launch(
            grid=[1, 1, 1], block=[self.spec.block[0], 1, 1], stream=stream, use_pdl=True)


def kernel_function(spec: OneShotSpec | PickSpec | GatherSpec):
    """The @cute.kernel whose Python signature the build checks against spec.params."""
    if isinstance(spec, PickSpec):
        return CrossRankPickSm90.kernel
    if isinstance(spec, GatherSpec):
        return AllGatherSm90.kernel
    fused = spec.epilogue == "residual"
    return OneShotAllReduceSm90.kernel_residual if fused else OneShotAllReduceSm90.kernel


def specs(cfg, tp: int) -> list[OneShotSpec | PickSpec | GatherSpec]:
    """Plain and residual-fused one-shot all-reduce at the hidden width for this TP degree, the
    cross-rank pick on the same buffers, and (Engram models) the all-gathers of a rank's
    looked-up heads and of its wkv output pieces."""
    if tp not in WORLD_SIZES:
        return []                       # TP1 needs no all-reduce
    out = [make_spec(tp, cfg.hidden_size, epilogue) for epilogue in ("none", "residual")]
    out.append(make_pick_spec(tp, cfg.hidden_size))
    if cfg.engram_layer_ids:
        cols = cfg.rank_shapes(tp).engram_hash_cols * cfg.engram_head_dim
        kv_cols = engram_kernel_ref.kv_pieces(cfg, tp)[1]      # the sharded wkv's pieces
        out += [make_gather_spec(tp, cfg.hidden_size, c) for c in sorted({cols, kv_cols})]
    return out


def compile_spec(spec: OneShotSpec | PickSpec | GatherSpec, options: str = "--gpu-arch sm_90a"):
    """cute.compile one one-shot all-reduce with pointer / Int32 arguments only."""
    from cutlass.cute.runtime import make_ptr

    def ptr(dtype, align=16):
        return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=align)

    tail = (ptr(Int64, 8), ptr(Uint32, 4), ptr(Uint32, 4), Int32(0), Int32(1), Int32(1),
            cuda.CUstream(0))
    if isinstance(spec, PickSpec):
        return cute.compile(CrossRankPickSm90(spec).launch, ptr(Int32, 8), ptr(Int64, 8), *tail,
                            options=options)
    if isinstance(spec, GatherSpec):
        return cute.compile(AllGatherSm90(spec).launch, ptr(BFloat16), ptr(BFloat16), *tail,
                            options=options)
    kern = OneShotAllReduceSm90(spec)
    if spec.epilogue == "residual":
        return cute.compile(kern.launch_residual, ptr(BFloat16), ptr(BFloat16), ptr(BFloat16),
                            *tail, options=options)
    return cute.compile(kern.launch, ptr(BFloat16), ptr(BFloat16), *tail, options=options)
