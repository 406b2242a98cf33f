"""executor.emulate.moe + executor.launches.moe: the routed-MoE launch lists, built on a HostArena
from the tiny bundle's manifest and run by the CPU emulator, against kernels/moe_ref.

Setup mirrors tests/gpu/test_moe_kernel.py: fresh random fused-E8M0 weights for a pool of experts
at random ids (the others zero, so a wrong expert is caught), packed by mk.pack_experts into the
arena; fresh routings (uniform, all rows on one top-k set, all pairs on distinct experts), bf16 x
and fp32 route weights; every scratch and output buffer poisoned (0xFF) before each chain. Checks:
y against moe_ref.routed_experts on the dequantized weights with mk.check_routed_close (the GPU
test's tolerance) and bit for bit (the emulator runs moe_ref's arithmetic, on the same rows in the
same order), routing lists and quantized x bitwise, and the bytes past the last row written (and
the meta words no kernel writes) still poison. One more case runs specs built from mk (no
cubin) at the real rank's I = 576, whose w2 K has a 64-wide tail group.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from executor.bundle import KernelRecord
from executor.emulate import NoEmulator, emulate_launch, run
from executor.emulate.moe import _w4a8_quantized, emulate
from executor.hostmem import AddressSpace, HostArena, ManifestBundle
from executor.launches import moe as ml
from kernels import moe_kernel_ref as mk
from kernels import moe_ref
from loader import formats as f

POOL = 12
ROWS = (1, 2, 5, 6, 48, mk.MAX_ROWS)
FEW_ROWS = 6            # every variant is emulated up to here; past it, the chain's pick only
SCRATCH = ("meta", "pairs", "xq", "xs", "h", "ye", "y")


def _random_fused(rng, experts, n, k):
    """As the GPU test: random codes (no -0), offsets in [3, 8], lo near a 2^-5 scale."""
    codes = rng.integers(0, 16, (experts, n, k), dtype=np.uint8)
    codes[codes == 8] = 0
    offsets = rng.integers(3, 9, (experts, n, k // 32)).astype(np.uint8)
    lo = rng.integers(110, 116, experts).astype(np.int32)
    return f.FusedE8M0(f.mxfp4_pack(codes), offsets,
                       (np.ldexp(np.float32(1), lo - 127) / 2).astype(np.float32), lo)


class Setup:
    def __init__(self, bundle_dir):
        self.bundle = ManifestBundle(bundle_dir)
        self.shape = shape = ml.shape_from_bundle(self.bundle)
        rng = np.random.default_rng()
        pool = min(POOL, shape.num_experts)
        self.pool_ids = np.sort(rng.choice(shape.num_experts, pool, replace=False))
        w13 = _random_fused(rng, pool, 2 * shape.inter, shape.hidden)
        w2 = _random_fused(rng, pool, shape.hidden, shape.inter)
        packed = mk.pack_experts(w13, w2, dataclasses.replace(shape, num_experts=pool))
        self.space = AddressSpace()
        self.arena = HostArena(self.space, ml.weight_requests(shape) + ml.requests(shape))
        parts = {"codes13": packed.w13.codes, "offsets13": packed.w13.offsets,
                 "codes2": packed.w2.codes, "offsets2": packed.w2.offsets,
                 "scales13": packed.w13.scales, "scales2": packed.w2.scales}
        for name, arr in parts.items():
            view = self.arena.view(name, np.uint8).reshape(shape.num_experts, -1)
            view[...] = 0
            view[self.pool_ids] = np.ascontiguousarray(arr).view(np.uint8).reshape(pool, -1)
        self.shards = [None] * shape.num_experts
        d13, d2 = f.fused_e8m0_dequantize(w13), f.fused_e8m0_dequantize(w2)
        for i, e in enumerate(self.pool_ids):
            self.shards[e] = moe_ref.ExpertShard(d13[i], d2[i])
        self.ptrs = {name: self.arena.ptr(name) for name in self.arena.slices}

    def inputs(self, kind: str, rows: int):
        """(x f32 bf16 values, ids, route weights) uploaded; the model reference's y."""
        rng, k = np.random.default_rng(), self.shape.topk
        if kind == "uniform":
            ids = np.stack([rng.choice(self.pool_ids, k, replace=False) for _ in range(rows)])
        elif kind == "one_expert":
            ids = np.tile(rng.choice(self.pool_ids, k, replace=False), (rows, 1))
        else:
            ids = rng.permutation(self.pool_ids)[:rows * k].reshape(rows, k)
        ids = ids.astype(np.int32)
        weights = rng.random((rows, k)).astype(np.float32)
        x = moe_ref.round_bf16(rng.normal(0, 1, (rows, self.shape.hidden)))
        self.arena.upload("x", f.to_bf16(x))
        self.arena.upload("ids", ids)
        self.arena.upload("route_weights", weights)
        routing = moe_ref.RouterOutput(ids.astype(np.int64), weights)
        want = moe_ref.routed_experts(x, routing, self.shards, self.shape.swiglu_limit)
        return x, ids, want

    def run(self, specs) -> np.ndarray:
        for name in SCRATCH:
            self.arena.fill(name, 0xFF)
        assert run(specs, self.space) == len(specs)
        return self.arena.download("y", np.float32, (mk.MAX_ROWS, self.shape.hidden))


