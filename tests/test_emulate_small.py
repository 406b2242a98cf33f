"""Emulated launches of the residual add, RoPE and the SWA KV insert, built by executor.launches.small.

Each case lays the buffers out in a HostArena sized for the 192-row bucket, uploads fresh random
inputs in the kernel's formats (as tests/gpu/test_norm_rope.py and test_indexer_publish.py do),
poisons the outputs with 0xFF, builds the launches from the tiny bundle's manifest, runs them on
the CPU emulator and checks every element. Tolerances:
- residual add: bitwise against `residual_add_ref` (the GPU test's check), and within
  (2^-8 + 2^-23) |exact| of the float64 sum (half a bf16 ulp after one fp32 rounding);
- RoPE: NaN exactly where the reference has NaN (out-of-range positions), every other element
  bitwise equal to `rope_ref` (the emulator runs that reference; the GPU test allows the kernel
  1 in 1000 differing bits), and within 2^-8 |exact| + 2^-22 (|x0| + |x1|) of the float64
  rotation by the table's values (the GPU test's bound: fp32 products and one bf16 rounding);
- SWA insert: every byte of the cache equal to `swa_insert_ref`'s on a 0xFF cache (GPU test).
Rows past `rows` (the padded bucket) keep their poison (or, in place, their input bytes).
"""
import numpy as np
import pytest

from executor.emulate import run
from executor.hostmem import AddressSpace, HostArena, ManifestBundle
from executor.launches import small
from kernels import elementwise_ref as er
from kernels import kv_publish_ref as kp
from kernels import rope_ref as rr
from kernels.common_ref import BF16, to_bf16
from kernels.kvrecord_ref import KV_RECORD_BYTES, KV_ROPE_OFFSET, KV_SCALE_OFFSET
from loader.config import ModelConfig
from loader.formats import to_bf16 as formats_to_bf16

BUCKET = 192
ROWS = (1, 7, 48, BUCKET)
NUM_POSITIONS = 4096


@pytest.fixture(scope="module")
def bundle(tiny_bundle_dir):
    return ManifestBundle(tiny_bundle_dir)


def _arena(requests):
    space = AddressSpace()
    arena = HostArena(space, requests)
    return space, arena, {name: arena.ptr(name) for name, *_ in requests}


# ---- residual add --------------------------------------------------------------------------

@pytest.mark.parametrize("a_dtype", er.A_DTYPES)
@pytest.mark.parametrize("alias", (False, True))
def test_residual_add(bundle, a_dtype, alias):
    rng = np.random.default_rng()
    width = bundle.kernel(f"residual_add_{a_dtype}_bf16_d256").spec["width"]
    spec = er.make_spec(width, a_dtype)
    for rows in ROWS:
        space, arena, ptrs = _arena(small.residual_add_requests(spec, BUCKET))
        a = (rng.standard_normal((rows, width)) * 3).astype(np.float32)
        a = to_bf16(a) if a_dtype == "bf16" else a
        b = to_bf16(rng.standard_normal((rows, width)) * 10)
        arena.upload("a", a)
        arena.fill("b", 0xFF)
        arena.upload("b", b)
        arena.fill("out", 0xFF)
        if alias:                                 # the step adds into the residual stream
            ptrs["out"] = ptrs["b"]
        assert run(small.residual_add_launches(bundle, spec, ptrs, rows), space) == 1
        got_name = "b" if alias else "out"
        got = arena.download(got_name, BF16, (BUCKET, width))
        want = er.residual_add_ref(a, b)
        assert np.array_equal(got[:rows].view(np.uint16), want.view(np.uint16)), (a_dtype, rows)
        exact = er.residual_add_f64(a, b)
        assert np.all(np.abs(got[:rows].astype(np.float64) - exact)
                      <= (2.0**-8 + 2.0**-23) * np.abs(exact)), (a_dtype, rows)
        assert np.all(got[rows:].view(np.uint16) == 0xFFFF), f"{spec.name}: wrote past {rows}"


def test_residual_add_builder_rejects_bad_pointers_and_a_foreign_bundle_spec(bundle):
    spec = er.make_spec(256, "f32")
    ptrs = {"a": 1 << 40, "b": 2 << 40, "out": 3 << 40}
    with pytest.raises(ValueError, match="missing \\['out'\\]"):
        small.residual_add_launches(bundle, spec, {"a": 1 << 40, "b": 2 << 40}, 1)
    with pytest.raises(ValueError, match="b must be a non-null 16-byte aligned"):
        small.residual_add_launches(bundle, spec, {**ptrs, "b": (2 << 40) + 8}, 1)
    with pytest.raises(KeyError, match="residual_add_f32_bf16_d512"):
        small.residual_add_launches(bundle, er.make_spec(512, "f32"), ptrs, 1)
    with pytest.raises(ValueError, match="rows must be a positive integer"):
        small.residual_add_launches(bundle, spec, ptrs, 0)


