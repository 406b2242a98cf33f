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
from kernels import attention_ref, rope_ref
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


# Starts cross every threshold of model doc §5 at the tiny config: T < window (5, 11), T = 17
# (ratio-1 entries > top-k 16, block starting at an odd position), T = 33 (candidate masking: > 32
# entries), T = 40 (ratio-2 entries > top-k); every 6-row block straddles odd positions.
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


def _perturbed(model, layers, line, pos, run):
    """run() with the inputs of (line, pos) changed on `layers`, restored afterwards."""
    model.x[layers, line, pos] += 1.0
    try:
        return run()
    finally:
        model.x[layers, line, pos] -= 1.0


def test_causal_verify_block(model):
    caches = _caches()
    _prefill(model, caches, line=0, end=20)
    verify = [RowBlock(0, 20, (1,) * 6, "verify")]
    a = model.step(caches.copy(), verify)
    b = _perturbed(model, slice(None), 0, 25, lambda: model.step(caches.copy(), verify))
    for layer in BACKBONE:  # rows 0..4 never see row 5
        np.testing.assert_array_equal(a[layer][:5], b[layer][:5], err_msg=f"layer {layer}")
        assert not np.array_equal(a[layer][5], b[layer][5])


def test_non_causal_draft_block(model):
    caches = _caches()
    stage = 10
    # DSpark context KV of positions 0..19 through the entry point dspark.py uses.
    for start in range(0, 20, 5):
        rows = RowBatch.from_blocks([RowBlock(0, start, (1,) * 5, "verify")], caches.block_tables,
                                    caches.ring_slots)
        attn.insert_swa(model.ranks[0].layer(stage), model.inputs(stage, rows), rows, caches, CFG)
    for kind in ("draft", "verify"):
        block = [RowBlock(0, 20, (1,) * 5, kind)]
        a = model.step(caches.copy(), block, [stage])[stage]
        b = _perturbed(model, stage, 0, 24,
                       lambda blk=block: model.step(caches.copy(), blk, [stage]))
        if kind == "draft":  # every row reads row 4's entry (position 24)
            assert all(not np.allclose(a[j], b[stage][j]) for j in range(5))
        else:  # the same rows as a causal block: rows 0..3 do not
            np.testing.assert_array_equal(a[:4], b[stage][:4])
    # Every draft row gathers the same entries: positions 20 - W .. 24.
    c = caches.copy()
    model.step(c, [RowBlock(0, 20, (1,) * 5, "draft")], [stage])
    rows = RowBatch.from_blocks([RowBlock(0, 20, (1,) * 5, "draft")], c.block_tables, c.ring_slots)
    kv, valid = attn.gather(CFG.layer(stage), None, rows, c, CFG)
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


def test_rollback_then_continue_matches_accepted_history(model):
    base = _caches()
    _prefill(model, base, line=0, end=20)
    clean, spec = base.copy(), base.copy()
    want = {}
    for p in range(20, 26):  # the accepted history, one row at a time
        want[p] = model.step(clean, [RowBlock(0, p, (1,))])
    # Verify 20..25 where rows 23..25 carried drafts that get rejected (different inputs).
    model.x[:, 0, 23:26] += 0.5
    try:
        model.step(spec, [RowBlock(0, 20, (1,) * 6, "verify")])
    finally:
        model.x[:, 0, 23:26] -= 0.5
    spec.rollback_compressor_rings(0, accepted_len=23)
    for layer in (2, 4):
        held = spec.ring_pos[layer][0]
        assert held.max() == 22 and (held[held >= 0] >= 15).all()
    # Position 25 cannot run now: its even predecessor 24 was rolled back and never recomputed.
    with pytest.raises(ValueError, match="lacks the even predecessor of odd positions \\[25\\]"):
        model.step(spec.copy(), [RowBlock(0, 25, (1,))])
    got = model.step(spec, [RowBlock(0, 23, (1,) * 3, "verify")])
    for j, p in enumerate(range(23, 26)):
        for layer in BACKBONE:
            np.testing.assert_array_equal(got[layer][j], want[p][layer][0], err_msg=f"{layer} {p}")
    _assert_same_caches(spec, clean)  # every rejected write was overwritten by the accepted one


def _tolerance_f64(ref: np.ndarray, fp8_dims: int) -> np.ndarray:
    """Record error bound: FP8 E4M3 RNE 2^-4 relative (2^-10 x the group scale in the subnormal
    range) on the first `fp8_dims` dims, BF16 2^-8 on the rest; + 1e-5 of the row's magnitude for
    float32 vs float64 upstream arithmetic."""
    groups = 64 if fp8_dims == 448 else 128
    amax = np.abs(ref[:, :fp8_dims]).reshape(ref.shape[0], -1, groups).max(axis=2)
    scale = np.repeat(2.0 ** np.ceil(np.log2(np.maximum(amax, 1e-4) / 448)), groups, axis=1)
    tol = np.empty_like(ref)
    tol[:, :fp8_dims] = np.maximum(2.0**-4 * np.abs(ref[:, :fp8_dims]), 2.0**-10 * scale)
    tol[:, fp8_dims:] = 2.0**-8 * np.abs(ref[:, fp8_dims:])
    return tol + 1e-5 * np.abs(ref).max(axis=1, keepdims=True)


