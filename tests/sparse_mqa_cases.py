"""The output check of the sparse MQA kernel tests, shared by the GPU test
(tests/gpu/test_sparse_mqa.py) and its CPU emulator twin (tests/test_emulate_sparse_mqa.py).

Every element within `sparse_mqa_ref.error_bound` of the case's reference, no NaN, padding rows
zero, and at least 98% of the real rows' elements bit-equal to the reference (the GPU test's
docstring says why). References only: the device machine has no CuTe DSL.
"""
from __future__ import annotations

import numpy as np

from kernels import sparse_mqa_ref as ref


def check_output(case, got: np.ndarray) -> None:
    """`got`: the launch's output [rows, heads, dim], as bf16 or as its 16-bit words."""
    want = case.reference()
    got = got.view(want.dtype)
    real = case.info[:, 3] >= 0
    g32 = got.astype(np.float32)
    nan = np.argwhere(np.isnan(g32))
    assert nan.size == 0, f"NaN at (row, head, dim) {nan[0].tolist()} ({len(nan)} elements)"
    assert not g32[~real].any(), "a padding row was written with non-zero values"
    bound = ref.error_bound(case.q, case.gathered(), case.sink, case.info, case.table.inv_freq)
    diff = np.abs(g32.astype(np.float64) - want.astype(np.float64))
    bad = np.argwhere(diff > bound)
    if bad.size:
        i = tuple(bad[0])
        raise AssertionError(f"{len(bad)} elements beyond the bound; first {list(i)}: got "
                             f"{g32[i]}, want {float(want[i])}, bound {bound[i]:.3g}")
    same = (got.view(np.uint16) == want.view(np.uint16))[real].mean()
    assert same >= 0.98, f"only {same:.4f} of the elements equal the reference bit for bit"
