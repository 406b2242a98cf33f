"""Stand-ins for the buffers other groups declare that executor.stages.attn_proj reads, so its test
runs the group alone: `positions32` (head.rows_prep, mHC group) and `attn.o` (attn_index, group B)."""
import numpy as np

from executor.wiring import Buffer
from kernels.common_ref import BF16

BUILDERS = {}


def buffers(cfg, tp, max_rows):
    heads = cfg.rank_shapes(tp).heads
    return [Buffer("positions32", np.int32, (max_rows,), "positions (rows prep)"),
            Buffer("attn.o", BF16, (max_rows, heads, cfg.head_dim), "attention output")]
