"""GPU: the polled pair (xquant, w13sr "bulkf", w2sr "earlyp", combine; kernels/moe_polled.py)
launched as one PDL chain, twice in a row: h and y bitwise the plain self-routed chain's (same
items and arithmetic; only when w2 may start moved), no poll timed out (flags[0]) and every
counter zero after each launch (else the second launch's polls would time out); then its
timeline builds: the same y, the counters zero. Own module (after test_moe_polled_w13 / _w2, which
run each kernel alone): a fault here is the concurrent handoff's."""
from __future__ import annotations

import moe_polled_cases
import numpy as np
import pytest
from moe_polled_cases import ROWS

from executor.launches import moe as ml
from kernels import moe_kernel_ref as mk

pytestmark = pytest.mark.gpu
cases = moe_polled_cases.cases           # the shared module-scoped fixture
cp = pytest.importorskip("cupy")


@pytest.mark.parametrize("rows", ROWS)
def test_polled_pair_matches_the_plain_chain_twice(cases, stream, rows):
    for case in cases:
        case.upload(rows, seed=200 + rows)
        case.run(case.plain(rows), stream)
        want_h, want_y = case.h(rows), case.y(rows)
        case.chain.zero_flags()
        for launch in range(2):
            what = f"{case.shape.tag()} R={rows} launch {launch}"
            case.run(case.polled(rows), stream)
            status, produced, consumed = case.counts()
            assert status == 0, f"{what}: a w2 poll timed out"
            assert not produced.any() and not consumed.any(), f"{what}: counters left"
            np.testing.assert_array_equal(case.h(rows), want_h, err_msg=f"h, {what}")
            np.testing.assert_array_equal(case.y(rows), want_y, err_msg=f"y, {what}")


@pytest.mark.parametrize("rows", [6, 12])
def test_polled_timeline_builds_match(cases, stream, rows):
    """The pair's timeline builds (flags, then stamps): y bitwise the pair's, counters zero,
    every CTA's entry / exit stamped."""
    from executor import moe_timeline as tl
    for case in cases:
        case.upload(rows, seed=300 + rows)
        case.run(case.polled(rows), stream)
        want_y = case.y(rows)
        bufs = [cp.zeros(mk.H200_NUM_SMS * 4 * mk.TIMELINE_RECORD_BYTES, cp.uint8)
                for _ in range(2)]
        specs = ml.timeline_launches(case.chain.bundle, case.shape, case.chain.ptrs, rows,
                                     (bufs[0].data.ptr, bufs[1].data.ptr), polled=True)
        case.run(specs, stream)
        np.testing.assert_array_equal(case.y(rows), want_y, err_msg=f"{case.shape.tag()} R={rows}")
        assert not case.chain.flags().any(), f"{case.shape.tag()} R={rows}: counters left"
        for spec, buf in zip(specs[1:3], bufs):
            rec = tl.Records.parse(spec.kernel.name, cp.asnumpy(buf), spec.grid[0])
            for i in (0, 6):
                assert (rec.ns[:, i] > 0).all(), f"{spec.kernel.name}: {tl.EVENTS[i]} missing"
