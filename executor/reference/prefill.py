"""Reference prefill: build one sequence's KV caches from a prompt with causal blocks of decode rows.

Simple and slow on purpose: the prompt runs through `decode_step` in consecutive causal blocks of
at most `chunk` rows (6 = a DSpark verify block, the most rows the caches' SWA and compressor rings
take in one step). Every layer runs for every prompt token (no SWA bounded replay). Because the
reference sums are batch-invariant, any chunking gives bit-identical caches and logits, so this
equals decoding the prompt token by token.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from executor.reference.rows import RowBatch, RowBlock
from executor.reference.step import ReferenceModel, decode_step


@dataclass(frozen=True)
class PrefillResult:
    """What the prompt leaves behind besides the caches."""

    next_token: int       # greedy token after the prompt (at position len(prompt))
    logits: np.ndarray    # [T, V] float32, row t = logits after token t
    aux: np.ndarray       # [T, n_targets, D] DSpark aux states of every prompt position
    tokens: np.ndarray    # [T] greedy token after each prompt position


def prefill(model: ReferenceModel, caches, state_line: int, prompt, chunk: int = 6) -> PrefillResult:
    """Run `prompt` (token ids at positions 0..T-1) into `caches` for the empty `state_line`."""
    prompt = np.asarray(prompt, np.int64)
    if prompt.ndim != 1 or prompt.size == 0:
        raise ValueError(f"prefill: prompt must be a non-empty 1-D list of token ids, got {prompt.shape}")
    if not 1 <= chunk <= caches.ring_rows - 2:
        raise ValueError(f"prefill: chunk {chunk} must be in 1..{caches.ring_rows - 2} for these caches")
    logits, aux, tokens = [], [], []
    for first in range(0, prompt.size, chunk):
        block = tuple(int(t) for t in prompt[first:first + chunk])
        kind = "decode" if len(block) == 1 else "verify"
        rows = RowBatch.from_blocks([RowBlock(state_line, first, block, kind)],
                                    caches.block_tables, caches.ring_slots)
        out = decode_step(model, rows, caches, [prompt])
        logits.append(out.logits)
        aux.append(out.aux)
        tokens.append(out.tokens)
    tokens_arr = np.concatenate(tokens)
    return PrefillResult(next_token=int(tokens_arr[-1]), logits=np.concatenate(logits),
                         aux=np.concatenate(aux), tokens=tokens_arr)
