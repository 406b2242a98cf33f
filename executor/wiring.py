"""From the plan's named stages to launches on one rank's memory: buffers, weights, builders.

The step runs on one arena per rank (`Arena` on the GPU, `HostArena` under the CPU emulator)
holding three kinds of slices, all sized for `max_rows` and laid out before any capture:
- boundary buffers (`boundary_buffers`): what flows between kernel families, named here once so
  every family agrees: the residual streams, the packed mHC coefficients, the collapsed and
  normed sublayer input, each sublayer's per-rank partial and all-reduced output, the final
  hidden state and the rank's (value bits, index) argmax pair `pick`;
- stage scratch (a stage module's `buffers(cfg, tp, max_rows) -> [Buffer]`, names prefixed by
  the module's group), shared by every layer because layers run one after another;
- this rank's weights in the kernels' formats (a stage module's `weights(cfg, tp, rank, fetch,
  layers=None) -> [(name, ndarray)]`, checkpoint-derived names from `weight_prefix`, such as
  `layers.3.attn.wq_b.weight` or `mtp.0.attn.wq_b.weight` for a DSpark stage), the only copy;
  with a `layer_map` (the whole-rank benchmark) layers of one role share their representative's
  packed arrays, each layer still in its own slices.
The caller's tensors (KV caches, row metadata, outputs) are not in the arena: `StepContext.ptr`
finds them among the bound pointers.

A stage module (`executor/stages/<group>.py`, listed in STAGE_MODULES) maps stage roles (the
plan's range names, e.g. "attn.mhc_pre", "head.embed") to builders in `BUILDERS`: `fn(ctx, layer)
-> (rows -> [LaunchSpec])`, `layer` the LayerSpec (None for head and tail stages). `wire(plan,
ctx)` puts every registered builder into the plan.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from executor.plan import Plan
from kernels.common_ref import BF16

MHC_COEFFS = 24             # packed pre[4] | post[4] | comb[16] per row (kernels/mhc_kernel_ref.py)

# Modules with BUILDERS {role: fn(ctx, layer) -> (rows -> [LaunchSpec])} and optionally
# buffers(cfg, tp, max_rows) -> [Buffer] and weights(cfg, tp, rank, fetch, layers=None) ->
# [(name, ndarray)] (`layers`: the backbone layers whose per-layer weights to pack; None = all).
STAGE_MODULES: tuple[str, ...] = (
    "executor.stages.mhc",
    "executor.stages.attn_proj",
    "executor.stages.attn_index",
    "executor.stages.ffn",
    "executor.stages.collectives",
    "executor.stages.dspark",
    "executor.stages.draft",
)


@dataclass(frozen=True)
class Buffer:
    """One arena slice by dtype and shape."""

    name: str
    dtype: object
    shape: tuple[int, ...]
    comment: str = ""

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def request(self) -> tuple[str, int, str]:
        what = "bf16" if np.dtype(self.dtype) == np.dtype(BF16) else np.dtype(self.dtype).name
        return (self.name, self.nbytes, f"{what} {list(self.shape)} {self.comment}".rstrip())


def boundary_buffers(cfg, tp: int, max_rows: int) -> list[Buffer]:
    """The buffers between kernel families (replicated values are computed on every rank)."""
    r, d, s = max_rows, cfg.hidden_size, cfg.hc_mult
    engram = []
    if cfg.engram_layer_ids:
        heads = cfg.engram_num_hash_cols * cfg.engram_head_dim
        engram = [Buffer("engram.local_heads", BF16, (r, heads // tp),
                         "this rank's looked-up Engram heads"),
                  Buffer("engram.heads", BF16, (r, heads), "every rank's heads (all-gathered)"),
                  Buffer("engram.kv_local", BF16, (r, (s + 1) * d // tp),
                         "this rank's wkv output columns (engram_kernel_ref.kv_rank_rows)"),
                  Buffer("engram.kv", BF16, (r, (s + 1) * d),
                         "wkv output (all-gathered): n keys, then v")]
    return engram + [
        Buffer("streams", BF16, (r, s, d), "residual streams X"),
        Buffer("coeff.attn", np.float32, (r, MHC_COEFFS), "attention sublayer's mHC pre|post|comb"),
        Buffer("coeff.ffn", np.float32, (r, MHC_COEFFS), "FFN sublayer's mHC pre|post|comb"),
        Buffer("x", BF16, (r, d), "collapsed sublayer input"),
        Buffer("xn", BF16, (r, d), "normed sublayer input"),
        Buffer("embed.partial", BF16, (r, d), "this rank's vocab rows of the embedding"),
        Buffer("embed.out", BF16, (r, d), "the embedding (all-reduced)"),
        Buffer("attn.partial", BF16, (r, d), "this rank's wo_b output"),
        Buffer("attn.out", BF16, (r, d), "attention output (all-reduced)"),
        Buffer("ffn.partial", BF16, (r, d), "this rank's routed + shared expert output"),
        Buffer("ffn.out", BF16, (r, d), "FFN output (all-reduced)"),
        Buffer("hidden", BF16, (r, d), "final normed hidden state"),
        Buffer("pick", np.int32, (r, 2), "this rank's best logit per row (f32 bits) and its "
               "global vocab index: the lm_head argmax output"),
    ]


def byte_tensor(array, name: str) -> np.ndarray:
    """A 1-byte checkpoint format (E4M3 codes, UE8M0 scales) as the raw bytes kernels read."""
    array = np.asarray(array)
    if array.dtype.itemsize != 1:
        raise TypeError(f"{name}: expected a 1-byte format (E4M3 / UE8M0), got {array.dtype}")
    return array.view(np.uint8)


def _modules(names: Sequence[str] | None):
    return [importlib.import_module(n) for n in (STAGE_MODULES if names is None else names)]


class StepContext:
    """What a stage builder needs: the config, this rank, the bundle, the arena, bound pointers."""

    def __init__(self, cfg, tp: int, rank: int, bundle, arena, bound: Mapping[str, int],
                 max_rows: int, collectives=None, geometry=None):
        self.cfg, self.tp, self.rank = cfg, tp, rank
        self.shapes = cfg.rank_shapes(tp)
        self.bundle, self.arena, self.bound = bundle, arena, dict(bound)
        self.max_rows = max_rows
        self.geometry = geometry            # the caller's KV-cache CacheGeometry
        self.collectives = collectives      # this rank's all-reduce (GPU), or None
        self.peers = None                   # every rank's StepContext, when all live in one process
        clash = sorted(set(self.bound) & set(arena.slices))
        if clash:
            raise ValueError(f"StepContext: names both bound by the caller and in the arena: {clash}")

    def ptr(self, name: str) -> int:
        if name in self.arena.slices:
            return self.arena.ptr(name)
        try:
            return self.bound[name]
        except KeyError:
            raise KeyError(f"step buffer {name!r} is neither an arena slice nor a bound tensor "
                           f"(bound: {sorted(self.bound)})") from None

    def kernel(self, name: str):
        return self.bundle.kernel(name)


def weight_prefix(cfg, spec) -> str:
    """The checkpoint prefix of a layer's weights: `layers.{i}.` for a backbone layer, `mtp.{s}.`
    for DSpark stage s (layer cfg.num_hidden_layers + s)."""
    if spec.is_dspark:
        return f"mtp.{spec.index - cfg.num_hidden_layers}."
    return f"layers.{spec.index}."


def packed_layers(cfg, layers=None) -> list:
    """The LayerSpecs whose per-layer weights the stage modules pack: those in `layers` (None:
    every backbone layer, and the DSpark stages when the config drafts with them)."""
    if layers is not None:
        return [spec for spec in cfg.layers if spec.index in layers]
    return [spec for spec in cfg.layers if not spec.is_dspark] + _drafting_stages(cfg)


def _drafting_stages(cfg) -> list:
    """The DSpark stages, when the config drafts with them (it names target layers)."""
    if not cfg.dspark_target_layer_ids:
        return []
    return [spec for spec in cfg.layers if spec.is_dspark]


def representatives(cfg) -> dict[int, int]:
    """backbone layer -> its representative: the first layer of the same role (LayerSpec without
    its index and sources, plus "is the first layer", whose mHC fn is stored summed). Layers of
    one role have weights of the same names, shapes and formats, so a benchmark can pack the
    representative's once and give every layer of the role its own copy (arena_contents)."""
    first = _first_backbone(cfg)
    out, seen = {}, {}
    for spec in cfg.layers:
        if spec.is_dspark:
            continue
        role = _role(spec, first)
        out[spec.index] = seen.setdefault(role, spec.index)
    return out