@pytest.fixture(scope="module")
def setup(tiny_bundle_dir):
    return Setup(tiny_bundle_dir)


def _cases():
    for kind in ("uniform", "one_expert"):
        for rows in ROWS:
            yield kind, rows
    for rows in (1, 2):                 # 12 distinct experts: what the pool holds
        yield "distinct", rows


def _check_poison_past(s: Setup, rows: int, y_full: np.ndarray, what: str) -> None:
    """Nothing written past `rows` rows (R*k pairs) in x's and the pairs' buffers."""
    shape, n = s.shape, rows * s.shape.topk
    tails = {"y": (y_full.view(np.uint8).reshape(mk.MAX_ROWS, -1), rows),
             "xq": (s.arena.view("xq", np.uint8, (mk.MAX_ROWS, shape.k13)), rows),
             "xs": (s.arena.view("xs", np.uint8).reshape(mk.MAX_ROWS, -1), rows),
             "h": (s.arena.view("h", np.uint8).reshape(mk.MAX_ROWS * shape.topk, -1), n),
             "ye": (s.arena.view("ye", np.uint8).reshape(mk.MAX_ROWS * shape.topk, -1), n),
             "pairs": (s.arena.view("pairs", np.uint8).reshape(-1, 4), n)}
    for name, (view, first) in tails.items():
        assert (view[first:] == 0xFF).all(), f"{what}: {name} written past row {first}"


def _check_lists(s: Setup, ids: np.ndarray, what: str) -> None:
    """moe_prep's meta and pairs bitwise the reference lists; unwritten meta words poison."""
    e, rows = s.shape.num_experts, ids.shape[0]
    lists = mk.routing_lists(ids, e)
    want = lists.meta(e)
    meta = s.arena.download("meta", np.int32, (mk.meta_words(e),))
    written = np.zeros(mk.meta_words(e), bool)
    written[:2] = True
    for part in range(3):
        lo = mk.META_HEADER + part * e
        written[lo:lo + len(lists.experts)] = True
    np.testing.assert_array_equal(meta[written], want[written], err_msg=f"{what}: meta")
    assert (meta[~written] == -1).all(), f"{what}: meta words no kernel writes were written"
    got_pairs = s.arena.download("pairs", np.int32, (rows * s.shape.topk,))
    np.testing.assert_array_equal(got_pairs, lists.pairs, err_msg=f"{what}: pairs")


def _check_xq(s: Setup, x: np.ndarray, what: str) -> None:
    want_q, want_s = mk.quantize_fragments(x, s.shape.k13)
    np.testing.assert_array_equal(s.arena.download("xq", np.uint8, want_q.shape), want_q,
                                  err_msg=f"{what}: xq")
    np.testing.assert_array_equal(s.arena.download("xs", np.float32, want_s.shape), want_s,
                                  err_msg=f"{what}: xs")


def _check_y(y_full: np.ndarray, want: np.ndarray, what: str) -> np.ndarray:
    y = y_full[:want.shape[0]]
    mk.check_routed_close(y, want, what)
    np.testing.assert_array_equal(y, want, err_msg=f"{what}: not moe_ref's bits")
    return y


