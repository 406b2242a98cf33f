"""GPU test of the BF16-weight linear (kernels/linear_bf16.py) against `linear_bf16_ref`.

Every element within `linear_tolerance` (fp32 sums in the kernel's order vs the exact sum rounded
to fp32, then both rounded to bf16: the bound's derivation is in its docstring); rows past `rows`
keep their poison. Bundles: HOPDEC_BUNDLE (tiny) and HOPDEC_BUNDLE_V41 (v41-flash widths); a
missing bundle skips with the reason. Written while no GPU was available: not yet run on one.
"""
from __future__ import annotations

import numpy as np
import pytest

from executor.launches.linear_bf16 import linear_bf16_launch
from executor.runtime import Arena
from kernels import linear_bf16_ref as lr
from kernels.common_ref import BF16, to_bf16

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

ROWS = (1, 5, 6, 8, 9, 17, 48, 192)
RNG = np.random.default_rng()


def _put(arena, name, array):
    raw = np.ascontiguousarray(array).view(np.uint8).ravel()
    arena.view(name, np.uint8, (raw.size,))[...] = cp.asarray(raw)


def test_indexer_weights_linear_matches_the_reference(dev, stream, preset_bundle):
    cfg, bundle = preset_bundle
    spec = lr.indexer_weights_spec(cfg)
    n, k, max_rows = spec.n, spec.k, max(ROWS)
    with Arena(dev, [("x", 2 * max_rows * k), ("w", 2 * n * k),
                     ("out", 2 * (max_rows + 1) * n)]) as arena:
        w = to_bf16(RNG.standard_normal((n, k)) * 0.05)
        _put(arena, "w", w)
        ptrs = {name: arena.ptr(name) for name in ("x", "w", "out")}
        for rows in ROWS:
            x = to_bf16(RNG.standard_normal((rows, k)))
            _put(arena, "x", x)
            arena.view("out", np.uint8, (arena.nbytes("out"),))[...] = 0xFF
            cp.cuda.Device().synchronize()
            linear_bf16_launch(bundle, spec, ptrs, rows).launch(stream)
            stream.synchronize()
            got = cp.asnumpy(arena.view("out", np.uint8, (arena.nbytes("out"),))).view(
                np.uint16).reshape(max_rows + 1, n)
            assert (got[rows:] == 0xFFFF).all(), f"{spec.name} rows={rows}: wrote past rows"
            err = np.abs(got[:rows].view(BF16).astype(np.float64)
                         - lr.linear_bf16_ref(x, w).astype(np.float64))
            bound = lr.linear_tolerance(x, w)
            assert (err <= bound).all(), f"{spec.name} rows={rows}: {(err / bound).max()} x bound"
