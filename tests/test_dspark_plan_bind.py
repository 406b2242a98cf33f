"""decode_plan(dspark=True) and binding_rules(dspark=True): where the DSpark stages sit, what the
caller binds for them, and what is refused (CPU)."""
from dataclasses import replace

import numpy as np
import pytest

from executor.bind import BindError, CacheGeometry, binding_rules, validate_binding
from executor.dlpack import KDL_CPU
from executor.plan import NOT_WIRED, decode_plan, draft_plan
from loader.config import ModelConfig

CPU = (KDL_CPU, 0)
def _without_dspark():
    """The tiny config with no DSpark stages (a valid config: no targets, no stages)."""
    cfg = ModelConfig.preset("tiny")
    return replace(cfg, dspark_target_layer_ids=(), num_nextn_predict_layers=0,
                   compress_ratios=cfg.compress_ratios[:cfg.num_hidden_layers])


GEOMETRY = CacheGeometry(max_seqs=2, ring_slots=32, ring_rows=8, page_size=16, num_pages=16,
                         pages_per_seq=8)


@pytest.mark.parametrize("preset", ["tiny", "v41-flash"])
def test_dspark_stages_sit_where_the_reference_takes_them(preset):
    cfg = ModelConfig.preset(preset)
    plain, plan = decode_plan(cfg), decode_plan(cfg, dspark=True)
    names = [s.name for s in plan.stages]
    extra = [n for n in names if "dspark" in n]
    # the plain step is unchanged: the verify plan is it plus the DSpark stages
    assert [n for n in names if "dspark" not in n] == [s.name for s in plain.stages]
    for t in cfg.dspark_target_layer_ids:
        # after the attn.mhc_pre that applied the pending FFN post (decode_step: apply_pending,
        # then the mean), before anything of the layer reads or changes the streams
        i = names.index(f"layer{t:02d}.attn.mhc_pre")
        assert names[i + 1] == f"layer{t:02d}.dspark.aux"
    stages = [s.index for s in cfg.layers if s.is_dspark]
    tail = ["dspark.accept", "dspark.ring_rollback", "dspark.main_proj", "dspark.main_norm",
            *[f"layer{i:02d}.dspark.context_kv" for i in stages]]
    assert names[-len(tail) - 1:] == ["tail.argmax_pick", *tail]
    assert len(extra) == len(cfg.dspark_target_layer_ids) + len(tail)
    assert all(plan.stage(n).missing == NOT_WIRED for n in extra)


def test_decode_plan_refuses_dspark_without_targets():
    with pytest.raises(ValueError, match="no DSpark target layers"):
        decode_plan(_without_dspark(), dspark=True)


def test_binding_rules_add_the_round_outputs():
    cfg = ModelConfig.preset("tiny")
    plain, rules = binding_rules(cfg, 4, GEOMETRY), binding_rules(cfg, 4, GEOMETRY, dspark=True)
    assert set(rules) - set(plain) == {"accepted", "bonus"}
    assert (rules["accepted"].dtype, rules["accepted"].shape) == ("int32", (192,))
    assert (rules["bonus"].dtype, rules["bonus"].shape) == ("int64", (192,))
    assert rules["accepted"].required and rules["bonus"].required
    tensors = {r.name: np.zeros(r.shape, r.dtype) for r in rules.values()}
    binding = validate_binding(rules, tensors, CPU)
    assert binding.ptr("accepted") == tensors["accepted"].ctypes.data
    del tensors["bonus"]
    with pytest.raises(BindError, match=r"missing tensor\(s\) \['bonus'\]"):
        validate_binding(rules, tensors, CPU)
    with pytest.raises(BindError, match=r"'accepted': expected int32 \[192\]"):
        validate_binding(rules, {**tensors, "bonus": np.zeros(192, np.int64),
                                 "accepted": np.zeros(192, np.int64)}, CPU)
    with pytest.raises(BindError, match=r"unexpected tensor\(s\) \['accepted'"):
        validate_binding(plain, {n: tensors[n] for n in plain if n in tensors}
                         | {"accepted": tensors["accepted"]}, CPU)


def test_binding_rules_refuse_dspark_without_stages():
    with pytest.raises(ValueError, match="no DSpark stages"):
        binding_rules(_without_dspark(), 4, GEOMETRY, dspark=True)


@pytest.mark.parametrize("preset", ["tiny", "v41-flash"])
def test_draft_plan_lays_out_the_draft_step(preset):
    cfg = ModelConfig.preset(preset)
    plan = draft_plan(cfg)
    names = [s.name for s in plan.stages]
    k = cfg.dspark_block_size
    assert names[:3] == ["head.rows_prep", "head.embed", "head.embed_allreduce"]
    assert names[-(k + 4):] == ["draft.mhc_post_collapse", "draft.norm", "draft.lm_head_logits",
                                *[f"dspark.markov{i}" for i in range(k + 1)]]
    stage_layers = {s.layer for s in plan.stages if s.layer is not None}
    assert stage_layers == {s.index for s in cfg.layers if s.is_dspark}
    # the stage layers' roles are draft.*: no backbone builder (layers.{i}. weights) claims them
    assert all(s.range_name.startswith("draft.") for s in plan.stages if s.layer is not None)
    with pytest.raises(NotImplementedError, match="stages have no launches"):
        plan.require_complete()
    with pytest.raises(ValueError, match="no DSpark stages"):
        draft_plan(_without_dspark())