@pytest.mark.parametrize(("kind", "rows"), list(_cases()))
def test_default_chain_equals_the_reference(setup, kind, rows):
    s = setup
    x, ids, want = s.inputs(kind, rows)
    available = ml.available_specs(s.bundle, s.shape)
    variants = ([(v, "") for v in ml.variant_names(available, "w13")[1:]]
                + [("", v) for v in ml.variant_names(available, "w2")] + [("", None)])
    if rows > FEW_ROWS:                 # the emulator computes every variant alike: once is enough
        variants = variants[-1:]
    for w13, w2 in variants:
        what = f"default chain ({kind}, R={rows}, w13={w13!r}, w2={w2!r})"
        specs = ml.chain_launches(s.bundle, s.shape, s.ptrs, rows, w13, w2)
        y_full = s.run(specs)
        _check_y(y_full, want, what)
        _check_lists(s, ids, what)
        _check_xq(s, x, what)
        _check_poison_past(s, rows, y_full, what)


@pytest.mark.parametrize(("kind", "rows"), [("uniform", r) for r in ROWS] + [("distinct", 2)])
def test_selfrouted_chains_equal_the_reference(setup, kind, rows):
    s = setup
    x, _, want = s.inputs(kind, rows)
    available = ml.available_specs(s.bundle, s.shape)
    pairs = ([(w13, "") for w13 in ml.variant_names(available, "w13sr")]
             + [("", w2) for w2 in ml.variant_names(available, "w2sr") if w2]
             + [("early", "early"), ("", None)])
    if rows > FEW_ROWS:
        pairs = [("early", "early")]
    for w13, w2 in pairs:
        what = f"self-routed chain ({kind}, R={rows}, w13sr={w13!r}, w2sr={w2!r})"
        y_full = s.run(ml.selfrouted_launches(s.bundle, s.shape, s.ptrs, rows, w13, w2))
        _check_y(y_full, want, what)
        _check_xq(s, x, what)
        _check_poison_past(s, rows, y_full, what)
        for name in ("meta", "pairs"):          # no prep in this chain
            assert (s.arena.view(name, np.uint8) == 0xFF).all(), f"{what}: {name} written"


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 10])
def test_selfrouted_w13w_chain_equals_the_reference(setup, rows):
    """Round 6: xquant -> w13w (register routing, e.g. "bulkw_lean4") -> w2sr early ->
    combine: the reference's y, x quantized, no meta / pairs written; refused past 64 pairs."""
    s = setup
    x, _, want = s.inputs("uniform", rows)
    for w13w in ("bulkw", "bulkw_lean4"):
        what = f"self-routed w13w chain (R={rows}, w13w={w13w!r})"
        y_full = s.run(ml.selfrouted_w13w_launches(s.bundle, s.shape, s.ptrs, rows, w13w))
        _check_y(y_full, want, what)
        _check_xq(s, x, what)
        _check_poison_past(s, rows, y_full, what)
        for name in ("meta", "pairs"):
            assert (s.arena.view(name, np.uint8) == 0xFF).all(), f"{what}: {name} written"
    too_many = mk.WARP_ROUTED_MAX_PAIRS // s.shape.topk + 1
    with pytest.raises(KeyError, match="rows \\* topk"):
        ml.selfrouted_w13w_launches(s.bundle, s.shape, s.ptrs, too_many, "bulkw_lean4")


@pytest.mark.parametrize("rows", ROWS)
def test_step_launches_pick_the_measured_winners(setup, rows):
    s = setup
    _, _, want = s.inputs("uniform", rows)
    specs = ml.step_launches(s.bundle, s.shape, s.ptrs, rows)
    names = [spec.kernel.name for spec in specs]
    tag = s.shape.tag()
    w13w, w13sr = ml.step_w13_variants(rows)
    if rows >= ml.SELFROUTED_FROM_ROWS:       # s.ptrs has "sched": the queued pair (round 9)
        w13sr, w2sr = ml.QUEUED_PAIR if ml.STEP_QUEUE else (w13sr, "early")
        expect = [f"moe_xquant_{tag}", f"moe_w13sr_{tag}_{w13sr}", f"moe_w2sr_{tag}_{w2sr}"]
    elif ml.STEP_BULK:
        w13 = (f"w13w_{tag}_{w13w}" if rows * s.shape.topk <= mk.WARP_ROUTED_MAX_PAIRS
               else f"w13sr_{tag}_bulk")
        expect = [f"moe_prep_{tag}", f"moe_{w13}", f"moe_w2_{tag}_{ml.STEP_BULK_W2}"]
    else:                               # the default chain as STEP_VARIANTS picks its kernels
        step = ml.STEP_VARIANTS
        w2v = step["w2_one_row"] if rows == 1 else step["w2"]
        w2 = f"moe_w2_{tag}" + (f"_{w2v}" if w2v else "")
        w13 = f"moe_w13_{tag}" + (f"_{step['w13']}" if step["w13"] else "")
        if step["w13w"] is not None and rows * s.shape.topk <= mk.WARP_ROUTED_MAX_PAIRS:
            w13 = f"moe_w13w_{tag}" + (f"_{step['w13w']}" if step["w13w"] else "")
        expect = [f"moe_prep_{tag}", w13, w2]
    assert names == expect + [f"moe_combine_{tag}"]
    if rows <= FEW_ROWS:                # larger R: the chains' own tests run these launches
        _check_y(s.run(specs), want, f"step launches at R={rows}")


