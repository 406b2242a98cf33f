"""Shared by the dense GPU tests (test_dense, test_dense_tile_epilogues): one weight shape's
random weights, inputs and float64 products on host and device, a launch with the output
NaN-poisoned, and the check of every element against dense_ref.epilogue_expectation's bound
(tolerances: tests/gpu/test_dense.py's docstring)."""
from __future__ import annotations

import numpy as np
import pytest

from executor.runtime import Arena, LaunchSpec
from kernels import dense_ref as dr
from kernels.common_ref import BF16
from loader.formats import fp8_block_dequantize

cp = pytest.importorskip("cupy")


def records(bundle, family: str):
    """The bundle's manifest records of one kernel family."""
    return [bundle.manifest.kernels[n] for n in bundle.names()
            if bundle.manifest.kernels[n].family == family]


def dense_spec_of(rec) -> dr.DenseSpec:
    """The DenseSpec of a manifest record, checked to round-trip."""
    s = rec.spec
    spec = dr.DenseSpec.from_dict(s)
    assert spec.to_dict() == s, f"{rec.name}: manifest spec differs from DenseSpec"
    return spec


def nan_bits(dtype: str) -> int:
    return 0x7FC0 if dtype == "bf16" else 0x7FC00000


class DenseCase:
    """One shape's weights on host and device, float64 products for 192 rows (sliced per R)."""

    def __init__(self, dev, specs: list[dr.DenseSpec], rng):
        spec = specs[0]
        g, n, k = spec.groups, spec.n, spec.k
        self.w = dr.random_e4m3(rng, (g, n, k))
        self.s = rng.integers(112, 125, size=(g, n // 32, k // 32)).astype(np.uint8)
        self.x = rng.standard_normal((dr.MAX_ROWS, g * k)).astype(BF16)
        self.res = rng.standard_normal((dr.MAX_ROWS, g * n)).astype(BF16)
        self.res_f32 = rng.standard_normal((dr.MAX_ROWS, g * n)).astype(np.float32)
        self.exact, self.acc_bound = self._products(self.w)
        self.swiglu_products = None         # the same bytes read as interleave_gate_up'd rows
        ws = max([s.workspace_bytes() for s in specs] + [4])
        cnt = max([s.counters_bytes() for s in specs] + [4])
        self.arena = Arena(dev, [("x", self.x.nbytes), ("w", self.w.nbytes), ("s", self.s.nbytes),
                                 ("res", self.res.nbytes), ("resf", self.res_f32.nbytes),
                                 ("out", dr.MAX_ROWS * g * n * 4), ("ws", ws), ("cnt", cnt)])
        for name, host in (("x", self.x), ("w", self.w), ("s", self.s), ("res", self.res),
                           ("resf", self.res_f32)):
            self.arena.view(name, np.uint8)[:host.nbytes] = cp.asarray(host.view(np.uint8).ravel())
        self.arena.view("cnt", np.uint32)[:] = 0
        cp.cuda.Device().synchronize()

    def _products(self, w):
        """float64 x·Wᵀ and the fp32 summation bound 2*(K-1)*2^-24*sum|x*w|, [192, G*N]."""
        g, n, k = w.shape
        xf = self.x.astype(np.float64)
        exact, acc_bound = np.empty((dr.MAX_ROWS, g * n)), np.empty((dr.MAX_ROWS, g * n))
        for gi in range(g):
            wf = fp8_block_dequantize(w[gi], self.s[gi]).astype(np.float64)
            xg = xf[:, gi * k:(gi + 1) * k]
            exact[:, gi * n:(gi + 1) * n] = xg @ wf.T
            acc_bound[:, gi * n:(gi + 1) * n] = (2.0 * (k - 1) * 2.0**-24
                                                 * (np.abs(xg) @ np.abs(wf).T))
        return exact, acc_bound

    def run(self, bundle, spec: dr.DenseSpec, rows: int, stream,
            in_place: bool = False) -> np.ndarray:
        """One launch; out poisoned with NaN first. in_place (epilogue "residual"): out holds the
        residual instead and the kernel reads it from `out` itself (launches/dense.py allows
        residual == out)."""
        out_t = np.uint16 if spec.out_dtype == "bf16" else np.uint32
        out = self.arena.view("out", out_t, (dr.MAX_ROWS, spec.out_width))
        a = self.arena
        if in_place:
            assert spec.epilogue == "residual", f"{spec.name}: in place needs a bf16 residual"
            out[:] = cp.asarray(self.res.view(np.uint16))
            res_ptr = a.ptr("out")
        else:
            out[:] = nan_bits(spec.out_dtype)
            res_ptr = a.ptr("resf" if spec.epilogue == "add_f32" else "res")
        cp.cuda.Device().synchronize()
        LaunchSpec(bundle.kernel(spec.name), spec.grid(rows),
                   (a.ptr("x"), a.ptr("w"), a.ptr("s"), res_ptr, a.ptr("out"),
                    a.ptr("ws"), a.ptr("cnt"), rows)).launch(stream)
        stream.synchronize()
        return cp.asnumpy(out)

    def check(self, spec: dr.DenseSpec, rows: int, raw: np.ndarray,
              in_place: bool = False) -> None:
        """Every element of rows < R within the bound, rows >= R as `run` left them."""
        past = self.res.view(np.uint16)[rows:] if in_place else nan_bits(spec.out_dtype)
        assert np.all(raw[rows:] == past), f"{spec.name}: wrote past row {rows}"
        got = raw[:rows].view(BF16 if spec.out_dtype == "bf16" else np.float32)
        got = got.astype(np.float64)
        exact, acc = self.exact, self.acc_bound
        if spec.epilogue == "swiglu":
            if self.swiglu_products is None:
                self.swiglu_products = self._products(dr.deinterleave_gate_up(self.w))
            exact, acc = self.swiglu_products
        res = self.res_f32 if spec.epilogue == "add_f32" else self.res
        exact, bound = dr.epilogue_expectation(spec, exact[:rows], acc[:rows], res[:rows])
        assert np.isfinite(got).all(), f"{spec.name} R={rows}: NaN left in the output"
        bad = np.argwhere(np.abs(got - exact) > bound)
        assert bad.size == 0, (f"{spec.name} R={rows}: {len(bad)} elements out of bound, first "
                               f"{tuple(bad[0])}: got {got[tuple(bad[0])]}, exact "
                               f"{exact[tuple(bad[0])]}, bound {bound[tuple(bad[0])]}")

    def close(self):
        self.arena.close()
