"""The table of V4.1-Flash checkpoint tensors for a config: name, dtype, shape, format, TP split, class.

`checkpoint_schema(cfg)` returns one list of `TensorSpec` rows, in checkpoint order (layers, then the
DSpark stages, then embed/norm/head). Everything else in `loader/` (validation, synthesis,
sharding, byte accounting) reads this table; nothing else knows tensor names.

Formats (humming-formats §2, §4):
- FP8 dense: `{name}.weight` F8_E4M3 [N, K] + `{name}.scale` F8_E8M0 [N/32, K/32].
- MXFP4 experts: `{name}.weight` I8 [out, in/2] (low nibble = even k) + `{name}.scale` F8_E8M0
  [out, in/32].
- Norms, router, mHC, sinks, compressors, indexer projections, embed/head: plain BF16 / F32.

TP splits as vLLM slices them (humming-formats §2.1/§2.2, model doc §2.2): `wq_b` column (and its
32x32 scale rows), `wo_b` row (scale columns), `wo_a` by whole output groups, `attn_sink` by heads,
shared experts w1/w3 column and w2 row, routed experts w1/w3 on out and w2 on in (bytes I/2,
scales I/32), embed/head/markov_w2 by vocab rows, Engram tables by whole hash columns; everything
else (`wq_a`, `wkv`, norms, mHC, router, compressors, indexers, Engram `wkv`, `main_proj`)
replicated.

Names and dtypes the model doc leaves uncertain (§6) are decided in `UNCERTAIN` below, in one place.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass

from loader.config import ModelConfig
from loader.safetensors import DTYPES

BLOCK = 32  # FP8 32x32 blocks and MXFP4 groups along K


class Split(enum.Enum):
    """How a tensor is divided over TP ranks: the dimension cut, and why (the vLLM layer kind)."""

    REPLICATED = "replicated"
    COLUMN = "column"  # ColumnParallelLinear: output rows (and the 32x32 scale rows)
    ROW = "row"  # RowParallelLinear: input columns (and the scale columns)
    HEADS = "heads"  # per-head vector (attn_sink)
    GROUPED = "grouped"  # wo_a: whole output groups (o_lora_rank rows each)
    VOCAB = "vocab"  # VocabParallelEmbedding / ParallelLMHead: vocab rows
    EXPERT_OUT = "experts-out"  # FusedMoE w1/w3: expert output rows (I)
    EXPERT_IN = "experts-in"  # FusedMoE w2: expert input columns (I/2 bytes, I/32 scales)
    ENGRAM_COLS = "engram-cols"  # Engram table: rows of whole hash columns (uneven, prime-sized)

    @property
    def dim(self) -> int | None:
        if self is Split.REPLICATED:
            return None
        return 1 if self in (Split.ROW, Split.EXPERT_IN) else 0


class Fmt(str, enum.Enum):
    """Storage format of one tensor, for byte accounting and for the synthesiser."""

    FP8 = "fp8 e4m3"
    FP8_SCALE = "fp8 scales (ue8m0)"  # 32x32 blocks; 1x32 for the Engram tables
    MXFP4 = "mxfp4 e2m1"
    MXFP4_SCALE = "mxfp4 scales (ue8m0 /32)"
    BF16 = "bf16"
    FP32 = "fp32"
    INT32 = "int32 ids"  # the Engram vocab map (loader/engram_vocab.py), not a schema row


# Byte classes of model doc §3, for `hopdec inspect`.
CLASSES = ("attention", "norms", "mhc", "router", "shared_expert", "routed_experts",
           "compressor_indexer", "engram_wkv", "engram_table", "embed", "head", "dspark")


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor.

    granule: the split dimension is cut only at multiples of this many entries (a 32-row FP8 block,
    a 16-byte / 32-code MXFP4 group, one `wo_a` output group).
    row_groups: for ENGRAM_COLS, the rows of each hash column; a rank takes whole columns.
    """

    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    fmt: Fmt
    split: Split
    cls: str  # one of CLASSES
    layer: int | None = None  # backbone layer, or L + stage for DSpark, None for global tensors
    granule: int = 1
    row_groups: tuple[int, ...] | None = None
    std: float = 1.0  # synthetic values: standard deviation (before quantization)
    init: str = "normal"  # synthetic law: normal N(0, std^2) | ones 1 + N(0, std^2) | hc_base | hc_scale

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    @property
    def is_scale(self) -> bool:
        return self.fmt in (Fmt.FP8_SCALE, Fmt.MXFP4_SCALE)

    @property
    def base(self) -> str:
        """`x` for `x.weight`/`x.scale`: the pair generated and quantized together."""
        for suffix in (".weight", ".scale"):
            if self.name.endswith(suffix):
                return self.name[: -len(suffix)]
        return self.name


