"""NumPy reference of the vocab-parallel lm_head and the split-vocabulary greedy argmax.

Model doc §2.3 steps 4-5. Each rank holds a BF16 shard `head[V_l, D]` of the vocabulary rows
[rank·V_l, (rank+1)·V_l). It computes fp32 logits for its shard, then the local pair
(max value, argmax + rank·V_l) with ties going to the lower index. The ranks exchange only these
pairs (8 B per row per rank); the global pick is the largest value, ties to the lower global index,
which is exactly `argmax` over the full vocabulary.
"""
from __future__ import annotations

import numpy as np


def head_logits(normed: np.ndarray, head_shard: np.ndarray) -> np.ndarray:
    """[R, D] BF16 values x [V_l, D] BF16 values -> fp32 logits [R, V_l].

    Summed in float64 and rounded once: independent of the batch's row count (see mhc_ref).
    """
    if normed.shape[1] != head_shard.shape[1]:
        raise ValueError(f"head shard is {head_shard.shape}, input rows are {normed.shape}")
    return (normed.astype(np.float64) @ head_shard.astype(np.float64).T).astype(np.float32)


def local_argmax(logits: np.ndarray, vocab_offset: int) -> tuple[np.ndarray, np.ndarray]:
    """[R, V_l] -> (max value [R] float32, global index [R] int64); np.argmax keeps the first max."""
    local = np.argmax(logits, axis=1)
    values = logits[np.arange(logits.shape[0]), local].astype(np.float32)
    return values, local.astype(np.int64) + int(vocab_offset)


def pick_across_ranks(values: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """[tp, R] per-rank pairs -> [R] global argmax: max value, ties to the lower global index."""
    if values.shape != indices.shape or values.ndim != 2:
        raise ValueError(f"per-rank pairs must both be [tp, R], got {values.shape}, {indices.shape}")
    best = values.max(axis=0)
    # Among the ranks holding the maximum, take the smallest global index.
    masked = np.where(values == best[None, :], indices, np.iinfo(np.int64).max)
    return masked.min(axis=0)


def greedy_tokens(normed: np.ndarray, head_shards: list[np.ndarray]) -> np.ndarray:
    """Whole split-vocab argmax over the rank shards in rank order: [R, D] -> token ids [R]."""
    values, indices, offset = [], [], 0
    for shard in head_shards:
        v, i = local_argmax(head_logits(normed, shard), offset)
        values.append(v)
        indices.append(i)
        offset += shard.shape[0]
    return pick_across_ranks(np.stack(values), np.stack(indices))
