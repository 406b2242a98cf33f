"""The step plan: the ordered, named stages of one rank's decode step, each a list of launches.

A `Stage` is one step of model doc §2 (`layer07.attn.sparse_mqa`, `tail.lm_head`...): either
`build(rows) -> [LaunchSpec, ...]` (the kernel family's launches on arena slices and bound
pointers, for a bucket of `rows`) or a `missing` reason. `Plan.record(stream, rows)` enqueues every
stage's launches in order, inside NVTX ranges per layer and per stage, eagerly or under a graph
capture; it refuses (NotImplementedError naming every missing stage) before launching anything, so
a capture never holds a partial step.

`decode_plan(cfg)` lays out the whole V4.1 step (head, 40 layers, tail) with every stage missing
until `executor.wiring.wire` builds it. A missing stage is of one of two kinds:
- NO_KERNEL: no kernel exists yet (none today: the last one, the cross-rank greedy pick, is
  kernels.allreduce's `allreduce_pick_*`);
- NOT_WIRED: the family exists in kernels/ and its pointer-level launch builder in
  executor/launches/, but no stage module (executor/stages/) builds the stage yet.
`Plan.wire(name, build)` replaces one missing stage by its launches as that work lands.

Side branches (executor/branches.py): a stage marked `side` runs on a second stream, after the
side stream's earlier work and after the main stream's work up to the stage's place in the plan;
the main stream waits for the branch before the next stage marked `joins` of the same layer.
`decode_plan` / `draft_plan` mark the roles of `branch_roles()` while STEP_BRANCHES. Every serial
order of a plan (its stage order, or each branch moved to its join: `launches(rows,
side_last=True)`) computes the same bytes; tests/test_plan_branches.py checks that on the
emulated tiny step.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

# The layer's work that feeds nothing the main chain runs next (executor/branches.py): the
# whole shared expert (w1|w3, then w2 -> ffn.shared_out, read by the MoE combine, which adds it)
# and the compressor and indexer (read by sparse MQA after wq_b and the q RoPE) run beside the
# chain. Revert: STEP_BRANCHES = False (one stream, the stages in plan order).
STEP_BRANCHES = True
SIDE_ROLES = frozenset({"attn.compressor", "attn.indexer", "ffn.shared_w13", "ffn.shared_expert"})
JOIN_ROLES = frozenset({"attn.sparse_mqa", "ffn.moe_combine"})
# Round 8: the shared expert's w2 on the side too (bf16 -> ffn.shared_out), the combine adding
# it (moe_combine_<tag>_shared, executor/stages/ffn.py). Revert: SHARED_ON_SIDE = False, the
# 62f9948 arrangement: w2 ("add_f32": + the routed sum -> ffn.partial) after the plain combine,
# joining the branch; `branch_roles` then moves ffn.shared_expert from SIDE_ROLES to the joins.
SHARED_ON_SIDE = True

NO_KERNEL = "no kernel"
NOT_WIRED = "kernel exists, not wired to the executor's buffers"


@dataclass(frozen=True)
class Stage:
    """One named stage. Exactly one of `build` (rows -> launches) or `missing` (why not) is set."""

    name: str                       # "head.embed", "layer03.attn.sparse_mqa", "tail.lm_head"
    family: str                     # kernels module or collectives algorithm it launches
    layer: int | None = None        # None for head and tail stages
    build: Callable[[int], Sequence] | None = None
    missing: str = ""               # NO_KERNEL or NOT_WIRED when build is None
    side: bool = False              # runs on the side stream (executor/branches.py)
    joins: bool = False             # the main stream waits for the open branch before this stage

    def __post_init__(self):
        if (self.build is None) == (not self.missing):
            raise ValueError(f"stage {self.name!r}: give exactly one of build or missing")
        if self.side and self.joins:
            raise ValueError(f"stage {self.name!r}: a side stage cannot join its own branch")

    @property
    def range_name(self) -> str:
        """The NVTX range: the name without its layer prefix (the layer has its own range)."""
        return self.name.split(".", 1)[1] if self.layer is not None else self.name


class Plan:
    """An ordered list of stages with unique names."""

    def __init__(self, stages: Sequence[Stage]):
        self.stages = tuple(stages)
        counts = Counter(s.name for s in self.stages)
        dup = sorted(n for n, c in counts.items() if c > 1)
        if dup:
            raise ValueError(f"plan: stage names used twice: {dup}")
        if not self.stages:
            raise ValueError("plan: no stages")
        self._check_branches()

    def _check_branches(self) -> None:
        """Every branch (side stages) joins before a `joins` stage of its own layer."""
        open_at = None
        for s in self.stages:
            if open_at is not None and s.layer != open_at.layer:
                raise ValueError(f"plan: the branch opened by {open_at.name!r} never joins (no "
                                 f"joins stage before {s.name!r})")
            if s.side and open_at is None:
                open_at = s
            elif s.joins:
                open_at = None
        if open_at is not None:
            raise ValueError(f"plan: the branch opened by {open_at.name!r} never joins")

    @property
    def has_branches(self) -> bool:
        return any(s.side for s in self.stages)

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"plan has no stage {name!r}")

    def wire(self, name: str, build: Callable[[int], Sequence]) -> Plan:
        """A new plan with stage `name` built by `build` instead of missing."""
        return self.wire_all({name: build})

    def wire_all(self, builds: Mapping[str, Callable[[int], Sequence]]) -> Plan:
        """A new plan with every stage named in `builds` built by its builder (one pass)."""
        unknown = sorted(set(builds) - {s.name for s in self.stages})
        if unknown:
            raise KeyError(f"plan has no stage {unknown[0]!r}" if len(unknown) == 1
                           else f"plan has no stages {unknown}")
        return Plan([replace(s, build=builds[s.name], missing="") if s.name in builds else s
                     for s in self.stages])

    def missing_stages(self) -> list[Stage]:
        return [s for s in self.stages if s.build is None]

    def require_complete(self) -> None:
        """Raise NotImplementedError naming every missing stage, grouped by kind and role."""
        missing = self.missing_stages()
        if not missing:
            return
        parts = []
        for kind in (NO_KERNEL, NOT_WIRED):
            groups: dict[str, list[int]] = {}
            for s in missing:
                if s.missing == kind:
                    groups.setdefault(s.range_name, []).append(s.layer)
            if groups:
                items = [name if layers == [None] else f"{name} (layers {_spans(layers)})"
                         for name, layers in groups.items()]
                parts.append(f"[{kind}] " + ", ".join(items))
        raise NotImplementedError(
            f"the step plan is incomplete: {len(missing)} of {len(self.stages)} stages have no "
            f"launches, so no graph is captured and no step is served. " + "; ".join(parts))

    def launches(self, rows: int, side_last: bool = False) -> list[tuple[Stage, list]]:
        """Every stage's launches for a bucket of `rows` (built before anything is enqueued), in
        stage order; side_last: each branch's side stages just before the stage it joins at
        (the other serial order its graph allows)."""
        self.require_complete()
        built = [(s, list(s.build(rows))) for s in self.stages]
        if not side_last:
            return built
        out, branch = [], []
        for stage, specs in built:
            if stage.side:
                branch.append((stage, specs))
                continue
            if stage.joins:
                out += branch
                branch = []
            out.append((stage, specs))
        return out

    def record(self, stream, rows: int, ranges=None, side=None, relaunch=None) -> int:
        """Enqueue the step for `rows` on `stream`; returns the number of launches.

        `side`: a branches.SideStream: side stages run on it, forked and joined as marked
        (None: every stage on `stream`, in order). `relaunch(spec) -> spec` (e.g. without the
        PDL attribute) is applied to every launch. NVTX (when `ranges` is given): one range per
        layer, one per stage inside it. Around a capture they mark the recording; around eager
        launches, the kernels.
        """
        built = self.launches(rows)
        count, open_layer, branch_open = 0, None, False
        main_since_fork = True          # main launches since the last fork (none: no new fork)
        for stage, specs in built:
            if ranges is not None and stage.layer != open_layer:
                if open_layer is not None:
                    ranges.pop()
                if stage.layer is not None:
                    ranges.push(f"layer{stage.layer:02d}")
                open_layer = stage.layer
            if ranges is not None:
                ranges.push(stage.range_name)
            target = stream
            if side is not None and stage.joins and branch_open:
                side.join(stream)
                branch_open = False
            # A side stage with no launches for this bucket forks nothing (e.g. attn.q_kv_norm
            # at R = 1, executor.stages.attn_proj.FOLD_MIN_ROWS).
            if side is not None and stage.side and specs:   # waits for the main's work so far
                if main_since_fork:     # else the side stream already waits for all of it
                    side.fork(stream)
                branch_open, target, main_since_fork = True, side.stream, False
            for spec in specs:
                (spec if relaunch is None else relaunch(spec)).launch(target)
                count += 1
            main_since_fork = main_since_fork or (target is stream and bool(specs))
            if ranges is not None:
                ranges.pop()
        if ranges is not None and open_layer is not None:
            ranges.pop()
        return count


def _spans(layers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    out, start, prev = [], layers[0], layers[0]
    for x in [*layers[1:], None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ", ".join(out)


def _layer_stages(spec) -> list[tuple[str, str, str]]:
    """(role, family, missing) of one backbone layer, in model doc §2.2 order."""
    out = []
    if spec.has_engram:
        out += [("engram.lookup", "kernels.engram", NOT_WIRED),
                ("engram.heads_allgather", "kernels.allreduce", NOT_WIRED),
                ("engram.wkv", "kernels.dense", NOT_WIRED),        # this rank's columns
                ("engram.kv_allgather", "kernels.allreduce", NOT_WIRED),
                ("engram.gate", "kernels.engram", NOT_WIRED)]
    out += [("attn.mhc_pre", "kernels.mhc", NOT_WIRED),        # pending FFN post + mixes + collapse
            ("attn.norm", "kernels.norm", NOT_WIRED)]
    if spec.owns_compressor:            # reads xn only: beside wq_a|wkv .. the q RoPE
        out.append(("attn.compressor", "kernels.compressor", NOT_WIRED))
    indexer = [("attn.indexer", "kernels.indexer", NOT_WIRED)] if spec.has_indexer else []
    out.append(("attn.wq_a_wkv", "kernels.dense", NOT_WIRED))
    if _q_norm_folded():                # the indexer reads attn.qkv (R > 8: attn.qr, written
        out += indexer                  # by attn.wq_a_wkv): it forks before the kv insert
        indexer = []
    out.append(("attn.q_kv_norm", "kernels.norm", NOT_WIRED))
    out += indexer                      # reads attn.qr: beside wq_b and the q RoPE
    out += [("attn.wq_b", "kernels.dense", NOT_WIRED),
            ("attn.rope_swa_insert", "kernels.kv_publish", NOT_WIRED),
            ("attn.sparse_mqa", "kernels.sparse_mqa", NOT_WIRED),
            ("attn.wo_a", "kernels.wo_a", NOT_WIRED),
            ("attn.wo_b", "kernels.dense", NOT_WIRED),
            ("attn.allreduce", "collectives.oneshot", NOT_WIRED),
            ("ffn.mhc_pre", "kernels.mhc", NOT_WIRED),
            ("ffn.norm", "kernels.norm", NOT_WIRED)]
    shared = [("ffn.shared_w13", "kernels.dense", NOT_WIRED),
              ("ffn.shared_expert", "kernels.dense", NOT_WIRED)]
    routed = [("ffn.router", "kernels.router", NOT_WIRED),
              ("ffn.moe_routed", "kernels.moe", NOT_WIRED),      # prep / xquant .. w2
              ("ffn.moe_combine", "kernels.moe", NOT_WIRED)]
    if SHARED_ON_SIDE:                  # the whole shared expert, then the routed chain
        out += shared + routed
    else:                               # 62f9948: w2 adds the routed sum after the combine
        out += shared[:1] + routed + shared[1:]
    out.append(("ffn.allreduce", "collectives.oneshot", NOT_WIRED))
    return out


def branch_roles() -> tuple[frozenset, frozenset]:
    """(side roles, join roles) of the plans built now: SIDE_ROLES / JOIN_ROLES, with
    ffn.shared_expert joining instead of on the side where not SHARED_ON_SIDE (attn.q_kv_norm
    may go on the side too, per layer: `kv_insert_on_side`)."""
    if SHARED_ON_SIDE:
        return SIDE_ROLES, JOIN_ROLES
    return (SIDE_ROLES - {"ffn.shared_expert"},
            (JOIN_ROLES - {"ffn.moe_combine"}) | {"ffn.shared_expert"})


def _q_norm_folded() -> bool:
    """q_norm folded into wq_b and the indexer's projection (attn_proj.FOLD_Q_NORM)."""
    from executor.stages import attn_proj  # lazy: the stage modules import the plan's users
    return attn_proj.q_norm_folded()


