"""moe_w13 / moe_w2 with one cp.async commit group per 128-group, awaited group by group.

Same work items, ring, numerics and ABI as `kernels/moe.py` (y is bitwise the default chain's);
only the copy/wait granularity changes. The default kernels commit an item's weights as one
group and wait for all of it before the first decode: with one item per CTA (R <= 2) the SM
then loads ~150 KB doing nothing, and decodes + multiplies (~2000 instructions per warp and
item, issue-bound) doing nothing else. Here each thread commits its share of every 128-group
separately (w13: 2 code columns + 1 offset word; w2: the same, the 64-wide tail group 1 column)
and waits only for the group it is about to use, so the math on the first groups overlaps the
arrival of the rest. The wait count is static: an iteration has `stages - 1` items of
`groups` commit groups each issued ahead of this one, so group g of the current item is done
when at most `(stages - 1) * groups + groups - 1 - g` groups are pending
(`mk.group_wait_pending`; tests/test_moe_kernel_cpu.py replays the schedule). Past the last item
`issue` still commits `groups` empty groups, so the counts stay uniform. Each thread reads back
only the bytes it copied, so the per-thread wait is the whole synchronisation (as before).
"""
from __future__ import annotations

import cutlass
from cutlass import Int32, Int64, cute

from kernels import moe_kernel_ref as mk
from kernels.moe import MoeW2Sm90, MoeW13Sm90
from kernels.moe_ptx import cp_async_8, cp_async_16, cp_async_commit, cp_async_wait


class MoeW13PipelinedSm90(MoeW13Sm90):
    """moe_w13 ("g" variants): per-128-group commit groups and waits."""

    def await_item(self):
        """Nothing: each group is awaited just before its math (`await_group`)."""

    def await_group(self, gi: int):
        cp_async_wait(mk.group_wait_pending(self.stages, self.groups_per_warp, gi))

    @cute.jit
    def issue(self, stage: Int32, e: Int32, codes: Int64, offsets: Int64, item: Int32,
              total: Int32, warp: Int32, lane: Int32, tidx: Int32):
        """This thread's share of item's weights (expert e), one commit group per 128-group
        of the warp's K slice (empty groups past the last item)."""
        tile_id = Int64(e * self.tiles + item % self.tiles)
        wbase = (codes + (tile_id * self.cols + warp * self.cols_per_warp) * mk.COL_BYTES
                 + lane * 16)
        obase = (offsets + (tile_id * self.groups + warp * self.groups_per_warp)
                 * mk.GROUP_OFFSET_BYTES + (lane // 4) * 8)
        for gi in cutlass.range_constexpr(self.groups_per_warp):
            if item < total:
                for c in cutlass.range_constexpr(2 * gi, 2 * gi + 2):
                    cp_async_16(stage + (c * self.threads + tidx) * 16, wbase + c * mk.COL_BYTES)
                cp_async_8(stage + self.offsets_at + (gi * self.threads + tidx) * 8,
                           obase + gi * mk.GROUP_OFFSET_BYTES)
            cp_async_commit()


class MoeW2PipelinedSm90(MoeW2Sm90):
    """moe_w2 ("g" variants): per-128-group commit groups and waits (the 64-wide tail group of
    I = 576 is one column)."""

    def await_item(self):
        """Nothing: each group is awaited just before its math (`await_group`)."""

    def await_group(self, grp: int):
        cp_async_wait(mk.group_wait_pending(self.stages, self.groups, grp))

    @cute.jit
    def issue(self, stage: Int32, e: Int32, codes: Int64, offsets: Int64, item: Int32,
              total: Int32, warp: Int32, lane: Int32, tidx: Int32):
        """This warp's tile of item (expert e), one commit group per 128-group of K = I (empty
        groups past the last item)."""
        tile_id = Int64(e * self.shape.tiles2 + (item % self.blocks) * mk.W2_WARPS + warp)
        wbase = codes + tile_id * self.cols * mk.COL_BYTES + lane * 16
        obase = offsets + tile_id * self.groups * mk.GROUP_OFFSET_BYTES + (lane // 4) * 8
        for grp in cutlass.range_constexpr(self.groups):
            if item < total:
                for c in cutlass.range_constexpr(2 * grp, min(2 * grp + 2, self.cols)):
                    cp_async_16(stage + (c * self.threads + tidx) * 16, wbase + c * mk.COL_BYTES)
                cp_async_8(stage + self.offsets_at + (grp * self.threads + tidx) * 8,
                           obase + grp * mk.GROUP_OFFSET_BYTES)
            cp_async_commit()


def kernel_class(spec: mk.MoeSpec):
    """The class compiling a group-commit spec (w13 or w2)."""
    classes = {"w13": MoeW13PipelinedSm90, "w2": MoeW2PipelinedSm90}
    if spec.kind not in classes:
        raise ValueError(f"{spec.name}: group commits exist for w13 / w2 only, not {spec.kind}")
    return classes[spec.kind]
