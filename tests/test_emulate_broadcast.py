"""The stream broadcast (kernels/elementwise.py): spec rules, reference and CPU emulator.

A copy, so every check is bitwise: out[r, s] == x[r] for r < rows and every stream s, rows past
`rows` keep their 0xFF poison; the emulator refuses an out that overlaps x and a wrong grid.
"""
import numpy as np
import pytest

from executor.emulate import run
from executor.hostmem import AddressSpace, HostArena, ManifestBundle
from executor.launch import LaunchSpec
from kernels import elementwise_ref as er
from kernels.common_ref import BF16
from loader.config import ModelConfig

BUCKET = 192


def test_spec_name_grid_bytes_and_bad_shapes():
    spec = er.make_broadcast_spec(5120, 4)
    assert spec.name == "broadcast_streams_bf16_d5120_s4"
    assert spec.grid(1) == (3, 1, 1)                  # 640 chunks of 8 over 256-thread CTAs
    assert spec.grid(192)[0] == min(-(-192 * 640 // 256), spec.max_ctas)
    assert spec.bytes_moved(3) == 3 * 5120 * 2 * 5
    for width, streams in ((100, 4), (0, 4), (256, 0)):
        with pytest.raises(ValueError):
            er.make_broadcast_spec(width, streams)
    with pytest.raises(TypeError, match="bf16"):
        er.broadcast_ref(np.zeros((2, 8), np.float32), 4)


def test_the_family_builds_it_at_the_hidden_width():
    from kernels import elementwise
    cfg = ModelConfig.preset("v41-flash")
    names = [s.name for s in elementwise.specs(cfg, 4)]
    assert f"broadcast_streams_bf16_d{cfg.hidden_size}_s{cfg.hc_mult}" in names


@pytest.mark.parametrize("rows", (1, 6, 37, BUCKET))
def test_emulated_launch_copies_every_row_into_every_stream(tiny_bundle_dir, rows):
    bundle = ManifestBundle(tiny_bundle_dir)
    cfg = ModelConfig.preset("tiny")
    spec = er.make_broadcast_spec(cfg.hidden_size, cfg.hc_mult)
    kernel = bundle.kernel(spec.name)
    space = AddressSpace()
    d, s = spec.width, spec.streams
    arena = HostArena(space, [("x", 2 * BUCKET * d), ("out", 2 * BUCKET * s * d)])
    x = np.random.default_rng().standard_normal((BUCKET, d)).astype(BF16)
    arena.upload("x", x)
    arena.fill("out", 0xFF)
    launch = LaunchSpec(kernel, spec.grid(rows), (arena.ptr("x"), arena.ptr("out"), rows))
    assert run([launch], space) == 1
    out = arena.download("out", np.uint16, (BUCKET, s, d))
    assert np.array_equal(out[:rows], er.broadcast_ref(x[:rows], s).view(np.uint16))
    assert (out[rows:] == 0xFFFF).all()
    with pytest.raises(ValueError, match="grid"):
        run([LaunchSpec(kernel, (1, 1, 1), (arena.ptr("x"), arena.ptr("out"), BUCKET))], space)
    with pytest.raises(ValueError, match="overlaps"):
        run([LaunchSpec(kernel, spec.grid(rows), (arena.ptr("x"), arena.ptr("x"), rows))], space)
