"""The whole wired step of the tiny model on the GPU (4 TP ranks on one device) vs the reference.

tests/gpu/device_ranks.py runs every rank's wired stages in lockstep on one stream, with the
cross-rank stages done on the host between segments (their kernels are tested across processes
in tests/gpu/test_collectives.py). Acceptance as tests/test_emulate_step.py: tokens equal the
reference's except at a genuine near-tie (top-2 margin inside LOGIT_BOUND); logits within
LOGIT_BOUND; every rank writes the same tokens and the same KV caches; padding rows write no slot.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from device_ranks import DeviceRanks
from ref_model import prefilled_tiny, tiny_checkpoint, token_history

from executor.reference.rows import RowBatch, RowBlock
from executor.reference.step import decode_step
from executor.runtime import Bundle

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

BUNDLE = Path(os.environ.get("HOPDEC_BUNDLE", "build/bundle-tiny"))
LOGIT_BOUND = 0.25


@pytest.fixture(scope="module")
def bundle(dev):
    b = Bundle.load(dev, BUNDLE)
    yield b
    b.close()


@pytest.mark.parametrize("block", ["decode", "verify"])
def test_wired_step_on_the_gpu_follows_the_reference(dev, stream, bundle, block):
    rng = np.random.default_rng()
    model, caches, seq = prefilled_tiny(rng, 4)
    cfg = model.cfg
    ranks = DeviceRanks(dev, tiny_checkpoint(), bundle, 4, caches, stream)
    try:
        for step in range(3):
            toks = [seq[-1]] if block == "decode" else [seq[-1], *rng.integers(0, 1000, 5)]
            toks = [int(t) for t in toks]
            rows = RowBatch.from_blocks([RowBlock(0, len(seq) - 1, tuple(toks), block)],
                                        caches.block_tables, caches.ring_slots, pad_to=8)
            history = token_history(cfg, rows, [np.asarray(seq + toks[1:], np.int64)])
            ranks.load(rows, caches if step == 0 else None, history)
            ranks.run(rows.num_rows)
            out = decode_step(model, rows, caches, [np.asarray(seq + toks[1:], np.int64)])
            n, real = len(toks), rows.seq_index >= 0
            vocab_l = cfg.vocab_size // 4
            logits = np.concatenate([ranks.read(r, "logits", np.float32, (192, vocab_l))[:n]
                                     for r in range(4)], axis=1)
            diff = np.abs(logits.astype(np.float64) - out.logits[:n]).max()
            assert diff <= LOGIT_BOUND, f"step {step}: logits differ by {diff}"
            tokens = [ranks.read(r, "tokens", np.int64, (192,))[:rows.num_rows] for r in range(4)]
            assert all(np.array_equal(t, tokens[0]) for t in tokens)
            for i in np.flatnonzero(real & (tokens[0] != out.tokens)):
                top2 = np.sort(out.logits[i].astype(np.float64))[-2:]
                assert top2[1] - top2[0] <= 2 * diff, (step, i, tokens[0][i], out.tokens[i])
            for layer in caches.swa:                          # replicated caches agree
                swa = [ranks.tensors[r][f"swa_{layer}"].get() for r in range(4)]
                assert all(np.array_equal(s, swa[0]) for s in swa), layer
            seq += toks[1:] + [int(out.tokens[n - 1])]
    finally:
        ranks.close()
