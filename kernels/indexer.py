"""Lightning indexer for SM90 in the CuTe DSL: FP4 query prep, FP8 mma scores, radix top-k.

What each kernel computes, the layouts, byte formulas and the reference: `kernels/indexer_kernel_ref.py`;
design and predictions: `docs/notes/indexer-design.md`. In short:
- `indexer_prep`: one warp per (row, head) quantizes the 128-d query to E2M1 values (stored as E4M3
  codes) with a power-of-two scale per 32 dims, in mma B-fragment order; CTA 0 writes the plan.
- `indexer_scores`: a persistent grid of warps walks 32-key work items; each warp keeps its own
  ring of SCORE_STAGES items in shared memory filled with 16-byte `cp.async.cg`, builds the A
  fragments (keys) once per item with conflict-free 4-byte shared loads and reuses them for every
  row of the unit: 4 k-steps x nh/8 n-tiles of `mma.sync.m16n8k32.e4m3` per tile, the k-step
  partial times its group scale, then x key scale, ReLU, x w, summed over heads and a 4-lane
  butterfly; lane c of quad i writes key 4i + c, so a warp stores 32 consecutive scores.
- `indexer_topk`: one CTA per row: three shared-memory histogram passes (11/11/10 bits) over the
  allowed items find the k-th largest key, a final pass in item order writes the selection with a
  block scan (ascending, ties to the lower index), then -1 padding.

PDL: every kernel waits before reading what an earlier kernel wrote and triggers its dependents
when done. PTX ABI: see `indexer_kernel_ref.*_PARAMS`. Pointers 16-byte aligned (keys: the cache
base; pages of page_size * 132 bytes), rows <= 256.

The top-k's radix-select phases live in `kernels/indexer_radix.py`, its cluster variants in
`kernels/indexer_topk_cluster.py`, the family's inline PTX helpers in `kernels/indexer_ptx.py`.
"""
from __future__ import annotations

import cutlass
from cuda.bindings import driver as cuda
from cutlass import Float32, Int32, Int64, cute

from kernels import indexer_kernel_ref as ik
from kernels.block_scan import block_scan
from kernels.indexer_ptx import (
    _addr,
    exp2_f32,
    fp4_round,
    ld_v2,
    ld_v2_f32,
    mark,
    pack_e4m3,
    pow2_exponent,
    relu_mul,
    syncwarp,
    timeline_of,
)
from kernels.indexer_radix import RadixSelectPhases
from kernels.ptx import (
    bf16_pair,
    cp_async_16_zfill,
    cp_async_commit,
    cp_async_wait,
    fabs_max,
    ld_bf16,
    ld_s32,
    lds_f32,
    lds_s32,
    mma_e4m3_from_zero,
    shfl_xor_f32,
    shfl_xor_max,
    st_f32,
    st_s32,
    sts_s32,
)

# ---- indexer_prep ----------------------------------------------------------------------------

