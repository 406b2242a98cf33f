"""The polled handoff of the lean mHC tail (variant `_lean_poll`): tagged words, a consumer CTA a row.

`MhcPreSm90` (kernels/mhc.py) inherits these methods; the rows' body, the coefficient row and the
norm's arithmetic are the lean ones (kernels/mhc_lean.py), so every output is bitwise that of
`_lean` (same products, same summation orders). What changes is how the last step gets its data:

- `_lean` elects the last CTA of a row block (fence, acq_rel atomic, barrier: two L2 round trips
  after the slowest CTA's partials) and that one CTA reduces, solves and normalises every row of
  the block in turn.
- `_lean_poll`: every 64-bit word a consumer needs carries its own tag (payload in the low half,
  POLL_TAG in the high half; a 64-bit access is single-copy atomic, so a tagged word holds its
  payload and no fence is needed). Producers store the row's 25 slice partials and its x as
  bf16 pairs into `workspace` (the exchange, `MhcPreSpec.exchange_row_bytes` a row),
  trigger the dependents and go; consumer CTAs poll the words they need, zero them for the next
  launch (whose producers write only after its griddepcontrol.wait, i.e. after this grid) and
  finish. Tasks: row rl's coefficients (task 2·rl) and its RMSNorm (task 2·rl + 1; the norm is
  always fused) run on CTA `task mod slices`, so the rows of a block and the norm run side by side
  instead of one after another in one CTA.
- A poll gives up after POLL_TIMEOUT_NS (a bug or a lost producer: wrong outputs, never a hang)
  and then sets the sticky flag `counters[0]` (u32; the variant has no counters otherwise): the
  host reads it (the step's `mhc.poll_status`), the GPU tests require it zero.

Consumers spin while producers may not be resident yet. The grid is dispatched in order and a
block's 80 CTAs (< 132 SMs) fit at once, so every block's producers run; the dependents launch
only once every CTA has triggered (after its body), so they never take a producer's SM.
"""
from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, Int64, cute
from cutlass.cutlass_dsl import T

from kernels.mhc_kernel_ref import (
    CTA_THREADS,
    MIX_DIM,
    PARTIALS,
    REDUCE_CHUNK,
    ROWS_PER_CTA,
)
from kernels.mhc_lean import norm_geometry
from kernels.ptx import asm, lds_f32, sts_f32, void

MIX_SPLIT = 4                        # `_ms`: warps sharing a row's mixes (passes of 4 rows)
POLL_TAG = 1                         # high half of a written exchange word; 0 = not yet written
POLL_TIMEOUT_NS = 2_000_000          # a consumer gives up (flag set, wrong outputs, no hang)


# ---- inline PTX of the tagged exchange -----------------------------------------------------------

def st_tagged(addr: Int64, payload: Int32):
    """(payload, POLL_TAG) as one relaxed 64-bit store (single-copy atomic)."""
    void([Int64(addr), Int32(payload)], "{ .reg .b32 t; .reg .b64 w; mov.b32 t, "
         f"{POLL_TAG}; mov.b64 w, {{$1, t}}; st.relaxed.gpu.global.b64 [$0], w; }}", "l,r")


def st_tagged2(addr: Int64, a: Int32, b: Int32):
    """Two tagged words at addr, addr + 8 (16-byte aligned): one store, each word atomic."""
    void([Int64(addr), Int32(a), Int32(b)], "{ .reg .b32 t; .reg .b64 u, v; mov.b32 t, "
         f"{POLL_TAG}; mov.b64 u, {{$1, t}}; mov.b64 v, {{$2, t}};\n"
         "st.relaxed.gpu.global.v2.b64 [$0], {u, v}; }", "l,r,r")


def ld_tagged2(addr: Int64):
    """(a, b, both tagged: 1 / 0) of the two words at addr (16-byte aligned), at L2."""
    a, b, ok = asm(3, [Int64(addr)], "{ .reg .b32 ta, tb; .reg .b64 u, v;\n"
                   "ld.relaxed.gpu.global.v2.b64 {u, v}, [$3];\n"
                   "mov.b64 {$0, ta}, u; mov.b64 {$1, tb}, v;\n"
                   f".reg .pred p; and.b32 ta, ta, tb; setp.eq.u32 p, ta, {POLL_TAG};\n"
                   "selp.u32 $2, 1, 0, p; }", "=r,=r,=r,l", side_effects=True)
    return Int32(a), Int32(b), Int32(ok)


