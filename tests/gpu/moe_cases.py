"""Shared by the GPU tests that run a self-routed MoE chain at every MoE shape of the preset's
bundle (test_moe_selfrouted_shapes, test_moe_queue): the shapes, and one MoeChain per shape with
random weights (device RNG) in every expert and random x. No DSL import (cubins from the bundle)."""
from __future__ import annotations

from executor.launches import moe as ml
from kernels import moe_kernel_ref as mk


def moe_shapes(bundle) -> list[mk.MoeShape]:
    """Every MoE shape the bundle holds, by tag (v41: e128_k3 then e384_k6)."""
    return sorted({ml.shape_of(bundle.manifest.kernels[n].spec) for n in bundle.names()
                   if n.startswith("moe_w13_")}, key=lambda s: s.tag())


def random_chains(dev, bundle):
    """Generator for a module fixture: yields the chains, closes them after the module."""
    from executor.benchmarks import fill_random_bf16
    from executor.moe_chain import MoeChain, _fill_random_weights
    out = []
    try:
        for shape in moe_shapes(bundle):
            chain = MoeChain(dev, bundle, shape)
            out.append(chain)
            _fill_random_weights(chain)
            fill_random_bf16(chain.arena, "x")
        yield out
    finally:
        for chain in out:
            chain.close()
