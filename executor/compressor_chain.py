"""The compressor chain of one kv-source layer (A2 projection, A7-A9 publish): buffers and launches.

`CompressorChain` owns an arena with every buffer the two kernels touch (x, weights, kv_score,
ring, positions, sequence tables, RoPE table, record caches) and builds their launches with
`executor.launches.compressor` (which also holds `CompressorShape`, re-exported here); the GPU
tests and `bench_compressor` use it. Layouts: `kernels/compressor_kernel_ref.py`.
"""
from __future__ import annotations

import numpy as np

from executor.arena import Arena
from executor.launch import LaunchSpec
from executor.launches.compressor import (
    BUFFERS,
    CompressorShape,
    compressor_launches,
    kernel_specs,
    requests,
)
from kernels import compressor_kernel_ref as ck
from kernels import rope_ref

BENCH_ROWS = (1, 6, 48)


class CompressorChain:
    """Arena + launches of `compressor_proj_*` then `compressor_publish_*` for one ratio: the
    session-1 pair, or round 9's (bulk projection, staged publish) when `fast`."""

    def __init__(self, device, bundle, shape: CompressorShape, fast: bool = False):
        self.shape = shape
        self.fast = fast
        self.proj, self.pub = kernel_specs(shape, fast, shape.max_rows)
        self.arena = Arena(device, requests(shape))
        self.bundle = bundle
        self.kernels = (bundle.kernel(self.proj.name), bundle.kernel(self.pub.name))

    def close(self) -> None:
        self.arena.close()

    def upload(self, name: str, arr: np.ndarray) -> None:
        self.arena.upload(name, arr)

    def download(self, name: str, dtype, shape) -> np.ndarray:
        return self.arena.download(name, dtype, shape)

    def fill(self, name: str, byte: int) -> None:
        self.arena.fill(name, byte)

    def launches(self, rows: int, eps: float, fast: bool | None = None) -> list[LaunchSpec]:
        """[projection, publish]: this chain's pair, or the other one (`fast`) on the same
        buffers."""
        ptrs = {name: self.arena.ptr(name) for name in BUFFERS}
        fast = self.fast if fast is None else fast
        return compressor_launches(self.bundle, self.shape, ptrs, rows, eps, fast)


def decode_rows(rows: int, context: int, per_seq: int = 6):
    """Positions / seq_index of `rows` rows: sequences of up to `per_seq` consecutive positions
    ending at `context` - 1 (so a 6-row block straddles three odd positions)."""
    pos, seq = [], []
    q = 0
    while len(pos) < rows:
        n = min(per_seq, rows - len(pos))
        pos += list(range(context - n, context))
        seq += [q] * n
        q += 1
    return np.array(pos, np.int32), np.array(seq, np.int32), q


def bench_compressor(ctx) -> None:
    """Projection and publish, both ratios, R = 1, 6, 48 (6 rows a sequence), L2 flushed: the
    session-1 pair and round 9's (bulk projection, staged publish) on the same buffers, each
    kernel alone and the pair back to back (publish PDL-launched after the projection).
    Bytes: weights once + x + kv_score (projection); the publish formula of
    `CompressorSpec.bytes_moved`. Context does not matter to these kernels (4k positions)."""
    from executor.benchmarks import fill_random_bf16, fill_random_u32
    bundle = (ctx.bundle_with("compressor_proj_r2_k5120_bulk")
              or ctx.bundle_with("compressor_proj_r2_k5120"))
    if bundle is None:
        raise LookupError("no bundle has the v41-flash compressor kernels")
    # A bundle built before round 9 times the session-1 pair alone.
    pairs = (False, True) if "compressor_proj_r2_k5120_bulk" in bundle.names() else (False,)
    rng = np.random.default_rng()
    reps = 20 if ctx.quick else 50
    for ratio in (2, 1):
        shape = CompressorShape(ratio, 5120, max(BENCH_ROWS), 8, 64, 64, 8 * 64, 4096)
        chain = CompressorChain(ctx.device, bundle, shape)
        try:
            fill_random_bf16(chain.arena, "x")
            if ratio == 2:
                fill_random_u32(chain.arena, "w")
                w = chain.arena.view("w", np.uint32)     # finite fp32: +-[2^-7, 2^-6)
                w[...] = (w & 0x807FFFFF) | 0x3C000000
            else:
                fill_random_bf16(chain.arena, "w")
            fill_random_bf16(chain.arena, "wk")
            chain.upload("norm_w", np.ones(ck.HEAD_DIM, np.float32))
            chain.upload("k_norm", np.ones(ck.INDEX_DIM, np.float32))
            chain.upload("table", rope_ref.RopeTable.build(
                "plain", rope_ref.plain_inv_freq(1e4), 4096).cos_sin)
            chain.upload("state_lines", np.arange(8, dtype=np.int32))
            chain.upload("block_tables", rng.permutation(8 * 64).astype(np.int32))
            chain.fill("ring", 0)
            for rows in BENCH_ROWS:
                pos, seq, seqs = decode_rows(rows, 4000)
                chain.upload("positions", pos)
                chain.upload("seq_index", seq)
                for fast in pairs:
                    _bench_pair(ctx, chain, rows, seqs, pos, fast, reps)
        finally:
            chain.close()


def _bench_pair(ctx, chain: CompressorChain, rows: int, seqs: int, pos: np.ndarray, fast: bool,
                reps: int) -> None:
    proj, pub = chain.launches(rows, 1e-6, fast)
    proj_spec, pub_spec = kernel_specs(chain.shape, fast, rows)
    ratio = chain.shape.ratio
    for sp in (proj, pub):
        sp.launch(ctx.stream)
    ctx.stream.synchronize()
    case = f"S={seqs}"
    us = ctx.cold_median_us(lambda: proj.launch(ctx.stream), reps)
    row = ctx.bandwidth(proj_spec.name, case, rows, us, proj_spec.bytes_moved(rows))
    if fast and proj_spec.variant != "bulk":       # r9b's bulk kernel beside the step's choice
        bulk = ck.make_proj_spec(ratio, chain.shape.hidden, "bulk")
        if bulk.name in chain.bundle.names():
            sp = LaunchSpec(chain.bundle.kernel(bulk.name), bulk.grid(rows), proj.args)
            us_bulk = ctx.cold_median_us(lambda: sp.launch(ctx.stream), reps)
            ctx.bandwidth(bulk.name, case, rows, us_bulk, bulk.bytes_moved(rows))
    if ratio == 2 and rows == 6:
        ctx.metric(f"{proj_spec.name} R=6: % of 4.8 TB/s", row.pct_hbm, "%",
                   ">= 70" if fast else "", row.pct_hbm >= 70 if fast else None)
    publishing = int(np.sum(pos % ratio == ratio - 1))
    us = ctx.cold_median_us(lambda: pub.launch(ctx.stream), reps)
    ctx.bandwidth(pub_spec.name, case, rows, us, pub_spec.bytes_moved(rows, publishing))

    def pair():
        proj.launch(ctx.stream)
        pub.launch(ctx.stream)
    us = ctx.cold_median_us(pair, reps)
    tag = "round 9 (bulk + staged)" if fast else "session 1"
    ctx.metric(f"compressor r={ratio} R={rows} projection + publish, {tag}", us, "us")
