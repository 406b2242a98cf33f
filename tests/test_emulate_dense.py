"""CPU emulation of the dense W8A16, grouped wo_a and lm_head launches, built by
executor/launches/dense.py over a HostArena exactly as the step and the benchmarks build them.

Mirrors tests/gpu/test_dense.py: every kernel of the tiny bundle, fresh random inputs (random e4m3
bytes over every finite code, UE8M0 scales 112..124), outputs poisoned with 0xFF, rows in
{1, 5, 8} for the 8-row kernels and {9, 48, 192} for the 32-row ones inside buffers sized for 192
rows (so every R < 192 is a padded bucket), every element compared with the float64 product
within the GPU test's bound: the fp32 recursive-summation bound 2*(K-1)*2^-24*sum|x*w| plus half
a bf16 ulp (2^-8*|y|) for bf16 outputs (the emulator sums in fp32 in NumPy's order, the kernel in
its own; both sit inside it). Rows past `rows` must still be poison. The argmax is compared
exactly with lm_head_argmax_ref of the emulated logits, planted ties must go to the lowest index.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from executor.bundle import KernelRecord
from executor.emulate import run
from executor.emulate.dense import workspace_written
from executor.hostmem import AddressSpace, HostArena, ManifestBundle, OutOfBounds
from executor.launch import LaunchSpec
from executor.launches import dense as ld
from kernels import dense_ref as dr
from kernels import lm_head_ref as lr
from kernels.common_ref import BF16
from loader.formats import fp8_block_dequantize

PREFIXES = {"kernels.dense": "dense_w8a16", "kernels.wo_a": "wo_a_fp8"}


@pytest.fixture(scope="module")
def bundle(tiny_bundle_dir):
    return ManifestBundle(tiny_bundle_dir)


def _dense_specs(bundle) -> list[tuple[str, dr.DenseSpec]]:
    out = []
    for name in bundle.names():
        rec = bundle.kernel(name)
        if rec.family in PREFIXES:
            spec = dr.DenseSpec.from_dict(rec.spec)
            assert spec.to_dict() == rec.spec, f"{name}: manifest spec differs from DenseSpec"
            out.append((rec.family, spec))
    assert out, "tiny bundle has no dense kernels"
    return out


def _rows_for(spec) -> tuple[int, ...]:
    return (1, 5, 8) if spec.row_tiles == 1 else (9, 48, 192)


class DenseInputs:
    """One shape's random weights and MAX_ROWS rows of x / residual, exact float64 products."""

    def __init__(self, spec: dr.DenseSpec, rng):
        g, n, k = spec.groups, spec.n, spec.k
        self.w = dr.random_e4m3(rng, (g, n, k))
        self.s = rng.integers(112, 125, size=(g, n // 32, k // 32)).astype(np.uint8)
        self.x = rng.standard_normal((dr.MAX_ROWS, g * k)).astype(BF16)
        self.res = rng.standard_normal((dr.MAX_ROWS, g * n)).astype(BF16)
        self.res_f32 = rng.standard_normal((dr.MAX_ROWS, g * n)).astype(np.float32)
        self.exact, self.acc_bound = self._products(self.w)
        self.swiglu_products = None         # the same bytes read as interleave_gate_up'd rows

    def _products(self, w):
        g, n, k = w.shape
        exact, acc_bound = np.empty((dr.MAX_ROWS, g * n)), np.empty((dr.MAX_ROWS, g * n))
        for gi in range(g):
            wf = fp8_block_dequantize(w[gi], self.s[gi]).astype(np.float64)
            xg = self.x[:, gi * k:(gi + 1) * k].astype(np.float64)
            exact[:, gi * n:(gi + 1) * n] = xg @ wf.T
            acc_bound[:, gi * n:(gi + 1) * n] = dr.dense_tolerance(xg, wf, "f32")
        return exact, acc_bound

    def arena(self, spec: dr.DenseSpec, space: AddressSpace) -> HostArena:
        arena = HostArena(space, ld.dense_requests(spec, dr.MAX_ROWS), name=spec.name)
        res = self.res_f32 if spec.epilogue == "add_f32" else self.res
        for name, host in (("x", self.x), ("weight", self.w), ("scales", self.s),
                           ("residual", res)):
            if name in arena.slices:
                arena.upload(name, host)
        arena.fill("out", 0xFF)
        return arena

    def check(self, spec: dr.DenseSpec, rows: int, raw: np.ndarray) -> None:
        poison = 0xFFFF if spec.out_dtype == "bf16" else 0xFFFFFFFF
        assert np.all(raw[rows:] == poison), f"{spec.name}: wrote past row {rows}"
        got = raw[:rows].view(BF16 if spec.out_dtype == "bf16" else np.float32)
        got = got.astype(np.float64)
        exact, acc = self.exact, self.acc_bound
        if spec.epilogue == "swiglu":
            if self.swiglu_products is None:
                self.swiglu_products = self._products(dr.deinterleave_gate_up(self.w))
            exact, acc = self.swiglu_products
        res = self.res_f32 if spec.epilogue == "add_f32" else self.res
        exact, bound = dr.epilogue_expectation(spec, exact[:rows], acc[:rows], res[:rows])
        assert np.isfinite(got).all(), f"{spec.name} R={rows}: poison left in the output"
        bad = np.argwhere(np.abs(got - exact) > bound)
        assert bad.size == 0, (f"{spec.name} R={rows}: {len(bad)} elements out of bound, first "
                               f"{tuple(bad[0])}: got {got[tuple(bad[0])]}, exact "
                               f"{exact[tuple(bad[0])]}, bound {bound[tuple(bad[0])]}")


def _label(family: str, spec: dr.DenseSpec) -> str:
    return spec.name.removeprefix(PREFIXES[family] + "_").split(f"_n{spec.n}_k")[0]


def _launch_and_check(bundle, spec, inputs: DenseInputs, rows: int) -> HostArena:
    space = AddressSpace()
    arena = inputs.arena(spec, space)
    ptrs = {name: arena.ptr(name) for name in arena.slices}
    assert run([ld.dense_launch(bundle, spec, ptrs, rows)], space) == 1
    out_t = np.uint16 if spec.out_dtype == "bf16" else np.uint32
    inputs.check(spec, rows, arena.download("out", out_t, (dr.MAX_ROWS, spec.out_width)))
    if "counters" in arena.slices:
        assert not arena.view("counters", np.uint8).any(), f"{spec.name}: counters left dirty"
    return arena


def test_every_dense_and_wo_a_launch_equals_the_reference(bundle):
    rng = np.random.default_rng()
    cases: dict = {}
    specs = _dense_specs(bundle)
    for family, spec in specs:
        shape = (spec.groups, spec.n, spec.k)
        if shape not in cases:
            cases[shape] = DenseInputs(spec, rng)
        label, prefix = _label(family, spec), PREFIXES[family]
        step_kernel = spec.name.endswith(f"_{spec.epilogue}")   # candidates carry a variant tag
        for rows in _rows_for(spec):
            # the picker hands the step exactly this kernel at this R (a candidate: never)
            picked = ld.dense_spec(bundle, label, rows, spec.epilogue, prefix)
            assert (picked == spec) == step_kernel, f"{spec.name} R={rows}: picker chose {picked.name}"
            _launch_and_check(bundle, spec, cases[shape], rows)
    assert {s.variant for _, s in specs} >= set(dr.STREAM_VARIANTS), "a streamed variant missing"
    assert any(s.split_k > 1 for _, s in specs), "no split-K kernel covered"
    assert {s.epilogue for _, s in specs} == set(dr.EPILOGUES)


def test_wo_a_picker_and_split_k_workspace(bundle):
    spec = ld.wo_a_spec(bundle, 48)
    assert spec.groups > 1 and spec.split_k > 1 and spec.row_tiles == 4
    inputs = DenseInputs(spec, np.random.default_rng())
    space = AddressSpace()
    arena = inputs.arena(spec, space)
    arena.fill("workspace", 0x5A)
    run([ld.dense_launch(bundle, spec, {n: arena.ptr(n) for n in arena.slices}, 48)], space)
    ws = arena.view("workspace", np.uint32)
    passes = 2                                   # 48 rows at 32 per pass
    written = passes * spec.split_k * spec.tiles * dr.TILE_N * spec.rows_per_pass
    assert np.all(ws[:written] == 0xFFFFFFFF) and np.all(ws[written:] == 0x5A5A5A5A)


def _owner(spec: dr.DenseSpec, unit: int) -> int:
    return next(c for c in range(spec.ctas) if spec.unit_range(c)[0] <= unit
                < spec.unit_range(c)[1])


def test_streamed_kernel_with_tiles_shared_across_ctas():
    """A streamed grouped spec whose tiles straddle CTAs (none in the tiny bundle): the
    workspace slots written are exactly (cta, first/last tile) of every straddled tile."""
    spec = dr.make_spec("grouped", 576, 2048, groups=2, prefix="wo_a_fp8", variant="stream")
    shared = {}
    for tile in range(spec.tiles):
        ctas = sorted({_owner(spec, u) for u in range(tile * spec.ksteps,
                                                       (tile + 1) * spec.ksteps)})
        if len(ctas) > 1:
            shared[tile] = ctas
    want = set()
    for tile, ctas in shared.items():
        for c in ctas:
            first_tile = spec.unit_range(c)[0] // spec.ksteps
            want.add(2 * c + (tile != first_tile))
    assert want and len(want) < 2 * spec.ctas, "want a spec with some slots written, not all"
    slots = {part.start // (dr.TILE_N * dr.ROW_TILE) for part in workspace_written(spec, 8)}
    assert slots == want and len(workspace_written(spec, 8)) == len(want)

    rec = KernelRecord(spec.name, "kernels.wo_a", None, "", dr.PARAMS, spec.block,
                       spec.smem_bytes, True, spec=spec.to_dict())
    fake = SimpleNamespace(kernel=lambda name: rec, names=lambda: [rec.name],
                           manifest=SimpleNamespace(kernels={rec.name: rec}))
    inputs = DenseInputs(spec, np.random.default_rng())
    space = AddressSpace()
    arena = inputs.arena(spec, space)
    arena.fill("workspace", 0x5A)
    run([ld.dense_launch(fake, spec, {n: arena.ptr(n) for n in arena.slices}, 6)], space)
    inputs.check(spec, 6, arena.download("out", np.uint16, (dr.MAX_ROWS, 2 * 576)))
    ws = arena.view("workspace", np.uint32).reshape(-1, dr.TILE_N * dr.ROW_TILE)
    clobbered = {int(i) for i in np.flatnonzero(np.all(ws == 0xFFFFFFFF, axis=1))}
    assert clobbered == want and np.all(np.delete(ws, sorted(want), axis=0) == 0x5A5A5A5A)


def test_bench_launches_are_argument_for_argument_the_old_ones(bundle):
    """executor/bench_dense.py builds through the builder: same kernel, grid, args, pdl."""
    spec = ld.dense_spec(bundle, "wo_b", 8, "residual")
    p = {"x": 1 << 40, "weight": 2 << 40, "scales": 3 << 40, "residual": 1 << 40,
         "out": 4 << 40, "workspace": 5 << 40, "counters": 6 << 40}
    got = ld.dense_launch(bundle, spec, p, 8)
    old = LaunchSpec(bundle.kernel(spec.name), spec.grid(8), (p["x"], p["weight"], p["scales"],
                     p["x"], p["out"], p["workspace"], p["counters"], 8))
    assert (got.kernel, got.grid, got.args, got.pdl) == (old.kernel, old.grid, old.args, old.pdl)
    head = ld.lm_head_spec(bundle, "argmax", 48)
    q = {"x": 1 << 40, "weight": 2 << 40, "out": 3 << 40, "keys": 4 << 40, "counters": 5 << 40}
    got = ld.lm_head_launch(bundle, head, q, 48, 0)
    old = LaunchSpec(bundle.kernel(head.name), head.grid(48), (q["x"], q["weight"], q["out"],
                     q["keys"], q["counters"], 48, 0))
    assert (got.kernel, got.grid, got.args, got.pdl) == (old.kernel, old.grid, old.args, old.pdl)


def test_residual_epilogue_in_place(bundle):
    """out = residual (the residual stream updated in place) is a legal binding."""
    for rows in (8, 48):
        spec = ld.dense_spec(bundle, "shared_w2", rows, "residual")
        inputs = DenseInputs(spec, np.random.default_rng())
        space = AddressSpace()
        arena = inputs.arena(spec, space)
        ptrs = {n: arena.ptr(n) for n in arena.slices}
        run([ld.dense_launch(bundle, spec, {**ptrs, "out": ptrs["residual"]}, rows)], space)
        got = arena.download("residual", np.uint16, (dr.MAX_ROWS, spec.n))
        assert np.array_equal(got[rows:], inputs.res[rows:].view(np.uint16))
        got[rows:] = 0xFFFF                      # check() wants the tail untouched = poison
        inputs.check(spec, rows, got)


def test_wiring_mistakes_fail_as_on_the_gpu(bundle):
    spec = ld.dense_spec(bundle, "wo_b", 8, "residual")
    inputs = DenseInputs(spec, np.random.default_rng())
    space = AddressSpace()
    arena = inputs.arena(spec, space)
    ptrs = {n: arena.ptr(n) for n in arena.slices}
    with pytest.raises(KeyError, match="'residual'"):
        ld.dense_launch(bundle, spec, {k: v for k, v in ptrs.items() if k != "residual"}, 8)
    good = ld.dense_launch(bundle, spec, ptrs, 8)
    with pytest.raises(ValueError, match="grid"):
        run([LaunchSpec(good.kernel, (good.grid[0] + 1,), good.args)], space)
    with pytest.raises(ValueError, match="'out'.*overlaps 'x'"):
        run([ld.dense_launch(bundle, spec, {**ptrs, "out": ptrs["x"] + 256}, 8)], space)
    small = HostArena(space, [("out", 4 * spec.n * 2)], name="small")
    with pytest.raises(OutOfBounds, match="small"):
        run([ld.dense_launch(bundle, spec, {**ptrs, "out": small.ptr("out")}, 8)], space)
    # dirty counters: a kernel that has them (the step's wo_b shares no tile across CTAs)
    spec = next(s for _, s in _dense_specs(bundle) if s.counters_bytes() and s.row_tiles == 1)
    arena = DenseInputs(spec, np.random.default_rng()).arena(spec, space)
    arena.view("counters", np.uint32)[3] = 1
    with pytest.raises(ValueError, match="counters must be zero"):
        run([ld.dense_launch(bundle, spec, {n: arena.ptr(n) for n in arena.slices}, 8)], space)


# ---- lm_head ------------------------------------------------------------------------------------

def _head_case(vocab: int, hidden: int, rng):
    """As tests/gpu/test_dense.py: a dominant vocab row per x row, repeated at higher indices."""
    x = rng.standard_normal((lr.MAX_ROWS, hidden)).astype(BF16)
    head = (rng.standard_normal((vocab, hidden)) * hidden**-0.5).astype(BF16)
    winners = {}
    slots = rng.permutation(vocab // 48)
    for r in range(min(lr.MAX_ROWS, vocab // 48)):
        base = int(slots[r]) * 48 + int(rng.integers(0, 8))
        row = (x[r].astype(np.float32) * 0.25).astype(BF16)
        for v in (base, base + 8, base + 16 * 2 + 3):
            head[v] = row
        winners[r] = base
    return x, head, winners


def test_lm_head_logits_and_argmax_launches(bundle):
    specs = [lr.spec_from_dict(bundle.kernel(n).spec) for n in bundle.names()
             if bundle.kernel(n).family == "kernels.lm_head"]
    assert {(s.mode, s.row_tiles) for s in specs} == {(m, rt) for m in lr.MODES for rt in (1, 4)}
    vocab, hidden = specs[0].vocab, specs[0].hidden
    x, head, winners = _head_case(vocab, hidden, np.random.default_rng())
    exact = x.astype(np.float64) @ head.astype(np.float64).T
    bound = lr.logits_tolerance(x, head)
    offset = 3 * vocab                                 # as rank 3 of 4
    for rows in (1, 5, 8, 9, 48, 192):
        space = AddressSpace()
        launches, arenas = [], {}
        for mode in lr.MODES:
            spec = ld.lm_head_spec(bundle, mode, rows)
            assert spec.row_tiles == (1 if rows <= 8 else 4) and spec.mode == mode
            arena = arenas[mode] = HostArena(space, ld.lm_head_requests(spec, lr.MAX_ROWS))
            arena.upload("x", x)
            arena.upload("weight", head)
            arena.fill("out", 0xFF)
            ptrs = {n: arena.ptr(n) for n in arena.slices}
            launches.append(ld.lm_head_launch(bundle, spec, ptrs, rows, offset))
        assert run(launches, space) == 2
        raw = arenas["logits"].download("out", np.uint32, (lr.MAX_ROWS, vocab))
        assert np.all(raw[rows:] == 0xFFFFFFFF), f"logits wrote past row {rows}"
        logits = raw[:rows].view(np.float32)
        err = np.abs(logits.astype(np.float64) - exact[:rows])
        assert np.isfinite(logits).all() and np.all(err <= bound[:rows]), f"R={rows}: {err.max()}"
        pairs = arenas["argmax"].download("out", np.int32, (lr.MAX_ROWS, 2))
        assert np.all(pairs[rows:] == -1), f"argmax wrote past row {rows}"
        assert np.array_equal(pairs[:rows], lr.lm_head_argmax_ref(logits, offset))
        for r, base in winners.items():
            if r < rows:
                assert pairs[r, 1] == base + offset, f"tie at row {r} not to the lowest index"
        assert not arenas["argmax"].view("keys", np.uint8).any()
        assert not arenas["argmax"].view("counters", np.uint8).any()


def test_lm_head_argmax_needs_zeroed_keys(bundle):
    spec = ld.lm_head_spec(bundle, "argmax", 8)
    space = AddressSpace()
    arena = HostArena(space, ld.lm_head_requests(spec, 8))
    ptrs = {n: arena.ptr(n) for n in arena.slices}
    arena.view("keys", np.uint64)[7] = 1
    with pytest.raises(ValueError, match="keys must be zero"):
        run([ld.lm_head_launch(bundle, spec, ptrs, 8, 0)], space)
    arena.view("keys", np.uint64)[7] = 0
    small = HostArena(space, [("keys", 8 * 8)], name="small_keys")
    with pytest.raises(OutOfBounds, match="small_keys"):     # keys are u64 [MAX_ROWS] at any R
        run([ld.lm_head_launch(bundle, spec, {**ptrs, "keys": small.ptr("keys")}, 8, 0)], space)
    run([ld.lm_head_launch(bundle, spec, ptrs, 8, 0)], space)   # zeroed again: it runs
