"""Emulated indexer launches (executor/launches/indexer.py on host memory) against the model reference.

The GPU test's setup (tests/gpu/test_indexer_publish.py) on a CPU, at the tiny model's sizes: fresh
random bf16 queries and weights, random key records on permuted pages of the key cache, every page
byte no sequence owns 0xFF (NaN keys: a read through a wrong table or past a sequence's entries
turns a score NaN), sequences of 1, 5 or 6 rows plus padding rows (sequence -1). Inputs and cache
live in one arena, the indexer's scratch and outputs (`requests`) in another, all 0xFF before the
launches. The candidate source (dense, ratio 1) runs first; the reindex layer (candidates) then
scores its rows' candidate blocks on the same cache; a ratio-2 dense layer beside them.

Checks, as the GPU test: plan and q fragments/scales/weights bitwise; scores within
`score_tolerance` of `indexer_ref.index_scores` (the kernel's bound; the emulator is exact, so this
checks wiring: rows, sequences, pages, strides) and NaN wherever nothing may be written; top-k and
blocks bitwise equal to `topk_ref` on those scores; every cluster top-k launch equal to the default
and writing only its own outputs. Plus: every byte past the launch's rows is still 0xFF, and the
input arena is unchanged.
"""
from __future__ import annotations

import dataclasses

import indexer_cases as cases
import numpy as np
import pytest

from executor.emulate import NoEmulator, run
from executor.hostmem import AddressSpace, HostArena, ManifestBundle
from executor.indexer_chain import random_key_records
from executor.launch import LaunchSpec
from executor.launches import indexer as il
from kernels import indexer_kernel_ref as ik
from kernels import indexer_ref, kvrecord_ref
from loader import formats
from loader.config import ModelConfig

CFG = ModelConfig.preset("tiny")
HEADS, TOPK, BLOCKS, BS = (CFG.index_n_heads, CFG.index_topk, CFG.candidate_topk_blocks,
                           CFG.candidate_block_size)
PAGE = 64
WEIGHT_SCALE = 128 ** -0.5 * HEADS ** -0.5
INPUTS = ("q", "w_raw", "positions", "seq_index", "cands", "keys", "block_tables")
# (context, rows, padding rows, max_rows): R = 1 alone, a draft block, verify blocks, several
# sequences, the most rows the plan holds (256); max_rows > rows + padding: a padded bucket.
CASES = [(10, 1, 0, 1), (100, 1, 2, 8), (300, 5, 2, 16), (1000, 12, 2, 14), (3000, 48, 3, 64),
         (500, 254, 2, 256)]


@pytest.fixture(scope="module")
def bundle(tiny_bundle_dir):
    return ManifestBundle(tiny_bundle_dir)


class Layer:
    """One layer's indexer on host memory: an inputs + cache arena and the indexer's own."""

    def __init__(self, space, shape, inputs=None):
        self.shape = shape
        self.inputs = inputs or HostArena(space, il.requests(shape, INPUTS), name="inputs")
        self.own = HostArena(space, il.requests(shape), name="indexer")

    def poison(self) -> None:
        """Scores NaN (0xFF); the rest 0xEE, which no written value is (-1 padding is 0xFF)."""
        self.own.buffer.fill(0xEE)
        self.own.fill("scores", 0xFF)

    def ptrs(self, **outputs) -> dict[str, int]:
        out = {n: self.inputs.ptr(n) for n in INPUTS}
        out.update({n: self.own.ptr(n) for n in self.own.slices})
        return {**out, **outputs}

    def get(self, name, dtype, shape):
        return self.own.download(name, dtype, shape)


