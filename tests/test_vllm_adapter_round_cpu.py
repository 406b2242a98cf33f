"""The vLLM adapter's DSpark round without a GPU: binding the round's outputs by vLLM name, `round`
and `draft` forwarding to the Executor's graphs on the engine's stream, `decide_round` against
what `round` returns (state, slot buckets, prefill, features, short verify blocks), and `open`
passing `dspark` on.

The executor is test_executor_dspark's: both sync-free plans with every stage a fake launch, the
graphs test_executor_cpu's Recorder (each replay logs (rows of the bucket, stream)); device
tensors are FakeCudaTensors. Batches, slot counts and streams are drawn fresh per run.
"""
from __future__ import annotations

import numpy as np
import pytest
from test_executor_cpu import CFG, GEOMETRY, FakeCudaTensor, fake_tensors, make_executor
from test_executor_dspark import _executor
from test_vllm_adapter_cpu import _bundle_dir, fake_gpu  # noqa: F401  (a fixture)

from executor.bind import BindError
from executor.graphs import BUCKETS
from executor.reasons import StepFeature, StepResult
from executor.vllm_adapter import HopdecBackend, decide_round, fallback_reason, step_features

K = CFG.dspark_block_size
ROUND_OUTPUTS = {"num_accepted_tokens": "accepted", "bonus_token_ids": "bonus"}


def dspark_backend(bind: bool = True, capture: bool = True, buckets=BUCKETS):
    ex, rec = _executor(buckets=buckets, bind=False, capture=False)
    b = HopdecBackend(ex)
    fakes = {v: t for v, t in zip(b.names, fake_tensors(ex.rules).values(), strict=True)}
    if bind:
        b.bind(**fakes)
    if capture:
        ex.capture("capture-stream")
    return b, rec, fakes


def _slot_bucket(b: HopdecBackend, n_seqs: int) -> int:
    return min(s for s in b.executor.round_slots if s >= n_seqs)


# ---- names and bind --------------------------------------------------------------------------


def test_round_outputs_bind_by_vllm_name_in_place():
    b, _, fakes = dspark_backend(capture=False)
    assert b.dspark and b.max_seqs == 192 // (K + 1)
    for vllm, hopdec in ROUND_OUTPUTS.items():
        assert b.names[vllm] == hopdec
        assert b.bound_addresses[vllm] == fakes[vllm].address
        assert b.executor.binding.pointers[hopdec] == fakes[vllm].address
    plain = HopdecBackend(make_executor()[0])
    assert not plain.dspark and plain.max_seqs == 0
    assert not set(ROUND_OUTPUTS) & set(plain.names)


def test_round_outputs_are_validated_naming_the_vllm_tensor():
    b, _, good = dspark_backend(bind=False, capture=False)
    for missing in ROUND_OUTPUTS:
        with pytest.raises(BindError, match=rf"missing tensor\(s\) \['{missing}'\]; expected "
                                            rf"{missing}: int(32|64) \[192\]"):
            b.bind(**{k: v for k, v in good.items() if k != missing})
    accepted = good["num_accepted_tokens"].address
    with pytest.raises(BindError, match=r"vLLM tensor 'num_accepted_tokens' \(hopdec "
                                        r"'accepted'\) is int64; hopdec needs int32 \[192\]"):
        b.bind(**{**good, "num_accepted_tokens": FakeCudaTensor((192,), "int64", accepted)})
    rows = int(np.random.default_rng().integers(193, 1024))
    bonus = good["bonus_token_ids"].address
    with pytest.raises(BindError, match=rf"'bonus_token_ids' \(hopdec 'bonus'\) has shape "
                                        rf"\[{rows}\].*Bind bonus_token_ids\[:192\]"):
        b.bind(**{**good, "bonus_token_ids": FakeCudaTensor((rows,), "int64", bonus)})
    good["num_accepted_tokens"].address = good["bonus_token_ids"].address + 64
    with pytest.raises(BindError, match="overlap") as info:
        b.bind(**good)
    for vllm, hopdec in ROUND_OUTPUTS.items():
        assert f"'{hopdec}' (vLLM '{vllm}')" in str(info.value)
    assert b.bound_addresses == {}


# ---- round, draft, step ----------------------------------------------------------------------


