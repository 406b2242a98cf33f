"""loader.engram_vocab: Engram's compressed-vocab map is loaded, validated, served and applied.

A config "needs a map" when engram_compressed_vocab_size < vocab_size (v41). `SMALL` is tiny with
a compressed vocabulary of 700 < 1024, so a whole synthetic checkpoint that needs a map is cheap.
"""
import shutil

import numpy as np
import pytest

from executor.bench_step_pack import SharedFetch
from executor.reference import step
from executor.stages import mhc as mhc_stage
from loader import engram_vocab as ev
from loader.checkpoint import Checkpoint, CheckpointError
from loader.config import ModelConfig
from loader.sharding import shard
from loader.synth import synth, synth_fetch

RNG = np.random.default_rng()
TINY = ModelConfig.preset("tiny")
V41 = ModelConfig.preset("v41-flash")
SMALL = ModelConfig.from_dict({**TINY.to_dict(), "engram_compressed_vocab_size": 700},
                              source="tiny, compressed vocab 700")


def _no_map_fetch(name):
    raise KeyError(f"no tensor {name!r}")


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    return synth(SMALL, tmp_path_factory.mktemp("small") / "ckpt", seed=3, progress=False)


def test_which_configs_need_a_map():
    assert not ev.needs_map(TINY) and ev.needs_map(V41) and ev.needs_map(SMALL)


def test_bad_maps_are_named():
    good = RNG.integers(0, SMALL.engram_compressed_vocab_size, SMALL.vocab_size)
    assert ev.check_vocab_map(SMALL, good, "x").dtype == np.int32
    cases = [(good.astype(np.float32), "integer ids"), (good[:-1], r"must be \[1024\]"),
             (good.reshape(2, -1), r"must be \[1024\]")]
    for value, at in ((-1, 5), (SMALL.engram_compressed_vocab_size, 1023)):
        bad = good.copy()
        bad[at] = value
        cases.append((bad, f"token {at} maps to {value}"))
    for array, message in cases:
        with pytest.raises(ev.EngramVocabMapError, match=f"my map: .*{message}"):
            ev.check_vocab_map(SMALL, array, "my map")


def test_fetch_vocab_map_identity_map_or_a_clear_error():
    assert np.array_equal(ev.fetch_vocab_map(TINY, _no_map_fetch), np.arange(TINY.vocab_size))
    with pytest.raises(ev.EngramVocabMapError, match="engram_vocab_map.npy.*'identity'"):
        ev.fetch_vocab_map(V41, _no_map_fetch)
    opted = ev.fetch_vocab_map(V41, ev.with_vocab_map(_no_map_fetch, ev.IDENTITY))
    assert np.array_equal(opted, np.arange(V41.vocab_size))
    shared = SharedFetch(ev.with_vocab_map(_no_map_fetch, ev.IDENTITY))   # asarray, read-only
    assert np.array_equal(ev.fetch_vocab_map(V41, shared), np.arange(V41.vocab_size))
    given = ev.synthetic_vocab_map(V41, 5)
    assert np.array_equal(ev.fetch_vocab_map(V41, ev.with_vocab_map(_no_map_fetch, given)), given)
    with pytest.raises(ev.EngramVocabMapError, match="maps to"):
        ev.fetch_vocab_map(V41, ev.with_vocab_map(_no_map_fetch, given + 1000))
    with pytest.raises(ev.EngramVocabMapError, match="expected an array or 'identity'"):
        ev.with_vocab_map(_no_map_fetch, "raw")
    with pytest.raises(KeyError, match="other"):      # every other name goes to the inner fetch
        ev.with_vocab_map(_no_map_fetch, given)("other")


def test_synthetic_map_is_surjective_and_not_the_identity():
    m = ev.synthetic_vocab_map(V41, 0)
    assert np.array_equal(np.unique(m), np.arange(V41.engram_compressed_vocab_size))
    assert np.count_nonzero(m != np.arange(V41.vocab_size) % V41.engram_compressed_vocab_size)
    assert np.array_equal(m, ev.synthetic_vocab_map(V41, 0))
    assert not np.array_equal(m, ev.synthetic_vocab_map(V41, 1))


def test_checkpoint_serves_its_map_to_every_rank(small_ckpt):
    want = ev.synthetic_vocab_map(SMALL, 3)
    assert (small_ckpt / ev.VOCAB_MAP_FILE).is_file()
    with Checkpoint.open(small_ckpt, progress=False) as ckpt:
        assert np.array_equal(ckpt.vocab_map, want)
        for rank in range(4):
            got = shard(ckpt, ckpt.spec(ev.VOCAB_MAP_NAME), 4, rank)
            assert np.array_equal(got, want)
            assert np.array_equal(synth_fetch(SMALL, 3, 4, rank)(ev.VOCAB_MAP_NAME), want)


