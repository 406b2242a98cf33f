"""The indexer kernel chain on device buffers (prep, scores, top-k, candidate blocks); its benchmark.

Used by tests/gpu/test_indexer_publish.py and by `hopdec devicecheck` (benchmark "indexer",
registered through executor/benchmarks.py FAMILY_BENCHMARKS as "executor.indexer_chain:bench_indexer").
The launches themselves are built from the arena's pointers by executor/launches/indexer.py.
"""
from __future__ import annotations

import numpy as np

from executor.arena import Arena
from executor.launch import LaunchSpec
from executor.launches import indexer as il
from executor.launches.indexer import IndexerShape
from kernels import indexer_kernel_ref as ik

BENCH_CONTEXTS = (4096, 65536, 131072)
BENCH_ROWS = (1, 6, 48)                  # 1 decode row; one verify block; 8 verify blocks


class IndexerChain:
    """Every buffer of one index-source layer's indexer and its launches."""

    def __init__(self, device, bundle, shape: IndexerShape):
        self.shape = s = shape
        self.bundle = bundle
        self.specs = il.default_specs(s)
        # The cluster top-k variants, launched by `variant_launches` into their own outputs so
        # the defaults' results stay the measured reference: entries or candidate entries and
        # blocks alone (topk_c, blocks_c), both from one read (topk_b, blocks_b).
        self.variant_specs = il.cluster_specs(s)
        self.kernels = {k: bundle.kernel(v.name)
                        for k, v in {**self.specs, **self.variant_specs}.items()}
        reqs = il.requests(s, ("q", "w_raw", "positions", "seq_index", "cands", "qfrag",
                               "qscale", "qw", "plan", "keys", "block_tables", "scores",
                               "topk", "blocks_out"))
        r = s.max_rows
        reqs += [("topk_c", 4 * r * s.topk, "cluster variant"),
                 ("blocks_c", 4 * r * s.num_blocks, "cluster variant"),
                 ("topk_b", 4 * r * s.topk, "cluster variant, both"),
                 ("blocks_b", 4 * r * s.num_blocks, "cluster variant, both")]
        self.arena = Arena(device, reqs)

    def close(self) -> None:
        self.arena.close()

    def upload(self, name: str, array: np.ndarray) -> None:
        self.arena.upload(name, array)

    def download(self, name: str, dtype, shape) -> np.ndarray:
        return self.arena.download(name, dtype, shape)

    def poison(self, *names: str) -> None:
        for name in names:
            self.arena.fill(name, 0xFF)

    def ptrs(self, **renamed: str) -> dict[str, int]:
        """Device address of every slice by name; renamed maps a pointer name to another slice."""
        out = {name: self.arena.ptr(name) for name in self.arena.slices}
        out.update({name: self.arena.ptr(slice_) for name, slice_ in renamed.items()})
        return out

    def launches(self, rows: int, weight_scale: float) -> list[LaunchSpec]:
        return il.indexer_launches(self.bundle, self.shape, self.ptrs(), rows, weight_scale)

    def variant_launches(self, rows: int) -> dict[str, LaunchSpec]:
        """The cluster top-k variants on the scores `launches` left, by key (topkc, blocksc,
        bothc); each writes only the output(s) of its mode."""
        out = {"topkc": ("topk_c", "blocks_c"), "blocksc": ("topk_c", "blocks_c"),
               "bothc": ("topk_b", "blocks_b")}
        return {k: il.cluster_topk_launch(
                    self.bundle, self.shape, spec,
                    self.ptrs(topk=out[k][0], blocks_out=out[k][1]), rows)
                for k, spec in self.variant_specs.items()}


def random_key_records(rng, n: int) -> np.ndarray:
    """[n, 132] valid key records of random keys (never NaN bytes)."""
    from kernels import kvrecord_ref
    return kvrecord_ref.encode_index_key(rng.standard_normal((n, 128)).astype(np.float32))


