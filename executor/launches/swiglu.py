"""Launch of the shared expert's clamped SwiGLU (kernels/swiglu.py) from device addresses.

    h13  bf16 [R, 2I]  read   (gate | up: the fused w1|w3 linear's output)
    out  bf16 [R, I]   write  (rows >= R untouched; must not overlap h13)

No scratch. `swiglu_requests` gives the arena slices under the same names.
"""
from __future__ import annotations

from collections.abc import Mapping

from executor.launch import LaunchSpec
from executor.launches.small import check_ptrs, kernel_for
from kernels import swiglu_ref as sr


def swiglu_requests(spec: sr.SwigluSpec, max_rows: int) -> list[tuple[str, int, str]]:
    i = spec.inter
    return [("h13", max_rows * 2 * i * 2, f"bf16 [{max_rows}, {2 * i}] gate | up"),
            ("out", max_rows * i * 2, f"bf16 [{max_rows}, {i}]")]


def swiglu_launch(bundle, spec: sr.SwigluSpec, ptrs: Mapping[str, int],
                  rows: int) -> LaunchSpec:
    """out[:rows] = SwiGLU of h13[:rows] (one PDL launch)."""
    check_ptrs(spec.name, ptrs, {"h13": 16, "out": 16})
    return LaunchSpec(kernel_for(bundle, spec), spec.grid(rows),
                      (ptrs["h13"], ptrs["out"], rows), pdl=True)
