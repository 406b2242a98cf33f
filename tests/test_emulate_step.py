"""The whole wired step on four emulated ranks against the NumPy reference step (tiny model).

Every launch of the step is built exactly as the GPU executor builds it (executor.wiring +
executor/stages/*), then run by the CPU emulator (each kernel's NumPy reference over host memory at
fake device addresses). The kernel references round where the kernels round, the model reference
where the model doc says; they sum in different orders, so, as for the upstream PR's stock-vs-
executor rule (tests/test_ref_step.py), a token may differ only at a genuine near-tie: where the
reference's top-2 margin is inside the logit difference of the two runs. The caches the emulated
step writes carry over from step to step (only the first step copies the reference's caches in).
"""
import numpy as np
import pytest
from ref_model import prefilled_tiny, tiny_checkpoint, token_history

from executor.emulate.ranks import EmulatedRanks
from executor.reference.rows import RowBatch, RowBlock
from executor.reference.step import decode_step
from executor.wiring import STAGE_MODULES

LOGIT_BOUND = 0.25          # tests/test_ref_step.py: TP1 vs TP4 worst 0.076 over 96 steps


def _check(ranks, rows, ref_out, step) -> float:
    """Logits within LOGIT_BOUND, tokens equal but at near-ties, the same on every rank, and
    every rank's caches identical; returns the largest logit difference."""
    n, vocab_l, real = rows.num_rows, ranks.cfg.vocab_size // ranks.tp, rows.seq_index >= 0
    logits = np.concatenate([ranks.read(r, "logits", np.float32, (192, vocab_l))[:n]
                             for r in range(ranks.tp)], axis=1)
    diff = float(np.abs(logits[real].astype(np.float64) - ref_out.logits[real]).max())
    assert diff <= LOGIT_BOUND, f"step {step}: logits differ by {diff}"
    tokens = [ranks.read(r, "tokens", np.int64, (192,))[:n] for r in range(ranks.tp)]
    assert all(np.array_equal(t, tokens[0]) for t in tokens), f"step {step}: ranks disagree"
    for i in np.flatnonzero(real & (tokens[0] != ref_out.tokens)):
        top2 = np.sort(ref_out.logits[i].astype(np.float64))[-2:]
        assert top2[1] - top2[0] <= 2 * diff, (
            f"step {step} row {i}: emulated token {tokens[0][i]}, reference "
            f"{ref_out.tokens[i]} at a top-2 margin of {top2[1] - top2[0]}")
    for name, arr in ranks.tensors[0].items():
        if name.startswith(("swa_", "compressed_", "index_keys_", "compressor_ring_")):
            for r in range(1, ranks.tp):
                assert ranks.tensors[r][name].tobytes() == arr.tobytes(), (step, name, r)
    return diff


@pytest.mark.parametrize("block", ["decode", "verify"])
def test_emulated_step_follows_the_reference(tiny_bundle_dir, block):
    rng = np.random.default_rng()
    model, caches, seq = prefilled_tiny(rng, 4)
    cfg = model.cfg
    ranks = EmulatedRanks(tiny_checkpoint(), tiny_bundle_dir, 4, caches, modules=STAGE_MODULES)
    first = True
    for step in range(3):
        toks = [seq[-1]] if block == "decode" else [seq[-1], *rng.integers(0, 1000, 5).tolist()]
        start = len(seq) - 1
        rows = RowBatch.from_blocks([RowBlock(0, start, tuple(toks), block)],
                                    caches.block_tables, caches.ring_slots, pad_to=8)
        prior = [np.asarray(seq + toks[1:], np.int64)]
        history = token_history(cfg, rows, prior) if cfg.engram_layer_ids else None
        ranks.load(rows, caches if first else None, history)
        first = False
        ranks.run(rows.num_rows)
        out = decode_step(model, rows, caches, [np.asarray(seq + toks[1:], np.int64)])
        _check(ranks, rows, out, step)
        seq += toks[1:] + [int(out.tokens[len(toks) - 1])]    # the block accepted whole