def test_grouped_gemm_of_quantized_x_is_moe_refs_w4a8():
    """The emulator's w13 GEMM (x read already quantized) is moe_ref.w4a8_matmul bit for bit,
    a short tail group included."""
    rng = np.random.default_rng()
    for k in (96, 256, 576):
        x = moe_ref.round_bf16(rng.normal(0, 2, (7, k)))
        w = rng.normal(0, 0.05, (40, k)).astype(np.float32)
        q, scales = f.quantize_act_fp8(x)
        got = _w4a8_quantized(q.astype(np.float32), scales, w)
        np.testing.assert_array_equal(got, moe_ref.w4a8_matmul(x, w))


def test_prep_on_one_cta_routes_but_quantizes_nothing(setup):
    """CTA 0 builds the lists, CTAs 1.. quantize x: a grid of 1 leaves xq / xs unwritten."""
    s = setup
    _, ids, _ = s.inputs("uniform", 3)
    prep = ml.chain_launches(s.bundle, s.shape, s.ptrs, 3, kinds=("prep",))[0]
    for name in SCRATCH:
        s.arena.fill(name, 0xFF)
    args = {name: value for (name, _), value in zip(prep.kernel.params, prep.args)}
    emulate(prep.kernel, (1, 1, 1), args, s.space)
    _check_lists(s, ids, "prep on one CTA")
    assert (s.arena.view("xq", np.uint8) == 0xFF).all()
    assert (s.arena.view("xs", np.uint8) == 0xFF).all()


def test_bad_input_and_unknown_variants_raise(setup):
    s = setup
    s.inputs("uniform", 2)
    ids = s.arena.view("ids", np.int32, (2, s.shape.topk))
    ids[1, 3] = s.shape.num_experts
    prep, w13 = ml.chain_launches(s.bundle, s.shape, s.ptrs, 2, kinds=("prep", "w13"))
    with pytest.raises(ValueError, match=r"moe_prep_.*topk_ids.*\[0, 16\)"):
        emulate_launch(prep, s.space)
    s.arena.fill("meta", 0xFF)                  # meta never written: w13 must not guess
    with pytest.raises(ValueError, match=r"moe_w13_.*meta\[0\]"):
        emulate_launch(w13, s.space)
    with pytest.raises(KeyError, match=r"no address for \['meta'"):
        ml.chain_launches(s.bundle, s.shape, {"ids": 1, "x": 2}, 2, kinds=("w13",))
    with pytest.raises(KeyError, match="no w2 variant 'r9'"):
        ml.chain_launches(s.bundle, s.shape, s.ptrs, 2, w2="r9")
    rec = s.bundle.kernel(f"moe_w2_{s.shape.tag()}")
    odd = dataclasses.replace(rec, spec={**rec.spec, "variant": "r9"})
    args = dict(zip([n for n, _ in rec.params], [s.ptrs["meta"]] * 7 + [2]))
    with pytest.raises(NoEmulator, match="'w2' variant 'r9'"):
        emulate(odd, (1, 1, 1), args, s.space)


