"""CPU tests of the QGMMA W8A16 candidate (kernels/dense_qgmma.py, dense_qgmma_ref.py): specs, the
register / shared-memory placement replayed lane by lane against the PTX fragment layouts, the
hi / lo split of x, and a model of the kernel's arithmetic (tensor-core sums truncated to 13 bits)
against the reference within the stated bound - and a wrong element (dropped or doubled k-step,
wrong block scale, swapped token or row, the lo part dropped) outside it."""
from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

from kernels import dense_qgmma_ref as qr
from kernels.common_ref import BF16
from kernels.dense_ref import DenseSpec, random_e4m3
from loader.config import ModelConfig
from loader.formats import fp8_block_dequantize

E4M3 = ml_dtypes.float8_e4m3fn


@pytest.mark.parametrize("config", ["tiny", "v41-flash"])
def test_specs_cover_the_attention_linears_in_one_wave(config):
    specs = qr.qg_specs(ModelConfig.preset(config), 4)
    assert [(s.name.split("_n")[0], s.name.split("_")[-1]) for s in specs] == [
        ("dense_w8a16_wqa_wkv", "sqg"), ("dense_w8a16_wqa_wkv", "sqg4"),
        ("dense_w8a16_wq_b", "sqg"), ("dense_w8a16_wo_b", "sqg")]
    for s in specs:
        assert s.name.endswith(f"_r8_bf16_{qr.TAGS[s.variant]}")
        assert s.block == (128 * s.warpgroups, 1, 1) and s.steps % s.warpgroups == 0
        assert s.ctas <= 132 and s.ctas == s.n // 64 * s.split_k and s.k == s.split_k * s.slice_k
        whole = "_wo_b_" in s.name                     # WHOLE_K_LABELS: one CTA per SM
        assert s.slice_k % 128 == 0 and s.smem_bytes <= (qr.SMEM_BUDGET_WHOLE if whole
                                                         else qr.SMEM_BUDGET)
        assert s.split_k == 1 or not whole
        assert s.grid(8) == (s.ctas, 1, 1)
        assert qr.QgSpec.from_dict(s.to_dict()) == s
        assert DenseSpec.from_dict(s.to_dict()).name == s.name      # the manifest record
        with pytest.raises(ValueError):
            s.grid(9)
        assert s.workspace_bytes() == (0 if s.split_k == 1 else s.ctas * 2048)
    if config == "v41-flash":
        wqa, _, wqb, wob = specs
        assert (wqa.n, wqa.k, wqa.split_k, wqa.ctas) == (1792, 5120, 4, 112)
        assert (wqb.n, wqb.k, wqb.split_k, wqb.ctas) == (8192, 1280, 1, 128)
        assert (wob.n, wob.k, wob.split_k, wob.ctas) == (5120, 2048, 1, 80)
        assert qr.SMEM_BUDGET < wob.smem_bytes <= qr.SMEM_BUDGET_WHOLE   # 64 x 2080 + 32 KB x


def test_smem_layout_is_disjoint_and_aligned():
    for s in qr.qg_specs(ModelConfig.preset("v41-flash"), 4) + qr.qg_specs(
            ModelConfig.preset("tiny"), 4):
        spans = sorted((off, off + size) for off, size in s.layout().values() if size)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
        assert s.layout()["x"][0] % 128 == 0 and s.row_stride % 128 == 32


# ---- the fragments ----------------------------------------------------------------------------