def test_a_bad_map_file_fails_the_open_naming_it(small_ckpt, tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    for p in small_ckpt.iterdir():
        (d / p.name).symlink_to(p) if p.suffix == ".safetensors" else shutil.copy(p, d / p.name)
    (d / ev.VOCAB_MAP_FILE).unlink()
    np.save(d / ev.VOCAB_MAP_FILE, np.full(SMALL.vocab_size, 700, np.int32))
    with pytest.raises(CheckpointError, match="engram_vocab_map.npy: Engram vocab map values"):
        Checkpoint.open(d, progress=False)
    (d / ev.VOCAB_MAP_FILE).write_bytes(b"not a npy file")
    with pytest.raises(CheckpointError, match="engram_vocab_map.npy: unreadable"):
        Checkpoint.open(d, progress=False)
    (d / ev.VOCAB_MAP_FILE).unlink()                  # absent: opens; packing then refuses
    with Checkpoint.open(d, progress=False) as ckpt:
        assert ckpt.vocab_map is None
        with pytest.raises(KeyError):
            ckpt.spec(ev.VOCAB_MAP_NAME)
        fetch = lambda name: shard(ckpt, ckpt.spec(name), 4, 0)
        with pytest.raises(ev.EngramVocabMapError, match="compressed-vocab map"):
            mhc_stage.weights(SMALL, 4, 0, fetch, layers=[])


def test_the_mhc_stage_packs_the_map():
    packed = dict(mhc_stage.weights(SMALL, 4, 1, synth_fetch(SMALL, 9, 4, 1), layers=[]))
    assert np.array_equal(packed[ev.VOCAB_MAP_NAME], ev.synthetic_vocab_map(SMALL, 9))
    packed = dict(mhc_stage.weights(TINY, 4, 1, synth_fetch(TINY, 9, 4, 1), layers=[]))
    assert np.array_equal(packed[ev.VOCAB_MAP_NAME], np.arange(TINY.vocab_size))


def test_reference_compressed_ids():
    tokens = RNG.integers(0, V41.vocab_size, (5, 4))
    with pytest.raises(ev.EngramVocabMapError, match="compressed_ids: .*99092 < vocab_size"):
        step.compressed_ids(V41, tokens)
    m = ev.synthetic_vocab_map(V41, 2)
    assert np.array_equal(step.compressed_ids(V41, tokens, m), m[tokens])
    assert np.array_equal(step.compressed_ids(V41, tokens, ev.IDENTITY), tokens)
    assert np.array_equal(step.compressed_ids(TINY, tokens % TINY.vocab_size),
                          tokens % TINY.vocab_size)
    with pytest.raises(ValueError, match=r"must be in \[0, 129280\)"):
        step.compressed_ids(V41, np.array([V41.vocab_size]), m)


def test_reference_model_takes_the_weights_map_unless_given():
    fetch = synth_fetch(SMALL, 4, 4, 0)
    ranks = (type("Rank", (), {"fetch": staticmethod(fetch)})(),)
    assert np.array_equal(step.ReferenceModel(SMALL, ranks).vocab_map,
                          ev.synthetic_vocab_map(SMALL, 4))
    given = ev.synthetic_vocab_map(SMALL, 8)
    assert np.array_equal(step.ReferenceModel(SMALL, ranks, engram_vocab_map=given).vocab_map,
                          given)
    none = (type("Rank", (), {"fetch": staticmethod(_no_map_fetch)})(),)
    with pytest.raises(ev.EngramVocabMapError):
        _ = step.ReferenceModel(SMALL, none).vocab_map


def test_build_map_from_a_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<pad>": 0, "Apple": 1, " apple": 2, "APPLE": 3, "Café": 4, "cafe": 5, " ": 6,
             "x": 7}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    got, size = ev.build_map(path)
    # 'Apple', ' apple', 'APPLE' -> 'apple'; 'Café', 'cafe' -> 'cafe'; a lone space stays ' '
    assert got.tolist() == [0, 1, 1, 1, 2, 2, 3, 4] and size == 5


def test_fit_to_vocab_pads_the_missing_ids_with_the_pad():
    got = ev.fit_to_vocab(SMALL, np.arange(1000) % 700, 700)
    assert got.shape == (1024,) and (got[1000:] == got[SMALL.engram_pad_token_id]).all()
    with pytest.raises(ev.EngramVocabMapError, match="gives 699 compressed ids"):
        ev.fit_to_vocab(SMALL, np.arange(1000) % 699, 699)
    with pytest.raises(ev.EngramVocabMapError, match="more than vocab_size"):
        ev.fit_to_vocab(SMALL, np.arange(1100) % 700, 700)