# ---- RoPE ---------------------------------------------------------------------------------------

def _rope_specs(bundle):
    for name in bundle.names():
        if name.startswith("rope_"):
            s = bundle.kernel(name).spec
            yield rr.make_spec(s["heads"], s["head_dim"], s["inverse"], s["in_place"])


@pytest.mark.parametrize("kind", ("plain", "yarn"))
def test_rope(bundle, kind):
    rng = np.random.default_rng()
    cfg = ModelConfig.preset("tiny")
    table = rr.RopeTable.for_ratio(cfg, 1 if kind == "yarn" else 0, NUM_POSITIONS)
    specs = list(_rope_specs(bundle))
    assert {(s.inverse, s.in_place) for s in specs} == {(False, True)}   # what the step runs
    for spec in specs:
        for rows in ROWS:
            space, arena, ptrs = _arena(small.rope_requests(spec, BUCKET, NUM_POSITIONS))
            x = to_bf16(rng.standard_normal((BUCKET, spec.heads, spec.head_dim)) * 4)
            pos = rng.integers(0, NUM_POSITIONS, BUCKET).astype(np.int32)
            pos[rng.integers(0, rows)] = NUM_POSITIONS - 1                # the last table row
            if rows > 5:
                pos[1] = -1 if rows % 2 else NUM_POSITIONS                 # out of range: NaN
            arena.upload("x", x)
            arena.upload("table", table.cos_sin)
            arena.upload("positions", pos)
            if not spec.in_place:
                arena.fill("out", 0xFF)
            launches = small.rope_launches(bundle, spec, ptrs, rows, NUM_POSITIONS)
            assert run(launches, space) == 1
            got = arena.download("x" if spec.in_place else "out", BF16, x.shape)
            _check_rope(spec, rows, got[:rows], x[:rows], pos[:rows], table)
            tail = x[rows:].view(np.uint16) if spec.in_place else 0xFFFF
            assert np.all(got[rows:].view(np.uint16) == tail), f"{spec.name}: wrote past {rows}"


def _check_rope(spec, rows, got, x, pos, table):
    want = rr.rope_ref(x, pos, table, spec.inverse)
    nan_got, nan_want = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
    assert np.array_equal(nan_got, nan_want), f"{spec.name} rows={rows}: NaN positions differ"
    assert np.array_equal(got.view(np.uint16)[~nan_want], want.view(np.uint16)[~nan_want]), (
        f"{spec.name} rows={rows}")
    valid = (pos >= 0) & (pos < table.num_positions)
    xr = x[valid][..., -rr.ROPE_DIM:].astype(np.float64)
    c = table.cos_sin[pos[valid], :, 0].astype(np.float64)[:, None, :]
    s = table.cos_sin[pos[valid], :, 1].astype(np.float64)[:, None, :]
    s = -s if spec.inverse else s
    exact = np.empty_like(xr)
    x0, x1 = xr[..., 0::2], xr[..., 1::2]
    exact[..., 0::2], exact[..., 1::2] = x0 * c - x1 * s, x0 * s + x1 * c
    bound = 2.0**-8 * np.abs(exact) + 2.0**-22 * np.repeat(np.abs(x0) + np.abs(x1), 2, axis=-1)
    err = np.abs(got[valid][..., -rr.ROPE_DIM:].astype(np.float64) - exact)
    assert np.all(err <= bound), f"{spec.name} rows={rows}: max err/bound {np.max(err / bound)}"


# ---- SWA insert ---------------------------------------------------------------------------------

def _swa_inputs(rng, rows: int, num_slots: int):
    """kv with group scales spread over 2^-20..2^6 (the scale bytes vary), slots a permutation
    with two padding rows (-1), every row of the bucket holding a slot (a tail that must not be
    read)."""
    kv = rng.standard_normal((BUCKET, 512)).astype(np.float32)
    kv *= np.exp2(rng.integers(-20, 7, (BUCKET, 8))).repeat(64, axis=1).astype(np.float32)
    kv = formats_to_bf16(kv)
    weight = (rng.random(512) * 2).astype(np.float32)
    positions = rng.integers(0, NUM_POSITIONS, BUCKET).astype(np.int32)
    slots = rng.permutation(num_slots)[:BUCKET].astype(np.int64)
    slots[rng.permutation(rows)[:min(2, rows - 1)]] = -1
    return kv, weight, positions, slots


