"""GPU tests of the QGMMA W8A16 candidate (kernels/dense_qgmma.py; family kernels.dense_qgmma).

Every `_sqg` kernel of each preset's bundle (tiny: wq_a|wkv 768x256 and wq_b 2048x256, both split
in 2 K slices, wo_b 256x256 whole; v41-flash TP4: wq_a|wkv 1792x5120 in 4 slices, wq_b 8192x1280
whole, wo_b 5120x2048 whole at one CTA per SM, 166 KB of smem: WHOLE_K_LABELS) at R in
{1, 5, 6, 8}, two fresh draws each: x with wide-range rows (dense_qgmma_ref.random_wide_rows: a
row with one 3e4 element, one spread over 2^-40..2^20, one of ~2^-100 values, one all zero, one
of ~2^100 values) and
plain normal x; weights uniform over every finite E4M3 code (subnormals included), scale bytes
112..124. The output is NaN-poisoned before each launch; every element of rows < R must be within
dense_qgmma_ref.qgmma_tolerance of dense_qgmma_ref.dense_qgmma_ref (the exact product of the
kernel's hi + lo split of x: the split itself is tested on the CPU, tests/test_dense_qgmma_cpu.py),
rows >= R untouched; a second launch is bitwise equal and the split-K counters are back at zero.

Tolerance: 2^-11 sum_k |W_nk| |x~_k| (the tensor core's reduced-precision FP8 accumulation,
~2^-13 per k32 step, with a factor 2 of margin) + the fp32 folds + half a bf16 ulp of the output
(module docstring of dense_qgmma_ref; a dropped k-step, a wrong block scale, swapped rows or
tokens and a dropped lo part all exceed it on the CPU model).
"""
from __future__ import annotations

import numpy as np
import pytest

from executor.runtime import Arena, LaunchSpec
from kernels import dense_qgmma_ref as qr
from kernels.common_ref import BF16
from kernels.dense_ref import random_e4m3
from loader.formats import fp8_block_dequantize

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

ROWS = (1, 5, 6, 8)
NAN_BF16 = 0x7FC0


def _specs(bundle) -> list[qr.QgSpec]:
    out = []
    for name in bundle.names():
        rec = bundle.manifest.kernels[name]
        if rec.family == "kernels.dense_qgmma":
            spec = qr.QgSpec.from_dict(rec.spec)
            assert spec.to_dict() == rec.spec, f"{name}: manifest spec differs from QgSpec"
            out.append(spec)
    return out


class QgCase:
    """One spec's weights and buffers; x redrawn per `draw`."""

    def __init__(self, dev, spec: qr.QgSpec, rng):
        self.spec, self.rng = spec, rng
        self.w = random_e4m3(rng, (spec.n, spec.k))
        self.s = rng.integers(112, 125, size=(spec.n // 32, spec.k // 32)).astype(np.uint8)
        self.wf = fp8_block_dequantize(self.w, self.s).astype(np.float64)
        self.arena = Arena(dev, [("x", 8 * spec.k * 2), ("w", self.w.nbytes),
                                 ("s", self.s.nbytes), ("out", 8 * spec.n * 2),
                                 ("ws", max(spec.workspace_bytes(), 16)),
                                 ("cnt", max(spec.counters_bytes(), 16))])
        for name, host in (("w", self.w), ("s", self.s)):     # slices may be padded
            self.arena.view(name, np.uint8)[:host.nbytes] = cp.asarray(host.view(np.uint8).ravel())
        self.arena.view("cnt", np.uint32)[:] = 0
        self.x = None

    def draw(self, wide: bool) -> None:
        k = self.spec.k
        self.x = (qr.random_wide_rows(self.rng, 8, k) if wide
                  else self.rng.standard_normal((8, k)).astype(np.float32).astype(BF16))
        self.arena.view("x", np.uint16)[:self.x.size] = cp.asarray(self.x.view(np.uint16).ravel())
        cp.cuda.Device().synchronize()

    def run(self, bundle, rows: int, stream) -> np.ndarray:
        out = self.arena.view("out", np.uint16, (8, self.spec.n))
        out[:] = NAN_BF16
        cp.cuda.Device().synchronize()
        a = self.arena
        LaunchSpec(bundle.kernel(self.spec.name), self.spec.grid(rows),
                   (a.ptr("x"), a.ptr("w"), a.ptr("s"), a.ptr("x"), a.ptr("out"),
                    a.ptr("ws"), a.ptr("cnt"), rows)).launch(stream)
        stream.synchronize()
        return cp.asnumpy(out)

    def check(self, rows: int, raw: np.ndarray) -> None:
        name = f"{self.spec.name} R={rows}"
        assert np.all(raw[rows:] == NAN_BF16), f"{name}: wrote past row {rows}"
        got = raw[:rows].view(BF16).astype(np.float64)
        assert np.isfinite(got).all(), f"{name}: NaN left in the output"
        want = qr.dense_qgmma_ref(self.spec, self.x[:rows], self.wf)
        bound = qr.qgmma_tolerance(self.spec, self.x[:rows], self.wf)
        bad = np.argwhere(np.abs(got - want) > bound)
        assert bad.size == 0, (f"{name}: {len(bad)} elements out of bound, first "
                               f"{tuple(bad[0])}: got {got[tuple(bad[0])]}, want "
                               f"{want[tuple(bad[0])]}, bound {bound[tuple(bad[0])]}")
        assert not cp.asnumpy(self.arena.view("cnt", np.uint32)).any(), \
            f"{name}: split-K counters left non-zero"

    def close(self):
        self.arena.close()


def test_qgmma_kernels_match_the_reference(preset_bundle, dev, stream):
    _, bundle = preset_bundle
    specs = _specs(bundle)
    assert specs, "bundle has no kernels.dense_qgmma kernels"
    rng = np.random.default_rng()
    for spec in specs:
        case = QgCase(dev, spec, rng)
        try:
            for wide in (True, False):
                case.draw(wide)
                for rows in ROWS:
                    first = case.run(bundle, rows, stream)
                    case.check(rows, first)
                    again = case.run(bundle, rows, stream)
                    assert np.array_equal(first, again), f"{spec.name} R={rows}: not bit-stable"
        finally:
            case.close()
