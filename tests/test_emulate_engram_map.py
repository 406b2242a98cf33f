"""The wired step on four emulated ranks with a NON-identity Engram vocab map (tiny model).

tiny's compressed vocabulary is its whole vocabulary, so its synthetic checkpoint carries no map
(the identity). Here a random permutation of the 1024 ids (a valid map: values < 1024) rides on
the checkpoint (`Checkpoint.vocab_map`, served as `engram.vocab_map` to the packing) and on the
reference (`ReferenceModel(engram_vocab_map=...)`); the caller binds the RAW token history, as
the executor expects. Checks, per step: every rank's hash ids of every Engram layer equal the
reference history's hash (bitwise, integer arithmetic) and differ from the identity's (the map is
really read); logits and tokens as tests/test_emulate_step.py (LOGIT_BOUND, near-tie rule).
"""
import dataclasses

import numpy as np
from ref_model import new_caches, random_prompt, tiny_checkpoint, tiny_model
from test_emulate_step import _check

from executor.emulate.ranks import EmulatedRanks
from executor.reference import step as ref_step
from executor.reference.prefill import prefill
from executor.reference.rows import RowBatch, RowBlock
from executor.wiring import STAGE_MODULES
from kernels import engram_ref
from loader.checkpoint import Checkpoint


def _ids(cfg, history, layer) -> np.ndarray:
    orders, heads = cfg.engram_max_ngram_size - 1, cfg.engram_n_heads
    primes = np.array(cfg.engram_primes_flat(layer), np.int64).reshape(orders, heads)
    return engram_ref.hash_ids(history, np.array(cfg.engram_hash_multipliers(layer)), primes)


def test_emulated_step_hashes_through_the_checkpoints_map(tiny_bundle_dir):
    rng = np.random.default_rng()
    base = tiny_checkpoint()
    cfg = base.config
    vocab_map = rng.permutation(cfg.vocab_size).astype(np.int32)
    # the same open shards, plus the map (never closed here: the shared checkpoint owns them)
    ckpt = Checkpoint(base.path, cfg, base.specs, base.files, base.locations, vocab_map)
    model = dataclasses.replace(tiny_model(4), engram_vocab_map=vocab_map)
    identity = dataclasses.replace(model, engram_vocab_map=np.arange(cfg.vocab_size))
    caches = new_caches(model)
    prompt = random_prompt(rng, 9)
    seq = list(prompt) + [prefill(model, caches, 0, prompt).next_token]
    ranks = EmulatedRanks(ckpt, tiny_bundle_dir, 4, caches, modules=STAGE_MODULES)
    for step in range(2):
        toks = [seq[-1], *rng.integers(0, cfg.vocab_size, 5).tolist()]
        start = len(seq) - 1
        rows = RowBatch.from_blocks([RowBlock(0, start, tuple(toks), "verify")],
                                    caches.block_tables, caches.ring_slots, pad_to=8)
        prior = [np.asarray(seq + toks[1:], np.int64)]
        raw = ref_step.ngram_lookback(rows, prior, cfg.engram_max_ngram_size)
        ranks.load(rows, caches if step == 0 else None,
                   engram_ref.ngram_history(raw, rows.positions, cfg.engram_max_ngram_size,
                                            cfg.engram_pad_token_id))
        ranks.run(rows.num_rows)
        n = rows.num_rows
        history = ref_step.engram_history(model, rows, prior)
        plain = ref_step.engram_history(identity, rows, prior)
        for layer in cfg.engram_layer_ids:
            want = _ids(cfg, history, layer)
            assert not np.array_equal(want, _ids(cfg, plain, layer))
            for r in range(4):
                got = ranks.read(r, f"engram.ids.l{layer}", np.int64, (n, want.shape[1]))
                assert np.array_equal(got, want), (step, layer, r)
        out = ref_step.decode_step(model, rows, caches, prior)
        _check(ranks, rows, out, step)
        seq += toks[1:] + [int(out.tokens[len(toks) - 1])]
