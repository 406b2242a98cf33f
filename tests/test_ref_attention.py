"""The reference attention sublayer at the tiny config: block semantics, cache writes, TP, rollback.

Weights are synthetic (loader.synth values, fresh seed per run) cut per rank by loader.sharding; the
attention input of a row is a fixed random BF16 vector per (layer, state line, position), so the
same row gets the same input whether it runs alone, in a block or after a rollback.
"""
from __future__ import annotations

import numpy as np
import pytest

from executor.reference import attention as attn
from executor.reference.kvcache import KVCaches
from executor.reference.rows import RowBatch, RowBlock
from executor.reference.weights import RankWeights
from loader.config import ModelConfig
from loader.formats import bf16_round
from loader.schema import checkpoint_schema
from loader.sharding import shard
from loader.synth import ValueSource

CFG = ModelConfig.preset("tiny")
BACKBONE = range(CFG.num_hidden_layers)
MAX_CONTEXT = 64
LINES = 2


class Model:
    """Per-rank weights of one synthetic checkpoint at `tp`, plus the fixed per-row inputs."""

    def __init__(self, seed: int, tp: int):
        specs = {s.name: s for s in checkpoint_schema(CFG)}
        source, full = ValueSource(seed), {}

        def fetch_for(rank):
            def fetch(name):
                if name not in full:
                    full[name] = source(specs[name])
                return shard(full[name], specs[name], tp, rank)
            return fetch

        self.tp = tp
        self.ranks = [RankWeights(CFG, fetch_for(r), tp, r) for r in range(tp)]
        rng = np.random.default_rng(seed)
        shape = (CFG.num_layers_total, LINES, MAX_CONTEXT, CFG.hidden_size)
        self.x = bf16_round(rng.standard_normal(shape, dtype=np.float32))

    def inputs(self, layer: int, rows: RowBatch) -> np.ndarray:
        lines = np.append(rows.state_lines, 0)[rows.seq_index]  # padding rows (-1) read line 0
        return self.x[layer, lines, np.where(rows.real, rows.positions, 0)]

    def step(self, caches: KVCaches, blocks, layers=BACKBONE, pad_to=None) -> dict:
        """Run `layers` in order on one step; layer -> [R, D] sum of the rank partials (fp32)."""
        rows = RowBatch.from_blocks(blocks, caches.block_tables, caches.ring_slots, pad_to)
        out = {}
        for layer in layers:
            x = self.inputs(layer, rows)
            parts = [attn.attention_sublayer(w.layer(layer), x, rows, caches, CFG, self.tp, r,
                                             exact=caches.exact) for r, w in enumerate(self.ranks)]
            out[layer] = np.sum(parts, axis=0)
        return out


@pytest.fixture(scope="module")
def model():
    return Model(int(np.random.default_rng().integers(1 << 30)), tp=1)


def _caches(exact=False):
    return KVCaches.allocate(CFG, max_seqs=LINES, max_context=MAX_CONTEXT, page_size=8, exact=exact)


def _prefill(model, caches, line, end, chunk=6):
    """Positions 0..end-1 of `line` as causal chunks (what a prefill driver does)."""
    for start in range(0, end, chunk):
        n = min(chunk, end - start)
        model.step(caches, [RowBlock(line, start, (1,) * n, "verify")])


def _assert_same_caches(a: KVCaches, b: KVCaches):
    for name in ("swa", "compressed", "index_keys", "ring", "ring_pos"):
        for layer, arr in getattr(a, name).items():
            np.testing.assert_array_equal(arr, getattr(b, name)[layer], err_msg=f"{name}[{layer}]")


# Starts cross every threshold of model doc §5 at the tiny config: T < window (5, 11), T = 17 (ratio-1
# entries > top-k 16, block starting at an odd position), T = 33 (candidate masking: > 32 entries),
# T = 40 (ratio-2 entries > top-k); every 6-row block straddles odd positions.
@pytest.mark.parametrize("start", [5, 11, 17, 33, 40])
def test_verify_block_equals_sequential_rows(model, start):
    base = _caches()
    _prefill(model, base, line=1, end=start)
    block, seq = base.copy(), base.copy()
    got = model.step(block, [RowBlock(1, start, (1,) * 6, "verify")])
    for j in range(6):
        one = model.step(seq, [RowBlock(1, start + j, (1,))])
        for layer in BACKBONE:
            # Same arithmetic row by row (BLAS keeps each row's dot products in one order): bitwise.
            np.testing.assert_array_equal(got[layer][j], one[layer][0],
                                          err_msg=f"layer {layer} row {j} at {start + j}")
    _assert_same_caches(block, seq)


