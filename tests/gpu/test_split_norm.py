"""GPU test of the split RMSNorm (kernels/split_norm.py) against its NumPy reference, bitwise.

Bundles: HOPDEC_BUNDLE (tiny: q_lora 256 | kv 512) and HOPDEC_BUNDLE_V41 (v41-flash: 1280 | 512);
a missing bundle skips its cases. Fresh inputs per case (a random scale, one all-zero row), both
outputs and the rows past `rows` poisoned with 0xFF (NaN), every element compared:
- out bitwise `norm_ref.rmsnorm_ref` of the strided head: the kernel is RmsNormSm90 of width W
  with only its load addresses changed, so the reference's replay of its summation order and
  IEEE-rounded div/sqrt/rcp/mul holds as for kernels.norm (tests/gpu/test_norm_rope.py);
- tail bitwise the input's tail (a copy);
- the poisoned rows >= `rows` of both outputs untouched.
Row counts include two full grid-stride passes plus a ragged tail (every thread group runs the
software pipeline: next row's loads in flight while the current row's tail is copied and its head
stored).
"""
from __future__ import annotations

import numpy as np
import pytest

from executor.launches.split_norm import split_norm_launch
from executor.runtime import Arena
from kernels import common_ref as cr
from kernels import norm_ref as nr
from kernels import split_norm_ref as sr

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

RNG = np.random.default_rng()


def test_split_norm_matches_reference_bitwise(dev, stream, preset_bundle):
    cfg, bundle = preset_bundle
    (spec,) = sr.specs_for(cfg)
    w_, t_ = spec.width, spec.tail
    for rows in (1, 6, 13, 48, 192, 2 * spec.max_ctas * spec.rows_per_cta + 3):
        cap = rows + 3
        x = cr.to_bf16(RNG.standard_normal((cap, w_ + t_)) * RNG.uniform(0.01, 50))
        x[RNG.integers(0, rows)] = 0
        w = RNG.uniform(-2, 2, w_).astype(np.float32)
        with Arena(dev, [("x", x.nbytes), ("weight", w.nbytes), ("out", cap * w_ * 2),
                         ("tail", cap * t_ * 2)]) as arena:
            arena.view("x", np.uint8, (x.nbytes,))[...] = cp.asarray(x.view(np.uint8).ravel())
            arena.view("weight", np.uint8, (w.nbytes,))[...] = cp.asarray(
                w.view(np.uint8).ravel())
            for name in ("out", "tail"):
                arena.view(name, np.uint8, (arena.nbytes(name),))[...] = 0xFF
            cp.cuda.Device().synchronize()
            ptrs = {n: arena.ptr(n) for n in ("x", "weight", "out", "tail")}
            split_norm_launch(bundle, spec, ptrs, rows, cfg.rms_norm_eps).launch(stream)
            stream.synchronize()
            out = cp.asnumpy(arena.view("out", np.uint16, (cap, w_)))
            tail = cp.asnumpy(arena.view("tail", np.uint16, (cap, t_)))
        want = nr.rmsnorm_ref(np.ascontiguousarray(x[:rows, :w_]), w, cfg.rms_norm_eps)
        bad = np.argwhere(out[:rows] != want.view(np.uint16))
        assert not len(bad), f"{spec.name} rows={rows}: {len(bad)} head mismatches, first {bad[0]}"
        assert np.array_equal(tail[:rows], x[:rows, w_:].view(np.uint16)), f"rows={rows}: tail"
        assert (out[rows:] == 0xFFFF).all() and (tail[rows:] == 0xFFFF).all(), (
            f"{spec.name} rows={rows}: wrote past its rows")