def st_zero2(addr: Int64):
    """Two exchange words back to empty (16-byte aligned)."""
    void([Int64(addr)], "{ .reg .b64 z; mov.b64 z, 0;\n"
         "st.relaxed.gpu.global.v2.b64 [$0], {z, z}; }", "l")


def st_flag(addr: Int64):
    void([Int64(addr)], "st.relaxed.gpu.global.u32 [$0], 1;", "l")


def f32_bits(value: Float32) -> Int32:
    return Int32(asm(1, [Float32(value)], "mov.b32 $0, $1;", "=r,f", side_effects=False))


def bits_f32(word: Int32) -> Float32:
    return Float32(asm(1, [Int32(word)], "mov.b32 $0, $1;", "=f,r", kind=T.f32(),
                       side_effects=False))


# ---- tail ----------------------------------------------------------------------------------------

class MhcPollTail:
    """Polled tail methods; the kernel class provides spec, S, D and the smem offsets, and the
    lean methods `_lean_row`, `_lean_norm_weight`, `_norm_row` (kernels/mhc_lean.py)."""

    @cute.jit
    def _poll_store_partials(self, part, exchange: cute.Pointer, row: Int32, slice_idx: Int32,
                             dv: Int32, group: Int32, groups: cutlass.Constexpr):
        """The row's butterflied totals (every lane of its 8 holds all of them) as tagged words
        at [row][v][slice]. All 25 (groups = 1): lane dv stores v ≡ dv (mod 8). Split (part[i]
        = mix group·n + i, n = 24 / groups < 8; part[n] = Σx²): lane dv < n stores part[dv],
        lane 7 of group 0 the Σx² (one store a lane)."""
        base = exchange.toint() + Int64(row) * self.spec.exchange_row_bytes
        if cutlass.const_expr(groups == 1):
            for v in cutlass.range_constexpr(PARTIALS):
                if dv == v % 8:
                    st_tagged(base + Int64((v * self.spec.slices + slice_idx) * 8),
                              f32_bits(part[v]))
        else:
            n_m = MIX_DIM // groups
            value = part[n_m]
            v = Int32(PARTIALS - 1)
            for i in cutlass.range_constexpr(n_m):
                if dv == i:
                    value = part[i]
                    v = group * n_m + i
            if (dv < n_m) | ((dv == 7) & (group == 0)):
                st_tagged(base + Int64((v * self.spec.slices + slice_idx) * 8), f32_bits(value))

    @cute.jit
    def _poll_store_x(self, packed, exchange: cute.Pointer, row: Int32, d0: Int32):
        """The thread's 8 bf16 of x (4 packed pairs) as 4 tagged words at [row][x][d0 / 2]."""
        addr = (exchange.toint() + Int64(row) * self.spec.exchange_row_bytes
                + Int64(self.spec.exchange_x_offset + d0 * 4))
        st_tagged2(addr, packed[0], packed[1])
        st_tagged2(addr + Int64(16), packed[2], packed[3])

    @cute.jit
    def _poll_words(self, pairs, status: Int64):
        """The word pairs at the 16-byte aligned addresses `pairs`, all loads issued before any
        test (one L2 round trip a try), once every tag is set (or after POLL_TIMEOUT_NS: then
        status is flagged and what is there is used); then zeroed for the next launch."""
        words = cute.make_rmem_tensor((2 * len(pairs),), Int32)
        start = cute.arch.globaltimer()
        waiting = Int32(1)
        while waiting != 0:
            ready = Int32(1)
            for i in cutlass.range_constexpr(len(pairs)):
                a, b, ok = ld_tagged2(pairs[i])
                words[2 * i] = a
                words[2 * i + 1] = b
                ready = ready & ok
            waiting = Int32(1) - ready
            if (waiting != 0) & (cute.arch.globaltimer() - start > Int64(POLL_TIMEOUT_NS)):
                st_flag(status)
                waiting = Int32(0)
        for i in cutlass.range_constexpr(len(pairs)):
            st_zero2(pairs[i])
        return words

    @cute.jit
    def _poll_tail(self, scale: cute.Pointer, base: cute.Pointer, coeff_out: cute.Pointer,
                   mixes: cute.Pointer, exchange: cute.Pointer, counters: cute.Pointer,
                   norm_weight: cute.Pointer, x_normed: cute.Pointer, sbase: Int32,
                   slice_idx: Int32, block_row: Int32, rows: Int32, tidx: Int32,
                   norm_eps: Float32, hc_eps: Float32):
        """This CTA's tasks of its row block: coefficients of row rl (task 2·rl) and its norm
        (task 2·rl + 1), every `slices`-th task from task slice_idx."""
        live = cutlass.min(rows - block_row * ROWS_PER_CTA, ROWS_PER_CTA)
        status = counters.toint()
        for task in cutlass.range(slice_idx, live * 2, self.spec.slices, unroll=1):
            row = block_row * ROWS_PER_CTA + task // 2
            cute.arch.sync_threads()             # the body's (or last task's) smem reads done
            if task % 2 == 0:                    # CTA-uniform
                self._poll_coefficients(scale, base, coeff_out, mixes, exchange, status,
                                        sbase, row, tidx, norm_eps, hc_eps)
            else:
                self._poll_norm(exchange, status, norm_weight, x_normed, sbase, row, tidx,
                                norm_eps)

    @cute.jit
    def _poll_coefficients(self, scale: cute.Pointer, base: cute.Pointer,
                           coeff_out: cute.Pointer, mixes: cute.Pointer,
                           exchange: cute.Pointer, status: Int64, sbase: Int32, row: Int32,
                           tidx: Int32, norm_eps: Float32, hc_eps: Float32):
        """The row's 25 sums in `_lean_reduce`'s order (REDUCE_CHUNK slices in slice order, a
        unit a thread, then the chunks in order), then `_lean_row` in thread 0."""
        chunk = min(REDUCE_CHUNK, self.spec.slices)
        chunks = self.spec.reduce_chunks
        rowbase = exchange.toint() + Int64(row) * self.spec.exchange_row_bytes
        for u in cutlass.range(tidx, PARTIALS * chunks, CTA_THREADS, unroll=1):
            v, c = u // chunks, u % chunks
            first = rowbase + Int64((v * self.spec.slices + c * chunk) * 8)
            words = self._poll_words([first + Int64(16 * i) for i in range(chunk // 2)],
                                     status)
            total = bits_f32(words[0])
            for s in cutlass.range_constexpr(1, chunk):
                total = total + bits_f32(words[s])
            sts_f32(sbase + u * 4, total)
        cute.arch.sync_threads()
        if tidx < PARTIALS:
            total = lds_f32(sbase + tidx * chunks * 4)
            for c in cutlass.range_constexpr(1, chunks):
                total = total + lds_f32(sbase + (tidx * chunks + c) * 4)
            sts_f32(sbase + self.red_offset + tidx * 4, total)
        cute.arch.sync_threads()
        if tidx == 0:
            self._lean_row(scale, base, coeff_out, mixes, sbase, row, Int32(0), norm_eps,
                           hc_eps)

    @cute.jit
    def _poll_norm(self, exchange: cute.Pointer, status: Int64, norm_weight: cute.Pointer,
                   x_normed: cute.Pointer, sbase: Int32, row: Int32, tidx: Int32,
                   eps: Float32):
        """The row's RMSNorm in `kernels.norm`'s geometry and order from its tagged x words:
        the first row group polls them (other groups, at narrow widths, sum zeros and store
        nothing: only one poller may zero a word)."""
        tpr, vecs, _, _, _ = norm_geometry(self.D)
        weight = self._lean_norm_weight(norm_weight, tidx)
        xbase = (exchange.toint() + Int64(row) * self.spec.exchange_row_bytes
                 + Int64(self.spec.exchange_x_offset))
        words = cute.make_rmem_tensor((4 * vecs,), Int32)
        words.fill(0)
        if tidx < tpr:
            vec = [xbase + Int64((k * tpr + tidx) * 32) for k in range(vecs)]
            got = self._poll_words([a + Int64(16 * h) for a in vec for h in range(2)], status)
            for i in cutlass.range_constexpr(4 * vecs):
                words[i] = got[i]
        rows_words = [[words[4 * k + q] for q in range(4)] for k in range(vecs)]
        self._norm_row(rows_words, row, tidx < tpr, weight, x_normed, sbase, tidx, eps)
