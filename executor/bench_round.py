"""DSpark round benchmark on one GPU: rank 0 of TP4, the draft and verify graphs back to back.

    hopdec devicecheck --only round --bundle build/bundle-v41-bench-step-tp4 ...
    HOPDEC_ROUND_CASES=c1x4k,c8x64k hopdec devicecheck --only round ...   # those cases only

Environment: HOPDEC_ROUND_CASES ("cSEQSxCONTEXT,...": SEQS sequences, one of ROUND_SEQS, CONTEXT
in tokens, k = 1024) runs only those; unset, c1, c4, c8 at 4k and 64k (quick too: a case costs
a capture and ~2 s).
HOPDEC_PACK_WORKERS as the step benchmark.

What runs (model doc §4; issue 10): on the step benchmark's rank (executor/bench_step.py:
`bench_config`, synthetic weights, 40 layers sharing 8 representatives' bytes, tiled experts,
`stages.local_collectives`), the round's plans on one arena:
- verify: `decode_plan(cfg, dspark=True)`, k + 1 = 6 rows per sequence: the step, the aux
  states, acceptance, ring rollback, main_proj and the 3 stages' context KV;
- draft: `draft_plan(cfg)`, k = 5 rows per sequence: the 3 DSpark stages (their own weights and
  128-expert FFNs, `stages.ffn_tiled_dspark`), the shared head's logits, the 5 Markov steps;
- verify_sf / draft_sf: the same with sync_free=True (+ the commit, the Engram lookback and the
  row advance to the other half's rows), and "step": the plain decode step, the baseline.
The draft roles are the backbone builders of the benchmark's modules (as stages/draft.py maps
the executor's). Each Markov step's cross-rank pick is wired on a stand-in state and dropped
(no peer would ever answer); its latency is added with the all-reduces' in the "+ AR" column
(one-shot latency at one row per pick: 8 bytes a row, latency-bound).

Timed per (sequences, context), one graph per plan captured at the case's rows as the Executor
captures it (Plan.record, the side stages on a second stream: executor/branches.py), CUDA-event
medians:
- the round = verify + draft, each replayed alone on rows the host loaded with random tokens
  (rank 0's vocabulary shard, as the step benchmark: ~uniform routing), which neither rewrites:
  the plain step and the verify at the verify rows, the draft at draft rows [anchor, noise x 4];
  each after an eager pass counting its routers' distinct experts (host reads, not timed);
- b2b: ROUND_REPS rounds of draft_sf then verify_sf back to back, the real round's graph
  sequence. With the local stand-ins no pick writes `tokens` or `dspark.prev`, so from the second
  round every verify row is token 0 (all k drafts accepted, k + 1 context KV rows, the rows
  advance k + 1 a round: ROUND_MARGIN), and the 6 rows route alike: b2b reads far fewer experts
  than a real round (run r5a: its verify 5.8 ms, the plain step on random rows 8.0), a lower
  bound only.
At the first context, the draft's roles each alone in a graph (the step benchmark's breakdown).
No L2 flush: a round reads 10-45 GB.

Reported: the round time, with the all-reduces and picks of both plans added; bytes that must be
read (each plan's weights: the arena slices its launches point into, the distinct experts its
routers picked, embedding rows, KV) against 4.8 TB/s and the model doc's 2.14 ms round floor
(c1); tokens per second per sequence = (accepted + 1) / round at the acceptance lengths of
ACCEPTANCE (synthetic weights have no acceptance of their own) and over accepted = 0..k, beside
the upstream PR's median ITL (one streamed chunk per round, so comparable to the round time).
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, replace

import numpy as np

from executor import bench_step as bs
from executor.bench_step import PlanWeights, plan_weights, touched_slices
from executor.plan import Plan, decode_plan, draft_plan
from executor.stages import draft as draft_stages
from executor.stages import local_collectives
from executor.stages.collectives import kv_gather_chunks
from executor.wiring import builders
from kernels.kvrecord_ref import KV_RECORD_BYTES

ROUND_MODULES = ("executor.stages.mhc", "executor.stages.attn_proj",
                 "executor.stages.attn_index", "executor.stages.ffn_tiled_dspark",
                 "executor.stages.local_collectives", "executor.stages.dspark")
ROUND_SEQS = (1, 4, 8)
CASES_ENV = "HOPDEC_ROUND_CASES"
ROUND_REPS, WARMUP_ROUNDS = 40, 3
ROUND_MARGIN = 1024              # tokens past the longest context: > (reps + warmup + 3) x 6
CROSS_RANK_FAMILY = "kernels.allreduce"
ROW_WRITERS = ("dspark.advance", "dspark.history")    # roles that rewrite the bound rows
DOC_ROUND_FLOOR_MS = {1: 2.14}   # model doc §4: verify R = 6 + draft, 10.3 GB at 4.8 TB/s
# tokens per round counting the bonus (accepted + 1): anchors.md §1 (vllm#56797, V4.1-Flash
# DSpark k = 5, GSM8K on H20; read as vLLM's mean acceptance length, which counts the bonus)
# and the upstream PR (seed/upstream-hopper-backend-pr.txt, merged build, real prompts)
UPSTREAM_AL = 3.25
ACCEPTANCE = (("anchors vllm#56797", 2.82), ("upstream PR", UPSTREAM_AL))
# the upstream PR's median ITL with the executor on (4 x H200, TP4, DSpark k = 5), ms, by
# (sequences, context label): real prompts (short) as "4k", its 64K prompts as "64k"
UPSTREAM_ITL_MS = {(1, "4k"): 5.34, (8, "4k"): 14.36, (1, "64k"): 5.63, (8, "64k"): 13.63}


@dataclass(frozen=True)
class RoundCase:
    """`seqs` sequences of one DSpark round: k + 1 verify rows and k draft rows each."""

    seqs: int
    k: int

    @property
    def verify(self) -> bs.Case:
        return bs.Case(self.seqs * (self.k + 1), self.seqs, "verify")

    @property
    def draft_rows(self) -> int:
        return self.seqs * self.k

    @property
    def label(self) -> str:
        return f"c{self.seqs}"


def selected_rounds(k: int, spec: str | None = None):
    """[(RoundCase, contexts)] to run: `spec` (default: CASES_ENV) "cSEQSxCONTEXT,..." such as
    "c1x4k,c8x64k" (the c optional, SEQS one of ROUND_SEQS, k = 1024 tokens, CONTEXT from a
    verify block up to max(bs.CONTEXTS)), grouped by case in the order given; unset or empty:
    every ROUND_SEQS at every context of bs.CONTEXTS."""
    spec = os.environ.get(CASES_ENV, "") if spec is None else spec
    if not spec.strip():
        return [(RoundCase(s, k), bs.CONTEXTS) for s in ROUND_SEQS]
    chosen: dict[RoundCase, list[int]] = {}
    for item in spec.split(","):
        seqs, _, context = item.strip().lower().removeprefix("c").partition("x")
        scale = 1024 if context.endswith("k") else 1
        context = context.removesuffix("k")
        tokens = int(context) * scale if context.isdigit() else -1
        if not (seqs.isdigit() and int(seqs) in ROUND_SEQS
                and k + 1 <= tokens <= max(bs.CONTEXTS)):
            raise ValueError(f"{CASES_ENV}: {item.strip()!r} is not cSEQSxCONTEXT with SEQS one "
                             f"of {list(ROUND_SEQS)} and CONTEXT (4k = 4096) from {k + 1} up to "
                             f"{max(bs.CONTEXTS)}")
        contexts = chosen.setdefault(RoundCase(int(seqs), k), [])
        if tokens not in contexts:
            contexts.append(tokens)
    return [(case, tuple(contexts)) for case, contexts in chosen.items()]


def draft_batch(cfg, geometry, case: RoundCase, context: int, rng):
    """(RowBatch, Engram history, anchors): the draft rows of `case`, [anchor, noise x (k - 1)]
    per sequence (the anchor from rank 0's vocabulary shard, as bs.row_batch draws), ending at
    context - 1; anchors int64 [seqs] is what the caller's `bonus` holds for them."""
    from executor.reference.rows import RowBatch, RowBlock

    anchors = rng.integers(0, cfg.vocab_size // bs.TP, case.seqs)
    noise = (cfg.dspark_noise_token_id,) * (case.k - 1)
    blocks = [RowBlock(s, context - case.k, (int(anchors[s]), *noise), "draft")
              for s in range(case.seqs)]
    tables = np.arange(geometry.num_pages, dtype=np.int32).reshape(geometry.max_seqs, -1)
    rows = RowBatch.from_blocks(blocks, tables, geometry.ring_slots)
    vocab = min(cfg.vocab_size, cfg.engram_compressed_vocab_size)
    history = rng.integers(0, vocab, (case.draft_rows, max(cfg.engram_max_ngram_size, 1)))
    return rows, history, anchors.astype(np.int64)


# ---- wiring: the two plans on the benchmark's stage modules -----------------------------------

def round_builders(modules=ROUND_MODULES) -> dict:
    """role -> builder: the modules' roles, each per-layer role again under `draft.` (on DSpark
    stage layers only, as stages/draft.py does with the executor's modules) and draft.py's own
    non-layer roles (collapse, norm, logits head)."""
    table = builders(modules)
    for role, build in list(table.items()):
        if role.startswith(draft_stages.LAYER_GROUPS):
            table[draft_stages.PREFIX + role] = _on_draft_stage(role, build)
    for role, build in draft_stages.BUILDERS.items():
        if not role.removeprefix(draft_stages.PREFIX).startswith(draft_stages.LAYER_GROUPS):
            table[role] = build
    return table


def _on_draft_stage(role: str, build):
    def factory(ctx, layer):
        if layer is None or not layer.is_dspark:
            raise ValueError(f"draft.{role} runs at a DSpark stage layer, got layer "
                             f"{getattr(layer, 'index', None)}")
        return build(ctx, layer)
    return factory


def wire_with(plan: Plan, ctx, table: dict) -> Plan:
    """`wiring.wire` over a role table instead of module names."""
    layers = {spec.index: spec for spec in ctx.cfg.layers}
    return plan.wire_all({s.name: table[s.range_name](
        ctx, None if s.layer is None else layers[s.layer])
        for s in plan.missing_stages() if s.range_name in table})


def standin_collectives(ctx):
    """A collective state the Markov builders accept; its launches are dropped (`local_plan`),
    so its pointers (the never-written zeros of local_collectives) are never read."""
    from collectives.oneshot import CollectiveState

    zeros = ctx.ptr(local_collectives.ZEROS)
    return CollectiveState(ctx.rank, ctx.tp, {"peers": zeros, "control": zeros, "status": zeros},
                           timeout_us=1000)


def is_cross_rank(spec) -> bool:
    return getattr(spec.kernel, "record", spec.kernel).family == CROSS_RANK_FAMILY


def local_plan(plan: Plan) -> Plan:
    """`plan` with every cross-rank launch (the Markov steps' picks) left out of its stages."""
    def keep(build):
        return lambda rows: [s for s in build(rows) if not is_cross_rank(s)]
    return Plan([replace(s, build=keep(s.build)) if s.build else s for s in plan.stages])


def wire_round(cfg, ctx, modules=ROUND_MODULES) -> dict[str, Plan]:
    """The plans wired on `ctx` (its `collectives`, else the stand-in), complete: "verify" and
    "draft" (no row advance: replayed alone they keep the host's rows), "verify_sf" and
    "draft_sf" (sync_free: back to back they walk the rows themselves), "step" (the plain
    decode step, the verify's baseline)."""
    if ctx.collectives is None:
        ctx.collectives = standin_collectives(ctx)
    table = round_builders(modules)
    plans = {"verify": decode_plan(cfg, dspark=True), "draft": draft_plan(cfg),
             "verify_sf": decode_plan(cfg, dspark=True, sync_free=True),
             "draft_sf": draft_plan(cfg, sync_free=True), "step": decode_plan(cfg)}
    plans = {name: wire_with(plan, ctx, table) for name, plan in plans.items()}
    for plan in plans.values():
        plan.require_complete()
    return plans


@dataclass(frozen=True)
class Collectives:
    """The cross-rank calls of one plan at one bucket (the local stand-ins make none)."""

    allreduces: int
    gathers: int
    picks: int

    def latency_us(self, rows: int, table=None) -> float:
        """One-shot latency: all-reduces and gathers at the bucket's rows, picks at one row."""
        return ((self.allreduces + self.gathers) * bs.allreduce_us(rows, table)
                + self.picks * bs.allreduce_us(1, table))


def count_collectives(plan: Plan, rows: int, cfg) -> Collectives:
    """From the wired (not local) plan: the calls of the cross-rank roles (one a stage, but
    engram.kv_allgather's row chunks: two above 96 rows at TP 4) and the picks inside the
    Markov stages."""
    counts = {"allreduce": 0, "allgather": 0, "pick": 0}
    for stage, specs in plan.launches(rows):
        role = stage.range_name.removeprefix(draft_stages.PREFIX)
        if role in local_collectives.BUILDERS:
            kind = next((kind for kind in counts if kind in role), None)
            if kind is None:
                raise ValueError(f"{stage.name}: a cross-rank role that is no all-reduce, "
                                 f"all-gather or pick")
            counts[kind] += (len(kv_gather_chunks(cfg, bs.TP, rows))
                             if role == "engram.kv_allgather" else 1)
        else:
            counts["pick"] += sum(is_cross_rank(s) for s in specs)
    return Collectives(counts["allreduce"], counts["allgather"], counts["pick"])


# ---- bytes that must be read ------------------------------------------------------------------

def draft_kv_bytes(cfg, case: RoundCase, context: int) -> int:
    """Each DSpark stage's SWA window and the block's own k rows, per sequence."""
    stages = sum(1 for spec in cfg.layers if spec.is_dspark)
    return case.seqs * stages * (min(context, cfg.sliding_window) + case.k) * KV_RECORD_BYTES


def round_bytes(cfg, verify: PlanWeights, draft: PlanWeights, case: RoundCase, context: int,
                distinct_verify: list[int], distinct_draft: list[int]) -> tuple[int, int]:
    """(verify, draft) bytes that must be read at `context`: the step's formula for the verify
    (bs.step_bytes), and for the draft its weights, distinct experts, embedding and Markov
    rows (w1[prev], 256 bf16 a step and sequence) and its stages' KV."""
    engram_row = cfg.engram_head_dim + cfg.engram_head_dim // 32
    v = bs.step_bytes(cfg, bs.WeightBytes(verify.dense, verify.per_expert, engram_row),
                      case.verify, context, distinct_verify)
    markov_rows = case.k * case.seqs * cfg.dspark_markov_rank * 2
    d = (draft.dense + draft.per_expert * sum(distinct_draft)
         + case.draft_rows * cfg.hidden_size * 2 + markov_rows
         + draft_kv_bytes(cfg, case, context))
    return v, d


def tokens_per_s(tokens_per_round: float, round_us: float) -> float:
    """Tokens a second of one sequence: (accepted + 1) tokens each round."""
    return tokens_per_round / (round_us * 1e-6)


def acceptance_table(k: int, round_us: float) -> list[tuple[int, float]]:
    """[(accepted, tokens per second per sequence)] for accepted = 0..k."""
    return [(a, tokens_per_s(a + 1, round_us)) for a in range(k + 1)]


# ---- the benchmark (GPU) ----------------------------------------------------------------------

class DeviceRound(bs.DeviceStep):
    """The step benchmark's rank with the DSpark weights, tensors and both round plans."""

    def __init__(self, ctx, cfg, bundle, rounds, modules=ROUND_MODULES, rank: int = bs.RANK,
                 collectives=None):
        """On one GPU (no `collectives`): the local stand-ins, cross-rank picks left out. With
        a rank's one-shot `collectives` and cross-rank stage `modules` (executor/bench_tp.py):
        the real round, every pick and all-reduce across the ranks."""
        cases = [bs.Case(c.verify.rows, c.seqs, "verify") for c, _ in rounds]
        contexts = [t for _, ts in rounds for t in ts]
        geometry = bs.cache_geometry(cfg, cases, contexts, extra_tokens=ROUND_MARGIN)
        self.local = collectives is None
        super().__init__(ctx, cfg, bundle, modules, geometry, dspark=True, rank=rank,
                         collectives=collectives)

    def wire_plans(self, step) -> None:
        self.wired = wire_round(self.cfg, step, self.modules)
        self.plans = ({name: local_plan(plan) for name, plan in self.wired.items()}
                      if self.local else dict(self.wired))

    def distinct_experts(self, built, rows: int) -> list[int]:
        """Run `built` eagerly; after each router (backbone or draft stage), the distinct
        experts it picked for the `rows` rows (a host read: this pass is not timed, so it runs
        serial on one stream)."""
        out = []
        for stage, specs in built:
            for spec in specs:
                spec.launch(self.stream)
            if stage.range_name.removeprefix(draft_stages.PREFIX) == "ffn.router":
                layer = self.cfg.layer(stage.layer)
                k, experts = ((self.cfg.dspark_num_experts_per_tok,
                               self.cfg.dspark_n_routed_experts) if layer.is_dspark else
                              (self.cfg.num_experts_per_tok, self.cfg.n_routed_experts))
                self.stream.synchronize()
                ids = self.arena.download("ffn.topk_ids", np.int32, (rows * k,))
                if ids.min() < 0 or ids.max() >= experts:
                    raise RuntimeError(f"{stage.name}: expert ids outside 0..{experts - 1}: "
                                       f"{np.unique(ids)}")
                out.append(len(np.unique(ids)))
        self.stream.synchronize()
        return out

    def load_draft(self, case: RoundCase, context: int, seed: int = bs.SEED) -> None:
        """The draft rows of `case` (draft_batch) into the bound row tensors, `bonus` = anchors."""
        from executor.emulate.ranks import fill_caller_tensors

        rows, history, anchors = draft_batch(self.cfg, self.geometry, case, context,
                                             np.random.default_rng(seed + 1))
        host = {n: np.zeros(self.tensors[n].shape, self.tensors[n].dtype)
                for n in bs.metadata_names(self.cfg, self.geometry, dspark=True)}
        fill_caller_tensors(host, rows, history=history)
        bonus = np.full(self.tensors["bonus"].shape, -1, np.int64)
        bonus[:case.seqs] = anchors
        host["bonus"] = bonus
        for name, array in host.items():
            self.tensors[name].set(array)
        self.cp.cuda.Device().synchronize()

    def nonfinite(self, name: str, dtype, shape) -> int:
        values = self.arena.download(name, dtype, shape).astype(np.float32)
        return int(np.count_nonzero(~np.isfinite(values)))


def _time_round(stream, graphs, reps: int, warmup: int) -> dict[str, float]:
    """Medians over `reps` rounds of the draft graph then the verify graph, with events before,
    between and after: {"draft", "verify", "round"} in us."""
    from executor.cuda import check, driver

    cu = driver()
    flags = cu.CUevent_flags.CU_EVENT_DEFAULT
    events = [[check(cu.cuEventCreate(flags)) for _ in range(3)] for _ in range(reps)]
    try:
        for _ in range(warmup):
            graphs["draft"].launch(stream)
            graphs["verify"].launch(stream)
        for before, between, after in events:
            check(cu.cuEventRecord(before, stream.cu_handle))
            graphs["draft"].launch(stream)
            check(cu.cuEventRecord(between, stream.cu_handle))
            graphs["verify"].launch(stream)
            check(cu.cuEventRecord(after, stream.cu_handle))
        stream.synchronize()

        def median(i, j):
            return statistics.median(check(cu.cuEventElapsedTime(e[i], e[j])) * 1e3
                                     for e in events)
        return {"draft": median(0, 1), "verify": median(1, 2), "round": median(0, 2)}
    finally:
        for trio in events:
            for event in trio:
                check(cu.cuEventDestroy(event))


def bench_round(ctx) -> None:
    """The DSpark round per number of sequences and context (see the module docstring)."""
    cfg = bs.bench_config()
    rounds = selected_rounds(cfg.dspark_block_size)     # a bad CASES_ENV fails before packing
    bundle = bs.find_bundle(ctx, cfg)
    ar_table = bs._measured_allreduce(ctx)
    t0 = time.perf_counter()
    dev = DeviceRound(ctx, cfg, bundle, rounds)
    ctx.metric("round: host packing (8 of 40 layers, the DSpark stages, main_proj, Markov)",
               dev.pack_s, "s")
    ctx.metric("round: arena upload + cache set-up", dev.upload_s, "s")
    lines, speeds = [], []
    try:
        for case, contexts in rounds:
            lines += _bench_case(ctx, dev, cfg, case, contexts, ar_table, speeds)
    finally:
        dev.close()
    ctx.metric("round: benchmark wall time", time.perf_counter() - t0, "s")
    _print_tables(cfg, lines, speeds, "this run" if ar_table else "docs/perf.md run 16")


@dataclass(frozen=True)
class PlanCase:
    """What a case knows of its plans before timing: rows, launches, calls and weights."""

    rows: dict
    launches: dict
    calls: dict
    weights: dict


def plan_rows(case: RoundCase) -> dict[str, int]:
    """Rows each plan of wire_round is captured and timed at for `case`."""
    return {"verify": case.verify.rows, "draft": case.draft_rows, "step": case.verify.rows,
            "verify_sf": case.verify.rows, "draft_sf": case.draft_rows}


def capture_plans(dev, rows: dict[str, int], graphs: dict) -> dict:
    """Into `graphs` (its caller closes them, also when a later capture fails): one graph per
    plan of dev.plans at its rows, captured as the Executor does (Plan.record, the side stages
    on dev.side: executor/branches.py)."""
    for name, count in rows.items():
        graphs[name] = dev.capture(dev.plans[name], count)
    return graphs


def _bench_case(ctx, dev, cfg, case: RoundCase, contexts, ar_table, speeds) -> list[str]:
    rows = plan_rows(case)
    built = {name: dev.plans[name].launches(rows[name]) for name in rows}
    specs = {name: [s for _, group in built[name] for s in group] for name in rows}
    halves = ("verify", "draft")
    known = PlanCase(rows, {n: len(specs[n]) for n in rows},
                     {n: count_collectives(dev.wired[n], rows[n], cfg) for n in halves},
                     {n: plan_weights(cfg, dev.upload_bytes, touched_slices(specs[n], dev.arena))
                      for n in halves})
    graphs, lines = {}, []
    try:
        capture_plans(dev, rows, graphs)
        for context in contexts:
            times, distinct = _time_halves(ctx, dev, case, context, graphs, built)
            # back to back, sync-free: the rows walk themselves, but with the local picks every
            # token is 0 from the second round on (all rows route alike: fewer experts)
            dev.load(case.verify, context)
            graphs["verify_sf"].launch(dev.stream)        # the rows are the draft's now
            b2b = _time_round(dev.stream, {"draft": graphs["draft_sf"],
                                           "verify": graphs["verify_sf"]},
                              ROUND_REPS, WARMUP_ROUNDS)
            times["b2b"] = b2b["round"]
            lines.append(_report(ctx, dev, cfg, case, context, known, times, distinct,
                                 ar_table, speeds))
            if context == contexts[0]:                   # the draft barely sees the context
                dev.load_draft(case, context)
                _draft_roles(ctx, dev, built["draft"], f"round {case.label} draft",
                             times["draft"])
    finally:
        bs.close_graphs(graphs)
    return lines


def _time_halves(ctx, dev, case: RoundCase, context: int, graphs, built):
    """Each half alone on host-loaded rows with random tokens (as the step benchmark's), which
    neither half rewrites: the plain step and the verify at the verify rows, the draft at draft
    rows [anchor, noise x 4]; each after an eager pass that counts its distinct experts."""
    def median(graph):
        return ctx.timer.median_us(lambda: graph.launch(dev.stream), reps=bs.GRAPH_REPS)

    dev.load(case.verify, context)
    distinct = {"verify": dev.distinct_experts(built["verify"], case.verify.rows)}
    times = {"step": median(graphs["step"]), "verify": median(graphs["verify"])}
    dev.load_draft(case, context)
    distinct["draft"] = dev.distinct_experts(built["draft"], case.draft_rows)
    times["draft"] = median(graphs["draft"])
    times["round"] = times["verify"] + times["draft"]
    return times, distinct


def _draft_roles(ctx, dev, built, tag: str, graph_us: float) -> None:
    """The draft's roles, each alone in a graph (bench_step's breakdown; serial, one stream),
    but those that rewrite the bound rows (ROW_WRITERS: replayed alone they would walk the rows
    away); their time is in the graph minus the sum. Run after a round: the rows are the
    draft's."""
    groups = {role: group for role, group in bs.role_groups(built).items()
              if group and not role.startswith(ROW_WRITERS)}
    graphs = {}
    try:
        for role, group in groups.items():
            graphs[role] = bs._capture(dev.stream, group)
        bs._role_breakdown(ctx, dev, graphs, {r: len(g) for r, g in groups.items()}, tag,
                           graph_us)
    finally:
        for graph in graphs.values():
            graph.close()


def _report(ctx, dev, cfg, case: RoundCase, context: int, known: PlanCase, times: dict,
            distinct: dict, ar_table, speeds) -> str:
    """Metrics of one (case, context) and its table line; appends to `speeds`."""
    label = bs._context_label(context)
    tag, rows = f"round {case.label} ctx={label}", known.rows
    v_bytes, d_bytes = round_bytes(cfg, known.weights["verify"], known.weights["draft"], case,
                                   context, distinct["verify"], distinct["draft"])
    latency = {name: known.calls[name].latency_us(rows[name], ar_table) for name in distinct}
    with_ar = {name: times[name] + latency[name] for name in distinct}
    with_ar["round"] = times["round"] + sum(latency.values())
    row = ctx.bandwidth("DSpark round (rank 0 of TP4)", f"{case.label} {label}", rows["verify"],
                        times["round"], v_bytes + d_bytes)
    for name in ("round", "verify", "draft"):
        ctx.metric(f"{tag}: {name} graph", times[name], "us")
        ctx.metric(f"{tag}: {name} + AR", with_ar[name], "us")
    ctx.metric(f"{tag}: back-to-back sync-free round (zero tokens: rows route alike)",
               times["b2b"], "us")
    ctx.metric(f"{tag}: plain step graph at the verify rows", times["step"], "us")
    ctx.metric(f"{tag}: verify - plain step (the DSpark stages)", times["verify"] - times["step"],
               "us")
    for name, experts in distinct.items():
        c = known.calls[name]
        for what, count in (("launches", known.launches[name]), ("all-reduces", c.allreduces),
                            ("all-gathers", c.gathers), ("picks", c.picks)):
            ctx.metric(f"{tag}: {name} {what}", count, "")
        ctx.metric(f"{tag}: {name} distinct experts per layer (mean)", statistics.mean(experts),
                   "")
    floor = (v_bytes + d_bytes) / bs.HBM_BYTES_PER_S * 1e6
    ctx.metric(f"{tag}: HBM floor of its bytes at 4.8 TB/s", floor, "us")
    for name, al in ACCEPTANCE:
        ctx.metric(f"{tag}: tokens/s per sequence at {al} tokens a round ({name})",
                   tokens_per_s(al, with_ar["round"]), "tok/s")
    ctx.metric(f"{tag}: non-finite base logits U", dev.nonfinite(
        "dspark.base", np.float32, (case.draft_rows, cfg.vocab_size // bs.TP)), "")
    doc, pr = DOC_ROUND_FLOOR_MS.get(case.seqs), UPSTREAM_ITL_MS.get((case.seqs, label))
    speeds.append((f"{case.label} {label}", with_ar["round"], pr))
    return (f"{case.label:>3s} {label:>4s} {times['round']:>9.1f} {with_ar['round']:>9.1f} "
            f"{times['b2b']:>8.1f} {times['verify']:>9.1f} {with_ar['verify']:>9.1f} {times['step']:>9.1f} "
            f"{times['draft']:>8.1f} {with_ar['draft']:>8.1f} {v_bytes / 1e9:>6.2f} "
            f"{d_bytes / 1e9:>6.2f} {row.pct_hbm:>5.1f} {floor:>8.1f} "
            f"{f'{doc * 1e3:.0f}' if doc else '-':>5s} "
            f"{statistics.mean(distinct['verify']):>6.1f} "
            f"{statistics.mean(distinct['draft']):>5.1f} {f'{pr * 1e3:.0f}' if pr else '-':>6s}")


def _print_tables(cfg, lines: list[str], speeds, ar_source: str) -> None:
    k = cfg.dspark_block_size
    title = (f"DSpark round benchmark (rank 0 of TP4, 1 GPU, k = {k}: round = verify + draft "
             f"graphs, each alone on random-token rows; b2b: the sync-free graphs back to back, "
             f"zero tokens; "
             f"+ AR: one-shot all-reduces, gathers and picks from {ar_source}; step: the plain "
             f"decode step's graph at the verify rows; doc: model doc §4 round floor; "
             f"PR: the upstream PR's median ITL, executor on)")
    header = (f"{'c':>3s} {'ctx':>4s} {'round us':>9s} {'+AR us':>9s} {'b2b':>8s} {'verify':>9s} "
              f"{'+AR':>9s} {'step':>9s} {'draft':>8s} {'+AR':>8s} {'GB v':>6s} {'GB d':>6s} "
              f"{'%4.8':>5s} {'floor us':>8s} {'doc':>5s} {'exp v':>6s} {'exp d':>5s} "
              f"{'PR us':>6s}")
    speed_header = (f"{'case':>9s} " + " ".join(f"{f'a={a}':>7s}" for a in range(k + 1))
                    + " " + " ".join(f"{f'AL {al}':>8s}" for _, al in ACCEPTANCE)
                    + f" {f'PR AL {UPSTREAM_AL}':>10s}")
    out = [title, header, *lines, "",
           ("tokens/s per sequence from the round + AR time: (accepted + 1) / round; AL: "
            f"tokens a round (accepted + 1) of ACCEPTANCE; PR: {UPSTREAM_AL} / its median ITL"),
           speed_header]
    for name, round_us, pr in speeds:
        cells = [f"{v:>7.0f}" for _, v in acceptance_table(k, round_us)]
        cells += [f"{tokens_per_s(al, round_us):>8.0f}" for _, al in ACCEPTANCE]
        cells.append(f"{f'{tokens_per_s(UPSTREAM_AL, pr * 1e3):.0f}' if pr else '-':>10s}")
        out.append(f"{name:>9s} " + " ".join(cells))
    print("\n".join(out), flush=True)
