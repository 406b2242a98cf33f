"""Engram's compressed-vocabulary map: token id -> compressed id, loaded, validated, supplied.

Model doc §2.1 item 3: every token is mapped through a tokenizer-derived map (v41: 129280 ids ->
99092) before the n-gram hash. DeepSeek's `CompressedTokenizer` numbers the distinct normalised
texts (NFKC, NFD, strip accents, lowercase, whitespace collapsed) of the tokens in id order; the
map is `lookup_table[token_id]`. hopdec never builds it at run time (no `tokenizers`): it is data.

Where it comes from (`fetch_vocab_map`, called when a rank's arena is packed and by the NumPy
reference):
- a checkpoint directory's `engram_vocab_map.npy` (VOCAB_MAP_FILE: int32 [vocab_size], every
  value in [0, engram_compressed_vocab_size)), read and validated by `Checkpoint.open`, which then
  serves it as the replicated tensor VOCAB_MAP_NAME to every fetch;
- or the caller's array, `with_vocab_map(fetch, array)` (vLLM passes the table it built);
- or, where engram_compressed_vocab_size >= vocab_size (`tiny`), the identity without a file.
A config that needs a map and has none raises `EngramVocabMapError` at capture / reference time,
never a silent identity. The explicit opt-out is `with_vocab_map(fetch, IDENTITY)`: raw ids are
hashed as they are (the values then reach vocab_size - 1 > the compressed size; the hash and the
lookup stay in bounds, the Engram rows are just not the model's).

Synthetic checkpoints (`loader.synth`) carry `synthetic_vocab_map(cfg, seed)`, a seeded surjective
non-identity map, so packing and benchmarks of v41 shapes run the mapped path.
`build_map(tokenizer_json)` rebuilds DeepSeek's map with `tokenizers` when that is installed;
`python -m loader.engram_vocab TOKENIZER_JSON CHECKPOINT_DIR` writes the checkpoint's file with it
(checked against the config's compressed size; ids the tokenizer lacks, the embedding's padding
rows, map to map[pad_id]).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

VOCAB_MAP_NAME = "engram.vocab_map"      # the replicated tensor / arena slice name
VOCAB_MAP_FILE = "engram_vocab_map.npy"  # in the checkpoint directory
IDENTITY = "identity"                    # the explicit opt-out: hash raw ids
MAP_SEED_SALT = 0xE4A1                   # synthetic maps: default_rng([seed, salt])


class EngramVocabMapError(ValueError):
    """The compressed-vocabulary map is missing or malformed (names where it came from)."""


def needs_map(cfg) -> bool:
    """True when the config's compressed vocabulary is smaller than its vocabulary (v41)."""
    return bool(cfg.engram_layer_ids) and cfg.engram_compressed_vocab_size < cfg.vocab_size


def identity_map(cfg) -> np.ndarray:
    return np.arange(cfg.vocab_size, dtype=np.int32)


def check_vocab_map(cfg, array, source: str) -> np.ndarray:
    """`array` as a validated int32 [vocab_size] map with values in [0, compressed); raises
    EngramVocabMapError naming `source` and what was expected."""
    vocab, compressed = cfg.vocab_size, cfg.engram_compressed_vocab_size
    array = np.asarray(array)
    if array.dtype.kind not in "iu":
        raise EngramVocabMapError(f"{source}: the Engram vocab map must be integer ids, got "
                                  f"{array.dtype}")
    if array.shape != (vocab,):
        raise EngramVocabMapError(f"{source}: the Engram vocab map must be [{vocab}] "
                                  f"(vocab_size), got {list(array.shape)}")
    if array.size and (int(array.min()) < 0 or int(array.max()) >= compressed):
        bad = int(np.flatnonzero((array < 0) | (array >= compressed))[0])
        raise EngramVocabMapError(f"{source}: Engram vocab map values must be in [0, "
                                  f"{compressed}) (engram_compressed_vocab_size); token {bad} "
                                  f"maps to {int(array[bad])}")
    return np.ascontiguousarray(array, dtype=np.int32)


def load_vocab_map_file(cfg, path: str | Path) -> np.ndarray:
    """Read and validate a VOCAB_MAP_FILE (.npy, no pickles)."""
    path = Path(path)
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise EngramVocabMapError(f"{path}: unreadable Engram vocab map ({exc}); expected a "
                                  f".npy int32 [{cfg.vocab_size}] array") from None
    return check_vocab_map(cfg, array, str(path))


def vocab_map_spec(cfg):
    """The map as a replicated checkpoint-like tensor (what `Checkpoint.spec` serves)."""
    from loader.schema import Fmt, Split, TensorSpec
    return TensorSpec(VOCAB_MAP_NAME, "I32", (cfg.vocab_size,), Fmt.INT32, Split.REPLICATED,
                      "embed")


def resolve(cfg, vocab_map, source: str) -> np.ndarray:
    """An array, IDENTITY, or None (identity where no map is needed, else an error)."""
    if isinstance(vocab_map, str):
        if vocab_map != IDENTITY:
            raise EngramVocabMapError(f"{source}: vocab map {vocab_map!r}; expected an array "
                                      f"or {IDENTITY!r}")
        return identity_map(cfg)
    if vocab_map is not None:
        return check_vocab_map(cfg, vocab_map, source)
    if needs_map(cfg):
        raise EngramVocabMapError(
            f"{source}: engram_compressed_vocab_size {cfg.engram_compressed_vocab_size} < "
            f"vocab_size {cfg.vocab_size}: Engram needs the tokenizer's compressed-vocab map. "
            f"Put {VOCAB_MAP_FILE} (int32 [{cfg.vocab_size}]) in the checkpoint directory, pass "
            f"fetch = loader.engram_vocab.with_vocab_map(fetch, array), or opt into hashing raw "
            f"ids with with_vocab_map(fetch, {IDENTITY!r})")
    return identity_map(cfg)


