"""Launches of the W8A16 linears with q_norm folded in (kernels/dense_qnorm_ref.py), R <= 8.

Buffers of a launch (DenseQNormSpec s):
  read   x            bf16 [rows, s.x_stride]  attn.qkv: the q half [:, :K] is normed, the kv
                                               half never read
  read   weight       e4m3 [N, K]; scales ue8m0 u8 [N/32, K/32]
  read   norm_weight  f32 [K]                  q_norm's weight
  write  out          bf16 [rows, N]           rows >= `rows` untouched
No workspace or counters (whole tiles per CTA).
"""
from __future__ import annotations

from collections.abc import Mapping

from executor.launch import LaunchSpec
from executor.launches.dense import _args
from kernels import dense_qnorm_ref as qr
from kernels import dense_ref as dr

USES = ("x", "weight", "scales", "norm_weight", "out")


def qnorm_spec(bundle, label: str) -> qr.DenseQNormSpec:
    """The bundle's folded kernel of `label` ("wq_b", "indexer_wq_b")."""
    head = f"{qr.PREFIX}_{label}_n"
    names = [n for n in bundle.names() if n.startswith(head)]
    if len(names) != 1:
        raise LookupError(f"bundle has {len(names)} kernels {head}* ({names}); expected one "
                          f"(rebuild the bundle: kernels.dense_qnorm)")
    return qr.DenseQNormSpec.from_dict(bundle.manifest.kernels[names[0]].spec)


def qnorm_requests(spec: qr.DenseQNormSpec, max_rows: int) -> list[tuple[str, int, str]]:
    """(name, nbytes, comment) of every buffer one launch needs, for up to max_rows (<= 8)."""
    n, k = spec.n, spec.k
    return [("x", max_rows * spec.x_stride * 2, f"bf16 [{max_rows}, {spec.x_stride}]"),
            ("weight", n * k, f"e4m3 [1, {n}, {k}]"),
            ("scales", (n // dr.FP8_BLOCK) * (k // dr.FP8_BLOCK),
             f"ue8m0 [1, {n // dr.FP8_BLOCK}, {k // dr.FP8_BLOCK}]"),
            ("norm_weight", 4 * k, f"f32 [{k}]"),
            ("out", max_rows * n * 2, f"bf16 [{max_rows}, {n}]")]


def qnorm_launch(bundle, spec: qr.DenseQNormSpec, ptrs: Mapping[str, int], rows: int,
                 eps: float, pdl: bool = True) -> LaunchSpec:
    """One launch: out[:rows] = bf16(q_norm(x[:rows, :K]) @ W^T)."""
    kernel = bundle.kernel(spec.name)
    args = _args(kernel, ptrs, USES, {"rows": rows, "eps": float(eps)})
    return LaunchSpec(kernel, spec.grid(rows), args, pdl=pdl)
