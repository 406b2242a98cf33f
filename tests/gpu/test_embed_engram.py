"""GPU tests of the embedding lookup and the Engram kernels (hash ids, FP8 table lookup, gate).

Bundles: HOPDEC_BUNDLE (tiny: D = 256, head_dim 32) and HOPDEC_BUNDLE_V41 (D = 5120, head_dim 256);
every embed / engram kernel of each bundle, R in {1, 5, 6, 12, 48, 192}. Every case draws fresh
inputs, poisons every output with 0xFF bytes (NaN as bf16, -1 as int64) and checks every element.

Tolerances (kernels/embed_ref.py, kernels/engram_kernel_ref.py):
- embedding: bitwise (a copy or zeros); ids on both sides of the rank's range.
- hash ids: exact (integer arithmetic) against `hash_ref`: raw token ids over the whole
  vocabulary through a fresh random non-identity compressed-vocab map (surjective onto a range
  smaller than the vocabulary); positions 0..3 exercise the pad (the raw pad id, mapped), tokens
  -1 / vocab_size / INT32_MIN the off-map guard (read as the pad), a token mapped to the largest
  compressed id the largest products.
- lookup: bitwise against `lookup_ref` (E4M3 x 2^(s-127) rounded once to BF16, the same single
  rounding in both), over every finite code and scale bytes 0..134; off-table ids give NaN heads;
  from device memory and from pinned host memory (UVA). Tiny: also hash -> lookup over a rank's
  whole real table.
- gate: |got - exact float64| <= `gate_error_bound` (fp32 sums of depth 8·vecs + 5 + warps - 1:
  the gate within 3·depth·2^-24 of t = rx·rk·Σ|terms|/√D through the signed root and σ, ex2.approx
  2^-20, then half a BF16 ulp); a gate error of 1e-2 breaks the bound (CPU test). In place and
  out of place give bitwise the same streams (fixed summation order).
"""
from __future__ import annotations

import embed_engram_cases as cases
import numpy as np
import pytest

from executor.embed_engram_chain import (
    EmbedLookup,
    EngramLayer,
    random_table,
    specs_from_bundle,
)
from executor.mhc_router_chain import download, poison, upload
from kernels import engram_kernel_ref as ek
from kernels.common_ref import BF16

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

ROWS = (1, 5, 6, 12, 48, 192)
RNG = np.random.default_rng()
LOOKUP_TABLE_ROWS = 4099


@pytest.fixture(scope="module")
def setup(preset_bundle):
    """(config, bundle, the chain's specs) for each preset whose bundle is built."""
    cfg, bundle = preset_bundle
    return cfg, bundle, specs_from_bundle(bundle)


# ---- embedding -----------------------------------------------------------------------------------

def test_embed_rows_or_zeros(dev, stream, setup):
    from executor.benchmarks import fill_random_bf16
    cfg, bundle, (_, _, _, embeds) = setup
    for spec in embeds:
        lookup = EmbedLookup(dev, bundle, spec)
        try:
            fill_random_bf16(lookup.arena, "table")
            table = lookup.arena.view("table", np.uint16, (spec.table_rows, spec.width))
            tp = cfg.vocab_size // spec.table_rows
            for rows in ROWS:
                rank = int(RNG.integers(tp))
                offset = rank * spec.table_rows
                ids = RNG.integers(0, cfg.vocab_size, rows).astype(np.int32)
                edges = [offset - 1, offset, offset + spec.table_rows - 1,
                         offset + spec.table_rows]
                for j, e in enumerate(edges[:rows]):
                    ids[j] = e if 0 <= e < cfg.vocab_size else offset
                upload(lookup.arena, "token_ids", ids)
                poison(lookup.arena, "out")
                cp.cuda.Device().synchronize()
                lookup.launch(rows, offset).launch(stream)
                stream.synchronize()
                got = download(lookup.arena, "out", BF16, (rows, spec.width))
                local = ids.astype(np.int64) - offset
                mine = (local >= 0) & (local < spec.table_rows)
                want = np.zeros((rows, spec.width), np.uint16)
                want[mine] = cp.asnumpy(table[cp.asarray(local[mine])])
                cases.bits_equal(got, want.view(BF16), f"{spec.name} rows={rows} rank={rank}")
        finally:
            lookup.close()


# ---- hash ids ------------------------------------------------------------------------------------

def _load_hash_inputs(layer, tokens, positions, vocab_map, output: str) -> None:
    """Upload one hash launch's inputs, poison `output`, wait for the copies."""
    upload(layer.arena, "tokens", tokens)
    upload(layer.arena, "positions", positions)
    layer.upload_vocab_map(vocab_map)
    poison(layer.arena, output)
    cp.cuda.Device().synchronize()


