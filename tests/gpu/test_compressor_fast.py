"""GPU: round 9's compressor kernels (bulk projection, staged publish) against
`kernels/compressor_kernel_ref.py`, at tiny (D = 256) and v41-flash (D = 5120) widths.

Runs alone (`pytest tests/gpu/test_compressor_fast.py`); cubins come from the bundles (no DSL).
Fresh random inputs every run. Poison before each launch: kv_score 0xFF (NaN) in every row, the
record caches 0xFF, ring lines no sequence owns NaN; every byte outside what the reference writes
must keep its poison.

Checks and tolerances (the session-1 kernels' contract, tests/gpu/test_compressor_publish.py):
- bulk projection ("bulk", "bulkr" (x rows < R only), "bulk16" (16-row tiles), each at every R):
  every kv_score
  element within gamma_n sum |x||w|, n = D/32 + 6; the bulk order needs only D/128 + 8
  roundings (thread chain, butterfly, 4 warp partials: CPU-checked in
  tests/test_compressor_kernel_cpu.py); rows >= R keep their NaN. R up to 192 exercises the loop
  over row tiles through the ring (24 tiles x 10 slots at D = 5120 with 8-row tiles).
- staged publish: ring bitwise against `publish_ref` on the kernel's kv_score (padding rows write
  no ring row), records decoded within `entry_tolerance` / `key_tolerance`, pad byte 0, nothing
  outside the publishing slots; R = 192 makes CTAs loop over two rows (grid 128).
- `test_staged_publish_equals_session1`: the staged publish does the session-1 arithmetic in the
  same order, so on the same kv_score and ring the two publishes write the same bytes (ring,
  entries, keys). A failure there with the tolerance tests passing means the compilers fused or
  ordered an operation differently (not a wrong result); the message names the first byte.
"""
from __future__ import annotations

import compressor_cases as cases
import numpy as np
import pytest

from executor.compressor_chain import CompressorChain, CompressorShape
from executor.launch import LaunchSpec
from kernels import compressor_kernel_ref as ck
from kernels import kvrecord_ref, rope_ref
from loader import formats
from loader.config import ModelConfig

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

PAGE = 64
PAGES = 40                     # per sequence: 2560 entries
NUM_POSITIONS = 8192
ROWS = (1, 5, 6, 8, 48, 192)
# R -> (blocks (start position, rows) per sequence, padding rows); R = blocks + padding.
PUBLISH_CASES = {
    1: ([(1001, 1)], 0),
    5: ([(999, 5)], 0),
    6: ([(1001, 6)], 0),
    8: ([(1000, 6), (77, 1)], 1),
    48: ([(1001, 6), (1000, 6), (0, 6), (500, 5), (31, 6), (2000, 6), (1023, 6), (7, 6)], 1),
    192: ([(1101 - 29 * q, 6) for q in range(32)], 0),
}


def bf16_bits(a: np.ndarray) -> np.ndarray:
    return (formats.bf16_round(a).view(np.uint32) >> 16).astype(np.uint16)


@pytest.fixture(scope="module", params=["tiny", "v41-flash"])
def width(request, dev):
    """(hidden, bundle): tiny from HOPDEC_BUNDLE (skips if missing), v41 from HOPDEC_BUNDLE_V41."""
    fixture = "tiny_bundle" if request.param == "tiny" else "v41_bundle"
    bundle = request.getfixturevalue(fixture)
    return ModelConfig.preset(request.param).hidden_size, bundle


@pytest.mark.parametrize("ratio,variant", [(2, "bulk"), (2, "bulkr"), (2, "bulk16"), (1, "bulk"),
                                           (1, "bulkr")])
@pytest.mark.parametrize("rows", ROWS)
def test_bulk_projection(dev, width, ratio, variant, rows):
    """Every variant at every R: both tile heights, and bulkr (x rows < R only: the rows past R
    compute on stale shared memory and must not be stored)."""
    hidden, bundle = width
    rng = np.random.default_rng()
    shape = CompressorShape(ratio, hidden, rows + 8, 1, 1, PAGE, 1, 16)
    spec = ck.make_proj_spec(ratio, hidden, variant)
    chain = CompressorChain(dev, bundle, shape, fast=True)
    try:
        x = formats.bf16_round(rng.standard_normal((rows, hidden)).astype(np.float32))
        w = cases.random_weights(rng, ratio, hidden)
        chain.upload("x", bf16_bits(x))
        chain.upload("w", w if ratio == 2 else bf16_bits(w))
        chain.fill("kv_score", 0xFF)
        cp.cuda.Device().synchronize()
        stream = dev.stream()
        ptrs = [chain.arena.ptr(n) for n in ("x", "w", "kv_score")]
        LaunchSpec(bundle.kernel(spec.name), spec.grid(rows), (*ptrs, rows)).launch(stream)
        stream.synchronize()
        got = chain.download("kv_score", np.float32, (rows + 8, ck.HEAD_DIM * ratio))
    finally:
        chain.close()
    cases.check_projection(got, rows, x, w)