def _rmsnorm64(x, w):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + CFG.rms_norm_eps) * w


def test_published_entries_and_keys_match_the_formulas(model):
    caches = _caches()
    _prefill(model, caches, line=1, end=12)
    table = rope_ref.RopeTable.yarn(CFG)
    block_table = caches.block_tables[1]

    def check(layer, latent, entry, pos):
        lw = model.ranks[0].layer(layer)
        phys = caches.entry_rows(block_table, np.array([entry]))
        rotated = rope_ref.rope_f64(latent[:, None, :], np.array([pos]), table.inv_freq)[:, 0]
        got = caches.load_kv(caches.compressed[layer], phys)
        assert (np.abs(got - rotated) <= _tolerance_f64(rotated, 448)).all(), f"entry {layer}"
        k = _rmsnorm64(latent @ lw.vector("attn.indexer.wk.weight").astype(np.float64).T,
                       lw.vector("attn.indexer.k_norm.weight"))
        k = rope_ref.rope_f64(k[:, None, :], np.array([pos]), table.inv_freq)[:, 0]
        assert (np.abs(caches.load_keys(layer, phys) - k) <= _tolerance_f64(k, 128)).all()

    # Ratio 2 (layer 2): entry 3 pools positions 6 and 7 (per-channel softmax), RoPE at position 6.
    lw = model.ranks[0].layer(2)
    x = model.x[2, 1, 6:8].astype(np.float64)
    kv = x @ lw.vector("attn.compressor.wkv.weight").astype(np.float64).T
    score = x @ lw.vector("attn.compressor.wgate.weight").astype(np.float64).T
    weights = np.exp(score - score.max(axis=0))
    pooled = (weights * kv).sum(axis=0) / weights.sum(axis=0)
    check(2, _rmsnorm64(pooled[None], lw.vector("attn.compressor.norm.weight")), 3, 6)
    # Ratio 1 (layer 6): entry 9 is position 9 alone.
    lw = model.ranks[0].layer(6)
    kv = model.x[6, 1, 9:10].astype(np.float64) @ lw.vector("attn.compressor.wkv.weight").T
    check(6, _rmsnorm64(kv, lw.vector("attn.compressor.norm.weight")), 9, 9)


