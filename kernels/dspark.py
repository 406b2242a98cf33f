"""DSpark round kernels for SM90 in the CuTe DSL: aux, acceptance, rollback, Markov, row advance.

Spec, ABI and reference: `kernels/dspark_ref.py`. All three are tiny (a few kB per step) and run
inside the captured round, so they read the device-side counts and never the host:
- aux: each thread one 16-byte chunk of each of the S streams, fp32 sum in stream order, * 0.25,
  one bf16 rounding; grid-stride over rows * D / 8 chunks;
- accept: one thread per row; it finds its block's first row (a backward scan of at most
  max_block - 1 rows: a sequence's rows are adjacent) and walks the block's drafts forward;
- rollback: one CTA per row, 256 threads of four fp32 NaN each over the 1024-wide ring row;
- markov: one CTA per 256 local vocab columns, one column a thread; per sequence the w1 row of
  `prev` goes to shared memory (fp32), each thread sums its column's m products in order (w2 as
  16-byte loads); the best (larger value, then lower index: a strict order, so np.argmax's first
  maximum whatever the reduction order) by warp butterflies, then thread 0 over the 8 warps, into
  partials; the last CTA (an acq_rel counter) reduces the tiles, a warp per sequence, into the
  pairs and re-zeroes the counter;
- advance: one thread per sequence slot (grid-stride); it reads only its own per-sequence
  entries and writes its k or k + 1 rows, so the in-place rewrite of the rows cannot race;
- history: one CTA, one thread per sequence slot; each thread loads the tokens its rows need
  into a register array, a CTA barrier, then the writes (another slot's rows may overlap the
  rows it read: the layouts differ), all column indices compile-time.
Nothing precedes the PDL wait: every input is an earlier kernel's output (or the previous
step's), and the outputs may still be read by the previous step's kernels.
"""
from __future__ import annotations

import cutlass
from cuda.bindings import driver as cuda
from cutlass import BFloat16, Float32, Int8, Int32, Int64, cute

from kernels.common_ref import BF16_PER_VECTOR, H200_NUM_SMS
from kernels.dspark_ref import (
    CTA_THREADS,
    KIND_DECODE,
    NAN_BITS,
    RING_WIDTH,
    AcceptSpec,
    AdvanceSpec,
    AuxSpec,
    HistorySpec,
    MarkovSpec,
    RollbackSpec,
    markov_specs_for,
    specs_for,
)
from kernels.mhc import atomic_add_acq_rel, bf16x2_to_f32, fence_gpu, shfl_xor_i32
from kernels.ptx import (
    ld_f32,
    ld_f32_gpu,
    ld_v4_u32,
    lds_f32,
    lds_s32,
    shfl_xor_f32,
    st_f32,
    st_s32,
    sts_f32,
    sts_s32,
)

VEC = BF16_PER_VECTOR
ONE = (1,)
WARP = 32
WARPS = CTA_THREADS // WARP


@cute.jit
def _load(ptr: cute.Pointer, i):
    return cute.make_tensor(ptr + i, cute.make_layout(ONE))[0]


@cute.jit
def _store(ptr: cute.Pointer, i, value):
    cute.make_tensor(ptr + i, cute.make_layout(ONE))[0] = value


@cute.jit
def _block_start(seq_index: cute.Pointer, r: Int32, seq: Int32, max_block: int) -> Int32:
    """The first row of row r's block (rows of a sequence are adjacent, at most max_block)."""
    first = r
    for _ in cutlass.range_constexpr(max_block - 1):
        if first > 0:   # noqa: SIM102 -- nested: the DSL's `and` would load seq_index[-1]
            if _load(seq_index, first - 1) == seq:
                first -= 1
    return first


