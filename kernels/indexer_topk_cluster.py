"""Indexer top-k variant for SM90: one thread-block cluster per row, the row read once into shared memory.

The measured default (`kernels/indexer.py:IndexerTopkSm90`, one CTA per row) reads every score from
L2 four times with one dependent load per thread at a time. This variant (`topkc`; modes entries,
blocks, and both = the layer-20 pair from one read; output as the default's) splits a row over a
cluster of TOPKC_CLUSTER CTAs:

    load      CTA c of the cluster takes blocks [c * per, (c + 1) * per) of 8 entries: their scores
              are read once, 8 independent loads in flight per thread, into shared memory; block
              keys (max of the block's visible entries, own block forced in) are made from them
    select    the three radix passes of the default, on the slice in shared memory; after each
              pass the cluster syncs and every CTA sums the CTAs' histograms over DSMEM (so all
              CTAs find the same bin; histograms alternate between two buffers, so clearing one
              never races a CTA still reading it)
    output    each CTA counts its (above, tie) items, the cluster syncs, and the CTA writes its
              selections in item order at offsets given by the counts of the CTAs before it;
              ties go to the lower index as in the default, so the output is bitwise the same.

Items past TOPKC_SLICE per CTA (contexts over 128k at ratio 1) are read from global memory in
every pass, as the default does: slower, still exact. Launch with cluster (TOPKC_CLUSTER, 1, 1)
and grid (TOPKC_CLUSTER, rows, 1); a launch without the cluster shape traps. Slices:
`indexer_kernel_ref.topkc_slices`; the algorithm: `indexer_kernel_ref.cluster_select_ref`.
"""
from __future__ import annotations

import cutlass
from cuda.bindings import driver as cuda
from cutlass import Float32, Int32, Int64, cute

from kernels import indexer_kernel_ref as ik
from kernels.block_scan import block_scan
from kernels.indexer import IndexerTopkSm90
from kernels.indexer_ptx import (
    _addr,
    _as_i32,
    _asm,
    atom_add_shared,
    fmax_f32,
    imin,
    mark,
    ordered_key,
    select_flags,
    timeline_of,
    ushr,
)
from kernels.ptx import (
    cluster_nctarank,
    cluster_sync,
    ld_f32,
    ld_f32_if,
    ld_s32,
    lds_f32,
    lds_s32,
    st_s32,
    sts_s32,
    void,
)

LOAD_BATCH = 8           # independent global loads in flight per thread while filling the slice
CAND_HELD = ik.TOPKC_SLICE // 2     # candidates mode: keys, then entry indices, in the slice


def ld_s32_if(addr: Int64, ok: Int32):
    """s32 at addr when ok != 0, else -1 (predicated: no branch, so loads batch)."""
    return Int32(_asm(1, [Int64(addr), Int32(ok)],
                      "{ .reg .pred p; setp.ne.s32 p, $2, 0; mov.b32 $0, -1;\n"
                      "@p ld.global.s32 $0, [$1]; }", "=r,l,r", side_effects=True))


def ld_cluster_v4(saddr: Int32, rank: Int32):
    """4 words at the same shared offset in CTA `rank` of the cluster (DSMEM)."""
    v = _asm(4, [Int32(saddr), Int32(rank)],
             "{ .reg .b32 a; mapa.shared::cluster.u32 a, $4, $5;\n"
             "ld.shared::cluster.v4.u32 {$0, $1, $2, $3}, [a]; }", "=r,=r,=r,=r,r,r",
             side_effects=True)
    return [Int32(x) for x in v]


def ld_cluster_s32(saddr: Int32, rank: Int32):
    return Int32(_asm(1, [Int32(saddr), Int32(rank)],
                      "{ .reg .b32 a; mapa.shared::cluster.u32 a, $1, $2;\n"
                      "ld.shared::cluster.u32 $0, [a]; }", "=r,r,r", side_effects=True))


def trap():
    void([], "trap;", "")


