"""Launch of the split RMSNorm (kernels/split_norm.py) from device addresses.

    x       bf16 [R, W + T]  read   (the fused wq_a|wkv output: q latent | kv latent)
    weight  f32 [W]          read   (q_norm, widened to fp32)
    out     bf16 [R, W]      write  (RMSNorm of the head; rows >= R untouched)
    tail    bf16 [R, T]      write  (the tail, copied)

No scratch; out and tail must not overlap x. `split_norm_requests` gives the slices by these names.
"""
from __future__ import annotations

from collections.abc import Mapping

from executor.launch import LaunchSpec
from executor.launches.small import check_ptrs, kernel_for
from kernels import split_norm_ref as sr


def split_norm_requests(spec: sr.SplitNormSpec, max_rows: int) -> list[tuple[str, int, str]]:
    w, t = spec.width, spec.tail
    return [("x", max_rows * (w + t) * 2, f"bf16 [{max_rows}, {w + t}]"),
            ("weight", w * 4, f"f32 [{w}]"),
            ("out", max_rows * w * 2, f"bf16 [{max_rows}, {w}]"),
            ("tail", max_rows * t * 2, f"bf16 [{max_rows}, {t}]")]


def split_norm_launch(bundle, spec: sr.SplitNormSpec, ptrs: Mapping[str, int], rows: int,
                      eps: float) -> LaunchSpec:
    """out[:rows] = RMSNorm(x[:rows, :W]) * weight, tail[:rows] = x[:rows, W:] (one PDL launch)."""
    check_ptrs(spec.name, ptrs, {"x": 16, "weight": 16, "out": 16, "tail": 16})
    return LaunchSpec(kernel_for(bundle, spec), spec.grid(rows),
                      (ptrs["x"], ptrs["weight"], ptrs["out"], ptrs["tail"], rows, float(eps)),
                      pdl=True)
