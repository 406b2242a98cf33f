"""NumPy reference of the V4.1 lightning indexer: FP4 index query, scores, top-k, candidate blocks.

What the indexer kernels compute for the R rows of one sequence (model doc §2.2 A10-A12):

    q_I     [R, nh, 128]  index query after RoPE, FP4 quantize-dequantized (E2M1, UE8M0 per 32)
    w       [R, nh]       head weights (weights_proj(x) * 128^-1/2 * nh^-1/2)
    K       [N, 128]      the sequence's index keys (entries 0..N-1, FP8 + fp32 scale in the cache)
    score[r, s] = sum_h w[r, h] * ReLU(q_I[r, h] . K[s])                 (float32)

Row r sees entries s < visible[r] = (p_r + 1) // ratio. The rows of one verify block share one scan:
one [R*nh, 128] x [128, N] product, then each row keeps its own visible prefix.

Top-k: the k best visible entries; ties go to the lower entry; returned sorted ascending with -1
padding at the end when fewer than k are visible. Candidates (the ratio-1 candidate source): block
score = max over the block's visible entries, the row's own block forced in, the best
`num_blocks` blocks (ties to the lower block), sorted ascending, -1 padded. Reindex layers score
only entries inside their row's candidate blocks.
"""
from __future__ import annotations

import numpy as np

from loader import formats

FP4_GROUP = 32
FP4_MAX = 6.0


def fp4_quantize_dequantize(x: np.ndarray, group: int = FP4_GROUP) -> np.ndarray:
    """MXFP4 round trip along the last axis: E2M1 values times a UE8M0 scale per `group` values.

    Scale 2^ceil(log2(amax / 6)) (amax floored at 1e-4, as DeepSeek's act_quant does) keeps every
    |x / scale| <= 6; the E2M1 cast rounds to nearest even.
    """
    # uncertain: the FP4 act-quant rounding (nearest even here) and the 1e-4 amax floor follow
    # DeepSeek's reference act_quant as the model doc §0 describes it; its kernel was not read.
    if x.shape[-1] % group:
        raise ValueError(f"fp4 quantize: last dim {x.shape[-1]} is not a multiple of {group}")
    g = x.astype(np.float32).reshape(*x.shape[:-1], -1, group)
    amax = np.maximum(np.abs(g).max(axis=-1, keepdims=True), np.float32(1e-4))
    exp = formats.ue8m0_scale_for_amax(amax, FP4_MAX).astype(np.int32) - 127
    codes = formats.e2m1_decode(formats.e2m1_encode(np.ldexp(g, -exp)))
    return np.ldexp(codes, exp).astype(np.float32).reshape(x.shape)


def index_scores(q: np.ndarray, weights: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """score[r, s] = sum_h weights[r, h] * ReLU(q[r, h] . keys[s]); q [R, nh, d], keys [N, d]."""
    r, nh, d = q.shape
    if weights.shape != (r, nh) or keys.ndim != 2 or keys.shape[1] != d:
        raise ValueError(
            f"index_scores: q {q.shape}, weights {weights.shape}, keys {keys.shape} do not agree "
            f"(expected weights [{r}, {nh}] and keys [N, {d}])"
        )
    # float64 sums rounded once: a row's scores do not depend on the scan's other rows or length.
    dots = (q.reshape(r * nh, d).astype(np.float64) @ keys.astype(np.float64).T).reshape(r, nh, -1)
    np.maximum(dots, 0.0, out=dots)
    return np.einsum("rhn,rh->rn", dots, weights.astype(np.float64)).astype(np.float32)


def visible_mask(num_visible: np.ndarray, num_entries: int) -> np.ndarray:
    """[R, N] bool: entry s is visible to row r when s < num_visible[r]."""
    return np.arange(num_entries)[None, :] < np.asarray(num_visible)[:, None]


def _best_sorted(scores: np.ndarray, allowed: np.ndarray, k: int) -> np.ndarray:
    """The k best allowed columns per row (ties to the lower column), ascending, -1 padded."""
    r, n = scores.shape
    masked = np.where(allowed, scores, -np.inf)
    # A stable sort of the negated scores keeps equal scores in column order: lower column first.
    order = np.argsort(-masked, axis=1, kind="stable")[:, :k]
    keep = np.take_along_axis(allowed, order, axis=1)
    picked = np.sort(np.where(keep, order, n), axis=1)  # n sorts after every real column
    picked = np.where(picked == n, -1, picked).astype(np.int32)
    if picked.shape[1] < k:
        picked = np.concatenate([picked, np.full((r, k - picked.shape[1]), -1, np.int32)], axis=1)
    return picked


def topk_entries(scores: np.ndarray, allowed: np.ndarray, k: int) -> np.ndarray:
    """[R, k] int32: the top-k allowed entries per row, ascending; -1 padding at the end.

    # uncertain: ties go to the lower entry and the output is sorted ascending with -1 last; the
    # model doc (§2.2 A11) says "positions sorted; -1 padding" without a tie rule.
    """
    if scores.shape != allowed.shape:
        raise ValueError(f"topk: scores {scores.shape} and mask {allowed.shape} differ")
    return _best_sorted(scores, allowed, k)


def candidate_blocks(scores: np.ndarray, allowed: np.ndarray, own_entry: np.ndarray,
                     block_size: int, num_blocks: int) -> np.ndarray:
    """[R, num_blocks] int32: the candidate blocks of each row, ascending, -1 padded.

    Block score = max of the row's allowed entry scores inside the block; blocks with no allowed
    entry are never candidates; the block holding `own_entry[r]` (the row's own position) is
    forced in.
    """
    r, n = scores.shape
    nb = -(-n // block_size)
    pad = nb * block_size - n
    masked = np.pad(np.where(allowed, scores, -np.inf), ((0, 0), (0, pad)), constant_values=-np.inf)
    block_score = masked.reshape(r, nb, block_size).max(axis=2)
    block_ok = np.pad(allowed, ((0, 0), (0, pad))).reshape(r, nb, block_size).any(axis=2)
    # uncertain: "the current block is forced in" read as the block of the row's own entry (its own
    # position for ratio 1), ranked above every scored block.
    own = np.asarray(own_entry) // block_size
    if np.any((own < 0) | (own >= nb)):
        raise ValueError(f"candidate blocks: own entries {own_entry} fall outside {n} entries")
    block_score[np.arange(r), own] = np.inf
    block_ok[np.arange(r), own] = True
    return _best_sorted(block_score, block_ok, num_blocks)


def candidate_entry_mask(blocks: np.ndarray, num_entries: int, block_size: int) -> np.ndarray:
    """[R, N] bool: entry s lies in one of the row's candidate blocks (-1 blocks select nothing)."""
    entry_block = np.arange(num_entries) // block_size
    return (entry_block[None, None, :] == blocks[:, :, None]).any(axis=1)
