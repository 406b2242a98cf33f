"""The embedding lookup and the Engram kernels on device buffers: arenas, launches; their benchmark.

Used by tests/gpu/test_embed_engram.py and by `hopdec devicecheck` (benchmark "embed_engram",
`executor.embed_engram_chain:bench_embed_engram`). One Engram layer of one rank is three launches
here: hash ids, lookup of the rank's heads, gate; `wkv` (dense family) and the all-gather of the
heads (collectives) sit between lookup and gate in the step and are not part of this chain. The
LaunchSpecs themselves come from `executor.launches.embed_engram` (pointer-level builders, which
the step wiring calls too); this module owns the buffers.

The Engram table is either a slice of the device arena or a `PinnedTable`: page-locked host memory
mapped into the device's address space (UVA), which the same lookup kernel reads over PCIe.
"""
from __future__ import annotations

import ctypes

import numpy as np

from executor.arena import Arena
from executor.cuda import check, driver
from executor.launch import LaunchSpec
from executor.launches.embed_engram import (
    embed_launch,
    engram_gate_launch,
    engram_hash_launch,
    engram_lookup_launch,
    specs_from_bundle,
)
from kernels import embed_ref as er
from kernels import engram_kernel_ref as ek

MAX_ROWS = 192
BENCH_ROWS = (1, 5, 6, 12, 48, 192)
QUICK_ROWS = (1, 6, 48, 192)
BENCH_TABLE_ROWS = 1 << 20         # 1M rows x 264 B = 277 MB: larger than L2, read at random rows