def test_round_replays_draft_then_verify_on_the_engine_stream():
    rng = np.random.default_rng()
    b, rec, _ = dspark_backend()
    stream = int(rng.integers(2, 1 << 40))
    for n in [1, b.max_seqs, *rng.integers(1, b.max_seqs + 1, size=6).tolist()]:
        s = _slot_bucket(b, int(n))
        rec.graph_launches.clear()
        assert b.round(int(n), stream) == StepResult.SERVED
        assert rec.graph_launches == [(s * K, stream), (s * (K + 1), stream)]
        rec.graph_launches.clear()
        assert b.draft(int(n), stream, StepFeature.NONE) == StepResult.SERVED
        assert b.step(int(n) * (K + 1), stream) == StepResult.SERVED
        assert rec.graph_launches == [(s * K, stream), (s * (K + 1), stream)]


def test_step_decision_on_a_round_backend_uses_its_verify_buckets():
    rng = np.random.default_rng()
    b, rec, _ = dspark_backend(buckets=(8, 100))                 # slots 1, 16: 96 verify rows
    assert b.max_rows == 16 * (K + 1) == 96
    for rows in [96, 97, int(rng.integers(1, 101))]:
        decision = b.decide([1] * rows)
        rec.graph_launches.clear()
        assert b.step(decision.n_rows, 5, decision.features) == decision.reason
        assert decision.use_hopdec == (rows <= 96) == bool(rec.graph_launches)


def test_round_declines_launch_nothing():
    rng = np.random.default_rng()
    b, rec, _ = dspark_backend()
    n = int(rng.integers(1, b.max_seqs + 1))
    high = 1 << int(rng.integers(6, 40))
    for call in (b.round, b.draft):
        assert call(0, 9) == StepResult.NO_ROWS
        assert call(b.max_seqs + int(rng.integers(1, 100)), 9) == StepResult.TOO_MANY_ROWS
        assert call(n, 9, StepFeature.PREFILL) == StepResult.PREFILL_ROWS
        assert call(n, 9, step_features(non_greedy=True)) == StepResult.UNSUPPORTED_FEATURE
        assert call(n, 9, high) == StepResult.UNSUPPORTED_FEATURE
        for legacy in (0, 1):
            with pytest.raises(ValueError, match=r"legacy default stream.*torch\.cuda\.stream"):
                call(n, legacy)
        with pytest.raises(TypeError, match="plain ints"):
            call(n, 9, 1.0)
        with pytest.raises(ValueError, match="features >= 0"):
            call(n, 9, -1)
    assert rec.graph_launches == []


# ---- decide_round ----------------------------------------------------------------------------


def _spec_batch(rng, most: int) -> tuple[list[int], bool, int]:
    """num_scheduled_tokens of a spec-decode batch: mostly verify blocks of k + 1, sometimes a
    short block (drafts cut), a prefill chunk, the prefill flag or a feature bit."""
    n = int(rng.integers(0, most + 8))
    rows = [K + 1] * n
    for i in rng.choice(n, size=min(n, int(rng.integers(0, 2))), replace=False):
        rows[int(i)] = int(rng.choice([int(rng.integers(1, K + 1)), K + 2 + int(rng.integers(60))]))
    features = int(rng.choice([0, 0, 0, int(StepFeature.NON_GREEDY_SAMPLING),
                               int(StepFeature.LOGPROBS), 1 << int(rng.integers(6, 30))]))
    return rows, bool(rng.random() < 0.1), features


def test_round_decision_is_what_round_returns():
    """Random spec-decode batches (up to max_seqs + 7 requests): the host decision is the code
    round() returns for it and only served rounds launch, except a short block, which only the
    decision can decline (round sees the sequence count alone)."""
    rng = np.random.default_rng()
    b, rec, _ = dspark_backend()
    seen, short_declined = set(), 0
    for _ in range(300):
        rows, prefill, features = _spec_batch(rng, b.max_seqs)
        decision = b.decide_round(rows, any_prefill=prefill, features=features)
        assert decision.n_seqs == len(rows)
        seen.add(decision.reason)
        rec.graph_launches.clear()
        code = b.round(decision.n_seqs, 77, decision.features)
        assert len(rec.graph_launches) == 2 * int(code == StepResult.SERVED)
        if code == StepResult.SERVED and min(rows) < K + 1:
            assert decision.reason == StepResult.UNSUPPORTED_FEATURE and not decision.use_hopdec
            short_declined += 1
            continue
        assert code == decision.reason and decision.use_hopdec == (code == StepResult.SERVED)
    assert {StepResult.SERVED, StepResult.NO_ROWS, StepResult.TOO_MANY_ROWS,
            StepResult.PREFILL_ROWS, StepResult.UNSUPPORTED_FEATURE} <= seen
    assert short_declined


