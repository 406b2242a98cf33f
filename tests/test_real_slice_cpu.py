"""The real-dimension slice's host side without a GPU (tests/real_slice.py).

The slice's layers have v41-flash's roles, widths and Engram hashing; one draw cut per rank is
exactly synth_fetch's values (every tensor of tiny, every rank; a few of the v41 slice's);
prefetching in worker processes draws the same values and skips the aliased experts; the
reference's experts are the aliased expert's.
"""
from __future__ import annotations

import numpy as np
import pytest
import real_slice as rs
from ref_model import caches_equal

from executor.bench_step import bench_config
from loader.config import ModelConfig
from loader.synth import synth_fetch


@pytest.fixture(scope="module")
def tiny():
    return ModelConfig.preset("tiny")


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8),
                                                                        b.view(np.uint8))


def test_slice_keeps_the_first_layers_roles_and_widths():
    v41, cfg = bench_config(), rs.slice_config_v41()
    assert cfg.num_hidden_layers == rs.LAYERS == 4
    assert [cfg.layer(i) for i in range(4)] == [v41.layer(i) for i in range(4)]
    assert [s.mode for s in cfg.layers[:4]] == ["swa", "swa", "full", "reuse"]
    assert cfg.layer(1).has_engram and cfg.engram_layer_ids == (1,)
    assert cfg.engram_primes_flat(1) == v41.engram_primes_flat(1)
    assert cfg.engram_hash_multipliers(1) == v41.engram_hash_multipliers(1)
    assert cfg.rank_shapes(4) == v41.rank_shapes(4)
    assert (cfg.n_routed_experts, cfg.vocab_size, cfg.hidden_size) == (384, 129280, 5120)
    assert cfg.dspark_target_layer_ids == (3,) and cfg.layer(4).is_dspark
    cut = {"num_hidden_layers", "compress_ratios", "kv_source_layer_ids", "engram_layer_ids",
           "index_source_layer_ids", "candidate_source_layer_id", "engram_num_embeddings",
           "num_nextn_predict_layers", "dspark_target_layer_ids", "max_position_embeddings"}
    a, b = cfg.to_dict(), v41.to_dict()
    assert {k for k in a if a[k] != b[k]} <= cut


def test_one_draw_cut_per_rank_is_synth_fetch(tiny):
    shared = rs.SharedSynth(tiny, seed=5)
    for rank in (0, 3):
        want, got = synth_fetch(tiny, 5, rs.TP, rank), shared.fetch(rank)
        for name in shared.specs:
            assert _same(got(name), want(name)), (name, rank)
    with pytest.raises(KeyError, match="layers.99.attn.wq_b.weight"):
        shared.fetch(0)("layers.99.attn.wq_b.weight")


def test_v41_slice_draws_equal_synth_fetch():
    cfg = rs.slice_config_v41()
    shared = rs.SharedSynth(cfg, seed=1)
    names = ["layers.2.attn.indexer.wq_b.scale", "layers.2.attn.indexer.wq_b.weight",
             "layers.0.ffn.experts.3.w2.scale", "layers.0.ffn.experts.3.w1.weight",
             "layers.1.hc_attn_fn", "layers.2.attn.indexer.wk.weight"]
    for rank in (0, 3):
        want, got = synth_fetch(cfg, 1, rs.TP, rank), shared.fetch(rank)
        for name in names:
            assert _same(got(name), want(name)), (name, rank)
        aliased = shared.fetch(rank, alias_experts=4)
        assert _same(aliased("layers.0.ffn.experts.7.w2.scale"),
                     want("layers.0.ffn.experts.3.w2.scale"))


def test_prefetch_draws_the_same_values_in_workers(tiny):
    shared = rs.SharedSynth(tiny, seed=2)
    shared.prefetch(unique_experts=4, workers=2)
    drawn = dict(shared._full)
    assert "layers.2.ffn.experts.3.w1.weight" in drawn
    assert not any(".experts.4." in n or ".experts.15." in n for n in drawn)
    assert len(drawn) > 100
    fresh = rs.SharedSynth(tiny, seed=2)
    for name, array in drawn.items():
        assert _same(array, fresh.full(name)), name


def test_reference_experts_are_the_aliased_experts(tiny):
    shared = rs.SharedSynth(tiny, seed=3)
    model = rs.reference_model(tiny, shared)
    unique = rs.stage_ffn_few_experts.UNIQUE_EXPERTS
    lw = model.ranks[1].layer(2)
    assert len(lw.experts) == tiny.n_routed_experts
    plain = type(lw)(tiny, lw.spec, shared.fetch(1), lw.prefix, 4, 1, True)
    for e in (0, 5, tiny.n_routed_experts - 1):
        want = plain._expert(e % unique)
        assert np.array_equal(lw.experts[e].w13, want.w13), e
        assert np.array_equal(lw.experts[e].w2, want.w2), e
    assert lw.experts[unique + 1] is lw.experts[1]          # dequantized once per value
    with pytest.raises(IndexError):
        lw.experts[tiny.n_routed_experts]


def test_packing_per_module_gives_arena_contents_slices(tiny):
    shared = rs.SharedSynth(tiny, seed=4)
    contents, _ = rs.pack_ranks(tiny, shared, 16, workers=4)
    for rank in (0, 3):
        requests, uploads = contents[rank]
        want_req, want_up = rs.arena_contents(tiny, rs.TP, rank, shared.fetch(rank), 16,
                                              rs.MODULES)
        assert sorted(requests) == sorted(want_req)
        assert len({r[0] for r in requests}) == len(requests)
        want = dict(want_up)
        assert sorted(want) == sorted(name for name, _ in uploads)
        for name, array in uploads:
            assert _same(array, want[name]), (rank, name)


def test_reference_in_a_process_equals_the_reference_here(tiny):
    rng = np.random.default_rng(6)
    prompt = [int(t) for t in rng.integers(0, 1000, 9)]
    blocks = [("decode", [int(rng.integers(0, 1000))]),
              ("verify", [int(t) for t in rng.integers(0, 1000, 6)])]
    shared = rs.SharedSynth(tiny, seed=6)
    for name in shared.specs:
        if not rs.EXPERT.fullmatch(name):
            shared.full(name)          # drawn here and shipped; the experts drawn where read
    future = rs.reference_in_process(tiny, shared, prompt, blocks)
    here_caches, here = rs.reference_run((tiny, 6, dict(shared._full), prompt, blocks))
    there_caches, there = future.result(timeout=300)
    assert len(here) == len(there) == 2
    for a, b in zip(here, there):
        assert _same(a.logits, b.logits) and _same(a.tokens, b.tokens)
    assert caches_equal(here_caches, there_caches)
    assert here_caches.swa.keys() and any(np.any(a) for a in here_caches.swa.values())
    with pytest.raises(KeyError, match="no Engram vocab map set"):
        rs.SharedSynth(tiny).fetch(0)("engram.vocab_map")
    vocab_map = np.random.default_rng().permutation(tiny.vocab_size).astype(np.int32)
    shared.set_vocab_map(vocab_map)
    assert np.array_equal(shared.fetch(3)("engram.vocab_map"), vocab_map)
    assert np.array_equal(rs.reference_model(tiny, shared).vocab_map, vocab_map)