def test_requests_match_the_pointer_keys_and_the_abi(setup):
    s = setup
    names = {n for n, _, _ in ml.weight_requests(s.shape) + ml.requests(s.shape, 8)}
    # + the queued pair's sched (the one pointer beyond its kind's, mk.MoeSpec.queued)
    assert names == {key for keys in ml.POINTER_KEYS.values() for key in keys} | {"sched"}
    for kind, keys in ml.POINTER_KEYS.items():
        params = [n for n, _ in mk.PARAMS[kind]]
        assert params[-1] == "rows" and len(params) == len(keys) + 1, kind
        for param, key in zip(params, keys):      # codes13 for codes, ids for topk_ids...
            assert key.startswith(param) or (param, key) == ("topk_ids", "ids"), (kind, param)
    with pytest.raises(ValueError, match="max_rows"):
        ml.requests(s.shape, mk.MAX_ROWS + 1)


class _SpecBundle:
    """A manifest-less bundle of mk's specs (no cubins): KernelRecords straight from to_dict()."""

    def __init__(self, shape: mk.MoeShape):
        specs = mk.make_specs(shape) + mk.variant_specs(shape) + mk.selfrouted_specs(shape)
        self.records = {s.name: KernelRecord(s.name, "kernels.moe", Path("-"), "-", s.params,
                                             s.block, s.smem_bytes, True, spec=s.to_dict())
                        for s in specs}

    def kernel(self, name: str):
        return self.records[name]

    def names(self) -> list[str]:
        return sorted(self.records)


@pytest.mark.parametrize("rows", [1, 7])
def test_real_intermediate_width_with_its_tail_group(rows):
    """I = 576 (the v41-flash TP4 rank: w2's K is four 128-groups and a 64 tail, padded to 640)
    and D = 384 (three 128-groups), on specs built from mk (the tiny bundle has I = 96 only)."""
    shape = mk.MoeShape(8, 6, 384, 576, 10.0)
    bundle = _SpecBundle(shape)
    rng = np.random.default_rng()
    w13 = _random_fused(rng, 8, 2 * shape.inter, shape.hidden)
    w2 = _random_fused(rng, 8, shape.hidden, shape.inter)
    packed = mk.pack_experts(w13, w2, shape)
    space = AddressSpace()
    arena = HostArena(space, ml.weight_requests(shape) + ml.requests(shape, 8))
    for name, arr in {"codes13": packed.w13.codes, "offsets13": packed.w13.offsets,
                      "codes2": packed.w2.codes, "offsets2": packed.w2.offsets,
                      "scales13": packed.w13.scales, "scales2": packed.w2.scales}.items():
        arena.upload(name, arr)
    ids = np.stack([rng.choice(8, 6, replace=False) for _ in range(rows)]).astype(np.int32)
    weights = rng.random((rows, 6)).astype(np.float32)
    x = moe_ref.round_bf16(rng.normal(0, 1, (rows, shape.hidden)))
    arena.upload("x", f.to_bf16(x))
    arena.upload("ids", ids)
    arena.upload("route_weights", weights)
    d13, d2 = f.fused_e8m0_dequantize(w13), f.fused_e8m0_dequantize(w2)
    shards = [moe_ref.ExpertShard(d13[e], d2[e]) for e in range(8)]
    want = moe_ref.routed_experts(x, moe_ref.RouterOutput(ids.astype(np.int64), weights),
                                  shards, shape.swiglu_limit)
    ptrs = {name: arena.ptr(name) for name in arena.slices}
    for label, specs in (("default", ml.chain_launches(bundle, shape, ptrs, rows)),
                         ("self-routed", ml.selfrouted_launches(bundle, shape, ptrs, rows))):
        for name in SCRATCH:
            arena.fill(name, 0xFF)
        run(specs, space)
        y = arena.download("y", np.float32, (8, shape.hidden))
        _check_y(y, want, f"{label}, I=576, R={rows}")
        assert (y[rows:].view(np.uint32) == 0xFFFFFFFF).all(), f"{label}: y written past R"


@pytest.mark.parametrize("config", ["tiny", "v41-flash"])
def test_scratch_buffers_are_the_requests_of_the_rank_shape(config):
    from loader.config import ModelConfig
    cfg = ModelConfig.preset(config)
    shape = mk.moe_shape(cfg, 4)
    want = {n: b for n, b, _ in ml.requests(shape, 48)}
    got = {buf.name.removeprefix("moe."): buf.nbytes for buf in ml.scratch_buffers(cfg, 4, 48)}
    assert got == {n: want[n] for n in ("meta", "pairs", "xq", "xs", "h", "ye", "y", "sched")}