def test_round_decision_follows_the_backend_state_as_round_does():
    rng = np.random.default_rng()
    b, rec, fakes = dspark_backend(bind=False, capture=False)
    rows = [K + 1] * int(rng.integers(1, b.max_seqs + 1))

    def agree(backend, expected):
        decision = backend.decide_round(rows)
        assert decision.reason == expected and not decision.use_hopdec
        assert backend.round(decision.n_seqs, 5, decision.features) == expected

    agree(b, StepResult.NOT_BOUND)
    b.bind(**fakes)
    agree(b, StepResult.NOT_CAPTURED)
    b.executor.capture("capture-stream")
    assert b.decide_round(rows).use_hopdec
    b.close()
    agree(b, StepResult.CLOSED)
    plain, plain_rec = make_executor()
    agree(HopdecBackend(plain), StepResult.UNSUPPORTED_FEATURE)
    assert rec.graph_launches == [] and plain_rec.graph_launches == []


def test_round_decision_rules():
    kw = {"max_seqs": 32, "block_rows": K + 1}
    assert decide_round([K + 1] * 32, **kw).reason == StepResult.SERVED
    assert decide_round(np.full(3, K + 1, np.int32), **kw).use_hopdec
    assert decide_round([K + 1] * 33, **kw).reason == StepResult.TOO_MANY_ROWS
    assert decide_round([K + 1] * 9, max_seqs=8, block_rows=K + 1).reason == \
        StepResult.TOO_MANY_ROWS
    assert decide_round([], **kw).reason == StepResult.NO_ROWS
    long = decide_round([K + 1, K + 2], **kw)
    assert long.reason == StepResult.PREFILL_ROWS and long.features == int(StepFeature.PREFILL)
    flagged = decide_round([K + 1], any_prefill=True, **kw)
    assert flagged.reason == StepResult.PREFILL_ROWS and flagged.features & StepFeature.PREFILL
    for rows in ([K + 1, K], [1], [K + 1] * 4 + [2]):
        short = decide_round(rows, **kw)
        assert short.reason == StepResult.UNSUPPORTED_FEATURE and short.features == 0
    greedy_only = decide_round([K + 1], features=step_features(non_greedy=True), **kw)
    assert greedy_only.reason == StepResult.UNSUPPORTED_FEATURE
    assert "sampling other than greedy" in fallback_reason(greedy_only.reason)
    assert "DSpark" in fallback_reason(StepResult.TOO_MANY_ROWS)
    with pytest.raises(ValueError, match=r"decide_round: every request schedules >= 1 row"):
        decide_round([K + 1, 0], **kw)
    with pytest.raises(TypeError, match=r"decide_round: rows_per_request must hold ints"):
        decide_round([6.0], **kw)
    with pytest.raises(TypeError, match=r"decide_round: features must be a non-negative int"):
        decide_round([K + 1], features=-1, **kw)


# ---- open ------------------------------------------------------------------------------------


def test_open_passes_dspark_on(tmp_path, fake_gpu):  # noqa: F811  (the imported fixture)
    b = HopdecBackend.open(CFG, _bundle_dir(tmp_path, tp=2), None, tp=2, rank=0,
                           geometry=GEOMETRY, device_ordinal=1, dspark=True)
    assert b.dspark and b.executor.round_slots[-1] == b.max_seqs == 192 // (K + 1)
    assert set(ROUND_OUTPUTS) <= set(b.names)
    assert b.round(1, 7) == StepResult.NOT_BOUND
    assert b.decide_round([K + 1]).reason == StepResult.NOT_BOUND
    b.close()
    assert fake_gpu == ["device 1", "bundle loaded", "bundle closed", "device closed"]
