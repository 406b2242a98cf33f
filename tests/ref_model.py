"""Shared by the reference-step tests: the tiny synthetic checkpoint and models over it, built once."""
import atexit
import functools
import shutil
import tempfile

import numpy as np

from executor.reference.kvcache import KVCaches
from executor.reference.prefill import prefill
from executor.reference.rows import RowBatch, RowBlock
from executor.reference.step import ReferenceModel, compressed_ids, decode_step, ngram_lookback
from executor.reference.weights import rank_weights_from_checkpoint
from kernels import engram_ref
from loader.checkpoint import Checkpoint
from loader.config import ModelConfig
from loader.synth import synth


@functools.lru_cache(maxsize=1)
def tiny_checkpoint() -> Checkpoint:
    out = tempfile.mkdtemp(prefix="hopdec-tiny-")
    atexit.register(shutil.rmtree, out, ignore_errors=True)  # 87 MB: do not leave it behind
    synth(ModelConfig.preset("tiny"), out, seed=0, progress=False)
    return Checkpoint.open(out, progress=False)


@functools.lru_cache(maxsize=8)
def tiny_model(tp: int, exact: bool = False) -> ReferenceModel:
    """The tiny synthetic model at `tp` (its output projections are small: loader.synth)."""
    ckpt = tiny_checkpoint()
    ranks = tuple(rank_weights_from_checkpoint(ckpt, tp, r, humming_experts=not exact)
                  for r in range(tp))
    return ReferenceModel(ckpt.config, ranks, exact=exact)


def new_caches(model: ReferenceModel, max_seqs: int = 2) -> KVCaches:
    return KVCaches.allocate(model.cfg, max_seqs=max_seqs, max_context=128, exact=model.exact)


def prefilled_tiny(rng, tp: int, prompt_length: int = 14):
    """The tiny model at `tp`, fresh caches, and state line 0 prefilled with a random prompt:
    (model, caches, the prompt's tokens + the token the prefill generated)."""
    model = tiny_model(tp)
    caches = new_caches(model)
    prompt = random_prompt(rng, prompt_length)
    return model, caches, list(prompt) + [prefill(model, caches, 0, prompt).next_token]


def block_step(model, caches, line, start, tokens, seq_tokens, kind=None, pad_to=None):
    """One step of one sequence's block of `tokens` at positions start..; returns StepOutput."""
    kind = kind or ("decode" if len(tokens) == 1 else "verify")
    rows = RowBatch.from_blocks([RowBlock(line, start, tuple(int(t) for t in tokens), kind)],
                                caches.block_tables, caches.ring_slots, pad_to=pad_to)
    return decode_step(model, rows, caches, [np.asarray(seq_tokens, np.int64)])


def token_history(cfg, rows: RowBatch, prior) -> np.ndarray:
    """The Engram token history the tests hand the wired step (caller tensor `token_history`):
    each row's lookback over its sequence's `prior` tokens (one int64 array per sequence),
    compressed (the identity map), then the pad id where p - k < 0."""
    raw = ngram_lookback(rows, prior, cfg.engram_max_ngram_size)
    return engram_ref.ngram_history(compressed_ids(cfg, raw), rows.positions,
                                    cfg.engram_max_ngram_size, cfg.engram_pad_token_id)


def random_prompt(rng, length, vocab=1024):
    return [int(t) for t in rng.integers(0, vocab - 1, length)]  # vocab - 1: not the noise token


def caches_equal(a: KVCaches, b: KVCaches) -> bool:
    """Every cache array equal (bytes; NaN poison compares equal to NaN poison)."""
    for name in ("swa", "compressed", "index_keys", "ring", "ring_pos"):
        da, db = getattr(a, name), getattr(b, name)
        if da.keys() != db.keys():
            return False
        for k in da:
            if da[k].tobytes() != db[k].tobytes():
                return False
    return True
