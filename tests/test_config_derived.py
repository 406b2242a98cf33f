"""ModelConfig derivations: layer roles (model doc §1.2, §5), per-rank shapes, the Engram layout."""

from __future__ import annotations

import numpy as np
import pytest

from loader.config import LayerSpec, ModelConfig

REAL = ModelConfig.preset("v41-flash")
TINY = ModelConfig.preset("tiny")


def _tiny_dict() -> dict:
    return TINY.to_dict()


# ---- layer roles: model doc §1.2 (real) and §5 (tiny), layer by layer ----------------------------


def _spec(index, ratio, mode, kv=None, topk=None, engram=False, candidate_source=False):
    return LayerSpec(
        index=index,
        ratio=ratio,
        mode=mode,
        kv_source=kv,
        topk_source=topk,
        owns_compressor=mode == "full",
        owns_index_keys=mode == "full",
        has_indexer=mode in ("full", "reindex"),
        is_candidate_source=candidate_source,
        uses_candidates=mode == "reindex",
        has_engram=engram,
        is_dspark=mode == "draft",
    )


def test_tiny_layer_roles():
    # §5: 0 SWA | 1 SWA+Engram | 2 C2A full | 3 C2A reuse | 4 C2A full+Engram | 5 C2A reuse
    #     6 C1A full+candidates | 7 C1A reuse | 8 C1A reindex(candidate consumer) | 9 C1A reuse
    expected = [
        _spec(0, 0, "swa"),
        _spec(1, 0, "swa", engram=True),
        _spec(2, 2, "full", 2, 2),
        _spec(3, 2, "reuse", 2, 2),
        _spec(4, 2, "full", 4, 4, engram=True),
        _spec(5, 2, "reuse", 4, 4),
        _spec(6, 1, "full", 6, 6, candidate_source=True),
        _spec(7, 1, "reuse", 6, 6),
        _spec(8, 1, "reindex", 6, 8),
        _spec(9, 1, "reuse", 6, 8),
        _spec(10, 0, "draft"),
        _spec(11, 0, "draft"),
        _spec(12, 0, "draft"),
    ]
    assert [TINY.layer(i) for i in range(13)] == expected
    assert TINY.layers == tuple(expected)


def test_real_layer_roles():
    expected = {0: _spec(0, 0, "swa"), 1: _spec(1, 0, "swa", engram=True)}
    for source in (2, 8, 14):  # §1.2: 2, 8, 14 FULL; 3-7, 9-13, 15-19 REUSE their top-k
        expected[source] = _spec(source, 2, "full", source, source, engram=source == 14)
        for i in range(source + 1, source + 6):
            expected[i] = _spec(i, 2, "reuse", source, source)
    expected[20] = _spec(20, 1, "full", 20, 20, candidate_source=True)
    for i in range(21, 40):  # REINDEX at 24/28/32/36; REUSE the latest index source otherwise
        latest = max(s for s in (20, 24, 28, 32, 36) if s <= i)
        expected[i] = _spec(i, 1, "reindex" if i == latest else "reuse", 20, latest)
    for i in range(40, 43):
        expected[i] = _spec(i, 0, "draft")
    assert len(REAL.layers) == 43
    for i in range(43):
        assert REAL.layer(i) == expected[i], f"layer {i}"


def test_layer_index_is_checked():
    assert TINY.layer(np.int64(3)) == TINY.layer(3)
    for bad in (-1, 13):
        with pytest.raises(ValueError, match=rf"layer {bad} is outside 0..12"):
            TINY.layer(bad)
    with pytest.raises(TypeError, match="layer index must be an int"):
        TINY.layer(2.0)


# ---- per-rank shapes -----------------------------------------------------------------------------

# tp -> (heads, o_groups, moe_inter, shared_inter, dspark_moe_inter, vocab, q_b_out, wo_b_in,
#        engram hash columns)
REAL_RANKS = {
    1: (64, 8, 2304, 2304, 2304, 129280, 32768, 8192, 24),
    2: (32, 4, 1152, 1152, 1152, 64640, 16384, 4096, 12),
    4: (16, 2, 576, 576, 576, 32320, 8192, 2048, 6),
}
TINY_RANKS = {
    1: (16, 8, 384, 384, 384, 1024, 8192, 1024, 24),
    2: (8, 4, 192, 192, 192, 512, 4096, 512, 12),
    4: (4, 2, 96, 96, 96, 256, 2048, 256, 6),
}


