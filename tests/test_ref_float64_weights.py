"""The reference's float64 weight cache and rank threads change its time, never a byte.

`ReferenceModel(float64_cache_bytes=..., rank_workers=...)` (executor/reference/
float64_weights.py, kernels.moe_ref's `f64=`) must give exactly the bytes of the reference's own arithmetic
(kernels.moe_ref's MoE, head_ref's head, a fresh float64 conversion per product, serial ranks):
- whole DSpark rounds on tiny at TP 4: prefills, batched drafts (U), Markov drafts, verify
  forwards (logits, hidden, aux), acceptance, every cache array; the baseline runs the pre-cache
  functions themselves (moe_ref.moe_partial, moe_ref.matmul_t, serial attention);
- a real-width MoE partial (v41's D = 5120, I_l = 576: 40 activation groups for w13 and a short
  tail group for w2; the slice's synthetic experts) over the copies against
  moe_ref.moe_partial without them, W4A8 and exact,
  experts aliased onto shared shard objects as the real-dimension round test aliases them;
- the reference's products at 1 and 2 OpenBLAS threads (real_slice.blas_threads, which the
  real-dimension round test sets to 1): the same bytes;
- the cache itself: 0 bytes keeps nothing, the bound evicts the least recently used copy, a copy
  is served only for the very weight object it was made from.
No tolerance anywhere: every comparison is of bytes.
"""
from __future__ import annotations

import numpy as np
import pytest
import real_slice as rs
from ref_model import caches_equal, new_caches, random_prompt, tiny_model

from executor.reference import dspark, step
from executor.reference.float64_weights import Float64Weights
from kernels import moe_ref
from loader.formats import bf16_round

ROUNDS, SEQS = 3, 3


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _pre_cache_arithmetic(monkeypatch) -> None:
    """The reference as it was before the cache: moe_ref's MoE with no copies (f64=None), a
    conversion per product."""
    partial = moe_ref.moe_partial
    monkeypatch.setattr(moe_ref, "moe_partial", lambda x, routing, experts, shared, limit, q, f64:
                        partial(x, routing, experts, shared, limit, quantize_acts=q))
    monkeypatch.setattr(Float64Weights, "matmul_t", lambda self, x, w: moe_ref.matmul_t(x, w))


def _rounds(model, seed: int) -> list:
    """Prefill SEQS prompts, then ROUNDS batched rounds (the first round's drafts are the
    reference's, the later ones random, so that accepted counts vary); everything they return."""
    rng = np.random.default_rng(seed)
    caches = new_caches(model, max_seqs=SEQS)
    seqs, record = [], []
    for line in range(SEQS):
        seq, logits = dspark.start_sequence(model, caches, line, random_prompt(rng, 5 + 2 * line))
        seqs.append(seq)
        record.append(logits)
    for rnd in range(ROUNDS):
        bases = dspark.draft_base_logits_many(model, caches, seqs)
        drafts = [dspark.markov_drafts(model, b, q.bonus) for b, q in zip(bases, seqs)]
        if rnd:
            drafts = [tuple(int(t) for t in rng.integers(0, 1023, 5)) for _ in seqs]
        results, out = dspark.verify_and_accept_many(model, caches, seqs, drafts)
        record += [b for base in bases for b in base]
        record += [np.array(drafts), np.array([a for a, _ in results]), out.tokens, out.logits,
                   out.hidden, out.aux]
    return record + [caches]


def test_cached_threaded_rounds_equal_the_pre_cache_reference_bytes(monkeypatch):
    plain = tiny_model(4)
    fast = step.ReferenceModel(plain.cfg, plain.ranks, rank_workers=4,
                               float64_cache_bytes=1 << 30)
    seed = int(np.random.default_rng().integers(1 << 31))
    with monkeypatch.context() as m:
        _pre_cache_arithmetic(m)
        want = _rounds(plain, seed)
    got = _rounds(fast, seed)
    assert fast.float64.held_bytes > 0                      # the cache did serve the rounds
    assert caches_equal(got.pop(), want.pop())
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert _same(g, w), f"seed {seed}: recorded array {i} differs"


