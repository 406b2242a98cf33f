"""The tensors a caller binds to an Executor: the expected set, its validation, the recorded pointers.

`binding_rules(cfg, tp, geometry)` lists every tensor `Executor.bind(**tensors)` takes, with its
dtype and shape from the model config and the KV-cache geometry (the layouts of
`executor/reference/kvcache.py` and `rows.py`, sized for MAX_ROWS rows):

    per row      token_ids int64 [192], positions int64 [192], slot_mapping int64 [192] (-1 pad),
                 seq_index int32 [192] (-1 pad), block_kind int8 [192] (rows.KIND_*),
                 token_history int64 [192, max_ngram - 1] (Engram lookback; only with Engram)
    per sequence state_lines int32 [192], context_lens int64 [192],
                 block_tables int32 [192, pages_per_seq]
    caches       swa_{l} uint8 [max_seqs * ring_slots, 584] for every layer l (DSpark stages too);
                 compressed_{k} uint8 [num_pages * page_size, 584],
                 index_keys_{k} uint8 [num_pages * page_size, 132] for every kv source k;
                 compressor_ring_{k} float32 [max_seqs, ring_rows, 1024] for ratio-2 sources
    outputs      tokens int64 [192]; optional logits float32 [192, vocab / tp] (this rank's shard)
    DSpark       (binding_rules(..., dspark=True): an executor that runs DSpark rounds)
                 accepted int32 [192], bonus int64 [192]: per sequence of the verify step, the
                 drafts accepted and the bonus token (kernels/dspark_ref.py), written on the
                 device; the caller reads them when it wants (no host read inside the round)

Padding rows: a step of n rows replays the graph of bucket b >= n, whose kernels also process rows
n..b-1. The caller owns those rows' metadata and must mark them padding, as vLLM does
(PAD_SLOT_ID) and as `RowBatch.from_blocks(pad_to=b)` does: slot_mapping -1 and seq_index -1, so
they write no KV slot. The executor cannot check this in `step` (it would be a device read).

`validate_binding` checks each tensor's DLPack view (dtype, exact shape, device, 16-byte
alignment, row-major contiguity) and that no two bound tensors overlap, then returns a `Binding`;
it raises before returning anything, so a failed bind changes nothing. Per-sequence arrays are
sized for 192 sequences because a step of 192 one-row sequences is legal.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from types import MappingProxyType

from executor.dlpack import KDL_CUDA, DLPackError, TensorView, describe, device_name

MAX_ROWS = 192
ALIGN_BYTES = 16   # 16-byte vector loads; DLPack producers (CuPy, torch) give 256 at offset 0
KV_RECORD_BYTES = 584
INDEX_RECORD_BYTES = 132
RING_WIDTH = 1024  # fp32 kv | score


class BindError(ValueError):
    """A bound tensor is missing, unexpected or unusable; the message names it and what was
    expected. Raised before anything is recorded."""


@dataclass(frozen=True)
class CacheGeometry:
    """Sizes of the caller's KV caches (see executor/reference/kvcache.py)."""

    max_seqs: int        # state lines of the SWA and compressor rings
    ring_slots: int      # SWA slots per state line (pow2 >= window + max block rows)
    ring_rows: int       # compressor ring rows per state line (pow2 >= max block rows + 2)
    page_size: int       # entries per page of the paged compressed caches
    num_pages: int       # pages in each paged cache
    pages_per_seq: int   # block table width

    def __post_init__(self):
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"CacheGeometry.{name} must be a positive int, got {value!r}")

    @classmethod
    def of(cls, caches) -> CacheGeometry:
        """The geometry of a reference `KVCaches` (what a test binds mirrors of)."""
        tables = caches.block_tables
        return cls(max_seqs=caches.max_seqs, ring_slots=caches.ring_slots,
                   ring_rows=caches.ring_rows, page_size=caches.page_size,
                   num_pages=int(tables.size), pages_per_seq=int(tables.shape[1]))


@dataclass(frozen=True)
class TensorRule:
    name: str
    dtype: str
    shape: tuple[int, ...]
    required: bool = True

    def expected(self) -> str:
        return f"{self.dtype} {list(self.shape)}"