def _first_backbone(cfg) -> int:
    return min(spec.index for spec in cfg.layers if not spec.is_dspark)


def _role(spec, first: int) -> tuple:
    fields = dataclasses.asdict(spec)
    for name in ("index", "kv_source", "topk_source"):
        del fields[name]
    return (*fields.items(), ("is_first", spec.index == first))


def _check_layer_map(cfg, layer_map: Mapping[int, int]) -> list[int]:
    """The representatives of a valid layer map (every backbone layer mapped to a layer of its
    role that maps to itself); ValueError naming the first bad entry otherwise."""
    first = _first_backbone(cfg)
    roles = {spec.index: _role(spec, first) for spec in cfg.layers if not spec.is_dspark}
    if set(layer_map) != set(roles):
        raise ValueError(f"layer_map covers layers {sorted(layer_map)}; expected every backbone "
                         f"layer {sorted(roles)}")
    for layer, rep in sorted(layer_map.items()):
        if rep not in roles or layer_map[rep] != rep or roles[rep] != roles[layer]:
            raise ValueError(f"layer_map: layer {layer} -> {rep}, which is not a representative "
                             f"of the same role (it must map to itself and share the LayerSpec "
                             f"role: see representatives())")
    return sorted(set(layer_map.values()))


def _per_layer(name: str) -> tuple[int, str] | None:
    """'layers.12.attn.wq_b.weight' -> (12, 'attn.wq_b.weight'); None for a global name."""
    head, _, rest = name.partition(".")
    index, _, tail = rest.partition(".")
    return (int(index), tail) if head == "layers" and index.isdigit() and tail else None