# Decisions where the model doc is uncertain (§6) or silent: change them here only.
UNCERTAIN = {
    # uncertain: RMSNorm weights are stored bf16 (DeepSeek's V3.2/V4 reference keeps them fp32 in
    # memory and says the checkpoint holds bf16).
    "norm_dtype": "BF16",
    # uncertain: router weight bf16 (model doc §6: bf16 vs fp32).
    "router_dtype": "BF16",
    # uncertain: ratio-2 compressor wkv/wgate fp32 per [pypto41] (could be bf16); ratio-1 wkv bf16.
    "compressor_r2_dtype": "F32",
    "compressor_r1_dtype": "BF16",
    # uncertain: `gate.bias_vl` (the VL routing bias) exists for every backbone layer, fp32 [E]
    # (humming-formats §4, from a backport comment). DSpark stages have none.
    "router_vl_bias": True,
    # uncertain: indexer key projection and its norm are `indexer.wk` [128, 512] bf16 and
    # `indexer.k_norm` [128] (kv sources only); the query side is `indexer.wq_b` (FP8) and
    # `indexer.weights_proj` [n_heads, D] bf16.
    # uncertain: Engram names: table `engram.embed.{weight,scale}` (fp8 + ue8m0 per 32 columns),
    # `engram.wkv` FP8, gate vectors `engram.q_weight` / `engram.k_weight` [hc_mult, D] bf16.
    # uncertain: DSpark extras live on mtp.0 (`main_proj`, `main_norm`) and on the last stage
    # (`markov_head.markov_w{1,2}`, `confidence_head.proj` fp32 [1, D + rank]); every stage has
    # its own `norm` (only the last one's is used).
}

# Checkpoint tensors hopdec reads nowhere (the vision tower and image embeddings of the multimodal
# release): accepted by validation, never loaded.
IGNORED_PREFIXES = ("vision.", "aligner.", "image_", "projector.")


