"""CPU emulation of kernels.dense_qgmma (executor/emulate/dense_qgmma.py) and its place in the step:
attn.wq_b at attn_proj.QGMMA_WQ_B_ROWS (1-row buckets) runs the `_sqg` kernel.

- Every QGMMA kernel of the tiny bundle (wq_a|wkv and wq_b, `_sqg` and `_sqg4`, both split K in
  2 there) launched as the step launches it (launches/dense.dense_launch over a HostArena), rows
  in {1, 5, 8}, fresh weights and x (the wide-range rows of the GPU test and plain normal rows):
  every element within dense_qgmma_ref.qgmma_tolerance of the exact product of the split x (the
  GPU test's check) and within that + split_error_bound of the exact bf16 x product, rows past R
  poison, counters back at zero, the split-K workspace clobbered.
- Wiring mistakes fail as on the GPU (grid, dirty counters, overlapping output, R > 8).
- The emulated tiny step at R = 1 with the switch and with bench_step's "wq_b_xtwp" (the plain
  kernel): the launch lists differ in attn.wq_b's kernel only, logits agree within the step
  test's bound, tokens agree but at near-ties.
"""
from __future__ import annotations

import numpy as np
import pytest
from ref_model import prefilled_tiny, tiny_checkpoint, token_history

from executor import bench_step
from executor.emulate import run
from executor.emulate.ranks import EmulatedRanks
from executor.hostmem import AddressSpace, HostArena, ManifestBundle
from executor.launch import LaunchSpec
from executor.launches import dense as ld
from executor.reference.rows import RowBatch, RowBlock
from executor.stages import attn_proj
from executor.wiring import STAGE_MODULES
from kernels import dense_qgmma_ref as qr
from kernels.common_ref import BF16
from kernels.dense_ref import random_e4m3
from loader.config import ModelConfig
from loader.formats import fp8_block_dequantize

MAX_ROWS = 8
LOGIT_BOUND = 0.25                  # tests/test_emulate_step.py


@pytest.fixture(scope="module")
def bundle(tiny_bundle_dir):
    return ManifestBundle(tiny_bundle_dir)


def _specs(bundle) -> list[qr.QgSpec]:
    out = []
    for name in bundle.names():
        rec = bundle.kernel(name)
        if rec.family == "kernels.dense_qgmma":
            spec = qr.QgSpec.from_dict(rec.spec)
            assert spec.to_dict() == rec.spec, f"{name}: manifest spec differs from QgSpec"
            out.append(spec)
    assert out, "tiny bundle has no QGMMA kernels"
    return out


