"""executor.hostmem + executor.emulate: fake addresses, bounds, and one emulated launch list."""
import numpy as np
import pytest

from executor.emulate import NoEmulator, emulate_launch, run
from executor.hostmem import AddressSpace, HostArena, ManifestBundle, OutOfBounds
from executor.launch import LaunchSpec
from kernels.common_ref import BF16
from kernels.norm_ref import rmsnorm_ref


def test_address_space_resolves_and_bounds_every_access():
    space = AddressSpace()
    a = HostArena(space, [("x", 1000), ("y", 64)], name="a")
    b = HostArena(space, [("z", 256)], name="b")
    assert a.base != b.base and a.base > 0 and a.ptr("y") % 256 == 0
    a.upload("x", np.arange(250, dtype=np.float32))
    assert np.array_equal(space.array(a.ptr("x") + 8, np.float32, 3), [2, 3, 4])
    assert space.name_of(b.ptr("z") + 4) == "b+4"
    with pytest.raises(OutOfBounds, match="region 'b'"):
        space.bytes(b.ptr("z"), b.total_bytes + 1)
    with pytest.raises(OutOfBounds, match="no region"):
        space.bytes(12345, 4)
    with pytest.raises(ValueError, match="aligned"):
        space.array(a.ptr("x") + 2, np.float32, 1)


def test_emulated_rmsnorm_launch_equals_the_reference(tiny_bundle_dir):
    bundle = ManifestBundle(tiny_bundle_dir)
    rec = next(bundle.kernel(n) for n in bundle.names() if n.startswith("rmsnorm_bf16_d256_wbf16"))
    rng = np.random.default_rng()
    rows, width = 5, rec.spec["width"]
    space = AddressSpace()
    arena = HostArena(space, [("x", rows * width * 2), ("w", width * 2), ("y", rows * width * 2)])
    x = rng.standard_normal((rows, width)).astype(BF16)
    w = rng.standard_normal(width).astype(BF16)
    arena.upload("x", x)
    arena.upload("w", w)
    arena.fill("y", 0xFF)
    spec = LaunchSpec(rec, (1,), (arena.ptr("x"), arena.ptr("w"), arena.ptr("y"), rows, 1e-6))
    assert run([spec], space) == 1
    got = arena.download("y", np.uint16, (rows, width))
    assert np.array_equal(got, rmsnorm_ref(x, w, 1e-6).view(np.uint16))


def test_a_family_without_emulator_says_so(tiny_bundle_dir):
    bundle = ManifestBundle(tiny_bundle_dir)
    probe = next(bundle.kernel(n) for n in bundle.names() if n.startswith("probe_"))
    space = AddressSpace()
    arena = HostArena(space, [("buf", 4096)])
    args = [arena.ptr("buf") if t == "u64" else 1 for _, t in probe.params]
    with pytest.raises(NoEmulator, match="kernels.probes"):
        emulate_launch(LaunchSpec(probe, (1,), args), space)
