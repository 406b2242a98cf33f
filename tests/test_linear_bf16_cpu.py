"""kernels.linear_bf16 on the CPU: spec rules, the reference against float64, the emulated launch
(the kernel itself is tested on the GPU in tests/gpu/test_linear_bf16.py)."""
import numpy as np
import pytest

from executor.emulate import emulate_launch
from executor.hostmem import AddressSpace, HostArena, ManifestBundle
from executor.launches.linear_bf16 import linear_bf16_launch, linear_bf16_requests
from kernels import linear_bf16_ref as lr
from kernels.common_ref import to_bf16


def test_spec_rules():
    spec = lr.make_spec(32, 5120)
    assert spec.name == "linear_bf16_n32_k5120"
    assert spec.grid(1) == (8, 1, 1) and spec.grid(192) == (8, 24, 1)
    for n, k in ((6, 256), (4, 200), (0, 256)):
        with pytest.raises(ValueError, match="multiple"):
            lr.make_spec(n, k)
    with pytest.raises(ValueError):
        spec.grid(0)


def test_reference_is_the_exact_sum_rounded_twice():
    rng = np.random.default_rng()
    x, w = to_bf16(rng.standard_normal((7, 512))), to_bf16(rng.standard_normal((8, 512)))
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    got = lr.linear_bf16_ref(x, w)
    assert np.array_equal(got.view(np.uint16), to_bf16(exact.astype(np.float32)).view(np.uint16))
    # the bound covers the reference's own distance to the exact sum (it holds any fp32 order)
    assert (np.abs(got.astype(np.float64) - exact) <= lr.linear_tolerance(x, w)).all()


def test_emulated_launch_writes_its_rows_only(tiny_bundle_dir):
    bundle = ManifestBundle(tiny_bundle_dir)
    spec = next(lr.spec_of(r.spec) for r in bundle.manifest.kernels.values()
                if r.family == "kernels.linear_bf16")
    rng = np.random.default_rng()
    arena = HostArena(AddressSpace(), linear_bf16_requests(spec, 16))
    ptrs = {name: arena.ptr(name) for name in ("x", "w", "out")}
    x, w = to_bf16(rng.standard_normal((16, spec.k))), to_bf16(rng.standard_normal((spec.n,
                                                                                    spec.k)))
    arena.upload("x", x)
    arena.upload("w", w)
    arena.upload("out", np.full((16, spec.n), 0xFFFF, np.uint16))
    emulate_launch(linear_bf16_launch(bundle, spec, ptrs, 11), arena.space)
    out = arena.download("out", np.uint16, (16, spec.n))
    assert np.array_equal(out[:11], lr.linear_bf16_ref(x[:11], w).view(np.uint16))
    assert (out[11:] == 0xFFFF).all()
    with pytest.raises(KeyError, match="out"):
        linear_bf16_launch(bundle, spec, {"x": 0, "w": 0}, 1)
