"""GPU: w13sr "bulkf" alone (kernels/moe_polled.py): after xquant, with nothing polling, its h is
bitwise w13sr "bulk"'s and it counts exactly tiles13 items for every listed expert (none for the
others, no consumed count, no timeout status). Own module: a fault here names this kernel."""
from __future__ import annotations

import moe_polled_cases
import numpy as np
import pytest
from moe_polled_cases import ROWS

pytestmark = pytest.mark.gpu
cases = moe_polled_cases.cases           # the shared module-scoped fixture
pytest.importorskip("cupy")


@pytest.mark.parametrize("rows", ROWS)
def test_signalling_w13_alone_counts_every_listed_expert(cases, stream, rows):
    for case in cases:
        what = f"{case.shape.tag()} R={rows}"
        ids = case.upload(rows, seed=rows)
        xquant, w13, _, _ = case.plain(rows)
        case.run([xquant, w13], stream)
        want_h = case.h(rows)
        case.chain.zero_flags()
        case.run([xquant, case.polled(rows)[1]], stream)
        np.testing.assert_array_equal(case.h(rows), want_h, err_msg=f"bulkf h, {what}")
        status, produced, consumed = case.counts()
        listed = np.zeros(case.shape.num_experts, bool)
        listed[np.unique(ids)] = True
        assert status == 0 and not consumed.any(), what
        np.testing.assert_array_equal(produced[listed], case.shape.tiles13, err_msg=what)
        assert not produced[~listed].any(), f"{what}: unlisted experts counted"
        case.chain.zero_flags()