def kv_insert_on_side(spec) -> bool:
    """With q_norm folded, attn.q_kv_norm is the kv half's SWA insert alone (read only by this
    layer's sparse MQA): a side stage where the layer has no other attention side work, so it
    runs beside wq_b and the q RoPE; where the compressor / indexer make the side chain the
    longer one, it stays on the main chain (which waits for the side at sparse MQA anyway),
    after the indexer has forked."""
    return _q_norm_folded() and not (spec.owns_compressor or spec.has_indexer)


def _layer_stage(name: str, role: str, family: str, spec, missing: str,
                 branches: bool) -> Stage:
    side, joins = branch_roles()
    on_side = role in side or (role == "attn.q_kv_norm" and kv_insert_on_side(spec))
    return Stage(name, family, spec.index, missing=missing, side=branches and on_side,
                 joins=branches and role in joins)


def decode_plan(cfg, dspark: bool = False, sync_free: bool = False,
                branches: bool | None = None) -> Plan:
    """The V4.1 decode step of one rank (backbone layers only: DSpark stages are a draft step).

    dspark=True: the verify step of a DSpark round (executor/stages/dspark.py): the aux states
    after each target layer's attn.mhc_pre, then after the pick the device-side acceptance, the
    ratio-2 ring rollback and the draft stages' context KV at the accepted positions.
    sync_free=True (with dspark): last, the draft rows' Engram lookback (dspark.history_draft,
    Engram models) and the row advance that makes the bound rows the draft step's
    (dspark.advance_draft), so the draft graph can follow with no host write.
    branches (default STEP_BRANCHES): mark the side stages and their joins.
    """
    branches = STEP_BRANCHES if branches is None else branches
    if dspark and not cfg.dspark_target_layer_ids:
        raise ValueError("decode_plan(dspark=True): the config has no DSpark target layers")
    if sync_free and not dspark:
        raise ValueError("decode_plan(sync_free=True): only a DSpark verify step advances its "
                         "rows (pass dspark=True)")
    # rows_prep: the caller's int64 rows -> the int32 rows (and Engram history) every kernel reads.
    stages = [Stage("head.rows_prep", "kernels.rows", missing=NOT_WIRED),
              Stage("head.embed", "kernels.embed", missing=NOT_WIRED),
              Stage("head.embed_allreduce", "collectives.oneshot", missing=NOT_WIRED)]
    if cfg.engram_layer_ids:
        stages.append(Stage("head.engram_hash", "kernels.engram", missing=NOT_WIRED))
    for spec in cfg.layers:
        if spec.is_dspark:
            continue
        for role, family, missing in _layer_stages(spec):
            stages.append(_layer_stage(f"layer{spec.index:02d}.{role}", role, family,
                                       spec, missing, branches))
            if dspark and role == "attn.mhc_pre" and spec.index in cfg.dspark_target_layer_ids:
                stages.append(Stage(f"layer{spec.index:02d}.dspark.aux", "kernels.dspark",
                                    spec.index, missing=NOT_WIRED))
    stages += [Stage("tail.mhc_post_collapse", "kernels.mhc", missing=NOT_WIRED),
               Stage("tail.norm", "kernels.norm", missing=NOT_WIRED),
               Stage("tail.lm_head_argmax", "kernels.lm_head", missing=NOT_WIRED),
               Stage("tail.argmax_pick", "kernels.allreduce", missing=NOT_WIRED)]
    if dspark:
        stages += _accept_stages(cfg)
    if sync_free:
        if cfg.engram_layer_ids:
            stages.append(Stage("dspark.history_draft", "kernels.dspark", missing=NOT_WIRED))
        stages.append(Stage("dspark.advance_draft", "kernels.dspark", missing=NOT_WIRED))
    return Plan(stages)


