"""Emulated embed / Engram launches (executor.emulate.embed, .engram) built by
executor.launches.embed_engram on a HostArena: every element against the references, and no byte
outside the launch's output rows changes.

Tiny bundle (D = 256, head_dim 32, 6 of 24 hash columns per rank), fresh random inputs each run,
R in {1, 5, 48, 192}: buffers are sized for 192 rows, so R < 192 is the padded-bucket case. The
whole arena is poisoned (0xFF) before the inputs go in; after the launches, every byte but the
output's first R rows must be unchanged. Tolerances (those of tests/gpu/test_embed_engram.py):
- embedding, hash ids, lookup: bitwise (a copy or zeros; integer arithmetic; E4M3 x 2^(s-127)
  rounded once to BF16);
- gate: |got - exact float64| <= `gate_error_bound` (fp32 sums at most as deep as the kernel's,
  sqrt, σ, then half a BF16 ulp; the bound holds for the NumPy reference too); in place and out of
  place bitwise equal.
"""
from dataclasses import replace

import embed_engram_cases as cases
import numpy as np
import pytest

from executor.embed_engram_chain import random_table
from executor.emulate import NoEmulator, emulate_launch, run
from executor.hostmem import AddressSpace, HostArena, ManifestBundle, OutOfBounds
from executor.launch import LaunchSpec
from executor.launches.embed_engram import (
    embed_launch,
    embed_requests,
    engram_gate_launch,
    engram_hash_launch,
    engram_lookup_launch,
    engram_requests,
    specs_from_bundle,
)
from kernels import engram_kernel_ref as ek
from kernels.common_ref import BF16, to_bf16
from loader.config import ModelConfig

MAX_ROWS = 192
ROWS = (1, 5, 48, MAX_ROWS)
LOOKUP_TABLE_ROWS = 4099
RNG = np.random.default_rng()


@pytest.fixture(scope="module")
def setup(tiny_bundle_dir):
    bundle = ManifestBundle(tiny_bundle_dir)
    return ModelConfig.preset("tiny"), bundle, specs_from_bundle(bundle)


def _arena(requests) -> tuple[AddressSpace, HostArena, dict[str, int]]:
    space = AddressSpace()
    arena = HostArena(space, requests)
    arena.buffer[...] = 0xFF
    return space, arena, {name: arena.ptr(name) for name, *_ in requests}


def _run_and_check_untouched(space, arena, launches, written: dict[str, int]) -> None:
    """Run the launches; only the first `written[name]` bytes of each named slice may change."""
    before = arena.buffer.copy()
    assert run(launches, space) == len(launches)
    may_change = np.zeros(arena.total_bytes, bool)
    for name, nbytes in written.items():
        start = arena.ptr(name) - arena.base
        may_change[start:start + nbytes] = True
    changed = np.flatnonzero((arena.buffer != before) & ~may_change)
    assert not changed.size, (f"{changed.size} bytes outside the outputs' rows changed, first at "
                              f"{space.name_of(arena.base + int(changed[0]))}")


def _random_bf16(shape) -> np.ndarray:
    return to_bf16(RNG.standard_normal(shape))


# ---- embedding -----------------------------------------------------------------------------------

def test_embed_rows_or_zeros(setup):
    cfg, bundle, (_, _, _, embeds) = setup
    for spec in embeds:                                   # vocab-parallel shard and replicated
        tp = cfg.vocab_size // spec.table_rows
        for rows in ROWS:
            space, arena, ptrs = _arena(embed_requests(spec, MAX_ROWS))
            table = _random_bf16((spec.table_rows, spec.width))
            offset = int(RNG.integers(tp)) * spec.table_rows
            ids = RNG.integers(0, cfg.vocab_size, rows).astype(np.int32)
            edges = [offset - 1, offset, offset + spec.table_rows - 1, offset + spec.table_rows]
            for j, e in enumerate(edges[:rows]):
                ids[j] = e if 0 <= e < cfg.vocab_size else offset
            arena.upload("table", table)
            arena.upload("token_ids", ids)
            launch = embed_launch(bundle, spec, ptrs, rows, offset)
            _run_and_check_untouched(space, arena, [launch], {"out": 2 * rows * spec.width})
            local = ids.astype(np.int64) - offset
            mine = (local >= 0) & (local < spec.table_rows)
            want = np.zeros((rows, spec.width), BF16)
            want[mine] = table[local[mine]]
            got = arena.download("out", BF16, (rows, spec.width))
            cases.bits_equal(got, want, f"{spec.name} rows={rows} offset={offset}")


