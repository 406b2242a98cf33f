"""kernels/mhc_ref: mixes, Sinkhorn, coefficients, collapse and post against float64 re-derivations."""
import numpy as np
import pytest

from kernels import mhc_ref

N_STREAMS, DIM = 4, 256
N_MIX = N_STREAMS * N_STREAMS + 2 * N_STREAMS


def _bf16(x):
    return mhc_ref.round_bf16(x)


def _sinkhorn_f64(logits, iters, eps):
    """Independent float64 loop over matrices, the algorithm of model doc §2.2 M2."""
    out = np.empty_like(logits, dtype=np.float64)
    for idx in np.ndindex(logits.shape[:-2]):
        m = np.exp(logits[idx].astype(np.float64))
        m = m / m.sum(axis=1, keepdims=True) + eps
        m = m / (m.sum(axis=0, keepdims=True) + eps)
        for _ in range(iters - 1):
            m = m / (m.sum(axis=1, keepdims=True) + eps)
            m = m / (m.sum(axis=0, keepdims=True) + eps)
        out[idx] = m
    return out


def test_sinkhorn_is_doubly_stochastic_and_matches_float64():
    rng = np.random.default_rng()
    logits = rng.normal(0.0, 1.0, (512, N_STREAMS, N_STREAMS)).astype(np.float32)
    comb = mhc_ref.sinkhorn(logits, 20, 1e-6)
    # The last step normalises columns: Σ_j comb[j, k] = S/(S + eps) with S ≈ 1, plus four fp32
    # roundings (≤ 4·2^-24 relative) -> within 2e-6 of 1.
    np.testing.assert_allclose(comb.sum(axis=-2), 1.0, atol=2e-6, rtol=0)
    # Rows converge geometrically but at a matrix-dependent rate: over 5e5 unit-variance draws, 20
    # rounds leave a median row error of 1e-6, 99.99 % below 6e-4 and a worst case of 1.8e-2.
    row_err = np.abs(comb.sum(axis=-1) - 1.0)
    assert row_err.max() <= 0.05 and np.median(row_err) <= 1e-5
    assert (comb > 0).all()
    # fp32 vs float64 of the same 20 rounds: each round is a few relative 2^-24 roundings.
    np.testing.assert_allclose(comb, _sinkhorn_f64(logits, 20, 1e-6), rtol=2e-5, atol=1e-7)


def test_sinkhorn_rows_converge_with_more_rounds():
    rng = np.random.default_rng()
    logits = rng.normal(0.0, 2.0, (256, N_STREAMS, N_STREAMS)).astype(np.float32)
    row_err = [np.abs(mhc_ref.sinkhorn(logits, k, 1e-6).sum(-1) - 1).max() for k in (2, 20, 200)]
    assert row_err[0] > row_err[1] > row_err[2]
    with pytest.raises(ValueError, match="at least one"):
        mhc_ref.sinkhorn(logits, 0, 1e-6)


def test_mixes_match_float64_and_broadcast_equals_full():
    rng = np.random.default_rng()
    rows = 7
    streams = _bf16(rng.normal(0, 1, (rows, N_STREAMS, DIM)))
    fn = rng.normal(0, 0.02, (N_MIX, N_STREAMS * DIM)).astype(np.float32)
    mixes = mhc_ref.hc_mixes(streams, fn, 1e-20)
    flat = streams.reshape(rows, -1).astype(np.float64)
    want = flat @ fn.T.astype(np.float64) / np.sqrt((flat ** 2).mean(1, keepdims=True) + 1e-20)
    # fp32 dot of 1024 terms: error ≤ ~1024·2^-24·Σ|terms| in the worst case, ~√1024·2^-24 typically.
    scale = np.abs(flat) @ np.abs(fn.T.astype(np.float64)) / np.sqrt((flat ** 2).mean(1))[:, None]
    assert (np.abs(mixes - want) <= 1e-5 * scale + 1e-30).all()

    emb = _bf16(rng.normal(0, 1, (rows, DIM)))
    copies = np.repeat(emb[:, None, :], N_STREAMS, axis=1)
    full = mhc_ref.hc_mixes(copies, fn, 1e-20)
    summed = mhc_ref.hc_mixes_broadcast(emb, mhc_ref.sum_fn_over_streams(fn, N_STREAMS), 1e-20)
    scale = np.abs(emb.astype(np.float64)) @ np.abs(fn.reshape(N_MIX, N_STREAMS, DIM)).sum(1).T
    scale /= np.sqrt((emb.astype(np.float64) ** 2).mean(1))[:, None]
    assert (np.abs(full - summed) <= 1e-5 * scale).all()
    with pytest.raises(ValueError, match="columns"):
        mhc_ref.hc_mixes(streams[:, :3], fn, 1e-20)


