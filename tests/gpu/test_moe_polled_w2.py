"""GPU: w2sr "earlyp" alone (kernels/moe_polled.py): after a completed xquant + w13sr "bulk" (the
stream synchronised) with produced[e] = tiles13 set by the host for every listed expert, so its
polls pass at once: y bitwise the plain self-routed chain's, every counter zero after it (its last
item of an expert zeroes them), no timeout status. Own module: a fault here names this kernel."""
from __future__ import annotations

import moe_polled_cases
import numpy as np
import pytest
from moe_polled_cases import ROWS

pytestmark = pytest.mark.gpu
cases = moe_polled_cases.cases           # the shared module-scoped fixture
pytest.importorskip("cupy")


@pytest.mark.parametrize("rows", ROWS)
def test_polling_w2_alone_matches_and_zeroes_the_counts(cases, stream, rows):
    for case in cases:
        what = f"{case.shape.tag()} R={rows}"
        ids = case.upload(rows, seed=100 + rows)
        plain = case.plain(rows)
        case.run(plain, stream)
        want_y = case.y(rows)
        case.chain.zero_flags()
        case.run(plain[:2], stream)                     # xquant, w13sr bulk: h complete
        case.set_produced(np.unique(ids), case.shape.tiles13)
        _, _, w2, combine = case.polled(rows)
        for spec in (w2, combine):                      # h is kept: no poison here
            spec.launch(stream)
        stream.synchronize()
        np.testing.assert_array_equal(case.y(rows), want_y, err_msg=f"earlyp y, {what}")
        status, produced, consumed = case.counts()
        assert status == 0, f"{what}: a poll timed out"
        assert not produced.any() and not consumed.any(), f"{what}: counters left"
