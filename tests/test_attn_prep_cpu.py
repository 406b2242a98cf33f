"""kernels.kv_publish's attn_prep without a GPU: the spec rules, and its launch emulated on host memory.

The emulated launch (executor/launches/small.py -> executor/emulate/kv_publish.py) on fresh random
fused wq_a|wkv rows of the tiny and V4.1 widths (q_lora 256 / 1280 | kv 512), some rows padding
(slot -1), the cache poisoned 0xFF: qr bitwise `norm_ref.rmsnorm_ref` of the strided q head and
nothing written past `rows`; every cache byte equal to the round-4 chain's (split_norm_ref's kv
copy through `swa_insert_ref`), i.e. the records of the real rows and 0xFF elsewhere. The kernel's
own test is tests/gpu/test_attn_prep.py.
"""
from __future__ import annotations

import numpy as np
import pytest
from spec_bundle import OneKernelBundle

from executor.emulate import run
from executor.hostmem import AddressSpace, HostArena
from executor.launch import LaunchSpec
from executor.launches.small import attn_prep_launches, attn_prep_requests
from kernels import kv_publish_ref as kp
from kernels import norm_ref, rope_ref, split_norm_ref
from kernels.common_ref import BF16
from loader.config import ModelConfig

EPS = 1e-20
NUM_POSITIONS = 4096


def _setup(spec, rows, max_rows, rng, num_slots):
    space = AddressSpace()
    arena = HostArena(space, attn_prep_requests(spec, max_rows, NUM_POSITIONS, num_slots))
    qkv = (rng.standard_normal((max_rows, spec.row_stride)) * rng.uniform(0.01, 30)).astype(BF16)
    x = {"qkv": qkv, "q_weight": (rng.random(spec.q_width) * 2).astype(np.float32),
         "kv_weight": (rng.random(spec.head_dim) * 2).astype(np.float32),
         "table": rope_ref.RopeTable.for_ratio(ModelConfig.preset("tiny"), 1, NUM_POSITIONS),
         "positions": rng.integers(0, NUM_POSITIONS, max_rows).astype(np.int32),
         "slots": rng.permutation(num_slots)[:max_rows].astype(np.int64)}
    x["slots"][rng.permutation(rows)[:rows // 3]] = -1
    for name in ("qkv", "q_weight", "kv_weight", "positions", "slots"):
        arena.upload(name, x[name])
    arena.upload("table", x["table"].cos_sin)
    arena.fill("qr", 0xFF)
    arena.fill("cache", 0xFF)
    ptrs = {name: arena.ptr(name) for name, *_ in attn_prep_requests(spec, 1, 1, 1)}
    return space, arena, ptrs, x


@pytest.mark.parametrize("width", [256, 1280])
@pytest.mark.parametrize("rows", [1, 6, 13, 48])
def test_emulated_launch_equals_the_round4_chain(width, rows):
    spec = kp.make_attn_prep_spec(width)
    rng = np.random.default_rng()
    num_slots = 2 * 64 + 5
    space, arena, ptrs, x = _setup(spec, rows, 64, rng, num_slots)
    bundle = OneKernelBundle(spec, "kernels.kv_publish")
    run(attn_prep_launches(bundle, spec, ptrs, rows, NUM_POSITIONS, EPS), space)
    qr = arena.view("qr", BF16, (64, width)).view(np.uint16)
    cache = arena.view("cache", np.uint8, (num_slots, 584))

    head, kv = split_norm_ref.split_norm_ref(x["qkv"][:rows], x["q_weight"], width, EPS)
    want = np.full((num_slots, 584), 0xFF, np.uint8)
    kp.swa_insert_ref(want, kv, x["kv_weight"], EPS, x["table"], x["positions"][:rows],
                      x["slots"][:rows])
    np.testing.assert_array_equal(qr[:rows], head.view(np.uint16))
    np.testing.assert_array_equal(
        qr[:rows], norm_ref.rmsnorm_ref(np.ascontiguousarray(x["qkv"][:rows, :width]),
                                        x["q_weight"], EPS).view(np.uint16))
    assert (qr[rows:] == 0xFFFF).all()
    np.testing.assert_array_equal(cache, want)
    real = x["slots"][:rows][x["slots"][:rows] >= 0]
    assert len(real) and (cache[real, -1] == 0).all()        # the records' pad byte


def test_specs_of_the_configs_and_their_rules():
    from kernels import kv_publish

    for preset, width in (("tiny", 256), ("v41-flash", 1280)):
        specs = {s.name: s for s in kv_publish.specs(ModelConfig.preset(preset), 4)}
        spec = specs[f"attn_prep_q{width}_d512"]
        assert (spec.q_width, spec.row_stride, spec.smem_bytes) == (width, width + 512, 4 * width)
        assert spec.block == (128, 1, 1) and spec.kind == "attn_prep"
    for bad in (0, 200, 2304):
        with pytest.raises(ValueError, match="attn_prep: q width"):
            kp.make_attn_prep_spec(bad)
    with pytest.raises(ValueError, match="584-byte"):
        kp.make_attn_prep_spec(256, 256)
    spec = kp.make_attn_prep_spec(256)
    assert spec.grid(1) == (1, 1, 1) and spec.grid(192) == (96, 1, 1) and spec.grid(5) == (3, 1, 1)
    with pytest.raises(ValueError):
        spec.grid(0)


def test_a_short_grid_or_qr_over_qkv_is_refused():
    spec = kp.make_attn_prep_spec(256)
    rng = np.random.default_rng()
    space, _, ptrs, _ = _setup(spec, 6, 8, rng, 21)
    bundle = OneKernelBundle(spec, "kernels.kv_publish")
    args = tuple(ptrs[n] for n, k in spec.params if k == "u64") + (6, NUM_POSITIONS, EPS)
    with pytest.raises(ValueError, match="grid"):
        run([LaunchSpec(bundle.record, (2, 1, 1), args)], space)
    with pytest.raises(ValueError, match="overlaps"):
        run(attn_prep_launches(bundle, spec, dict(ptrs, qr=ptrs["qkv"]), 6, NUM_POSITIONS, EPS),
            space)
    with pytest.raises(ValueError, match="cache must be"):
        attn_prep_launches(bundle, spec, dict(ptrs, cache=0), 6, NUM_POSITIONS, EPS)