def setup_keys(rng, layer: Layer, seqs: int, positions, seq_index):
    """Random key records on each sequence's pages (permuted), 0xFF everywhere else."""
    s = layer.shape
    tables = rng.permutation(s.max_seqs * s.pages_per_seq).reshape(
        s.max_seqs, s.pages_per_seq).astype(np.int32)
    layer.inputs.fill("keys", 0xFF)
    cache = layer.inputs.view("keys", np.uint8).reshape(-1, ik.KEY_BYTES)
    decoded = []
    for q in range(seqs):
        n = (int(positions[seq_index == q].max()) + 1) // s.ratio
        recs = random_key_records(rng, n)
        e = np.arange(n)
        cache[tables[q, e // PAGE].astype(np.int64) * PAGE + e % PAGE] = recs
        decoded.append(kvrecord_ref.decode_index_key(recs))
    layer.inputs.upload("block_tables", tables)
    return decoded


def upload_query(rng, layer: Layer, r: int):
    """bf16 q [r, nh, 128] and w_raw [r, nh]; returns the model's (FP4 q, head weights)."""
    q = formats.bf16_round(rng.standard_normal((r, HEADS, 128)).astype(np.float32))
    w_raw = formats.bf16_round(rng.standard_normal((r, HEADS)).astype(np.float32))
    layer.inputs.upload("q", (q.view(np.uint32) >> 16).astype(np.uint16))
    layer.inputs.upload("w_raw", (w_raw.view(np.uint32) >> 16).astype(np.uint16))
    codes, scales, w = ik.prep_query(q, w_raw, WEIGHT_SCALE)
    return codes, scales, w, indexer_ref.fp4_quantize_dequantize(q)


def check_untouched_tail(layer: Layer, r: int):
    """Every byte of the indexer's arena past the launch's r rows is still poison."""
    s = layer.shape
    used = {"qfrag": r * s.tiles * 1024, "qscale": r * s.tiles * 128, "qw": r * s.tiles * 32,
            "plan": 4 * ik.plan_words(r), "scores": r * 4 * s.max_entries,
            "topk": r * 4 * s.topk, "blocks_out": r * 4 * s.num_blocks}
    for name in layer.own.slices:
        tail = layer.own.view(name, np.uint8)[used[name]:]
        poison = 0xFF if name == "scores" else 0xEE
        assert (tail == poison).all(), f"{name}: written past row {r}"


def run_checked(space, layer: Layer, specs) -> None:
    before = layer.inputs.buffer.copy()
    assert run(specs, space) == len(specs)
    assert np.array_equal(layer.inputs.buffer, before), "a launch wrote to its inputs"


def new_shape(mode, ratio, context, max_rows, max_seqs, source):
    return il.IndexerShape(HEADS, ratio, mode, TOPK, BLOCKS, BS, PAGE, max_rows, max_seqs,
                           max(context, 64), candidate_source=source)


@pytest.mark.parametrize(("context", "rows", "padding", "max_rows"), CASES)
def test_candidate_source_then_reindex(bundle, context, rows, padding, max_rows):
    rng = np.random.default_rng()
    space = AddressSpace()
    positions, seq_index, seqs = cases.make_rows(rng, context, rows, padding)
    r = positions.size
    src = Layer(space, new_shape("dense", 1, context, max_rows, seqs + 1, True))
    decoded = setup_keys(rng, src, seqs, positions, seq_index)
    codes, scales, w, qd = upload_query(rng, src, r)
    src.inputs.upload("positions", positions)
    src.inputs.upload("seq_index", seq_index)
    src.inputs.fill("cands", 0xFF)                      # dense layers never read it
    src.poison()
    run_checked(space, src, il.indexer_launches(bundle, src.shape, src.ptrs(), r, WEIGHT_SCALE))
    cases.check_prep(src.get, src.shape.ratio, src.shape.mode, codes, scales, w,
                     positions, seq_index)
    scores = src.get("scores", np.float32, (r, src.shape.max_entries))
    cases.check_scores(scores, qd, w, decoded, seq_index)
    topk = src.get("topk", np.int32, (r, TOPK))
    blocks = src.get("blocks_out", np.int32, (r, BLOCKS))
    np.testing.assert_array_equal(topk, ik.topk_ref(scores, positions, seq_index, "entries",
                                                    TOPK, 1))
    np.testing.assert_array_equal(blocks, ik.topk_ref(scores, positions, seq_index, "blocks",
                                                      BLOCKS, 1))
    check_untouched_tail(src, r)
    check_cluster_variants(space, bundle, src, r, topk, blocks)

    cands = blocks                                      # the reindex layer's candidate blocks
    rei = Layer(space, new_shape("candidates", 1, context, max_rows, seqs + 1, False),
                inputs=src.inputs)
    src.inputs.upload("cands", cands)
    codes, scales, w, qd = upload_query(rng, rei, r)
    for cluster in (False, True):                       # the default top-k, then the cluster one
        rei.poison()
        run_checked(space, rei, il.indexer_launches(bundle, rei.shape, rei.ptrs(), r,
                                                    WEIGHT_SCALE, cluster_topk=cluster))
        cases.check_prep(rei.get, rei.shape.ratio, rei.shape.mode, codes, scales, w,
                         positions, seq_index, cands)
        scores = rei.get("scores", np.float32, (r, rei.shape.max_entries))
        n_max = rei.shape.max_entries
        inside = indexer_ref.candidate_entry_mask(cands, n_max, BS) & indexer_ref.visible_mask(
            ik.visible_counts(positions, seq_index, 1), n_max)
        cases.check_scores(scores, qd, w, decoded, seq_index, allowed=inside)
        np.testing.assert_array_equal(
            rei.get("topk", np.int32, (r, TOPK)),
            ik.topk_ref(scores, positions, seq_index, "candidates", TOPK, 1, cands=cands),
            err_msg=f"reindex top-k (cluster={cluster})")
        check_untouched_tail(rei, r)


def check_cluster_variants(space, bundle, layer: Layer, r: int, topk, blocks):
    """Each cluster top-k of the candidate source into fresh outputs: equal to the defaults,
    the output its mode does not write still poison (0xEE), nothing past row r written."""
    out = HostArena(space, il.requests(layer.shape, ("topk", "blocks_out")), name="variant")
    ptrs = layer.ptrs(topk=out.ptr("topk"), blocks_out=out.ptr("blocks_out"))
    for key, spec in il.cluster_specs(layer.shape).items():
        out.buffer.fill(0xEE)
        run_checked(space, layer, [il.cluster_topk_launch(bundle, layer.shape, spec, ptrs, r)])
        got_topk = out.view("topk", np.int32)[:r * TOPK].reshape(r, TOPK)
        got_blocks = out.view("blocks_out", np.int32)[:r * BLOCKS].reshape(r, BLOCKS)
        writes = {"topkc": ("topk",), "blocksc": ("blocks_out",),
                  "bothc": ("topk", "blocks_out")}[key]
        for name, got, want in (("topk", got_topk, topk), ("blocks_out", got_blocks, blocks)):
            if name in writes:
                np.testing.assert_array_equal(got, want, err_msg=f"{spec.name} {name}")
            else:
                assert (got.view(np.uint8) == 0xEE).all(), f"{spec.name} wrote {name}"
        assert (out.view("topk", np.uint8)[4 * r * TOPK:] == 0xEE).all()
        assert (out.view("blocks_out", np.uint8)[4 * r * BLOCKS:] == 0xEE).all()


@pytest.mark.parametrize(("context", "rows", "padding", "max_rows"),
                         [(10, 1, 0, 1), (700, 6, 1, 9), (2000, 30, 2, 40)])
def test_ratio2_dense_layer(bundle, context, rows, padding, max_rows):
    """A compressed (ratio 2) layer without candidates: entries < (p + 1) // 2, default top-k
    and the cluster one."""
    rng = np.random.default_rng()
    space = AddressSpace()
    positions, seq_index, seqs = cases.make_rows(rng, context, rows, padding)
    r = positions.size
    layer = Layer(space, new_shape("dense", 2, context // 2, max_rows, seqs + 1, False))
    decoded = setup_keys(rng, layer, seqs, positions, seq_index)
    codes, scales, w, qd = upload_query(rng, layer, r)
    layer.inputs.upload("positions", positions)
    layer.inputs.upload("seq_index", seq_index)
    layer.inputs.fill("cands", 0xFF)
    extra = HostArena(space, il.requests(layer.shape, ("blocks_out",)), name="unwritten")
    extra.buffer.fill(0xEE)
    for cluster in (False, True):
        layer.poison()
        ptrs = layer.ptrs(blocks_out=extra.ptr("blocks_out"))   # the cluster ABI's 2nd output
        run_checked(space, layer, il.indexer_launches(bundle, layer.shape, ptrs, r,
                                                      WEIGHT_SCALE, cluster_topk=cluster))
        cases.check_prep(layer.get, layer.shape.ratio, layer.shape.mode, codes, scales, w,
                         positions, seq_index)
        scores = layer.get("scores", np.float32, (r, layer.shape.max_entries))
        cases.check_scores(scores, qd, w, decoded, seq_index)
        np.testing.assert_array_equal(
            layer.get("topk", np.int32, (r, TOPK)),
            ik.topk_ref(scores, positions, seq_index, "entries", TOPK, 2))
        check_untouched_tail(layer, r)
        assert (extra.buffer == 0xEE).all(), "the entries top-k wrote blocks"


def test_shape_for_layer_matches_the_bundle(bundle):
    """Every index-source layer of the tiny model gets a shape whose kernels the bundle has."""
    layers = [layer for layer in CFG.layers if layer.has_indexer]
    assert {"dense", "candidates"} <= {il.IndexerShape.for_layer(CFG, x, PAGE, 8, 2, 256).mode
                                       for x in layers}
    for layer in layers:
        shape = il.IndexerShape.for_layer(CFG, layer, PAGE, 8, 2, 256)
        for spec in {**il.default_specs(shape), **il.cluster_specs(shape)}.values():
            assert bundle.kernel(spec.name).family == "kernels.indexer"


def test_builder_and_emulator_refuse_bad_calls(bundle):
    space = AddressSpace()
    shape = new_shape("dense", 1, 100, 4, 2, True)
    layer = Layer(space, shape)
    ptrs = layer.ptrs()
    with pytest.raises(ValueError, match=r"rows must be an int in \[1, 4\]"):
        il.indexer_launches(bundle, shape, ptrs, 5, WEIGHT_SCALE)
    del ptrs["keys"]
    with pytest.raises(KeyError, match="'keys'"):
        il.indexer_launches(bundle, shape, ptrs, 2, WEIGHT_SCALE)
    topk = il.indexer_launches(bundle, shape, layer.ptrs(), 2, WEIGHT_SCALE)[2]
    short = LaunchSpec(topk.kernel, (1,), topk.args)    # one CTA per row: 2 rows need 2
    with pytest.raises(ValueError, match=r"grid \(1, 1, 1\) for 2 rows"):
        run([short], space)
    record = dataclasses.replace(topk.kernel, spec={**topk.kernel.spec, "kind": "gather"})
    with pytest.raises(NoEmulator, match="kind 'gather'"):
        run([LaunchSpec(record, topk.grid, topk.args)], space)