def test_hash_ids_exact(dev, stream, setup):
    cfg, bundle, (hashes, lookup, gate, _) = setup
    for spec in hashes:
        layer = EngramLayer(dev, bundle, spec, lookup, gate, table_rows=32)
        try:
            for rows in ROWS:
                tokens, positions, vocab_map = cases.hash_inputs(RNG, cfg, spec, rows)
                _load_hash_inputs(layer, tokens, positions, vocab_map, "ids")
                layer.launch_hash(rows).launch(stream)
                stream.synchronize()
                got = download(layer.arena, "ids", np.int64, (rows, spec.cols))
                want = ek.hash_ref(spec, tokens, positions, vocab_map)
                bad = np.argwhere(got != want)
                assert not len(bad), (f"{spec.name} rows={rows}: {len(bad)} ids differ, first "
                                      f"{tuple(bad[0])}: got {got[tuple(bad[0])]} want "
                                      f"{want[tuple(bad[0])]}")
        finally:
            layer.close()


# ---- lookup --------------------------------------------------------------------------------------

@pytest.mark.parametrize("host_table", [False, True], ids=["device", "pinned-host"])
def test_lookup_bitwise(dev, stream, setup, host_table):
    _, bundle, (hashes, spec, gate, _) = setup
    layer = EngramLayer(dev, bundle, hashes[0], spec, gate, LOOKUP_TABLE_ROWS,
                        host_table=host_table)
    try:
        codes, scales = cases.every_code_table(RNG, LOOKUP_TABLE_ROWS, spec.head_dim)
        layer.upload_table(codes, scales)
        tp = spec.total_cols // spec.cols
        for rows in ROWS:
            first_col = int(RNG.integers(tp)) * spec.cols
            row_offset = int(RNG.integers(0, 2**31 - LOOKUP_TABLE_ROWS))
            ids = cases.lookup_ids(RNG, spec, rows, first_col, row_offset, LOOKUP_TABLE_ROWS)
            upload(layer.arena, "chosen_ids", ids)
            poison(layer.arena, "heads")
            cp.cuda.Device().synchronize()
            layer.launch_lookup(rows, first_col, row_offset, "chosen_ids").launch(stream)
            stream.synchronize()
            got = download(layer.arena, "heads", BF16, (rows, spec.cols, spec.head_dim))
            want = ek.lookup_ref(spec, ids, codes, scales, first_col, row_offset)
            cases.bits_equal(got, want, f"{spec.name} rows={rows} host={host_table}")
    finally:
        layer.close()


# Tiny only: a v41-flash rank's real table is ~96M rows (25 GB); test_lookup_bitwise covers real widths.
@pytest.mark.parametrize("preset", ["tiny"], indirect=True)
def test_hash_then_lookup_over_a_ranks_real_table(dev, stream, setup):
    cfg, bundle, (hashes, spec, gate, _) = setup
    tp = spec.total_cols // spec.cols
    for hspec in hashes:
        rank = int(RNG.integers(tp))
        start, stop = cfg.engram_rank_rows(hspec.layer, tp, rank)
        layer = EngramLayer(dev, bundle, hspec, spec, gate, stop - start)
        try:
            codes, scales = random_table(RNG, stop - start, spec.head_dim)
            layer.upload_table(codes, scales)
            rows = 48
            tokens, positions, vocab_map = cases.hash_inputs(RNG, cfg, hspec, rows)
            positions = RNG.integers(0, 50, rows).astype(np.int32)
            _load_hash_inputs(layer, tokens, positions, vocab_map, "heads")
            layer.launch_hash(rows).launch(stream)
            layer.launch_lookup(rows, rank * spec.cols, start).launch(stream)
            stream.synchronize()
            got = download(layer.arena, "heads", BF16, (rows, spec.cols, spec.head_dim))
            ids = ek.hash_ref(hspec, tokens, positions, vocab_map)
            want = ek.lookup_ref(spec, ids, codes, scales, rank * spec.cols, start)
            assert not np.isnan(want.astype(np.float32)).any()   # every id is this rank's
            cases.bits_equal(got, want, f"{hspec.name} -> {spec.name} rank={rank}")
        finally:
            layer.close()


# ---- gate ----------------------------------------------------------------------------------------

def test_gate_within_bound(dev, stream, setup):
    cfg, bundle, (hashes, lookup, spec, _) = setup
    n, d = spec.streams, spec.width
    layer = EngramLayer(dev, bundle, hashes[0], lookup, spec, table_rows=32)
    try:
        for rows in ROWS:
            x, kv, qw, kw = cases.gate_inputs(RNG, rows, n, d)
            for name, host in (("streams", x), ("keys_and_value", kv), ("q_weight", qw),
                               ("k_weight", kw)):
                upload(layer.arena, name, host)
            poison(layer.arena, "streams_out")
            cp.cuda.Device().synchronize()
            layer.launch_gate(rows, cfg.rms_norm_eps, in_place=False).launch(stream)
            layer.launch_gate(rows, cfg.rms_norm_eps, in_place=True).launch(stream)
            stream.synchronize()
            out = download(layer.arena, "streams_out", BF16, (rows, n, d))
            in_place = download(layer.arena, "streams", BF16, (rows, n, d))
            cases.bits_equal(in_place, out, f"{spec.name} rows={rows}: in place vs out of place")
            cases.check_gate(spec, out, x, kv, qw, kw, cfg.rms_norm_eps, f"{spec.name} rows={rows}")
    finally:
        layer.close()
