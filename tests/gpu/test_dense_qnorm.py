"""GPU test of q_norm folded into wq_b / the indexer's wq_b (kernels.dense_qnorm) and of the
strided SWA insert that takes attn.q_kv_norm's place (kv_swa_insert_d512_s<W + 512>).

Bundles: HOPDEC_BUNDLE (tiny: q_lora 256) and HOPDEC_BUNDLE_V41 (v41-flash TP4: q_lora 1280, wq_b
N 8192, indexer N 4096); a missing bundle skips its cases. The folded kernels are built for
R <= 8 only (R > 8 keeps split_rmsnorm + the r32 kernel in the step), so R in {1, 5, 6, 8}.
Fresh inputs per case: attn.qkv rows [R + 3, W + 512] with a per-row scale 2^-40..2^40 (squares
stay normal fp32, so fma and the reference's square-then-add agree) and one all-zero q row, a
random q_norm weight, random E4M3 weights over every finite code, scale bytes 100..134. Outputs
poisoned 0xFF (NaN) for R + 3 rows. Checks:
- bitwise: the folded kernel's output equals the round-8 chain on the same inputs, split_rmsnorm
  (q_norm -> qr; bitwise attn_prep's qr: tests/gpu/test_attn_prep.py) then the plain tile kernel
  of the same variant on qr (wq_b: the step's kernel; indexer: its `_sxtwp` candidate): the
  multiplied B fragments must be the same bits and the mma order is the same;
- that qr is bitwise `norm_ref.rmsnorm_ref` (what the folded prologue claims to compute);
- against `dense_qnorm_ref` within `dense_ref.epilogue_expectation`'s fp32 bound, every element;
- rows >= R of the output untouched (still the poison).
The strided insert: every cache byte equals `kv_publish_ref.swa_insert_ref` of the kv half (slot
-1 rows write nothing), and equals what attn_prep writes on the same rows.
"""
from __future__ import annotations

import numpy as np
import pytest

from executor.launches.dense import dense_launch
from executor.launches.dense_qnorm import qnorm_launch, qnorm_spec
from executor.launches.small import attn_prep_launches, swa_insert_launches
from executor.launches.split_norm import split_norm_launch
from executor.runtime import Arena
from kernels import common_ref as cr
from kernels import dense_qnorm_ref as qr
from kernels import dense_ref as dr
from kernels import kv_publish_ref as kp
from kernels import rope_ref
from kernels import split_norm_ref as sr

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

RNG = np.random.default_rng()
EXTRA = 3                        # poisoned rows past R
NUM_POSITIONS = 8192


def _upload(arena, name, arr):
    flat = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
    arena.view(name, np.uint8, flat.shape)[...] = cp.asarray(flat)


def _qkv(cfg, rows: int) -> np.ndarray:
    w, d = cfg.q_lora_rank, cfg.head_dim
    cap = rows + EXTRA
    scale = np.exp2(RNG.uniform(-40, 40, (cap, 1)))
    qkv = cr.to_bf16(RNG.standard_normal((cap, w + d)) * scale)
    qkv[RNG.integers(0, rows), :w] = 0
    return qkv


def _first_diff(got, want) -> str:
    bad = np.argwhere(got != want)
    if not len(bad):
        return "none"
    at = tuple(bad[0])
    return f"{len(bad)} differ, first at {at}: {got[at]:#x} vs {want[at]:#x}"


def _run(dev, stream, bundle, cfg, label, spec, x, rows: int):
    """(folded out, chain out, chain qr) as uint16 bits, each [rows + EXTRA, .]."""
    w, d, n, k = cfg.q_lora_rank, cfg.head_dim, spec.n, spec.k
    cap = rows + EXTRA
    plain = dr.make_spec(label, n, k, variant=spec.variant)     # the same tile variant
    reqs = [("qkv", x["qkv"].nbytes), ("norm_weight", 4 * w), ("weight", n * k),
            ("scales", x["scales"].nbytes), ("out", cap * n * 2), ("chain", cap * n * 2),
            ("qr", cap * w * 2), ("kv", cap * d * 2)]
    with Arena(dev, reqs) as arena:
        for name in ("qkv", "norm_weight", "weight", "scales"):
            _upload(arena, name, x[name])
        for name in ("out", "chain", "qr", "kv"):
            arena.view(name, np.uint8, (arena.nbytes(name),))[...] = 0xFF
        cp.cuda.Device().synchronize()
        ptr, eps = arena.ptr, cfg.rms_norm_eps
        qnorm_launch(bundle, spec, {"x": ptr("qkv"), "weight": ptr("weight"),
                                    "scales": ptr("scales"), "norm_weight": ptr("norm_weight"),
                                    "out": ptr("out")}, rows, eps).launch(stream)
        split_norm_launch(bundle, sr.make_spec(w, d), {"x": ptr("qkv"),
                                                      "weight": ptr("norm_weight"),
                                                      "out": ptr("qr"), "tail": ptr("kv")},
                          rows, eps).launch(stream)
        dense_launch(bundle, plain, {"x": ptr("qr"), "weight": ptr("weight"),
                                     "scales": ptr("scales"), "out": ptr("chain")},
                     rows).launch(stream)
        stream.synchronize()
        return tuple(cp.asnumpy(arena.view(name, np.uint16, (cap, width)))
                     for name, width in (("out", n), ("chain", n), ("qr", w)))


