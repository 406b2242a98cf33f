"""Side branches of the step plan (executor/branches.py, executor.plan SIDE_ROLES / JOIN_ROLES).

What a branch may do is decided by data, not by the stream API: a side stage must touch nothing the
main stages between its fork and its join touch. The emulated tiny step proves it for the wired
plan: both serial orders a branched graph allows (each side stage where it forks, or moved to
just before its join) leave every byte of every rank's arena and bound tensors the same.
"""
import numpy as np
import pytest
from ref_model import prefilled_tiny, tiny_checkpoint, token_history

from executor import plan as plan_mod
from executor.branches import SideStream
from executor.emulate.ranks import EmulatedRanks
from executor.plan import Plan, Stage, decode_plan, draft_plan
from executor.reference.rows import RowBatch, RowBlock
from executor.wiring import STAGE_MODULES
from loader.config import ModelConfig


def _branches(plan: Plan) -> list[tuple[list[str], str]]:
    """[(side stage names, the stage it joins before)] in plan order."""
    out, side = [], []
    for s in plan.stages:
        if s.side:
            side.append(s.name)
        elif s.joins and side:
            out.append((side, s.name))
            side = []
    assert not side
    return out


@pytest.mark.parametrize("preset", ["v41-flash", "tiny"])
def test_decode_plan_marks_one_branch_per_sublayer(preset):
    cfg = ModelConfig.preset(preset)
    branches = _branches(decode_plan(cfg))
    by_layer = {}
    for side, join in branches:
        by_layer.setdefault(int(join[5:7]), []).append(([n.split(".", 1)[1] for n in side],
                                                        join.split(".", 1)[1]))
    for spec in cfg.layers:
        if spec.is_dspark:
            continue
        attn = [r for r, has in (("attn.compressor", spec.owns_compressor),
                                 ("attn.indexer", spec.has_indexer)) if has]
        if plan_mod.kv_insert_on_side(spec):           # q_norm folded: the SWA insert alone
            attn = ["attn.q_kv_norm"]
        want = ([(attn, "attn.sparse_mqa")] if attn else []) + [
            (["ffn.shared_w13", "ffn.shared_expert"], "ffn.moe_combine")]
        assert by_layer[spec.index] == want, spec.index
    assert not decode_plan(cfg, branches=False).has_branches
    if cfg.dspark_target_layer_ids:
        draft = _branches(draft_plan(cfg))
        stages = [s for s in cfg.layers if s.is_dspark]
        per_stage = ([(["draft.attn.q_kv_norm"], "draft.attn.sparse_mqa")]
                     if plan_mod.kv_insert_on_side(stages[0]) else []) + [
            (["draft.ffn.shared_w13", "draft.ffn.shared_expert"], "draft.ffn.moe_combine")]
        assert [([n.split(".", 1)[1] for n in s], j.split(".", 1)[1]) for s, j in draft] == \
            per_stage * len(stages) and draft


@pytest.mark.parametrize("on_side", [True, False])
def test_ffn_stage_order_follows_shared_on_side(monkeypatch, on_side):
    """plan.SHARED_ON_SIDE: the shared expert's two stages beside router .. w2, the combine
    joining; False (62f9948): w2 after the combine, joining."""
    monkeypatch.setattr(plan_mod, "SHARED_ON_SIDE", on_side)
    cfg = ModelConfig.preset("tiny")
    for plan in (decode_plan(cfg), draft_plan(cfg)):
        layer = next(st.layer for st in plan.stages if st.layer is not None)
        roles = [(role, st.side, st.joins) for st in plan.stages if st.layer == layer
                 for role in [st.range_name.removeprefix("draft.")] if role.startswith("ffn.")]
        if on_side:
            assert roles == [("ffn.mhc_pre", False, False), ("ffn.norm", False, False),
                             ("ffn.shared_w13", True, False), ("ffn.shared_expert", True, False),
                             ("ffn.router", False, False), ("ffn.moe_routed", False, False),
                             ("ffn.moe_combine", False, True), ("ffn.allreduce", False, False)]
        else:
            assert roles == [("ffn.mhc_pre", False, False), ("ffn.norm", False, False),
                             ("ffn.shared_w13", True, False), ("ffn.router", False, False),
                             ("ffn.moe_routed", False, False), ("ffn.moe_combine", False, False),
                             ("ffn.shared_expert", False, True), ("ffn.allreduce", False, False)]


def test_plan_refuses_a_branch_that_never_joins():
    def st(name, layer, **kw):
        return Stage(name, "f", layer, build=lambda r: [], **kw)

    with pytest.raises(ValueError, match="cannot join its own branch"):
        st("layer00.x", 0, side=True, joins=True)
    with pytest.raises(ValueError, match=r"'layer00\.s' never joins \(no joins stage before "
                                         r"'layer01\.a'\)"):
        Plan([st("layer00.s", 0, side=True), st("layer00.m", 0), st("layer01.a", 1)])
    with pytest.raises(ValueError, match="'layer00.s' never joins"):
        Plan([st("layer00.s", 0, side=True)])
    Plan([st("layer00.s", 0, side=True), st("layer00.m", 0), st("layer00.j", 0, joins=True),
          st("layer01.j", 1, joins=True)])                    # a join with no branch open: a no-op


class _Log:
    def __init__(self):
        self.events = []


