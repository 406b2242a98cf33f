"""CPU test of the contract the sparse MQA `early` candidate relies on (SparseMqaSpec.early).

`fixed_push_runs_early` reads the top-k lists, block tables, row metadata and cache records
before griddepcontrol.wait. That is correct only because the kernel launched right before it in
the step, attn.rope_swa_insert (kernels/rope.py alone while FUSED_ATTN_PREP), triggers its
dependents after its own griddepcontrol.wait: when sparse MQA starts, wq_b and every kernel
before it have completed. This test fails when that wiring changes, so the early kernel is not
left in the step on a broken premise.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from executor import plan as plan_mod
from executor.stages import attn_proj
from loader.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("dspark", [False, True])
def test_rope_is_launched_right_before_every_sparse_mqa(dspark):
    cfg = ModelConfig.preset("v41-flash")
    names = [s.name for s in plan_mod.decode_plan(cfg, dspark=dspark).stages]
    mqa = [i for i, n in enumerate(names) if n.endswith(".attn.sparse_mqa")]
    assert len(mqa) >= cfg.num_hidden_layers
    for i in mqa:
        assert names[i - 1] == names[i].replace("sparse_mqa", "rope_swa_insert"), names[i - 1]
    assert attn_proj.FUSED_ATTN_PREP     # rope_swa_insert is then the RoPE kernel alone


def test_rope_kernel_triggers_after_its_wait():
    body = (ROOT / "kernels" / "rope.py").read_text()
    wait = [m.start() for m in re.finditer(r"griddepcontrol_wait\(\)", body)]
    trigger = [m.start() for m in re.finditer(r"griddepcontrol_launch_dependents\(\)", body)]
    assert len(wait) == 1 and len(trigger) == 1 and wait[0] < trigger[0]