def test_causal_verify_and_non_causal_draft(model):
    caches = _caches()
    _prefill(model, caches, line=0, end=20)
    verify = [RowBlock(0, 20, (1,) * 6, "verify")]
    a = model.step(caches.copy(), verify)
    model.x[:, 0, 25] += 1.0  # change only the last row's inputs
    try:
        b = model.step(caches.copy(), verify)
        draft_changed = model.step(caches.copy(), [RowBlock(0, 20, (1,) * 5, "draft")], [10])
    finally:
        model.x[:, 0, 25] -= 1.0
    for layer in BACKBONE:
        np.testing.assert_array_equal(a[layer][:5], b[layer][:5], err_msg=f"layer {layer}")
        assert not np.array_equal(a[layer][5], b[layer][5])
    # DSpark stage 10: context KV at 0..19 of line 0, then a 5-row draft block at 20..24.
    for start in range(0, 20, 5):
        model.step(caches, [RowBlock(0, start, (1,) * 5, "verify")], [10])
    c = caches.copy()
    draft = model.step(c, [RowBlock(0, 20, (1,) * 5, "draft")], [10])[10]
    # Non-causal: row 0 reads row 4's entry (position 24), so row 0 moves when only row 4 changed.
    assert not np.allclose(draft[0], draft_changed[10][0])
    # Every draft row gathers the same entries: positions 20 - W .. 24.
    rows = RowBatch.from_blocks([RowBlock(0, 20, (1,) * 5, "draft")], c.block_tables, c.ring_slots)
    kv, valid = attn.gather(CFG.layer(10), None, rows, c, CFG)
    assert (valid.sum(axis=1) == CFG.sliding_window + 5).all()
    for j in range(1, 5):
        np.testing.assert_array_equal(kv[j][valid[j]], kv[0][valid[0]])


def test_padding_rows_write_nothing(model):
    caches = _caches()
    _prefill(model, caches, line=0, end=9)
    blocks = [RowBlock(0, 9, (1,) * 6, "verify")]
    plain, padded = caches.copy(), caches.copy()
    a = model.step(plain, blocks)
    b = model.step(padded, blocks, pad_to=8)
    _assert_same_caches(plain, padded)
    for layer in BACKBONE:
        np.testing.assert_array_equal(a[layer], b[layer][:6])
        np.testing.assert_array_equal(b[layer][6:], 0.0)
    # A step of padding rows only leaves every byte as it was.
    before = caches.copy()
    model.step(caches, [], layers=[0, 1], pad_to=4)
    _assert_same_caches(before, caches)


def test_tp4_partials_sum_to_tp1():
    seed = int(np.random.default_rng().integers(1 << 30))
    m1, m4 = Model(seed, tp=1), Model(seed, tp=4)
    c1, c4 = _caches(), _caches()
    _prefill(m1, c1, line=0, end=30)
    _prefill(m4, c4, line=0, end=30)
    _assert_same_caches(c1, c4)  # the replicated half does not depend on tp
    rows = RowBatch.from_blocks([RowBlock(0, 30, (1,) * 6, "verify")], c1.block_tables,
                                c1.ring_slots)
    for layer in BACKBONE:
        x = m1.inputs(layer, rows)
        lw1 = m1.ranks[0].layer(layer)
        shared = attn.attention_shared(lw1, x, rows, c1, CFG)
        z = attn.attention_heads(lw1, shared, rows, CFG, 1)
        full = attn.attention_rank(lw1, shared, rows, CFG, 1, 0)
        shared4 = attn.attention_shared(m4.ranks[0].layer(layer), x, rows, c4, CFG)
        z4 = [attn.attention_heads(w.layer(layer), shared4, rows, CFG, 4) for w in m4.ranks]
        # Each rank's heads and wo_a groups compute exactly what TP1 computes for them.
        np.testing.assert_array_equal(np.concatenate(z4, axis=1), z, err_msg=f"layer {layer}")
        parts = [attn.attention_rank(w.layer(layer), shared4, rows, CFG, 4, r)
                 for r, w in enumerate(m4.ranks)]
        # Only wo_b's K = 1024 sum is split into 4 partial sums, added in fp32: the standard
        # summation bound |error| <= 2 * K * 2^-24 * sum_k |z_k w_k| covers both orders.
        wo_b = np.abs(lw1.dense("attn.wo_b"))
        bound = 2 * z.shape[1] * 2.0**-24 * (np.abs(z) @ wo_b.T)
        err = np.abs(np.sum(parts, axis=0) - full)
        assert (err <= bound).all(), f"layer {layer}: max excess {(err - bound).max()}"
