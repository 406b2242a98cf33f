"""What `Executor.step` returns: 0 when it served the step, else why it declined (nothing written).

`step(n_rows, stream, features=0) -> int` takes and returns plain integers. The codes are an
IntEnum so a C or torch caller compares with ints and a Python caller prints a name. Every decline
is decided on the host from the arguments alone, before any launch: the step never reads device
data to decide, so a caller that wants the executor to decline a step says so through `features`.

How the caller declares prefill or an unsupported feature (the design choice):
  The scheduler knows on the host, before it calls `step`, whether its batch holds prefill chunks,
  LoRA adapters, non-greedy sampling, multimodal tokens...; the executor cannot find out without
  a device-to-host read (forbidden in a step). So the caller passes a `StepFeature` bit mask as a
  third plain int. A plain argument rather than a bound pinned-host flag word because an argument
  has no ordering hazard: a flag word the host rewrites for step N+1 while step N is still being
  decided on would need a fence and a documented ownership rule; an argument is read once, now.
  Bits the executor does not know are declined as UNSUPPORTED_FEATURE (fail closed), so a caller
  built against a newer feature list never gets a silently wrong step.
"""
from __future__ import annotations

from enum import IntEnum, IntFlag


class StepResult(IntEnum):
    """Return value of `Executor.step`. 0 = served; any other value = declined, nothing written."""

    SERVED = 0
    NOT_BOUND = 1            # bind() has not succeeded yet
    NOT_CAPTURED = 2         # bound, but capture() has not built the bucket graphs
    CLOSED = 3               # close() was called
    NO_ROWS = 4              # n_rows == 0: nothing to do (the caller runs nothing either)
    TOO_MANY_ROWS = 5        # n_rows above the largest captured bucket (at most 192)
    PREFILL_ROWS = 6         # the caller declared prefill rows (StepFeature.PREFILL)
    UNSUPPORTED_FEATURE = 7  # any other declared feature bit, known or not


class StepFeature(IntFlag):
    """Bits the caller sets in `step(..., features=...)` for what its batch needs.

    Every bit is declined today; the executor serves only greedy decode, DSpark verify and draft
    blocks (which need no flag: the bound per-row `block_kind` says which rows are which).
    """

    NONE = 0
    PREFILL = 1 << 0            # a row block longer than one verify block, or a first chunk
    NON_GREEDY_SAMPLING = 1 << 1  # temperature / top-p / top-k: the step only computes argmax
    LOGPROBS = 1 << 2           # the caller needs full-vocabulary log-probabilities
    LORA = 1 << 3
    MULTIMODAL = 1 << 4         # image tokens (Engram gate 0, embeddings from a vision tower)
    PENALTIES = 1 << 5          # repetition / presence / frequency penalties


SUPPORTED_FEATURES = StepFeature.NONE
