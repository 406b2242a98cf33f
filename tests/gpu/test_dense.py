"""GPU tests of the dense W8A16, grouped wo_a and lm_head kernels against their NumPy references.

Every shape the bundles hold (tiny: HOPDEC_BUNDLE, V4.1-Flash TP4: HOPDEC_BUNDLE_V41), rows in
{1, 5, 6, 8, 17, 48, 192}, fresh random inputs, outputs poisoned with NaN before each launch, every
element checked, rows past `rows` checked untouched, and a second launch compared bitwise (the
split-K / argmax counters must be back at zero for it to be right). The dense cases (weights,
launch, check) are tests/gpu/dense_cases.py, shared with test_dense_tile_epilogues.

Tolerances (kernels/dense_ref.dense_tolerance, lm_head_ref.logits_tolerance): the kernel sums in
fp32 in another order than NumPy, so it is compared with the float64 product within the fp32
recursive-summation bound 2*(K-1)*2^-24*sum|x*w| plus half a bf16 ulp (2^-8*|y|) where the output
is bf16; the shared expert's "swiglu" and "add_f32" epilogues propagate it through their
roundings (dense_ref.epilogue_expectation). A wrong scale block (factor 2), a wrong K permutation
or a gate paired with the wrong up row exceeds that bound (see tests/test_dense_cpu.py). The argmax is compared exactly with NumPy's argmax of the kernel's own
logits (the logits kernel sums in the same order as the argmax kernel).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from dense_cases import DenseCase, dense_spec_of, records

from executor.runtime import Arena, Bundle, LaunchSpec
from kernels import dense_ref as dr
from kernels import lm_head_ref as lr
from kernels.common_ref import BF16

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

ROWS = (1, 5, 6, 8, 17, 48, 192)
BUNDLES = {"tiny": os.environ.get("HOPDEC_BUNDLE", "build/bundle-tiny"),
           "v41-flash": os.environ.get("HOPDEC_BUNDLE_V41", "build/bundle-v41-flash-tp4")}


@pytest.fixture(scope="module", params=list(BUNDLES))
def bundle(request, dev):
    path = Path(BUNDLES[request.param])
    if not (path / "manifest.json").is_file():
        pytest.skip(f"no kernel bundle at {path}")
    b = Bundle.load(dev, path)
    yield b
    b.close()


def _rows_for(spec: dr.DenseSpec) -> tuple[int, ...]:
    """Main variants (r8: R <= 8, r32: R > 8) at every R; the other variant and the extra
    epilogues at a few R (every kernel still runs a multi-pass R)."""
    fused = spec.epilogue in ("swiglu", "add_f32")   # the shared expert's step kernels
    if spec.streamed:                             # R <= 8 only (grid() rejects more)
        return (1, 5, 6, 8) if spec.epilogue == "bf16" or fused else (6, 8)
    if fused:
        return (1, 8, 17, 48, 192)
    if spec.epilogue != "bf16":
        return (6, 48)
    return ROWS if spec.row_tiles == 1 else (1, 8, 17, 48, 192)


def test_dense_and_wo_a_kernels_match_the_reference(bundle, dev, stream):
    recs = records(bundle, "kernels.dense") + records(bundle, "kernels.wo_a")
    assert recs, "bundle has no dense kernels"
    rng = np.random.default_rng()
    by_shape: dict = {}
    for rec in recs:
        spec = dense_spec_of(rec)
        by_shape.setdefault((spec.groups, spec.n, spec.k), []).append(spec)
    for specs in by_shape.values():
        case = DenseCase(dev, specs, rng)
        try:
            for spec in specs:
                for rows in _rows_for(spec):
                    first = case.run(bundle, spec, rows, stream)
                    case.check(spec, rows, first)
                    again = case.run(bundle, spec, rows, stream)
                    assert np.array_equal(first, again), f"{spec.name} R={rows}: not bit-stable"
        finally:
            case.close()


def test_dense_timeline_kernels_stamp_every_point_in_order(bundle, dev, stream):
    """The `_timeline` kernels (dense_ref.timeline_specs): the reference's output, and in every CTA's
    row of the workspace all (globaltimer, clock64) stamps, non-decreasing in program order, on
    a real SM, nothing written past the row's used words (executor/dense_timeline.py)."""
    from executor.dense_timeline import Stamps
    specs = [s for s in map(dense_spec_of, records(bundle, "kernels.dense")) if s.timeline]
    assert specs, "bundle has no dense timeline kernels"
    rng = np.random.default_rng()
    used = 2 * len(dr.TIMELINE_POINTS) + 1
    for spec in specs:
        case = DenseCase(dev, [spec], rng)
        try:
            for rows in (1, 6):
                case.arena.fill("ws", 0)
                cp.cuda.Device().synchronize()
                case.check(spec, rows, case.run(bundle, spec, rows, stream))
                raw = case.arena.download("ws", np.uint64, (spec.ctas, dr.TIMELINE_WORDS))
                stamps = Stamps.parse(raw, f"{spec.name} R={rows}")   # raises if one is missing
                assert not raw[:, used:].any(), f"{spec.name}: wrote past the stamps"
                assert np.all((stamps.smid >= 0) & (stamps.smid < dev.sm_count)), spec.name
                for what, v in (("globaltimer", stamps.gt), ("clock64", stamps.clk)):
                    assert np.all(np.diff(v, axis=1) >= 0), f"{spec.name}: {what} goes back"
                span = stamps.gt[:, -1].max() - stamps.gt[:, 0].min()
                assert 0 < span < 10**9, f"{spec.name}: launch spans {span} ns"
        finally:
            case.close()


