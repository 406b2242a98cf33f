"""Grouped low-rank `wo_a` in FP8 (model doc §2.2 A15): specs and reference, a grouped dense W8A16.

    y[r, g, :] = o[r, g, :] @ W[g]^T,   W = e4m3(wo_a[g]) * 2^(s[g] - 127),   g < o_groups / tp

o is BF16 [rows, G * K] (group g = heads heads_per_group*g .. +heads_per_group-1, K = o_group_in_dim
= 4096), wo_a FP8 E4M3 [G, N = o_lora_rank, K] with UE8M0 [G, N/32, K/32] (the only copy: FP8,
not the stock SM90 BF16 dequantized copy), y BF16 [rows, G * N] = the input of `wo_b`.
The kernel is the dense W8A16 kernel with `groups = G` (kernels/dense.py); this module only names
the shapes. ABI, constraints, numerics and byte formula: kernels/dense_ref.py.
"""
from __future__ import annotations

from kernels.dense_ref import ROW_TILE_CHOICES, DenseSpec, candidate_specs, dense_ref, make_spec

__all__ = ["wo_a_ref", "wo_a_shape", "wo_a_specs"]


def wo_a_shape(cfg, tp: int) -> tuple[int, int, int]:
    """(groups per rank, N = o_lora_rank, K = o_group_in_dim): [2, 1024, 4096] for V4.1 TP4."""
    return cfg.rank_shapes(tp).o_groups, cfg.o_lora_rank, cfg.o_group_in_dim


def wo_a_specs(cfg, tp: int) -> list[DenseSpec]:
    groups, n, k = wo_a_shape(cfg, tp)
    return ([make_spec("grouped", n, k, groups=groups, row_tiles=rt, prefix="wo_a_fp8")
             for rt in ROW_TILE_CHOICES]
            + candidate_specs("grouped", n, k, groups=groups, prefix="wo_a_fp8"))


def wo_a_ref(spec: DenseSpec, o, weight, scales):
    """bf16 [rows, G * N]: what the kernel writes, up to fp32 summation order."""
    return dense_ref(spec, o, weight, scales)
