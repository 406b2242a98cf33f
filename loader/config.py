"""The DeepSeek-V4.1-Flash model configuration: parsed from `config.json`, validated, with layer roles.

`ModelConfig` holds every key of the V4.1 text config (model doc §1.1) under its config.json name, checks
that hopdec can run it (V4.1 numerics, 32-blocked widths, a consistent cache-sharing topology), and derives
what the rest of hopdec needs: each layer's role (§1.2), per-rank shapes for TP 1/2/4 (§2.0), and the
Engram table layout (prime-sized hash buckets and hash multipliers, §2.1 item 3).

Engram derivation (from vLLM `vllm/models/deepseek_v41/common/engram.py`, a port of DeepSeek's
`inference/engram.py`): every (engram layer, n-gram order n = 2..max, head) pair owns a bucket range of
prime size. The primes are handed out by one global walk over the engram layers in order, each the
smallest prime above `engram_vocab_size - 1` not handed out before, so layer `engram_layer_ids[i]` gets
the primes number 24i .. 24i+23 above the vocab size. A layer's table rows are the sum of its primes; a
head's rows start at the running sum (`engram_offsets`). The real config's rows, 384006168 and 384016682,
come out of this walk exactly.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

PRESET_DIR = Path(__file__).resolve().parent / "presets"
SUPPORTED_TP = (1, 2, 4)
QUANT_BLOCK = 32  # FP8 weights: UE8M0 per 32x32 block; MXFP4 experts: UE8M0 per 32 along K
SUPPORTED_RATIOS = (0, 1, 2)  # V4.1: SWA only, ratio-1 (C1A), ratio-2 (C2A); V4's 4/128 are not supported
MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")
LAYER_MODES = ("swa", "full", "reuse", "reindex", "draft")

# Keys that may appear in a config.json but carry nothing hopdec reads (the vision tower, the multimodal
# wrapper, HF bookkeeping). Everything else that is not a ModelConfig field is an error.
IGNORED_KEYS = {
    "architectures": "HF class names",
    "auto_map": "HF remote-code class paths",
    "transformers_version": "HF bookkeeping",
    "torch_dtype": "HF default dtype; hopdec's dtypes are fixed per tensor",
    "dtype": "HF default dtype (transformers >= 4.56 name)",
    "use_cache": "HF generation flag",
    "initializer_range": "training only",
    "bos_token_id": "tokenizer, not the decode step",
    "eos_token_id": "tokenizer, not the decode step",
    "pad_token_id": "tokenizer, not the decode step",
    "vision_config": "vision tower: hopdec decodes text only",
    "aligner_config": "vision aligner: hopdec decodes text only",
    "projector_config": "vision projector: hopdec decodes text only",
    "image_token_id": "vision prompt token: prefill only",
    "image_token_index": "vision prompt token: prefill only",
}

# Keys that some V4.1 configs spell out but that hopdec supports with one value only.
FIXED_KEYS = {
    "num_hash_layers": 0,  # V4's tid2eid hash routing; V4.1 has none
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "expert_dtype": "fp4",  # duplicate of quantization_config.expert_dtype in some copies
}

# Keys that may be absent; their default is derived from the other keys (None: derive in __post_init__).
OPTIONAL_KEYS = ("engram_num_embeddings", "dspark_moe_intermediate_size")


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


# The only quantization hopdec implements (model doc §1.1, humming-formats §2).
V41_QUANTIZATION = QuantizationConfig("fp8", "dynamic", "e4m3", "ue8m0", (32, 32), "fp4")


@dataclass(frozen=True)
class LayerSpec:
    """The role of one layer (0..L-1 backbone, L..L+nextn-1 DSpark stages) in the cache-sharing plan.

    kv_source: the layer whose compressed cache (and index keys) this layer reads, None for ratio 0.
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
    """Per-rank widths under tensor parallelism (attention heads, MoE intermediate and vocab split)."""

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
        """First vocabulary id held by `rank` (embed rows and head columns are split contiguously)."""
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
        _validate(self)
        derived = tuple(sum(self.engram_primes_flat(layer)) for layer in self.engram_layer_ids)
        if self.engram_num_embeddings is None:
            object.__setattr__(self, "engram_num_embeddings", derived)
        elif tuple(self.engram_num_embeddings) != derived:
            raise ValueError(
                f"engram_num_embeddings {list(self.engram_num_embeddings)} does not match the prime walk "
                f"over engram_layer_ids {list(self.engram_layer_ids)} (expected {list(derived)})"
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
            return cls(**_parse(data))
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"{source}: {exc}") from exc

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        """A named preset: 'v41-flash' (the real model, §1.1) or 'tiny' (the CPU test model, §5)."""
        path = PRESET_DIR / f"{name}.json"
        if not path.is_file():
            known = sorted(p.stem for p in PRESET_DIR.glob("*.json"))
            raise ValueError(f"unknown preset {name!r}; expected one of {known}")
        return cls.from_json(path)

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

    # ---- derived widths ---------------------------------------------------------------------------

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

    # ---- layer roles ------------------------------------------------------------------------------

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

    def _latest_source(self, sources: tuple[int, ...], index: int) -> int | None:
        """The most recent layer of `sources` at or below `index` with the same compress ratio."""
        ratio = self.compress_ratios[index]
        found = [s for s in sources if s <= index and self.compress_ratios[s] == ratio]
        return max(found) if found else None

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
            kv_source = self._latest_source(self.kv_source_layer_ids, index)
            topk_source = self._latest_source(self.index_source_layer_ids, index)
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

    # ---- tensor parallelism -----------------------------------------------------------------------

    def rank_shapes(self, tp: int) -> RankShapes:
        """Per-rank widths at tensor parallelism `tp` (1, 2 or 4); raises naming what tp must divide."""
        if isinstance(tp, bool) or tp not in SUPPORTED_TP:
            raise ValueError(f"tp={tp!r} is not supported; expected one of {SUPPORTED_TP}")
        split = {
            "num_attention_heads": self.num_attention_heads,
            "o_groups": self.o_groups,
            "vocab_size": self.vocab_size,
            "engram hash columns ((engram_max_ngram_size-1)*engram_n_heads)": self.engram_num_hash_cols,
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
                    f"{name} = {total} does not split into whole {QUANT_BLOCK}-wide blocks at tp={tp} "
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

    # ---- Engram -----------------------------------------------------------------------------------

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
            raise ValueError(f"layer {layer} has no Engram (engram_layer_ids {list(self.engram_layer_ids)})")
        return self.engram_layer_ids.index(layer)

    def engram_primes_flat(self, layer: int) -> tuple[int, ...]:
        """The hash-column bucket sizes of Engram layer `layer`, order-major (column = (n-2)*heads + h)."""
        return tuple(p for order in self.engram_primes[self._engram_slot(layer)] for p in order)

    def engram_offsets(self, layer: int) -> tuple[int, ...]:
        """First table row of each hash column of `layer` (running sum of its primes)."""
        primes = self.engram_primes_flat(layer)
        return tuple(int(x) for x in np.cumsum((0,) + primes[:-1]))

    def engram_num_embeddings_of(self, layer: int) -> int:
        """Table rows of Engram layer `layer`: the sum of its primes."""
        return self.engram_num_embeddings[self._engram_slot(layer)]

    def engram_hash_multipliers(self, layer: int) -> tuple[int, ...]:
        """The odd int64 multiplier per lookback k = 0..max_ngram-1 of Engram layer `layer`.

        Drawn from `np.random.default_rng(10007 * layer)` below (int64 max // compressed vocab) // 2, then
        made odd (2v + 1), so token_id * multiplier cannot overflow int64.
        """
        self._engram_slot(layer)
        bound = max(1, (np.iinfo(np.int64).max // self.engram_compressed_vocab_size) // 2)
        values = np.random.default_rng(10007 * layer).integers(
            low=0, high=bound, size=(self.engram_max_ngram_size,), dtype=np.int64
        )
        return tuple(int(v) * 2 + 1 for v in values)

    def engram_rank_rows(self, layer: int, tp: int, rank: int) -> tuple[int, int]:
        """The table rows [start, stop) of `layer` held by `rank`: its hash columns' whole buckets."""
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


# ---- parsing: config.json dict -> constructor arguments -------------------------------------------


def _parse(data: Any) -> dict[str, Any]:
    """Check keys (unknown, missing, fixed-value) and types; return ModelConfig keyword arguments."""
    if not isinstance(data, dict):
        raise TypeError(f"a model config must be a JSON object, got {type(data).__name__}")
    text = _unwrap(data)
    fields = {f.name: f.type for f in dataclasses.fields(ModelConfig)}
    for key in text:
        if key not in fields and key not in IGNORED_KEYS and key not in FIXED_KEYS:
            raise ValueError(
                f"unknown key {key!r}: not a DeepSeek-V4.1 text config key hopdec reads, nor in "
                f"loader.config.IGNORED_KEYS"
            )
    for key, expected in FIXED_KEYS.items():
        if key in text and text[key] != expected:
            raise ValueError(
                f"{key} = {text[key]!r} is not supported: hopdec implements DeepSeek-V4.1 only "
                f"(expected {expected!r})"
            )
    kwargs = {}
    for name, kind in fields.items():
        if name not in text:
            if name in OPTIONAL_KEYS:
                continue
            raise ValueError(f"missing required key {name!r}")
        kwargs[name] = _convert(name, kind, text[name])
    return kwargs


def _unwrap(data: dict[str, Any]) -> dict[str, Any]:
    """The text config: `data` itself, or its `text_config` merged with the wrapper's own keys."""
    if "text_config" not in data:
        return data
    text = data["text_config"]
    if not isinstance(text, dict):
        raise TypeError(f"text_config must be a JSON object, got {type(text).__name__}")
    merged = dict(text)
    for key, value in data.items():
        if key == "text_config" or key in IGNORED_KEYS:
            continue
        if key == "model_type":  # the wrapper's type (deepseek_v41); the text one wins
            _check_model_type(value)
            merged.setdefault(key, value)
        elif key in merged and merged[key] != value:
            raise ValueError(
                f"key {key!r} differs between the wrapper ({value!r}) and text_config ({merged[key]!r})"
            )
        else:
            merged[key] = value
    return merged


def _convert(name: str, kind: str, value: Any) -> Any:
    """Check one JSON value against its field type; JSON lists become tuples."""
    kind = kind.replace(" | None", "")
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an integer, got {value!r}")
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {value!r}")
        return float(value)
    if kind in ("bool", "str"):
        if type(value).__name__ != kind:
            raise TypeError(f"{name} must be a {kind}, got {value!r}")
        return value
    if kind == "tuple[int, ...]":
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{name} must be a list of integers, got {value!r}")
        return tuple(_convert(f"{name}[{i}]", "int", v) for i, v in enumerate(value))
    if kind in ("RopeScaling", "QuantizationConfig"):
        return _convert_section(name, kind, value)
    raise AssertionError(f"no converter for field {name} of type {kind}")


def _convert_section(name: str, kind: str, value: Any) -> Any:
    cls = RopeScaling if kind == "RopeScaling" else QuantizationConfig
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a JSON object, got {value!r}")
    value = dict(value)
    if cls is RopeScaling and "rope_type" in value:  # the newer HF spelling of "type"
        if "type" in value and value["type"] != value["rope_type"]:
            raise ValueError(f"{name}: type {value['type']!r} differs from rope_type {value['rope_type']!r}")
        value["type"] = value.pop("rope_type")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in value:
        if key not in fields:
            raise ValueError(f"unknown key {name}.{key}; expected {sorted(fields)}")
    args = {}
    for key, f in fields.items():
        if key in value:
            args[key] = _convert(f"{name}.{key}", f.type, value[key])
        elif f.default is dataclasses.MISSING:
            raise ValueError(f"missing required key {name}.{key}")
    return cls(**args)


# ---- validation: what hopdec can run ----------------------------------------------------------------


def _check_model_type(value: Any) -> None:
    if value not in MODEL_TYPES:
        raise ValueError(
            f"model_type {value!r} is not supported: hopdec implements DeepSeek-V4.1 only "
            f"(expected one of {MODEL_TYPES})"
        )


def _validate(cfg: ModelConfig) -> None:
    """Raise ValueError naming the key(s), the value and what was expected."""
    _check_model_type(cfg.model_type)
    _check_numerics(cfg)
    _check_widths(cfg)
    _check_topology(cfg)
    _check_extras(cfg)


def _check_numerics(cfg: ModelConfig) -> None:
    q = cfg.quantization_config
    for key in ("quant_method", "activation_scheme", "fmt", "scale_fmt", "weight_block_size", "expert_dtype"):
        got, expected = getattr(q, key), getattr(V41_QUANTIZATION, key)
        if got != expected:
            raise ValueError(
                f"quantization_config.{key} = {_jsonable(got)!r} is not supported: hopdec supports "
                f"V4.1 numerics only (expected {_jsonable(expected)!r})"
            )
    r = cfg.rope_scaling
    if r.type != "yarn" or r.mscale != 0.0:
        raise ValueError(
            f"rope_scaling type {r.type!r} / mscale {r.mscale} is not supported: V4.1 uses YaRN with "
            f"mscale 0"
        )
    for key in ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings"):
        if getattr(r, key) <= 0:
            raise ValueError(f"rope_scaling.{key} = {getattr(r, key)} must be positive")
    expected = {"scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "num_key_value_heads": 1}
    for key, value in expected.items():
        if getattr(cfg, key) != value:
            raise ValueError(
                f"{key} = {getattr(cfg, key)!r} is not supported: hopdec implements V4.1 (expected "
                f"{value!r})"
            )
    for key in ("rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "routed_scaling_factor",
                "swiglu_limit"):
        if not getattr(cfg, key) > 0:
            raise ValueError(f"{key} = {getattr(cfg, key)} must be positive")


def _check_widths(cfg: ModelConfig) -> None:
    positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads",
                "index_head_dim", "index_topk", "candidate_topk_blocks", "candidate_block_size",
                "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "hc_mult",
                "hc_sinkhorn_iters", "max_position_embeddings", "engram_n_heads", "engram_head_dim",
                "engram_vocab_size", "engram_compressed_vocab_size", "dspark_block_size",
                "dspark_markov_rank", "dspark_n_routed_experts", "dspark_num_experts_per_tok",
                "dspark_moe_intermediate_size")
    for key in positive:
        if getattr(cfg, key) <= 0:
            raise ValueError(f"{key} = {getattr(cfg, key)} must be positive")
    for key in ("n_shared_experts", "num_nextn_predict_layers"):
        if getattr(cfg, key) < 0:
            raise ValueError(f"{key} = {getattr(cfg, key)} must be >= 0")
    rope, nope = cfg.qk_rope_head_dim, cfg.head_dim - cfg.qk_rope_head_dim
    if rope <= 0 or rope % 2 or nope <= 0:
        raise ValueError(
            f"qk_rope_head_dim = {rope} must be even and inside head_dim = {cfg.head_dim} "
            f"(head_dim = nope + rope with both positive)"
        )
    blocked = {
        "hidden_size": cfg.hidden_size, "q_lora_rank": cfg.q_lora_rank, "o_lora_rank": cfg.o_lora_rank,
        "qk_rope_head_dim": rope, "head_dim - qk_rope_head_dim (nope)": nope,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "dspark_moe_intermediate_size": cfg.dspark_moe_intermediate_size,
        "index_head_dim": cfg.index_head_dim, "engram_head_dim": cfg.engram_head_dim,
        "vocab_size": cfg.vocab_size,
    }
    for key, value in blocked.items():
        if value % QUANT_BLOCK:
            raise ValueError(
                f"{key} = {value} is not a multiple of {QUANT_BLOCK}: the FP8 32x32 and MXFP4/32 "
                f"scale blocks would straddle it"
            )
    if cfg.num_attention_heads % cfg.o_groups:
        raise ValueError(
            f"o_groups = {cfg.o_groups} does not divide num_attention_heads = {cfg.num_attention_heads}"
        )
    for top, total in (("num_experts_per_tok", "n_routed_experts"),
                       ("dspark_num_experts_per_tok", "dspark_n_routed_experts")):
        if getattr(cfg, top) > getattr(cfg, total):
            raise ValueError(f"{top} = {getattr(cfg, top)} exceeds {total} = {getattr(cfg, total)}")


def _check_ids(key: str, ids: tuple[int, ...], limit: int) -> None:
    if list(ids) != sorted(set(ids)):
        raise ValueError(f"{key} = {list(ids)} must be strictly increasing")
    for i in ids:
        if not 0 <= i < limit:
            raise ValueError(f"{key} = {list(ids)}: layer {i} is outside 0..{limit - 1}")


def _check_topology(cfg: ModelConfig) -> None:
    L, ratios = cfg.num_hidden_layers, cfg.compress_ratios
    if len(ratios) != cfg.num_layers_total:
        raise ValueError(
            f"compress_ratios has {len(ratios)} entries; expected num_hidden_layers + "
            f"num_nextn_predict_layers = {L} + {cfg.num_nextn_predict_layers} = {cfg.num_layers_total}"
        )
    bad = [(i, r) for i, r in enumerate(ratios) if r not in SUPPORTED_RATIOS]
    if bad:
        raise ValueError(
            f"compress_ratios: (layer, ratio) {bad} are not V4.1 ratios; expected values in "
            f"{SUPPORTED_RATIOS}"
        )
    drafts = [i for i in range(L, cfg.num_layers_total) if ratios[i]]
    if drafts:
        raise ValueError(f"compress_ratios: DSpark stages {drafts} must be 0 (SWA only)")
    kv, index = cfg.kv_source_layer_ids, cfg.index_source_layer_ids
    _check_ids("kv_source_layer_ids", kv, L)
    _check_ids("index_source_layer_ids", index, L)
    for key, ids in (("kv_source_layer_ids", kv), ("index_source_layer_ids", index)):
        flat = [i for i in ids if ratios[i] == 0]
        if flat:
            raise ValueError(f"{key}: layers {flat} are not compressed layers (compress_ratios 0)")
    missing = [i for i in kv if i not in index]
    if missing:
        raise ValueError(
            f"kv_source_layer_ids {missing} are not in index_source_layer_ids {list(index)}: every kv "
            f"source owns index keys and must run an indexer"
        )
    orphans = [i for i in range(L) if ratios[i] and cfg._latest_source(kv, i) is None]
    if orphans:
        raise ValueError(
            f"compressed layers {orphans} have no kv source at or below them with the same ratio "
            f"(kv_source_layer_ids {list(kv)}, compress_ratios {list(ratios[:L])})"
        )
    cand = cfg.candidate_source_layer_id
    if cand not in kv or ratios[cand] != 1:
        raise ValueError(
            f"candidate_source_layer_id = {cand} must be a ratio-1 kv source "
            f"(kv_source_layer_ids {list(kv)})"
        )
    reach = cfg.candidate_topk_blocks * cfg.candidate_block_size - (cfg.candidate_block_size - 1)
    if reach < cfg.index_topk:
        raise ValueError(
            f"candidate_topk_blocks * candidate_block_size - (candidate_block_size - 1) = "
            f"{cfg.candidate_topk_blocks} * {cfg.candidate_block_size} - "
            f"{cfg.candidate_block_size - 1} = {reach} < index_topk = {cfg.index_topk}: the candidates "
            f"cannot always hold a full top-k"
        )


def _check_extras(cfg: ModelConfig) -> None:
    L = cfg.num_hidden_layers
    _check_ids("engram_layer_ids", cfg.engram_layer_ids, L)
    if cfg.engram_max_ngram_size < 2:
        raise ValueError(f"engram_max_ngram_size = {cfg.engram_max_ngram_size} must be >= 2")
    if not 0 <= cfg.engram_pad_token_id < cfg.vocab_size:
        raise ValueError(
            f"engram_pad_token_id = {cfg.engram_pad_token_id} is outside the vocabulary 0..{cfg.vocab_size - 1}"
        )
    if len(cfg.dspark_target_layer_ids) != cfg.num_nextn_predict_layers:
        raise ValueError(
            f"dspark_target_layer_ids {list(cfg.dspark_target_layer_ids)} has "
            f"{len(cfg.dspark_target_layer_ids)} entries; expected num_nextn_predict_layers = "
            f"{cfg.num_nextn_predict_layers} (one aux state per DSpark stage)"
        )
    _check_ids("dspark_target_layer_ids", cfg.dspark_target_layer_ids, L)
    if not 0 <= cfg.dspark_noise_token_id < cfg.vocab_size:
        raise ValueError(
            f"dspark_noise_token_id = {cfg.dspark_noise_token_id} is outside the vocabulary "
            f"0..{cfg.vocab_size - 1}"
        )
    if cfg.engram_num_embeddings is not None and len(cfg.engram_num_embeddings) != len(cfg.engram_layer_ids):
        raise ValueError(
            f"engram_num_embeddings {list(cfg.engram_num_embeddings)} needs one entry per "
            f"engram_layer_ids {list(cfg.engram_layer_ids)}"
        )
