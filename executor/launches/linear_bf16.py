"""Launches of the BF16-weight linear (kernels/linear_bf16_ref.py) from device addresses.

Buffers (spec N, K; rows the launch's R):
  read   x     bf16 [R, K]   row stride K
  read   w     bf16 [N, K]
  write  out   bf16 [R, N]   rows >= R untouched
No scratch.
"""
from __future__ import annotations

from collections.abc import Mapping

from executor.launch import LaunchSpec
from kernels import linear_bf16_ref as lr

BUFFERS = ("x", "w", "out")


def linear_bf16_requests(spec: lr.LinearBf16Spec, max_rows: int) -> list[tuple[str, int, str]]:
    """(name, nbytes, comment) of every buffer one launch of `spec` needs, for up to max_rows."""
    n, k = spec.n, spec.k
    return [("x", max_rows * k * 2, f"bf16 [{max_rows}, {k}]"),
            ("w", n * k * 2, f"bf16 [{n}, {k}]"),
            ("out", max_rows * n * 2, f"bf16 [{max_rows}, {n}]")]


def linear_bf16_launch(bundle, spec: lr.LinearBf16Spec, ptrs: Mapping[str, int],
                       rows: int) -> LaunchSpec:
    """One launch of `spec`'s kernel over ptrs['x'], ptrs['w'] -> ptrs['out']."""
    missing = [name for name in BUFFERS if name not in ptrs]
    if missing:
        raise KeyError(f"{spec.name}: no pointer for buffer(s) {missing} (it needs "
                       f"{', '.join(BUFFERS)})")
    return LaunchSpec(bundle.kernel(spec.name), spec.grid(rows),
                      (ptrs["x"], ptrs["w"], ptrs["out"], rows))
