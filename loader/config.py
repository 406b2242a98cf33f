"""The DeepSeek-V4.1-Flash model config: read from `config.json`, validated, with layer roles.

`ModelConfig` holds every key of the V4.1 text config (model doc §1.1) under its config.json name;
`loader.config_checks` checks that hopdec can run it (V4.1 numerics, 32-blocked widths, a consistent
cache-sharing topology). It derives what the rest of hopdec needs: each layer's role (§1.2),
per-rank shapes for TP 1/2/4 (§2.0) and the Engram table layout (prime-sized hash buckets and hash
multipliers).

Engram layout (vLLM `vllm/models/deepseek_v41/common/engram.py`, a port of DeepSeek's
`inference/engram.py`): each (Engram layer, n-gram order 2..max, head) owns a bucket range of prime
size. One global walk over the Engram layers in order hands out, each time, the smallest prime above
`engram_vocab_size - 1` not handed out before, so `engram_layer_ids[i]` gets primes number
24i..24i+23 above the vocab size. A layer's table rows are the sum of its primes; a column's rows
start at the running sum. The real config's rows, 384006168 and 384016682, come out of this walk
exactly.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loader.config_checks import QUANT_BLOCK, latest_source, parse, validate

PRESET_DIR = Path(__file__).resolve().parent / "presets"
SUPPORTED_TP = (1, 2, 4)
LAYER_MODES = ("swa", "full", "reuse", "reindex", "draft")


@dataclass(frozen=True)
class RopeScaling:
    """YaRN on the compressed (ratio > 0) layers; mscale is 0 (disabled) in V4.1."""

    type: str
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float = 0.0


@dataclass(frozen=True)
class QuantizationConfig:
    """V4.1 checkpoint formats: FP8 e4m3 dense weights with UE8M0 32x32 scales, MXFP4 experts."""

    quant_method: str
    activation_scheme: str
    fmt: str
    scale_fmt: str
    weight_block_size: tuple[int, ...]
    expert_dtype: str


@dataclass(frozen=True)
class LayerSpec:
    """The role of one layer (backbone 0..L-1, DSpark stages L..L+nextn-1) in the cache sharing.

    A compressed layer reads the cache of the most recent kv source at or below it with the same
    ratio, and the top-k of the most recent index source likewise (model doc §1.2). Modes:
      swa      ratio 0: sliding window only.
      full     kv source: runs the compressor, publishes its cache and index keys, own indexer.
      reindex  index source that is not a kv source: own indexer query over kv_source's index keys,
               masked to the candidate blocks when uses_candidates.
      reuse    attends to kv_source's cache at topk_source's top-k positions; no indexer.
      draft    DSpark stage: sliding window only, non-causal inside the draft block.
    kv_source: the layer whose compressed cache (and index keys) this layer reads; None at ratio 0.
    topk_source: the layer whose top-k positions this layer attends to; itself for full/reindex.
    """

    index: int
    ratio: int
    mode: str  # one of LAYER_MODES
    kv_source: int | None
    topk_source: int | None
    owns_compressor: bool
    owns_index_keys: bool
    has_indexer: bool
    is_candidate_source: bool
    uses_candidates: bool
    has_engram: bool
    is_dspark: bool


@dataclass(frozen=True)
class RankShapes:
    """Per-rank widths under tensor parallelism (heads, groups, MoE intermediate, vocab split)."""

    tp: int
    heads: int
    o_groups: int
    moe_inter: int
    shared_inter: int
    dspark_moe_inter: int
    vocab: int
    q_b_out: int  # wq_b output columns: heads * head_dim
    wo_b_in: int  # wo_b input columns: o_groups * o_lora_rank
    engram_hash_cols: int  # Engram hash columns (prime buckets) looked up on each rank

    def vocab_offset(self, rank: int) -> int:
        """First vocabulary id held by `rank` (embed rows and head columns split contiguously)."""
        if not 0 <= rank < self.tp:
            raise ValueError(f"rank {rank} is outside 0..{self.tp - 1} for tp={self.tp}")
        return rank * self.vocab


@dataclass(frozen=True)
class ModelConfig:
    """The V4.1-Flash text config; every attribute is the config.json key of the same name."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int
    candidate_topk_blocks: int
    candidate_block_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    scoring_func: str
    topk_method: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    engram_layer_ids: tuple[int, ...]
    engram_max_ngram_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_vocab_size: int
    engram_compressed_vocab_size: int
    engram_pad_token_id: int
    num_nextn_predict_layers: int
    dspark_block_size: int
    dspark_noise_token_id: int
    dspark_target_layer_ids: tuple[int, ...]
    dspark_markov_rank: int
    dspark_n_routed_experts: int
    dspark_num_experts_per_tok: int
    tie_word_embeddings: bool
    quantization_config: QuantizationConfig
    # Optional keys (OPTIONAL_KEYS); None means "derive".
    engram_num_embeddings: tuple[int, ...] | None = None
    dspark_moe_intermediate_size: int | None = None

    def __post_init__(self) -> None:
        if self.dspark_moe_intermediate_size is None:
            # DSpark experts use the backbone's I (model doc §0, §1.1: the 763B total needs it).
            object.__setattr__(self, "dspark_moe_intermediate_size", self.moe_intermediate_size)
        validate(self)
        derived = tuple(sum(self.engram_primes_flat(layer)) for layer in self.engram_layer_ids)
        if self.engram_num_embeddings is None:
            object.__setattr__(self, "engram_num_embeddings", derived)
        elif tuple(self.engram_num_embeddings) != derived:
            raise ValueError(
                f"engram_num_embeddings {list(self.engram_num_embeddings)} does not match the "
                f"prime walk over engram_layer_ids {list(self.engram_layer_ids)} (expected "
                f"{list(derived)})"
            )

    # ---- loading and saving ---------------------------------------------------------------------

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        """Read a flat text config or a multimodal one (`text_config` inside) from a JSON file."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: model config not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: not a valid JSON file ({exc})") from exc
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: Any, source: str = "<dict>") -> ModelConfig:
        """Build from a config.json dict; errors name `source`, the key and what was expected."""
        try:
            return cls(**parse(data, cls))
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"{source}: {exc}") from exc

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        """A named preset: 'v41-flash' (the real model, §1.1) or 'tiny' (the CPU test model, §5)."""
        known = sorted(p.stem for p in PRESET_DIR.glob("*.json"))
        if name not in known:
            raise ValueError(f"unknown preset {name!r}; expected one of {known}")
        return cls.from_json(PRESET_DIR / f"{name}.json")

    def to_dict(self) -> dict[str, Any]:
        """A flat text config (JSON-ready: lists, plain dicts) that from_dict reads back equal."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value):
                value = {k: _jsonable(v) for k, v in dataclasses.asdict(value).items()}
            out[f.name] = _jsonable(value)
        return out

    def to_json(self, path: str | Path) -> None:
        """Write `to_dict()` as an indented config.json."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    # ---- derived widths -------------------------------------------------------------------------

    @property
    def qk_nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.o_groups

    @property
    def o_group_in_dim(self) -> int:
        """Input width of one `wo_a` group: its heads' outputs side by side."""
        return self.heads_per_group * self.head_dim

    @property
    def hc_mix_dim(self) -> int:
        """mHC mix width: pre (n) + post (n) + comb (n*n) = (2 + n) * n."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def num_layers_total(self) -> int:
        """Backbone layers plus DSpark stages (the length of compress_ratios)."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    @property
    def engram_num_hash_cols(self) -> int:
        """Hash columns per token and Engram layer: (max_ngram - 1) orders x n_heads."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    # ---- layer roles ----------------------------------------------------------------------------

    def layer(self, index: int) -> LayerSpec:
        """The role of layer `index` in 0..num_layers_total-1 (model doc §1.2)."""
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"layer index must be an int, got {type(index).__name__}")
        if not 0 <= index < self.num_layers_total:
            raise ValueError(f"layer {index} is outside 0..{self.num_layers_total - 1}")
        return self.layers[int(index)]

    @functools.cached_property
    def layers(self) -> tuple[LayerSpec, ...]:
        """Every layer's role, backbone then DSpark stages."""
        return tuple(self._layer_spec(i) for i in range(self.num_layers_total))

    def _layer_spec(self, index: int) -> LayerSpec:
        ratio = self.compress_ratios[index]
        is_dspark = index >= self.num_hidden_layers
        is_kv_source = index in self.kv_source_layer_ids
        has_indexer = index in self.index_source_layer_ids
        kv_source = topk_source = None
        if is_dspark:
            mode = "draft"
        elif ratio == 0:
            mode = "swa"
        else:
            kv_source = latest_source(self.compress_ratios, self.kv_source_layer_ids, index)
            topk_source = latest_source(self.compress_ratios, self.index_source_layer_ids, index)
            mode = "full" if is_kv_source else "reindex" if has_indexer else "reuse"
        return LayerSpec(
            index=index,
            ratio=ratio,
            mode=mode,
            kv_source=kv_source,
            topk_source=topk_source,
            owns_compressor=is_kv_source,
            owns_index_keys=is_kv_source,
            has_indexer=has_indexer,
            is_candidate_source=index == self.candidate_source_layer_id,
            uses_candidates=mode == "reindex" and kv_source == self.candidate_source_layer_id,
            has_engram=index in self.engram_layer_ids,
            is_dspark=is_dspark,
        )

    # ---- tensor parallelism ---------------------------------------------------------------------

    def rank_shapes(self, tp: int) -> RankShapes:
        """Per-rank widths at tensor parallelism `tp` (1, 2 or 4); raises naming what tp breaks."""
        if isinstance(tp, bool) or tp not in SUPPORTED_TP:
            raise ValueError(f"tp={tp!r} is not supported; expected one of {SUPPORTED_TP}")
        split = {
            "num_attention_heads": self.num_attention_heads,
            "o_groups": self.o_groups,
            "vocab_size": self.vocab_size,
            "Engram hash columns ((engram_max_ngram_size-1)*engram_n_heads)":
                self.engram_num_hash_cols,
        }
        for name, total in split.items():
            if total % tp:
                raise ValueError(f"tp={tp} does not divide {name} = {total}")
        blocked = {
            "moe_intermediate_size": self.moe_intermediate_size,
            "dspark_moe_intermediate_size": self.dspark_moe_intermediate_size,
            "vocab_size": self.vocab_size,
        }
        for name, total in blocked.items():
            if total % (tp * QUANT_BLOCK):
                raise ValueError(
                    f"{name} = {total} does not split into whole {QUANT_BLOCK}-wide blocks at "
                    f"tp={tp} "
                    f"(needs a multiple of {tp * QUANT_BLOCK})"
                )
        moe_inter = self.moe_intermediate_size // tp
        return RankShapes(
            tp=tp,
            heads=self.num_attention_heads // tp,
            o_groups=self.o_groups // tp,
            moe_inter=moe_inter,
            shared_inter=self.n_shared_experts * moe_inter,
            dspark_moe_inter=self.dspark_moe_intermediate_size // tp,
            vocab=self.vocab_size // tp,
            q_b_out=self.num_attention_heads // tp * self.head_dim,
            wo_b_in=self.o_groups // tp * self.o_lora_rank,
            engram_hash_cols=self.engram_num_hash_cols // tp,
        )

    # ---- Engram ---------------------------------------------------------------------------------

    @functools.cached_property
    def engram_primes(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """Bucket sizes [engram layer][n-gram order 2..max][head], from one global prime walk."""
        per_layer = self.engram_num_hash_cols
        count = per_layer * len(self.engram_layer_ids)
        walk = _primes_above(self.engram_vocab_size - 1, count)
        heads = self.engram_n_heads
        return tuple(
            tuple(
                tuple(walk[i * per_layer + o * heads:i * per_layer + (o + 1) * heads])
                for o in range(self.engram_max_ngram_size - 1)
            )
            for i in range(len(self.engram_layer_ids))
        )

    def _engram_slot(self, layer: int) -> int:
        if layer not in self.engram_layer_ids:
            raise ValueError(
                f"layer {layer} has no Engram (engram_layer_ids {list(self.engram_layer_ids)})"
            )
        return self.engram_layer_ids.index(layer)

    def engram_primes_flat(self, layer: int) -> tuple[int, ...]:
        """Bucket sizes of Engram layer `layer`, per column (n-2)*n_heads + head."""
        return tuple(p for order in self.engram_primes[self._engram_slot(layer)] for p in order)

    def engram_offsets(self, layer: int) -> tuple[int, ...]:
        """First table row of each hash column of `layer` (running sum of its primes)."""
        primes = self.engram_primes_flat(layer)
        return tuple(int(x) for x in np.cumsum((0,) + primes[:-1]))

    def engram_num_embeddings_of(self, layer: int) -> int:
        """Table rows of Engram layer `layer`: the sum of its primes."""
        return self.engram_num_embeddings[self._engram_slot(layer)]

    def engram_hash_multipliers(self, layer: int) -> tuple[int, ...]:
        """The odd int64 hash multiplier per lookback k = 0..max_ngram-1 of Engram `layer`.

        Drawn by `np.random.default_rng(10007 * layer)` below (int64 max // compressed vocab) // 2
        and made odd (2v + 1), so compressed_id * multiplier cannot overflow int64.
        """
        self._engram_slot(layer)
        bound = max(1, (np.iinfo(np.int64).max // self.engram_compressed_vocab_size) // 2)
        values = np.random.default_rng(10007 * layer).integers(
            low=0, high=bound, size=(self.engram_max_ngram_size,), dtype=np.int64
        )
        return tuple(int(v) * 2 + 1 for v in values)

    def engram_rank_rows(self, layer: int, tp: int, rank: int) -> tuple[int, int]:
        """Table rows [start, stop) of `layer` held by `rank`: its hash columns' whole buckets."""
        cols = self.rank_shapes(tp).engram_hash_cols
        if not 0 <= rank < tp:
            raise ValueError(f"rank {rank} is outside 0..{tp - 1} for tp={tp}")
        primes = self.engram_primes_flat(layer)
        start = sum(primes[:rank * cols])
        return start, start + sum(primes[rank * cols:(rank + 1) * cols])


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24 (bases: the first 12 primes)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in small:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@functools.lru_cache(maxsize=16)
def _primes_above(start: int, count: int) -> tuple[int, ...]:
    """The `count` smallest primes greater than `start`, ascending."""
    primes, candidate = [], start
    while len(primes) < count:
        candidate += 1
        if _is_prime(candidate):
            primes.append(candidate)
    return tuple(primes)
