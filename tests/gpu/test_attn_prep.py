"""GPU test of attn_prep (kernels/kv_publish.py: q_norm | kv_norm + RoPE + SWA insert in one launch).

Bundles: HOPDEC_BUNDLE (tiny: q_lora 256) and HOPDEC_BUNDLE_V41 (v41-flash: 1280); a missing
bundle skips its cases. R in {1, 5, 6, 12, 48, 192} real-or-padding rows, 2 of them padding
(slot -1), fresh inputs per case: the fused wq_a|wkv rows with a random overall scale, kv groups of
64 with scales spread over 2^-20..2^6 (so the record's scale bytes vary), one all-zero q head, a
random q_norm / kv_norm weight, positions over a plain or YaRN table, slots a permutation of a
larger cache. qr (and 3 rows past R) poisoned 0xFF (NaN), every cache byte poisoned 0xFF.
Checks, all bitwise (tolerance 0, as the arithmetic allows):
- qr equals `norm_ref.rmsnorm_ref` of the q head: the kernel's q warp runs kernels/norm.py's
  instructions (fma of exact bf16 squares in the reference's order, butterfly, div.rn/sqrt.rn/
  rcp.rn, two mul.rn), which the reference replays operation by operation;
- every byte of the cache equals `kv_publish_ref.attn_prep_ref`: the real rows' records at their
  slots (the kv warp is kv_swa_insert's code, whose float64 rotation and RNE E4M3 casts the
  reference replays), 0xFF everywhere else, so a padding row that wrote, a wrong slot, a wrong
  row stride or a stray byte shows;
- the poisoned rows past R of qr untouched;
- the round-4 chain (split_rmsnorm, then kv_swa_insert on its kv copy) on the same inputs writes
  the same qr and the same cache bytes.
"""
from __future__ import annotations

import numpy as np
import pytest

from executor.launch import LaunchSpec
from executor.launches.small import attn_prep_launches
from executor.launches.split_norm import split_norm_launch
from executor.runtime import Arena
from kernels import common_ref as cr
from kernels import kv_publish_ref as kp
from kernels import rope_ref
from kernels import split_norm_ref as sr

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

RNG = np.random.default_rng()
NUM_POSITIONS = 8192
PADDING = 2