@cute.jit
def _warp_best(value: Float32, index: Int32):
    """The warp's best (value, index): larger value, then lower index. A strict total order on
    distinct indices, so the butterfly's result does not depend on the exchange order and is
    np.argmax's first maximum."""
    for sh in cutlass.range_constexpr(5):
        other_v = shfl_xor_f32(value, 16 >> sh)
        other_i = shfl_xor_i32(index, 16 >> sh)
        if other_v > value or (other_v == value and other_i < index):
            value, index = other_v, other_i
    return value, index


class AuxSm90:
    """Kernel object for one AuxSpec."""

    def __init__(self, spec: AuxSpec):
        self.spec = spec

    @cute.jit
    def __call__(self, streams: cute.Pointer, aux: cute.Pointer, target: Int32, rows: Int32,
                 stream: cuda.CUstream):
        self.kernel(streams, aux, target, rows).launch(
            grid=[H200_NUM_SMS, 1, 1], block=list(self.spec.block),
            stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, streams: cute.Pointer, aux: cute.Pointer, target: Int32, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        spec = self.spec
        chunk = cute.make_layout((VEC,))
        per_row = spec.chunks_per_row
        i = bidx * CTA_THREADS + tidx

        cute.arch.griddepcontrol_wait()     # the streams come from this layer's mhc_pre

        while i < rows * per_row:
            row = i // per_row
            col = (i - row * per_row) * VEC
            base = row * (spec.streams * spec.width) + col
            held = cute.make_rmem_tensor(chunk, BFloat16)
            cute.autovec_copy(cute.make_tensor(streams + base, chunk), held)
            total = held.load().to(Float32)
            for s in cutlass.range_constexpr(1, spec.streams):
                cute.autovec_copy(cute.make_tensor(streams + (base + s * spec.width), chunk),
                                  held)
                total = total + held.load().to(Float32)
            mean = cute.make_rmem_tensor(chunk, BFloat16)
            mean.store((total * Float32(1.0 / spec.streams)).to(BFloat16))
            out = row * (spec.targets * spec.width) + target * spec.width + col
            cute.autovec_copy(mean, cute.make_tensor(aux + out, chunk))
            i += gdim * CTA_THREADS

        cute.arch.griddepcontrol_launch_dependents()


class AcceptSm90:
    """Kernel object for one AcceptSpec."""

    def __init__(self, spec: AcceptSpec):
        self.spec = spec

    @cute.jit
    def __call__(self, token_ids: cute.Pointer, tokens: cute.Pointer, seq_index: cute.Pointer,
                 slot_mapping: cute.Pointer, accepted: cute.Pointer, bonus: cute.Pointer,
                 context_slots: cute.Pointer, rows: Int32, stream: cuda.CUstream):
        self.kernel(token_ids, tokens, seq_index, slot_mapping, accepted, bonus,
                    context_slots, rows).launch(
            grid=[1, 1, 1], block=list(self.spec.block), stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, token_ids: cute.Pointer, tokens: cute.Pointer, seq_index: cute.Pointer,
               slot_mapping: cute.Pointer, accepted: cute.Pointer, bonus: cute.Pointer,
               context_slots: cute.Pointer, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        r = bidx * CTA_THREADS + tidx

        cute.arch.griddepcontrol_wait()     # tokens: the verify step's greedy pick

        while r < rows:
            seq = _load(seq_index, r)
            slot = Int64(-1)
            if seq >= 0:
                first = _block_start(seq_index, r, seq, self.spec.max_block)
                count, going = Int32(0), Int32(1)
                for k in cutlass.range_constexpr(self.spec.max_block - 1):
                    nxt = first + (k + 1)
                    if going != 0 and nxt < rows:
                        if _load(seq_index, nxt) == seq and \
                                _load(token_ids, nxt) == _load(tokens, first + k):
                            count += 1
                        else:
                            going = Int32(0)
                    else:
                        going = Int32(0)
                if r == first:
                    _store(accepted, seq, count)
                    _store(bonus, seq, _load(tokens, first + count))
                if r - first <= count:
                    slot = _load(slot_mapping, r)
            _store(context_slots, r, slot)
            r += gdim * CTA_THREADS

        cute.arch.griddepcontrol_launch_dependents()


class RollbackSm90:
    """Kernel object for one RollbackSpec."""

    def __init__(self, spec: RollbackSpec):
        self.spec = spec

    @cute.jit
    def __call__(self, ring: cute.Pointer, positions: cute.Pointer, seq_index: cute.Pointer,
                 state_lines: cute.Pointer, accepted: cute.Pointer, rows: Int32,
                 stream: cuda.CUstream):
        self.kernel(ring, positions, seq_index, state_lines, accepted, rows).launch(
            grid=[rows, 1, 1], block=list(self.spec.block), stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, ring: cute.Pointer, positions: cute.Pointer, seq_index: cute.Pointer,
               state_lines: cute.Pointer, accepted: cute.Pointer, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        r, _, _ = cute.arch.block_idx()

        cute.arch.griddepcontrol_wait()     # accepted: the acceptance kernel's output

        seq = _load(seq_index, r)
        if seq >= 0:
            first = _block_start(seq_index, r, seq, self.spec.max_block)
            pos = _load(positions, r)
            if pos - _load(positions, first) > Int64(_load(accepted, seq)):
                line = Int64(_load(state_lines, seq))
                ring_row = line * self.spec.ring_rows + (pos & (self.spec.ring_rows - 1))
                quad = cute.make_layout((4,))
                nan = cute.make_rmem_tensor(quad, Int32)
                for j in cutlass.range_constexpr(4):
                    nan[j] = Int32(NAN_BITS)
                dst = cute.recast_ptr(ring, dtype=Int32) + (ring_row * RING_WIDTH + tidx * 4)
                cute.autovec_copy(nan, cute.make_tensor(dst, quad))

        cute.arch.griddepcontrol_launch_dependents()


class MarkovSm90:
    """Kernel object for one MarkovSpec."""

    def __init__(self, spec: MarkovSpec):
        self.spec = spec
        self.best_offset = 4 * spec.rank                # smem: w1 row | bests | flag
        self.flag_offset = self.best_offset + 8 * WARPS

    @cute.jit
    def __call__(self, base: cute.Pointer, w1: cute.Pointer, w2: cute.Pointer,
                 prev: cute.Pointer, pairs: cute.Pointer, ids: cute.Pointer,
                 partials: cute.Pointer, counter: cute.Pointer, step: Int32,
                 vocab_offset: Int32, seqs: Int32, stream: cuda.CUstream):
        self.kernel(base, w1, w2, prev, pairs, ids, partials, counter, step, vocab_offset,
                    seqs).launch(grid=[self.spec.tiles, 1, 1], block=list(self.spec.block),
                                 smem=self.spec.smem_bytes, stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, base: cute.Pointer, w1: cute.Pointer, w2: cute.Pointer,
               prev: cute.Pointer, pairs: cute.Pointer, ids: cute.Pointer,
               partials: cute.Pointer, counter: cute.Pointer, step: Int32,
               vocab_offset: Int32, seqs: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        tile, _, _ = cute.arch.block_idx()
        spec = self.spec
        smem = cutlass.memory.SmemAllocator()
        sbase = Int32(smem.allocate(spec.smem_bytes, byte_alignment=16).toint())
        v = tile * CTA_THREADS + tidx

        cute.arch.griddepcontrol_wait()     # prev: the accept kernel's bonus or the last pick

        for s in range(seqs):
            token = _load(prev, s)
            if tile == 0 and tidx == 0:
                _store(ids, s * (spec.steps + 1) + step, token)
            if step < spec.steps and token >= 0:        # prev < 0: a padding sequence
                self._tile_best(base, w1, w2, partials, sbase, tidx, tile, v, s, step, token)
        if step < spec.steps:
            fence_gpu()
            cute.arch.sync_threads()
            if tidx == 0:
                old = atomic_add_acq_rel(counter.toint(), Int32(1))
                sts_s32(sbase + self.flag_offset, Int32(old == spec.tiles - 1))
            cute.arch.sync_threads()
            if lds_s32(sbase + self.flag_offset) != 0:  # the last CTA: reduce the tiles
                fence_gpu()
                warp, lane = tidx // WARP, tidx % WARP
                s = warp
                while s < seqs:                         # a warp per sequence
                    if _load(prev, s) >= 0:
                        self._reduce(partials, pairs, s, lane, vocab_offset)
                    s += WARPS
                if tidx == 0:
                    st_s32(counter.toint(), Int32(0))

        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def _tile_best(self, base: cute.Pointer, w1: cute.Pointer, w2: cute.Pointer,
                   partials: cute.Pointer, sbase: Int32, tidx: Int32, tile: Int32, v: Int32,
                   s: Int32, step: Int32, token: Int64):
        """This tile's first best (value, index) of sequence s into partials[s, tile]."""
        spec = self.spec
        if tidx < spec.rank // VEC:                     # the w1 row of prev, as fp32, in smem
            words = ld_v4_u32(w1.toint() + token * (spec.rank * 2) + tidx * 16)
            for q in cutlass.range_constexpr(4):
                lo, hi = bf16x2_to_f32(words[q])
                sts_f32(sbase + (tidx * VEC + 2 * q) * 4, lo)
                sts_f32(sbase + (tidx * VEC + 2 * q + 1) * 4, hi)
        cute.arch.sync_threads()
        best, best_i = Float32(-float("inf")), Int32(0x7FFFFFFF)
        if v < spec.vocab:
            acc = Float32(0.0)
            row2 = w2.toint() + Int64(v) * (spec.rank * 2)
            for c in range(spec.rank // VEC):
                words = ld_v4_u32(row2 + c * 16, streaming=True)
                for q in cutlass.range_constexpr(4):
                    lo, hi = bf16x2_to_f32(words[q])
                    acc = acc + lds_f32(sbase + (c * VEC + 2 * q) * 4) * lo
                    acc = acc + lds_f32(sbase + (c * VEC + 2 * q + 1) * 4) * hi
            row = Int64(s * spec.steps + step)
            best = ld_f32(base.toint() + (row * spec.vocab + v) * 4) + acc
            best_i = v
        best, best_i = _warp_best(best, best_i)
        warp, lane = tidx // WARP, tidx % WARP
        if lane == 0:
            sts_f32(sbase + self.best_offset + warp * 4, best)
            sts_s32(sbase + self.best_offset + (WARPS + warp) * 4, best_i)
        cute.arch.sync_threads()
        if tidx == 0:
            for w in cutlass.range_constexpr(1, WARPS):
                value = lds_f32(sbase + self.best_offset + w * 4)
                index = lds_s32(sbase + self.best_offset + (WARPS + w) * 4)
                if value > best or (value == best and index < best_i):
                    best, best_i = value, index
            out = partials.toint() + (Int64(s) * spec.tiles + tile) * 8
            st_f32(out, best)
            st_f32(out + 4, Float32(best_i))
        cute.arch.sync_threads()                        # smem is reused by the next sequence

    @cute.jit
    def _reduce(self, partials: cute.Pointer, pairs: cute.Pointer, s: Int32, lane: Int32,
                vocab_offset: Int32):
        """The tiles' bests of sequence s (lanes stride over the tiles) -> pairs[s]."""
        spec = self.spec
        row = partials.toint() + Int64(s) * (spec.tiles * 8)
        best, best_i = Float32(-float("inf")), Int32(0x7FFFFFFF)
        t = lane
        while t < spec.tiles:
            value, index = ld_f32_gpu(row + t * 8), Int32(ld_f32_gpu(row + t * 8 + 4))
            if value > best or (value == best and index < best_i):
                best, best_i = value, index
            t += WARP
        best, best_i = _warp_best(best, best_i)
        if lane == 0:
            out = pairs.toint() + Int64(s) * 8
            st_f32(out, best)
            st_s32(out + 4, best_i + vocab_offset)


class AdvanceSm90:
    """Kernel object for one AdvanceSpec."""

    def __init__(self, spec: AdvanceSpec):
        self.spec = spec

    @cute.jit
    def __call__(self, token_ids: cute.Pointer, positions: cute.Pointer,
                 seq_index: cute.Pointer, slot_mapping: cute.Pointer, block_kind: cute.Pointer,
                 context_lens: cute.Pointer, state_lines: cute.Pointer, accepted: cute.Pointer,
                 bonus: cute.Pointer, ring_slots: Int32, seqs: Int32, stream: cuda.CUstream):
        self.kernel(token_ids, positions, seq_index, slot_mapping, block_kind, context_lens,
                    state_lines, accepted, bonus, ring_slots, seqs).launch(
            grid=[1, 1, 1], block=list(self.spec.block), stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, token_ids: cute.Pointer, positions: cute.Pointer, seq_index: cute.Pointer,
               slot_mapping: cute.Pointer, block_kind: cute.Pointer, context_lens: cute.Pointer,
               state_lines: cute.Pointer, accepted: cute.Pointer, bonus: cute.Pointer,
               ring_slots: Int32, seqs: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        spec = self.spec
        s = bidx * CTA_THREADS + tidx

        cute.arch.griddepcontrol_wait()     # accepted, bonus; every reader of the rows is done

        while s < seqs:
            token = _load(bonus, s)
            if token < 0:                   # a padding sequence slot of the bucket
                for j in cutlass.range_constexpr(spec.width):
                    row = s * spec.width + j
                    _store(token_ids, row, Int64(0))
                    _store(positions, row, Int64(0))
                    _store(seq_index, row, Int32(-1))
                    _store(slot_mapping, row, Int64(-1))
                    _store(block_kind, row, Int8(KIND_DECODE))
                _store(context_lens, s, Int64(0))
            else:
                start = _load(context_lens, s) - spec.steps
                if not spec.to_verify:
                    start = start + Int64(_load(accepted, s))
                line = Int64(_load(state_lines, s)) * Int64(ring_slots)
                for j in cutlass.range_constexpr(spec.width):
                    row = s * spec.width + j
                    pos = start + j
                    _store(positions, row, pos)
                    _store(seq_index, row, s)
                    _store(slot_mapping, row, line + pos % Int64(ring_slots))
                    _store(block_kind, row, Int8(spec.kind))
                    if not spec.to_verify:
                        _store(token_ids, row, token if j == 0 else Int64(spec.noise_token))
                _store(context_lens, s, start + spec.width)
            s += gdim * CTA_THREADS

        cute.arch.griddepcontrol_launch_dependents()


class HistorySm90:
    """Kernel object for one HistorySpec."""

    def __init__(self, spec: HistorySpec):
        self.spec = spec

    @cute.jit
    def __call__(self, token_ids: cute.Pointer, token_history: cute.Pointer,
                 accepted: cute.Pointer, bonus: cute.Pointer, seqs: Int32,
                 stream: cuda.CUstream):
        self.kernel(token_ids, token_history, accepted, bonus, seqs).launch(
            grid=[1, 1, 1], block=list(self.spec.block), stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, token_ids: cute.Pointer, token_history: cute.Pointer,
               accepted: cute.Pointer, bonus: cute.Pointer, seqs: Int32):
        s, _, _ = cute.arch.thread_idx()
        spec = self.spec
        k, c = spec.steps, spec.cols
        held = cute.make_rmem_tensor(cute.make_layout((c,)), Int64)   # the tail before P'
        live = Int32(0)
        token = Int64(-1)

        cute.arch.griddepcontrol_wait()     # accepted, bonus, the Markov stages' token_ids

        if s < seqs:
            token = _load(bonus, s)
            if token >= 0:
                live = Int32(1)
                if spec.to_verify:
                    for m in cutlass.range_constexpr(c):        # the draft block's first row
                        held[m] = _load(token_history, (s * k) * c + m)
                else:
                    f = s * (k + 1)
                    a = _load(accepted, s)
                    for m in cutlass.range_constexpr(c):        # the verify block, its history
                        if a >= m:
                            held[m] = _load(token_ids, f + a - m)
                        else:
                            held[m] = _load(token_history, f * c + (m - a - 1))
        cute.arch.sync_threads()            # every read above before any write below

        if live != 0:
            if spec.to_verify:              # token_ids: the Markov stages', not written here
                for j in cutlass.range_constexpr(k + 1):
                    row = s * (k + 1) + j
                    for m in cutlass.range_constexpr(c):
                        if j > m:
                            _store(token_history, row * c + m,
                                   _load(token_ids, s * (k + 1) + (j - 1 - m)))
                        else:
                            _store(token_history, row * c + m, held[m - j])
            else:
                for j in cutlass.range_constexpr(k):
                    row = s * k + j
                    for m in cutlass.range_constexpr(c):
                        if j > m:
                            _store(token_history, row * c + m,
                                   token if j - 1 - m == 0 else Int64(spec.noise_token))
                        else:
                            _store(token_history, row * c + m, held[m - j])

        cute.arch.griddepcontrol_launch_dependents()


_KERNELS = {AuxSpec: AuxSm90, AcceptSpec: AcceptSm90, RollbackSpec: RollbackSm90,
            MarkovSpec: MarkovSm90, AdvanceSpec: AdvanceSm90, HistorySpec: HistorySm90}


def kernel_function(spec):
    """The @cute.kernel whose Python signature the build checks against spec.params."""
    return _KERNELS[type(spec)].kernel


def specs(cfg, tp: int) -> list:
    return specs_for(cfg) + markov_specs_for(cfg, tp)


def compile_spec(spec, options: str = "--gpu-arch sm_90a"):
    """cute.compile one DSpark round kernel with pointer / Int32 arguments only."""
    from cutlass.cute.runtime import make_ptr

    def ptr(dtype, align):
        return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=align)

    stream = cuda.CUstream(0)
    if isinstance(spec, AuxSpec):
        return cute.compile(AuxSm90(spec), ptr(BFloat16, 16), ptr(BFloat16, 16), Int32(0),
                            Int32(1), stream, options=options)
    if isinstance(spec, AcceptSpec):
        return cute.compile(AcceptSm90(spec), ptr(Int64, 8), ptr(Int64, 8), ptr(Int32, 4),
                            ptr(Int64, 8), ptr(Int32, 4), ptr(Int64, 8), ptr(Int64, 8),
                            Int32(1), stream, options=options)
    if isinstance(spec, MarkovSpec):
        return cute.compile(MarkovSm90(spec), ptr(Float32, 16), ptr(BFloat16, 16),
                            ptr(BFloat16, 16), ptr(Int64, 8), ptr(Int32, 8), ptr(Int64, 8),
                            ptr(Float32, 8), ptr(Int32, 4), Int32(0), Int32(0), Int32(1), stream,
                            options=options)
    if isinstance(spec, AdvanceSpec):
        return cute.compile(AdvanceSm90(spec), ptr(Int64, 8), ptr(Int64, 8), ptr(Int32, 4),
                            ptr(Int64, 8), ptr(Int8, 1), ptr(Int64, 8), ptr(Int32, 4),
                            ptr(Int32, 4), ptr(Int64, 8), Int32(1), Int32(1), stream,
                            options=options)
    if isinstance(spec, HistorySpec):
        return cute.compile(HistorySm90(spec), ptr(Int64, 8), ptr(Int64, 8), ptr(Int32, 4),
                            ptr(Int64, 8), Int32(1), stream, options=options)
    return cute.compile(RollbackSm90(spec), ptr(Float32, 16), ptr(Int64, 8), ptr(Int32, 4),
                        ptr(Int32, 4), ptr(Int32, 4), Int32(1), stream, options=options)
