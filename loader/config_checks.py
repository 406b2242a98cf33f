"""Checks behind `loader.config`: config.json keys and types, and what hopdec can run.

`parse` turns a config.json dict (flat, or multimodal with `text_config`) into ModelConfig keyword
arguments, rejecting unknown, missing and mistyped keys. `validate` rejects configs hopdec cannot
run: anything but V4.1 numerics, widths that break the 32-blocked FP8/MXFP4 scales, and
cache-sharing topologies that the layer-role rule of model doc §1.2 cannot resolve. Every error
names the key(s), the value and what was expected.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

QUANT_BLOCK = 32  # FP8 weights: UE8M0 per 32x32 block; MXFP4 experts: UE8M0 per 32 along K
SUPPORTED_RATIOS = (0, 1, 2)  # V4.1: SWA only, ratio 1 (C1A), ratio 2 (C2A); V4's 4/128 are not
MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")
NO_CANDIDATE_SOURCE = -1  # candidate_source_layer_id of a config without the two-level indexer

# The only quantization hopdec implements (model doc §1.1, humming-formats §2).
V41_QUANTIZATION = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "weight_block_size": (32, 32),
    "expert_dtype": "fp4",
}

# Keys that may appear in a config.json but carry nothing hopdec reads (the vision tower, the
# multimodal wrapper, HF bookkeeping). Any other key that is not a ModelConfig field is an error.
IGNORED_KEYS = {
    "architectures": "HF class names",
    "auto_map": "HF remote-code class paths",
    "transformers_version": "HF bookkeeping",
    "torch_dtype": "HF default dtype; hopdec's dtypes are fixed per tensor",
    "dtype": "HF default dtype (newer transformers spelling)",
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
    "expert_dtype": "fp4",  # a copy of quantization_config.expert_dtype in some configs
}

# Keys that may be absent: ModelConfig derives them from the others.
OPTIONAL_KEYS = ("engram_num_embeddings", "dspark_moe_intermediate_size")


def latest_source(ratios: tuple[int, ...], sources: tuple[int, ...], index: int) -> int | None:
    """The most recent layer of `sources` at or below `index` with the same compress ratio."""
    found = [s for s in sources if s <= index and ratios[s] == ratios[index]]
    return max(found) if found else None


def _json(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


# ---- parsing: config.json dict -> constructor arguments ------------------------------------------


def parse(data: Any, cls: type) -> dict[str, Any]:
    """Check keys (unknown, missing, fixed-value) and types; return `cls` keyword arguments."""
    if not isinstance(data, dict):
        raise TypeError(f"a model config must be a JSON object, got {type(data).__name__}")
    text = _unwrap(data)
    hints = typing.get_type_hints(cls)
    for key in text:
        if key not in hints and key not in IGNORED_KEYS and key not in FIXED_KEYS:
            raise ValueError(
                f"unknown key {key!r}: not a DeepSeek-V4.1 text config key that hopdec reads, "
                f"nor in loader.config_checks.IGNORED_KEYS"
            )
    for key, expected in FIXED_KEYS.items():
        if key in text and text[key] != expected:
            raise ValueError(
                f"{key} = {text[key]!r} is not supported: hopdec implements DeepSeek-V4.1 only "
                f"(expected {expected!r})"
            )
    kwargs = {}
    for name, hint in hints.items():
        if name in text:
            kwargs[name] = _convert(name, hint, text[name])
        elif name not in OPTIONAL_KEYS:
            raise ValueError(f"missing required key {name!r}")
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
            check_model_type(value)
            merged.setdefault(key, value)
        elif key in merged and merged[key] != value:
            raise ValueError(
                f"key {key!r} differs between the wrapper ({value!r}) and text_config "
                f"({merged[key]!r})"
            )
        else:
            merged[key] = value
    return merged


def _convert(name: str, hint: Any, value: Any) -> Any:
    """Check one JSON value against its field's type; JSON lists become tuples."""
    if isinstance(hint, types.UnionType):  # `X | None`: None only means "absent"
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    if hint is int or hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float) if hint is float else int):
            raise TypeError(f"{name} must be {'a number' if hint is float else 'an integer'}, "
                            f"got {value!r}")
        return hint(value)
    if hint is bool or hint is str:
        if type(value) is not hint:
            raise TypeError(f"{name} must be a {hint.__name__}, got {value!r}")
        return value
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{name} must be a list of integers, got {value!r}")
        return tuple(_convert(f"{name}[{i}]", int, v) for i, v in enumerate(value))
    if dataclasses.is_dataclass(hint):
        return _convert_section(name, hint, value)
    raise AssertionError(f"no converter for field {name} of type {hint}")


