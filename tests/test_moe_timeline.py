"""CPU: the routed-MoE timeline builds' specs and launches, and the summariser of their records
(executor/moe_timeline.py) on synthetic records whose phases and overlap are known exactly."""
from __future__ import annotations

import numpy as np
import pytest

from executor import moe_timeline as tl
from kernels import moe_kernel_ref as mk
from loader.config import ModelConfig

EVENTS = mk.TIMELINE_EVENTS


def _records(rng, ctas: int, start_ns: np.ndarray, gaps_ns: np.ndarray, ghz: float,
             reached: np.ndarray) -> np.ndarray:
    """Raw record bytes: CTA i enters at start_ns[i] and moves from event to event by
    gaps_ns[i]; clock64 runs at ghz from a random per-SM origin; events where reached[i] is
    False stay 0."""
    raw = np.zeros((ctas, mk.TIMELINE_RECORD_BYTES // 8), dtype=np.int64)
    smid = rng.integers(0, 132, ctas)
    raw[:, 0] = smid
    ns = start_ns[:, None] + np.concatenate([np.zeros((ctas, 1), np.int64),
                                             np.cumsum(gaps_ns, axis=1)], axis=1)
    clock = rng.integers(1 << 30, 1 << 40, ctas)[:, None] + np.round(
        (ns - start_ns[:, None]) * ghz).astype(np.int64)
    ns = np.where(reached, ns, 0)
    clock = np.where(reached, clock, 0)
    raw[:, 2::2], raw[:, 3::2] = ns, clock
    return raw.view(np.uint8).reshape(-1)


def test_summarise_phases_overlap_and_timer():
    rng = np.random.default_rng()
    n13, n2, ghz = int(rng.integers(50, 300)), int(rng.integers(50, 300)), 1.98
    t0 = int(rng.integers(10**9, 10**12))
    # w13: every CTA enters within 1 us; phase gaps random whole microseconds (a 1 us timer).
    start13 = t0 + 1000 * rng.integers(0, 2, n13)
    start13[0] = t0
    gaps13 = 1000 * rng.integers(1, 6, (n13, len(EVENTS) - 1))
    reach13 = np.ones((n13, len(EVENTS)), bool)
    reach13[-1, 3:6] = False                  # one CTA without an item: no landed / epilogue
    raw13 = _records(rng, n13, start13, gaps13, ghz, reach13)
    end13 = (start13 + gaps13.sum(1)).max()
    # w2: the first `early` CTAs enter 3 us before w13's last exit, the rest after it.
    early = int(rng.integers(1, n2))
    start2 = np.where(np.arange(n2) < early, end13 - 3000, end13 + 1000).astype(np.int64)
    gaps2 = 1000 * rng.integers(1, 4, (n2, len(EVENTS) - 1))
    raw2 = _records(rng, n2, start2, gaps2, ghz, np.ones((n2, len(EVENTS)), bool))

    w13 = tl.Records.parse("w13", raw13, n13)
    w2 = tl.Records.parse("w2", raw2, n2)
    got = tl.summarise(w13, w2)

    assert got["timer_resolution_ns"] == 1000.0     # stamps land on whole microseconds
    for rec, gaps, reach in ((w13, gaps13, reach13), (w2, gaps2, None)):
        k = got["kernels"][rec.name]
        assert k["ctas"] == rec.smid.size and k["sms"] == np.unique(rec.smid).size
        for j, (phase, a, b) in enumerate(tl.PHASES[:-1]):
            want = gaps[:, j] / 1e3
            if reach is not None:             # phases touching an unreached event: left out
                want = want[reach[:, EVENTS.index(a)] & reach[:, EVENTS.index(b)]]
            np.testing.assert_allclose(
                [k["phases_us"][phase][q] for q in ("p10", "median", "p90")],
                np.percentile(want, [10, 50, 90]), rtol=0, atol=1e-9, err_msg=phase)
            assert k["phases_us"][phase]["n"] == want.size
        # clock64 runs at ghz: cycles / ns within a CTA (exact to the rounding of one cycle).
        assert abs(k["sm_clock_ghz"] - ghz) < 1e-3
    ov = got["overlap"]
    assert ov["w2_ctas_entered_under_w13"] == early and ov["w2_ctas"] == n2
    assert ov["overlap_us"] == pytest.approx(3.0, abs=1e-9)
    assert ov["w13_last_exit_us"] == pytest.approx((end13 - t0) / 1e3, abs=1e-9)
    rows = tl.metric_lines("R=1", got)
    assert all(np.isfinite(v) for _, v, _ in rows) and len(rows) == 2 * (len(tl.PHASES) + 1) + 3


def test_parse_rejects_a_short_buffer():
    with pytest.raises(ValueError, match="w2: 256 bytes of stamps, need 3 records"):
        tl.Records.parse("w2", np.zeros(256, np.uint8), 3)


def test_spread_of_nothing_is_nan():
    s = tl.spread([np.nan, np.nan])
    assert s["n"] == 0 and np.isnan(s["median"])


@pytest.mark.parametrize("config", ["tiny", "v41-flash"])
def test_timeline_specs_add_stamps_before_rows(config):
    """The timeline builds are the step's w13 / w2 kernels with `stamps` before rows, under
    their own names; the production specs are untouched."""
    shape = mk.moe_shape(ModelConfig.preset(config), 4)
    specs = mk.timeline_specs(shape)
    every = {(s.kind, s.variant): s for s in mk.variant_specs(shape)
             + mk.warp_routed_specs(shape) + mk.selfrouted_specs(shape)}
    assert [(s.kind, s.variant) for s in specs] == [
        key for key in mk.TIMELINE_KERNELS if key in every]
    for spec in specs:
        base = every[(spec.kind, spec.variant)]
        assert spec.name == base.name + "_tl" and spec.timeline and not base.timeline
        assert spec.params == (*base.params[:-1], ("stamps", "u64"), base.params[-1])
        assert (spec.block, spec.smem_bytes, spec.ctas_per_sm) == (
            base.block, base.smem_bytes, base.ctas_per_sm)
        assert spec.to_dict()["timeline"] is True and "timeline" not in base.to_dict()
        assert spec.grid(1)[0] * mk.TIMELINE_RECORD_BYTES <= 132 * 4 * mk.TIMELINE_RECORD_BYTES


@pytest.mark.parametrize("rows", [1, 2, 6])
def test_timeline_launches_swap_in_the_stamped_w13_and_w2(tiny_bundle_dir, rows):
    """The step's chain with its w13 / w2 replaced by their timeline builds: the same kernels
    around them, each stamped kernel's stamps address right before rows, the grid of the kernel
    it replaces."""
    from executor.hostmem import ManifestBundle
    from executor.launches import moe as ml

    bundle = ManifestBundle(tiny_bundle_dir)
    shape = ml.shape_from_bundle(bundle)
    ptrs = {key: 4096 * (i + 1) for i, key in enumerate(
        sorted({k for keys in ml.POINTER_KEYS.values() for k in keys}))}
    stamps = (1 << 40, 1 << 41)
    got = ml.timeline_launches(bundle, shape, ptrs, rows, stamps)
    if rows >= ml.SELFROUTED_FROM_ROWS:
        plain = ml.selfrouted_launches(bundle, shape, ptrs, rows, ml.STEP_SELFROUTED_W13,
                                       ml.SELFROUTED_EARLY)
    else:
        plain = ml.bulk_launches(bundle, shape, ptrs, rows, None, "bulk", ml.BULK_W13W)
    assert [s.kernel.name for s in got] == [
        s.kernel.name + ("_tl" if i in (1, 2) else "") for i, s in enumerate(plain)]
    for i, (g, p) in enumerate(zip(got, plain)):
        assert g.grid == p.grid
        if i in (1, 2):
            assert g.args == (*p.args[:-1], stamps[i - 1], rows)
        else:
            assert g.args == p.args
