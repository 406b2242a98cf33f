"""GPU tests of the multi-GPU check (collectives/multi.py): IPC smoke test and all-reduce
correctness, one process per rank.

- On >= 2 GPUs (every visible one, or HOPDEC_TP_DEVICES): links, the IPC smoke test (peer
  loads, copy-engine copies and remote stores, every word checked), and the one-shot (plain,
  residual) and NCCL (plain, + residual add) all-reduces at a few row counts, eager, untimed.
  Skipped with the reason on one GPU.
- On any GPU: world 4 with every rank on GPU 0 (the contexts time-slice), the functional mode:
  smoke test and one-shot correctness, no NCCL (it refuses two ranks on one GPU), no timing.
Tolerances: one-shot bitwise against `allreduce_ref` (same fp32 adds in rank order, one RNE
rounding) and the same bits on every rank; NCCL within world x 2^-8 x sum_s |x_s| of the float64
sum (its order is its own: at most world - 1 bf16 roundings of partial sums no larger than
sum |x_s|), and the residual add after it bitwise from NCCL's own sum. Inputs are fresh per run
(a random seed), outputs poisoned before each check. About 20-40 s each.
"""
from __future__ import annotations

import os
import random

import pytest

from collectives import multi

pytestmark = pytest.mark.gpu

ROWS = (1, 5, 64, 192)


def _bundle(world: int):
    extra = [os.environ.get("HOPDEC_BUNDLE_V41", "build/bundle-v41-flash-tp4")]
    try:
        return multi.find_bundle(world, multi.bundle_candidates(world, extra))
    except LookupError as exc:
        pytest.skip(str(exc))


def _run(plan: multi.Plan) -> dict:
    seed = random.randrange(2**32)
    report = multi.run_check(plan, _bundle(plan.world), seed)
    assert multi.problems(report) == [], multi.format_report(report)
    return report


def test_tp_links_smoke_and_allreduce_correctness_on_separate_gpus():
    devices = multi.resolve_devices(os.environ.get(multi.DEVICES_VARIABLE), multi.visible_gpus())
    reason = multi.skip_reason(devices)
    if reason is None and len(set(devices)) < len(devices):
        reason = f"{multi.DEVICES_VARIABLE} puts several ranks on one GPU: {devices}"
    if reason is not None:
        pytest.skip(reason)
    report = _run(multi.Plan(devices, rows=ROWS, timed=False))
    pairs = {(p["src"], p["dst"]) for p in report["pairs"]}
    assert len(pairs) == len(set(devices)) * (len(set(devices)) - 1)
    assert {(r["variant"], r["rows"]) for r in report["rows"]} == {
        (v, n) for v in multi.VARIANTS for n in ROWS}
    assert all(sum(s["mismatching_words"].values()) == 0 for s in report["smoke"])
    assert all(len(s["mismatching_words"]) == 3 * (len(devices) - 1) + 1
               for s in report["smoke"])       # load + copy + store per peer, own slice


def test_tp_functional_world4_on_one_gpu():
    report = _run(multi.Plan((0, 0, 0, 0), rows=ROWS))
    assert report["shares_gpu"] and "crossover" not in report
    assert {(r["variant"], r["rows"]) for r in report["rows"]} == {
        (v, n) for v in ("oneshot", "oneshot_residual") for n in ROWS}
    assert all(r["us"] is None and r["ranks_agree"] for r in report["rows"])
    assert all(len(s["mismatching_words"]) == 10 for s in report["smoke"])