def a_coords(warp: int, lane: int, reg: int, byte: int) -> tuple[int, int]:
    """CUTLASS ALayout_64x32 (register-sourced 8-bit A of wgmma m64nNk32): (m, k)."""
    g, t = lane // 4, lane % 4
    return 16 * warp + g + 8 * (reg % 2), 4 * t + byte + 16 * (reg // 2)


def c_coords(warp: int, lane: int, reg: int) -> tuple[int, int]:
    g, t = lane // 4, lane % 4
    return 16 * warp + g + 8 * (reg // 2), 2 * t + reg % 2


def test_logical_k_is_a_permutation_of_the_block():
    assert sorted(qr.logical_k(a) for a in range(32)) == list(range(32))


def test_fragment_replay_gives_w_times_x_for_one_k_step():
    """What the kernel loads (a_word_offsets from the bulk-copied rows) and writes (b_offset),
    decoded with the hardware layouts (A: ALayout_64x32; B: K-major core matrices through
    `descriptor`), multiplies to W . x over the step's actual 32 K."""
    rng = np.random.default_rng(1)
    stride, step = 1280 + qr.ROW_PAD, 3
    w = rng.integers(-8, 8, size=(64, 1280)).astype(np.float64)
    x = rng.integers(-8, 8, size=(8, 1280)).astype(np.float64)
    smem_w = np.full(64 * stride, np.nan)
    for r in range(64):
        smem_w[r * stride:r * stride + 1280] = w[r]
    smem_x = np.full(40 * qr.B_STEP_BYTES, np.nan)
    for token in range(8):
        for a in range(32):
            smem_x[qr.b_offset(step, 0, token, a)] = x[token, 32 * step + a]
    A = np.full((64, 32), np.nan)
    for warp in range(4):
        for lane in range(32):
            for reg, off in enumerate(qr.a_word_offsets(lane, step, stride)):
                for byte in range(4):
                    A[a_coords(warp, lane, reg, byte)] = smem_w[16 * warp * stride + off + byte]
    desc = qr.descriptor(step * qr.B_STEP_BYTES)
    start, lbo, sbo = (desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4, (desc >> 32) << 4
    assert lbo == sbo == 128 and start == step * qr.B_STEP_BYTES
    B = np.array([[smem_x[start + (k // 16) * lbo + n * 16 + k % 16] for n in range(8)]
                  for k in range(32)])
    assert not np.isnan(A).any() and not np.isnan(B).any()
    D = A @ B
    want = w[:, 32 * step:32 * step + 32] @ x[:, 32 * step:32 * step + 32].T
    got = np.full((64, 8), np.nan)
    for warp in range(4):
        for lane in range(32):
            for reg in range(4):
                got[c_coords(warp, lane, reg)] = D[c_coords(warp, lane, reg)]
    assert np.array_equal(got, want)


# ---- the split of x --------------------------------------------------------------------------

def _spec(n=256, k=1280):
    return qr.make_qg_spec("wq_b", n, k)


def test_split_parts_are_e4m3_and_within_the_bound():
    spec = _spec()
    rng = np.random.default_rng(2)
    x = qr.random_wide_rows(rng, 8, spec.k)
    hi, lo, inv_s = qr.split_x(spec, x)
    for part in (hi, lo):
        assert np.array_equal(part.astype(E4M3).astype(np.float32), part)
        assert np.abs(part).max() < 448
    xt = qr.split_dequant(spec, x)
    err = np.abs(xt - x.astype(np.float64))
    per_k = np.repeat(inv_s, spec.slice_k, axis=1)
    assert np.all(err <= (2.0**-10 + 2.0**-25) * per_k)
    # elements within 2^-9 of their slice's row max are exact (bf16 has 8 bits, hi + lo 8)
    kc = spec.slice_k
    for sl in range(spec.split_k):
        xs = x[:, sl * kc:(sl + 1) * kc].astype(np.float64)
        big = np.abs(xs) >= np.abs(xs).max(axis=1, keepdims=True) * 2.0**-9
        assert np.all(err[:, sl * kc:(sl + 1) * kc][big] == 0)
    assert not xt[4].any()                            # the zero row stays zero


def test_split_error_bound_covers_the_product():
    spec = _spec()
    rng = np.random.default_rng(3)
    x = qr.random_wide_rows(rng, 8, spec.k)
    w = random_e4m3(rng, (spec.n, spec.k))
    s = rng.integers(112, 125, size=(spec.n // 32, spec.k // 32)).astype(np.uint8)
    wf = fp8_block_dequantize(w, s).astype(np.float64)
    exact = x.astype(np.float64) @ wf.T
    assert np.all(np.abs(qr.dense_qgmma_ref(spec, x, wf) - exact)
                  <= qr.split_error_bound(spec, x, np.abs(wf)) * (1 + 2.0**-14))


# ---- the model of the kernel against the bound ------------------------------------------------

def _case(spec, seed, rows=8, gaussian=False):
    """Inputs; `gaussian`: weights as a checkpoint's (normal, quantized to E4M3) instead of
    every code uniformly, whose few huge weights would hide a wrong block of small ones."""
    rng = np.random.default_rng(seed)
    x = qr.random_wide_rows(rng, rows, spec.k)
    w = (rng.standard_normal((spec.n, spec.k)) * 16).astype(np.float32).astype(E4M3) \
        if gaussian else random_e4m3(rng, (spec.n, spec.k))
    s = rng.integers(112, 125, size=(spec.n // 32, spec.k // 32)).astype(np.uint8)
    wf = fp8_block_dequantize(w, s).astype(np.float64)
    return x, w, s, wf


def _within(spec, got, x, wf) -> bool:
    y = got.astype(BF16).astype(np.float64)
    return bool(np.all(np.abs(y - qr.dense_qgmma_ref(spec, x, wf))
                       <= qr.qgmma_tolerance(spec, x, wf)))


@pytest.mark.parametrize("variant", [qr.VARIANT, qr.VARIANT_WIDE])
@pytest.mark.parametrize("shape", [(256, 1280), (128, 5120), (768, 256)])
def test_model_of_the_kernel_is_within_the_bound(shape, variant):
    spec = qr.make_qg_spec("wq_b", *shape, variant)
    for seed in range(2):
        x, w, s, wf = _case(spec, seed)
        assert _within(spec, qr.qgmma_model(spec, x, w, s), x, wf)
    # looser hardware (10 bits kept instead of 13) still passes: the bound has margin
    assert _within(spec, qr.qgmma_model(spec, x, w, s, acc_bits=11), x, wf)


def test_whole_k_model_is_within_the_bound():
    """wo_b's arrangement (one slice of K = 2048, 32 k-steps per warpgroup) on the CPU model."""
    spec = qr.make_qg_spec("wo_b", 128, 2048, whole_k=True)
    assert (spec.split_k, spec.wg_steps, spec.ctas) == (1, 32, 2)
    with pytest.raises(ValueError, match="slice"):
        qr.make_qg_spec("wo_b", 5120, 2048)            # v41 wo_b: 1 slice > MAX_SLICE_K, 2 > 1 wave
    for seed in range(2):
        x, w, s, wf = _case(spec, seed)
        assert _within(spec, qr.qgmma_model(spec, x, w, s), x, wf)


@pytest.mark.parametrize("shape", [(256, 1280), (128, 5120)])
def test_a_wrong_element_fails_the_bound(shape):
    spec = _spec(*shape)
    x, w, s, wf = _case(spec, 7, gaussian=True)
    model = qr.qgmma_model

    def drop(step):
        return lambda st, p: p * 0 if st == step else p

    def double(step):
        return lambda st, p: p * 2 if st == step else p

    s_bad = s.copy()
    s_bad[1, 5] += 1                                   # one 32 x 32 block scale off by 2
    w_rows = w.copy()
    w_rows[[3, 4]] = w_rows[[4, 3]]                    # two rows swapped
    x_tok = x.copy()
    x_tok[[0, 5]] = x_tok[[5, 0]]                      # two tokens swapped
    hi_only = qr.split_x                              # the lo part dropped

    def split_hi_only(spec_, x_):
        hi, lo, inv = hi_only(spec_, x_)
        return hi, lo * 0, inv

    cases = {"dropped k-step": model(spec, x, w, s, fault=drop(5)),
             "doubled k-step": model(spec, x, w, s, fault=double(11)),
             "scale block": model(spec, x, w, s_bad),
             "swapped rows": model(spec, x, w_rows, s),
             "swapped tokens": model(spec, x_tok, w, s)}
    qr.split_x = split_hi_only
    try:
        cases["lo dropped"] = model(spec, x, w, s)
    finally:
        qr.split_x = hi_only
    for what, got in cases.items():
        assert not _within(spec, got, x, wf), f"{what}: passes the bound"


# ---- the benchmark row -----------------------------------------------------------------------

def test_family_benchmark_times_the_candidates_beside_the_step_kernel(tiny_bundle_dir):
    """executor/bench_dense.py picks the `_sqg` kernels up as QgSpecs of their layer (label),
    shown as candidates, and launches them with the spec's grid and the workspace / counters a
    K split needs; the step's own lookup (launches/dense.dense_spec) never returns them."""
    from executor import bench_dense as bd
    from executor.hostmem import ManifestBundle
    from executor.launches import dense as ld
    bundle = ManifestBundle(tiny_bundle_dir)
    specs = bd.narrow(bd._dense_specs(bundle), "wqa_wkv,wq_b,wo_b")
    qg = [s for s in specs if isinstance(s, qr.QgSpec)]
    assert sorted(s.name for s in qg) == sorted(s.name for s in qr.qg_specs(
        ModelConfig.preset("tiny"), 4))
    ptrs = {"x": 1 << 40, "weight": 2 << 40, "scales": 3 << 40, "out": 4 << 40,
            "workspace": 5 << 40, "counters": 6 << 40}
    for spec in qg:
        assert not bd._shown_name(spec).endswith("*]")
        assert spec in bd._for_rows(specs, 1) and spec not in bd._for_rows(specs, 17)
        launch = ld.dense_launch(bundle, spec, ptrs, 6)
        assert launch.grid == (spec.ctas, 1, 1) and launch.pdl
        assert launch.args == (ptrs["x"], ptrs["weight"], ptrs["scales"], ptrs["x"], ptrs["out"],
                               ptrs["workspace"], ptrs["counters"], 6)
        split = spec.split_k > 1
        assert ("workspace" in ld.dense_uses(spec)) == split == ("counters" in ld.dense_uses(spec))
        label = bd._label(spec)
        assert ld.dense_spec(bundle, label, 6).name != spec.name


# ---- ptxas keeps the wgmmas asynchronous --------------------------------------------------------

_PTXAS_PROBE = """
import json, sys
from kernels import build
from kernels import dense_qgmma_ref as qr
from loader.config import ModelConfig
specs = qr.qg_specs(ModelConfig.preset(sys.argv[1]), 4)
if sys.argv[1] == "v41-flash":
    specs.append(qr.make_qg_spec("wq_b", 8192, 1280, qr.VARIANT_WIDE))
logs = {s.name: build.compile_job("kernels.dense_qgmma", s)["log"] for s in specs}
print(json.dumps({n: ["Function properties" in g, "C7512" in g] for n, g in logs.items()}))
"""


@pytest.mark.parametrize("config", ["tiny", "v41-flash"])
def test_ptxas_does_not_serialize_the_wgmmas(config):
    """ptxas -v (the build's captured log) without C7512 "wgmma.mma_async instructions are
    serialized": under register pressure ptxas waits after every QGMMA, which the build's spill
    check does not see (it happened with 4 warpgroups and 4 groups in flight, and at wq_b with 4
    warpgroups at all: a wq_b `_sqg4` is compiled here to show the check catches it). In a fresh
    process: after other compiles in this one the DSL's log did not reach compile_job."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", _PTXAS_PROBE, config], cwd=root, text=True,
                         capture_output=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    for name, (has_log, serialized) in found.items():
        assert has_log, f"{name}: no ptxas -v log captured"
        assert serialized == name.startswith("dense_w8a16_wq_b_n8192_k1280_r8_bf16_sqg4"), \
            f"{name}: ptxas serialized the wgmmas (or the check no longer catches it)"


# ---- coverage: every output column and every k32 step exactly once --------------------------------

@pytest.mark.parametrize("config", ["tiny", "v41-flash"])
def test_grid_covers_every_column_and_k_step_once(config):
    """The kernel's index arithmetic (tile = cta // split, slice = cta % split, warpgroup j takes
    steps [j wg_steps, (j+1) wg_steps) of the slice, the store's 16 wq + g + 8 (q // 2) rows)
    replayed: every (column, k32 step) pair is multiplied exactly once."""
    for s in qr.qg_specs(ModelConfig.preset(config), 4):
        hits = np.zeros((s.n, s.k // qr.KSTEP), np.int64)
        stored = np.zeros(s.n, np.int64)
        for cta in range(s.grid(1)[0]):
            tile, sl = cta // s.split_k, cta % s.split_k
            for wg in range(s.warpgroups):
                steps = sl * s.steps + wg * s.wg_steps + np.arange(s.wg_steps)
                hits[tile * 64:(tile + 1) * 64, steps] += 1
            if sl == s.split_k - 1:                       # one store per tile (its last slice)
                for wq, lane, q in itertools.product(range(4), range(32), range(4)):
                    if 2 * (lane % 4) + q % 2 == 0:       # token 0
                        stored[tile * 64 + 16 * wq + lane // 4 + 8 * (q // 2)] += 1
        assert (hits == 1).all() and (stored == 1).all(), s.name


# ---- the x split as compiled: the e4m3 -> f16 back-conversions read the hi bytes -----------------

def _nvdisasm():
    import os
    import shutil
    from pathlib import Path
    for cand in (os.environ.get("HOPDEC_NVDISASM"), shutil.which("nvdisasm"),
                 "/usr/local/cuda/bin/nvdisasm"):
        if cand and Path(cand).is_file():
            return cand
    return None


def unpack_sources_not_from_hi(sass: str) -> list[str]:
    """SASS lines `F2FP.F16.E4M3.UNPACK_B Rd, Rs` whose Rs was last written by anything but an
    F2FP.SATFINITE.E4M3 (the hi bytes) or a PRMT: the DSL's PTX compiler once sourced half of
    them from R0 (blockIdx.x), which made lo = e4m3(xs - garbage)."""
    import re
    lines = [ln.split("*/", 1)[1].strip() for ln in sass.splitlines()
             if re.match(r"\s*/\*[0-9a-f]{4}\*/", ln)]
    bad = []
    for i, ln in enumerate(lines):
        m = re.match(r"(@!?P\d )?F2FP\.F16\.E4M3\.UNPACK_B R\d+, (R\d+)[.\w]* ;", ln)
        if not m:
            continue
        writer = next((mm.group(2) for p in reversed(lines[:i])
                       if (mm := re.match(r"(@!?U?P\w+ )?([A-Z0-9_.]+) (R\d+)[,. ]", p))
                       and mm.group(3) == m.group(2)), None)
        if writer is None or not writer.startswith(("F2FP.SATFINITE.E4M3", "PRMT")):
            bad.append(f"{ln} (source last written by {writer})")
    return bad


def test_unpack_check_catches_the_r0_miscompile():
    bad = ("        /*1420*/                   F2FP.SATFINITE.E4M3.F16.UNPACK_B_MERGE_C R28, R10, RZ ;\n"
           "        /*1440*/                   F2FP.F16.E4M3.UNPACK_B R27, R28 ;\n"
           "        /*1480*/                   F2FP.F16.E4M3.UNPACK_B R8, R0 ;\n")
    assert len(unpack_sources_not_from_hi("        /*0040*/                   S2R R0, "
                                          "SR_CTAID.X ;\n" + bad)) == 1


def test_compiled_split_converts_back_the_hi_bytes(tiny_bundle_dir):
    """Every e4m3 -> f16 back-conversion in the bundle's QGMMA cubins reads the hi bytes just
    made (needs nvdisasm: PATH, /usr/local/cuda/bin or $HOPDEC_NVDISASM; skipped without)."""
    import json
    import subprocess
    tool = _nvdisasm()
    if tool is None:
        pytest.skip("no nvdisasm")
    manifest = json.loads((tiny_bundle_dir / "manifest.json").read_text())
    names = [n for n, rec in manifest["kernels"].items() if rec["family"] == "kernels.dense_qgmma"]
    assert names
    for name in names:
        sass = subprocess.run([tool, "-c", str(tiny_bundle_dir / manifest["kernels"][name]["cubin"])],
                              capture_output=True, text=True, check=True).stdout
        assert "F2FP.F16.E4M3.UNPACK_B" in sass, name
        assert not unpack_sources_not_from_hi(sass), (name, unpack_sources_not_from_hi(sass))