def fetch_vocab_map(cfg, fetch: Callable[[str], np.ndarray]) -> np.ndarray:
    """The map a weight fetch serves (VOCAB_MAP_NAME), validated; the identity where the config
    needs none and the fetch has none; EngramVocabMapError where it needs one and has none."""
    try:
        served = fetch(VOCAB_MAP_NAME)
    except KeyError:
        served = None
    if served is not None and np.asarray(served).dtype == _IDENTITY_MARK.dtype:
        return identity_map(cfg)
    return resolve(cfg, served, f"weights of {cfg.model_type}")


# The opt-out as a fetch serves it: an empty array of a dtype no map has (it survives the
# asarray / view / read-only wrappers fetches go through, e.g. bench_step_pack.SharedFetch).
_IDENTITY_MARK = np.zeros(0, dtype=[("engram_vocab_identity", "u1")])


def with_vocab_map(fetch: Callable[[str], np.ndarray], vocab_map) -> Callable[[str], np.ndarray]:
    """`fetch` that also serves VOCAB_MAP_NAME: an int32 [vocab] array (validated when the map is
    read, against the config it is read for) or IDENTITY (hash raw ids, the explicit opt-out)."""
    if isinstance(vocab_map, str):
        if vocab_map != IDENTITY:
            raise EngramVocabMapError(f"with_vocab_map: {vocab_map!r}; expected an array or "
                                      f"{IDENTITY!r}")
        served = _IDENTITY_MARK
    else:
        served = np.asarray(vocab_map)

    def fetch_with_map(name: str) -> np.ndarray:
        return served if name == VOCAB_MAP_NAME else fetch(name)
    return fetch_with_map


def synthetic_vocab_map(cfg, seed: int) -> np.ndarray:
    """A seeded surjective non-identity map (a permutation of the vocabulary mod the compressed
    size): what synthetic checkpoints carry where the config needs a map."""
    rng = np.random.default_rng([seed, MAP_SEED_SALT])
    perm = rng.permutation(cfg.vocab_size)
    return (perm % cfg.engram_compressed_vocab_size).astype(np.int32)


def build_map(tokenizer_json_path: str | Path) -> tuple[np.ndarray, int]:
    """(map int32 [vocab], compressed size) from a HF `tokenizer.json`, as DeepSeek's
    `CompressedTokenizer` builds it. Needs the `tokenizers` package (not a runtime dependency)."""
    try:
        from tokenizers import Regex, Tokenizer, normalizers
    except ImportError:
        raise ImportError("loader.engram_vocab.build_map needs the `tokenizers` package "
                          "(pip install tokenizers); hopdec itself only reads the built map "
                          f"({VOCAB_MAP_FILE})") from None
    tok = Tokenizer.from_file(str(tokenizer_json_path))
    space = "\ue000"                     # protects a token that is a single space from Strip
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(),
        normalizers.Lowercase(), normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), space), normalizers.Strip(),
        normalizers.Replace(space, " ")])
    vocab = tok.get_vocab_size(with_added_tokens=True)
    keys: dict[str, int] = {}
    out = np.empty(vocab, np.int32)
    for tid in range(vocab):
        text = tok.decode([tid], skip_special_tokens=False)
        # undecodable pieces (partial UTF-8) keep their raw token string as the key
        key = tok.id_to_token(tid) if "\ufffd" in text else (norm.normalize_str(text) or text)
        out[tid] = keys.setdefault(key, len(keys))
    return out, len(keys)


def fit_to_vocab(cfg, vocab_map: np.ndarray, compressed: int) -> np.ndarray:
    """`build_map`'s result for `cfg`: the compressed size must be the config's; a tokenizer
    shorter than vocab_size (padded embedding rows) sends the missing ids to map[pad_id]."""
    if compressed != cfg.engram_compressed_vocab_size:
        raise EngramVocabMapError(f"the tokenizer gives {compressed} compressed ids, the config "
                                  f"says engram_compressed_vocab_size = "
                                  f"{cfg.engram_compressed_vocab_size}")
    if vocab_map.shape[0] > cfg.vocab_size:
        raise EngramVocabMapError(f"the tokenizer has {vocab_map.shape[0]} ids, more than "
                                  f"vocab_size {cfg.vocab_size}")
    tail = np.full(cfg.vocab_size - vocab_map.shape[0], vocab_map[cfg.engram_pad_token_id])
    return check_vocab_map(cfg, np.concatenate([vocab_map, tail]), "build_map")


def main(argv=None) -> int:
    from loader.config import ModelConfig
    parser = argparse.ArgumentParser(prog="python -m loader.engram_vocab",
                                     description=f"write a checkpoint's {VOCAB_MAP_FILE} from "
                                                 "its tokenizer.json (needs `tokenizers`)")
    parser.add_argument("tokenizer_json", type=Path)
    parser.add_argument("checkpoint_dir", type=Path, help="holds config.json; gets the map")
    args = parser.parse_args(argv)
    cfg = ModelConfig.from_json(args.checkpoint_dir / "config.json")
    try:
        vocab_map = fit_to_vocab(cfg, *build_map(args.tokenizer_json))
    except (EngramVocabMapError, ImportError) as exc:
        print(f"{args.tokenizer_json}: {exc}", file=sys.stderr)
        return 1
    np.save(args.checkpoint_dir / VOCAB_MAP_FILE, vocab_map)
    print(f"{args.checkpoint_dir / VOCAB_MAP_FILE}: {cfg.vocab_size} ids -> "
          f"{cfg.engram_compressed_vocab_size} compressed ids")
    return 0


if __name__ == "__main__":
    sys.exit(main())
