"""GPU tests of the dense tile kernels with the f32 and residual epilogues (kernels/dense_tile.py).

Round 8 makes stream_xtu the step's wo_b kernel at R <= 8 (dense_ref.R8_VARIANT_ROUND8), so every
epilogue of wo_b's r8 kernel is now a tile kernel. The step launches the bf16 one (attn.wo_b, the
DSpark stages too; the bf16 and swiglu tile kernels passed test_dense in run r7a2); the f32 and
residual ones are built but had never run on the GPU. They run here first, in a module of their
own so that a fault names them, then in test_dense with every bundle kernel.

Each preset's bundle (tiny; v41-flash TP4: wo_b N 5120, K 2048) must hold the step's wo_b r8
kernels as tile kernels (a bundle built before the switch fails here instead of testing
stream_xtb). Every tile kernel with the f32 or residual epilogue runs at R in {1, 5, 6, 8} (the
model doc's test shapes up to the r8 kernel's 8 rows): fresh random inputs, the output poisoned
with NaN, every element within dense_ref.epilogue_expectation's bound of the float64 product
(tolerances as tests/gpu/test_dense.py), rows past R untouched, a second launch bitwise equal.
The residual kernels also run in place (residual == out, which launches/dense.py allows).
"""
from __future__ import annotations

import numpy as np
import pytest
from dense_cases import DenseCase, dense_spec_of, records

from kernels import dense_ref as dr

pytestmark = pytest.mark.gpu

ROWS = (1, 5, 6, 8)
EPILOGUES = ("f32", "residual")


def _tile_specs(cfg, bundle) -> list[dr.DenseSpec]:
    """The bundle's tile kernels with an EPILOGUES epilogue, after checking that the step's wo_b
    r8 kernels are among them exactly as dense_ref builds them now."""
    n, k, _ = dr.dense_shapes(cfg, 4)["wo_b"]
    for epilogue in EPILOGUES:
        want = dr.make_spec("wo_b", n, k, epilogue=epilogue)
        assert want.variant in dr.TILE_VARIANTS, f"{want.name}: the step's wo_b is {want.variant}"
        assert want.name in bundle.names(), f"{want.name} missing from the bundle"
        got = dense_spec_of(bundle.manifest.kernels[want.name])
        assert got == want, f"{want.name}: the bundle's spec {got} (built before the switch?)"
    specs = [dense_spec_of(r) for r in records(bundle, "kernels.dense")]
    return [s for s in specs if s.unrolled and s.epilogue in EPILOGUES]


def _by_shape(specs: list[dr.DenseSpec]) -> dict:
    out: dict = {}
    for spec in specs:
        out.setdefault((spec.groups, spec.n, spec.k), []).append(spec)
    return out


def test_tile_f32_and_residual_kernels_match_the_reference(preset_bundle, dev, stream):
    cfg, bundle = preset_bundle
    rng = np.random.default_rng()
    for specs in _by_shape(_tile_specs(cfg, bundle)).values():
        case = DenseCase(dev, specs, rng)
        try:
            for spec in specs:
                for rows in ROWS:
                    first = case.run(bundle, spec, rows, stream)
                    case.check(spec, rows, first)
                    again = case.run(bundle, spec, rows, stream)
                    assert np.array_equal(first, again), f"{spec.name} R={rows}: not bit-stable"
        finally:
            case.close()


def test_tile_residual_kernels_in_place(preset_bundle, dev, stream):
    """residual == out: each element's residual is read before its output overwrites it."""
    cfg, bundle = preset_bundle
    rng = np.random.default_rng()
    specs = [s for s in _tile_specs(cfg, bundle) if s.epilogue == "residual"]
    for group in _by_shape(specs).values():
        case = DenseCase(dev, group, rng)
        try:
            for spec in group:
                for rows in ROWS:
                    case.check(spec, rows, case.run(bundle, spec, rows, stream, in_place=True),
                               in_place=True)
        finally:
            case.close()
