"""One rank's routed-MoE shape (`MoeShape`) and the constants of the repacked weight layout.

The lowest layer of `kernels/moe_kernel_ref.py` (whose docstring describes the layout); callers
use these names through `moe_kernel_ref`, which imports them.
"""
from __future__ import annotations

from dataclasses import dataclass

from kernels.common_ref import ceil_div

TILE_ROWS = 16          # mma M
COL_K = 64              # two k-steps of 32: one 16-byte load per lane
KSTEP = 32              # mma K, also the MXFP4 scale group
ACT_GROUP = 128         # activation quantization group
LANES = 32
CHUNK_TOKENS = 8        # mma N: token rows per pass over a tile
COL_BYTES = LANES * 16
GROUP_OFFSET_BYTES = 8 * 8
LUT_LO_BASE = 0x0C080000
LUT_HI_BASE = 0x1C181410
MAX_ROWS = 192          # largest decode bucket; the prep kernel's bitmap holds this many rows
BITMAP_WORDS = ceil_div(MAX_ROWS, 32)
META_HEADER = 4         # meta[0] = distinct experts, [1] = bad expert ids seen, [2..3] spare


def round_up(a: int, b: int) -> int:
    return ceil_div(a, b) * b


@dataclass(frozen=True)
class MoeShape:
    """One rank's routed MoE: experts, top-k, hidden D, intermediate I (this rank's slice)."""

    num_experts: int
    topk: int
    hidden: int
    inter: int
    swiglu_limit: float

    def __post_init__(self):
        if self.hidden % ACT_GROUP or self.hidden % TILE_ROWS:
            raise ValueError(f"MoE hidden {self.hidden} must be a multiple of {ACT_GROUP}")
        if self.inter % 8 or self.inter % KSTEP:
            raise ValueError(f"MoE intermediate {self.inter} must be a multiple of 32")
        if not 0 < self.topk <= min(self.num_experts, 8):
            raise ValueError(f"MoE topk {self.topk} must be in 1..min(experts, 8)")

    @property
    def k13(self) -> int:           # padded K of w13 (= hidden)
        return round_up(self.hidden, COL_K)

    @property
    def k2(self) -> int:            # padded K of w2 (I rounded up to 64)
        return round_up(self.inter, COL_K)

    def groups(self, k: int) -> int:
        return ceil_div(k, ACT_GROUP)

    @property
    def tiles13(self) -> int:       # 8 gate + 8 up rows per tile
        return self.inter // 8

    @property
    def tiles2(self) -> int:
        return self.hidden // TILE_ROWS

    def sublayer_bytes(self, n: int, k: int) -> tuple[int, int]:
        """(code bytes, offset bytes) of one expert's repacked sublayer [n, k]."""
        kp = round_up(k, COL_K)
        return n * kp // 2, (n // TILE_ROWS) * self.groups(kp) * GROUP_OFFSET_BYTES

    @property
    def w13_bytes(self) -> tuple[int, int]:
        return self.sublayer_bytes(2 * self.inter, self.hidden)

    @property
    def w2_bytes(self) -> tuple[int, int]:
        return self.sublayer_bytes(self.hidden, self.inter)

    def checkpoint_expert_bytes(self) -> int:
        """MXFP4 codes + one UE8M0 byte per 32, w13 and w2, one expert (anchors.md's count)."""
        n13, n2 = 2 * self.inter * self.hidden, self.hidden * self.inter
        return n13 // 2 + n13 // 32 + n2 // 2 + n2 // 32

    def repacked_expert_bytes(self) -> int:
        return sum(self.w13_bytes) + sum(self.w2_bytes)

    def tag(self) -> str:
        return f"e{self.num_experts}_k{self.topk}_d{self.hidden}_i{self.inter}"