class IndexerPrepSm90:
    """CTA 0: the work plan; CTAs 1..: one warp per (row, padded head) quantizes the query."""

    def __init__(self, spec: ik.IndexerSpec):
        self.spec = spec
        self.heads = spec.heads
        self.heads_padded = ik.padded_heads(spec.heads)
        self.tiles = self.heads_padded // ik.HEADS_PER_TILE
        self.warps = ik.PREP_THREADS // ik.LANES

    @cute.jit
    def __call__(self, q: cute.Pointer, w_raw: cute.Pointer, positions: cute.Pointer,
                 seq_index: cute.Pointer, cands: cute.Pointer, qfrag: cute.Pointer,
                 qscale: cute.Pointer, qw: cute.Pointer, plan: cute.Pointer, rows: Int32,
                 num_cands: Int32, weight_scale: Float32, stream: cuda.CUstream):
        self.kernel(q, w_raw, positions, seq_index, cands, qfrag, qscale, qw, plan, rows,
                    num_cands, weight_scale).launch(
            grid=[1, 1, 1], block=list(self.spec.block), smem=self.spec.smem_bytes,
            stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, q: cute.Pointer, w_raw: cute.Pointer, positions: cute.Pointer,
               seq_index: cute.Pointer, cands: cute.Pointer, qfrag: cute.Pointer,
               qscale: cute.Pointer, qw: cute.Pointer, plan: cute.Pointer, rows: Int32,
               num_cands: Int32, weight_scale: Float32):
        self.run(q, w_raw, positions, seq_index, cands, qfrag, qscale, qw, plan, rows, num_cands,
                 weight_scale)

    @cute.jit
    def run(self, q: cute.Pointer, w_raw: cute.Pointer, positions: cute.Pointer,
            seq_index: cute.Pointer, cands: cute.Pointer, qfrag: cute.Pointer,
            qscale: cute.Pointer, qw: cute.Pointer, plan: cute.Pointer, rows: Int32,
            num_cands: Int32, weight_scale: Float32, stamps=None):
        """The body; stamps: the timeline build's u64 address (None in production)."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        tl = timeline_of(stamps, bidx, tidx, ik.TIMELINE_WORDS)
        points = ik.TIMELINE_POINTS["prep"]
        mark(tl, points, "entry")
        smem = cutlass.memory.SmemAllocator()
        base = smem.allocate(self.spec.smem_bytes, byte_alignment=16).toint()
        mark(tl, points, "before_wait")
        cute.arch.griddepcontrol_wait()        # q, w, positions and candidates come from earlier
        mark(tl, points, "after_wait")
        if bidx == 0:
            self.write_plan(_addr(positions), _addr(seq_index), _addr(cands), _addr(plan),
                            rows, num_cands, base, tidx)
        else:
            self.quantize(_addr(q), _addr(w_raw), _addr(qfrag), _addr(qscale), _addr(qw), rows,
                          weight_scale, tidx, bidx, gdim)
        mark(tl, points, "work")
        cute.arch.griddepcontrol_launch_dependents()
        mark(tl, points, "exit")

    @cute.jit
    def quantize(self, q: Int64, w_raw: Int64, qfrag: Int64, qscale: Int64, qw: Int64,
                 rows: Int32, weight_scale: Float32, tidx: Int32, bidx: Int32, gdim: Int32):
        lane = tidx % ik.LANES
        item = (bidx - 1) * self.warps + tidx // ik.LANES
        while item < rows * self.heads_padded:
            row = item // self.heads_padded
            head = item % self.heads_padded
            x0, x1, x2, x3 = Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)
            wv = Float32(0.0)
            if head < self.heads:
                src = q + Int64((row * self.heads + head) * ik.INDEX_DIM + 4 * lane) * 2
                v0, v1 = ld_v2(src)
                x0, x1 = bf16_pair(v0)
                x2, x3 = bf16_pair(v1)
                wv = ld_bf16(w_raw + Int64(row * self.heads + head) * 2) * weight_scale
            amax = fabs_max(fabs_max(fabs_max(fabs_max(Float32(0.0), x0), x1), x2), x3)
            for k in cutlass.range_constexpr(3):                 # the 8 lanes of one group
                amax = shfl_xor_max(amax, 1 << k)
            a = pow2_exponent(amax, 0x400000, 2)
            inv = exp2_f32(-a)
            word = pack_e4m3(fp4_round(x0 * inv), fp4_round(x1 * inv), fp4_round(x2 * inv),
                             fp4_round(x3 * inv))
            g = lane // 8
            t = head // ik.HEADS_PER_TILE
            n = head % ik.HEADS_PER_TILE
            frag = ((row * self.tiles + t) * ik.GROUPS + g) * ik.LANES + 4 * n + lane % 4
            st_s32(qfrag + Int64(frag * 2 + (lane % 8) // 4) * 4, word)
            if lane % 8 == 0:
                at = (((row * self.tiles + t) * ik.GROUPS + g) * 4 + n // 2) * 2 + n % 2
                st_f32(qscale + Int64(at) * 4, exp2_f32(a))
            if lane == 0:
                st_f32(qw + Int64(((row * self.tiles + t) * 4 + n // 2) * 2 + n % 2) * 4, wv)
            item += (gdim - 1) * self.warps

    @cute.jit
    def write_plan(self, positions: Int64, seq_index: Int64, cands: Int64, plan: Int64,
                   rows: Int32, num_cands: Int32, base: Int32, tidx: Int32):
        first = base
        last = base + 4 * ik.PREP_THREADS
        totals = last + 4 * ik.PREP_THREADS
        sts_s32(first + 4 * tidx, Int32(-1))
        cute.arch.sync_threads()
        items = Int32(0)
        row0, nrows, seq, n = Int32(0), Int32(0), Int32(0), Int32(0)
        if cutlass.const_expr(self.spec.mode == "dense"):
            if tidx < rows:
                s = ld_s32(seq_index + Int64(tidx) * 4)
                prev = Int32(-1)
                nxt = Int32(-1)
                if tidx > 0:
                    prev = ld_s32(seq_index + Int64(tidx - 1) * 4)
                if tidx + 1 < rows:
                    nxt = ld_s32(seq_index + Int64(tidx + 1) * 4)
                if s >= 0 and prev != s:
                    sts_s32(first + 4 * s, tidx)
                if s >= 0 and nxt != s:
                    sts_s32(last + 4 * s, tidx)
            cute.arch.sync_threads()
            if tidx < rows:
                row0 = lds_s32(first + 4 * tidx)
                if row0 >= 0:
                    end = lds_s32(last + 4 * tidx)
                    nrows = end - row0 + 1
                    seq = tidx
                    n = (ld_s32(positions + Int64(end) * 4) + 1) // self.spec.ratio
                    items = (n + ik.ITEM_KEYS - 1) // ik.ITEM_KEYS
                else:
                    row0 = Int32(0)
        else:
            if tidx < rows:
                s = ld_s32(seq_index + Int64(tidx) * 4)
                if s >= 0:
                    lo = Int32(0)
                    hi = num_cands
                    while lo < hi:                   # candidates: ascending, -1 at the end
                        mid = (lo + hi) // 2
                        if ld_s32(cands + Int64(tidx * num_cands + mid) * 4) >= 0:
                            lo = mid + 1
                        else:
                            hi = mid
                    row0, nrows, seq = tidx, Int32(1), s
                    n = (ld_s32(positions + Int64(tidx) * 4) + 1) // self.spec.ratio
                    items = (lo + ik.CAND_BLOCKS_PER_ITEM - 1) // ik.CAND_BLOCKS_PER_ITEM
        exclusive, total = block_scan(items, totals, tidx, ik.PREP_THREADS // ik.LANES)
        if tidx < rows:
            st_s32(plan + Int64(1 + tidx) * 4, exclusive)
            info = plan + Int64(2 + rows + 4 * tidx) * 4
            st_s32(info, row0)
            st_s32(info + 4, nrows)
            st_s32(info + 8, seq)
            st_s32(info + 12, n)
        if tidx == 0:
            st_s32(plan, total)
            st_s32(plan + Int64(1 + rows) * 4, total)


# ---- indexer_scores --------------------------------------------------------------------------

class IndexerScoresSm90:
    """Persistent warps over 32-key items; per-warp cp.async ring; mma.sync e4m3 scores."""

    def __init__(self, spec: ik.IndexerSpec):
        self.spec = spec
        self.tiles = ik.padded_heads(spec.heads) // ik.HEADS_PER_TILE
        self.stage_bytes = ik.ITEM_KEYS * ik.KEY_BYTES
        self.stages = ik.SCORE_STAGES
        self.dense = spec.mode == "dense"

    @cute.jit
    def __call__(self, qfrag: cute.Pointer, qscale: cute.Pointer, qw: cute.Pointer,
                 plan: cute.Pointer, keys: cute.Pointer, block_tables: cute.Pointer,
                 cands: cute.Pointer, seq_index: cute.Pointer, scores: cute.Pointer, rows: Int32,
                 ld: Int32, max_pages: Int32, num_cands: Int32, stream: cuda.CUstream):
        self.kernel(qfrag, qscale, qw, plan, keys, block_tables, cands, seq_index, scores, rows,
                    ld, max_pages, num_cands).launch(
            grid=[self.spec.max_ctas, 1, 1], block=list(self.spec.block),
            smem=self.spec.smem_bytes, stream=stream, use_pdl=True,
            min_blocks_per_mp=ik.SCORE_CTAS_PER_SM,
            preferred_smem_carveout=100)   # given, so the DSL does not query a GPU at compile

    @cute.kernel
    def kernel(self, qfrag: cute.Pointer, qscale: cute.Pointer, qw: cute.Pointer,
               plan: cute.Pointer, keys: cute.Pointer, block_tables: cute.Pointer,
               cands: cute.Pointer, seq_index: cute.Pointer, scores: cute.Pointer, rows: Int32,
               ld: Int32, max_pages: Int32, num_cands: Int32):
        self.run(qfrag, qscale, qw, plan, keys, block_tables, cands, seq_index, scores, rows, ld,
                 max_pages, num_cands)

    @cute.jit
    def run(self, qfrag: cute.Pointer, qscale: cute.Pointer, qw: cute.Pointer,
            plan: cute.Pointer, keys: cute.Pointer, block_tables: cute.Pointer,
            cands: cute.Pointer, seq_index: cute.Pointer, scores: cute.Pointer, rows: Int32,
            ld: Int32, max_pages: Int32, num_cands: Int32, stamps=None):
        """The body; stamps: the timeline build's u64 address (None in production)."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        tl = timeline_of(stamps, bidx, tidx, ik.TIMELINE_WORDS)
        points = ik.TIMELINE_POINTS["scores"]
        mark(tl, points, "entry")
        smem = cutlass.memory.SmemAllocator()
        base = smem.allocate(self.spec.smem_bytes, byte_alignment=16).toint()
        lane = tidx % ik.LANES
        warp = tidx // ik.LANES
        ring = base + warp * (self.stages * self.stage_bytes)
        nwarps = gdim * ik.SCORE_WARPS
        mark(tl, points, "before_wait")
        cute.arch.griddepcontrol_wait()        # the plan, q and the keys come from earlier
        mark(tl, points, "after_wait")
        p = _addr(plan)
        total = ld_s32(p)
        item = bidx * ik.SCORE_WARPS + warp
        for s in cutlass.range_constexpr(self.stages - 1):
            self.issue(item + s * nwarps, total, ring + s * self.stage_bytes, p, _addr(keys),
                       _addr(block_tables), _addr(cands), rows, max_pages, num_cands, lane)
            cp_async_commit()
        mark(tl, points, "prologue")
        first = Int32(1)                       # timeline only: warp 0's first item not yet seen
        stage = Int32(0)
        while item < total:
            ahead = (stage + self.stages - 1) % self.stages
            self.issue(item + (self.stages - 1) * nwarps, total, ring + ahead * self.stage_bytes,
                       p, _addr(keys), _addr(block_tables), _addr(cands), rows, max_pages,
                       num_cands, lane)
            cp_async_commit()
            cp_async_wait(self.stages - 1)
            syncwarp()
            if cutlass.const_expr(tl is not None):
                mark(tl, points, "first_landed", first)
                first = Int32(0)
            self.compute(item, ring + stage * self.stage_bytes, p, _addr(qfrag), _addr(qscale),
                         _addr(qw), _addr(cands), _addr(scores), rows, ld, num_cands, lane)
            syncwarp()
            item += nwarps
            stage = (stage + 1) % self.stages
        mark(tl, points, "first_landed", first)     # warp 0 had no item: at the loop's end
        mark(tl, points, "items")
        cp_async_wait(0)
        mark(tl, points, "drained")
        cute.arch.griddepcontrol_launch_dependents()
        mark(tl, points, "exit")

    @cute.jit
    def unit_of(self, p: Int64, item: Int32, rows: Int32):
        """(unit, item within the unit, row0, nrows, seq, entries): the last unit starting <= item."""
        lo = Int32(0)
        hi = rows - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ld_s32(p + Int64(1 + mid) * 4) <= item:
                lo = mid
            else:
                hi = mid - 1
        info = p + Int64(2 + rows + 4 * lo) * 4
        local = item - ld_s32(p + Int64(1 + lo) * 4)
        return (local, ld_s32(info), ld_s32(info + 4), ld_s32(info + 8), ld_s32(info + 12))

    @cute.jit
    def issue(self, item: Int32, total: Int32, stage_addr: Int32, p: Int64, keys: Int64,
              tables: Int64, cands: Int64, rows: Int32, max_pages: Int32, num_cands: Int32,
              lane: Int32):
        """cp.async the 32 key records of `item` into a ring stage (nothing when item >= total)."""
        if item < total:
            local, row0, _, seq, n = self.unit_of(p, item, rows)
            ps = self.spec.page_size
            page_row = tables + Int64(seq) * Int64(max_pages) * 4
            if cutlass.const_expr(self.dense):
                e0 = local * ik.ITEM_KEYS
                page = ld_s32(page_row + Int64(e0 // ps) * 4)
                src = keys + (Int64(page) * ps + Int64(e0 % ps)) * ik.KEY_BYTES
                for j in cutlass.range_constexpr(ik.ceil_div(ik.ITEM_VECTORS, ik.LANES)):
                    v = lane + j * ik.LANES
                    if v < ik.ITEM_VECTORS:
                        size = Int32(0)
                        if (v * 16) // ik.KEY_BYTES < n - e0:
                            size = Int32(16)
                        cp_async_16_zfill(stage_addr + 16 * v, src + Int64(16 * v), size)
            else:
                per_block = ik.ITEM_VECTORS // ik.CAND_BLOCKS_PER_ITEM       # 66
                for j in cutlass.range_constexpr(ik.ceil_div(ik.ITEM_VECTORS, ik.LANES)):
                    v = lane + j * ik.LANES
                    if v < ik.ITEM_VECTORS:
                        jb = v // per_block
                        cb = ld_s32(cands + Int64(row0 * num_cands + local * 4 + jb) * 4)
                        src = keys
                        size = Int32(0)
                        if cb >= 0:
                            e0 = cb * 8
                            page = ld_s32(page_row + Int64(e0 // ps) * 4)
                            src = keys + (Int64(page) * ps + Int64(e0 % ps)) * ik.KEY_BYTES \
                                + Int64(16 * (v % per_block))
                            size = Int32(16)
                        cp_async_16_zfill(stage_addr + 16 * v, src, size)

    @cute.jit
    def compute(self, item: Int32, sa: Int32, p: Int64, qfrag: Int64, qscale: Int64, qw: Int64,
                cands: Int64, scores: Int64, rows: Int32, ld: Int32, num_cands: Int32,
                lane: Int32):
        local, row0, nrows, _, n = self.unit_of(p, item, rows)
        i = lane // 4
        c = lane % 4
        afrag = []                                  # [tile][k-step] -> 4 regs
        kscale = []                                 # [tile] -> (lo key, hi key)
        for t in cutlass.range_constexpr(2):
            lo = sa + 4 * (ik.KEY_WORDS * (4 * i + 2 * t) + c)
            hi = lo + 4 * ik.KEY_WORDS
            for kk in cutlass.range_constexpr(ik.GROUPS):
                afrag.append([lds_s32(lo + 32 * kk), lds_s32(hi + 32 * kk),
                              lds_s32(lo + 32 * kk + 16), lds_s32(hi + 32 * kk + 16)])
            kscale.append((lds_f32(lo - 4 * c + 128), lds_f32(hi - 4 * c + 128)))
        key = 4 * i + c
        entry = local * ik.ITEM_KEYS + key
        ok = Int32(0)
        if cutlass.const_expr(not self.dense):
            cb = ld_s32(cands + Int64(row0 * num_cands + local * 4 + key // 8) * 4)
            entry = cb * 8 + key % 8
            if cb >= 0 and entry < n:
                ok = Int32(1)
        else:
            if entry < n:
                ok = Int32(1)
        rr = Int32(0)
        while rr < nrows:
            row = row0 + rr
            part = [Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)]    # t0 lo/hi, t1
            for nt in cutlass.range_constexpr(self.tiles):
                acc = [Float32(0.0)] * 8
                tile_row = row * self.tiles + nt
                for kk in cutlass.range_constexpr(ik.GROUPS):
                    frag = (tile_row * ik.GROUPS + kk) * ik.LANES + lane
                    b0, b1 = ld_v2(qfrag + Int64(frag) * 8)
                    s0, s1 = ld_v2_f32(qscale + Int64((tile_row * ik.GROUPS + kk) * 4 + c) * 8)
                    for t in cutlass.range_constexpr(2):
                        d = mma_e4m3_from_zero(afrag[t * ik.GROUPS + kk], [b0, b1])
                        acc[4 * t] = acc[4 * t] + d[0] * s0
                        acc[4 * t + 1] = acc[4 * t + 1] + d[1] * s1
                        acc[4 * t + 2] = acc[4 * t + 2] + d[2] * s0
                        acc[4 * t + 3] = acc[4 * t + 3] + d[3] * s1
                w0, w1 = ld_v2_f32(qw + Int64(tile_row * 4 + c) * 8)
                for t in cutlass.range_constexpr(2):
                    klo, khi = kscale[t]
                    part[2 * t] = relu_mul(acc[4 * t + 1], klo, w1,
                                           relu_mul(acc[4 * t], klo, w0, part[2 * t]))
                    part[2 * t + 1] = relu_mul(acc[4 * t + 3], khi, w1,
                                               relu_mul(acc[4 * t + 2], khi, w0, part[2 * t + 1]))
            for j in cutlass.range_constexpr(4):
                for k in cutlass.range_constexpr(2):
                    part[j] = part[j] + shfl_xor_f32(part[j], 1 << k)
            mine = part[0]
            if c == 1:
                mine = part[1]
            if c == 2:
                mine = part[2]
            if c == 3:
                mine = part[3]
            if ok != 0:
                st_f32(scores + (Int64(row) * Int64(ld) + Int64(entry)) * 4, mine)
            rr += 1




# ---- indexer_topk ----------------------------------------------------------------------------

class IndexerTopkSm90(RadixSelectPhases):
    """One CTA per row: exact radix select (3 histogram passes) + an ordered output pass."""

    def __init__(self, spec: ik.IndexerSpec):
        self.spec = spec
        self.k = spec.topk
        self.mode = spec.mode
        self.warps = ik.TOPK_THREADS // ik.LANES

    @cute.jit
    def __call__(self, scores: cute.Pointer, positions: cute.Pointer, seq_index: cute.Pointer,
                 cands: cute.Pointer, out: cute.Pointer, rows: Int32, ld: Int32,
                 num_cands: Int32, stream: cuda.CUstream):
        self.kernel(scores, positions, seq_index, cands, out, rows, ld, num_cands).launch(
            grid=[rows, 1, 1], block=list(self.spec.block), smem=self.spec.smem_bytes,
            stream=stream, use_pdl=True)

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
        row, _, _ = cute.arch.block_idx()
        tl = timeline_of(stamps, row, tidx, ik.TIMELINE_WORDS)
        points = ik.TIMELINE_POINTS["topk"]
        mark(tl, points, "entry")
        smem = cutlass.memory.SmemAllocator()
        hist = smem.allocate(self.spec.smem_bytes, byte_alignment=16).toint()
        totals = hist + 4 * ik.TOPK_BINS
        found = totals + 4 * self.warps
        mark(tl, points, "before_wait")
        cute.arch.griddepcontrol_wait()        # scores (and candidates) come from earlier
        mark(tl, points, "after_wait")
        s = ld_s32(_addr(seq_index) + Int64(row) * 4)
        n = Int32(0)
        if s >= 0:
            n = (ld_s32(_addr(positions) + Int64(row) * 4) + 1) // self.spec.ratio
        mark(tl, points, "meta")
        src = _addr(scores) + Int64(row) * Int64(ld) * 4
        crow = _addr(cands) + Int64(row) * Int64(num_cands) * 4
        items = n
        if cutlass.const_expr(self.mode == "candidates"):
            items = num_cands * self.spec.block_size
        if cutlass.const_expr(self.mode == "blocks"):
            items = (n + self.spec.block_size - 1) // self.spec.block_size
        prefix = Int32(0)
        mask = Int32(0)
        need = Int32(self.k)
        take_all = Int32(0)
        for pi in cutlass.range_constexpr(len(ik.RADIX_PASSES)):
            if take_all == 0:
                prefix, mask, need, take_all = self.radix_pass(
                    src, crow, n, items, prefix, mask, need, ik.RADIX_PASSES[pi][0],
                    ik.RADIX_PASSES[pi][1], hist, found, totals, tidx)
            mark(tl, points, f"pass{pi + 1}")
        selected = self.ordered_output(src, crow, n, items, prefix, need, take_all,
                                       _addr(out) + Int64(row) * self.k * 4, totals, tidx)
        j = selected + tidx
        while j < self.k:
            st_s32(_addr(out) + (Int64(row) * self.k + Int64(j)) * 4, Int32(-1))
            j += ik.TOPK_THREADS
        mark(tl, points, "output")
        cute.arch.griddepcontrol_launch_dependents()
        mark(tl, points, "exit")


# ---- family protocol -------------------------------------------------------------------------

PAGE_SIZE = 64          # entries per page of the compressed caches and index keys (KVCaches)

_CLASSES = {"prep": IndexerPrepSm90, "scores": IndexerScoresSm90, "topk": IndexerTopkSm90}


def _kernel_class(spec: ik.IndexerSpec):
    if spec.timeline:               # the step's kernels with stamps (devicecheck attn_timeline)
        from kernels import indexer_timeline
        return indexer_timeline.kernel_class(spec)
    if spec.kind == "topkc":        # the cluster top-k variants build on this module's helpers
        from kernels import indexer_topk_cluster as tc
        if spec.mode == "candidates":
            return tc.IndexerTopkCandidatesClusterSm90
        return tc.IndexerTopkClusterSm90
    return _CLASSES[spec.kind]


def kernel_function(spec: ik.IndexerSpec):
    return _kernel_class(spec).kernel


def specs(cfg, tp: int) -> list[ik.IndexerSpec]:
    """The indexer kernels of one decode step: per (mode, ratio) of the index-source layers."""
    del tp
    out, seen = [], set()
    for layer in cfg.layers:
        if not layer.has_indexer:
            continue
        mode = "candidates" if layer.uses_candidates else "dense"
        key = (mode, layer.ratio, layer.is_candidate_source)
        if key in seen:
            continue
        seen.add(key)
        nh = cfg.index_n_heads
        group = [ik.make_prep_spec(nh, mode, layer.ratio, PAGE_SIZE),
                 ik.make_scores_spec(nh, mode, layer.ratio, PAGE_SIZE),
                 ik.make_topk_spec("candidates" if layer.uses_candidates else "entries",
                                   cfg.index_topk, layer.ratio, cfg.candidate_block_size)]
        group.append(ik.make_topk_cluster_spec(             # variant, measured side by side
            "candidates" if layer.uses_candidates else "entries", cfg.index_topk, layer.ratio,
            cfg.candidate_block_size))
        if not layer.uses_candidates:                       # round 7: keys held in smem
            group.append(ik.make_topk_spec("entries", cfg.index_topk, layer.ratio,
                                           cfg.candidate_block_size, held=ik.TOPK_HELD))
        if layer.is_candidate_source:
            group.append(ik.make_topk_spec("blocks", cfg.candidate_topk_blocks, layer.ratio,
                                           cfg.candidate_block_size))
            group.append(ik.make_topk_cluster_spec("blocks", cfg.candidate_topk_blocks,
                                                   layer.ratio, cfg.candidate_block_size))
            group.append(ik.make_topk_cluster_spec("both", cfg.index_topk, layer.ratio,
                                                   cfg.candidate_block_size,
                                                   cfg.candidate_topk_blocks))
        out += [s for s in group if s.name not in {o.name for o in out}]
    from kernels.indexer_timeline import TIMELINE_OF
    return out + [ik.timeline_twin(s) for s in out if (s.kind, s.mode, s.ratio) in TIMELINE_OF]


def compile_spec(spec: ik.IndexerSpec, options: str = "--gpu-arch sm_90a"):
    """cute.compile one indexer kernel with pointer / Int32 / Float32 arguments only."""
    from cutlass.cute.runtime import make_ptr

    def ptr(dtype=Int32):
        return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=16)

    kernel = _kernel_class(spec)(spec)
    args = []
    for _, kind in spec.params:
        args.append(ptr() if kind == "u64" else Float32(1.0) if kind == "f32" else Int32(1))
    return cute.compile(kernel, *args, cuda.CUstream(0), options=options)
