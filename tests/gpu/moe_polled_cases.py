"""Shared by the polled-handoff GPU tests (test_moe_polled_w13 / _w2 / _pair): chains per MoE
shape of a bundle with random weights, inputs, and the plain self-routed chain's h / y to compare
against bitwise.

Run r7a: the pair (kernels/moe_polled.py) faulted (illegal address) at the v41 DSpark-stage shape
e128_k3, R = 1, while every tiny case passed. The three modules run each kernel alone (w13sr
"bulkf" after nothing, w2sr "earlyp" after a completed w13sr with its counts set by the host)
and then the pair, each in its own process, so that a fault names the kernel.
"""
from __future__ import annotations

import numpy as np
import pytest

from executor.launches import moe as ml
from executor.moe_chain import MoeChain, _fill_random_weights
from kernels import moe_kernel_ref as mk

ROWS = (1, 3, 6, 16, 48)


def shapes_of(bundle) -> list[mk.MoeShape]:
    """Every MoE shape the bundle holds (v41: the backbone's and the DSpark stages')."""
    return sorted({ml.shape_of(bundle.manifest.kernels[n].spec) for n in bundle.names()
                   if n.startswith("moe_w13_")}, key=lambda s: s.tag())


@pytest.fixture(scope="module")
def cases(dev, preset_bundle):
    """A PolledCase per MoE shape of the preset's bundle (each test module imports this fixture)."""
    _, bundle = preset_bundle
    out = [PolledCase(dev, bundle, shape) for shape in shapes_of(bundle)]
    yield out
    for case in out:
        case.close()


class PolledCase:
    """A chain at one shape with random weights (device RNG) and x."""

    def __init__(self, dev, bundle, shape: mk.MoeShape):
        from executor.benchmarks import fill_random_bf16
        self.shape = shape
        self.chain = MoeChain(dev, bundle, shape)
        _fill_random_weights(self.chain)
        fill_random_bf16(self.chain.arena, "x")
        if not self.chain.has_polled():
            raise AssertionError(f"the bundle lacks the polled pair of {shape.tag()}")

    def close(self):
        self.chain.close()

    def upload(self, rows: int, seed: int) -> np.ndarray:
        """Random distinct top-k ids per row (and weights); returns the ids."""
        rng = np.random.default_rng(seed)
        s = self.shape
        ids = np.stack([rng.choice(s.num_experts, s.topk, replace=False)
                        for _ in range(rows)]).astype(np.int32)
        x_bits = self.chain.download("x", np.uint16, (rows, s.hidden))
        self.chain.upload_inputs(x_bits, ids, rng.random((rows, s.topk)).astype(np.float32))
        return ids

    def plain(self, rows: int):
        """xquant, w13sr "bulk", w2sr "early", combine."""
        return ml.selfrouted_launches(self.chain.bundle, self.shape, self.chain.ptrs, rows,
                                      "bulk", "early", self.chain.available)

    def polled(self, rows: int):
        return self.chain.launches_polled(rows)

    def run(self, specs, stream):
        self.chain.poison_outputs()
        for spec in specs:
            spec.launch(stream)
        stream.synchronize()

    def h(self, rows: int) -> np.ndarray:
        return self.chain.download("h", np.uint16, (rows * self.shape.topk, self.shape.inter))

    def y(self, rows: int) -> np.ndarray:
        return self.chain.download("y", np.float32, (rows, self.shape.hidden))

    def counts(self) -> tuple[int, np.ndarray, np.ndarray]:
        """(status, produced[E], consumed[E])."""
        f = self.chain.flags()
        e = self.shape.num_experts
        return int(f[0]), f[mk.FLAGS_HEADER:mk.FLAGS_HEADER + e], f[mk.FLAGS_HEADER + e:]

    def set_produced(self, experts, value: int):
        import cupy as cp
        view = self.chain.arena.view("flags", np.uint32)
        for e in experts:
            view[mk.FLAGS_HEADER + int(e)] = value
        cp.cuda.Device().synchronize()