def test_index_topk_and_candidates_in_the_step(model):
    caches = _caches()
    _prefill(model, caches, line=0, end=40)
    model.step(caches, [RowBlock(0, 40, (1,) * 6, "verify")])
    pos = np.arange(40, 46)
    for layer, ratio in ((2, 2), (4, 2), (6, 1), (8, 1)):
        topk = caches.step_topk[layer][1]
        assert ((topk >= 0).sum(axis=1) == 16).all()  # > 16 visible entries everywhere
        assert (topk < ((pos + 1) // ratio)[:, None]).all()
        assert (np.diff(topk, axis=1) > 0).all()
    cands = caches.step_candidates[6][1]
    assert all(p // 8 in c for p, c in zip(pos, cands))
    inside = np.isin(caches.step_topk[8][1] // 8, cands).all(axis=1)  # reindex stays in candidates
    assert inside.all()


def test_exact_mode(model):
    quant, exact = _caches(), _caches(exact=True)
    assert exact.swa[0].dtype == np.float32 and exact.compressed[2].shape[1] == 512
    _prefill(model, quant, line=0, end=18)
    _prefill(model, exact, line=0, end=18)
    a = model.step(quant, [RowBlock(0, 18, (1,) * 4, "verify")])
    b = model.step(exact, [RowBlock(0, 18, (1,) * 4, "verify")])
    for layer in (0, 1):
        # SWA-only layers differ only by the FP8 nope dims of the entries (<= 2^-4 relative each);
        # outputs are averages of entries pushed through wo_a/wo_b: a few percent at most.
        rel = np.linalg.norm(a[layer] - b[layer]) / np.linalg.norm(b[layer])
        assert 0 < rel < 0.1, f"layer {layer}: {rel}"
    for layer in BACKBONE:
        assert np.isfinite(b[layer]).all()
    rows = RowBatch.from_blocks([RowBlock(0, 22, (1,))], quant.block_tables, quant.ring_slots)
    with pytest.raises(ValueError, match="exact=True but the KV caches were allocated exact=False"):
        attn.attention_shared(model.ranks[0].layer(0), model.inputs(0, rows), rows, quant, CFG,
                              exact=True)


def test_reading_unwritten_entries_raises(model):
    caches = _caches()
    # No prefill: position 5 would attend to SWA entries 0..4, which are still poison.
    with pytest.raises(ValueError, match="attends to a KV entry that was never written"):
        model.step(caches, [RowBlock(0, 5, (1,))], layers=[0])
    # The first block publishes ratio-2 entry 0 at its row p = 1, whose index key is written before
    # the scan: the row sees (and selects) an entry it created in the same step.
    model.step(caches, [RowBlock(1, 0, (1,) * 4, "verify")], layers=[0, 1, 2])
    np.testing.assert_array_equal(caches.step_topk[2][1][:, :3], [[-1, -1, -1], [0, -1, -1],
                                                                  [0, -1, -1], [0, 1, -1]])


def test_bad_input_raises(model):
    caches = _caches()
    rows = RowBatch.from_blocks([RowBlock(0, 0, (1,))], caches.block_tables, caches.ring_slots)
    lw = model.ranks[0].layer(3)
    with pytest.raises(ValueError, match=r"layer 3 attention input: expected float32 \[1, 256\]"):
        attn.attention_shared(lw, np.zeros((1, 255), np.float32), rows, caches, CFG)
    with pytest.raises(ValueError, match="needs this step's output of layer 2"):
        attn.attention_shared(lw, model.inputs(3, rows), rows, caches, CFG)
    wrong = RowBatch(**{**rows.__dict__, "slot_mapping": rows.slot_mapping + 1})
    with pytest.raises(ValueError, match="slot_mapping of rows \\[0\\]"):
        attn.attention_shared(model.ranks[0].layer(0), model.inputs(0, rows), wrong, caches, CFG)
    long = RowBatch.from_blocks([RowBlock(0, 0, (1,) * 8, "verify")], caches.block_tables,
                                caches.ring_slots)
    with pytest.raises(ValueError, match="more rows in one step than these caches allow"):
        attn.attention_shared(model.ranks[0].layer(0), model.inputs(0, long), long, caches, CFG)
    draft = RowBatch.from_blocks([RowBlock(0, 0, (1,) * 5, "draft")], caches.block_tables,
                                 caches.ring_slots)
    with pytest.raises(ValueError, match="draft rows run only the SWA-only DSpark stages"):
        attn.attention_shared(model.ranks[0].layer(2), model.inputs(2, draft), draft, caches, CFG)


def test_sparse_mqa_against_float64():
    rng = np.random.default_rng()
    r, h, n = 5, 4, 40
    q = bf16_round(rng.standard_normal((r, h, 512), dtype=np.float32))
    kv = bf16_round(rng.standard_normal((r, n, 512), dtype=np.float32))
    valid = rng.random((r, n)) < 0.7
    valid[0] = False  # a row with nothing to attend to: only the sink, o = 0
    kv[~valid] = np.nan  # poison: must never reach the output
    sink = rng.standard_normal(h).astype(np.float32)
    got = attention_ref.sparse_mqa(q, kv, valid, sink)
    want = attention_ref.sparse_mqa_f64(q, kv, valid, sink)
    np.testing.assert_array_equal(got[0], 0.0)
    # P rounded to BF16 (unit roundoff 2^-8 relative each) and o rounded to BF16 (2^-8 relative):
    # |o - o64| <= 2^-8 * sum_n P_n |v_n| + 2^-8 |o64| (+ float32 slack).
    v = np.where(valid[:, :, None], kv, 0).astype(np.float64)
    logits = np.einsum("rhd,rnd->rhn", q.astype(np.float64), v) / np.sqrt(512)
    logits = np.where(valid[:, None], logits, -np.inf)
    m = np.maximum(logits.max(axis=2, keepdims=True), sink[None, :, None])
    e = np.exp(logits - m)
    p = e / (e.sum(axis=2, keepdims=True) + np.exp(sink[None, :, None] - m))
    bound = 2.0**-8 * (p @ np.abs(v)) + 2.0**-8 * np.abs(want) + 1e-6
    assert (np.abs(got - want) <= bound).all()


def test_swa_positions_brute_force():
    rng = np.random.default_rng()
    w = 16
    for _ in range(20):
        start, n = int(rng.integers(0, 40)), int(rng.integers(1, 7))
        pos = np.arange(start, start + n)
        draft = np.full(n, bool(rng.integers(2)))
        cols, valid = attention_ref.swa_positions(pos, np.full(n, start), np.full(n, start + n - 1),
                                                  draft, w)
        for j, p in enumerate(pos):
            seen = set(cols[j][valid[j]].tolist())
            want = (set(range(max(0, start - w), start + n)) if draft[0]
                    else set(range(max(0, p - w + 1), p + 1)))
            assert seen == want and valid[j].sum() == len(want)
