"""CPU: the compressor launches (executor.launches.compressor) emulated on host memory, against the
model reference the GPU test uses (tests/gpu/test_compressor_publish.py).

Fresh random inputs every run, the GPU test's setup on the tiny bundle's kernels (D = 256): bf16
x, fp32 (r = 2) or bf16 (r = 1) weights, rings holding the 8 positions before each block on
permuted state lines (NaN in lines no sequence owns), permuted block tables, padding rows, one
entry on an unallocated page. Every output buffer is poisoned (kv_score and the caches 0xFF)
before the two launches run in one `emulate.run`, with rows < the arena's rows where the case
says so (a padded bucket). Checks, every element, the GPU test's tolerances:
- kv_score within gamma_n sum |x||w| of the float64 product (n = D/32 + 6 fp32 roundings: the
  lane's fma chain plus the butterfly), poison (NaN) in rows >= R;
- ring bitwise against `publish_ref` run on the emulated kv_score (the kernel copies rows);
- records decoded within `entry_tolerance` / `key_tolerance` (one FP8 step plus the fp32 pipeline),
  pad byte 0; every slot nothing publishes to keeps its 0xFF poison.
"""
from __future__ import annotations

import dataclasses

import compressor_cases as cases
import numpy as np
import pytest

from executor.emulate import NoEmulator, run
from executor.hostmem import AddressSpace, HostArena, ManifestBundle
from executor.launch import LaunchSpec
from executor.launches.compressor import (
    BUFFERS,
    CompressorShape,
    compressor_launches,
    requests,
)
from kernels import compressor_kernel_ref as ck
from kernels import kvrecord_ref, rope_ref
from kernels.common_ref import BF16
from loader import formats
from loader.config import ModelConfig

PAGE = 16
PAGES = 80                     # per sequence: 1280 entries (position 1101 at r = 1)
NUM_POSITIONS = 2048
# name: (blocks (start position, rows) per sequence, padding rows, arena rows)
CASES = {
    "decode_odd_in_bucket_8": ([(1001, 1)], 1, 8),
    "decode_even": ([(1000, 1)], 0, 1),
    "verify_odd_start": ([(1001, 6)], 2, 8),
    "drafts_and_zero": ([(999, 5), (40, 5), (0, 6)], 3, 24),
    "max_rows_192": ([(1101 - 29 * q, 6) for q in range(32)], 0, 192),
}


@pytest.fixture(scope="module")
def bundle(tiny_bundle_dir):
    return ManifestBundle(tiny_bundle_dir)