def _inputs(cfg, rows: int):
    w, d = cfg.q_lora_rank, cfg.head_dim
    cap = rows + 3
    q = RNG.standard_normal((cap, w)) * RNG.uniform(0.01, 50)
    kv = RNG.standard_normal((cap, d)) * np.exp2(RNG.integers(-20, 7, (cap, d // 64))).repeat(
        64, axis=1)
    qkv = cr.to_bf16(np.concatenate([q, kv], axis=1))
    qkv[RNG.integers(0, rows), :w] = 0
    num_slots = 2 * rows + 7
    slots = RNG.permutation(num_slots)[:rows].astype(np.int64)
    slots[RNG.permutation(rows)[:min(PADDING, rows - 1)]] = -1     # R = 1 keeps its real row
    return {"qkv": qkv, "q_weight": RNG.uniform(-2, 2, w).astype(np.float32),
            "kv_weight": RNG.uniform(0, 2, d).astype(np.float32),
            "positions": RNG.integers(0, NUM_POSITIONS, rows).astype(np.int32),
            "slots": slots, "num_slots": num_slots}


def _upload(arena, name, arr):
    flat = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
    arena.view(name, np.uint8, flat.shape)[...] = cp.asarray(flat)


def _run(dev, stream, bundle, cfg, x, table, rows: int, fused: bool):
    """qr [rows + 3, W] (uint16 bits) and the cache [num_slots, 584] after one chain."""
    w, d, cap = cfg.q_lora_rank, cfg.head_dim, x["qkv"].shape[0]
    eps = cfg.rms_norm_eps
    reqs = [("qkv", x["qkv"].nbytes), ("q_weight", 4 * w), ("kv_weight", 4 * d),
            ("table", table.nbytes), ("positions", 4 * rows), ("slots", 8 * rows),
            ("qr", cap * w * 2), ("kv", cap * d * 2), ("cache", x["num_slots"] * 584)]
    with Arena(dev, reqs) as arena:
        for name in ("qkv", "q_weight", "kv_weight", "positions", "slots"):
            _upload(arena, name, x[name])
        _upload(arena, "table", table.cos_sin)
        for name in ("qr", "kv", "cache"):
            arena.view(name, np.uint8, (arena.nbytes(name),))[...] = 0xFF
        cp.cuda.Device().synchronize()
        ptr = arena.ptr
        if fused:
            spec = kp.make_attn_prep_spec(w, d)
            ptrs = {name: ptr(name) for name, kind in spec.params if kind == "u64"}
            for launch in attn_prep_launches(bundle, spec, ptrs, rows, NUM_POSITIONS, eps):
                launch.launch(stream)
        else:
            split = sr.make_spec(w, d)
            split_norm_launch(bundle, split, {"x": ptr("qkv"), "weight": ptr("q_weight"),
                                              "out": ptr("qr"), "tail": ptr("kv")},
                              rows, eps).launch(stream)
            insert = kp.make_swa_spec(d)
            LaunchSpec(bundle.kernel(insert.name), insert.grid(rows),
                       (ptr("kv"), ptr("kv_weight"), ptr("table"), ptr("positions"),
                        ptr("slots"), ptr("cache"), rows, NUM_POSITIONS, eps)).launch(stream)
        stream.synchronize()
        qr = cp.asnumpy(arena.view("qr", np.uint16, (cap, w)))
        cache = cp.asnumpy(arena.view("cache", np.uint8, (x["num_slots"], 584)))
    return qr, cache


def _first_diff(got, want) -> str:
    bad = np.argwhere(got != want)
    if not len(bad):
        return "none"
    at = tuple(bad[0])
    return f"{len(bad)} differ, first at {at}: {got[at]:#x} vs {want[at]:#x}"


@pytest.mark.parametrize("rows", [1, 5, 6, 12, 48, 192])
def test_attn_prep_matches_reference_and_round4_chain(dev, stream, preset_bundle, rows):
    cfg, bundle = preset_bundle
    x = _inputs(cfg, rows)
    table = rope_ref.RopeTable.for_ratio(cfg, int(RNG.integers(0, 2)), NUM_POSITIONS)
    want_cache = np.full((x["num_slots"], 584), 0xFF, np.uint8)
    want_qr = kp.attn_prep_ref(want_cache, x["qkv"][:rows], x["q_weight"], x["kv_weight"],
                               cfg.rms_norm_eps, table, x["positions"], x["slots"])
    qr, cache = _run(dev, stream, bundle, cfg, x, table, rows, fused=True)
    name = f"attn_prep q{cfg.q_lora_rank} rows={rows}"
    assert np.array_equal(qr[:rows], want_qr.view(np.uint16)), (
        f"{name}: qr {_first_diff(qr[:rows], want_qr.view(np.uint16))}")
    assert (qr[rows:] == 0xFFFF).all(), f"{name}: wrote qr past its rows"
    assert np.array_equal(cache, want_cache), f"{name}: cache bytes {_first_diff(cache, want_cache)}"
    assert (cache[x["slots"][x["slots"] >= 0]] != 0xFF).any(axis=1).all(), name

    old_qr, old_cache = _run(dev, stream, bundle, cfg, x, table, rows, fused=False)
    assert np.array_equal(qr[:rows], old_qr[:rows]), (
        f"{name}: qr vs the round-4 chain {_first_diff(qr[:rows], old_qr[:rows])}")
    assert np.array_equal(cache, old_cache), (
        f"{name}: cache vs the round-4 chain {_first_diff(cache, old_cache)}")
