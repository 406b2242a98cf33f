"""GPU: the routed-MoE chain (moe_prep, moe_w13, moe_w2, moe_combine) against its NumPy reference.

Fresh random weights and routings every run (uniform, all rows on one expert's top-k set, all
pairs on distinct experts), R in {1, 2, 3, 5, 6, 8, 12, 16, 48, 96, 192}, tiny and real (v41-flash
TP4) shapes, every output and scratch buffer NaN-poisoned before the launch. Checks, in order:
routing lists (bitwise: deterministic integer work), x quantized to FP8 (bitwise: div.rn, rcp.rn,
mul.rn, cvt.rn.satfinite as quantize_act_fp8), h and y against kernels/moe_ref's two-stage bound
(`check_two_stage`: h within the envelope of the reference's h13, then y against the reference's
w2 + combine on the device's own h; y alone has no end-to-end bound, docs/notes/moe-tolerance.md)
for the first chain, h and y bitwise equal to it for the others (every candidate w13 / w2
variant the bundle holds, the pair the step launches and, where rows * k <= 64, the chain with
each moe_w13w variant (kernels/moe_pipelined.py, kernels/moe_bulk.py) for w13, and the bulk-copy
chain the step runs (prep, w13w or w13sr "bulk", w2 "bulk" / "bulkp" / "bulkpd" (round 7: the
first tile decoded before the wait), combine) and its w13w "bulkw_lean4" form; all bitwise equal
to each other), and two replays bitwise equal; then the self-routed chain
(kernels/moe_selfroute.py, every w13sr and w2sr variant) from poisoned buffers: h and y bitwise
the default chain's, its quantized x bitwise.
At the real shape only a pool of experts (at random ids among 384) holds weights; the others are
zero, so a kernel reading a wrong expert is caught. Every failure label carries the draws' seeds
(weight pool, inputs), so a failure can be replayed on the CPU.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from executor.launches import moe as ml
from executor.moe_chain import MoeChain
from executor.runtime import Bundle
from kernels import moe_kernel_ref as mk
from kernels import moe_ref
from loader import formats as f

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

BUNDLES = {"tiny": Path(os.environ.get("HOPDEC_BUNDLE", "build/bundle-tiny")),
           "v41-flash": Path(os.environ.get("HOPDEC_BUNDLE_V41", "build/bundle-v41-flash-tp4"))}
ROWS = (1, 2, 3, 5, 6, 8, 12, 16, 48, 96, 192)
POOL_SEEDS: dict[int, int] = {}     # id(chain) -> the seed of its weight pool (failure labels)
POOL = 12            # experts with weights at the real shape (pack + reference time)


def _shape_of(bundle) -> mk.MoeShape:
    rec = next(bundle.manifest.kernels[n] for n in bundle.names() if n.startswith("moe_w13_"))
    s = rec.spec
    return mk.MoeShape(s["num_experts"], s["topk"], s["hidden"], s["inter"], s["swiglu_limit"])


def _random_fused(rng, experts, n, k):
    """Fused-E8M0 weights drawn directly: random codes, offsets in [1, 12], lo near 2^-5 scale."""
    codes = rng.integers(0, 16, (experts, n, k), dtype=np.uint8)
    codes[codes == 8] = 0                                   # the fused step leaves no -0 codes
    offsets = rng.integers(3, 9, (experts, n, k // 32)).astype(np.uint8)
    lo = rng.integers(110, 116, experts).astype(np.int32)
    return f.FusedE8M0(f.mxfp4_pack(codes), offsets,
                       (np.ldexp(np.float32(1), lo - 127) / 2).astype(np.float32), lo)


@pytest.fixture(scope="module", params=["tiny", "v41-flash"])
def setup(request, dev):
    path = BUNDLES[request.param]
    if not (path / "manifest.json").is_file():
        pytest.fail(f"no bundle at {path} (build it with python -m kernels.build)")
    bundle = Bundle.load(dev, path)
    shape = _shape_of(bundle)
    seed = np.random.SeedSequence().entropy
    rng = np.random.default_rng(seed)
    pool = min(POOL, shape.num_experts)
    ids = np.sort(rng.choice(shape.num_experts, pool, replace=False))
    w13 = _random_fused(rng, pool, 2 * shape.inter, shape.hidden)
    w2 = _random_fused(rng, pool, shape.hidden, shape.inter)
    packed = mk.pack_experts(w13, w2, mk.MoeShape(pool, shape.topk, shape.hidden, shape.inter,
                                                  shape.swiglu_limit))
    chain = MoeChain(dev, bundle, shape)
    POOL_SEEDS[id(chain)] = seed
    for name in ("codes13", "offsets13", "codes2", "offsets2", "scales13", "scales2"):
        chain.arena.view(name, np.uint8)[...] = 0
    chain.upload_experts(packed, ids)
    shards = [None] * shape.num_experts
    d13, d2 = f.fused_e8m0_dequantize(w13), f.fused_e8m0_dequantize(w2)
    for i, e in enumerate(ids):
        shards[e] = moe_ref.ExpertShard(d13[i], d2[i])
    yield shape, chain, ids, shards, dev.stream()
    chain.close()
    bundle.close()


def _device_y_h(chain, rows, shape):
    """y [R, D] fp32 and h [R·k, I] (BF16 bits -> fp32, by pair = row·k + slot) of the chain."""
    y = chain.download("y", np.float32, (rows, shape.hidden))
    bits = chain.download("h", np.uint16, (rows * shape.topk, shape.inter))
    return y, (bits.astype(np.uint32) << 16).view(np.float32)


def _routing(rng, kind, rows, pool_ids, topk):
    if kind == "uniform":
        return np.stack([rng.choice(pool_ids, topk, replace=False) for _ in range(rows)])
    if kind == "one_expert":
        return np.tile(rng.choice(pool_ids, topk, replace=False), (rows, 1))
    return rng.permutation(pool_ids)[:rows * topk].reshape(rows, topk)


def _cases():
    for kind in ("uniform", "one_expert"):
        for rows in ROWS:
            yield kind, rows
    for rows in (1, 2):                  # 12 distinct experts: what both pools hold
        yield "distinct", rows


@pytest.mark.parametrize(("kind", "rows"), list(_cases()))
def test_moe_chain_matches_reference(setup, kind, rows):
    shape, chain, pool_ids, shards, stream = setup
    seed = np.random.SeedSequence().entropy
    rng = np.random.default_rng(seed)
    seeds = f"seeds: pool {POOL_SEEDS[id(chain)]}, inputs {seed}"
    ids = _routing(rng, kind, rows, pool_ids, shape.topk).astype(np.int32)
    weights = rng.random((rows, shape.topk)).astype(np.float32)
    x = moe_ref.round_bf16(rng.normal(0, 1, (rows, shape.hidden)))
    x_bits = (x.view(np.uint32) >> 16).astype(np.uint16)
    chain.upload_inputs(x_bits, ids, weights)
    routing = moe_ref.RouterOutput(ids.astype(np.int64), weights)
    parts = moe_ref.routed_parts(x, routing, shards, shape.swiglu_limit)
    # Every variant the bundle holds (w13 ones with the default w2, then w2 ones), each from
    # NaN-poisoned buffers; last the chain as launched by default (w2 chosen by rows), whose
    # lists and activations are checked below and whose replay must be bitwise equal.
    # Every variant has the default's items and per-item arithmetic order (they differ in ring
    # depth, occupancy and cp.async commit granularity only), so all y are bitwise equal; the
    # pair the step launches below 6 rows (launches/moe.py step_variants) is run as well.
    variants = ([(v, "") for v in chain.variant_names("w13")[1:]]
                + [("", v) for v in chain.variant_names("w2")] + [("", None)])
    step_w13, step_w2 = ml.step_variants(chain.available, rows)
    if step_w13:
        variants.insert(0, (step_w13, step_w2))
    # moe_w13w variants in place of w13 (("w13w", v): their own launch list)
    variants[:0] = [(("w13w", v), step_w2) for v in chain.warp_routed_variants(rows)]
    if ml.bulk_fits(chain.available, shape, rows):   # the step's bulk-copy chain (round 5)
        variants[:0] = [("bulk", w2) for w2 in mk.W2_BULK_VARIANTS if ("w2", w2) in chain.available]
        if ml.warp_routed_fits(chain.available, shape, rows, "bulkw_lean4"):
            variants.insert(0, ("bulkw_lean4", "bulk"))    # round 6: w13w at 128 registers
    variants.insert(0, ("step", None))                  # what the decode step launches
    ys, hs = [], []
    for w13, w2 in variants:
        chain.poison_outputs()
        if w13 == "step":
            launches = chain.step_launches(rows)
        elif w13 == "bulk":
            launches = chain.launches_bulk(rows, w2)
        elif w13 == "bulkw_lean4":
            launches = chain.launches_bulk(rows, w2, w13)
        elif isinstance(w13, tuple):
            launches = chain.launches_warp_routed(rows, w2, w13[1])
        else:
            launches = chain.launches(rows, w13=w13, w2=w2)
        for spec in launches:
            spec.launch(stream)
        stream.synchronize()
        y, h = _device_y_h(chain, rows, shape)
        label = f"y ({kind}, R={rows}, w13={w13!r}, w2={w2!r}, {seeds})"
        if not ys:
            moe_ref.check_two_stage(y, h, parts, routing, shards, shape.swiglu_limit, label)
        ys.append(y)
        hs.append(h)
        np.testing.assert_array_equal(h, hs[0], err_msg=f"h of {label} vs {variants[0]}")
        np.testing.assert_array_equal(y, ys[0], err_msg=f"{label} vs {variants[0]}")

    lists = mk.routing_lists(ids, shape.num_experts)
    meta = chain.download("meta", np.int32, (mk.meta_words(shape.num_experts),))
    d = len(lists.experts)
    assert meta[0] == d and meta[1] == 0, f"meta header {meta[:2]}, expected [{d}, 0]"
    want_meta = lists.meta(shape.num_experts)
    for part in range(3):
        lo = mk.META_HEADER + part * shape.num_experts
        np.testing.assert_array_equal(meta[lo:lo + d], want_meta[lo:lo + d])
    np.testing.assert_array_equal(chain.download("pairs", np.int32, (rows * shape.topk,)),
                                  lists.pairs)
    want_q, want_s = mk.quantize_fragments(x, shape.k13)
    np.testing.assert_array_equal(chain.download("xq", np.uint8, want_q.shape), want_q)
    np.testing.assert_array_equal(chain.download("xs", np.float32, want_s.shape), want_s)

    for spec in chain.launches(rows):       # replay: bit-identical (fixed reduction order)
        spec.launch(stream)
    stream.synchronize()
    np.testing.assert_array_equal(chain.download("y", np.float32, (rows, shape.hidden)), y)
    _check_selfrouted(chain, stream, rows, shape, x, (ys[0], hs[0]), f"{kind}, R={rows}, {seeds}")


def _check_selfrouted(chain, stream, rows, shape, x, default, what):
    """The self-routed chain (xquant, w13sr, w2sr, combine) from NaN-poisoned buffers, every
    w13sr and w2sr variant: y and h bitwise the default chain's (`default` = (y, h), already
    bounded by the reference; same bytes, same items, same per-item arithmetic order: only where
    routing and x quantization happen moved); xq / xs bitwise quantize_act_fp8 in fragment
    order."""
    assert chain.has_selfrouted(), "the bundle lacks the self-routed MoE kernels"
    pairs = ([(w13, "") for w13 in chain.selfrouted_variants("w13sr")]
             + [("", w2) for w2 in chain.selfrouted_variants("w2sr") if w2])
    if "early" in chain.selfrouted_variants("w2sr"):   # the step's / benchmark's pairs
        pairs += [(w13, "early") for w13 in ("bulk", "bulkw")
                  if w13 in chain.selfrouted_variants("w13sr")]
    # round 6: the register-routed w13w in that chain (xquant -> w13w -> w2sr early -> combine)
    pairs += [(("w13w", v), "early") for v in ("bulkw", "bulkw_lean4")
              if ml.warp_routed_fits(chain.available, shape, rows, v)]
    for w13, w2 in pairs:
        chain.poison_outputs()
        launches = (ml.selfrouted_w13w_launches(chain.bundle, shape, chain.ptrs, rows, w13[1], w2)
                    if isinstance(w13, tuple) else chain.launches_selfrouted(rows, w13=w13, w2=w2))
        for spec in launches:
            spec.launch(stream)
        stream.synchronize()
        label = f"self-routed y ({what}, w13sr={w13!r}, w2sr={w2!r})"
        _assert_default(chain, rows, shape, default, label)
        want_q, want_s = mk.quantize_fragments(x, shape.k13)
        np.testing.assert_array_equal(chain.download("xq", np.uint8, want_q.shape), want_q)
        np.testing.assert_array_equal(chain.download("xs", np.float32, want_s.shape), want_s)


def _assert_default(chain, rows, shape, default, label):
    """The chain's y and h bitwise `default` = (y, h) of the default chain."""
    y, h = _device_y_h(chain, rows, shape)
    np.testing.assert_array_equal(h, default[1], err_msg=f"h of {label} vs the default chain")
    np.testing.assert_array_equal(y, default[0], err_msg=f"{label} vs the default chain")


