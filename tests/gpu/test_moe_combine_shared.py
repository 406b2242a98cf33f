"""GPU: moe_combine_<tag>_shared (round 8, the step's combine) bitwise against its NumPy reference.

The step runs the shared expert's w2 beside the routed chain (bf16 -> ffn.shared_out) and this
kernel adds it: out bf16 [R, D] = bf16_rn(y + f32(shared)), y the plain combine's fp32 sum over
slots in slot order (mk.combine_shared_reference). In a module of its own so that a fault names
it. Kernels come from the bundles (no kernels/moe.py import: the DSL is absent here).

Per preset bundle (tiny; v41-flash TP4) and R in {1, 2, 3, 5, 6, 8, 12, 16, 48, 96, 192}: fresh
random route weights, ye and shared (a third of the elements on or next to a bf16 rounding tie
of y + shared), the output NaN-poisoned over all 192 rows; every element of rows < R bitwise the
reference, rows >= R untouched, a second launch bitwise equal; and the plain moe_combine's y on
the same inputs, added in NumPy, gives the same bits (the step's old "add_f32" arithmetic).
"""
from __future__ import annotations

import numpy as np
import pytest

from executor.launches import moe as ml
from executor.runtime import Arena
from kernels import moe_kernel_ref as mk
from kernels.common_ref import BF16

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

ROWS = (1, 2, 3, 5, 6, 8, 12, 16, 48, 96, 192)
NAN_BF16 = 0x7FC0


def _inputs(rng, shape: mk.MoeShape, rows: int):
    """(route weights f32 [R, k], ye bf16 [R*k, D], shared bf16 [R, D]) with ties: where picked,
    y is slot 0's ye (weight 1, the other slots' ye 0) and shared (1, 3, 1 + 2^-7 or
    1 - 2^-8) x half an ulp of it."""
    k, d = shape.topk, shape.hidden
    w = (rng.random((rows, k)) * 0.5).astype(np.float32)
    w[:, 0] = 1.0
    ye = rng.standard_normal((rows * k, d)).astype(BF16)
    shared = (rng.standard_normal((rows, d)) * 0.3).astype(BF16)
    pick = rng.random((rows, d)) < 1 / 3
    grid = ye.reshape(rows, k, d)
    grid[:, 1:][np.broadcast_to(pick[:, None], (rows, k - 1, d))] = 0
    a = grid[:, 0].astype(np.float32)
    half = np.ldexp(np.float32(1), np.frexp(a)[1] - 9).astype(np.float32)
    factor = rng.choice(np.float32([1, 3, 1 + 2.0**-7, 1 - 2.0**-8]), (rows, d))
    sign = rng.choice(np.float32([-1, 1]), (rows, d))
    shared = np.where(pick & (a != 0), (sign * factor * half).astype(BF16), shared)
    return w, ye, shared


def _shapes(bundle) -> list[mk.MoeShape]:
    """Every MoE shape the bundle holds a shared combine of (the backbone's, the DSpark's)."""
    out = []
    for name in bundle.names():
        if name.startswith("moe_combine_") and name.endswith("_shared"):
            out.append(ml.shape_of(bundle.manifest.kernels[name].spec))
    return out


def test_combine_shared_matches_the_reference_bitwise(preset_bundle, dev, stream):
    cfg, bundle = preset_bundle
    shapes = _shapes(bundle)
    assert mk.moe_shape(cfg, 4) in shapes, "the step's shared combine is not in the bundle"
    seed = np.random.SeedSequence().entropy
    rng = np.random.default_rng(seed)
    for shape in shapes:
        k, d, top = shape.topk, shape.hidden, mk.MAX_ROWS
        arena = Arena(dev, [("w", 4 * top * k), ("ye", 2 * top * k * d), ("shared", 2 * top * d),
                            ("out", 2 * top * d), ("y", 4 * top * d)])
        ptrs = {"route_weights": arena.ptr("w"), "ye": arena.ptr("ye"),
                "shared": arena.ptr("shared"), "out": arena.ptr("out"), "y": arena.ptr("y")}
        try:
            for rows in ROWS:
                label = f"{shape.tag()} R={rows} seed={seed}"
                w, ye, shared = _inputs(rng, shape, rows)
                for name, host in (("w", w), ("ye", ye), ("shared", shared)):
                    arena.view(name, np.uint8)[:host.nbytes] = cp.asarray(
                        host.view(np.uint8).ravel())
                want = mk.combine_shared_reference(w, ye, shared).view(np.uint16)
                out = arena.view("out", np.uint16, (top, d))
                results = []
                for _ in range(2):
                    out[:] = NAN_BF16
                    cp.cuda.Device().synchronize()
                    ml.combine_launch(bundle, shape, ptrs, rows, shared=True).launch(stream)
                    stream.synchronize()
                    results.append(cp.asnumpy(out))
                got = results[0]
                assert (got[rows:] == NAN_BF16).all(), f"{label}: wrote past row {rows}"
                bad = np.argwhere(got[:rows] != want)
                assert bad.size == 0, (f"{label}: {len(bad)} elements differ, first "
                                       f"{tuple(bad[0])}: {got[tuple(bad[0])]:#06x} vs "
                                       f"{want[tuple(bad[0])]:#06x}")
                assert np.array_equal(results[0], results[1]), f"{label}: not bit-stable"
                # The plain combine's y + shared in NumPy: the old add_f32 arithmetic.
                arena.view("y", np.uint32)[:] = 0x7FC00000
                cp.cuda.Device().synchronize()
                ml.combine_launch(bundle, shape, ptrs, rows, shared=False).launch(stream)
                stream.synchronize()
                y = cp.asnumpy(arena.view("y", np.float32, (top, d)))[:rows]
                old = (y + shared.astype(np.float32)).astype(np.float32).astype(BF16)
                assert np.array_equal(old.view(np.uint16), got[:rows]), (
                    f"{label}: plain combine + add differs from the shared combine")
        finally:
            arena.close()
