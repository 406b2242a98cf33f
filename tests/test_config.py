"""ModelConfig: presets, JSON round trips, key errors and every validation rule."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader.config import ModelConfig, QuantizationConfig, RopeScaling
from loader.config_checks import IGNORED_KEYS

REAL = ModelConfig.preset("v41-flash")
TINY = ModelConfig.preset("tiny")


def _tiny_dict() -> dict:
    return TINY.to_dict()


def _raises(data: dict, *needles: str, exc: type[Exception] = ValueError) -> str:
    """from_dict(data) must raise `exc` whose message holds every needle and the source name."""
    with pytest.raises(exc) as info:
        ModelConfig.from_dict(data, source="cfg.json")
    message = str(info.value)
    assert message.startswith("cfg.json: "), message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


# ---- presets: the numbers of model doc §1.1 and §5 -----------------------------------------------


def test_v41_flash_preset_matches_the_model_doc():
    c = REAL
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers) == (129280, 5120, 40)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.qk_rope_head_dim) == (
        64,
        1,
        512,
        64,
    )
    assert (c.q_lora_rank, c.o_groups, c.o_lora_rank, c.sliding_window) == (1280, 8, 1024, 128)
    assert c.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20 + (0,) * 3
    assert c.kv_source_layer_ids == (2, 8, 14, 20)
    assert c.index_source_layer_ids == (2, 8, 14, 20, 24, 28, 32, 36)
    assert (c.candidate_source_layer_id, c.candidate_topk_blocks, c.candidate_block_size) == (
        20,
        2048,
        8,
    )
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (32, 128, 512)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts) == (384, 6, 1)
    assert c.moe_intermediate_size == c.dspark_moe_intermediate_size == 2304
    assert (c.scoring_func, c.topk_method, c.norm_topk_prob) == ("sqrtsoftplus", "noaux_tc", True)
    assert (c.routed_scaling_factor, c.swiglu_limit) == (1.5, 10.0)
    assert (c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps) == (4, 20, 1e-6, 1e-20)
    assert (c.rope_theta, c.compress_rope_theta, c.max_position_embeddings) == (1e4, 1.6e5, 1048576)
    assert c.rope_scaling == RopeScaling("yarn", 16.0, 65536, 32.0, 1.0, 0.0)
    assert c.engram_layer_ids == (1, 14)
    assert (c.engram_max_ngram_size, c.engram_n_heads, c.engram_head_dim) == (4, 8, 256)
    assert (c.engram_vocab_size, c.engram_compressed_vocab_size, c.engram_pad_token_id) == (
        16_000_000,
        99092,
        2,
    )
    assert (c.num_nextn_predict_layers, c.dspark_block_size, c.dspark_noise_token_id) == (
        3,
        5,
        128799,
    )
    assert c.dspark_target_layer_ids == (37, 38, 39)
    assert (c.dspark_markov_rank, c.dspark_n_routed_experts, c.dspark_num_experts_per_tok) == (
        256,
        128,
        3,
    )
    assert c.tie_word_embeddings is False
    assert c.quantization_config == QuantizationConfig(
        "fp8", "dynamic", "e4m3", "ue8m0", (32, 32), "fp4"
    )


def test_derived_numbers():
    assert (REAL.qk_nope_head_dim, REAL.heads_per_group, REAL.o_group_in_dim) == (448, 8, 4096)
    assert (REAL.hc_mix_dim, REAL.num_layers_total, REAL.engram_num_hash_cols) == (24, 43, 24)
    assert (TINY.qk_nope_head_dim, TINY.heads_per_group, TINY.o_group_in_dim) == (448, 2, 1024)
    assert (TINY.hc_mix_dim, TINY.num_layers_total, TINY.engram_num_hash_cols) == (24, 13, 24)


def test_tiny_preset_matches_the_model_doc():
    c = TINY
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads) == (
        1024,
        256,
        10,
        16,
    )
    assert (c.head_dim, c.qk_rope_head_dim, c.q_lora_rank, c.o_groups, c.o_lora_rank) == (
        512,
        64,
        256,
        8,
        128,
    )
    assert c.sliding_window == 16
    assert c.compress_ratios == (0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0)
    assert (c.kv_source_layer_ids, c.index_source_layer_ids) == ((2, 4, 6), (2, 4, 6, 8))
    assert (c.candidate_source_layer_id, c.candidate_topk_blocks, c.candidate_block_size) == (
        6,
        4,
        8,
    )
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (4, 128, 16)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (16, 6, 384)
    assert (c.engram_layer_ids, c.engram_head_dim, c.engram_vocab_size) == ((1, 4), 32, 1000)
    assert (c.engram_compressed_vocab_size, c.engram_pad_token_id) == (1024, 2)
    assert (c.dspark_noise_token_id, c.dspark_target_layer_ids, c.dspark_markov_rank) == (
        1023,
        (7, 8, 9),
        32,
    )
    assert (c.dspark_n_routed_experts, c.dspark_num_experts_per_tok) == (8, 3)
    assert (
        c.rope_scaling.original_max_position_embeddings == 64 and c.max_position_embeddings == 1024
    )


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown preset 'v4'.*tiny.*v41-flash"):
        ModelConfig.preset("v4")
    with pytest.raises(ValueError, match="unknown preset '../presets/tiny'"):
        ModelConfig.preset("../presets/tiny")


# ---- JSON round trips and the multimodal wrapper -------------------------------------------------


@pytest.mark.parametrize("cfg", [REAL, TINY], ids=["v41-flash", "tiny"])
def test_json_round_trip(cfg, tmp_path):
    path = tmp_path / "config.json"
    cfg.to_json(path)
    again = ModelConfig.from_json(path)
    assert again == cfg and hash(again) == hash(cfg)  # usable as a cache key
    assert json.loads(path.read_text()) == cfg.to_dict() == again.to_dict()


def test_multimodal_wrapper_is_accepted(tmp_path):
    text = REAL.to_dict()
    quant = text.pop("quantization_config")
    text["model_type"] = "deepseek_v41_text"
    wrapped = {
        "model_type": "deepseek_v41",
        "architectures": ["DeepseekV41ForCausalLM"],
        "text_config": text,
        "vision_config": {"model_type": "deepseek_v41_vision", "num_hidden_layers": 32},
        "quantization_config": quant,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.0",
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(wrapped))
    cfg = ModelConfig.from_json(path)
    assert cfg.model_type == "deepseek_v41_text"
    assert dataclass_fields_equal(cfg, REAL, skip={"model_type"})


def dataclass_fields_equal(a: ModelConfig, b: ModelConfig, skip: set[str]) -> bool:
    da, db = a.to_dict(), b.to_dict()
    return {k: v for k, v in da.items() if k not in skip} == {
        k: v for k, v in db.items() if k not in skip
    }


def test_wrapper_and_text_config_must_agree():
    text = _tiny_dict()
    _raises({"text_config": text, "vocab_size": 2048}, "'vocab_size'", "2048", "1024")
    _raises({"text_config": text, "model_type": "deepseek_v4"}, "model_type 'deepseek_v4'", "V4.1")
    _raises({"text_config": [1]}, "text_config must be a JSON object", exc=TypeError)


def test_ignored_keys_are_accepted_in_a_flat_config():
    data = _tiny_dict()
    data.update({key: None for key in IGNORED_KEYS})
    assert ModelConfig.from_dict(data) == TINY


def test_optional_keys_default_from_the_others():
    data = _tiny_dict()
    del data["dspark_moe_intermediate_size"], data["engram_num_embeddings"]
    cfg = ModelConfig.from_dict(data)
    assert cfg.dspark_moe_intermediate_size == 384
    assert cfg.engram_num_embeddings == TINY.engram_num_embeddings


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json: model config not found"):
        ModelConfig.from_json(tmp_path / "nope.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{ not json")
    with pytest.raises(ValueError, match="broken.json: not a valid JSON file"):
        ModelConfig.from_json(broken)
    listing = tmp_path / "list.json"
    listing.write_text("[]")
    with pytest.raises(TypeError, match="list.json: a model config must be a JSON object"):
        ModelConfig.from_json(listing)


# ---- key-level errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    [k for k in _tiny_dict() if k not in ("engram_num_embeddings", "dspark_moe_intermediate_size")],
)
def test_every_missing_required_key_is_named(key, tmp_path):
    data = _tiny_dict()
    del data[key]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"config.json: missing required key '{key}'"):
        ModelConfig.from_json(path)


def test_unknown_keys_are_named():
    _raises({**_tiny_dict(), "kv_lora_rank": 512}, "unknown key 'kv_lora_rank'")
    data = _tiny_dict()
    data["rope_scaling"]["mscale_all_dim"] = 1.0
    _raises(data, "unknown key rope_scaling.mscale_all_dim")
    data = _tiny_dict()
    data["quantization_config"]["modules_to_not_convert"] = []
    _raises(data, "unknown key quantization_config.modules_to_not_convert")


def test_fixed_value_keys():
    assert (
        ModelConfig.from_dict({**_tiny_dict(), "num_hash_layers": 0, "hidden_act": "silu"}) == TINY
    )
    _raises({**_tiny_dict(), "num_hash_layers": 3}, "num_hash_layers = 3", "V4.1")
    _raises({**_tiny_dict(), "expert_dtype": "fp8"}, "expert_dtype = 'fp8'")


@pytest.mark.parametrize(
    "key, value",
    [
        ("hidden_size", 256.0),
        ("hidden_size", "256"),
        ("hidden_size", True),
        ("norm_topk_prob", 1),
        ("scoring_func", 3),
        ("rms_norm_eps", "1e-20"),
        ("compress_ratios", 2),
        ("engram_layer_ids", [1, 4.0]),
        ("rope_scaling", [16]),
        ("quantization_config", "fp8"),
    ],
)
def test_wrong_types_are_named(key, value):
    _raises({**_tiny_dict(), key: value}, key, exc=TypeError)


def test_rope_type_alias():
    data = _tiny_dict()
    data["rope_scaling"]["rope_type"] = data["rope_scaling"].pop("type")
    assert ModelConfig.from_dict(data) == TINY
    data["rope_scaling"]["type"] = "linear"
    _raises(data, "rope_scaling: type 'linear' differs from rope_type 'yarn'")


# ---- validation: every rule raises with the key in the message -----------------------------------


def _set(**changes):
    def mutate(d):
        d.update(changes)

    return mutate


def _set_in(section, **changes):
    def mutate(d):
        d[section].update(changes)

    return mutate


def _ratios(ratios, kv=None, index=None):
    def mutate(d):
        d["compress_ratios"] = ratios
        if kv is not None:
            d["kv_source_layer_ids"] = kv
        if index is not None:
            d["index_source_layer_ids"] = index

    return mutate


TINY_RATIOS = [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0]

INVALID = {
    "ratios too short": (_ratios(TINY_RATIOS[:-1]), ["compress_ratios has 12 entries", "= 13"]),
    "ratio 4 (V4 CSA)": (
        _ratios(TINY_RATIOS[:3] + [4] + TINY_RATIOS[4:]),
        ["compress_ratios", "(3, 4)", "(0, 1, 2)"],
    ),
    "compressed DSpark stage": (_ratios(TINY_RATIOS[:-1] + [1]), ["DSpark stages [12]"]),
    "kv source out of range": (
        _set(kv_source_layer_ids=[2, 4, 6, 10]),
        ["kv_source_layer_ids", "layer 10 is outside 0..9"],
    ),
    "kv source not increasing": (
        _set(kv_source_layer_ids=[4, 2, 6]),
        ["kv_source_layer_ids = [4, 2, 6] must be strictly increasing"],
    ),
    "index source negative": (
        _set(index_source_layer_ids=[-1, 2, 4, 6, 8]),
        ["index_source_layer_ids", "layer -1 is outside"],
    ),
    "kv source not compressed": (
        _set(kv_source_layer_ids=[1, 2, 4, 6], index_source_layer_ids=[1, 2, 4, 6, 8]),
        ["kv_source_layer_ids: layers [1] are not compressed"],
    ),
    "index source not compressed": (
        _set(index_source_layer_ids=[0, 2, 4, 6, 8]),
        ["index_source_layer_ids: layers [0] are not compressed"],
    ),
    "kv source without indexer": (
        _set(index_source_layer_ids=[2, 6, 8]),
        ["kv_source_layer_ids [4] are not in index_source_layer_ids"],
    ),
    "compressed layer without kv source": (
        _set(kv_source_layer_ids=[4, 6], index_source_layer_ids=[4, 6, 8]),
        ["compressed layers [2, 3] have no kv source"],
    ),
    "candidate source ratio 2": (
        _set(candidate_source_layer_id=4),
        ["candidate_source_layer_id = 4 must be a ratio-1 kv source"],
    ),
    "candidate source not kv": (
        _set(candidate_source_layer_id=8),
        ["candidate_source_layer_id = 8"],
    ),
    "candidates shorter than top-k": (
        _set(candidate_topk_blocks=2),
        ["candidate_topk_blocks * candidate_block_size", "= 9 < index_topk = 16"],
    ),
    "hidden not 32-blocked": (_set(hidden_size=250), ["hidden_size = 250 is not a multiple of 32"]),
    "q_lora not 32-blocked": (_set(q_lora_rank=100), ["q_lora_rank = 100"]),
    "o_lora not 32-blocked": (_set(o_lora_rank=120), ["o_lora_rank = 120"]),
    "moe inter not 32-blocked": (
        _set(moe_intermediate_size=400),
        ["moe_intermediate_size = 400 is not a multiple of 32"],
    ),
    "dspark inter not 32-blocked": (
        _set(dspark_moe_intermediate_size=400),
        ["dspark_moe_intermediate_size = 400"],
    ),
    "index dim not 32-blocked": (_set(index_head_dim=100), ["index_head_dim = 100"]),
    "engram dim not 32-blocked": (_set(engram_head_dim=48), ["engram_head_dim = 48"]),
    "vocab not 32-blocked": (_set(vocab_size=1000), ["vocab_size = 1000 is not a multiple of 32"]),
    "rope not 32-blocked": (_set(qk_rope_head_dim=66), ["qk_rope_head_dim = 66"]),
    "rope odd": (_set(qk_rope_head_dim=63), ["qk_rope_head_dim = 63 must be even"]),
    "rope is all of head_dim": (_set(qk_rope_head_dim=512), ["inside head_dim = 512"]),
    "nope not 32-blocked": (_set(head_dim=500), ["head_dim - qk_rope_head_dim (nope) = 436"]),
    "o_groups does not divide heads": (
        _set(o_groups=3),
        ["o_groups = 3 does not divide num_attention_heads = 16"],
    ),
    "top-k above experts": (_set(num_experts_per_tok=17), ["num_experts_per_tok = 17 exceeds"]),
    "dspark top-k above experts": (
        _set(dspark_num_experts_per_tok=9),
        ["dspark_num_experts_per_tok = 9 exceeds"],
    ),
    "dspark targets vs stages": (
        _set(dspark_target_layer_ids=[8, 9]),
        ["dspark_target_layer_ids [8, 9] has 2 entries", "num_nextn_predict_layers = 3"],
    ),
    "dspark target out of range": (
        _set(dspark_target_layer_ids=[8, 9, 10]),
        ["dspark_target_layer_ids", "layer 10 is outside 0..9"],
    ),
    "engram layer out of range": (
        _set(engram_layer_ids=[1, 10]),
        ["engram_layer_ids", "layer 10 is outside"],
    ),
    "engram rows not the prime walk": (
        _set(engram_num_embeddings=[25874, 30000]),
        ["engram_num_embeddings [25874, 30000] does not match", "[25874, 30058]"],
    ),
    "engram rows per layer": (
        _set(engram_num_embeddings=[25874]),
        ["engram_num_embeddings [25874] needs one entry per"],
    ),
    "engram unigram only": (_set(engram_max_ngram_size=1), ["engram_max_ngram_size = 1"]),
    "engram pad outside vocab": (
        _set(engram_pad_token_id=1024),
        ["engram_pad_token_id = 1024 is outside the vocabulary"],
    ),
    "noise token outside vocab": (_set(dspark_noise_token_id=-1), ["dspark_noise_token_id = -1"]),
    "block 128x128 (V4)": (
        _set_in("quantization_config", weight_block_size=[128, 128]),
        ["quantization_config.weight_block_size = [128, 128]", "V4.1 numerics only", "[32, 32]"],
    ),
    "scale e4m3": (
        _set_in("quantization_config", scale_fmt="e4m3"),
        ["quantization_config.scale_fmt = 'e4m3'", "V4.1 numerics only"],
    ),
    "fp8 experts": (
        _set_in("quantization_config", expert_dtype="fp8"),
        ["quantization_config.expert_dtype = 'fp8'"],
    ),
    "quant method": (
        _set_in("quantization_config", quant_method="mxfp4"),
        ["quantization_config.quant_method = 'mxfp4'"],
    ),
    "weight format": (
        _set_in("quantization_config", fmt="e5m2"),
        ["quantization_config.fmt = 'e5m2'"],
    ),
    "static activations": (
        _set_in("quantization_config", activation_scheme="static"),
        ["quantization_config.activation_scheme = 'static'"],
    ),
    "rope not yarn": (_set_in("rope_scaling", type="linear"), ["rope_scaling.type = 'linear'"]),
    "yarn mscale": (_set_in("rope_scaling", mscale=1.0), ["rope_scaling.mscale = 1.0"]),
    "yarn factor": (
        _set_in("rope_scaling", factor=0),
        ["rope_scaling.factor = 0.0 must be positive"],
    ),
    "softmax routing": (_set(scoring_func="softmax"), ["scoring_func = 'softmax'"]),
    "greedy top-k": (_set(topk_method="greedy"), ["topk_method = 'greedy'"]),
    "two kv heads": (_set(num_key_value_heads=2), ["num_key_value_heads = 2"]),
    "zero eps": (_set(rms_norm_eps=0.0), ["rms_norm_eps = 0.0 must be positive"]),
    "zero window": (_set(sliding_window=0), ["sliding_window = 0 must be positive"]),
    "V4 model type": (_set(model_type="deepseek_v4"), ["model_type 'deepseek_v4'"]),
}


@pytest.mark.parametrize("name", list(INVALID))
def test_invalid_config_raises_naming_the_key(name):
    mutate, needles = INVALID[name]
    data = _tiny_dict()
    mutate(data)
    _raises(data, *needles)


def test_direct_construction_is_validated_too():
    kwargs = {f: getattr(TINY, f) for f in TINY.__dataclass_fields__}
    ModelConfig(**kwargs)
    with pytest.raises(ValueError, match="o_groups = 5"):
        ModelConfig(**{**kwargs, "o_groups": 5})


@st.composite
def _invalid_ratios(draw):
    """Either a wrong length of valid ratios, or the right length with one bad value somewhere."""
    if draw(st.booleans()):
        length = draw(st.integers(0, 30).filter(lambda n: n != 13))
        return draw(
            st.lists(st.sampled_from([0, 1, 2]), min_size=length, max_size=length)
        ), "entries"
    ratios = list(TINY_RATIOS)
    at = draw(st.integers(0, 12))
    if at >= 10:  # a DSpark stage: any non-zero ratio is wrong there
        ratios[at] = draw(st.sampled_from([1, 2]))
        return ratios, f"DSpark stages [{at}]"
    ratios[at] = draw(st.integers(-5, 200).filter(lambda r: r not in (0, 1, 2)))
    return ratios, f"({at}, {ratios[at]})"


@settings(max_examples=60, deadline=None)
@given(_invalid_ratios())
def test_random_invalid_compress_ratios_raise(case):
    ratios, needle = case
    data = _tiny_dict()
    data["compress_ratios"] = ratios
    _raises(data, "compress_ratios", needle)