@pytest.mark.parametrize("rows", [1, 2, 6, 12])
def test_moe_timeline_builds_match_and_stamp_in_order(setup, rows):
    """The timeline builds (kernels/moe_timeline.py) in the step's chain: y bitwise the plain
    chain's (the stamps add stores, never arithmetic), and every CTA's record in order (entry <=
    wait_begin <= wait_end <= first_landed <= last_landed <= epilogue <= exit where reached, the
    landed / epilogue events reached by every CTA with an item) on an SM id < the SM count."""
    from executor import moe_timeline as tl
    shape, chain, pool_ids, _, stream = setup
    if not any(n.startswith("moe_") and n.endswith("_tl") for n in chain.bundle.names()):
        pytest.fail("the bundle has no MoE timeline builds (mk.timeline_specs)")
    rng = np.random.default_rng()
    ids = _routing(rng, "uniform", rows, pool_ids, shape.topk).astype(np.int32)
    x = moe_ref.round_bf16(rng.normal(0, 1, (rows, shape.hidden)))
    chain.upload_inputs((x.view(np.uint32) >> 16).astype(np.uint16), ids,
                        rng.random((rows, shape.topk)).astype(np.float32))
    bufs = [cp.zeros(mk.H200_NUM_SMS * 4 * mk.TIMELINE_RECORD_BYTES, cp.uint8) for _ in range(2)]
    ys = []
    for launches in (chain.step_launches(rows),
                     ml.timeline_launches(chain.bundle, shape, chain.ptrs, rows,
                                          (bufs[0].data.ptr, bufs[1].data.ptr))):
        chain.poison_outputs()
        for spec in launches:
            spec.launch(stream)
        stream.synchronize()
        ys.append(chain.download("y", np.float32, (rows, shape.hidden)))
    np.testing.assert_array_equal(ys[1], ys[0], err_msg=f"timeline chain y, R={rows}")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    for spec, buf in zip(launches[1:3], bufs):
        rec = tl.Records.parse(spec.kernel.name, cp.asnumpy(buf), spec.grid[0])
        assert (rec.smid >= 0).all() and (rec.smid < sms).all(), spec.kernel.name
        ns = np.where(rec.ns > 0, rec.ns, np.nan)
        for i in (0, 1, 2, 6):
            assert (rec.ns[:, i] > 0).all(), f"{spec.kernel.name}: {tl.EVENTS[i]} missing"
        steps = np.diff(ns[:, [0, 1, 2, 6]], axis=1)
        assert (steps >= 0).all(), f"{spec.kernel.name}: entry / wait / exit out of order"
        reached = (rec.ns[:, 3:6] > 0).all(axis=1)
        assert reached.any() and ((rec.ns[:, 3:6] > 0).any(axis=1) == reached).all()
        inner = ns[reached][:, 2:7]
        assert (np.diff(inner, axis=1) >= 0).all(), f"{spec.kernel.name}: phases out of order"
