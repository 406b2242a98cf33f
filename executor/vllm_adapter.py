"""What a torch engine (vLLM) needs to use hopdec: the opt-in switch, one rank's backend, the decision.

    if decode_backend_enabled(vllm_config.additional_config):     # '{"decode_backend": ...}'
        backend = HopdecBackend.open(config_json, bundle_dir, weights, tp=4, rank=r,
                                     geometry=geometry, device_ordinal=local_rank,
                                     exchange=all_gather_bytes)    # the TP group's
        backend.bind(input_ids=ids64, positions=positions[:192], ..., sampled_token_ids=out)
        backend.capture()                               # once, outside the engine's own capture
    # per decode step, on the host, without reading the device:
    decision = backend.decide(num_scheduled_tokens, any_prefill=..., features=step_features(...))
    code = backend.step(decision.n_rows, stream, decision.features) if decision.use_hopdec \
        else decision.reason
    if code:                                            # declined: nothing written
        log(fallback_reason(code)); run_stock_path()

DSpark k = 5 (vLLM's spec decode, num_speculative_tokens = 5): open with `dspark=True` and bind
`num_accepted_tokens` and `bonus_token_ids` too. A round drafts on the device and then verifies,
so the engine asks for the round, not for a step, and writes nothing between rounds (the rows,
the lookback and `bonus` once, after prefill: docs/notes/dspark-round.md):

    decision = backend.decide_round(num_scheduled_tokens, any_prefill=..., features=...)
    code = backend.round(decision.n_seqs, stream, decision.features) if decision.use_hopdec \
        else decision.reason
    # later, after the stream: num_accepted_tokens[s], bonus_token_ids[s], and the committed
    # tokens sampled_token_ids[s * 6 + j] for j = 0..num_accepted_tokens[s]

Names: `bind` takes vLLM's names for the engine's tensors; VLLM_NAMES maps each to the binding
name of executor/bind.py (the table is in the README, "Using hopdec from vLLM"). Every tensor is
bound in place through DLPack, so the executor reads and writes the engine's own memory. A tensor
that would need a conversion first (another dtype, a non-contiguous view, host memory) is refused,
naming the tensor and the layout hopdec needs: a converted copy would be made once, at bind, and
never see what the engine writes afterwards. When the memory is right and only the shape is not
(a longer persistent buffer, cache blocks not flattened), the message names the view that fits;
views share memory, so they cost nothing.

Stream: `step` takes the raw cudaStream_t of the engine's current stream as an int,
`torch.cuda.current_stream().cuda_stream` (about 8 us in torch: read it once per step, or once
for good when the engine keeps one decode stream). torch's default stream is the legacy default
stream (handle 0), which hopdec refuses because it serialises with every blocking stream: run
decode under `with torch.cuda.stream(decode_stream):`, a `torch.cuda.Stream()` of the engine.
`step` replays graphs hopdec captured itself; calling it while the engine captures its own CUDA
graph (vLLM's FULL cudagraph mode) has not been verified, so serve hopdec steps outside it.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from executor.bind import BindError, CacheGeometry, TensorRule, cuda_device
from executor.dlpack import DLPackError, TensorView, describe, device_name
from executor.executor import Executor
from executor.graphs import BUCKETS
from executor.reasons import StepFeature, StepResult
from executor.vllm_decide import (
    RoundDecision,
    StepDecision,
    decide_round,
    decide_step,
    fallback_reason,
    step_features,
)

__all__ = [
    "DECODE_BACKEND_KEY",
    "LATENCY_SPECIALIZED",
    "VLLM_NAMES",
    "HopdecBackend",
    "NameRule",
    "RoundDecision",
    "StepDecision",
    "decide_round",
    "decide_step",
    "decode_backend_enabled",
    "fallback_reason",
    "step_features",
    "vllm_name_map",
]

# ---- the opt-in switch -----------------------------------------------------------------------

DECODE_BACKEND_KEY = "decode_backend"
LATENCY_SPECIALIZED = "latency_specialized"


def decode_backend_enabled(additional_config) -> bool:
    """Whether vLLM's `additional_config` opts in: `{"decode_backend": "latency_specialized"}`.

    Takes what vLLM holds (`VllmConfig.additional_config`, a dict) or the JSON text of
    `--additional-config`. The key absent (or null) means vLLM's stock path; any other value is
    an error naming the key, so a misspelt opt-in never silently runs the stock path. Other keys
    belong to vLLM or other plugins and are ignored.
    """
    if additional_config is None:
        return False
    if isinstance(additional_config, (str, bytes)):
        try:
            additional_config = json.loads(additional_config)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"--additional-config is not valid JSON ({exc}); expected e.g. "
                             f"'{{\"{DECODE_BACKEND_KEY}\": \"{LATENCY_SPECIALIZED}\"}}'") from None
    if not isinstance(additional_config, Mapping):
        raise TypeError(f"additional_config must be a JSON object (dict), got "
                        f"{type(additional_config).__name__}")
    value = additional_config.get(DECODE_BACKEND_KEY)
    if value is None:
        return False
    if value != LATENCY_SPECIALIZED:
        raise ValueError(f"additional_config[{DECODE_BACKEND_KEY!r}] = {value!r}: expected "
                         f"{LATENCY_SPECIALIZED!r}, or the key left out for vLLM's stock path")
    return True


# ---- names: vLLM's tensors -> hopdec's bindings ----------------------------------------------


@dataclass(frozen=True)
class NameRule:
    """One row of the mapping: `{i}` stands for a layer (caches) or kv-source index."""

    vllm: str      # the keyword HopdecBackend.bind takes
    hopdec: str    # the binding name of executor/bind.py
    source: str    # what the engine binds there


VLLM_NAMES: tuple[NameRule, ...] = (
    NameRule("input_ids", "token_ids", "the step's token ids; vLLM's InputBuffers.input_ids is "
             "int32, so keep an int64 [192] buffer the engine writes them to"),
    NameRule("positions", "positions", "InputBuffers.positions[:192] (int64 already)"),
    NameRule("slot_mapping", "slot_mapping", "the SWA slot each row writes: state_line * "
             "ring_slots + position % ring_slots; PAD_SLOT_ID (-1) for padding rows"),
    NameRule("req_indices", "seq_index", "each row's request in batch order, int32, -1 for "
             "padding (np.repeat(arange(num_reqs), num_scheduled_tokens), on the device)"),
    NameRule("spec_block_kind", "block_kind", "each row's block: 0 decode, 1 DSpark verify, "
             "2 DSpark draft (executor/reference/rows.py KIND_*)"),
    NameRule("token_history", "token_history", "the n-1 tokens before each row's position "
             "(Engram lookback), newest first"),
    NameRule("req_state_indices", "state_lines", "each request's line in the per-request "
             "state (SWA rings, compressor rings), as vLLM's idx_mapping (int64 there: keep an "
             "int32 [192] buffer)"),
    NameRule("seq_lens", "context_lens", "positions with KV after the step; vLLM's "
             "InputBuffers.seq_lens is int32, so keep an int64 [192] buffer"),
    NameRule("block_table", "block_tables", "the compressed-KV pages of each request, int32 "
             "[192, pages_per_seq]; -1 = no page"),
    NameRule("swa_kv_cache_{i}", "swa_{i}", "layer i's SWA ring, 584-byte records, "
             "[max_seqs * ring_slots, 584] uint8 (a flat view of [lines, ring_slots, 584])"),
    NameRule("compressed_kv_cache_{i}", "compressed_{i}", "kv source i's compressed entries, "
             "[num_pages * page_size, 584] uint8 (a flat view of [pages, page_size, 584])"),
    NameRule("indexer_k_cache_{i}", "index_keys_{i}", "kv source i's index keys, "
             "[num_pages * page_size, 132] uint8 (a flat view of [pages, page_size, 132])"),
    NameRule("compressor_state_{i}", "compressor_ring_{i}", "ratio-2 source i's compressor "
             "ring, float32 [max_seqs, ring_rows, 1024]"),
    NameRule("sampled_token_ids", "tokens", "the greedy token of each row (output), int64"),
    NameRule("logits", "logits", "optional output: this rank's vocab shard, float32 [192, "
             "vocab / tp], before vLLM's tensor-parallel gather"),
    NameRule("num_accepted_tokens", "accepted", "DSpark output: drafts each request's verify "
             "block accepted, int32, written on the device (read it when wanted)"),
    NameRule("bonus_token_ids", "bonus", "DSpark output: each request's bonus token, int64"),
)


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(re.escape("{i}"), r"(\d+)") + r"\Z")


def vllm_name_map(rules: Mapping[str, TensorRule]) -> dict[str, str]:
    """vLLM name -> binding name for every binding in `rules` (binding_rules' order).

    Raises ValueError when a binding matches no row or several rows of VLLM_NAMES: the table
    must follow executor/bind.py."""
    out = {}
    for name in rules:
        hits = []
        for row in VLLM_NAMES:
            match = _pattern(row.hopdec).match(name)
            if match:
                hits.append(row.vllm.replace("{i}", match.group(1)) if match.groups()
                            else row.vllm)
        if len(hits) != 1:
            raise ValueError(f"binding {name!r} matches {len(hits)} rows of VLLM_NAMES "
                             f"({hits}); expected exactly one")
        out[hits[0]] = name
    return out


def _view_hint(vllm: str, got: tuple[int, ...], want: tuple[int, ...]) -> str:
    """The zero-copy view of a compact tensor that has the wanted shape, if there is one."""
    if len(got) == len(want) and got[1:] == want[1:] and got[0] > want[0]:
        return f" Bind {vllm}[:{want[0]}]: a view of the same memory, no copy."
    count = 1
    for d in got:
        count *= d
    need = 1
    for d in want:
        need *= d
    if count == need:
        return (f" Bind {vllm}.view({', '.join(map(str, want))}): the same memory, "
                f"reshaped, no copy.")
    return ""


def _copy_needed(vllm: str, hopdec: str, rule: TensorRule, view: TensorView,
                 device: tuple[int, int]) -> str | None:
    """Why `view` cannot be bound in place as `rule` (what hopdec needs), or None."""
    where = f"bind: vLLM tensor {vllm!r} (hopdec {hopdec!r})"
    need = (f"hopdec needs {rule.dtype} {list(rule.shape)}, row-major contiguous, on "
            f"{device_name(*device)}")
    later = "the executor would read a copy made once, never what the engine writes later"
    if (view.device_type, view.device_id) != device:
        return f"{where} lives on {view.device}; {need}. Moving it would copy: {later}."
    if view.dtype != rule.dtype:
        return (f"{where} is {view.dtype}; {need}. Converting it would copy: {later}. "
                f"Allocate a persistent {rule.dtype} tensor of that shape for the engine to "
                f"write.")
    if not view.is_compact():
        return (f"{where} has strides {list(view.strides)} (elements) for shape "
                f"{list(view.shape)}; {need}. .contiguous() would copy: {later}.")
    if view.shape != rule.shape:
        return f"{where} has shape {list(view.shape)}; {need}." + _view_hint(
            vllm, view.shape, rule.shape)
    return None


# ---- one rank's backend --------------------------------------------------------------------

_LEGACY_STREAMS = (0, 1)   # the legacy default stream: 0, and CU_STREAM_LEGACY (1)


class HopdecBackend:
    """One TP rank's hopdec for a torch engine: owns its Executor (and, from `open`, the
    Device and the bundle). Not thread-safe, like the Executor: one engine thread."""

    def __init__(self, executor: Executor, device=None, allreduce=None, exchange=None):
        """Wrap an Executor (tests, custom plans); `device` and `allreduce` (the one-shot
        all-reduce behind the executor's comm, with its `exchange`) are closed with it."""
        self.executor = executor
        self.names = vllm_name_map(executor.rules)       # vLLM name -> binding name
        self._hopdec_to_vllm = {h: v for v, h in self.names.items()}
        self._device, self._allreduce, self._exchange = device, allreduce, exchange
        self._closed = False
        self._max_block_rows = executor.config.dspark_block_size + 1

    @classmethod
    def open(cls, config, bundle_dir, weights, *, tp: int, rank: int, geometry: CacheGeometry,
             device_ordinal: int, comm=None, exchange=None, timeout_ms: int | None = None,
             ranges=None, dspark: bool = False, buckets=BUCKETS) -> HopdecBackend:
        """Build the rank's executor: `config` a ModelConfig or the model's config.json path,
        `bundle_dir` the kernel bundle (python -m kernels.build), `weights` the rank's weights
        (a `fetch(name) -> ndarray` of its slices, e.g. `lambda n: shard(ckpt, ckpt.spec(n),
        tp, rank)`, or a RankWeights), `dspark` whether it serves DSpark rounds (vLLM's spec
        decode; bind then takes num_accepted_tokens and bonus_token_ids too), `buckets` the row
        buckets captured (the largest 192; DSpark: slot buckets b // 6 of them).

        Collectives (tp > 1): `exchange`, an all-gather of bytes over the TP group (`exchange(b)
        -> [b of rank 0, ..., b of rank tp-1]`, e.g. over torch.distributed.all_gather_object),
        sets up the one-shot all-reduce (collectives/oneshot.py, `timeout_ms` its poll limit);
        then open, capture and close are collective: every rank calls them. Or `comm`, a
        CollectiveState the caller made and owns. The config and manifest are validated before
        the GPU is touched; on any failure what was opened is closed."""
        from executor.bundle import BundleError, read_manifest

        if comm is not None and exchange is not None:
            raise ValueError("HopdecBackend.open: pass comm= (a CollectiveState) or exchange= "
                             "(hopdec sets up its all-reduce), not both")
        cfg = _model_config(config)
        manifest = read_manifest(bundle_dir)
        if manifest.tp and manifest.tp != tp:
            raise BundleError(f"{manifest.path}: built for tp={manifest.tp}, the engine runs "
                              f"tp={tp}")
        from executor.runtime import Bundle, Device

        device = Device(device_ordinal)
        bundle = allreduce = None
        try:
            bundle = Bundle.load(device, bundle_dir)
            if exchange is not None:
                from collectives.oneshot import DEFAULT_TIMEOUT_MS, OneShotAllReduce
                allreduce = OneShotAllReduce(bundle, rank, tp, cfg.hidden_size, exchange,
                                             timeout_ms=timeout_ms or DEFAULT_TIMEOUT_MS)
                comm = allreduce.state()
            executor = Executor(cfg, bundle, weights, tp, rank, comm, device=device,
                                geometry=geometry, owns_bundle=True, ranges=ranges,
                                dspark=dspark, buckets=buckets)
        except BaseException:
            for opened in (allreduce, bundle, device):
                if opened is not None:
                    opened.close()
            raise
        return cls(executor, device=device, allreduce=allreduce, exchange=exchange)

    # ---- bind and capture ------------------------------------------------------------------

    def bind(self, **tensors) -> None:
        """Bind the engine's tensors by vLLM name, in place (see the module docstring). All or
        nothing: on any error the previous binding stays, and the error names the tensor."""
        unknown = sorted(set(tensors) - set(self.names))
        if unknown:
            hopdec = [f"{n!r} -> {self._hopdec_to_vllm[n]!r}" for n in unknown
                      if n in self._hopdec_to_vllm]
            hint = f" (hopdec names; use the vLLM names: {', '.join(hopdec)})" if hopdec else ""
            raise BindError(f"bind: unexpected tensor(s) {unknown}{hint}; this backend binds "
                            f"{list(self.names)}")
        rules = self.executor.rules
        missing = [v for v, h in self.names.items() if rules[h].required and v not in tensors]
        if missing:
            raise BindError(f"bind: missing tensor(s) {missing}; expected " + ", ".join(
                f"{v}: {rules[self.names[v]].expected()}" for v in missing))
        device = cuda_device(self.executor.device.ordinal)
        renamed = {}
        for vllm, obj in tensors.items():
            hopdec = self.names[vllm]
            try:
                view = describe(obj, vllm)
            except DLPackError as exc:
                raise BindError(str(exc)) from None
            problem = _copy_needed(vllm, hopdec, rules[hopdec], view, device)
            if problem:
                raise BindError(problem)
            renamed[hopdec] = obj
        try:
            self.executor.bind(**renamed)
        except BindError as exc:
            raise BindError(self._in_vllm_names(str(exc))) from None

    def _in_vllm_names(self, message: str) -> str:
        """The executor's message with each quoted binding name followed by its vLLM name."""
        def name(match: re.Match) -> str:
            vllm = self._hopdec_to_vllm.get(match.group(1))
            return match.group(0) if vllm is None else f"{match.group(0)} (vLLM {vllm!r})"
        return re.sub(r"'(\w+)'", name, message)

    @property
    def bound_addresses(self) -> dict[str, int]:
        """vLLM name -> the device address bound (equal to the engine's `data_ptr()`)."""
        binding = self.executor.binding
        if binding is None:
            return {}
        return {self._hopdec_to_vllm[h]: p for h, p in binding.pointers.items()}

    def capture(self) -> None:
        """Build the arena and capture one graph per bucket on the executor's own stream. Once,
        after bind, outside any capture of the engine's (the graphs are replayed by `step`).
        With hopdec's all-reduce, collective: it returns once every rank has captured, so no
        rank's first all-reduce waits on a peer still capturing."""
        self.executor.capture()
        if self._exchange is not None:
            _synchronize()                      # the weight uploads, before any step reads them
            self._exchange(b"captured")

    # ---- step ------------------------------------------------------------------------------

    @property
    def max_rows(self) -> int:
        """The most rows `step` serves: the largest bucket (DSpark: the largest slot bucket's
        verify rows)."""
        if self.executor.dspark:
            return self.executor.round_slots[-1] * self._max_block_rows
        return self.executor.max_rows

    def decide(self, rows_per_request, *, any_prefill: bool = False,
               features: int = 0) -> StepDecision:
        """`decide_step` with this backend's largest bucket and DSpark block length, after the
        backend's own state (closed, not bound, not captured), as `step` checks them."""
        decision = decide_step(rows_per_request, any_prefill=any_prefill, features=features,
                               max_rows=self.max_rows, max_block_rows=self._max_block_rows)
        state = self._state()
        if state == StepResult.SERVED:
            return decision
        return StepDecision(False, decision.n_rows, decision.features, state)

    def step(self, n_rows: int, stream_handle: int, features: int = 0) -> int:
        """`Executor.step` on the engine's stream (`torch.cuda.current_stream().cuda_stream`):
        0 when served, else a StepResult (`fallback_reason(code)`), nothing written.
        `features` is a plain int or a StepFeature. With DSpark this is the verify step alone."""
        _check_stream("step", stream_handle)
        return self.executor.step(n_rows, stream_handle, _plain(features))

    def _state(self) -> StepResult:
        return (StepResult.CLOSED if self._closed else
                StepResult.NOT_BOUND if self.executor.binding is None else
                StepResult.NOT_CAPTURED if not self.executor.captured else StepResult.SERVED)

    # ---- DSpark rounds ---------------------------------------------------------------------

    @property
    def dspark(self) -> bool:
        return self.executor.dspark

    @property
    def max_seqs(self) -> int:
        """The most sequences one DSpark round serves (the largest slot bucket); 0 without."""
        return self.executor.round_slots[-1] if self.executor.dspark else 0

    def decide_round(self, rows_per_request, *, any_prefill: bool = False,
                     features: int = 0) -> RoundDecision:
        """`decide_round` with this backend's slot buckets and k + 1, after what `round` checks
        first: a backend without DSpark (UNSUPPORTED_FEATURE), then its state."""
        decision = decide_round(rows_per_request, max_seqs=self.max_seqs,
                                block_rows=self._max_block_rows, any_prefill=any_prefill,
                                features=features)
        state = self._state() if self.dspark else StepResult.UNSUPPORTED_FEATURE
        if state == StepResult.SERVED:
            return decision
        return RoundDecision(False, decision.n_seqs, decision.features, state)

    def round(self, n_seqs: int, stream_handle: int, features: int = 0) -> int:
        """`Executor.round` on the engine's stream: the draft graph, then the verify graph, of
        the smallest slot bucket >= n_seqs. 0 when enqueued (the outputs land in the bound
        num_accepted_tokens, bonus_token_ids and sampled_token_ids), else a StepResult, nothing
        written. No allocation, host read or synchronisation."""
        _check_stream("round", stream_handle)
        return self.executor.round(n_seqs, stream_handle, _plain(features))

    def draft(self, n_seqs: int, stream_handle: int, features: int = 0) -> int:
        """`Executor.draft`: a round's draft step alone (its drafts land in the verify rows'
        input_ids); `step(n_seqs * (k + 1), ...)` is the verify step after it."""
        _check_stream("draft", stream_handle)
        return self.executor.draft(n_seqs, stream_handle, _plain(features))

    def collective_timeouts(self) -> list[int]:
        """Ranks hopdec's all-reduce waited for in vain in some call so far ([] when it has
        none, or none timed out): a plain read of pinned memory, no synchronisation. Non-empty
        means this backend's later steps are unusable: close it and run the stock path."""
        return [] if self._allreduce is None else self._allreduce.failed_sources()

    # ---- close -----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the executor (graphs, arena, bundle), the all-reduce and the device `open`
        made; idempotent. The engine's tensors are only un-referenced. With hopdec's
        all-reduce, collective: the rank waits for its device and for every rank to be done
        with the all-reduce before freeing its buffers (a peer's may still read them); if that
        agreement fails, they are left to process exit."""
        if self._closed:
            return
        self._closed = True
        allreduce, self._allreduce = self._allreduce, None
        try:
            try:
                if allreduce is not None:
                    _synchronize()
            finally:
                self.executor.close()
            if allreduce is not None:
                self._exchange(b"close")
                allreduce.close()
        finally:
            device, self._device = self._device, None
            if device is not None:
                device.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _synchronize() -> None:
    from executor.cuda import check, driver
    check(driver().cuCtxSynchronize())


def _check_stream(what: str, handle) -> None:
    if handle in _LEGACY_STREAMS:
        raise ValueError(f"HopdecBackend.{what}: stream handle {handle} is the legacy default "
                         f"stream, which torch uses unless told otherwise; run decode under "
                         f"`with torch.cuda.stream(torch.cuda.Stream()):`")


def _plain(features):
    """A StepFeature as the plain int the executor takes (anything else is passed on as is)."""
    return int(features) if type(features) is not int and isinstance(features, StepFeature) \
        else features


def _model_config(config):
    from loader.config import ModelConfig

    if isinstance(config, ModelConfig):
        return config
    if isinstance(config, (str, Path)):
        return ModelConfig.from_json(config)
    raise TypeError(f"config must be a ModelConfig or the path of the model's config.json, "
                    f"got {type(config).__name__}")