def layout_rows(rows: int, context: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(positions, seq_index, sequences): 1 decode row, or verify blocks of 6 ending at context."""
    per = 1 if rows == 1 else 6
    seqs = ik.ceil_div(rows, per)
    pos, seq = [], []
    for q in range(seqs):
        n = min(per, rows - q * per)
        pos += list(range(context - n, context))
        seq += [q] * n
    return np.array(pos, np.int32), np.array(seq, np.int32), seqs


def bench_indexer(ctx) -> None:
    """Indexer at 4k/64k/128k contexts, R = 1, 6, 48: scores, top-k and the chain, L2 flushed;
    bytes = the key records each sequence must read once (+ q, scales, w)."""
    import cupy as cp

    from executor.benchmarks import fill_random_bf16
    bundle = ctx.bundle_with("indexer_scores_dense_h32")
    if bundle is None:
        raise LookupError("no bundle has the v41-flash indexer kernels")
    rng = np.random.default_rng()
    contexts = BENCH_CONTEXTS[:1] if ctx.quick else BENCH_CONTEXTS
    page = 64
    shape = IndexerShape(32, 1, "dense", 512, 2048, 8, page, max(BENCH_ROWS), 8, max(contexts),
                         candidate_source=True)
    chain = IndexerChain(ctx.device, bundle, shape)
    try:
        keys = chain.arena.view("keys", np.uint8)
        n_keys = keys.size // ik.KEY_BYTES
        chunk = random_key_records(rng, 65536).reshape(-1)
        for start in range(0, keys.size, chunk.size):
            stop = min(keys.size, start + chunk.size)
            keys[start:stop] = cp.asarray(chunk[:stop - start])
        tables = rng.permutation(n_keys // page)[:shape.max_seqs * shape.pages_per_seq]
        chain.upload("block_tables", tables.astype(np.int32))
        fill_random_bf16(chain.arena, "q")
        fill_random_bf16(chain.arena, "w_raw")
        for context in contexts:
            for rows in BENCH_ROWS:
                _bench_case(ctx, chain, context, rows)
    finally:
        chain.close()
    _bench_candidates(ctx, bundle, rng, contexts)


def _bench_candidates(ctx, bundle, rng, contexts) -> None:
    """Reindex-layer top-k (512 of the entries in 2048 candidate blocks): default vs cluster
    variant on random scores and random ascending candidate lists; outputs compared."""
    rows_max = max(BENCH_ROWS)
    shape = IndexerShape(32, 1, "candidates", 512, 2048, 8, 64, rows_max, 8, max(contexts))
    chain = IndexerChain(ctx.device, bundle, shape)
    try:
        chain.upload("scores", rng.standard_normal((rows_max, shape.max_entries), np.float32))
        reps = 20 if ctx.quick else 50
        for context in contexts:
            nb = context // 8
            picked = np.sort(rng.permuted(np.tile(np.arange(nb), (rows_max, 1)), axis=1)[:, :2048],
                             axis=1)
            cands = np.full((rows_max, 2048), -1, np.int32)       # fewer blocks than 2048: -1
            cands[:, :picked.shape[1]] = picked
            chain.upload("cands", cands)
            for rows in BENCH_ROWS:
                pos, seq, _ = layout_rows(rows, context)
                chain.upload("positions", pos)
                chain.upload("seq_index", seq)
                default = chain.launches(rows, 1.0)[2]
                variant = chain.variant_launches(rows)["topkc"]
                case = f"T={context // 1024}k cands"
                for name, sp in (("indexer_topk_candidates_k512", default),
                                 ("indexer_topkc_candidates_k512_c8", variant)):
                    us = ctx.cold_median_us(lambda sp=sp: sp.launch(ctx.stream), reps)
                    ctx.bandwidth(name, case, rows, us, rows * (4 * 8 * 2048 + 4 * 2048 + 4 * 512))
                ctx.stream.synchronize()
                same = np.array_equal(chain.download("topk", np.int32, (rows, 512)),
                                      chain.download("topk_c", np.int32, (rows, 512)))
                ctx.metric(f"indexer cluster top-k candidates == default ({case} R={rows})",
                           float(same), "", "1", same)
    finally:
        chain.close()


def _bench_case(ctx, chain: IndexerChain, context: int, rows: int) -> None:
    pos, seq, seqs = layout_rows(rows, context)
    chain.upload("positions", pos)
    chain.upload("seq_index", seq)
    specs = chain.launches(rows, 0.0156)
    bytes_scores = ik.scores_bytes([context] * seqs, rows, chain.shape.heads)
    case = f"T={context // 1024}k S={seqs}"
    _, scores, topk, blocks = specs

    def run_all():
        for sp in specs:
            sp.launch(ctx.stream)
    for sp in specs:                    # the plan and q must exist before the parts are timed
        sp.launch(ctx.stream)
    ctx.stream.synchronize()
    reps = 20 if ctx.quick else 50
    us = ctx.cold_median_us(lambda: scores.launch(ctx.stream), reps)
    row = ctx.bandwidth("indexer_scores_dense_h32", case, rows, us, bytes_scores)
    if context == 65536:
        ctx.metric(f"indexer scores R={rows} T=64k: % of 4.8 TB/s", row.pct_hbm, "%", ">= 70",
                   row.pct_hbm >= 70)
    us_topk = ctx.cold_median_us(lambda: topk.launch(ctx.stream), reps)
    ctx.bandwidth("indexer_topk_entries_k512", case, rows, us_topk,
                  ik.topk_bytes([context] * rows, 512))
    us_blocks = ctx.cold_median_us(lambda: blocks.launch(ctx.stream), reps)
    ctx.bandwidth("indexer_topk_blocks_k2048", case, rows, us_blocks,
                  ik.topk_bytes([context] * rows, 2048))
    us_chain = ctx.cold_median_us(run_all, reps)
    ctx.bandwidth("indexer_chain_layer20", case, rows, us_chain, bytes_scores)
    _bench_variants(ctx, chain, specs, case, context, rows, reps, bytes_scores)


def _bench_variants(ctx, chain, specs, case, context, rows, reps, bytes_scores) -> None:
    """The cluster top-k variants beside the defaults: each alone, and the chain using them."""
    v = chain.variant_launches(rows)
    chains = {"indexer_chain_layer20_topkc": specs[:2] + [v["topkc"], v["blocksc"]],
              "indexer_chain_layer20_bothc": specs[:2] + [v["bothc"]]}
    one_read = sum(4 * context + 4 * 512 + 4 * 2048 for _ in range(rows))
    for name, key, nbytes in (
            ("indexer_topkc_entries_k512_c8", "topkc", ik.topk_bytes([context] * rows, 512)),
            ("indexer_topkc_blocks_k2048_c8", "blocksc", ik.topk_bytes([context] * rows, 2048)),
            ("indexer_topkc_both_k512_b2048_c8", "bothc", one_read)):
        us = ctx.cold_median_us(lambda sp=v[key]: sp.launch(ctx.stream), reps)
        ctx.bandwidth(name, case, rows, us, nbytes)
    for name, launches in chains.items():
        def run(launches=launches):
            for sp in launches:
                sp.launch(ctx.stream)
        us = ctx.cold_median_us(run, reps)
        ctx.bandwidth(name, case, rows, us, bytes_scores)
        if context == 65536 and rows == 6:
            ctx.metric(f"{name} R=6 T=64k", us, "us")
    ctx.stream.synchronize()                  # every output now holds its kernel's last result
    same = all(np.array_equal(chain.download(a, np.int32, (rows, k)),
                              chain.download(b, np.int32, (rows, k)))
               for a, b, k in (("topk", "topk_c", 512), ("topk", "topk_b", 512),
                               ("blocks_out", "blocks_c", 2048),
                               ("blocks_out", "blocks_b", 2048)))
    ctx.metric(f"indexer cluster top-k outputs == default ({case} R={rows})", float(same), "",
               "1", same)