class _Rows:
    """Collects TensorSpec rows for one layer prefix (keeps the table below declarative)."""

    def __init__(self, prefix: str, layer: int | None, cls: str):
        self.prefix, self.layer, self.cls, self.rows = prefix, layer, cls, []

    def plain(self, name, dtype, shape, split=Split.REPLICATED, cls=None, std=1.0, **kw):
        fmt = Fmt.FP32 if dtype == "F32" else Fmt.BF16
        self.rows.append(TensorSpec(self.prefix + name, dtype, tuple(shape), fmt, split,
                                    cls or self.cls, self.layer, std=std, **kw))

    def norm(self, name, dim, cls=None):
        self.plain(name, UNCERTAIN["norm_dtype"], (dim,), cls=cls or "norms", std=0.05,
                   init="ones")

    def fp8(self, name, n, k, split=Split.REPLICATED, cls=None, granule_rows=BLOCK):
        """FP8 e4m3 weight + UE8M0 32x32 scale, cut alongside each other."""
        if n % BLOCK or k % BLOCK:
            raise ValueError(f"{self.prefix}{name}: FP8 [{n}, {k}] is not 32x32-blocked")
        wgran = BLOCK if split.dim == 1 else granule_rows
        sgran = 1 if split.dim == 1 else granule_rows // BLOCK
        cls = cls or self.cls
        self.rows.append(TensorSpec(f"{self.prefix}{name}.weight", "F8_E4M3", (n, k), Fmt.FP8,
                                    split, cls, self.layer, wgran, std=k ** -0.5))
        self.rows.append(TensorSpec(f"{self.prefix}{name}.scale", "F8_E8M0", (n // BLOCK, k // BLOCK),
                                    Fmt.FP8_SCALE, split, cls, self.layer, sgran))

    def mxfp4(self, name, n, k, split, cls):
        """MXFP4 expert weight: I8 [n, k/2] codes + UE8M0 [n, k/32] scales."""
        if k % BLOCK:
            raise ValueError(f"{self.prefix}{name}: MXFP4 input width {k} is not a multiple of 32")
        wgran = BLOCK // 2 if split.dim == 1 else 1
        self.rows.append(TensorSpec(f"{self.prefix}{name}.weight", "I8", (n, k // 2), Fmt.MXFP4,
                                    split, cls, self.layer, wgran, std=k ** -0.5))
        self.rows.append(TensorSpec(f"{self.prefix}{name}.scale", "F8_E8M0", (n, k // BLOCK),
                                    Fmt.MXFP4_SCALE, split, cls, self.layer))


def _attention(r: _Rows, cfg: ModelConfig) -> None:
    d, hd = cfg.hidden_size, cfg.head_dim
    r.fp8("attn.wq_a", cfg.q_lora_rank, d)
    r.norm("attn.q_norm.weight", cfg.q_lora_rank)
    r.fp8("attn.wkv", hd, d)
    r.norm("attn.kv_norm.weight", hd)
    r.fp8("attn.wq_b", cfg.num_attention_heads * hd, cfg.q_lora_rank, Split.COLUMN)
    # wo_a rows are o_groups blocks of o_lora_rank: a rank owns whole groups.
    r.fp8("attn.wo_a", cfg.o_groups * cfg.o_lora_rank, cfg.o_group_in_dim, Split.GROUPED,
          granule_rows=cfg.o_lora_rank)
    r.fp8("attn.wo_b", d, cfg.o_groups * cfg.o_lora_rank, Split.ROW)
    r.plain("attn.attn_sink", "F32", (cfg.num_attention_heads,), Split.HEADS, std=0.5)


def _compressor_indexer(r: _Rows, cfg: ModelConfig, spec) -> None:
    d, hd = cfg.hidden_size, cfg.head_dim
    c = "compressor_indexer"
    if spec.owns_compressor:
        if spec.ratio == 2:
            dt = UNCERTAIN["compressor_r2_dtype"]
            r.plain("attn.compressor.wkv.weight", dt, (hd, d), cls=c, std=d ** -0.5)
            r.plain("attn.compressor.wgate.weight", dt, (hd, d), cls=c, std=d ** -0.5)
        else:
            r.plain("attn.compressor.wkv.weight", UNCERTAIN["compressor_r1_dtype"], (hd, d),
                    cls=c, std=d ** -0.5)
        r.norm("attn.compressor.norm.weight", hd, cls=c)
    if spec.has_indexer:
        r.fp8("attn.indexer.wq_b", cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, cls=c)
        r.plain("attn.indexer.weights_proj.weight", "BF16", (cfg.index_n_heads, d), cls=c,
                std=d ** -0.5)
    if spec.owns_index_keys:
        r.plain("attn.indexer.wk.weight", "BF16", (cfg.index_head_dim, hd), cls=c, std=hd ** -0.5)
        r.norm("attn.indexer.k_norm.weight", cfg.index_head_dim, cls=c)


def _engram(r: _Rows, cfg: ModelConfig, layer: int) -> None:
    d, cols, hdim = cfg.hidden_size, cfg.engram_num_hash_cols, cfg.engram_head_dim
    primes = cfg.engram_primes_flat(layer)
    rows = sum(primes)
    for suffix, dtype, shape, fmt in (("weight", "F8_E4M3", (rows, hdim), Fmt.FP8),
                                      ("scale", "F8_E8M0", (rows, hdim // BLOCK), Fmt.FP8_SCALE)):
        r.rows.append(TensorSpec(f"{r.prefix}engram.embed.{suffix}", dtype, shape, fmt,
                                 Split.ENGRAM_COLS, "engram_table", layer, row_groups=primes))
    # wkv: the 24 looked-up rows -> hc_mult keys + 1 value, each D wide (model doc §2.2 E2).
    r.fp8("engram.wkv", (cfg.hc_mult + 1) * d, cols * hdim, cls="engram_wkv")
    for name in ("engram.q_weight", "engram.k_weight"):
        r.plain(name, "BF16", (cfg.hc_mult, d), cls="engram_wkv", std=0.05, init="ones")


def _ffn(r: _Rows, cfg: ModelConfig, dspark: bool) -> None:
    d = cfg.hidden_size
    n_exp = cfg.dspark_n_routed_experts if dspark else cfg.n_routed_experts
    inter = cfg.dspark_moe_intermediate_size if dspark else cfg.moe_intermediate_size
    r.plain("ffn.gate.weight", UNCERTAIN["router_dtype"], (n_exp, d), cls="router", std=d ** -0.5)
    r.plain("ffn.gate.bias", "F32", (n_exp,), cls="router", std=0.01)
    if UNCERTAIN["router_vl_bias"] and not dspark:
        r.plain("ffn.gate.bias_vl", "F32", (n_exp,), cls="router", std=0.01)
    for e in range(n_exp):
        for w, n, k, split in (("w1", inter, d, Split.EXPERT_OUT), ("w2", d, inter, Split.EXPERT_IN),
                               ("w3", inter, d, Split.EXPERT_OUT)):
            r.mxfp4(f"ffn.experts.{e}.{w}", n, k, split, "routed_experts")
    shared = cfg.n_shared_experts * inter
    r.fp8("ffn.shared_experts.w1", shared, d, Split.COLUMN, cls="shared_expert")
    r.fp8("ffn.shared_experts.w2", d, shared, Split.ROW, cls="shared_expert")
    r.fp8("ffn.shared_experts.w3", shared, d, Split.COLUMN, cls="shared_expert")


def _mhc(r: _Rows, cfg: ModelConfig) -> None:
    for sub in ("attn", "ffn"):
        r.plain(f"hc_{sub}_fn", "F32", (cfg.hc_mix_dim, cfg.hc_mult * cfg.hidden_size), cls="mhc",
                std=(cfg.hc_mult * cfg.hidden_size) ** -0.5)
        r.plain(f"hc_{sub}_base", "F32", (cfg.hc_mix_dim,), cls="mhc", init="hc_base")
        r.plain(f"hc_{sub}_scale", "F32", (3,), cls="mhc", init="hc_scale")


def layer_specs(cfg: ModelConfig, index: int) -> list[TensorSpec]:
    """Every tensor of backbone layer or DSpark stage `index` (0..num_layers_total-1)."""
    spec = cfg.layer(index)
    if spec.is_dspark:
        stage = index - cfg.num_hidden_layers
        r = _Rows(f"mtp.{stage}.", index, "dspark")
    else:
        r = _Rows(f"layers.{index}.", index, "attention")
    _attention(r, cfg)
    _compressor_indexer(r, cfg, spec)
    if spec.has_engram:
        _engram(r, cfg, index)
    r.norm("attn_norm.weight", cfg.hidden_size)
    r.norm("ffn_norm.weight", cfg.hidden_size)
    _mhc(r, cfg)
    _ffn(r, cfg, spec.is_dspark)
    if spec.is_dspark:
        _dspark_extras(r, cfg, stage)
        r.rows = [_as_dspark(t) for t in r.rows]
    return r.rows


def _dspark_extras(r: _Rows, cfg: ModelConfig, stage: int) -> None:
    d, v, rank = cfg.hidden_size, cfg.vocab_size, cfg.dspark_markov_rank
    r.norm("norm.weight", d)
    if stage == 0:
        n_in = len(cfg.dspark_target_layer_ids) * d
        r.fp8("main_proj", d, n_in)
        r.norm("main_norm.weight", d)
    if stage == cfg.num_nextn_predict_layers - 1:
        r.plain("markov_head.markov_w1.weight", "BF16", (v, rank), std=1.0)
        r.plain("markov_head.markov_w2.weight", "BF16", (v, rank), Split.VOCAB, std=0.1 / rank**0.5)
        r.plain("confidence_head.proj.weight", "F32", (1, d + rank), std=(d + rank) ** -0.5)


def _as_dspark(t: TensorSpec) -> TensorSpec:
    """DSpark stage tensors are accounted as one class (model doc §3 counts them apart)."""
    return dataclasses.replace(t, cls="dspark")


def checkpoint_schema(cfg: ModelConfig) -> list[TensorSpec]:
    """The whole table for `cfg`, in checkpoint order; names are unique."""
    rows: list[TensorSpec] = []
    for index in range(cfg.num_layers_total):
        rows += layer_specs(cfg, index)
    g = _Rows("", None, "norms")
    g.plain("embed.weight", "BF16", (cfg.vocab_size, cfg.hidden_size), Split.VOCAB, cls="embed")
    g.norm("norm.weight", cfg.hidden_size)
    g.plain("head.weight", "BF16", (cfg.vocab_size, cfg.hidden_size), Split.VOCAB, cls="head",
            std=cfg.hidden_size ** -0.5)
    rows += g.rows
    names = [t.name for t in rows]
    assert len(set(names)) == len(names), "duplicate tensor names in the schema"
    return rows


def is_ignored(name: str) -> bool:
    """Checkpoint tensors that hopdec accepts and never reads (vision tower, image embeddings)."""
    return name.startswith(IGNORED_PREFIXES)
