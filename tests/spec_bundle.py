"""A bundle of one kernel record made from its spec, for CPU tests that emulate one kernel family's
launches without building a bundle (no cubin: the emulator reads only the record)."""
from __future__ import annotations

from pathlib import Path

from executor.bundle import KernelRecord


class OneKernelBundle:
    """The one kernel record a manifest would hold for `spec` (built by kernels.`module`)."""

    def __init__(self, spec, module: str):
        self.record = KernelRecord(spec.name, module, Path(f"{spec.name}.cubin"), "", spec.params,
                                   spec.block, spec.smem_bytes, True, spec=spec.to_dict())

    def kernel(self, name):
        assert name == self.record.name
        return self.record