def _arena(spec, space, rng):
    w = random_e4m3(rng, (spec.n, spec.k))
    s = rng.integers(112, 125, size=(spec.n // 32, spec.k // 32)).astype(np.uint8)
    arena = HostArena(space, ld.dense_requests(spec, MAX_ROWS), name=spec.name)
    arena.upload("weight", w)
    arena.upload("scales", s)
    arena.fill("out", 0xFF)
    if "workspace" in arena.slices:
        arena.fill("workspace", 0x5A)
    return arena, fp8_block_dequantize(w, s).astype(np.float64)


def test_every_qgmma_launch_is_within_the_gpu_bound(bundle):
    rng = np.random.default_rng()
    specs = _specs(bundle)
    assert {s.variant for s in specs} == set(qr.WARPGROUPS)
    assert any(s.split_k > 1 for s in specs), "no split-K QGMMA kernel covered"
    for spec in specs:
        space = AddressSpace()
        arena, wf = _arena(spec, space, rng)
        ptrs = {name: arena.ptr(name) for name in arena.slices}
        for wide in (True, False):
            x = (qr.random_wide_rows(rng, MAX_ROWS, spec.k) if wide else
                 rng.standard_normal((MAX_ROWS, spec.k)).astype(np.float32).astype(BF16))
            arena.upload("x", x)
            for rows in (1, 5, 8):
                arena.fill("out", 0xFF)
                assert run([ld.dense_launch(bundle, spec, ptrs, rows)], space) == 1
                raw = arena.download("out", np.uint16, (MAX_ROWS, spec.n))
                assert np.all(raw[rows:] == 0xFFFF), f"{spec.name}: wrote past row {rows}"
                got = raw[:rows].view(BF16).astype(np.float64)
                xr = x[:rows]
                tol = qr.qgmma_tolerance(spec, xr, wf)
                err = np.abs(got - qr.dense_qgmma_ref(spec, xr, wf))
                assert np.isfinite(got).all() and (err <= tol).all(), (spec.name, rows, wide)
                exact = xr.astype(np.float64) @ wf.T
                bound = tol + qr.split_error_bound(spec, xr, np.abs(wf))
                assert (np.abs(got - exact) <= bound).all(), (spec.name, rows, wide)
                if spec.counters_bytes():
                    assert not arena.view("counters", np.uint8).any(), "counters left dirty"
                if spec.workspace_bytes():
                    assert np.all(arena.view("workspace", np.uint32) == 0xFFFFFFFF)


def test_wiring_mistakes_fail_as_on_the_gpu(bundle):
    spec = next(s for s in _specs(bundle) if s.counters_bytes())
    space = AddressSpace()
    arena, _ = _arena(spec, space, np.random.default_rng())
    ptrs = {n: arena.ptr(n) for n in arena.slices}
    good = ld.dense_launch(bundle, spec, ptrs, 8)
    with pytest.raises(ValueError, match="grid"):
        run([LaunchSpec(good.kernel, (good.grid[0] + 1, 1, 1), good.args)], space)
    with pytest.raises(ValueError, match="rows <= 8"):
        ld.dense_launch(bundle, spec, ptrs, 9)
    with pytest.raises(ValueError, match="'out'.*overlaps 'x'"):
        run([ld.dense_launch(bundle, spec, {**ptrs, "out": ptrs["x"] + 256}, 8)], space)
    arena.view("counters", np.uint32)[1] = 1
    with pytest.raises(ValueError, match="counters must be zero"):
        run([good], space)


@pytest.mark.parametrize("preset", ["tiny", "v41-flash"])
def test_step_buffers_hold_the_wq_b_kernels_scratch(preset):
    """attn_proj.buffers sizes the split-K scratch for the QGMMA wq_b whether or not the switch
    is on (tiny: K split in 2 slices; v41-flash TP4: whole K, no scratch)."""
    cfg = ModelConfig.preset(preset)
    spec = next(s for s in qr.qg_specs(cfg, 4)
                if s.variant == qr.VARIANT and "_wq_b_" in s.name)
    assert spec.split_k == (2 if preset == "tiny" else 1)
    sizes = {b.name: int(np.prod(b.shape)) * np.dtype(b.dtype).itemsize
             for b in attn_proj.buffers(cfg, 4, 8)}
    assert sizes["attn.dense_workspace"] >= spec.workspace_bytes()
    assert sizes["attn.dense_counters"] >= spec.counters_bytes()


def test_picker_takes_the_two_warpgroup_kernel(bundle):
    spec = ld.qgmma_spec(bundle, "wq_b")
    assert spec.variant == qr.VARIANT and spec.name.endswith("_r8_bf16_sqg")
    assert spec in qr.qg_specs(ModelConfig.preset("tiny"), 4)
    with pytest.raises(LookupError):
        ld.qgmma_spec(bundle, "shared_w2")          # built for the attention linears only


def _step(bundle_dir, caches, rows, history):
    ranks = EmulatedRanks(tiny_checkpoint(), bundle_dir, 4, caches, modules=STAGE_MODULES)
    ranks.load(rows, caches, history)
    ranks.run(rows.num_rows)
    return ranks


def _logits(ranks, n):
    vocab_l = ranks.cfg.vocab_size // ranks.tp
    return np.concatenate([ranks.read(r, "logits", np.float32, (192, vocab_l))[:n]
                           for r in range(ranks.tp)], axis=1).astype(np.float64)


def test_decode_step_with_qgmma_wq_b_or_the_plain_kernel(tiny_bundle_dir):
    assert 1 in attn_proj.QGMMA_WQ_B_ROWS
    rng = np.random.default_rng()
    model, caches, seq = prefilled_tiny(rng, 4)
    rows = RowBatch.from_blocks([RowBlock(0, len(seq) - 1, (seq[-1],), "decode")],
                                caches.block_tables, caches.ring_slots, pad_to=1)
    history = (token_history(model.cfg, rows, [np.asarray(seq, np.int64)])
               if model.cfg.engram_layer_ids else None)
    on = _step(tiny_bundle_dir, caches, rows, history)
    with bench_step.overrides(bench_step.STEP_VARIANTS["wq_b_xtwp"]()):
        off = _step(tiny_bundle_dir, caches, rows, history)
    names_on = [s.kernel.name for _, specs in on.plans[0].launches(1) for s in specs]
    names_off = [s.kernel.name for _, specs in off.plans[0].launches(1) for s in specs]
    diff = [(a, b) for a, b in zip(names_on, names_off) if a != b]
    assert len(names_on) == len(names_off) and diff, "the variant changed nothing"
    for a, b in diff:                       # attn.wq_b only: _sqg on, the plain r8 kernel off
        assert a.startswith("dense_w8a16_wq_b_") and a.endswith("_r8_bf16_sqg"), a
        assert b.startswith("dense_w8a16_wq_b_") and b.endswith("_r8_bf16"), b
    a, b = _logits(on, 1), _logits(off, 1)
    gap = float(np.abs(a - b).max())
    assert gap <= LOGIT_BOUND, f"logits differ by {gap}"
    tok_on, tok_off = (r.read(0, "tokens", np.int64, (192,))[:1] for r in (on, off))
    if tok_on[0] != tok_off[0]:
        top2 = np.sort(b[0])[-2:]
        assert top2[1] - top2[0] <= 2 * gap, "tokens differ away from a near-tie"
