"""GPU test of the stream broadcast (kernels/elementwise.py) against `broadcast_ref`: bitwise.

The kernel copies bytes (a 16-byte load, S 16-byte stores), so every element of every stream must
equal the input row exactly; rows past `rows` keep their NaN poison. Bundles: HOPDEC_BUNDLE (tiny)
and HOPDEC_BUNDLE_V41 (v41-flash widths); a missing bundle skips with the reason. Written while
no GPU was available: not yet run on one.
"""
from __future__ import annotations

import numpy as np
import pytest

from executor.runtime import Arena, LaunchSpec
from kernels import common_ref as cr
from kernels import elementwise_ref as er

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

ROWS = (1, 5, 6, 8, 17, 48, 192, 4099)       # 4099: more chunks than one wave of CTAs at D=5120
RNG = np.random.default_rng()


def test_broadcast_streams_copies_every_row_into_every_stream(dev, stream, preset_bundle):
    cfg, bundle = preset_bundle
    spec = er.make_broadcast_spec(cfg.hidden_size, cfg.hc_mult)
    max_rows = max(ROWS)
    out_rows = max_rows + 1                           # one row past the largest launch
    with Arena(dev, [("x", 2 * max_rows * spec.width),
                     ("out", 2 * out_rows * spec.streams * spec.width)]) as arena:
        for rows in ROWS:
            x = cr.to_bf16(RNG.standard_normal((rows, spec.width)) * 10)
            arena.view("x", np.uint8, (x.nbytes,))[...] = cp.asarray(x.view(np.uint8).ravel())
            arena.view("out", np.uint8, (arena.nbytes("out"),))[...] = 0xFF
            cp.cuda.Device().synchronize()
            LaunchSpec(bundle.kernel(spec.name), spec.grid(rows),
                       (arena.ptr("x"), arena.ptr("out"), rows), pdl=True).launch(stream)
            stream.synchronize()
            got = cp.asnumpy(arena.view("out", np.uint8, (arena.nbytes("out"),))).view(
                np.uint16).reshape(out_rows, spec.streams, spec.width)
            want = er.broadcast_ref(x, spec.streams).view(np.uint16)
            assert np.array_equal(got[:rows], want), f"{spec.name} rows={rows}"
            assert (got[rows:] == 0xFFFF).all(), f"{spec.name} rows={rows}: wrote past rows"