@pytest.fixture(scope="module")
def slice_layer():
    """Layer 0 of rank 1 of the real-dimension slice (synthetic values, experts e % 4)."""
    cfg = rs.slice_config_v41(1, 1)
    model = rs.reference_model(cfg, rs.SharedSynth(cfg, seed=11))
    return cfg, model.ranks[1].layer(0)


@pytest.mark.parametrize("quantize_acts", [True, False])
def test_real_width_moe_partial_equals_moe_ref(slice_layer, quantize_acts):
    cfg, lw = slice_layer
    rng = np.random.default_rng()
    x = bf16_round(rng.standard_normal((18, cfg.hidden_size)).astype(np.float32))
    routing = moe_ref.route(x, lw.vector("ffn.gate.weight"), lw.vector("ffn.gate.bias"), lw.topk,
                            cfg.routed_scaling_factor)
    assert lw.shared.w2.shape[1] % moe_ref.ACT_GROUP        # w2's last group is a short one
    want = moe_ref.moe_partial(x, routing, lw.experts, lw.shared, cfg.swiglu_limit,
                               quantize_acts=quantize_acts)
    f64 = Float64Weights(1 << 30)
    for _ in range(2):                      # the second call runs on the cached copies
        got = moe_ref.moe_partial(x, routing, lw.experts, lw.shared, cfg.swiglu_limit,
                                  quantize_acts, f64)
        assert _same(got, want)
    assert f64.held_bytes > 0


def test_cache_bound_eviction_and_identity():
    rng = np.random.default_rng()
    a, b = (rng.standard_normal((64, 300)).astype(np.float32) for _ in range(2))
    x = rng.standard_normal((5, 300)).astype(np.float32)
    none = Float64Weights(0)
    assert _same(none.matmul_t(x, a), moe_ref.matmul_t(x, a)) and none.held_bytes == 0
    one = Float64Weights(a.nbytes * 2)                       # room for one float64 copy
    assert one.whole(a) is one.whole(a)
    assert _same(one.whole(a), a.astype(np.float64))
    one.whole(b)                                             # evicts a's copy
    assert one.held_bytes == a.nbytes * 2 and one.whole(b) is one.whole(b)
    groups = Float64Weights(1 << 20).groups(a, 128)
    assert [g.shape for g in groups] == [(64, 128), (64, 128), (64, 44)]
    assert all(g.flags.c_contiguous for g in groups)
    assert _same(np.concatenate(groups, axis=1), a.astype(np.float64))
    twin = a.copy()
    twin[0, 0] += 1.0
    cache = Float64Weights(1 << 20)
    cache.whole(a)
    assert cache.whole(twin)[0, 0] == twin[0, 0]             # another object: its own copy
    with pytest.raises(ValueError, match="max_bytes"):
        Float64Weights(-1)
    with pytest.raises(ValueError, match="weight is"):
        cache.matmul_t(x[:, :10], a)


def test_blas_thread_count_changes_no_product():
    rng = np.random.default_rng()
    head = bf16_round(rng.standard_normal((4096, 5120)).astype(np.float32))
    expert = bf16_round(rng.standard_normal((1152, 5120)).astype(np.float32))
    x = bf16_round(rng.standard_normal((18, 5120)).astype(np.float32))
    got = {}
    for threads in (1, 2):
        with rs.blas_threads(threads) as before:
            if before is None:
                pytest.skip("numpy's OpenBLAS thread count cannot be set here")
            got[threads] = (moe_ref.matmul_t(x, head), moe_ref.w4a8_matmul(x, expert))
        assert rs._openblas()[0]() == before                 # put back
    assert all(_same(a, b) for a, b in zip(got[1], got[2]))