# ---- Engram: hash, lookup, gate alone ------------------------------------------------------------

def _engram_arena(setup, table_rows: int, extra=()):
    _, _, (hashes, lookup, gate, _) = setup
    return _arena(engram_requests(hashes[0], lookup, gate, MAX_ROWS, table_rows) + list(extra))


def test_hash_ids_exact(setup):
    cfg, bundle, (hashes, _, _, _) = setup
    for spec in hashes:
        for rows in ROWS:
            space, arena, ptrs = _engram_arena(setup, 1)
            tokens, positions, vocab_map = cases.hash_inputs(RNG, cfg, spec, rows)
            arena.upload("tokens", tokens)
            arena.upload("positions", positions)
            arena.upload("vocab_map", vocab_map)
            launch = engram_hash_launch(bundle, spec, ptrs, rows)
            _run_and_check_untouched(space, arena, [launch], {"ids": 8 * rows * spec.cols})
            got = arena.download("ids", np.int64, (rows, spec.cols))
            want = ek.hash_ref(spec, tokens, positions, vocab_map)
            bad = np.argwhere(got != want)
            assert not len(bad), f"{spec.name} rows={rows}: {len(bad)} ids differ, first {bad[0]}"


def test_lookup_bitwise_and_nan_off_table(setup):
    _, bundle, (_, spec, _, _) = setup
    tp = spec.total_cols // spec.cols
    for rows in ROWS:
        space, arena, ptrs = _engram_arena(setup, LOOKUP_TABLE_ROWS)
        codes, scales = cases.every_code_table(RNG, LOOKUP_TABLE_ROWS, spec.head_dim)
        first_col = int(RNG.integers(tp)) * spec.cols
        row_offset = int(RNG.integers(0, 2**31 - LOOKUP_TABLE_ROWS))
        ids = cases.lookup_ids(RNG, spec, rows, first_col, row_offset, LOOKUP_TABLE_ROWS)
        for name, host in (("ids", ids), ("codes", codes), ("scales", scales)):
            arena.upload(name, host)
        launch = engram_lookup_launch(bundle, spec, {**ptrs, "out": ptrs["heads"]}, rows,
                                      first_col, row_offset, LOOKUP_TABLE_ROWS)
        out_bytes = 2 * rows * spec.cols * spec.head_dim
        _run_and_check_untouched(space, arena, [launch], {"heads": out_bytes})
        got = arena.download("heads", BF16, (rows, spec.cols, spec.head_dim))
        want = ek.lookup_ref(spec, ids, codes, scales, first_col, row_offset)
        assert np.isnan(want.astype(np.float32)).any() == (rows > 3)
        cases.bits_equal(got, want, f"{spec.name} rows={rows} first_col={first_col}")


def test_gate_within_bound_in_place_and_out_of_place(setup):
    cfg, bundle, (_, _, spec, _) = setup
    n, d = spec.streams, spec.width
    eps = cfg.rms_norm_eps
    for rows in ROWS:
        space, arena, ptrs = _engram_arena(setup, 1, [("streams_out", 2 * MAX_ROWS * n * d)])
        x, kv, qw, kw = cases.gate_inputs(RNG, rows, n, d)
        for name, host in (("streams", x), ("keys_and_value", kv), ("q_weight", qw),
                           ("k_weight", kw)):
            arena.upload(name, host)
        launches = [engram_gate_launch(bundle, spec, {**ptrs, "out": ptrs["streams_out"]},
                                       rows, eps),
                    engram_gate_launch(bundle, spec, {**ptrs, "out": ptrs["streams"]}, rows, eps)]
        nbytes = 2 * rows * n * d
        _run_and_check_untouched(space, arena, launches,
                                 {"streams_out": nbytes, "streams": nbytes})
        out = arena.download("streams_out", BF16, (rows, n, d))
        cases.bits_equal(arena.download("streams", BF16, (rows, n, d)), out,
                         f"{spec.name} rows={rows}: in place vs out of place")
        cases.check_gate(spec, out, x, kv, qw, kw, eps, f"{spec.name} rows={rows}")


# ---- one Engram layer's launch list on one arena -------------------------------------------------