@pytest.mark.parametrize("rows", ROWS)
def test_swa_insert(bundle, rows):
    rng = np.random.default_rng()
    cfg = ModelConfig.preset("tiny")
    table = rr.RopeTable.for_ratio(cfg, int(rng.integers(0, 2)), NUM_POSITIONS)
    spec = kp.make_swa_spec(cfg.head_dim)
    num_slots = BUCKET + 37
    kv, weight, positions, slots = _swa_inputs(rng, rows, num_slots)
    space, arena, ptrs = _arena(small.swa_insert_requests(spec, BUCKET, NUM_POSITIONS, num_slots))
    for name, arr in (("kv", kv), ("weight", weight), ("table", table.cos_sin),
                      ("positions", positions), ("slots", slots)):
        arena.upload(name, arr)
    arena.fill("cache", 0xFF)
    eps = float(cfg.rms_norm_eps)
    launches = small.swa_insert_launches(bundle, spec, ptrs, rows, NUM_POSITIONS, eps)
    assert run(launches, space) == 1
    got = arena.download("cache", np.uint8, (num_slots, KV_RECORD_BYTES))
    want = np.full((num_slots, KV_RECORD_BYTES), 0xFF, np.uint8)
    kp.swa_insert_ref(want, kv[:rows], weight, eps, table, positions[:rows], slots[:rows])
    diff = np.argwhere(got != want)
    assert diff.size == 0, (f"rows={rows}: {len(diff)} bytes differ; first at record "
                            f"{diff[0][0]} byte {diff[0][1]}")
    assert np.count_nonzero(np.any(got != 0xFF, axis=1)) == np.count_nonzero(slots[:rows] >= 0)


def test_swa_insert_out_of_range_position_writes_nan_rope_dims(bundle):
    """The kernel's NaN (bf16 0x7FFF) in the 64 rope dims; nope bytes and scales as at any
    valid position, since they do not depend on it."""
    rng = np.random.default_rng()
    cfg = ModelConfig.preset("tiny")
    table = rr.RopeTable.for_ratio(cfg, 0, NUM_POSITIONS)
    spec = kp.make_swa_spec()
    rows, num_slots = 6, BUCKET + 37
    kv, weight, positions, slots = _swa_inputs(rng, rows, num_slots)
    slots[:rows] = np.arange(rows)
    positions[3] = NUM_POSITIONS
    space, arena, ptrs = _arena(small.swa_insert_requests(spec, BUCKET, NUM_POSITIONS, num_slots))
    for name, arr in (("kv", kv), ("weight", weight), ("table", table.cos_sin),
                      ("positions", positions), ("slots", slots)):
        arena.upload(name, arr)
    run(small.swa_insert_launches(bundle, spec, ptrs, rows, NUM_POSITIONS, 1e-6), space)
    got = arena.download("cache", np.uint8, (rows, KV_RECORD_BYTES))
    valid_pos = positions[:rows].copy()
    valid_pos[3] = 0
    want = np.empty((rows, KV_RECORD_BYTES), np.uint8)
    kp.swa_insert_ref(want, kv[:rows], weight, 1e-6, table, valid_pos, np.arange(rows))
    rope = slice(KV_ROPE_OFFSET, KV_SCALE_OFFSET)
    assert np.array_equal(np.delete(got, 3, axis=0), np.delete(want, 3, axis=0))
    assert np.array_equal(np.delete(got[3], np.r_[rope]), np.delete(want[3], np.r_[rope]))
    assert np.all(got[3, rope].view(np.uint16) == 0x7FFF)


def test_swa_insert_refuses_two_rows_on_one_slot(bundle):
    """Two real rows writing one record race on the GPU: the emulator names it."""
    rng = np.random.default_rng()
    spec = kp.make_swa_spec()
    rows, num_slots = 4, BUCKET + 37
    kv, weight, positions, slots = _swa_inputs(rng, rows, num_slots)
    slots[:rows] = [5, 9, 5, -1]
    space, arena, ptrs = _arena(small.swa_insert_requests(spec, BUCKET, NUM_POSITIONS, num_slots))
    for name, arr in (("kv", kv), ("weight", weight), ("positions", positions), ("slots", slots)):
        arena.upload(name, arr)
    with pytest.raises(ValueError, match="share a slot"):
        run(small.swa_insert_launches(bundle, spec, ptrs, rows, NUM_POSITIONS, 1e-6), space)
