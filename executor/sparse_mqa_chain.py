"""Sparse MQA on device buffers: seeded cases on real cache bytes, a cluster launch, the benchmark.

Used by tests/test_sparse_mqa_cpu.py (cases, host only), tests/gpu/test_sparse_mqa.py and the
devicecheck benchmark "sparse_mqa" (`bench_sparse_mqa`).

A case is one launch's inputs built the way the step leaves them: SWA rings and a paged compressed
cache of 584-byte records, everything unwritten poisoned with 0xFF (NaN records), block tables
that are random page permutations with -1 for pages past the context, top-k lists of distinct
visible entries (-1 padded, a few -1 inside), verify blocks whose rows share most of their
entries, padding rows. Only the records some row must read are written: any other read is NaN.

The kernel needs a thread-block-cluster launch: `LaunchSpec(..., cluster=spec.cluster)`, which
`executor.launches.sparse_mqa.sparse_mqa_launch` builds from the arena's pointers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from executor.launch import LaunchSpec
from executor.launches.sparse_mqa import BUFFERS, sparse_mqa_launch, spec_of
from kernels import kvrecord_ref as rec
from kernels import rope_ref
from kernels import sparse_mqa_ref as ref
from kernels.common_ref import BF16, ceil_div

BLOCK_ROWS = {"decode": 1, "verify": 6, "draft": 5}
ROPE_THETA = 160000.0
Q_SCALE = 3.0          # q . k / sqrt(512) has std ~3: peaked softmax, so a wrong entry shows


@dataclass(frozen=True)
class Case:
    """Host arrays of one launch (names as the kernel ABI) and its reference view."""

    spec: ref.SparseMqaSpec
    q: np.ndarray              # bf16 [R, H, 512]
    swa: np.ndarray            # u8 [lines * ring_slots, 584]
    compressed: np.ndarray     # u8 [pages * page_size, 584] (1 record when topk == 0)
    topk: np.ndarray           # i32 [R, max(topk, 1)]
    block_tables: np.ndarray   # i32 [S, pages_per_seq]
    info: np.ndarray           # i32 [R, 4]
    state_lines: np.ndarray    # i32 [S]
    sink: np.ndarray           # f32 [H]
    table: rope_ref.RopeTable
    page_size: int

    @property
    def rows(self) -> int:
        return self.info.shape[0]

    def gathered(self) -> ref.Gathered:
        return ref.gather(self.spec, self.swa, self.compressed, self.topk, self.block_tables,
                          self.info, self.state_lines, self.page_size)

    def reference(self) -> np.ndarray:
        return ref.sparse_mqa_ref(self.spec, self.q, self.gathered(), self.sink, self.info,
                                  self.table)


def _records(rng, n: int) -> np.ndarray:
    """n valid records of BF16-valued N(0, 1) entries (rope dims as stored: rotated)."""
    entries = rng.standard_normal((n, ref.HEAD_DIM)).astype(np.float32)
    return rec.encode_kv_record(entries.astype(BF16).astype(np.float32))


def _topk_lists(rng, spec, positions: np.ndarray, overlap: float) -> np.ndarray:
    """[rows, topk] distinct visible entries (< p + 1, ratio 1), sorted, -1 padded; the rows of a
    block share a base set and each replaces a (1 - overlap) share with entries of its own."""
    k = spec.topk
    out = np.full((positions.size, k), -1, np.int32)
    base = rng.permutation(int(positions[0]) + 1)[:k]
    for i, p in enumerate(positions):
        visible = int(p) + 1
        mine = base[base < visible]
        keep = mine[rng.random(mine.size) < overlap]
        rest = np.setdiff1d(np.arange(visible), keep, assume_unique=True)
        extra = rng.choice(rest, size=min(k - keep.size, rest.size), replace=False)
        chosen = np.sort(np.concatenate([keep, extra]))[:k]
        chosen[rng.random(chosen.size) < 0.02] = -1          # -1 inside the list too
        out[i, :chosen.size] = chosen
    return out


def make_case(spec: ref.SparseMqaSpec, rng, context: int, blocks: list[str], pad_rows: int = 0,
              page_size: int = 64, overlap: float = 0.8, write_all: bool = False) -> Case:
    """One launch: `blocks` (kinds) end at position context - 1 each, then `pad_rows` padding.

    The compressed pool holds the context's pages once; each sequence maps it through its own
    permutation (a shared pool keeps 128k-token cases small; the records read are the same).
    `write_all` fills every record (benchmarks), otherwise only the ones a row must read.
    """
    seqs = len(blocks)
    lines = rng.permutation(seqs + 3)[:seqs].astype(np.int32)
    swa = np.full(((seqs + 3) * spec.ring_slots, ref.RECORD_BYTES), 0xFF, np.uint8)
    pages = ceil_div(context, page_size)
    pages_per_seq = pages + 2                                  # 2 unallocated (-1) pages
    tables = np.full((seqs, pages_per_seq), -1, np.int32)
    info_rows, topk_rows = [], []
    for s, kind in enumerate(blocks):
        n = BLOCK_ROWS[kind]
        if kind == "draft" and spec.topk:
            raise ValueError("draft blocks run only on SWA-only kernels")
        start = context - n
        if start < 0:
            raise ValueError(f"context {context} is shorter than a {kind} block")
        tables[s, :pages] = rng.permutation(pages)
        positions = np.arange(start, context)
        lo = start - spec.window if kind == "draft" else positions - spec.window + 1
        lo = np.maximum(np.broadcast_to(lo, positions.shape), 0)
        hi = np.full_like(positions, context - 1) if kind == "draft" else positions
        info_rows.append(np.stack([positions, lo, hi, np.full_like(positions, s)], axis=1))
        seen = np.arange(int(lo.min()), context)
        swa[lines[s] * spec.ring_slots + seen % spec.ring_slots] = _records(rng, seen.size)
        if spec.topk:
            topk_rows.append(_topk_lists(rng, spec, positions, overlap))
    info = np.concatenate(info_rows + [np.tile([[0, 0, -1, -1]], (pad_rows, 1))]).astype(np.int32)
    width = max(spec.topk, 1)
    topk = np.full((info.shape[0], width), -1, np.int32)
    compressed = np.full((max(pages * page_size, 1), ref.RECORD_BYTES), 0xFF, np.uint8)
    if spec.topk:
        topk[:info.shape[0] - pad_rows] = np.concatenate(topk_rows)
        if write_all:
            compressed[:] = np.resize(_records(rng, 4096), compressed.shape)
        else:
            for s in range(seqs):
                mine = topk[info[:, 3] == s]
                ids = np.unique(mine[mine >= 0])
                phys = tables[s, ids // page_size].astype(np.int64) * page_size + ids % page_size
                compressed[phys] = _records(rng, ids.size)
    q = (rng.standard_normal((info.shape[0], spec.heads, ref.HEAD_DIM)) * Q_SCALE).astype(BF16)
    sink = rng.standard_normal(spec.heads).astype(np.float32)
    table = rope_ref.RopeTable.build("plain", rope_ref.plain_inv_freq(ROPE_THETA), context + 8)
    return Case(spec, q, swa, compressed, topk, tables, info, lines, sink, table, page_size)


# ---- device side -----------------------------------------------------------------------------------

# Arena slice names, in the order of the kernel's pointer parameters (launches.sparse_mqa.BUFFERS).
ARRAYS = ("q", "out", "swa", "compressed", "topk", "block_tables", "info", "state_lines", "sink",
          "table")


class SparseMqaBuffers:
    """Every buffer of one Case in one arena (output poisoned with NaN), and its launch."""

    def __init__(self, device, bundle, case: Case):
        import cupy as cp

        from executor.arena import Arena
        self.case = case
        host = self._host(case)
        self.arena = Arena(device, [(k, max(v.nbytes, 16)) for k, v in host.items()])
        for key, arr in host.items():
            view = self.arena.view(key, np.uint8, (arr.nbytes,))
            if key == "out":
                view[...] = 0xFF
            else:
                view[...] = cp.asarray(np.ascontiguousarray(arr).view(np.uint8).ravel())
        cp.cuda.Device().synchronize()
        self.ptrs = {abi: self.arena.ptr(k) for abi, k in zip(BUFFERS, ARRAYS)}
        self.launch = self.launch_of(bundle, case.spec)

    def launch_of(self, bundle, spec: ref.SparseMqaSpec, stamps: int | None = None) -> LaunchSpec:
        """A launch of `spec`'s kernel on these buffers (variants share the case's ABI; a
        `_timeline` build also takes its stamps address)."""
        c = self.case
        return sparse_mqa_launch(bundle, spec, self.ptrs, c.rows,
                                 pages_per_seq=c.block_tables.shape[1], page_size=c.page_size,
                                 num_positions=c.table.num_positions, stamps=stamps)

    @staticmethod
    def _host(case: Case) -> dict:
        return {"q": case.q, "out": np.empty_like(case.q), "swa": case.swa,
                "compressed": case.compressed, "topk": case.topk,
                "block_tables": case.block_tables, "info": case.info,
                "state_lines": case.state_lines, "sink": case.sink, "table": case.table.cos_sin}

    def output(self) -> np.ndarray:
        import cupy as cp
        raw = cp.asnumpy(self.arena.view("out", np.uint8, (self.case.q.nbytes,)))
        return raw.view(BF16).reshape(self.case.q.shape)

    def close(self) -> None:
        self.arena.close()


# ---- benchmark -------------------------------------------------------------------------------------

BENCH_CONTEXTS = (4096, 65536, 131072)
BENCH_CASES = {1: ["decode"], 6: ["verify"], 48: ["verify"] * 8}
CHAIN = 4              # launches per graph, each on its own case (other entries, other rows)
TARGET_PCT = 70.0


def bench_sparse_mqa(ctx) -> None:
    """µs (isolated cold and per launch in a PDL graph of CHAIN distinct cases), bytes actually
    read, GB/s and % of 4.8 TB/s on the must-read bytes, for contexts 4k/64k/128k and R 1/6/48.

    Every top-k kernel of the bundle runs on the same buffers, side by side: the measured default,
    the candidates (isolated and chained) and the timing-only ablations (chained; their bytes
    column is the default's must-read, their outputs are not meaningful)."""
    bundle = ctx.bundle_with("sparse_mqa_topk")
    if bundle is None:
        return
    specs = _topk_specs(bundle)
    spec = specs[0]
    rng = np.random.default_rng(7)
    for context in BENCH_CONTEXTS[:1] if ctx.quick else BENCH_CONTEXTS:
        for rows, blocks in BENCH_CASES.items():
            cases = [make_case(spec, rng, context, blocks, write_all=True) for _ in range(CHAIN)]
            bufs = [SparseMqaBuffers(ctx.device, bundle, c) for c in cases]
            try:
                nbytes = ref.bytes_read(spec, cases[0].gathered())
                label = f"T{context // 1024}k R{rows}"
                for variant in specs:
                    launches = [b.launch_of(bundle, variant) for b in bufs]
                    if not variant.ablation:
                        iso = ctx.cold_median_us(lambda x=launches[0]: x.launch(ctx.stream),
                                                 reps=20)
                        ctx.bandwidth(variant.name, f"{label} iso", rows, iso,
                                      nbytes["must_read"])
                    chain = _chain_us(ctx, launches)
                    row = ctx.bandwidth(variant.name, f"{label} pdl", rows, chain,
                                        nbytes["must_read"])
                    if context == 65536 and rows == 48 and not variant.ablation:
                        ctx.metric(f"{variant.name} {label} pdl % of 4.8 TB/s", row.pct_hbm, "%",
                                   f">= {TARGET_PCT:.0f}%", row.pct_hbm >= TARGET_PCT)
            finally:
                for b in bufs:
                    b.close()
            ctx.metric(f"{spec.name} {label}: records read per launch (per row / unique)",
                       nbytes["records"] / max(nbytes["unique_records"], 1), "x")


def _chain_us(ctx, launches) -> float:
    """µs per launch in one captured graph of the launches (PDL edges between them)."""
    from executor.graphs import Graph
    with Graph.capture(ctx.stream) as g:
        for x in launches:
            x.launch(ctx.stream)
    try:
        return ctx.timer.median_us(lambda: g.launch(ctx.stream), reps=20, warmup=2) / len(launches)
    finally:
        g.close()


def _topk_specs(bundle) -> list[ref.SparseMqaSpec]:
    """The bundle's top-k kernels: the measured default first, candidates, then ablations."""
    specs = [_spec_from(bundle, n) for n in bundle.names()
             if n.startswith("sparse_mqa_topk") and not n.endswith("_timeline")]
    return sorted(specs, key=lambda s: (s.ablation, s.split != "balanced", s.name))


def _spec_from(bundle, name: str) -> ref.SparseMqaSpec:
    return spec_of(bundle.manifest.kernels[name].spec)
