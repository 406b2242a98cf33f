"""Test-only stage module for tests/test_stages_attn_index.py: the buffers and constants that the
attn_index stages read but other groups declare (group A: attn.qkv, attn.qr, attn.q, rope.plain,
rope.yarn;
head.rows_prep's module: positions32, row_info), so the stages can run on their own. No builders."""
import numpy as np

from executor.reference.attention import rope_for
from executor.wiring import Buffer
from kernels import sparse_mqa_ref as sm
from kernels.common_ref import BF16

BUILDERS = {}


def buffers(cfg, tp, max_rows):
    heads = cfg.rank_shapes(tp).heads
    return [Buffer("attn.qkv", BF16, (max_rows, cfg.q_lora_rank + cfg.head_dim), "test input"),
            Buffer("attn.qr", BF16, (max_rows, cfg.q_lora_rank), "test input"),
            Buffer("attn.q", BF16, (max_rows, heads, sm.HEAD_DIM), "test input"),
            Buffer("positions32", np.int32, (max_rows,), "test input"),
            Buffer("row_info", np.int32, (max_rows, sm.INFO_FIELDS), "test input")]


def weights(cfg, tp, rank, fetch):
    """The RoPE tables, and q_norm's weight (group A's) where the folded indexer wq_b reads it."""
    q_norm = [(f"layers.{s.index}.attn.q_norm.weight.f32",
               np.asarray(fetch(f"layers.{s.index}.attn.q_norm.weight"), np.float32))
              for s in cfg.layers if s.has_indexer and not s.is_dspark]
    return [("rope.plain", rope_for(cfg, 0).cos_sin),
            ("rope.yarn", rope_for(cfg, 1).cos_sin)] + q_norm
