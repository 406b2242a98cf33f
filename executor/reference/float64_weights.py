"""float64 copies of the reference's float32 weights, kept in a byte-bounded cache (speed only).

Every reference product sums in float64 and rounds once to float32 (`moe_ref.matmul_t`,
`head_ref.head_logits`, `moe_ref.w4a8_matmul`'s 128-column groups): each call converts its
weight to float64 first, and at real widths that conversion costs more than the product (a
DSpark round of the real-dimension slice: the head alone is 4 x 165 M values a forward).
`Float64Weights` makes each copy once and hands it back while the weight object lives, so the
same BLAS call runs on the same operands: the same bytes, in less time
(tests/test_ref_float64_weights.py compares whole reference rounds with and without it).

The cache is bounded by `max_bytes` (least recently used copies go first); 0 keeps nothing,
which is exactly the reference's per-call conversion. Entries are keyed by the weight object's
identity and checked through a weak reference, so a copy never outlives its weight's meaning.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import numpy as np


class Float64Weights:
    """float64 copies of float32 weights (whole, or as contiguous column groups), made once."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"Float64Weights: max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self.held_bytes = 0
        self._entries: OrderedDict[tuple, tuple[weakref.ref, object, int]] = OrderedDict()
        self._lock = threading.Lock()       # the ranks' threads share one cache

    def whole(self, weight: np.ndarray) -> np.ndarray:
        """weight.astype(float64): a C-contiguous copy, as the reference's products make."""
        return self._get(weight, "whole", lambda: weight.astype(np.float64))

    def groups(self, weight: np.ndarray, width: int) -> tuple[np.ndarray, ...]:
        """weight[:, j·width:(j + 1)·width].astype(float64) for every j (the last may be short):
        the operands of w4a8_matmul's per-group products."""
        return self._get(weight, ("groups", width), lambda: tuple(
            weight[:, start:start + width].astype(np.float64)
            for start in range(0, weight.shape[1], width)))

    def matmul_t(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """moe_ref.matmul_t(x, weight) (= head_ref.head_logits): x @ weightᵀ summed in float64,
        rounded once to float32, over the cached copy."""
        if x.shape[-1] != weight.shape[1]:
            raise ValueError(f"matmul_t: input rows are {x.shape}, the weight is {weight.shape}")
        return (x.astype(np.float64) @ self.whole(weight).T).astype(np.float32)

    def _get(self, weight: np.ndarray, kind, make):
        key = (id(weight), kind)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0]() is weight:
                self._entries.move_to_end(key)
                return entry[1]
        value = make()
        size = sum(v.nbytes for v in value) if isinstance(value, tuple) else value.nbytes
        if size > self.max_bytes:
            return value
        with self._lock:
            self._drop(key)
            self._drop_dead()
            while self.held_bytes + size > self.max_bytes:
                self._drop(next(iter(self._entries)))
            self._entries[key] = (weakref.ref(weight), value, size)
            self.held_bytes += size
        return value

    def _drop(self, key) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.held_bytes -= entry[2]

    def _drop_dead(self) -> None:
        for key in [k for k, entry in self._entries.items() if entry[0]() is None]:
            self._drop(key)
