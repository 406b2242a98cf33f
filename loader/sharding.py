"""Tensor-parallel shards of checkpoint tensors, cut exactly where vLLM cuts them (tp 1, 2, 4).

`shard(source, spec, tp, rank)` returns rank `rank`'s part of one tensor as a view (no copy) of
the checkpoint mapping or of the array given; `rank_tensors(ckpt, tp, rank)` yields every
(name, array) of one rank lazily. The cut of each tensor is its schema row's `Split`:

| split | cut | example |
|---|---|---|
| REPLICATED | none | wq_a, wkv, norms, mHC, router, compressors, indexers, Engram wkv, main_proj |
| COLUMN, HEADS, GROUPED, VOCAB, EXPERT_OUT | dim 0, tp equal parts | wq_b (+ scale rows), attn_sink, wo_a, embed/head, experts w1/w3 |
| ROW, EXPERT_IN | dim 1, tp equal parts | wo_b (+ scale columns), shared w2, experts w2 (I/2 bytes, I/32 scales) |
| ENGRAM_COLS | dim 0, whole hash columns | Engram table: rank r owns columns [r*C/tp, (r+1)*C/tp) |

A cut must land on a multiple of the row's `granule` (a 32-row FP8 block, a 16-byte MXFP4 group,
a whole `wo_a` group), so a weight and its scale are always cut at the same model coordinate.
vLLM repeats the 32x32 block scales 32x along N (`formats.fp8_block_scales_per_row`) before its
loader slices them; cutting the block form on whole blocks is the same cut. The shared expert
needs no zero padding here: I/32 blocks divide by tp for both presets (72 and 12 blocks).
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from itertools import accumulate

import numpy as np

from loader.checkpoint import Checkpoint
from loader.safetensors import DTYPES
from loader.schema import Split, TensorSpec

SUPPORTED_TP = (1, 2, 4)


def rank_range(spec: TensorSpec, tp: int, rank: int) -> tuple[int, int] | None:
    """[start, stop) along `spec.split.dim` held by `rank`; None when replicated."""
    if tp not in SUPPORTED_TP:
        raise ValueError(f"tp={tp} is not supported; expected one of {SUPPORTED_TP}")
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside 0..{tp - 1} for tp={tp}")
    if spec.split is Split.REPLICATED:
        return None
    if spec.split is Split.ENGRAM_COLS:
        groups = spec.row_groups or ()
        if len(groups) % tp:
            raise ValueError(f"{spec.name}: {len(groups)} hash columns do not split over tp={tp}")
        per = len(groups) // tp
        bounds = [0, *accumulate(groups)]
        return bounds[rank * per], bounds[(rank + 1) * per]
    size = spec.shape[spec.split.dim]
    part = size // tp
    if size % tp or part % spec.granule:
        raise ValueError(f"{spec.name}: dim {spec.split.dim} of {list(spec.shape)} ({spec.split.value}"
                         f" split) does not cut into {tp} parts of whole {spec.granule}-entry units")
    return rank * part, (rank + 1) * part


def rank_shape(spec: TensorSpec, tp: int, rank: int) -> tuple[int, ...]:
    cut = rank_range(spec, tp, rank)
    if cut is None:
        return spec.shape
    shape = list(spec.shape)
    shape[spec.split.dim] = cut[1] - cut[0]
    return tuple(shape)


def rank_nbytes(spec: TensorSpec, tp: int, rank: int) -> int:
    """Bytes of `spec` held by `rank` (replicated tensors count fully on every rank)."""
    return math.prod(rank_shape(spec, tp, rank)) * DTYPES[spec.dtype].itemsize


def shard(source: Checkpoint | np.ndarray, spec: TensorSpec, tp: int, rank: int) -> np.ndarray:
    """Rank `rank`'s part of `spec`'s tensor, a view of `source` (a checkpoint or the full array)."""
    array = source.get(spec.name) if isinstance(source, Checkpoint) else source
    if array.shape != spec.shape:
        raise ValueError(f"{spec.name}: array shape {list(array.shape)} is not the schema's "
                         f"{list(spec.shape)}")
    cut = rank_range(spec, tp, rank)
    if cut is None:
        return array
    index = [slice(None)] * array.ndim
    index[spec.split.dim] = slice(*cut)
    return array[tuple(index)]


def rank_tensors(ckpt: Checkpoint, tp: int, rank: int) -> Iterator[tuple[str, np.ndarray]]:
    """Every schema tensor of one rank, in checkpoint order, lazily (views; nothing is read yet)."""
    for name, spec in ckpt.specs.items():
        yield name, shard(ckpt, spec, tp, rank)