def test_hash_lookup_gate_list_over_a_ranks_real_table(setup):
    """hash -> lookup (the hash's ids, a rank's real table shard) -> gate, run in order on one
    arena: the lookup must read what the hash wrote."""
    cfg, bundle, (hashes, lookup, gate, _) = setup
    tp = lookup.total_cols // lookup.cols
    n, d, eps = gate.streams, gate.width, cfg.rms_norm_eps
    for i, rows in enumerate(ROWS):
        hspec = hashes[i % len(hashes)]                     # every layer's hash constants
        rank = int(RNG.integers(tp))
        start, stop = cfg.engram_rank_rows(hspec.layer, tp, rank)
        space = AddressSpace()
        requests = engram_requests(hspec, lookup, gate, MAX_ROWS, stop - start)
        arena = HostArena(space, requests)
        arena.buffer[...] = 0xFF
        ptrs = {name: arena.ptr(name) for name, *_ in requests}
        codes, scales = random_table(RNG, stop - start, lookup.head_dim)
        tokens, positions, vocab_map = cases.hash_inputs(RNG, cfg, hspec, rows)
        x, kv, qw, kw = cases.gate_inputs(RNG, rows, n, d)
        for name, host in (("codes", codes), ("scales", scales), ("tokens", tokens),
                           ("positions", positions), ("vocab_map", vocab_map),
                           ("streams", x), ("keys_and_value", kv),
                           ("q_weight", qw), ("k_weight", kw)):
            arena.upload(name, host)
        launches = [engram_hash_launch(bundle, hspec, ptrs, rows),
                    engram_lookup_launch(bundle, lookup, {**ptrs, "out": ptrs["heads"]}, rows,
                                         rank * lookup.cols, start, stop - start),
                    engram_gate_launch(bundle, gate, {**ptrs, "out": ptrs["streams"]}, rows, eps)]
        _run_and_check_untouched(space, arena, launches, {
            "ids": 8 * rows * hspec.cols, "heads": 2 * rows * lookup.cols * lookup.head_dim,
            "streams": 2 * rows * n * d})
        ids = ek.hash_ref(hspec, tokens, positions, vocab_map)
        want = ek.lookup_ref(lookup, ids, codes, scales, rank * lookup.cols, start)
        assert not np.isnan(want.astype(np.float32)).any()   # every id is this rank's
        got = arena.download("heads", BF16, (rows, lookup.cols, lookup.head_dim))
        cases.bits_equal(got, want, f"{hspec.name} -> {lookup.name} rank={rank} rows={rows}")
        cases.check_gate(gate, arena.download("streams", BF16, (rows, n, d)), x, kv, qw, kw, eps,
                         f"{gate.name} after the lookup, rows={rows}")


# ---- wiring errors the emulator or the builders catch --------------------------------------------

def test_wiring_errors_are_named(setup):
    _, bundle, (hashes, lookup, gate, _) = setup
    space, arena, ptrs = _engram_arena(setup, 16)
    with pytest.raises(KeyError, match="no address for \\['out'\\]"):
        engram_gate_launch(bundle, gate, ptrs, 1, 1e-6)
    with pytest.raises(ValueError, match="first_col"):
        engram_lookup_launch(bundle, lookup, {**ptrs, "out": ptrs["heads"]}, 1,
                             lookup.total_cols, 0, 16)
    # table_rows larger than the codes slice: the emulated lookup reads past it.
    too_big = engram_lookup_launch(bundle, lookup, {**ptrs, "out": ptrs["heads"]}, 1, 0, 0,
                                   arena.total_bytes)
    with pytest.raises(OutOfBounds):
        run([too_big], space)
    # A hash grid short of the rows (one thread per row, no grid-stride) is refused.
    rec = bundle.kernel(hashes[0].name)
    short = LaunchSpec(rec, (1,), (ptrs["tokens"], ptrs["positions"], ptrs["vocab_map"],
                                   ptrs["ids"], MAX_ROWS))
    with pytest.raises(ValueError, match="covers 64 rows of 192"):
        emulate_launch(short, space)
    unknown = replace(bundle.kernel(gate.name), name="engram_other_d256")
    with pytest.raises(NoEmulator, match="engram_other_d256"):
        emulate_launch(LaunchSpec(unknown, (1,), (ptrs["streams"],) * 5 + (1, 1e-6)), space)
