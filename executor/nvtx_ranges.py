"""NVTX ranges for profilers (domain "hopdec"), a no-op when the `nvtx` package is missing.

Ranges are host-side: around eager launches they mark each kernel family and layer; around a graph
replay they mark the launch only (profile graphs with `nsys --cuda-graph-trace=node`). Attributes
are built once per name, so push/pop is the package's cheapest path (~0.1 us per pair measured).
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager

DOMAIN = "hopdec"
_warned = False


def _import_nvtx():
    global _warned
    try:
        import nvtx
        return nvtx
    except ImportError:
        if not _warned:
            warnings.warn("the 'nvtx' package is not installed: hopdec NVTX ranges are disabled",
                          RuntimeWarning, stacklevel=3)
            _warned = True
        return None


class Ranges:
    """Push/pop named ranges in one NVTX domain; `enabled` is False without the nvtx package."""

    def __init__(self, domain: str = DOMAIN):
        nvtx = _import_nvtx()
        self.enabled = nvtx is not None
        self._domain = nvtx.get_domain(domain) if nvtx else None
        self._attrs: dict[str, object] = {}

    def push(self, name: str) -> None:
        if self._domain is None:
            return
        attr = self._attrs.get(name)
        if attr is None:
            attr = self._attrs[name] = self._domain.get_event_attributes(message=name)
        self._domain.push_range(attr)

    def pop(self) -> None:
        if self._domain is not None:
            self._domain.pop_range()

    @contextmanager
    def range(self, name: str):
        self.push(name)
        try:
            yield
        finally:
            self.pop()
