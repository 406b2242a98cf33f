"""Whether hopdec serves a vLLM batch, decided on the host from its description alone; log lines.

`decide_step` (plain decode, and DSpark verify blocks through `step`) and `decide_round` (a DSpark
round for a spec-decode batch) give the code `Executor.step` / `Executor.round` would return, in
their order, without touching the device, so the engine runs its stock path for a declined batch
without calling hopdec at all. `step_features` builds the `features` int from what the engine knows
(executor/reasons.py); `fallback_reason` turns any returned code into a log line. Used through
executor/vllm_adapter.py (HopdecBackend.decide / decide_round add the backend's state).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

from executor.bind import MAX_ROWS
from executor.reasons import SUPPORTED_FEATURES, StepFeature, StepResult

__all__ = ["RoundDecision", "StepDecision", "decide_round", "decide_step", "fallback_reason",
           "step_features"]


def step_features(*, prefill: bool = False, non_greedy: bool = False, logprobs: bool = False,
                  lora: bool = False, multimodal: bool = False, penalties: bool = False) -> int:
    """The `features` int for `step` from what the engine knows on the host. In vLLM:
    `non_greedy = not sampling_metadata.all_greedy`, `logprobs = max_num_logprobs is not None`,
    `penalties = not no_penalties`, `lora` = any active LoRA request, `multimodal` = any
    scheduled encoder input; `prefill` = any request still in its prompt."""
    bits = StepFeature.NONE
    for flag, bit in ((prefill, StepFeature.PREFILL), (non_greedy, StepFeature.NON_GREEDY_SAMPLING),
                      (logprobs, StepFeature.LOGPROBS), (lora, StepFeature.LORA),
                      (multimodal, StepFeature.MULTIMODAL), (penalties, StepFeature.PENALTIES)):
        if flag:
            bits |= bit
    return int(bits)


@dataclass(frozen=True)
class StepDecision:
    """Whether to call hopdec for a batch. `reason` is SERVED when `use_hopdec`, else the code
    `step(n_rows, stream, features)` would return for it (nothing to call then)."""

    use_hopdec: bool
    n_rows: int
    features: int
    reason: StepResult


def decide_step(rows_per_request, *, any_prefill: bool = False, features: int = 0,
                max_rows: int = MAX_ROWS, max_block_rows: int = 6) -> StepDecision:
    """Decide on the host, from the batch description alone, in `Executor.step`'s order.

    `rows_per_request`: the rows each request schedules this step (vLLM's
    `num_scheduled_tokens`, host ints). `max_block_rows`: the longest block the executor serves
    (a DSpark verify block, dspark_block_size + 1 = 6); a longer one is a prefill chunk, as is
    any request the engine flags with `any_prefill`. `max_rows`: the largest captured bucket.
    """
    rows, _, features = _read_batch("decide_step", rows_per_request, any_prefill, features,
                                    max_block_rows)
    n_rows = sum(rows)
    reason = _decline(n_rows, max_rows, features)
    return StepDecision(reason == StepResult.SERVED, n_rows, features, reason)


@dataclass(frozen=True)
class RoundDecision:
    """Whether to run a DSpark round through hopdec for a spec-decode batch. `reason` is SERVED
    when `use_hopdec`, else the reason not to (nothing to call then)."""

    use_hopdec: bool
    n_seqs: int
    features: int
    reason: StepResult


def decide_round(rows_per_request, *, max_seqs: int, block_rows: int, any_prefill: bool = False,
                 features: int = 0) -> RoundDecision:
    """Decide a DSpark round on the host, from the spec-decode batch alone, in `round`'s order.

    `rows_per_request`: vLLM's `num_scheduled_tokens` (host ints), one verify block per request
    of `block_rows` = k + 1 rows (1 + num_speculative_tokens). `max_seqs`: the largest captured
    sequence-slot bucket. A longer block is a prefill chunk (PREFILL_ROWS, and the bit set in
    `features`, where `round` reads it); a shorter one (vLLM cut the drafts, or has none yet)
    cannot be served by a round, which verifies exactly k drafts per sequence:
    UNSUPPORTED_FEATURE, decided here only (`round` sees the sequence count alone).
    """
    rows, fewest, features = _read_batch("decide_round", rows_per_request, any_prefill,
                                         features, block_rows)
    reason = _decline(len(rows), max_seqs, features)
    if reason == StepResult.SERVED and fewest < block_rows:
        reason = StepResult.UNSUPPORTED_FEATURE
    return RoundDecision(reason == StepResult.SERVED, len(rows), features, reason)


def _read_batch(what: str, rows_per_request, any_prefill: bool, features,
                max_block_rows: int) -> tuple[list[int], int, int]:
    """(rows as a list, the fewest rows of a request, features with PREFILL set when a block is
    longer than `max_block_rows` or `any_prefill`); refuses what is not a batch."""
    rows = rows_per_request.tolist() if hasattr(rows_per_request, "tolist") else rows_per_request
    try:   # builtins over a list: ~3 us at 32 requests, ~7 at 192 (a Python loop took 22)
        operator.index(sum(rows))
        fewest, most = operator.index(min(rows, default=1)), operator.index(max(rows, default=0))
    except TypeError:
        raise TypeError(f"{what}: rows_per_request must hold ints, got {rows!r}") from None
    if fewest < 1:
        raise ValueError(f"{what}: every request schedules >= 1 row, got {rows}")
    if isinstance(features, bool) or not isinstance(features, int) or features < 0:
        raise TypeError(f"{what}: features must be a non-negative int (step_features), "
                        f"got {features!r}")
    features = int(features)
    if any_prefill or most > max_block_rows:
        features |= int(StepFeature.PREFILL)
    return rows, fewest, features


def _decline(count: int, limit: int, features: int) -> StepResult:
    """Executor._decline_reason's batch part: rows (or sequences) against the largest bucket,
    then the features."""
    if count == 0:
        return StepResult.NO_ROWS
    if count > limit:
        return StepResult.TOO_MANY_ROWS
    if features & int(StepFeature.PREFILL):
        return StepResult.PREFILL_ROWS
    if features & ~int(SUPPORTED_FEATURES):
        return StepResult.UNSUPPORTED_FEATURE
    return StepResult.SERVED


_FALLBACK_REASONS = {
    StepResult.SERVED: "served by hopdec",
    StepResult.NOT_BOUND: "hopdec declined: the engine's tensors are not bound yet (bind())",
    StepResult.NOT_CAPTURED: "hopdec declined: bound, but the step graphs are not captured "
                             "(capture())",
    StepResult.CLOSED: "hopdec declined: the backend is closed",
    StepResult.NO_ROWS: "hopdec declined: the step has no rows",
    StepResult.TOO_MANY_ROWS: "hopdec declined: more rows (or DSpark sequences) than its "
                              "largest captured bucket (at most 192 rows, 32 sequences)",
    StepResult.PREFILL_ROWS: "hopdec declined: the batch holds prefill rows",
    StepResult.UNSUPPORTED_FEATURE: "hopdec declined: the batch needs a feature it does not "
                                    "serve (sampling other than greedy, logprobs, LoRA, "
                                    "multimodal or penalties; a DSpark round on a backend "
                                    "without it, or with fewer drafts than k)",
}


def fallback_reason(code: int) -> str:
    """A log line for what `step` returned; every StepResult has one."""
    try:
        return _FALLBACK_REASONS[StepResult(code)]
    except ValueError:
        return f"hopdec declined with unknown reason code {code!r}"