def binding_rules(cfg, tp: int, geometry: CacheGeometry, max_rows: int = MAX_ROWS,
                  dspark: bool = False) -> dict[str, TensorRule]:
    """Every tensor bind() takes, by name, in a stable order (see the module docstring)."""
    if cfg.vocab_size % tp:
        raise ValueError(f"vocab_size {cfg.vocab_size} is not divisible by tp={tp}")
    if dspark and not cfg.dspark_target_layer_ids:
        raise ValueError("binding_rules(dspark=True): this model config has no DSpark stages "
                         "(dspark_target_layer_ids is empty)")
    g, r = geometry, max_rows
    entries = g.num_pages * g.page_size
    rules = [TensorRule("token_ids", "int64", (r,)), TensorRule("positions", "int64", (r,)),
             TensorRule("slot_mapping", "int64", (r,)), TensorRule("seq_index", "int32", (r,)),
             TensorRule("block_kind", "int8", (r,)), TensorRule("state_lines", "int32", (r,)),
             TensorRule("context_lens", "int64", (r,)),
             TensorRule("block_tables", "int32", (r, g.pages_per_seq))]
    if cfg.engram_layer_ids:
        rules.append(TensorRule("token_history", "int64", (r, cfg.engram_max_ngram_size - 1)))
    for spec in cfg.layers:
        rules.append(TensorRule(f"swa_{spec.index}", "uint8",
                                (g.max_seqs * g.ring_slots, KV_RECORD_BYTES)))
    for spec in cfg.layers:
        if spec.owns_compressor:
            rules.append(TensorRule(f"compressed_{spec.index}", "uint8",
                                    (entries, KV_RECORD_BYTES)))
            rules.append(TensorRule(f"index_keys_{spec.index}", "uint8",
                                    (entries, INDEX_RECORD_BYTES)))
            if spec.ratio == 2:
                rules.append(TensorRule(f"compressor_ring_{spec.index}", "float32",
                                        (g.max_seqs, g.ring_rows, RING_WIDTH)))
    rules.append(TensorRule("tokens", "int64", (r,)))
    rules.append(TensorRule("logits", "float32", (r, cfg.vocab_size // tp), required=False))
    if dspark:
        rules += [TensorRule("accepted", "int32", (r,)), TensorRule("bonus", "int64", (r,))]
    return {rule.name: rule for rule in rules}


@dataclass(frozen=True, eq=False)
class Binding:
    """Validated raw addresses of every bound tensor, plus the producer objects kept alive."""

    pointers: MappingProxyType          # name -> int device address
    views: MappingProxyType             # name -> TensorView
    owners: tuple                       # the caller's objects: their memory must outlive us

    def ptr(self, name: str) -> int:
        try:
            return self.pointers[name]
        except KeyError:
            raise KeyError(f"no tensor {name!r} is bound; bound: {sorted(self.pointers)}") from None


def _check_one(rule: TensorRule, view: TensorView, device: tuple[int, int]) -> None:
    where = f"bind: tensor {rule.name!r}"
    if (view.device_type, view.device_id) != device:
        raise BindError(f"{where} lives on {view.device}; expected the executor's device "
                        f"{device_name(*device)}")
    if view.dtype != rule.dtype or view.shape != rule.shape:
        raise BindError(f"{where}: expected {rule.expected()}, got {view.dtype} "
                        f"{list(view.shape)}")
    if not view.is_compact():
        raise BindError(f"{where}: expected a row-major contiguous tensor, got strides "
                        f"{list(view.strides)} (elements) for shape {list(view.shape)}")
    if view.address == 0:
        raise BindError(f"{where}: data pointer is null")
    if view.address % ALIGN_BYTES:
        raise BindError(f"{where}: address {view.address:#x} is not {ALIGN_BYTES}-byte aligned")


def _check_disjoint(views: dict[str, TensorView]) -> None:
    spans = sorted((v.address, v.address + v.nbytes, n) for n, v in views.items())
    for (_s0, end0, name0), (start1, _e1, name1) in itertools.pairwise(spans):
        if start1 < end0:
            raise BindError(f"bind: tensors {name0!r} and {name1!r} overlap in memory; every "
                            f"bound tensor needs its own bytes")


def validate_binding(rules: dict[str, TensorRule], tensors: dict,
                     device: tuple[int, int]) -> Binding:
    """Check every tensor against its rule; return the Binding or raise BindError (no effect).

    `device` is the DLPack (device_type, device_id) the tensors must live on: (KDL_CUDA, ordinal)
    for an executor; tests of the rules alone pass (KDL_CPU, 0) to bind numpy arrays.
    """
    unknown = sorted(set(tensors) - set(rules))
    if unknown:
        raise BindError(f"bind: unexpected tensor(s) {unknown}; this executor binds "
                        f"{list(rules)}")
    missing = [n for n, rule in rules.items() if rule.required and n not in tensors]
    if missing:
        raise BindError(f"bind: missing tensor(s) {missing}; expected "
                        + ", ".join(f"{n}: {rules[n].expected()}" for n in missing))
    views = {}
    for name, obj in tensors.items():
        try:
            view = describe(obj, name)
        except DLPackError as exc:
            raise BindError(str(exc)) from None
        _check_one(rules[name], view, device)
        views[name] = view
    _check_disjoint(views)
    return Binding(pointers=MappingProxyType({n: v.address for n, v in views.items()}),
                   views=MappingProxyType(views), owners=tuple(tensors.values()))


def cuda_device(ordinal: int) -> tuple[int, int]:
    return (KDL_CUDA, int(ordinal))