@pytest.mark.parametrize("label", qr.LABELS)
@pytest.mark.parametrize("rows", [1, 5, 6, 8])
def test_folded_q_norm_is_the_chain_bitwise(dev, stream, preset_bundle, label, rows):
    cfg, bundle = preset_bundle
    spec = qnorm_spec(bundle, label)
    n, k = spec.n, spec.k
    x = {"qkv": _qkv(cfg, rows), "norm_weight": RNG.uniform(-2, 2, k).astype(np.float32),
         "weight": dr.random_e4m3(RNG, (1, n, k)),
         "scales": RNG.integers(100, dr.MAX_SCALE_BYTE + 1, (1, n // 32, k // 32), np.uint8)}
    out, chain, qr_bits = _run(dev, stream, bundle, cfg, label, spec, x, rows)
    name = f"{spec.name} rows={rows}"
    xn = qr.normalized_x(spec, x["qkv"][:rows], x["norm_weight"], cfg.rms_norm_eps)
    assert np.array_equal(qr_bits[:rows], xn.view(np.uint16)), (
        f"{name}: split_rmsnorm qr vs rmsnorm_ref {_first_diff(qr_bits[:rows], xn.view(np.uint16))}")
    assert np.array_equal(out[:rows], chain[:rows]), (
        f"{name}: folded vs split_rmsnorm -> plain kernel {_first_diff(out[:rows], chain[:rows])}")
    assert (out[rows:] == 0xFFFF).all(), f"{name}: wrote past its rows"

    w_f32 = (x["weight"][0].astype(np.float32)
             * np.exp2(x["scales"][0].astype(np.float32) - 127).repeat(32, 0).repeat(32, 1))
    exact = xn.astype(np.float64) @ w_f32.astype(np.float64).T
    acc = dr.dense_tolerance(xn, w_f32, "f32")
    want, bound = dr.epilogue_expectation(spec.base(), exact, acc)
    got = out[:rows].view(cr.BF16).astype(np.float64)
    assert np.isfinite(got).all(), f"{name}: non-finite output"
    err = np.abs(got - want)
    assert (err <= bound).all(), (f"{name}: {int((err > bound).sum())} elements outside the "
                                  f"fp32 bound, worst {float((err - bound).max()):.3g}")


@pytest.mark.parametrize("rows", [1, 5, 6, 8, 17, 48, 192])
def test_strided_swa_insert_matches_reference_and_attn_prep(dev, stream, preset_bundle, rows):
    cfg, bundle = preset_bundle
    w, d = cfg.q_lora_rank, cfg.head_dim
    qkv = _qkv(cfg, rows)
    q_w = RNG.uniform(-2, 2, w).astype(np.float32)
    kv_w = RNG.uniform(0, 2, d).astype(np.float32)
    positions = RNG.integers(0, NUM_POSITIONS, rows).astype(np.int32)
    num_slots = 2 * rows + 7
    slots = RNG.permutation(num_slots)[:rows].astype(np.int64)
    slots[RNG.permutation(rows)[:min(2, rows - 1)]] = -1
    table = rope_ref.RopeTable.for_ratio(cfg, int(RNG.integers(0, 2)), NUM_POSITIONS)
    want = np.full((num_slots, 584), 0xFF, np.uint8)
    kp.swa_insert_ref(want, np.ascontiguousarray(qkv[:rows, w:]), kv_w, cfg.rms_norm_eps, table,
                      positions, slots)
    spec = kp.make_swa_spec(d, w + d)
    prep = kp.make_attn_prep_spec(w, d)
    reqs = [("qkv", qkv.nbytes), ("q_weight", 4 * w), ("kv_weight", 4 * d),
            ("table", table.cos_sin.nbytes), ("positions", 4 * rows), ("slots", 8 * rows),
            ("qr", (rows + EXTRA) * w * 2), ("cache", num_slots * 584),
            ("cache_prep", num_slots * 584)]
    with Arena(dev, reqs) as arena:
        for name, arr in (("qkv", qkv), ("q_weight", q_w), ("kv_weight", kv_w),
                          ("table", table.cos_sin), ("positions", positions), ("slots", slots)):
            _upload(arena, name, arr)
        for name in ("qr", "cache", "cache_prep"):
            arena.view(name, np.uint8, (arena.nbytes(name),))[...] = 0xFF
        cp.cuda.Device().synchronize()
        ptr = arena.ptr
        for launch in swa_insert_launches(
                bundle, spec, {"kv": ptr("qkv") + 2 * w, "weight": ptr("kv_weight"),
                               "table": ptr("table"), "positions": ptr("positions"),
                               "slots": ptr("slots"), "cache": ptr("cache")},
                rows, NUM_POSITIONS, cfg.rms_norm_eps):
            launch.launch(stream)
        ptrs = {name: ptr(name) for name, kind in prep.params if kind == "u64"}
        ptrs["cache"] = ptr("cache_prep")
        for launch in attn_prep_launches(bundle, prep, ptrs, rows, NUM_POSITIONS,
                                         cfg.rms_norm_eps):
            launch.launch(stream)
        stream.synchronize()
        cache = cp.asnumpy(arena.view("cache", np.uint8, (num_slots, 584)))
        cache_prep = cp.asnumpy(arena.view("cache_prep", np.uint8, (num_slots, 584)))
    name = f"{spec.name} rows={rows}"
    assert np.array_equal(cache, want), f"{name}: cache bytes {_first_diff(cache, want)}"
    assert np.array_equal(cache, cache_prep), (
        f"{name}: vs attn_prep's records {_first_diff(cache, cache_prep)}")