@pytest.mark.parametrize(
    "cfg, table", [(REAL, REAL_RANKS), (TINY, TINY_RANKS)], ids=["real", "tiny"]
)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_rank_shapes(cfg, table, tp):
    s = cfg.rank_shapes(tp)
    got = (
        s.heads,
        s.o_groups,
        s.moe_inter,
        s.shared_inter,
        s.dspark_moe_inter,
        s.vocab,
        s.q_b_out,
        s.wo_b_in,
        s.engram_hash_cols,
    )
    assert (s.tp, got) == (tp, table[tp])
    assert [s.vocab_offset(r) for r in range(tp)] == [r * cfg.vocab_size // tp for r in range(tp)]
    with pytest.raises(ValueError, match=f"rank {tp} is outside"):
        s.vocab_offset(tp)


@pytest.mark.parametrize("tp", [0, 3, 8, True])
def test_unsupported_tp(tp):
    with pytest.raises(ValueError, match=r"is not supported; expected one of \(1, 2, 4\)"):
        TINY.rank_shapes(tp)


@pytest.mark.parametrize(
    "changes, tp, needle",
    [
        ({"o_groups": 2, "num_attention_heads": 16}, 4, "tp=4 does not divide o_groups = 2"),
        (
            {"num_attention_heads": 6, "o_groups": 2},
            4,
            "tp=4 does not divide num_attention_heads = 6",
        ),
        (
            {"moe_intermediate_size": 64, "dspark_moe_intermediate_size": 128},
            4,
            "moe_intermediate_size = 64 does not split into whole 32-wide blocks at tp=4",
        ),
        ({"dspark_moe_intermediate_size": 96}, 2, "dspark_moe_intermediate_size = 96"),
        ({"vocab_size": 1056}, 2, "vocab_size = 1056"),
        ({"engram_n_heads": 3}, 2, "tp=2 does not divide Engram hash columns"),
    ],
)
def test_tp_must_split_widths(changes, tp, needle):
    data = {**_tiny_dict(), **changes}
    del data["engram_num_embeddings"]  # re-derived for the changed Engram heads
    cfg = ModelConfig.from_dict(data)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        cfg.rank_shapes(tp)


# ---- Engram: the prime walk, table rows, offsets, multipliers, rank split ------------------------


def _sieve_primes_above(start: int, count: int) -> list[int]:
    """An independent oracle for the walk: Eratosthenes up to a bound past the `count`-th prime."""
    limit = start + 64 * count + 1000  # prime gaps near 1.6e7 average ~17, far below 64
    sieve = np.ones(limit + 1, dtype=bool)
    sieve[:2] = False
    for p in range(2, int(limit**0.5) + 1):
        if sieve[p]:
            sieve[p * p :: p] = False
    primes = np.flatnonzero(sieve[start + 1 :]) + start + 1
    assert len(primes) >= count
    return [int(p) for p in primes[:count]]


@pytest.mark.parametrize("cfg", [REAL, TINY], ids=["real", "tiny"])
def test_engram_primes_are_one_global_walk(cfg):
    walk = _sieve_primes_above(cfg.engram_vocab_size - 1, 24 * len(cfg.engram_layer_ids))
    flat = [p for layer in cfg.engram_layer_ids for p in cfg.engram_primes_flat(layer)]
    assert flat == walk
    for i, layer in enumerate(cfg.engram_layer_ids):
        # [layer][order][head] nesting: 3 orders (2-, 3-, 4-gram) of 8 heads each
        nested = cfg.engram_primes[i]
        assert [len(order) for order in nested] == [8, 8, 8]
        assert [p for order in nested for p in order] == walk[24 * i : 24 * (i + 1)]
        assert cfg.engram_num_embeddings_of(layer) == sum(walk[24 * i : 24 * (i + 1)])


def test_engram_rows_known_answer():
    # The real config's rows (model doc §1.1), reproduced from the walk, not read from the preset.
    data = REAL.to_dict()
    del data["engram_num_embeddings"]
    derived = ModelConfig.from_dict(data)
    assert derived.engram_num_embeddings == (384006168, 384016682)
    assert (derived.engram_num_embeddings_of(1), derived.engram_num_embeddings_of(14)) == (
        384006168,
        384016682,
    )


@pytest.mark.parametrize("cfg", [REAL, TINY], ids=["real", "tiny"])
def test_engram_offsets_tile_the_table(cfg):
    for layer in cfg.engram_layer_ids:
        primes, offsets = cfg.engram_primes_flat(layer), cfg.engram_offsets(layer)
        assert offsets[0] == 0 and len(offsets) == cfg.engram_num_hash_cols == 24
        assert all(offsets[c + 1] - offsets[c] == primes[c] for c in range(23))
        assert offsets[-1] + primes[-1] == cfg.engram_num_embeddings_of(layer)


@pytest.mark.parametrize("cfg", [REAL, TINY], ids=["real", "tiny"])
def test_engram_hash_multipliers(cfg):
    bound = (np.iinfo(np.int64).max // cfg.engram_compressed_vocab_size) // 2
    rows = {}
    for layer in cfg.engram_layer_ids:
        mult = cfg.engram_hash_multipliers(layer)
        draw = np.random.default_rng(10007 * layer).integers(0, bound, size=4, dtype=np.int64)
        assert mult == tuple(int(v) * 2 + 1 for v in draw)
        assert all(m % 2 == 1 and 1 <= m < 2 * bound for m in mult)
        # the product of the largest compressed id and a multiplier stays inside int64
        assert max(mult) * (cfg.engram_compressed_vocab_size - 1) <= np.iinfo(np.int64).max
        rows[layer] = mult
    assert len(set(rows.values())) == len(rows)


@pytest.mark.parametrize("cfg", [REAL, TINY], ids=["real", "tiny"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_engram_rank_rows_partition_the_table(cfg, tp):
    for layer in cfg.engram_layer_ids:
        ranges = [cfg.engram_rank_rows(layer, tp, r) for r in range(tp)]
        assert ranges[0][0] == 0 and ranges[-1][1] == cfg.engram_num_embeddings_of(layer)
        assert all(ranges[r][1] == ranges[r + 1][0] for r in range(tp - 1))
        cols = 24 // tp
        primes = cfg.engram_primes_flat(layer)
        assert [b - a for a, b in ranges] == [
            sum(primes[r * cols : (r + 1) * cols]) for r in range(tp)
        ]
    with pytest.raises(ValueError, match=f"rank {tp} is outside"):
        cfg.engram_rank_rows(cfg.engram_layer_ids[0], tp, tp)


def test_engram_queries_need_an_engram_layer():
    for query in (
        TINY.engram_primes_flat,
        TINY.engram_offsets,
        TINY.engram_hash_multipliers,
        TINY.engram_num_embeddings_of,
    ):
        with pytest.raises(
            ValueError, match=r"layer 2 has no Engram \(engram_layer_ids \[1, 4\]\)"
        ):
            query(2)


def test_no_candidate_source():
    # -1: no two-level indexer (as in a config cut below the candidate source); reindex layers then
    # scan every entry of their kv source's index keys.
    cfg = ModelConfig.from_dict({**_tiny_dict(), "candidate_source_layer_id": -1})
    assert not any(spec.is_candidate_source or spec.uses_candidates for spec in cfg.layers)
    assert cfg.layer(8).mode == "reindex" and cfg.layer(8).topk_source == 8
    with pytest.raises(ValueError, match="candidate_source_layer_id = -2"):
        ModelConfig.from_dict({**_tiny_dict(), "candidate_source_layer_id": -2})


@pytest.mark.parametrize("num_layers", [1, 2, 3, 9, 20, 21, 25])
def test_configs_cut_to_the_first_layers(num_layers):
    """What `hopdec synth --layers N` writes: the first N layers of the real model, no DSpark."""
    d = REAL.to_dict()

    def keep(ids):
        return [i for i in ids if i < num_layers]

    engram = keep(REAL.engram_layer_ids)
    d.update(
        num_hidden_layers=num_layers,
        compress_ratios=list(REAL.compress_ratios[:num_layers]),
        kv_source_layer_ids=keep(REAL.kv_source_layer_ids),
        index_source_layer_ids=keep(REAL.index_source_layer_ids),
        engram_layer_ids=engram,
        engram_num_embeddings=list(REAL.engram_num_embeddings[: len(engram)]),
        num_nextn_predict_layers=0,
        dspark_target_layer_ids=[],
        candidate_source_layer_id=20 if num_layers > 20 else -1,
    )
    cut = ModelConfig.from_dict(d)
    assert cut.layers == REAL.layers[:num_layers]