class _Stream:
    def __init__(self, name):
        self.name = name


class _Event:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def record(self, stream):
        self.log.events.append(f"record {self.name} on {stream.name}")

    def wait(self, stream):
        self.log.events.append(f"{stream.name} waits {self.name}")


class _Spec:
    def __init__(self, log, name, pdl=True):
        self.log, self.name, self.pdl = log, name, pdl

    def launch(self, stream):
        self.log.events.append(f"{self.name}{'' if self.pdl else '/plain'} on {stream.name}")


def test_record_forks_launches_beside_and_joins():
    log = _Log()

    def st(name, layer, n=1, **kw):
        return Stage(name, "f", layer, build=lambda r: [_Spec(log, f"{name}#{i}")
                                                          for i in range(n * r)], **kw)

    plan = Plan([st("head.a", None), st("layer00.m1", 0), st("layer00.s1", 0, side=True),
                 st("layer00.s2", 0, 2, side=True), st("layer00.m2", 0),
                 st("layer00.s3", 0, side=True), st("layer00.j", 0, joins=True),
                 st("layer01.j", 1, joins=True)])
    side = SideStream(_Stream("side"), _Event(log, "fork"), _Event(log, "join"))
    main = _Stream("main")
    assert plan.record(main, 1, side=side) == 9
    # s2 follows s1 with no main launch between: the side stream already waits for main's
    # work, so no second fork (its launch stays right behind s1's: PDL on the side stream);
    # s3 follows m2: forked again.
    assert log.events == [
        "head.a#0 on main", "layer00.m1#0 on main",
        "record fork on main", "side waits fork", "layer00.s1#0 on side",
        "layer00.s2#0 on side", "layer00.s2#1 on side",
        "layer00.m2#0 on main",
        "record fork on main", "side waits fork", "layer00.s3#0 on side",
        "record join on side", "main waits join",
        "layer00.j#0 on main", "layer01.j#0 on main"]
    log.events.clear()
    assert plan.record(main, 1, relaunch=lambda s: _Spec(log, s.name, pdl=False)) == 9
    assert log.events == [f"{n}/plain on main" for n in (
        "head.a#0", "layer00.m1#0", "layer00.s1#0", "layer00.s2#0", "layer00.s2#1",
        "layer00.m2#0", "layer00.s3#0", "layer00.j#0", "layer01.j#0")]
    order = [s.name for s, _ in plan.launches(1, side_last=True)]
    assert order == ["head.a", "layer00.m1", "layer00.m2", "layer00.s1", "layer00.s2",
                     "layer00.s3", "layer00.j", "layer01.j"]


def _state(ranks) -> list[bytes]:
    return ([a.buffer.tobytes() for a in ranks.arenas]
            + [t[name].tobytes() for t in ranks.tensors for name in sorted(t)])


def _restore(ranks, saved) -> None:
    arrays = [a.buffer for a in ranks.arenas] + [t[name] for t in ranks.tensors
                                                 for name in sorted(t)]
    for array, data in zip(arrays, saved, strict=True):
        array.view(np.uint8).reshape(-1)[:] = np.frombuffer(data, np.uint8)


def test_both_serial_orders_of_the_branched_step_write_the_same_bytes(tiny_bundle_dir):
    """The wired tiny step (4 emulated ranks, a verify block of 6 rows) with its branches where
    they fork, then again from the same state with each branch just before its join: every byte
    equal. A side stage that read or wrote what a main stage of its branch window writes would
    differ here (checked: wq_b made a side stage fails it, ~80 buffers differ)."""
    assert plan_mod.STEP_BRANCHES
    rng = np.random.default_rng()
    model, caches, seq = prefilled_tiny(rng, 4)
    ranks = EmulatedRanks(tiny_checkpoint(), tiny_bundle_dir, 4, caches, modules=STAGE_MODULES)
    assert ranks.plans[0].has_branches
    toks = [seq[-1], *rng.integers(0, 1000, 5).tolist()]
    rows = RowBatch.from_blocks([RowBlock(0, len(seq) - 1, tuple(toks), "verify")],
                                caches.block_tables, caches.ring_slots, pad_to=8)
    history = (token_history(model.cfg, rows, [np.asarray(seq + toks[1:], np.int64)])
               if model.cfg.engram_layer_ids else None)
    ranks.load(rows, caches, history)
    before = _state(ranks)
    ranks.run(rows.num_rows)
    forked = _state(ranks)
    assert forked != before
    _restore(ranks, before)
    ranks.run(rows.num_rows, side_last=True)
    joined = _state(ranks)
    diff = [i for i, (a, b) in enumerate(zip(forked, joined, strict=True)) if a != b]
    assert not diff, f"{len(diff)} buffers differ between the two serial orders"


def test_bench_step_variants_name_existing_constants():
    """Every STEP_VARIANTS entry sets constants that exist (a renamed switch fails here, on the
    CPU, not in the middle of a GPU run), and the overrides are undone after the body."""
    from executor import bench_step as bs

    for name, settings in bs.STEP_VARIANTS.items():
        before = {key: bs._constant(*key) for key in settings()}
        with bs.overrides(settings()):
            for (module, attr), value in settings().items():
                assert bs._constant(module, attr) == value, name
        assert {key: bs._constant(*key) for key in settings()} == before
    assert bs.selected_variants() == list(bs.STEP_VARIANTS)
