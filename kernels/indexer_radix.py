"""Radix-select phases of the indexer top-k (SM90 CuTe DSL): item keys, histogram passes, output.

The `@cute.jit` phases of `indexer_topk` (`kernels/indexer.py:IndexerTopkSm90`, one CTA per row):
three shared-memory histogram passes (11/11/10 bits, `indexer_kernel_ref.RADIX_PASSES`) over the
allowed items find the k-th largest key, then a pass in item order writes the selection with a
block scan (ascending, ties to the lower index). The cluster variants
(`kernels/indexer_topk_cluster.py`) reuse `item_key` and `reverse_scan`. The kernel classes keep
their `@cute.kernel` in their own modules: the DSL names the cubin's entry after the module.
"""
from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, Int64, cute

from kernels import indexer_kernel_ref as ik
from kernels.block_scan import block_scan
from kernels.indexer_ptx import (
    _as_i32,
    atom_add_shared,
    fmax_f32,
    imin,
    ordered_key,
    select_flags,
    ushr,
)
from kernels.ptx import ld_f32, ld_s32, lds_s32, st_s32, sts_s32


class RadixSelectPhases:
    """Phases of the one-CTA radix select; the kernel class sets `spec`, `k`, `mode`, `warps`."""

    @cute.jit
    def item_key(self, src: Int64, crow: Int64, n: Int32, j: Int32):
        """(allowed, ordered key, output index) of item j."""
        allowed = Int32(0)
        key = Int32(0)
        index = j
        if cutlass.const_expr(self.mode == "entries"):
            allowed = Int32(1)
            key = ordered_key(ld_f32(src + Int64(j) * 4))
        if cutlass.const_expr(self.mode == "candidates"):
            bs = self.spec.block_size
            cb = ld_s32(crow + Int64(j // bs) * 4)
            index = cb * bs + j % bs
            if cb >= 0 and index < n:
                allowed = Int32(1)
                key = ordered_key(ld_f32(src + Int64(index) * 4))
        if cutlass.const_expr(self.mode == "blocks"):
            bs = self.spec.block_size
            allowed = Int32(1)
            best = Float32(-float("inf"))
            for e in cutlass.range_constexpr(bs):
                if j * bs + e < n:
                    best = fmax_f32(best, ld_f32(src + Int64(j * bs + e) * 4))
            if j == (n - 1) // bs:                 # the row's own block is forced in
                best = Float32(float("inf"))
            key = ordered_key(best)
        return allowed, key, index

    @cute.jit
    def held_key(self, src: Int64, crow: Int64, n: Int32, j: Int32, base: Int32,
                 first: cutlass.Constexpr):
        """item_key, or (held candidate, j < held) the key pass 1 kept in shared memory at
        base + topk_smem_bytes(): pass 1 (`first`) stores it, the later passes load it."""
        if cutlass.const_expr(self.spec.held == 0):
            return self.item_key(src, crow, n, j)
        keys = base + ik.topk_smem_bytes()
        allowed, key, index = Int32(1), Int32(0), j
        if j < self.spec.held:
            if cutlass.const_expr(first):
                allowed, key, index = self.item_key(src, crow, n, j)
                sts_s32(keys + 4 * j, key)
            else:
                key = lds_s32(keys + 4 * j)
        else:
            allowed, key, index = self.item_key(src, crow, n, j)
        return allowed, key, index

    @cute.jit
    def radix_pass(self, src: Int64, crow: Int64, n: Int32, items: Int32, prefix: Int32,
                   mask: Int32, need: Int32, shift: cutlass.Constexpr, bits: cutlass.Constexpr,
                   hist: Int32, found: Int32, totals: Int32, tidx: Int32):
        nbins = 1 << bits
        b = tidx
        while b < ik.TOPK_BINS:
            sts_s32(hist + 4 * b, Int32(0))
            b += ik.TOPK_THREADS
        cute.arch.sync_threads()
        j = tidx
        while j < items:
            allowed, key, _ = self.held_key(src, crow, n, j, hist,
                                            shift == ik.RADIX_PASSES[0][0])
            if allowed != 0 and (key & mask) == prefix:
                atom_add_shared(hist + 4 * (ushr(key, shift) & (nbins - 1)), Int32(1))
            j += ik.TOPK_THREADS
        cute.arch.sync_threads()
        # Thread t owns bins 2t, 2t+1; a scan in reversed thread order gives the counts above.
        per = ik.TOPK_BINS // ik.TOPK_THREADS
        hi_bin = Int32(0)
        lo_bin = Int32(0)
        if per * tidx + 1 < nbins:
            hi_bin = lds_s32(hist + 4 * (per * tidx + 1))
        if per * tidx < nbins:
            lo_bin = lds_s32(hist + 4 * (per * tidx))
        rev = ik.TOPK_THREADS - 1 - tidx
        excl, total = self.reverse_scan(lo_bin + hi_bin, rev, totals)
        above_hi = excl                       # items in bins above 2t+1
        above_lo = excl + hi_bin
        if above_hi < need and above_hi + hi_bin >= need:
            sts_s32(found, per * tidx + 1)
            sts_s32(found + 4, above_hi)
        if above_lo < need and above_lo + lo_bin >= need:
            sts_s32(found, per * tidx)
            sts_s32(found + 4, above_lo)
        cute.arch.sync_threads()
        take_all = Int32(0)
        new_prefix, new_mask, new_need = prefix, mask, need
        if cutlass.const_expr(shift == ik.RADIX_PASSES[0][0]):  # noqa: SIM102 - trace-time test
            if total <= need:
                take_all = Int32(1)
        if take_all == 0:
            d = lds_s32(found)
            new_need = need - lds_s32(found + 4)
            new_prefix = prefix | (d << shift)
            new_mask = mask | Int32(_as_i32((nbins - 1) << shift))
        cute.arch.sync_threads()
        return new_prefix, new_mask, new_need, take_all

    @cute.jit
    def reverse_scan(self, value: Int32, rev: Int32, totals: Int32):
        """(sum of `value` over threads with a larger tidx, total): a scan in reversed order."""
        lane = rev % ik.LANES
        warp = rev // ik.LANES
        inclusive = value
        # shuffle_sync_down on tidx == shuffle up in reversed order (lanes reverse inside a warp).
        for k in cutlass.range_constexpr(5):
            down = cute.arch.shuffle_sync_down(inclusive, offset=1 << k)
            if lane >= (1 << k):
                inclusive = inclusive + down
        if lane == ik.LANES - 1:
            sts_s32(totals + 4 * warp, inclusive)
        cute.arch.sync_threads()
        before = Int32(0)
        total = Int32(0)
        for w in cutlass.range_constexpr(self.warps):
            t = lds_s32(totals + 4 * w)
            if w < warp:
                before = before + t
            total = total + t
        cute.arch.sync_threads()
        return before + inclusive - value, total

    @cute.jit
    def ordered_output(self, src: Int64, crow: Int64, n: Int32, items: Int32, threshold: Int32,
                       need: Int32, take_all: Int32, dst: Int64, totals: Int32, tidx: Int32):
        """Write the selected items in item order; returns how many were written."""
        per = 4
        chunk = ik.TOPK_THREADS * per
        run_above = Int32(0)
        run_tie = Int32(0)
        start = Int32(0)
        while start < items:
            flags = []
            packed = Int32(0)
            for q in cutlass.range_constexpr(per):
                j = start + tidx * per + q
                above = Int32(0)
                tie = Int32(0)
                index = Int32(0)
                if j < items:
                    allowed, key, index = self.held_key(src, crow, n, j,
                                                        totals - 4 * ik.TOPK_BINS, False)
                    above, tie = select_flags(key, threshold, take_all, allowed)
                flags.append((above, tie, index))
                packed = packed + above + (tie << 16)
            excl, total = block_scan(packed, totals, tidx, self.warps)
            a_before = run_above + (excl & 0xFFFF)
            t_before = run_tie + ushr(excl, 16)
            for q in cutlass.range_constexpr(per):
                above, tie, index = flags[q]
                if above != 0:
                    st_s32(dst + Int64(a_before + imin(t_before, need)) * 4, index)
                    a_before = a_before + 1
                if tie != 0:
                    if t_before < need:
                        st_s32(dst + Int64(a_before + t_before) * 4, index)
                    t_before = t_before + 1
            run_above = run_above + (total & 0xFFFF)
            run_tie = run_tie + ushr(total, 16)
            cute.arch.sync_threads()
            start += chunk
        return run_above + imin(run_tie, need)