# ---- lm_head -----------------------------------------------------------------------------------

def _head_case(vocab: int, hidden: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((lr.MAX_ROWS, hidden)).astype(BF16)
    head = (rng.standard_normal((vocab, hidden)) * hidden**-0.5).astype(BF16)
    # Planted ties: x row r gets a dominant vocab row, repeated at other indices (same tile half,
    # another tile): equal weights give bit-equal logits, and the lowest index must win.
    winners = {}
    slots = rng.permutation(vocab // 48)           # disjoint 48-row windows, one per planted row
    for r in range(min(lr.MAX_ROWS, vocab // 48)):
        base = int(slots[r]) * 48 + int(rng.integers(0, 8))
        row = (x[r].astype(np.float32) * 0.25).astype(BF16)
        for v in (base, base + 8, base + 16 * 2 + 3):
            head[v] = row
        winners[r] = base
    return x, head, winners


def test_lm_head_logits_and_split_vocab_argmax(bundle, dev, stream):
    recs = records(bundle, "kernels.lm_head")
    assert recs, "bundle has no lm_head kernels"
    vocab, hidden = recs[0].spec["vocab"], recs[0].spec["hidden"]
    x, head, winners = _head_case(vocab, hidden, int(np.random.default_rng().integers(1 << 30)))
    exact = x.astype(np.float64) @ head.astype(np.float64).T
    bound = lr.logits_tolerance(x, head)
    offset = 3 * vocab                         # as rank 3 of 4
    specs = {(r.spec["mode"], r.spec["row_tiles"], r.spec.get("variant", "mma")):
             lr.spec_from_dict(r.spec) for r in recs}
    for key, spec in specs.items():
        assert spec.to_dict() == bundle.manifest.kernels[spec.name].spec, f"{key}: spec differs"
    reqs = [("x", x.nbytes), ("w", head.nbytes), ("logits", lr.MAX_ROWS * vocab * 4),
            ("pairs", lr.MAX_ROWS * 8), ("keys", lr.MAX_ROWS * 8),
            ("cnt", max(s.counters_bytes() for s in specs.values()))]
    with Arena(dev, reqs) as a:
        a.view("x", np.uint16)[:] = cp.asarray(x.view(np.uint16).ravel())
        a.view("w", np.uint16)[:] = cp.asarray(head.view(np.uint16).ravel())
        a.view("keys", np.uint64)[:] = 0
        a.view("cnt", np.uint32)[:] = 0
        logits_v = a.view("logits", np.uint32, (lr.MAX_ROWS, vocab))
        pairs_v = a.view("pairs", np.int32, (lr.MAX_ROWS, 2))

        def launch(spec, rows, out_name):
            view = logits_v if out_name == "logits" else pairs_v
            view[:] = 0x7FC00000 if out_name == "logits" else -1
            cp.cuda.Device().synchronize()
            LaunchSpec(bundle.kernel(spec.name), spec.grid(rows),
                       (a.ptr("x"), a.ptr("w"), a.ptr(out_name), a.ptr("keys"), a.ptr("cnt"),
                        rows, offset)).launch(stream)
            stream.synchronize()
            return cp.asnumpy(view)

        for rt, variant in sorted({key[1:] for key in specs}):
            tag = f"r{8 * rt} {variant}"
            for rows in (ROWS if variant == "mma" else (1, 5, 6, 8)):
                raw = launch(specs[("logits", rt, variant)], rows, "logits")
                assert np.all(raw[rows:] == 0x7FC00000), f"logits {tag} wrote past row {rows}"
                logits = raw[:rows].view(np.float32)
                err = np.abs(logits.astype(np.float64) - exact[:rows])
                assert np.isfinite(logits).all() and np.all(err <= bound[:rows]), \
                    f"lm_head logits {tag} R={rows}: max err {err.max()}"
                pairs = launch(specs[("argmax", rt, variant)], rows, "pairs")
                assert np.all(pairs[rows:] == -1), f"argmax {tag} wrote past row {rows}"
                want = lr.lm_head_argmax_ref(logits, offset)
                assert np.array_equal(pairs[:rows], want), \
                    f"lm_head argmax {tag} R={rows}: first mismatch row " \
                    f"{int(np.argmax(np.any(pairs[:rows] != want, axis=1)))}"
                for r, base in winners.items():
                    if r < rows:
                        assert pairs[r, 1] == base + offset, f"tie at row {r} not to the lowest"
                again = launch(specs[("argmax", rt, variant)], rows, "pairs")
                assert np.array_equal(pairs, again), f"argmax {tag} R={rows}: not bit-stable"
        assert not cp.asnumpy(a.view("keys", np.uint64)).any(), "argmax left its keys dirty"
        assert not cp.asnumpy(a.view("cnt", np.uint32)).any(), "argmax left its counters dirty"
