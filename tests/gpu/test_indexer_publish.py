"""GPU: the indexer chain (prep, scores, top-k, candidate blocks) against its NumPy reference.

Fresh random queries, weights and key records every run, pages of the key cache handed out as a
permutation and every page no sequence owns filled with 0xFF (NaN keys and scales): a read through a
wrong block table or past a sequence's entries turns a score NaN. Scores, plan, q fragments and
top-k outputs are NaN/0xFF poisoned before the launch. Cases: contexts shorter than the window, 1k,
32k, 128k; R in {1, 5, 6, 12, 48} (decode rows, a draft-sized and verify blocks, several
sequences) plus padding rows (sequence -1); the candidate-consumer (reindex) chain on the
candidates the candidate source picked, at contexts longer than the candidate coverage.

Checks: plan and q fragments/scales/weights bitwise (integer work and exact power-of-two scaling);
scores within `score_tolerance` (2^-12 of sum |w||q||K|: the tensor core's truncating k-step adder
and ~40 fp32 roundings, see kernels/indexer_kernel_ref.py) and NaN exactly where nothing may be
written; top-k and candidate blocks bitwise equal to `topk_ref` applied to the kernel's own scores
(the selection is exact), and the cluster top-k variants bitwise equal to the defaults; a replay is
bitwise identical.
"""
from __future__ import annotations

import indexer_cases as cases
import numpy as np
import pytest

from executor.indexer_chain import IndexerChain, IndexerShape, random_key_records
from kernels import indexer_kernel_ref as ik
from kernels import indexer_ref, kvrecord_ref
from loader import formats

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

PAGE = 64
WEIGHT_SCALE = 128 ** -0.5 * 32 ** -0.5
CASES = [(10, 1), (10, 6), (1000, 1), (1000, 5), (1000, 12), (1000, 48), (4096, 48),
         (32768, 1), (32768, 6), (32768, 12), (131072, 1), (131072, 6)]


