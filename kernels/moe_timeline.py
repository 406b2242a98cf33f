"""Timeline builds of the step's routed-MoE w13 / w2 kernels: per-CTA %smid, %globaltimer, %clock64.

Each class here is a production kernel (kernels/moe_bulk.py, kernels/moe_selfroute.py) with one
more pointer parameter, `stamps` (before rows), passed to the production body (`run`), which then
has thread 0 of each CTA write its record: the SM id and, per mk.TIMELINE_EVENTS, (globaltimer ns,
clock64). The production kernels call the same body with stamps None, so nothing of this reaches
their cubins (checked: byte-identical). Built as "<name>_tl" (mk.timeline_specs) and launched only
by the devicecheck timeline case (executor/moe_chain.py); the records are read by
executor/moe_timeline.py.

ABI: the production kernel's, with (u64 stamps) inserted before (u32 rows); stamps holds
grid x mk.TIMELINE_RECORD_BYTES bytes.
"""
from __future__ import annotations

from cuda.bindings import driver as cuda
from cutlass import Int32, cute

from kernels import moe_kernel_ref as mk
from kernels.moe_bulk import MoeW2BulkSm90, MoeW13BulkSm90, MoeW13SelfRoutedBulkSm90
from kernels.moe_ptx import _addr
from kernels.moe_selfroute import MoeW2EarlyRefillSm90


def launch_w13(obj, kernel, stream: cuda.CUstream):
    """A w13 kernel's launch (grid and block as compiled; the host sets the real grid). As
    MoeW13WarpRoutedSm90.__call__: ctas_per_sm is the launch bound."""
    kernel.launch(grid=[2, 1, 1], block=list(obj.spec.block), smem=obj.spec.smem_bytes,
                  stream=stream, use_pdl=True, min_blocks_per_mp=obj.spec.launch_bound,
                  preferred_smem_carveout=100)


def launch_w2(obj, kernel, stream: cuda.CUstream):
    """A w2 kernel's launch (no launch bound)."""
    kernel.launch(grid=[2, 1, 1], block=list(obj.spec.block), smem=obj.spec.smem_bytes,
                  stream=stream, use_pdl=True)


def w13_ptrs(xq, xs, codes, offsets, scales, h):
    """The w13 body's pointer tuple (addresses, in this order)."""
    return (_addr(xq), _addr(xs), _addr(codes), _addr(offsets), _addr(scales), _addr(h))


def w2_ptrs(h, codes, offsets, scales, ye):
    """The self-routed w2 body's pointer tuple (addresses, in this order)."""
    return (_addr(h), _addr(codes), _addr(offsets), _addr(scales), _addr(ye))


class _W13Timeline:
    """w13w / w13sr "bulk*": (ids, xq, xs, codes, offsets, scales, h, stamps, rows)."""

    @cute.jit
    def __call__(self, topk_ids: cute.Pointer, xq: cute.Pointer, xs: cute.Pointer,
                 codes: cute.Pointer, offsets: cute.Pointer, scales: cute.Pointer,
                 h: cute.Pointer, stamps: cute.Pointer, rows: Int32, stream: cuda.CUstream):
        launch_w13(self, self.kernel(topk_ids, xq, xs, codes, offsets, scales, h, stamps, rows),
                   stream)

    @cute.kernel
    def kernel(self, topk_ids: cute.Pointer, xq: cute.Pointer, xs: cute.Pointer,
               codes: cute.Pointer, offsets: cute.Pointer, scales: cute.Pointer,
               h: cute.Pointer, stamps: cute.Pointer, rows: Int32):
        self.run(_addr(topk_ids), w13_ptrs(xq, xs, codes, offsets, scales, h), rows,
                 _addr(stamps))


class MoeW13BulkTimelineSm90(_W13Timeline, MoeW13BulkSm90):
    """moe_w13w "bulk*" with stamps."""


class MoeW13SelfRoutedBulkTimelineSm90(_W13Timeline, MoeW13SelfRoutedBulkSm90):
    """moe_w13sr "bulk*" with stamps."""


class MoeW2BulkTimelineSm90(MoeW2BulkSm90):
    """moe_w2 "bulk" with stamps: (meta, pairs, h, codes, offsets, scales, ye, stamps, rows)."""

    @cute.jit
    def __call__(self, meta: cute.Pointer, pairs: cute.Pointer, h: cute.Pointer,
                 codes: cute.Pointer, offsets: cute.Pointer, scales: cute.Pointer,
                 ye: cute.Pointer, stamps: cute.Pointer, rows: Int32, stream: cuda.CUstream):
        launch_w2(self, self.kernel(meta, pairs, h, codes, offsets, scales, ye, stamps, rows),
                  stream)

    @cute.kernel
    def kernel(self, meta: cute.Pointer, pairs: cute.Pointer, h: cute.Pointer,
               codes: cute.Pointer, offsets: cute.Pointer, scales: cute.Pointer,
               ye: cute.Pointer, stamps: cute.Pointer, rows: Int32):
        self.run(_addr(meta), (_addr(pairs), _addr(h), _addr(codes), _addr(offsets),
                               _addr(scales), _addr(ye)), _addr(stamps))


class MoeW2EarlyRefillTimelineSm90(MoeW2EarlyRefillSm90):
    """moe_w2sr "early" with stamps: (ids, h, codes, offsets, scales, ye, stamps, rows)."""

    @cute.jit
    def __call__(self, topk_ids: cute.Pointer, h: cute.Pointer, codes: cute.Pointer,
                 offsets: cute.Pointer, scales: cute.Pointer, ye: cute.Pointer,
                 stamps: cute.Pointer, rows: Int32, stream: cuda.CUstream):
        launch_w2(self, self.kernel(topk_ids, h, codes, offsets, scales, ye, stamps, rows),
                  stream)

    @cute.kernel
    def kernel(self, topk_ids: cute.Pointer, h: cute.Pointer, codes: cute.Pointer,
               offsets: cute.Pointer, scales: cute.Pointer, ye: cute.Pointer,
               stamps: cute.Pointer, rows: Int32):
        self.run(_addr(topk_ids), w2_ptrs(h, codes, offsets, scales, ye), rows, _addr(stamps))


def kernel_class(spec: mk.MoeSpec):
    """The timeline class of a mk.timeline_specs spec."""
    if spec.kind == "w13w" and mk.bulk_scheme(spec.variant).startswith("bulk"):
        return MoeW13BulkTimelineSm90
    if spec.kind == "w13sr" and mk.bulk_scheme(spec.variant).startswith("bulk"):
        return MoeW13SelfRoutedBulkTimelineSm90
    classes = {("w2", "bulk"): MoeW2BulkTimelineSm90, ("w2sr", "early"): MoeW2EarlyRefillTimelineSm90}
    if not spec.timeline or (spec.kind, spec.variant) not in classes:
        raise ValueError(f"{spec.name}: no timeline build for {spec.kind} {spec.variant!r} "
                         f"(have w13w / w13sr bulk*, {sorted(classes)})")
    return classes[(spec.kind, spec.variant)]