def _publish_inputs(rng, ratio: int, rows: int, hidden: int):
    blocks, padding = PUBLISH_CASES[rows]
    seqs = len(blocks)
    positions, seq_index, lines = cases.make_rows(rng, blocks, padding, seqs)
    assert positions.size == rows
    num_pages = seqs * PAGES + 5
    tables = rng.permutation(num_pages)[:seqs * PAGES].reshape(seqs, PAGES).astype(np.int32)
    if seqs > 1:                               # one sequence's entry page is unallocated
        tables[1, (1000 // ratio) // PAGE] = -1
    shape = CompressorShape(ratio, hidden, rows, seqs + 3, PAGES, PAGE, num_pages,
                            NUM_POSITIONS)
    cfg = ModelConfig.preset("v41-flash")
    inputs = {
        "x": formats.bf16_round(rng.standard_normal((rows, hidden)).astype(np.float32)),
        "w": cases.random_weights(rng, ratio, hidden),
        "ring": cases.rings_before(rng, blocks, lines, seqs + 3),
        "positions": positions, "seq_index": seq_index, "state_lines": lines,
        "block_tables": tables, "norm_w": (rng.random(ck.HEAD_DIM) * 2).astype(np.float32),
        "wk": formats.bf16_round((rng.standard_normal((ck.INDEX_DIM, ck.HEAD_DIM))
                                  * ck.HEAD_DIM ** -0.5).astype(np.float32)),
        "k_norm": (rng.random(ck.INDEX_DIM) * 2).astype(np.float32),
        "table": rope_ref.RopeTable.for_ratio(cfg, ratio, NUM_POSITIONS)}
    return shape, inputs


def _upload_state(chain: CompressorChain, inputs: dict, ratio: int, with_x: bool) -> None:
    """Inputs in the kernels' formats; ring as given, caches poisoned (kv_score too with x)."""
    for name, arr in inputs.items():
        if name == "table":
            arr = arr.cos_sin
        elif name in ("x", "wk") or (name == "w" and ratio == 1):
            arr = bf16_bits(arr)
        if name in ("x", "w") and not with_x:
            continue
        chain.upload(name, arr)
    if with_x:
        chain.fill("kv_score", 0xFF)
    chain.fill("cache", 0xFF)
    chain.fill("keys", 0xFF)
    cp.cuda.Device().synchronize()


def _outputs(chain: CompressorChain, shape: CompressorShape, ring_shape) -> dict:
    r = shape.max_rows
    return {"kv_score": chain.download("kv_score", np.float32, (r, ck.HEAD_DIM * shape.ratio)),
            "ring": chain.download("ring", np.float32, ring_shape),
            "cache": chain.download("cache", np.uint8, (shape.slots,
                                                        kvrecord_ref.KV_RECORD_BYTES)),
            "keys": chain.download("keys", np.uint8, (shape.slots,
                                                      kvrecord_ref.INDEX_RECORD_BYTES))}


def _run(dev, bundle, ratio: int, rows: int, hidden: int, session1_too: bool):
    """Round 9's pair on fresh inputs (and, if asked, the session-1 publish on the same kv_score
    and the same initial ring): (inputs, shape, round-9 outputs, session-1 outputs or None)."""
    rng = np.random.default_rng()
    shape, inputs = _publish_inputs(rng, ratio, rows, hidden)
    eps = float(ModelConfig.preset("v41-flash").rms_norm_eps)
    chain = CompressorChain(dev, bundle, shape, fast=True)
    try:
        _upload_state(chain, inputs, ratio, with_x=True)
        stream = dev.stream()
        for spec in chain.launches(rows, eps):
            spec.launch(stream)
        stream.synchronize()
        fast = _outputs(chain, shape, inputs["ring"].shape)
        old = None
        if session1_too:
            _upload_state(chain, inputs, ratio, with_x=False)   # kv_score stays the kernel's
            chain.launches(rows, eps, fast=False)[1].launch(stream)
            stream.synchronize()
            old = _outputs(chain, shape, inputs["ring"].shape)
    finally:
        chain.close()
    return inputs, shape, fast, old


@pytest.mark.parametrize("ratio", [2, 1])
@pytest.mark.parametrize("rows", ROWS)
def test_staged_publish(dev, width, ratio, rows):
    hidden, bundle = width
    inputs, shape, got, _ = _run(dev, bundle, ratio, rows, hidden, session1_too=False)
    x, w = inputs["x"], inputs["w"]
    kv_score = got["kv_score"]
    cases.check_projection(kv_score, rows, x, w)
    positions, seq_index = inputs["positions"], inputs["seq_index"]
    eps = float(ModelConfig.preset("v41-flash").rms_norm_eps)
    state = ck.PublishState(inputs["ring"].copy(), np.full_like(got["cache"], 0xFF),
                            np.full_like(got["keys"], 0xFF))
    slots, entries, keys = ck.publish_ref(state, kv_score, positions, seq_index,
                                          inputs["state_lines"], inputs["block_tables"], PAGE,
                                          inputs["norm_w"], inputs["wk"], inputs["k_norm"], eps,
                                          inputs["table"], ratio)
    want_pub = int(np.sum((seq_index >= 0) & (positions % ratio == ratio - 1)))
    assert slots.size == want_pub, "the reference and the case disagree on who publishes"
    np.testing.assert_array_equal(got["ring"].view(np.uint32), state.ring.view(np.uint32))
    cases.check_records(got["cache"], got["keys"], slots, entries, keys, shape.slots)


@pytest.mark.parametrize("ratio", [2, 1])
@pytest.mark.parametrize("rows", [1, 6, 48, 192])
def test_staged_publish_equals_session1(dev, v41_bundle, ratio, rows):
    _, _, fast, old = _run(dev, v41_bundle, ratio, rows, 5120, session1_too=True)
    for name in ("ring", "cache", "keys"):
        a, b = fast[name].view(np.uint8), old[name].view(np.uint8)
        diff = np.argwhere(a != b)
        assert diff.size == 0, (f"{name}: {len(diff)} bytes differ from the session-1 publish, "
                                f"first at {tuple(diff[0])}")