def _accept_stages(cfg) -> list[Stage]:
    """After the verify step's pick: acceptance, ring rollback, the draft stages' context KV."""
    stages = [Stage("dspark.accept", "kernels.dspark", missing=NOT_WIRED),
              Stage("dspark.ring_rollback", "kernels.dspark", missing=NOT_WIRED),
              Stage("dspark.main_proj", "kernels.dense", missing=NOT_WIRED),
              Stage("dspark.main_norm", "kernels.norm", missing=NOT_WIRED)]
    return stages + [Stage(f"layer{spec.index:02d}.dspark.context_kv", "kernels.kv_publish",
                           spec.index, missing=NOT_WIRED)
                     for spec in cfg.layers if spec.is_dspark]


def draft_plan(cfg, sync_free: bool = False, branches: bool | None = None) -> Plan:
    """The draft step of a DSpark round on one rank (model doc §4, executor/reference/dspark.py).

    Rows: k = dspark_block_size per sequence, [bonus, noise x (k - 1)], kind "draft". The head
    embeds them; the DSpark stages run like backbone layers; the last stage's collapse, its norm
    and the shared head give the base logits U (`dspark.base`); then k Markov steps (a local
    argmax and the cross-rank pick each) and a last copy write the next verify step's token_ids
    (executor/stages/dspark.py); sync_free=True: last, the verify rows' Engram lookback
    (dspark.history_verify, Engram models) and the row advance that makes the bound rows the next
    verify step's (dspark.advance_verify). The stage layers' roles carry a `draft.` prefix:
    executor/stages/draft.py maps each to the backbone builder of the same role, which names the
    stage's weights `mtp.{s}.` (wiring.weight_prefix).
    """
    branches = STEP_BRANCHES if branches is None else branches
    stage_layers = [spec for spec in cfg.layers if spec.is_dspark]
    if not stage_layers or not cfg.dspark_target_layer_ids:
        raise ValueError("draft_plan: the config has no DSpark stages")
    stages = [Stage("head.rows_prep", "kernels.rows", missing=NOT_WIRED),
              Stage("head.embed", "kernels.embed", missing=NOT_WIRED),
              Stage("head.embed_allreduce", "collectives.oneshot", missing=NOT_WIRED)]
    for spec in stage_layers:
        stages += [_layer_stage(f"layer{spec.index:02d}.draft.{role}", role, family, spec,
                                missing, branches)
                   for role, family, missing in _layer_stages(spec)]
    stages += [Stage("draft.mhc_post_collapse", "kernels.mhc", missing=NOT_WIRED),
               Stage("draft.norm", "kernels.norm", missing=NOT_WIRED),
               Stage("draft.lm_head_logits", "kernels.lm_head", missing=NOT_WIRED)]
    stages += [Stage(f"dspark.markov{i}", "kernels.dspark", missing=NOT_WIRED)
               for i in range(cfg.dspark_block_size + 1)]
    if sync_free:
        if cfg.engram_layer_ids:
            stages.append(Stage("dspark.history_verify", "kernels.dspark", missing=NOT_WIRED))
        stages.append(Stage("dspark.advance_verify", "kernels.dspark", missing=NOT_WIRED))
    return Plan(stages)