def _convert_section(name: str, cls: type, value: Any) -> Any:
    """A nested object (rope_scaling, quantization_config) into its frozen dataclass."""
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a JSON object, got {value!r}")
    value = dict(value)
    if "rope_type" in value:  # the newer HF spelling of rope_scaling.type
        if "type" in value and value["type"] != value["rope_type"]:
            raise ValueError(
                f"{name}: type {value['type']!r} differs from rope_type {value['rope_type']!r}"
            )
        value["type"] = value.pop("rope_type")
    hints = typing.get_type_hints(cls)
    for key in value:
        if key not in hints:
            raise ValueError(f"unknown key {name}.{key}; expected {sorted(hints)}")
    defaults = {f.name for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    for key in hints:
        if key not in value and key not in defaults:
            raise ValueError(f"missing required key {name}.{key}")
    return cls(**{key: _convert(f"{name}.{key}", hints[key], v) for key, v in value.items()})


# ---- validation: what hopdec can run -------------------------------------------------------------


def check_model_type(value: Any) -> None:
    if value not in MODEL_TYPES:
        raise ValueError(
            f"model_type {value!r} is not supported: hopdec implements DeepSeek-V4.1 only "
            f"(expected one of {MODEL_TYPES})"
        )


def validate(cfg: Any) -> None:
    """Raise ValueError naming the key(s), the value and what was expected."""
    check_model_type(cfg.model_type)
    _check_numerics(cfg)
    _check_widths(cfg)
    _check_topology(cfg)
    _check_extras(cfg)


def _unsupported(key: str, value: Any, expected: Any) -> ValueError:
    return ValueError(
        f"{key} = {_json(value)!r} is not supported: hopdec supports V4.1 numerics only "
        f"(expected {_json(expected)!r})"
    )


def _check_numerics(cfg: Any) -> None:
    for key, expected in V41_QUANTIZATION.items():
        if getattr(cfg.quantization_config, key) != expected:
            raise _unsupported(f"quantization_config.{key}",
                               getattr(cfg.quantization_config, key), expected)
    rope = cfg.rope_scaling
    for key, expected in (("type", "yarn"), ("mscale", 0.0)):
        if getattr(rope, key) != expected:
            raise _unsupported(f"rope_scaling.{key}", getattr(rope, key), expected)
    for key in ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings"):
        if not getattr(rope, key) > 0:
            raise ValueError(f"rope_scaling.{key} = {getattr(rope, key)} must be positive")
    fixed = {"scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "num_key_value_heads": 1}
    for key, expected in fixed.items():
        if getattr(cfg, key) != expected:
            raise _unsupported(key, getattr(cfg, key), expected)
    for key in ("rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta",
                "routed_scaling_factor", "swiglu_limit"):
        if not getattr(cfg, key) > 0:
            raise ValueError(f"{key} = {getattr(cfg, key)} must be positive")


_POSITIVE = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
    "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim",
    "index_topk", "candidate_topk_blocks", "candidate_block_size", "n_routed_experts",
    "num_experts_per_tok", "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters",
    "max_position_embeddings", "engram_n_heads", "engram_head_dim", "engram_vocab_size",
    "engram_compressed_vocab_size", "dspark_block_size", "dspark_markov_rank",
    "dspark_n_routed_experts", "dspark_num_experts_per_tok", "dspark_moe_intermediate_size",
)


def _check_widths(cfg: Any) -> None:
    for key in _POSITIVE:
        if getattr(cfg, key) <= 0:
            raise ValueError(f"{key} = {getattr(cfg, key)} must be positive")
    for key in ("n_shared_experts", "num_nextn_predict_layers"):
        if getattr(cfg, key) < 0:
            raise ValueError(f"{key} = {getattr(cfg, key)} must be >= 0")
    rope, nope = cfg.qk_rope_head_dim, cfg.head_dim - cfg.qk_rope_head_dim
    if rope <= 0 or rope % 2 or nope <= 0:
        raise ValueError(
            f"qk_rope_head_dim = {rope} must be even and inside head_dim = {cfg.head_dim} "
            f"(head_dim = nope + rope, both positive)"
        )
    blocked = {
        "hidden_size": cfg.hidden_size,
        "q_lora_rank": cfg.q_lora_rank,
        "o_lora_rank": cfg.o_lora_rank,
        "qk_rope_head_dim": rope,
        "head_dim - qk_rope_head_dim (nope)": nope,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "dspark_moe_intermediate_size": cfg.dspark_moe_intermediate_size,
        "index_head_dim": cfg.index_head_dim,
        "engram_head_dim": cfg.engram_head_dim,
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
            f"o_groups = {cfg.o_groups} does not divide num_attention_heads = "
            f"{cfg.num_attention_heads}"
        )
    for top, total in (("num_experts_per_tok", "n_routed_experts"),
                       ("dspark_num_experts_per_tok", "dspark_n_routed_experts")):
        if getattr(cfg, top) > getattr(cfg, total):
            raise ValueError(
                f"{top} = {getattr(cfg, top)} exceeds {total} = {getattr(cfg, total)}"
            )


def _check_ids(key: str, ids: tuple[int, ...], limit: int) -> None:
    if list(ids) != sorted(set(ids)):
        raise ValueError(f"{key} = {list(ids)} must be strictly increasing")
    for i in ids:
        if not 0 <= i < limit:
            raise ValueError(f"{key} = {list(ids)}: layer {i} is outside 0..{limit - 1}")


def _check_ratios(cfg: Any) -> None:
    ratios, total = cfg.compress_ratios, cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    if len(ratios) != total:
        raise ValueError(
            f"compress_ratios has {len(ratios)} entries; expected num_hidden_layers + "
            f"num_nextn_predict_layers = {cfg.num_hidden_layers} + "
            f"{cfg.num_nextn_predict_layers} = {total}"
        )
    bad = [(i, r) for i, r in enumerate(ratios) if r not in SUPPORTED_RATIOS]
    if bad:
        raise ValueError(
            f"compress_ratios: (layer, ratio) {bad} are not V4.1 ratios; expected values in "
            f"{SUPPORTED_RATIOS}"
        )
    drafts = [i for i in range(cfg.num_hidden_layers, total) if ratios[i]]
    if drafts:
        raise ValueError(f"compress_ratios: DSpark stages {drafts} must be 0 (SWA only)")


def _check_topology(cfg: Any) -> None:
    _check_ratios(cfg)
    num_layers, ratios = cfg.num_hidden_layers, cfg.compress_ratios
    kv, index = cfg.kv_source_layer_ids, cfg.index_source_layer_ids
    _check_ids("kv_source_layer_ids", kv, num_layers)
    _check_ids("index_source_layer_ids", index, num_layers)
    for key, ids in (("kv_source_layer_ids", kv), ("index_source_layer_ids", index)):
        flat = [i for i in ids if ratios[i] == 0]
        if flat:
            raise ValueError(f"{key}: layers {flat} are not compressed (compress_ratios 0)")
    missing = [i for i in kv if i not in index]
    if missing:
        raise ValueError(
            f"kv_source_layer_ids {missing} are not in index_source_layer_ids {list(index)}: "
            f"every kv source owns index keys and must run an indexer"
        )
    orphans = [i for i in range(num_layers) if ratios[i] and latest_source(ratios, kv, i) is None]
    if orphans:
        raise ValueError(
            f"compressed layers {orphans} have no kv source at or below them with the same ratio "
            f"(kv_source_layer_ids {list(kv)}, compress_ratios {list(ratios[:num_layers])})"
        )
    cand = cfg.candidate_source_layer_id
    if cand == NO_CANDIDATE_SOURCE:  # no two-level indexer: every indexer scans all entries
        return
    if cand not in kv or ratios[cand] != 1:
        raise ValueError(
            f"candidate_source_layer_id = {cand} must be a ratio-1 kv source "
            f"(kv_source_layer_ids {list(kv)}) or {NO_CANDIDATE_SOURCE} for none"
        )
    blocks, size = cfg.candidate_topk_blocks, cfg.candidate_block_size
    reach = blocks * size - (size - 1)
    if reach < cfg.index_topk:
        raise ValueError(
            f"candidate_topk_blocks * candidate_block_size - (candidate_block_size - 1) = "
            f"{blocks} * {size} - {size - 1} = {reach} < index_topk = {cfg.index_topk}: the "
            f"candidate blocks cannot always hold a full top-k"
        )


def _check_extras(cfg: Any) -> None:
    num_layers = cfg.num_hidden_layers
    _check_ids("engram_layer_ids", cfg.engram_layer_ids, num_layers)
    if cfg.engram_max_ngram_size < 2:
        raise ValueError(f"engram_max_ngram_size = {cfg.engram_max_ngram_size} must be >= 2")
    if (cfg.engram_num_embeddings is not None
            and len(cfg.engram_num_embeddings) != len(cfg.engram_layer_ids)):
        raise ValueError(
            f"engram_num_embeddings {list(cfg.engram_num_embeddings)} needs one entry per "
            f"engram_layer_ids {list(cfg.engram_layer_ids)}"
        )
    for key in ("engram_pad_token_id", "dspark_noise_token_id"):
        if not 0 <= getattr(cfg, key) < cfg.vocab_size:
            raise ValueError(
                f"{key} = {getattr(cfg, key)} is outside the vocabulary 0..{cfg.vocab_size - 1}"
            )
    targets = cfg.dspark_target_layer_ids
    if len(targets) != cfg.num_nextn_predict_layers:
        raise ValueError(
            f"dspark_target_layer_ids {list(targets)} has {len(targets)} entries; expected "
            f"num_nextn_predict_layers = {cfg.num_nextn_predict_layers} (one per DSpark stage)"
        )
    _check_ids("dspark_target_layer_ids", targets, num_layers)