def setup_keys(rng, chain: IndexerChain, seqs: int, positions, seq_index, ratio: int):
    """Random key records on each sequence's pages (permuted), 0xFF everywhere else."""
    s = chain.shape
    total_pages = s.max_seqs * s.pages_per_seq
    tables = rng.permutation(total_pages)[:s.max_seqs * s.pages_per_seq].reshape(
        s.max_seqs, s.pages_per_seq).astype(np.int32)
    chain.poison("keys")
    decoded = []
    for q in range(seqs):
        n = (int(positions[seq_index == q].max()) + 1) // ratio
        recs = random_key_records(rng, n)
        e = np.arange(n)
        phys = tables[q, e // PAGE].astype(np.int64) * PAGE + e % PAGE
        view = chain.arena.view("keys", np.uint8, (total_pages * PAGE, ik.KEY_BYTES))
        view[cp.asarray(phys)] = cp.asarray(recs)
        decoded.append(kvrecord_ref.decode_index_key(recs))
    chain.upload("block_tables", tables)
    return decoded


def run_chain(chain, rows, stream):
    """The default chain, then the cluster top-k variants on its scores (dense chains)."""
    chain.poison("scores", "topk", "blocks_out", "qfrag", "qscale", "qw", "plan", "topk_c",
                 "blocks_c", "topk_b", "blocks_b")
    cp.cuda.Device().synchronize()
    for spec in chain.launches(rows, WEIGHT_SCALE) + list(chain.variant_launches(rows).values()):
        spec.launch(stream)
    stream.synchronize()


def check_prep(chain, q, w_raw, positions, seq_index, mode, cands=None):
    """The prep outputs bitwise; returns the dequantized query and head weights."""
    codes, scales, w = ik.prep_query(q, w_raw, WEIGHT_SCALE)
    cases.check_prep(chain.download, chain.shape.ratio, mode, codes, scales, w, positions,
                     seq_index, cands)
    return ik.dequantized_query(codes, scales), w


def new_chain(dev, bundle, mode, context, rows, candidate_source):
    return IndexerChain(dev, bundle, IndexerShape(
        32, 1, mode, 512, 2048, 8, PAGE, rows + 2, rows + 1, max(context, 64),
        candidate_source=candidate_source))


@pytest.mark.parametrize(("context", "rows"), CASES)
def test_layer20_then_reindex(dev, v41_bundle, context, rows):
    rng = np.random.default_rng()
    stream = dev.stream()
    positions, seq_index, seqs = cases.make_rows(rng, context, rows, padding=2)
    r = positions.size
    q = formats.bf16_round(rng.standard_normal((r, 32, 128)).astype(np.float32))
    w_raw = formats.bf16_round(rng.standard_normal((r, 32)).astype(np.float32))
    q_bits = (q.view(np.uint32) >> 16).astype(np.uint16)
    w_bits = (w_raw.view(np.uint32) >> 16).astype(np.uint16)

    dense = new_chain(dev, v41_bundle, "dense", context, rows, True)
    try:
        decoded = setup_keys(rng, dense, seqs, positions, seq_index, 1)
        for name, arr in (("q", q_bits), ("w_raw", w_bits), ("positions", positions),
                          ("seq_index", seq_index)):
            dense.upload(name, arr)
        run_chain(dense, r, stream)
        qd, w = check_prep(dense, q, w_raw, positions, seq_index, "dense")
        scores = dense.download("scores", np.float32, (r, dense.shape.max_entries))
        cases.check_scores(scores, qd, w, decoded, seq_index)
        topk = dense.download("topk", np.int32, (r, 512))
        np.testing.assert_array_equal(topk, ik.topk_ref(scores, positions, seq_index, "entries",
                                                        512, 1))
        blocks = dense.download("blocks_out", np.int32, (r, 2048))
        np.testing.assert_array_equal(blocks, ik.topk_ref(scores, positions, seq_index,
                                                          "blocks", 2048, 1))
        np.testing.assert_array_equal(dense.download("topk_c", np.int32, (r, 512)), topk,
                                      err_msg="cluster top-k variant (entries)")
        np.testing.assert_array_equal(dense.download("blocks_c", np.int32, (r, 2048)), blocks,
                                      err_msg="cluster top-k variant (blocks)")
        np.testing.assert_array_equal(dense.download("topk_b", np.int32, (r, 512)), topk,
                                      err_msg="cluster top-k variant (both: entries)")
        np.testing.assert_array_equal(dense.download("blocks_b", np.int32, (r, 2048)), blocks,
                                      err_msg="cluster top-k variant (both: blocks)")
        for spec in dense.launches(r, WEIGHT_SCALE):           # replay: bitwise
            spec.launch(stream)
        stream.synchronize()
        np.testing.assert_array_equal(dense.download("topk", np.int32, (r, 512)), topk)
        np.testing.assert_array_equal(
            dense.download("scores", np.float32, scores.shape)[~np.isnan(scores)],
            scores[~np.isnan(scores)])
        keys_bytes = dense.download("keys", np.uint8, (dense.arena.nbytes("keys"),))
        tables = dense.download("block_tables", np.int32, (dense.shape.max_seqs,
                                                           dense.shape.pages_per_seq))
    finally:
        dense.close()

    reindex = new_chain(dev, v41_bundle, "candidates", context, rows, False)
    try:
        reindex.upload("keys", keys_bytes)
        reindex.upload("block_tables", tables)
        q2 = formats.bf16_round(rng.standard_normal((r, 32, 128)).astype(np.float32))
        for name, arr in (("q", (q2.view(np.uint32) >> 16).astype(np.uint16)),
                          ("w_raw", w_bits), ("positions", positions),
                          ("seq_index", seq_index), ("cands", blocks)):
            reindex.upload(name, arr)
        run_chain(reindex, r, stream)
        qd2, w2 = check_prep(reindex, q2, w_raw, positions, seq_index, "candidates", blocks)
        scores2 = reindex.download("scores", np.float32, (r, reindex.shape.max_entries))
        n_max = reindex.shape.max_entries
        inside = indexer_ref.candidate_entry_mask(blocks, n_max, 8) & indexer_ref.visible_mask(
            ik.visible_counts(positions, seq_index, 1), n_max)
        cases.check_scores(scores2, qd2, w2, decoded, seq_index, allowed=inside)
        want = ik.topk_ref(scores2, positions, seq_index, "candidates", 512, 1, cands=blocks)
        np.testing.assert_array_equal(reindex.download("topk", np.int32, (r, 512)), want)
        np.testing.assert_array_equal(reindex.download("topk_c", np.int32, (r, 512)), want,
                                      err_msg="cluster top-k variant (candidates)")
    finally:
        reindex.close()


# ---- SWA insert: bytes equal to the reference records ----------------------------------------

@pytest.mark.parametrize("rows", [1, 5, 6, 12, 48, 192])
def test_swa_insert_writes_reference_bytes(dev, v41_bundle, rows):
    """Every byte of the cache equals the reference after the launch: the records of real rows,
    0xFF (poison) everywhere else, so a padding row that wrote, a wrong slot or a stray byte shows.
    kv is drawn with group scales spread over 2^-20..2^6 so the scale bytes vary."""
    from executor.arena import Arena
    from executor.launch import LaunchSpec
    from kernels import kv_publish_ref as kp
    from kernels import rope_ref
    from loader.config import ModelConfig

    rng = np.random.default_rng()
    cfg = ModelConfig.preset("v41-flash")
    table = rope_ref.RopeTable.for_ratio(cfg, int(rng.integers(0, 2)), 8192)
    padding = 2
    r = rows + padding
    kv = rng.standard_normal((r, 512)).astype(np.float32)
    kv *= np.exp2(rng.integers(-20, 7, (r, 8))).repeat(64, axis=1).astype(np.float32)
    kv = formats.to_bf16(kv)
    weight = (rng.random(512) * 2).astype(np.float32)
    positions = rng.integers(0, 8192, r).astype(np.int32)
    num_slots = 2 * r + 7
    slots = rng.permutation(num_slots)[:r].astype(np.int64)
    slots[rng.permutation(r)[:padding]] = -1
    eps = float(cfg.rms_norm_eps)
    want = np.full((num_slots, 584), 0xFF, np.uint8)
    kp.swa_insert_ref(want, kv, weight, eps, table, positions, slots)

    spec = kp.make_swa_spec()
    reqs = [("kv", 2 * r * 512), ("weight", 4 * 512), ("table", table.nbytes),
            ("positions", 4 * r), ("slots", 8 * r), ("cache", num_slots * 584)]
    with Arena(dev, reqs) as arena:
        for name, arr in (("kv", kv.view(np.uint16)), ("weight", weight),
                          ("table", table.cos_sin), ("positions", positions), ("slots", slots)):
            flat = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
            arena.view(name, np.uint8, flat.shape)[...] = cp.asarray(flat)
        arena.view("cache", np.uint8)[...] = 0xFF
        cp.cuda.Device().synchronize()
        stream = dev.stream()
        LaunchSpec(v41_bundle.kernel(spec.name), spec.grid(r),
                   (arena.ptr("kv"), arena.ptr("weight"), arena.ptr("table"),
                    arena.ptr("positions"), arena.ptr("slots"), arena.ptr("cache"), r, 8192,
                    eps)).launch(stream)
        stream.synchronize()
        got = arena.view("cache", np.uint8, (num_slots, 584)).get()
    diff = np.argwhere(got != want)
    assert diff.size == 0, (f"{len(diff)} bytes differ; first at record {diff[0][0]} byte "
                            f"{diff[0][1]}: {got[tuple(diff[0])]:#x} vs {want[tuple(diff[0])]:#x}")