class IndexerTopkClusterSm90(IndexerTopkSm90):
    """A cluster of CTAs per row; the slice in shared memory; histograms merged over DSMEM."""

    def __init__(self, spec: ik.IndexerSpec):
        super().__init__(spec)
        self.warps = ik.TOPKC_THREADS // ik.LANES
        self.C = spec.cluster_ctas
        self.bs = spec.block_size
        self.lay = ik.topkc_smem_layout()
        self.bins_per_thread = ik.TOPK_BINS // ik.TOPKC_THREADS          # 4

    @cute.jit
    def __call__(self, scores: cute.Pointer, positions: cute.Pointer, seq_index: cute.Pointer,
                 out_entries: cute.Pointer, out_blocks: cute.Pointer, rows: Int32, ld: Int32,
                 stream: cuda.CUstream):
        self.kernel(scores, positions, seq_index, out_entries, out_blocks, rows, ld).launch(
            grid=[self.C, rows, 1], block=list(self.spec.block), cluster=[self.C, 1, 1],
            smem=self.spec.smem_bytes, stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, scores: cute.Pointer, positions: cute.Pointer, seq_index: cute.Pointer,
               out_entries: cute.Pointer, out_blocks: cute.Pointer, rows: Int32, ld: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        rank, row, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        base = Int32(smem.allocate(self.spec.smem_bytes, byte_alignment=16).toint())
        if cluster_nctarank(side_effects=False) != self.C:
            trap()                             # DSMEM addresses would be wrong: fail loudly
        cute.arch.griddepcontrol_wait()        # scores come from the scores kernel
        s = ld_s32(_addr(seq_index) + Int64(row) * 4)
        n = Int32(0)
        if s >= 0:
            n = (ld_s32(_addr(positions) + Int64(row) * 4) + 1) // self.spec.ratio
        src = _addr(scores) + Int64(row) * Int64(ld) * 4
        # This CTA's slice (as ik.topkc_slices): whole blocks; entries clipped to the row.
        nb = (n + self.bs - 1) // self.bs
        per = (nb + self.C - 1) // self.C
        first = rank * per
        count = imin(per, nb - first)
        if count < 0:
            count = Int32(0)
        held = imin(count, Int32(ik.TOPKC_SLICE // self.bs))
        e0 = first * self.bs
        count_e = imin(count * self.bs, n - e0)
        if count_e < 0:
            count_e = Int32(0)
        held_e = imin(count_e, held * self.bs)
        self.fill_slice(src, n, first, held, e0, held_e, base, tidx)
        cute.arch.sync_threads()
        if cutlass.const_expr(self.mode != "blocks"):
            self.select("entries", self.k, src, src, n, e0, count_e, held_e,
                        _addr(out_entries) + Int64(row) * self.k * 4, base, rank, tidx, 0)
        if cutlass.const_expr(self.mode != "entries"):
            kb = self.k if self.mode == "blocks" else self.spec.topk_blocks
            self.select("blocks", kb, src, src, n, first, count, held,
                        _addr(out_blocks) + Int64(row) * kb * 4, base, rank, tidx, 1)
        cluster_sync()                         # no CTA leaves while another reads its counts
        cute.arch.griddepcontrol_launch_dependents()

    # ---- load --------------------------------------------------------------------------------

    @cute.jit
    def fill_slice(self, src: Int64, n: Int32, first: Int32, held: Int32, e0: Int32,
                   held_e: Int32, base: Int32, tidx: Int32):
        """Raw scores of entries [e0, e0 + held_e) into shared memory; block keys of the held
        blocks when this kernel selects blocks."""
        slot = base + self.lay["slice"]
        start = Int32(0)
        while start < held_e:
            vals = []
            for u in cutlass.range_constexpr(LOAD_BATCH):
                j = start + u * ik.TOPKC_THREADS + tidx
                ok = Int32(0)
                if j < held_e:
                    ok = Int32(1)
                vals.append((j, ok, ld_f32_if(src + Int64(e0 + j) * 4, ok)))
            for u in cutlass.range_constexpr(LOAD_BATCH):
                j, ok, v = vals[u]
                if ok != 0:
                    sts_s32(slot + 4 * j, Int32(_asm(1, [Float32(v)], "mov.b32 $0, $1;", "=r,f")))
            start += LOAD_BATCH * ik.TOPKC_THREADS
        if cutlass.const_expr(self.mode != "entries"):
            cute.arch.sync_threads()
            j = tidx
            while j < held:
                best = Float32(-float("inf"))
                for e in cutlass.range_constexpr(self.bs):
                    if j * self.bs + e < held_e:
                        best = fmax_f32(best, lds_f32(slot + 4 * (j * self.bs + e)))
                if first + j == (n - 1) // self.bs:     # the row's own block is forced in
                    best = Float32(float("inf"))
                sts_s32(base + self.lay["block_keys"] + 4 * j, ordered_key(best))
                j += ik.TOPKC_THREADS

    @cute.jit
    def slice_item(self, sub: cutlass.Constexpr, src: Int64, crow: Int64, n: Int32, first: Int32,
                   held: Int32, j: Int32, base: Int32):
        """(allowed, ordered key, output index) of item first + j: from shared memory when held,
        else from global memory."""
        allowed = Int32(1)
        key = Int32(0)
        index = first + j
        if j < held:
            if cutlass.const_expr(sub == "entries"):
                key = ordered_key(lds_f32(base + self.lay["slice"] + 4 * j))
            if cutlass.const_expr(sub == "blocks"):
                key = lds_s32(base + self.lay["block_keys"] + 4 * j)
            if cutlass.const_expr(sub == "candidates"):
                key = lds_s32(base + self.lay["slice"] + 4 * j)
                index = lds_s32(base + self.lay["slice"] + 4 * (CAND_HELD + j))
                if index < 0:
                    allowed = Int32(0)
        else:
            if cutlass.const_expr(sub == "entries"):
                key = ordered_key(ld_f32(src + Int64(first + j) * 4))
            if cutlass.const_expr(sub == "blocks"):
                b = first + j
                best = Float32(-float("inf"))
                for e in cutlass.range_constexpr(self.bs):
                    if b * self.bs + e < n:
                        best = fmax_f32(best, ld_f32(src + Int64(b * self.bs + e) * 4))
                if b == (n - 1) // self.bs:
                    best = Float32(float("inf"))
                key = ordered_key(best)
            if cutlass.const_expr(sub == "candidates"):
                allowed, key, index = self.item_key(src, crow, n, first + j)
        return allowed, key, index

    # ---- select ------------------------------------------------------------------------------

    @cute.jit
    def select(self, sub: cutlass.Constexpr, k: cutlass.Constexpr, src: Int64, crow: Int64,
               n: Int32, first: Int32, count: Int32, held: Int32, dst: Int64, base: Int32,
               rank: Int32, tidx: Int32, run: cutlass.Constexpr, tl=None):
        """Top-k of one item kind over the cluster's slices, written to dst (the row's k words).
        tl: a timeline build's stamp handle (None in production)."""
        points = ik.TIMELINE_POINTS["topkc"]
        prefix = Int32(0)
        mask = Int32(0)
        need = Int32(k)
        take_all = Int32(0)
        for pi in cutlass.range_constexpr(len(ik.RADIX_PASSES)):
            if take_all == 0:
                prefix, mask, need, take_all = self.cluster_pass(
                    sub, src, crow, n, first, count, held, prefix, mask, need, pi, base, tidx)
            mark(tl, points, f"pass{pi + 1}")
        self.write_selection(sub, k, src, crow, n, first, count, held, prefix, need, take_all,
                             dst, base, rank, tidx, run)
        mark(tl, points, "output")

    @cute.jit
    def cluster_pass(self, sub: cutlass.Constexpr, src: Int64, crow: Int64, n: Int32,
                     first: Int32, count: Int32, held: Int32, prefix: Int32, mask: Int32,
                     need: Int32, pi: cutlass.Constexpr, base: Int32, tidx: Int32):
        shift, bits = ik.RADIX_PASSES[pi]
        nbins = 1 << bits
        hist = base + self.lay["hist"] + (pi % 2) * 4 * ik.TOPK_BINS
        found = base + self.lay["found"]
        per = self.bins_per_thread
        for q in cutlass.range_constexpr(per):
            sts_s32(hist + 4 * (per * tidx + q), Int32(0))
        cute.arch.sync_threads()
        j = tidx
        while j < count:
            allowed, key, _ = self.slice_item(sub, src, crow, n, first, held, j, base)
            if allowed != 0 and (key & mask) == prefix:
                atom_add_shared(hist + 4 * (ushr(key, shift) & (nbins - 1)), Int32(1))
            j += ik.TOPKC_THREADS
        cluster_sync()                         # every CTA's histogram is complete and visible
        mine = [Int32(0)] * per                # bins per*t .. per*t+3 summed over the cluster
        for c in cutlass.range_constexpr(self.C):
            v = ld_cluster_v4(hist + 4 * per * tidx, Int32(c))
            for q in cutlass.range_constexpr(per):
                mine[q] = mine[q] + v[q]
        total_mine = mine[0]
        for q in cutlass.range_constexpr(1, per):
            total_mine = total_mine + mine[q]
        excl, total = self.reverse_scan(total_mine, ik.TOPKC_THREADS - 1 - tidx,
                                        base + self.lay["totals"])
        above = excl                           # items in bins above this thread's top bin
        for qq in cutlass.range_constexpr(per):
            q = per - 1 - qq
            if above < need and above + mine[q] >= need:
                sts_s32(found, per * tidx + q)
                sts_s32(found + 4, above)
            above = above + mine[q]
        cute.arch.sync_threads()
        take_all = Int32(0)
        new_prefix, new_mask, new_need = prefix, mask, need
        if cutlass.const_expr(pi == 0):  # noqa: SIM102 - trace-time test
            if total <= need:
                take_all = Int32(1)
        if take_all == 0:
            d = lds_s32(found)
            new_need = need - lds_s32(found + 4)
            new_prefix = prefix | (d << shift)
            new_mask = mask | Int32(_as_i32((nbins - 1) << shift))
        cute.arch.sync_threads()
        return new_prefix, new_mask, new_need, take_all

    # ---- output ------------------------------------------------------------------------------

    @cute.jit
    def write_selection(self, sub: cutlass.Constexpr, k: cutlass.Constexpr, src: Int64,
                        crow: Int64, n: Int32, first: Int32, count: Int32, held: Int32,
                        threshold: Int32, need: Int32, take_all: Int32, dst: Int64, base: Int32,
                        rank: Int32, tidx: Int32, run: cutlass.Constexpr):
        totals = base + self.lay["totals"]
        counts = base + self.lay["counts"] + 8 * run
        n_above = Int32(0)                     # two scans: a slice may exceed 16-bit counts
        n_tie = Int32(0)
        j = tidx
        while j < count:
            allowed, key, _ = self.slice_item(sub, src, crow, n, first, held, j, base)
            above, tie = select_flags(key, threshold, take_all, allowed)
            n_above = n_above + above
            n_tie = n_tie + tie
            j += ik.TOPKC_THREADS
        _, total_above = block_scan(n_above, totals, tidx, self.warps)
        cute.arch.sync_threads()
        _, total_tie = block_scan(n_tie, totals, tidx, self.warps)
        if tidx == 0:
            sts_s32(counts, total_above)
            sts_s32(counts + 4, total_tie)
        cluster_sync()                         # every CTA's counts are visible
        run_above = Int32(0)
        run_tie = Int32(0)
        all_above = Int32(0)
        all_tie = Int32(0)
        for c in cutlass.range_constexpr(self.C):
            a = ld_cluster_s32(counts, Int32(c))
            t = ld_cluster_s32(counts + 4, Int32(c))
            if c < rank:
                run_above = run_above + a
                run_tie = run_tie + t
            all_above = all_above + a
            all_tie = all_tie + t
        self.ordered_slice(sub, src, crow, n, first, count, held, threshold, need, take_all, dst,
                           base, run_above, run_tie, tidx)
        selected = all_above + imin(all_tie, need)
        j = selected + rank * ik.TOPKC_THREADS + tidx
        while j < k:
            st_s32(dst + Int64(j) * 4, Int32(-1))
            j += self.C * ik.TOPKC_THREADS

    @cute.jit
    def ordered_slice(self, sub: cutlass.Constexpr, src: Int64, crow: Int64, n: Int32,
                      first: Int32, count: Int32, held: Int32, threshold: Int32, need: Int32,
                      take_all: Int32, dst: Int64, base: Int32, run_above: Int32, run_tie: Int32,
                      tidx: Int32):
        """This CTA's selections in item order (4 consecutive items per thread per chunk)."""
        per = 4
        totals = base + self.lay["totals"]
        start = Int32(0)
        while start < count:
            flags = []
            packed = Int32(0)
            for q in cutlass.range_constexpr(per):
                j = start + tidx * per + q
                above = Int32(0)
                tie = Int32(0)
                index = Int32(0)
                if j < count:
                    allowed, key, index = self.slice_item(sub, src, crow, n, first, held, j,
                                                          base)
                    above, tie = select_flags(key, threshold, take_all, allowed)
                flags.append((above, tie, index))
                packed = packed + above + (tie << 16)
            cute.arch.sync_threads()           # totals: the previous scan's readers are done
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
            start += ik.TOPKC_THREADS * per


class IndexerTopkCandidatesClusterSm90(IndexerTopkClusterSm90):
    """The reindex layers' top-k (entries inside the row's candidate blocks) on a cluster per
    row: the default's ABI (drop-in); items = candidate slots, 8 per candidate block."""

    @cute.jit
    def __call__(self, scores: cute.Pointer, positions: cute.Pointer, seq_index: cute.Pointer,
                 cands: cute.Pointer, out: cute.Pointer, rows: Int32, ld: Int32,
                 num_cands: Int32, stream: cuda.CUstream):
        self.kernel(scores, positions, seq_index, cands, out, rows, ld, num_cands).launch(
            grid=[self.C, rows, 1], block=list(self.spec.block), cluster=[self.C, 1, 1],
            smem=self.spec.smem_bytes, stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, scores: cute.Pointer, positions: cute.Pointer, seq_index: cute.Pointer,
               cands: cute.Pointer, out: cute.Pointer, rows: Int32, ld: Int32, num_cands: Int32):
        self.run(scores, positions, seq_index, cands, out, rows, ld, num_cands)

    @cute.jit
    def run(self, scores: cute.Pointer, positions: cute.Pointer, seq_index: cute.Pointer,
            cands: cute.Pointer, out: cute.Pointer, rows: Int32, ld: Int32, num_cands: Int32,
            stamps=None):
        """The body; stamps: the timeline build's u64 address (None in production)."""
        tidx, _, _ = cute.arch.thread_idx()
        rank, row, _ = cute.arch.block_idx()
        tl = timeline_of(stamps, row * self.C + rank, tidx, ik.TIMELINE_WORDS)
        points = ik.TIMELINE_POINTS["topkc"]
        mark(tl, points, "entry")
        smem = cutlass.memory.SmemAllocator()
        base = Int32(smem.allocate(self.spec.smem_bytes, byte_alignment=16).toint())
        if cluster_nctarank(side_effects=False) != self.C:
            trap()                             # DSMEM addresses would be wrong: fail loudly
        mark(tl, points, "before_wait")
        cute.arch.griddepcontrol_wait()        # scores and candidates come from earlier kernels
        mark(tl, points, "after_wait")
        s = ld_s32(_addr(seq_index) + Int64(row) * 4)
        n = Int32(0)
        if s >= 0:
            n = (ld_s32(_addr(positions) + Int64(row) * 4) + 1) // self.spec.ratio
        src = _addr(scores) + Int64(row) * Int64(ld) * 4
        crow = _addr(cands) + Int64(row) * Int64(num_cands) * 4
        # This CTA's candidate slots: whole candidate blocks (ik.topkc_candidate_slices).
        per = (num_cands + self.C - 1) // self.C * self.bs
        first = rank * per
        count = imin(per, num_cands * self.bs - first)
        if count < 0:
            count = Int32(0)
        held = imin(count, Int32(CAND_HELD))
        self.fill_candidates(src, crow, n, first, held, base, tidx)
        cute.arch.sync_threads()
        mark(tl, points, "meta")
        self.select("candidates", self.k, src, crow, n, first, count, held,
                    _addr(out) + Int64(row) * self.k * 4, base, rank, tidx, 0, tl)
        cluster_sync()                         # no CTA leaves while another reads its counts
        cute.arch.griddepcontrol_launch_dependents()
        mark(tl, points, "exit")

    @cute.jit
    def fill_candidates(self, src: Int64, crow: Int64, n: Int32, first: Int32, held: Int32,
                        base: Int32, tidx: Int32):
        """Slots [first, first + held): ordered key and entry index (-1: not allowed) into
        shared memory; the block ids of a batch, then its scores, each batch of loads in flight."""
        keys = base + self.lay["slice"]
        start = Int32(0)
        while start < held:
            slots = []
            for u in cutlass.range_constexpr(LOAD_BATCH):
                j = start + u * ik.TOPKC_THREADS + tidx
                ok = Int32(0)
                if j < held:
                    ok = Int32(1)
                slots.append((j, ok, ld_s32_if(crow + Int64((first + j) // self.bs) * 4, ok)))
            vals = []
            for u in cutlass.range_constexpr(LOAD_BATCH):
                j, ok, cb = slots[u]
                index = cb * self.bs + (first + j) % self.bs
                allowed = Int32(0)
                if ok != 0 and cb >= 0 and index < n:
                    allowed = Int32(1)
                vals.append((j, ok, allowed, index, ld_f32_if(src + Int64(index) * 4, allowed)))
            for u in cutlass.range_constexpr(LOAD_BATCH):
                j, ok, allowed, index, v = vals[u]
                if ok != 0:
                    sts_s32(keys + 4 * j, ordered_key(v))
                    if allowed == 0:
                        index = Int32(-1)
                    sts_s32(keys + 4 * (CAND_HELD + j), index)
            start += LOAD_BATCH * ik.TOPKC_THREADS