def test_coefficients_ranges_and_formula():
    rng = np.random.default_rng()
    mixes = rng.normal(0, 1, (9, N_MIX)).astype(np.float32)
    scale = rng.uniform(0.5, 2, 3).astype(np.float32)
    base = rng.normal(0, 1, N_MIX).astype(np.float32)
    c = mhc_ref.hc_coefficients(mixes, scale, base, N_STREAMS, 20, 1e-6)
    m, s, b = mixes.astype(np.float64), scale.astype(np.float64), base.astype(np.float64)
    sig = lambda v: 1 / (1 + np.exp(-v))
    np.testing.assert_allclose(c.pre, sig(m[:, :4] * s[0] + b[:4]) + 1e-6, rtol=1e-6)
    np.testing.assert_allclose(c.post, 2 * sig(m[:, 4:8] * s[1] + b[4:8]), rtol=1e-6)
    comb_logits = (m[:, 8:] * s[2] + b[8:]).reshape(-1, 4, 4)
    np.testing.assert_allclose(c.comb, _sinkhorn_f64(comb_logits, 20, 1e-6), rtol=2e-5, atol=1e-7)
    assert ((c.pre > 1e-6) & (c.pre < 1 + 2e-6)).all() and ((c.post > 0) & (c.post < 2)).all()
    with pytest.raises(ValueError, match="coefficient shapes"):
        mhc_ref.hc_coefficients(mixes[:, :20], scale, base, N_STREAMS, 20, 1e-6)


def test_post_and_collapse_round_once_to_bf16():
    rng = np.random.default_rng()
    rows = 5
    streams = _bf16(rng.normal(0, 1, (rows, N_STREAMS, DIM)))
    out = _bf16(rng.normal(0, 1, (rows, DIM)))
    c = mhc_ref.hc_coefficients(rng.normal(0, 1, (rows, N_MIX)).astype(np.float32),
                                np.ones(3, np.float32), np.zeros(N_MIX, np.float32), 4, 20, 1e-6)
    got = mhc_ref.hc_post(out, streams, c)
    want = c.post[:, :, None].astype(np.float64) * out[:, None, :] \
        + np.einsum("rjk,rjd->rkd", c.comb.astype(np.float64), streams)
    terms = c.post[:, :, None] * np.abs(out)[:, None, :] \
        + np.einsum("rjk,rjd->rkd", c.comb.astype(np.float64), np.abs(streams))
    # One BF16 rounding (half ulp ≤ 2^-8 relative, 8-bit significand) of an fp32 sum of 5 terms,
    # whose own rounding (≤ 5·2^-24 of the terms' magnitudes) matters only under cancellation.
    assert (np.abs(got - want) <= 2.0 ** -8 * np.abs(want) * 1.01 + 2.0 ** -21 * terms).all()
    assert np.array_equal(got, _bf16(got))

    pre = c.pre
    got = mhc_ref.hc_collapse(streams, pre)
    want = np.einsum("rn,rnd->rd", pre.astype(np.float64), streams)
    terms = np.einsum("rn,rnd->rd", pre.astype(np.float64), np.abs(streams))
    assert (np.abs(got - want) <= 2.0 ** -8 * np.abs(want) * 1.01 + 2.0 ** -21 * terms).all()
    # The carried one-hot pre of layer 0 collapses to stream 0 exactly.
    assert np.array_equal(mhc_ref.hc_collapse(streams, mhc_ref.one_hot_pre(rows, 4)), streams[:, 0])
