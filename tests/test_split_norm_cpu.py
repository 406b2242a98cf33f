"""kernels.split_norm without a GPU: the spec rules, and its launch emulated on host memory.

The emulated launch (executor/launches/split_norm.py -> executor/emulate/split_norm.py) on fresh
random bf16 rows of the tiny and V4.1 widths (q_lora 256 / 1280 | kv 512): the normed head
bitwise `norm_ref.rmsnorm_ref` of the strided head (the kernel replays its order: see
kernels/split_norm_ref.py), the tail bitwise the input's tail, nothing written at or past `rows`.
The kernel itself is compiled into the bundles but has not run on a GPU yet
(tests/gpu/test_split_norm.py is its GPU test).
"""
from __future__ import annotations

import numpy as np
import pytest
from spec_bundle import OneKernelBundle

from executor.emulate import run
from executor.hostmem import AddressSpace, HostArena
from executor.launch import LaunchSpec
from executor.launches.split_norm import split_norm_launch, split_norm_requests
from kernels import norm_ref
from kernels import split_norm_ref as sr
from kernels.common_ref import BF16

EPS = 1e-20


def _launch(spec, rows, max_rows, rng, scale=1.0):
    space = AddressSpace()
    arena = HostArena(space, split_norm_requests(spec, max_rows))
    x = (rng.standard_normal((max_rows, spec.row_stride)) * scale).astype(BF16)
    w = (rng.random(spec.width) * 2).astype(np.float32)
    arena.upload("x", x)
    arena.upload("weight", w)
    arena.fill("out", 0xFF)
    arena.fill("tail", 0xFF)
    ptrs = {n: arena.ptr(n) for n in ("x", "weight", "out", "tail")}
    bundle = OneKernelBundle(spec, "kernels.split_norm")
    run([split_norm_launch(bundle, spec, ptrs, rows, EPS)], space)
    out = arena.view("out", BF16, (max_rows, spec.width)).copy()
    tail = arena.view("tail", BF16, (max_rows, spec.tail)).copy()
    return x, w, out, tail, ptrs, space


@pytest.mark.parametrize("width", [256, 1280])
@pytest.mark.parametrize("rows", [1, 5, 13, 192])
def test_emulated_launch_norms_the_head_and_copies_the_tail(width, rows):
    spec = sr.make_spec(width, 512)
    rng = np.random.default_rng()
    x, w, out, tail, _, _ = _launch(spec, rows, 192, rng, scale=float(rng.uniform(0.01, 30)))
    want = norm_ref.rmsnorm_ref(np.ascontiguousarray(x[:rows, :width]), w, EPS)
    np.testing.assert_array_equal(out[:rows].view(np.uint16), want.view(np.uint16))
    np.testing.assert_array_equal(tail[:rows].view(np.uint16), x[:rows, width:].view(np.uint16))
    assert (out[rows:].view(np.uint16) == 0xFFFF).all() and (tail[rows:].view(np.uint16)
                                                               == 0xFFFF).all()
    # The bitwise reference is itself within a few fp32 ulps + one bf16 rounding of float64.
    exact = norm_ref.rmsnorm_f64(np.ascontiguousarray(x[:rows, :width]), w, EPS)
    err = np.abs(want.astype(np.float64) - exact)
    assert (err <= 2.0**-8 * np.abs(exact) + 2.0**-20 * np.abs(exact).max()).all()


def test_specs_of_the_configs_and_their_rules():
    from loader.config import ModelConfig

    for preset, width in (("tiny", 256), ("v41-flash", 1280)):
        (spec,) = sr.specs_for(ModelConfig.preset(preset))
        assert (spec.width, spec.tail, spec.threads_per_row) == (width, 512, 32)
        assert spec.tail_vecs_per_thread == 2 and spec.smem_bytes == 4 * width
    with pytest.raises(ValueError, match="a warp or less"):
        sr.make_spec(4096, 512)
    with pytest.raises(ValueError, match="tail 520"):
        sr.make_spec(256, 520)
    spec = sr.make_spec(256, 512)
    assert spec.grid(192) == (48, 1, 1) and spec.grid(1) == (1, 1, 1)
    with pytest.raises(ValueError):
        spec.grid(0)


def test_a_wrong_grid_or_an_output_over_x_is_refused():
    spec = sr.make_spec(256, 512)
    rng = np.random.default_rng()
    _, _, _, _, ptrs, space = _launch(spec, 4, 8, rng)
    bundle = OneKernelBundle(spec, "kernels.split_norm")
    bad_grid = LaunchSpec(bundle.record, (9, 1, 1), (ptrs["x"], ptrs["weight"], ptrs["out"],
                                                     ptrs["tail"], 4, EPS))
    with pytest.raises(ValueError, match="grid"):
        run([bad_grid], space)
    over = dict(ptrs, tail=ptrs["x"])
    with pytest.raises(ValueError, match="overlaps"):
        run([split_norm_launch(bundle, spec, over, 4, EPS)], space)
