"""kernels.swiglu (CPU): spec rules, the reference against float64, a NumPy model of the kernel's
instructions against the reference, the emulator and launch builder on a HostArena from the tiny
bundle's manifest. The kernel itself is compiled (tests/test_build.py) but not GPU-run here.
"""
from __future__ import annotations

import numpy as np
import pytest

from executor.emulate import emulate_launch
from executor.hostmem import AddressSpace, HostArena, ManifestBundle
from executor.launches.swiglu import swiglu_launch, swiglu_requests
from kernels import swiglu_ref as sr
from kernels.common_ref import BF16
from loader.config import ModelConfig

LIMIT = 10.0
# Gates below -88.7 overflow exp in moe_ref's fp32 silu (-> -0, as the kernel's ex2 gives): meant.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _h13(rng, rows: int, inter: int) -> np.ndarray:
    """Gates and ups over the interesting ranges: around 0, near and past ±L, large negatives."""
    h = rng.normal(0.0, 4.0, (rows, 2 * inter))
    h[:, ::7] *= 8.0                                   # past the clamp both ways
    h[:, 1::11] = rng.uniform(-LIMIT - 1, LIMIT + 1, h[:, 1::11].shape)
    return h.astype(BF16)


def _kernel_model(h13: np.ndarray, limit: float) -> np.ndarray:
    """The kernel's instruction sequence in float32 (ex2.approx modelled by np.exp2, whose 2^-22
    relative difference is what swiglu_tolerance allows for): min, max/min clamp, mul.rn by
    -log2 e, ex2, add.rn 1, div.rn, mul.rn, cvt.rn to bf16."""
    inter = h13.shape[1] // 2
    g = np.minimum(h13[:, :inter].astype(np.float32), np.float32(limit))
    u = np.clip(h13[:, inter:].astype(np.float32), np.float32(-limit), np.float32(limit))
    neg_log2e = np.uint32(0xBFB8AA3B).view(np.float32)
    with np.errstate(over="ignore"):
        t = np.exp2(g * neg_log2e)
    return ((g / (t + np.float32(1.0))) * u).astype(BF16)


def test_spec_rules():
    spec = sr.make_spec(96, LIMIT)
    assert spec.name == "swiglu_bf16_i96_l10" and spec.chunks_per_row == 12
    assert spec.grid(1) == (1, 1, 1) and spec.grid(192) == (9, 1, 1)      # 192 * 12 / 256
    assert sr.make_spec(512, 7.5).name == "swiglu_bf16_i512_l7p5"
    assert [s.name for s in sr.specs_for(ModelConfig.preset("tiny"), 4)] == [spec.name]
    assert [s.name for s in sr.specs_for(ModelConfig.preset("v41-flash"), 4)] == [
        "swiglu_bf16_i576_l10"]
    with pytest.raises(ValueError, match="multiple of 8"):
        sr.make_spec(100, LIMIT)
    with pytest.raises(ValueError, match="limit"):
        sr.make_spec(96, 0.0)
    with pytest.raises(ValueError, match="rows"):
        spec.grid(0)
    assert spec.bytes_moved(3) == 3 * 96 * 6


def test_reference_is_bf16_of_the_exact_value():
    """float64 ground truth is within half a bf16 ulp plus one ulp of the fp32 reference (the fp32
    silu is a few fp32 ulps from exact, far below bf16's half ulp). Gates below -88.7 overflow
    exp in fp32 (reference and kernel alike), giving 0 where the exact |g| e^g L < 1e-35."""
    rng = np.random.default_rng()
    h13 = _h13(rng, 37, 96)
    got = sr.swiglu_ref(h13, LIMIT)
    g = np.minimum(h13[:, :96].astype(np.float64), LIMIT)
    u = np.clip(h13[:, 96:].astype(np.float64), -LIMIT, LIMIT)
    exact = g / (1.0 + np.exp(-g)) * u
    bound = sr.swiglu_tolerance(exact.astype(BF16)) + 2.0**-8 * np.abs(exact) + 1e-35
    assert (np.abs(got.astype(np.float64) - exact) <= bound).all()
    assert (np.abs(got.astype(np.float32)) <= LIMIT * LIMIT * 1.01).all()  # |silu(g)| <= |g|
    with pytest.raises(TypeError, match="bf16"):
        sr.swiglu_ref(h13.astype(np.float32), LIMIT)


def test_kernel_arithmetic_is_within_one_ulp_of_the_reference():
    rng = np.random.default_rng()
    h13 = _h13(rng, 192, 512)
    want = sr.swiglu_ref(h13, LIMIT)
    got = _kernel_model(h13, LIMIT)
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    assert (err <= sr.swiglu_tolerance(want)).all()


@pytest.fixture(scope="module")
def arena(tiny_bundle_dir):
    bundle = ManifestBundle(tiny_bundle_dir)
    spec = sr.specs_for(ModelConfig.preset("tiny"), 4)[0]
    space = AddressSpace()
    return bundle, spec, space, HostArena(space, swiglu_requests(spec, 192))


@pytest.mark.parametrize("rows", [1, 6, 13, 48, 192])
def test_emulated_launch_writes_the_reference_and_nothing_past_rows(arena, rows):
    bundle, spec, space, host = arena
    rng = np.random.default_rng()
    h13 = _h13(rng, rows, spec.inter)
    host.fill("h13", 0xFF)
    host.upload("h13", h13)
    host.fill("out", 0xFF)
    ptrs = {name: host.ptr(name) for name in ("h13", "out")}
    launch = swiglu_launch(bundle, spec, ptrs, rows)
    assert launch.grid == spec.grid(rows) and launch.pdl
    emulate_launch(launch, space)
    out = host.download("out", BF16, (192, spec.inter))
    np.testing.assert_array_equal(out[:rows].view(np.uint16),
                                  sr.swiglu_ref(h13, spec.limit).view(np.uint16))
    assert (out[rows:].view(np.uint16) == 0xFFFF).all()


def test_bad_pointers_and_overlap_raise(arena):
    bundle, spec, space, host = arena
    with pytest.raises(ValueError, match="missing"):
        swiglu_launch(bundle, spec, {"h13": host.ptr("h13")}, 4)
    with pytest.raises(ValueError, match="aligned"):
        swiglu_launch(bundle, spec, {"h13": host.ptr("h13") + 2, "out": host.ptr("out")}, 4)
    inside = {"h13": host.ptr("h13"), "out": host.ptr("h13") + 4 * spec.inter}   # h13 row 1
    with pytest.raises(ValueError, match="overlaps"):
        emulate_launch(swiglu_launch(bundle, spec, inside, 4), space)
