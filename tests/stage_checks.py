"""Comparisons the emulated stage tests (tests/test_stages_*.py) share."""
from __future__ import annotations

import numpy as np


def within_bound(got, want, bound, what: str) -> float:
    """Every |got - want| <= bound, element by element (NaN fails); names the first element off.
    Returns the largest error, for the tests' error tables."""
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    bad = ~(err <= bound)                           # NaN fails
    if bad.any():
        i = tuple(int(v) for v in np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {int(bad.sum())} elements off, first at {i}: got "
                             f"{got[i]}, want {want[i]}, bound {bound[i]:.3g}")
    return float(err.max(initial=0.0))
