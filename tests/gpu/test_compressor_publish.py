"""GPU: the compressor projection and publish kernels against `kernels/compressor_kernel_ref.py`.

Fresh random inputs every run. Outputs are poisoned before each launch: kv_score rows past the batch
NaN, record caches 0xFF, ring lines no sequence owns NaN; every byte outside what the reference
writes must keep its poison.

Checks and tolerances:
- projection: every kv_score element within gamma_n sum |x||w| (n = D/32 + 6 fp32 roundings per
  output: the lane's fma chain plus the butterfly), NaN past the batch.
- ring: bitwise (the kernel copies kv_score rows).
- records: decoded, within `entry_tolerance` / `key_tolerance` of the fp32 reference values: one
  FP8 step (2^-3 relative, the scale may round one power higher) plus the fp32-vs-float64
  difference of the pipeline (2^-16 of the group max for entries, 2^-14 for keys: a 512-term fp32
  dot product). A wrong pair, position, weight or slot is O(1) of the group max. The pad byte is 0.
Cases: decode rows at odd and even positions, 6-row verify blocks starting even and odd (the first
odd row's partner from the ring), 5-row draft-sized blocks, position 0, several sequences on
permuted state lines and pages, padding rows, an entry on an unallocated page.
"""
from __future__ import annotations

import compressor_cases as cases
import numpy as np
import pytest

from executor.compressor_chain import CompressorChain, CompressorShape
from kernels import compressor_kernel_ref as ck
from kernels import kvrecord_ref, rope_ref
from loader import formats
from loader.config import ModelConfig

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

HIDDEN = 5120
PAGE = 64
PAGES = 40                     # per sequence: 2560 entries (position 2005 at r = 1)
NUM_POSITIONS = 8192
# (start position, rows) per sequence; padding rows are appended to every case.
CASES = {
    "decode_odd": [(1001, 1)],
    "decode_even": [(1000, 1)],
    "verify_even_start": [(1000, 6)],
    "verify_odd_start": [(1001, 6)],
    "draft_sized": [(999, 5), (40, 5)],
    "from_zero": [(0, 6)],
    "many_sequences": [(1001, 6), (1000, 6), (77, 1), (500, 5), (1, 1), (2000, 6), (31, 6),
                       (1023, 1)],
}


def bf16_bits(a: np.ndarray) -> np.ndarray:
    return (formats.bf16_round(a).view(np.uint32) >> 16).astype(np.uint16)


@pytest.mark.parametrize("ratio", [2, 1])
@pytest.mark.parametrize("rows", [1, 5, 6, 12, 48])
def test_projection(dev, v41_bundle, ratio, rows):
    rng = np.random.default_rng()
    shape = CompressorShape(ratio, HIDDEN, rows + 8, 1, 1, PAGE, 1, 16)
    chain = CompressorChain(dev, v41_bundle, shape)
    try:
        x = formats.bf16_round(rng.standard_normal((rows, HIDDEN)).astype(np.float32))
        w = cases.random_weights(rng, ratio, HIDDEN)
        chain.upload("x", bf16_bits(x))
        chain.upload("w", w if ratio == 2 else bf16_bits(w))
        chain.fill("kv_score", 0xFF)
        cp.cuda.Device().synchronize()
        stream = dev.stream()
        chain.launches(rows, 1e-6)[0].launch(stream)
        stream.synchronize()
        got = chain.download("kv_score", np.float32, (rows + 8, ck.HEAD_DIM * ratio))
    finally:
        chain.close()
    cases.check_projection(got, rows, x, w)


@pytest.mark.parametrize("ratio", [2, 1])
@pytest.mark.parametrize("case", sorted(CASES))
def test_publish(dev, v41_bundle, ratio, case):
    rng = np.random.default_rng()
    cfg = ModelConfig.preset("v41-flash")
    blocks = CASES[case]
    seqs = len(blocks)
    positions, seq_index, lines = cases.make_rows(rng, blocks, 2, seqs)
    r = positions.size
    ring_lines = seqs + 3
    num_pages = seqs * PAGES + 5
    tables = rng.permutation(num_pages)[:seqs * PAGES].reshape(seqs, PAGES).astype(np.int32)
    if case == "many_sequences":               # one sequence's entry page is unallocated
        tables[1, (1000 // ratio) // PAGE] = -1
    shape = CompressorShape(ratio, HIDDEN, r, ring_lines, PAGES, PAGE, num_pages, NUM_POSITIONS)
    table = rope_ref.RopeTable.for_ratio(cfg, ratio, NUM_POSITIONS)
    # The ring of every used line holds the 8 positions before its block (an earlier step).
    ring = cases.rings_before(rng, blocks, lines, ring_lines)
    norm_w = (rng.random(ck.HEAD_DIM) * 2).astype(np.float32)
    wk = formats.bf16_round((rng.standard_normal((ck.INDEX_DIM, ck.HEAD_DIM))
                             * ck.HEAD_DIM ** -0.5).astype(np.float32))
    k_norm = (rng.random(ck.INDEX_DIM) * 2).astype(np.float32)
    x = formats.bf16_round(rng.standard_normal((r, HIDDEN)).astype(np.float32))
    w = cases.random_weights(rng, ratio, HIDDEN)
    eps = float(cfg.rms_norm_eps)

    chain = CompressorChain(dev, v41_bundle, shape)
    try:
        for name, arr in (("x", bf16_bits(x)), ("w", w if ratio == 2 else bf16_bits(w)),
                          ("ring", ring), ("positions", positions), ("seq_index", seq_index),
                          ("state_lines", lines), ("block_tables", tables), ("norm_w", norm_w),
                          ("wk", bf16_bits(wk)), ("k_norm", k_norm), ("table", table.cos_sin)):
            chain.upload(name, arr)
        chain.fill("cache", 0xFF)
        chain.fill("keys", 0xFF)
        cp.cuda.Device().synchronize()
        stream = dev.stream()
        for spec in chain.launches(r, eps):
            spec.launch(stream)
        stream.synchronize()
        kv_score = chain.download("kv_score", np.float32, (r, ck.HEAD_DIM * ratio))
        got_ring = chain.download("ring", np.float32, ring.shape)
        got_cache = chain.download("cache", np.uint8, (shape.slots, kvrecord_ref.KV_RECORD_BYTES))
        got_keys = chain.download("keys", np.uint8, (shape.slots,
                                                     kvrecord_ref.INDEX_RECORD_BYTES))
    finally:
        chain.close()

    tol = ck.proj_tolerance(x, w)          # the publish reads the kernel's own kv_score
    assert (np.abs(kv_score - x.astype(np.float64) @ w.astype(np.float64).T) <= tol).all()
    state = ck.PublishState(ring.copy(), np.full_like(got_cache, 0xFF),
                            np.full_like(got_keys, 0xFF))
    slots, entries, keys = ck.publish_ref(state, kv_score, positions, seq_index, lines, tables,
                                          PAGE, norm_w, wk, k_norm, eps, table, ratio)
    want_pub = int(np.sum((seq_index >= 0) & (positions % ratio == ratio - 1)))
    assert slots.size == want_pub, "the reference and the case disagree on who publishes"
    # Bitwise: r = 2 rows copied in, every other ring row (r = 1: all) as uploaded.
    np.testing.assert_array_equal(got_ring.view(np.uint32), state.ring.view(np.uint32))
    cases.check_records(got_cache, got_keys, slots, entries, keys, shape.slots)