def _case_inputs(rng, cfg, ratio: int, case: str, hidden: int):
    blocks, padding, arena_rows = CASES[case]
    seqs = len(blocks)
    positions, seq_index, lines = cases.make_rows(rng, blocks, padding, seqs)
    num_pages = seqs * PAGES + 5
    tables = rng.permutation(num_pages)[:seqs * PAGES].reshape(seqs, PAGES).astype(np.int32)
    if seqs > 1:                               # one sequence's entry page is unallocated
        tables[0, (999 // ratio) // PAGE] = -1
    ring = cases.rings_before(rng, blocks, lines, seqs + 3)
    r = positions.size
    shape = CompressorShape(ratio, hidden, arena_rows, seqs + 3, PAGES, PAGE, num_pages,
                            NUM_POSITIONS)
    inputs = {
        "x": formats.bf16_round(rng.standard_normal((r, hidden)).astype(np.float32)),
        "w": cases.random_weights(rng, ratio, hidden), "ring": ring, "positions": positions,
        "seq_index": seq_index, "state_lines": lines, "block_tables": tables,
        "norm_w": (rng.random(ck.HEAD_DIM) * 2).astype(np.float32),
        "wk": formats.bf16_round((rng.standard_normal((ck.INDEX_DIM, ck.HEAD_DIM))
                                  * ck.HEAD_DIM ** -0.5).astype(np.float32)),
        "k_norm": (rng.random(ck.INDEX_DIM) * 2).astype(np.float32),
        "table": rope_ref.RopeTable.for_ratio(cfg, ratio, NUM_POSITIONS)}
    return shape, inputs


def _upload(arena: HostArena, inputs: dict, ratio: int) -> None:
    """In the kernels' formats: bf16 bits for x, wk and the r = 1 weight, fp32 otherwise."""
    for name, arr in inputs.items():
        if name == "table":
            arr = arr.cos_sin
        elif name in ("x", "wk") or (name == "w" and ratio == 1):
            arr = arr.astype(BF16)
        arena.upload(name, arr)
    for name in ("kv_score", "cache", "keys"):
        arena.fill(name, 0xFF)


@pytest.mark.parametrize("fast", [True, False], ids=["round9", "session1"])
@pytest.mark.parametrize("ratio", [2, 1])
@pytest.mark.parametrize("case", sorted(CASES))
def test_emulated_compressor_equals_the_reference(bundle, ratio, case, fast):
    rng = np.random.default_rng()
    cfg = ModelConfig.preset("tiny")
    hidden = bundle.kernel(f"compressor_proj_r{ratio}_k{cfg.hidden_size}").spec["hidden"]
    shape, inputs = _case_inputs(rng, cfg, ratio, case, hidden)
    positions, seq_index = inputs["positions"], inputs["seq_index"]
    rows, eps = positions.size, float(cfg.rms_norm_eps)
    space = AddressSpace()
    arena = HostArena(space, requests(shape))
    _upload(arena, inputs, ratio)
    launches = compressor_launches(bundle, shape, {n: arena.ptr(n) for n in BUFFERS}, rows, eps,
                                   fast)
    assert [sp.kernel.name.endswith(("_bulk", "_bulkr", "_bulk16", "_staged"))
            for sp in launches] == [fast] * 2
    assert launches[0].kernel.name.endswith("_bulk16") == (fast and ratio == 2 and rows > 8)
    assert run(launches, space) == 2

    cols = ck.HEAD_DIM * ratio
    kv_score = arena.download("kv_score", np.float32, (shape.max_rows, cols))
    cases.check_projection(kv_score, rows, inputs["x"], inputs["w"])

    ring = inputs["ring"]
    state = ck.PublishState(ring.copy(), np.full((shape.slots, kvrecord_ref.KV_RECORD_BYTES),
                                                 0xFF, np.uint8),
                            np.full((shape.slots, kvrecord_ref.INDEX_RECORD_BYTES), 0xFF, np.uint8))
    slots, entries, keys = ck.publish_ref(
        state, kv_score[:rows], positions, seq_index, inputs["state_lines"],
        inputs["block_tables"], PAGE, inputs["norm_w"], inputs["wk"], inputs["k_norm"], eps,
        inputs["table"], ratio)
    assert slots.size == int(np.sum((seq_index >= 0) & (positions % ratio == ratio - 1)))
    got_ring = arena.download("ring", np.uint32, ring.shape)
    np.testing.assert_array_equal(got_ring, state.ring.view(np.uint32))
    got_cache = arena.download("cache", np.uint8, (shape.slots, kvrecord_ref.KV_RECORD_BYTES))
    got_keys = arena.download("keys", np.uint8, (shape.slots, kvrecord_ref.INDEX_RECORD_BYTES))
    cases.check_records(got_cache, got_keys, slots, entries, keys, shape.slots)


def test_builder_checks_rows_and_pointers(bundle):
    shape = CompressorShape(2, 256, 8, 2, 4, PAGE, 8, 64)
    space = AddressSpace()
    arena = HostArena(space, requests(shape))
    ptrs = {n: arena.ptr(n) for n in BUFFERS}
    with pytest.raises(ValueError, match="9 rows, allocated for 1..8"):
        compressor_launches(bundle, shape, ptrs, 9, 1e-6)
    del ptrs["wk"]
    with pytest.raises(KeyError, match="'wk'"):
        compressor_launches(bundle, shape, ptrs, 4, 1e-6)


def test_emulator_checks_the_grid_and_refuses_unknown_kinds(bundle):
    shape = CompressorShape(2, 256, 16, 2, 4, PAGE, 8, 64)
    space = AddressSpace()
    arena = HostArena(space, requests(shape))
    ptrs = {n: arena.ptr(n) for n in BUFFERS}
    proj, _ = compressor_launches(bundle, shape, ptrs, 9, 1e-6, fast=False)
    short = LaunchSpec(proj.kernel, (proj.grid[0], 1, 1), proj.args)   # covers 8 of 9 rows
    with pytest.raises(ValueError, match="grid"):
        run([short], space)
    bulk, staged = compressor_launches(bundle, shape, ptrs, 9, 1e-6, fast=True)
    for spec, grid in ((bulk, (bulk.grid[0], 2, 1)), (staged, (8, 1, 1))):  # loops, one pass
        with pytest.raises(ValueError, match="grid"):
            run([LaunchSpec(spec.kernel, grid, spec.args)], space)
    odd = dataclasses.replace(proj.kernel, spec={**proj.kernel.spec, "kind": "x"})
    with pytest.raises(NoEmulator, match="compressor_proj_r2_k256"):
        run([LaunchSpec(odd, proj.grid, proj.args)], space)


def test_two_steps_pool_through_the_ring(bundle):
    """Decode rows at even positions, then the next step at odd ones: the second step's partners
    come from the ring the first step's emulated publish wrote (r = 2, the same arena)."""
    rng = np.random.default_rng()
    cfg = ModelConfig.preset("tiny")
    seqs, eps = 3, float(cfg.rms_norm_eps)
    _, inputs = _case_inputs(rng, cfg, 2, "drafts_and_zero", cfg.hidden_size)
    shape = CompressorShape(2, cfg.hidden_size, 4, seqs + 3, PAGES, PAGE,
                            inputs["block_tables"].size + 5, NUM_POSITIONS)
    start = (2 * rng.integers(10, 500, seqs)).astype(np.int32)          # even positions
    inputs.update(positions=start, seq_index=np.arange(seqs, dtype=np.int32),
                  ring=np.full((seqs + 3, ck.RING_ROWS, ck.RING_WIDTH), np.nan, np.float32))
    del inputs["x"]                                                      # new rows each step
    space = AddressSpace()
    arena = HostArena(space, requests(shape))
    _upload(arena, inputs, 2)
    ptrs = {n: arena.ptr(n) for n in BUFFERS}
    state = ck.PublishState(inputs["ring"].copy(),
                            np.full((shape.slots, kvrecord_ref.KV_RECORD_BYTES), 0xFF, np.uint8),
                            np.full((shape.slots, kvrecord_ref.INDEX_RECORD_BYTES), 0xFF,
                                    np.uint8))
    for step in range(2):
        x = formats.bf16_round(rng.standard_normal((seqs, cfg.hidden_size)).astype(np.float32))
        arena.upload("x", x.astype(BF16))
        arena.upload("positions", start + step)
        run(compressor_launches(bundle, shape, ptrs, seqs, eps), space)
        kv_score = arena.download("kv_score", np.float32, (seqs, ck.RING_WIDTH))
        slots, entries, keys = ck.publish_ref(
            state, kv_score, start + step, inputs["seq_index"], inputs["state_lines"],
            inputs["block_tables"], PAGE, inputs["norm_w"], inputs["wk"], inputs["k_norm"], eps,
            inputs["table"], 2)
        assert slots.size == (seqs if step else 0)
    np.testing.assert_array_equal(arena.download("ring", np.uint32, state.ring.shape),
                                  state.ring.view(np.uint32))
    assert not np.isnan(entries).any(), "a partner row was not in the ring"
    cases.check_records(arena.download("cache", np.uint8, state.cache.shape),
                        arena.download("keys", np.uint8, state.keys.shape), slots, entries,
                        keys, shape.slots)
