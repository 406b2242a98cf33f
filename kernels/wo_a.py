"""Grouped low-rank `wo_a` (FP8 [G, 1024, 4096] per rank) for SM90: the dense W8A16 kernel, grouped.

Every group is an independent W8A16 GEMV/GEMM over its own slice of the attention output; the
dense kernel already indexes weights, scales, x and out by group (`DenseSpec.groups`), so the CTAs
of both groups run in one launch. Shapes: kernels/wo_a_ref.py; kernel: kernels/dense.py.
PTX ABI: (u64 x, u64 weight, u64 scales, u64 residual, u64 out, u64 workspace, u64 counters,
u32 rows), as the dense family.
"""
from __future__ import annotations

from kernels.dense import compile_dense, kernel_class
from kernels.dense_ref import DenseSpec
from kernels.wo_a_ref import wo_a_specs


def kernel_function(spec: DenseSpec):
    """The @cute.kernel whose Python signature the build checks against spec.params."""
    return kernel_class(spec).kernel


def specs(cfg, tp: int) -> list[DenseSpec]:
    return wo_a_specs(cfg, tp)


def compile_spec(spec: DenseSpec, options: str = "--gpu-arch sm_90a"):
    return compile_dense(kernel_class(spec)(spec), spec, options)