class PinnedTable:
    """Page-locked, device-mapped host memory for an Engram table shard (codes, then scales)."""

    def __init__(self, table_rows: int, head_dim: int):
        cu = driver()
        self.codes_bytes = table_rows * head_dim
        self.nbytes = self.codes_bytes + table_rows * (head_dim // 32)
        flags = cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE
        self.host = int(check(cu.cuMemHostAlloc(self.nbytes, flags)))
        self.device_ptr = int(check(cu.cuMemHostGetDevicePointer(self.host, 0)))

    def view(self) -> np.ndarray:
        """The whole buffer as host uint8 (fill it here; the device reads it in place)."""
        return np.ctypeslib.as_array((ctypes.c_uint8 * self.nbytes).from_address(self.host))

    def close(self) -> None:
        if self.host:
            check(driver().cuMemFreeHost(self.host))
            self.host = 0


class EmbedLookup:
    """Token ids, one rank's (or the replicated) table and the output, sized for `max_rows`."""

    def __init__(self, device, bundle, spec: er.EmbedSpec, max_rows: int = MAX_ROWS):
        self.spec, self.max_rows = spec, max_rows
        self.bundle, self.kernel = bundle, bundle.kernel(spec.name)
        self.arena = Arena(device, [
            ("token_ids", 4 * max_rows), ("table", 2 * spec.table_rows * spec.width),
            ("out", 2 * max_rows * spec.width)])

    def launch(self, rows: int, vocab_offset: int) -> LaunchSpec:
        p = self.arena.ptr
        return embed_launch(self.bundle, self.spec,
                            {"token_ids": p("token_ids"), "table": p("table"), "out": p("out")},
                            rows, vocab_offset)

    def close(self) -> None:
        self.arena.close()


class EngramLayer:
    """Every buffer of one rank's Engram layer: history, ids, table shard, heads, streams, wkv out.

    `host_table`: the shard lives in a PinnedTable instead of the arena (same kernel, UVA).
    """

    def __init__(self, device, bundle, hash_spec: ek.EngramHashSpec,
                 lookup_spec: ek.EngramLookupSpec, gate_spec: ek.EngramGateSpec,
                 table_rows: int, max_rows: int = MAX_ROWS, host_table: bool = False):
        self.hash_spec, self.lookup_spec, self.gate_spec = hash_spec, lookup_spec, gate_spec
        self.table_rows, self.max_rows = table_rows, max_rows
        self.bundle = bundle
        self.kernels = {s.name: bundle.kernel(s.name) for s in (hash_spec, lookup_spec, gate_spec)}
        hd, n, d = lookup_spec.head_dim, gate_spec.streams, gate_spec.width
        slices = [
            ("tokens", 4 * max_rows * hash_spec.max_ngram), ("positions", 4 * max_rows),
            ("vocab_map", 4 * hash_spec.vocab_size),
            ("ids", 8 * max_rows * lookup_spec.total_cols),
            ("chosen_ids", 8 * max_rows * lookup_spec.total_cols),   # ids fed without the hash
            ("heads", 2 * max_rows * lookup_spec.cols * hd),
            ("streams", 2 * max_rows * n * d), ("streams_out", 2 * max_rows * n * d),
            ("keys_and_value", 2 * max_rows * (n + 1) * d),
            ("q_weight", 2 * n * d), ("k_weight", 2 * n * d)]
        self.pinned = PinnedTable(table_rows, hd) if host_table else None
        if not host_table:
            slices += [("codes", table_rows * hd), ("scales", table_rows * (hd // 32))]
        self.arena = Arena(device, slices)

    def table_ptrs(self) -> tuple[int, int]:
        if self.pinned is not None:
            return self.pinned.device_ptr, self.pinned.device_ptr + self.pinned.codes_bytes
        return self.arena.ptr("codes"), self.arena.ptr("scales")

    def upload_table(self, codes: np.ndarray, scales: np.ndarray) -> None:
        """Codes uint8 [table_rows, head_dim], scales uint8 [table_rows, head_dim/32], checked."""
        ek.check_lookup_table(codes, scales, self.lookup_spec.head_dim)
        if codes.shape[0] != self.table_rows:
            raise ValueError(f"engram table: {codes.shape[0]} rows, the layer holds "
                             f"{self.table_rows}")
        if self.pinned is not None:
            view = self.pinned.view()
            view[:self.pinned.codes_bytes] = codes.ravel()
            view[self.pinned.codes_bytes:] = scales.ravel()
            return
        from executor.mhc_router_chain import upload
        upload(self.arena, "codes", codes)
        upload(self.arena, "scales", scales)

    def upload_vocab_map(self, vocab_map: np.ndarray) -> None:
        """The compressed-vocab map, int32 [vocab_size] (values any int32: the kernel and
        hash_ref only index it)."""
        vocab_map = np.asarray(vocab_map)
        if vocab_map.dtype != np.int32 or vocab_map.shape != (self.hash_spec.vocab_size,):
            raise ValueError(f"engram vocab map must be int32 [{self.hash_spec.vocab_size}], "
                             f"got {vocab_map.dtype} {list(vocab_map.shape)}")
        from executor.mhc_router_chain import upload
        upload(self.arena, "vocab_map", vocab_map)

    def launch_hash(self, rows: int) -> LaunchSpec:
        p = self.arena.ptr
        return engram_hash_launch(self.bundle, self.hash_spec,
                                  {"tokens": p("tokens"), "positions": p("positions"),
                                   "vocab_map": p("vocab_map"), "ids": p("ids")}, rows)

    def launch_lookup(self, rows: int, first_col: int, row_offset: int,
                      ids: str = "ids") -> LaunchSpec:
        """`ids`: the hash's output ("ids") or ids the caller uploaded ("chosen_ids")."""
        codes, scales = self.table_ptrs()
        p = self.arena.ptr
        return engram_lookup_launch(self.bundle, self.lookup_spec,
                                    {"ids": p(ids), "codes": codes, "scales": scales,
                                     "out": p("heads")},
                                    rows, first_col, row_offset, self.table_rows)

    def launch_gate(self, rows: int, eps: float, in_place: bool = True) -> LaunchSpec:
        p = self.arena.ptr
        out = "streams" if in_place else "streams_out"
        return engram_gate_launch(self.bundle, self.gate_spec,
                                  {"streams": p("streams"), "keys_and_value": p("keys_and_value"),
                                   "q_weight": p("q_weight"), "k_weight": p("k_weight"),
                                   "out": p(out)}, rows, eps)

    def close(self) -> None:
        self.arena.close()
        if self.pinned is not None:
            self.pinned.close()


def random_table(rng, table_rows: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Finite E4M3 codes (no 0x7F/0xFF) and UE8M0 scales in [110, 134]."""
    codes = rng.integers(0, 256, (table_rows, head_dim), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] ^= 0x01
    scales = rng.integers(110, ek.MAX_SCALE_BYTE + 1, (table_rows, head_dim // 32), dtype=np.uint8)
    return codes, scales


def random_vocab_map(rng, vocab: int, compressed: int) -> np.ndarray:
    """A random surjective non-identity map int32 [vocab] onto [0, compressed)."""
    return (rng.permutation(vocab) % compressed).astype(np.int32)


def _fill(layer: EngramLayer, rng) -> None:
    from executor.benchmarks import fill_random_bf16
    from executor.mhc_router_chain import upload
    for name in ("streams", "keys_and_value"):
        fill_random_bf16(layer.arena, name)
    ones = np.full(layer.gate_spec.streams * layer.gate_spec.width, 0x3F80, np.uint16)  # 1.0
    upload(layer.arena, "q_weight", ones)
    upload(layer.arena, "k_weight", ones)
    hs, cols = layer.hash_spec, layer.lookup_spec.total_cols
    upload(layer.arena, "tokens", rng.integers(0, 1000, (layer.max_rows, hs.max_ngram),
                                               dtype=np.int32))
    upload(layer.arena, "positions", np.arange(layer.max_rows, dtype=np.int32) + 100)
    layer.upload_vocab_map(random_vocab_map(rng, hs.vocab_size, hs.vocab_size * 3 // 4 + 1))
    upload(layer.arena, "chosen_ids",
           rng.integers(0, layer.table_rows, (layer.max_rows, cols), dtype=np.int64))
    layer.upload_table(*random_table(rng, layer.table_rows, layer.lookup_spec.head_dim))


def bench_embed_engram(ctx) -> None:
    """Embedding lookup, and Engram's hash, lookup (device table, then pinned host table through
    UVA) and gate, alone and as the 3-launch PDL chain, at R = 1..192, L2 flushed before each rep.
    The table has BENCH_TABLE_ROWS rows (smaller than a real shard, read the same way: random
    rows); ids are drawn uniformly over it."""
    bundle = ctx.bundle_with("engram_lookup_")
    if bundle is None:
        raise LookupError("no bundle has the engram kernels")
    rng = np.random.default_rng()
    hashes, lookup, gate, embeds = specs_from_bundle(bundle)
    embed = EmbedLookup(ctx.device, bundle, min(embeds, key=lambda s: s.table_rows))
    layers = [EngramLayer(ctx.device, bundle, hashes[0], lookup, gate, BENCH_TABLE_ROWS,
                          host_table=host) for host in (False, True)]
    try:
        from executor.benchmarks import fill_random_bf16
        from executor.mhc_router_chain import upload
        fill_random_bf16(embed.arena, "table")
        for layer in layers:
            _fill(layer, rng)
        reps = 20 if ctx.quick else 50
        for rows in QUICK_ROWS if ctx.quick else BENCH_ROWS:
            upload(embed.arena, "token_ids",
                   rng.integers(0, embed.spec.table_rows, embed.max_rows, dtype=np.int32))
            _bench_rows(ctx, embed, layers, rows, reps)
    finally:
        embed.close()
        for layer in layers:
            layer.close()


def _bench_rows(ctx, embed: EmbedLookup, layers, rows: int, reps: int) -> None:
    def timed(launch, name: str, case: str, nbytes: int) -> float:
        us = ctx.cold_median_us(lambda: launch.launch(ctx.stream), reps=reps)
        ctx.bandwidth(name, case, rows, us, nbytes)
        return us

    pred = er.predicted_us(rows, embed.spec.width)
    timed(embed.launch(rows, 0), embed.spec.name, f"pred {pred:.1f} us",
          embed.spec.bytes_moved(rows))
    device, host = layers
    hs, ls, gs = device.hash_spec, device.lookup_spec, device.gate_spec
    timed(device.launch_hash(rows), hs.name, "alone", hs.bytes_moved(rows))
    for layer, where in ((device, "device table"), (host, "pinned host table (UVA)")):
        timed(layer.launch_lookup(rows, 0, 0, "chosen_ids"), ls.name, where, ls.bytes_moved(rows))
    timed(device.launch_gate(rows, 1e-20), gs.name, "in place", gs.bytes_moved(rows))
    # The bench table is smaller than the layer's rows the hash spreads over, so the chain's
    # lookup reads the uploaded in-range ids (same timing: PDL orders it after the hash anyway).
    chain = [device.launch_hash(rows), device.launch_lookup(rows, 0, 0, "chosen_ids"),
             device.launch_gate(rows, 1e-20)]

    def run_chain():
        for launch in chain:
            launch.launch(ctx.stream)
    us = ctx.cold_median_us(run_chain, reps=reps)
    nbytes = hs.bytes_moved(rows) + ls.bytes_moved(rows) + gs.bytes_moved(rows)
    pred = ek.predicted_us(rows, gs.width, ls.cols, ls.head_dim, gs.streams)
    ctx.metric(f"engram hash+lookup+gate, R={rows} (pred {pred:.1f} us, floor "
               f"{nbytes / 4.8e6:.2f} us)", us, "us")