def arena_contents(cfg, tp: int, rank: int, fetch, max_rows: int,
                   modules: Sequence[str] | None = None,
                   layer_map: Mapping[int, int] | None = None):
    """(requests, uploads): every slice of one rank's arena and the host arrays to put in them.

    layer_map (layer -> representative, see representatives()): the stage modules pack the
    representatives' weights only (`weights(..., layers=...)`), and every layer mapped to one
    gets its own slices holding the same bytes (the same array object, uploaded once per layer).
    The uploads then hold the representatives' arrays and the global ones, not the whole rank;
    without a layer_map they hold every array of the rank (sizes are needed before packing).
    The DSpark stages (`mtp.{s}.` names) are packed as themselves either way.
    """
    buffers = boundary_buffers(cfg, tp, max_rows)
    mods = _modules(modules)
    for mod in mods:
        if hasattr(mod, "buffers"):
            buffers += mod.buffers(cfg, tp, max_rows)
    requests = [b.request() for b in buffers]
    uploads = []
    reps = None
    if layer_map is not None:
        reps = _check_layer_map(cfg, layer_map) + [s.index for s in _drafting_stages(cfg)]
    copies: dict[int, list[int]] = {}
    for layer, rep in sorted((layer_map or {}).items()):
        if layer != rep:
            copies.setdefault(rep, []).append(layer)
    for mod in mods:
        for name, array in _weights(mod, cfg, tp, rank, fetch, reps):
            array = np.ascontiguousarray(array)
            per_layer = _per_layer(name)
            layers = [None] if per_layer is None else [per_layer[0], *copies.get(per_layer[0], ())]
            for layer in layers:
                slice_name = name if layer is None else f"layers.{layer}.{per_layer[1]}"
                requests.append((slice_name, max(array.nbytes, 1),
                                 f"{array.dtype} {list(array.shape)}"))
                uploads.append((slice_name, array))
    return requests, uploads


def _weights(mod, cfg, tp: int, rank: int, fetch, layers):
    if not hasattr(mod, "weights"):
        return ()
    if layers is None:
        return mod.weights(cfg, tp, rank, fetch)
    if "layers" not in inspect.signature(mod.weights).parameters:
        raise TypeError(f"{mod.__name__}.weights() takes no `layers` argument: it cannot pack "
                        f"representative layers only (arena_contents(layer_map=...))")
    return mod.weights(cfg, tp, rank, fetch, layers=layers)


def builders(modules: Sequence[str] | None = None) -> dict[str, Callable]:
    """role -> builder over the stage modules; a role claimed twice is an error."""
    out: dict[str, Callable] = {}
    for mod in _modules(modules):
        for role, fn in mod.BUILDERS.items():
            if role in out:
                raise ValueError(f"stage role {role!r} has builders in two modules "
                                 f"({out[role].__module__}, {mod.__name__})")
            out[role] = fn
    return out


def wire(plan: Plan, ctx: StepContext, modules: Sequence[str] | None = None) -> Plan:
    """The plan with every stage whose role has a builder wired on `ctx`."""
    table = builders(modules)
    layers = {spec.index: spec for spec in ctx.cfg.layers}
    builds = {}
    for stage in plan.missing_stages():
        fn = table.get(stage.range_name)
        if fn is not None:
            builds[stage.name] = fn(ctx, None if stage.layer is None else layers[stage.layer])
    return plan.wire_all(builds)
