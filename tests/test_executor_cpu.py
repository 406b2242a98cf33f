"""Executor host side without a GPU: DLPack reading, bind validation (every rule, all-or-nothing),
step reason codes (nothing launched when declining), bucket selection, the plan's refusal.

Device tensors are faked with `FakeCudaTensor`, a DLPack producer whose capsule is built with
ctypes and claims device cuda:N at an address nobody dereferences (bind records addresses only).
Graphs are faked with `FakeGraph`, which replays the launches `record(bucket)` made into it.
Shapes, addresses and wrong values are drawn fresh per run (np.random.default_rng() unseeded).
"""
from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import pytest

from executor import dlpack
from executor.bind import (
    ALIGN_BYTES,
    BindError,
    CacheGeometry,
    binding_rules,
    validate_binding,
)
from executor.executor import Executor
from executor.graphs import BUCKETS, GraphSet
from executor.plan import NO_KERNEL, NOT_WIRED, Plan, Stage, decode_plan
from executor.reasons import StepFeature, StepResult
from executor.reference.kvcache import KVCaches
from loader.config import ModelConfig

CFG = ModelConfig.preset("tiny")
GEOMETRY = CacheGeometry(max_seqs=4, ring_slots=32, ring_rows=8, page_size=64, num_pages=16,
                         pages_per_seq=4)
CPU = (dlpack.KDL_CPU, 0)
NP_DTYPES = {"int8": np.int8, "int32": np.int32, "int64": np.int64, "uint8": np.uint8,
             "float32": np.float32}
DL_CODES = {"int8": (0, 8), "int32": (0, 32), "int64": (0, 64), "uint8": (1, 8),
            "float32": (2, 32), "bfloat16": (4, 16), "float16": (2, 16)}

_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_CAPSULE_NAME = ctypes.create_string_buffer(b"dltensor")


class FakeCudaTensor:
    """A DLPack producer on cuda:`device_id` at `address`; no memory behind it."""

    def __init__(self, shape, dtype: str, address: int, device_id: int = 0, strides=None):
        self.shape, self.dtype, self.address = tuple(shape), dtype, address
        self.device_id, self.strides = device_id, strides
        self.exports = []

    def __dlpack_device__(self):
        return (dlpack.KDL_CUDA, self.device_id)

    def __dlpack__(self, stream=None):
        assert stream == -1, "a CUDA producer must be asked not to synchronize"
        ndim = len(self.shape)
        shape = (ctypes.c_int64 * max(1, ndim))(*self.shape)
        strides = None if self.strides is None else (ctypes.c_int64 * ndim)(*self.strides)
        managed = dlpack.DLManagedTensor()
        t = managed.dl_tensor
        t.data, t.byte_offset, t.ndim = self.address, 0, ndim
        t.device.device_type, t.device.device_id = dlpack.KDL_CUDA, self.device_id
        t.dtype.code, t.dtype.bits = DL_CODES[self.dtype]
        t.dtype.lanes = 1
        t.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
        if strides is not None:
            t.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
        self.exports.append((managed, shape, strides))      # alive as long as the capsule
        return _api.PyCapsule_New(ctypes.addressof(managed), _CAPSULE_NAME, None)


def fake_tensors(rules, device_id: int = 0, base: int | None = None) -> dict:
    """One FakeCudaTensor per rule (optional ones included), disjoint, 256-byte aligned."""
    rng = np.random.default_rng()
    addr = base if base is not None else int(rng.integers(1 << 20, 1 << 30)) << 12
    out = {}
    for rule in rules.values():
        out[rule.name] = FakeCudaTensor(rule.shape, rule.dtype, addr, device_id)
        nbytes = int(np.prod(rule.shape)) * np.dtype(NP_DTYPES[rule.dtype]).itemsize
        addr += (nbytes + 255) // 256 * 256 + 256 * int(rng.integers(0, 4))
    return out


def host_bound_tensors(space, rules) -> dict:
    """One FakeCudaTensor per rule at a zeroed host array bound into `space` (an emulator
    AddressSpace): emulated launches read and write what the executor binds."""
    from executor.emulate import bind_host
    out = {}
    for rule in rules.values():
        array = np.zeros(rule.shape, np.dtype(rule.dtype))
        out[rule.name] = FakeCudaTensor(rule.shape, rule.dtype,
                                        bind_host(space, {rule.name: array})[rule.name])
    return out


def host_tensors(rules) -> dict:
    return {r.name: np.zeros(r.shape, NP_DTYPES[r.dtype]) for r in rules.values()}


class FakeDevice:
    """Streams are names; events only order them, so they do nothing here."""

    ordinal = 0

    def stream(self):
        return "own-stream"

    def event(self):
        return FakeEvent()


class FakeEvent:
    def record(self, stream) -> None:
        pass

    def wait(self, stream) -> None:
        pass


class FakeGraph:
    def __init__(self, bucket: int, specs: list, log: list):
        self.bucket, self.specs, self.log, self.closed = bucket, specs, log, False

    def launch(self, stream) -> None:
        self.log.append((self.bucket, stream.handle))
        for s in self.specs:
            s.launch(stream)

    def close(self) -> None:
        self.closed = True


class FakeSpec:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def launch(self, stream) -> None:
        self.log.append(self.name)


class Recorder:
    """Stands in for GraphSet.capture: records each bucket's launches into a FakeGraph."""

    def __init__(self):
        self.graph_launches, self.kernel_launches, self.captured = [], [], []

    def __call__(self, stream, record, buckets) -> GraphSet:
        graphs = {}
        for b in sorted(buckets, reverse=True):
            self.captured.append(b)
            specs: list = []
            self.recording = specs
            record(b)
            graphs[b] = FakeGraph(b, specs, self.graph_launches)
        return GraphSet(graphs)


def complete_plan(recorder: Recorder) -> Plan:
    """decode_plan(CFG) with every stage wired to one fake launch (head.embed: one per row)."""
    plan = decode_plan(CFG)
    for stage in plan.stages:
        def build(rows, name=stage.name):
            count = rows if name == "head.embed" else 1
            return [_Capturing(recorder, f"{name}#{i}") for i in range(count)]
        plan = plan.wire(stage.name, build)
    return plan


class _Capturing:
    """A spec that, during capture, lands in the graph being recorded; on replay, in the log."""

    def __init__(self, recorder: Recorder, name: str):
        self.recorder, self.name = recorder, name

    def launch(self, stream) -> None:
        if stream in ("capture-stream", "own-stream"):      # the capture's stream or its side
            self.recorder.recording.append(FakeSpec(self.name, self.recorder.kernel_launches))
        else:
            raise AssertionError("launched outside a graph")


def make_executor(plan=None, buckets=BUCKETS, recorder=None, **kw) -> tuple[Executor, Recorder]:
    recorder = recorder or Recorder()
    ex = Executor(CFG, bundle=None, weights=None, tp=2, rank=1, device=FakeDevice(),
                  geometry=GEOMETRY, plan=plan if plan is not None else complete_plan(recorder),
                  buckets=buckets, capture_graphs=recorder, **kw)
    return ex, recorder


def ready_executor(**kw) -> tuple[Executor, Recorder]:
    ex, rec = make_executor(**kw)
    ex.bind(**fake_tensors(ex.rules))
    ex.capture("capture-stream")
    return ex, rec


# ---- DLPack ----------------------------------------------------------------------------------


def test_dlpack_reads_numpy_views_without_copy():
    rng = np.random.default_rng()
    for dtype in (np.int8, np.int32, np.int64, np.uint8, np.float32, np.float16):
        a = np.zeros(tuple(int(d) for d in rng.integers(2, 9, size=3)), dtype)
        v = dlpack.describe(a, "a")
        assert (v.address, v.shape, v.dtype) == (a.ctypes.data, a.shape, np.dtype(dtype).name)
        assert v.device == "cpu:0" and v.is_compact() and v.nbytes == a.nbytes
        s = a[:, :, ::2]
        vs = dlpack.describe(s, "s")
        assert vs.strides == tuple(x // a.itemsize for x in s.strides)
        assert vs.is_compact() == s.flags.c_contiguous


def test_dlpack_reads_a_fake_cuda_capsule():
    rng = np.random.default_rng()
    addr = int(rng.integers(1, 1 << 30)) * 256
    t = FakeCudaTensor((7, 584), "uint8", addr, device_id=3)
    v = dlpack.describe(t, "t")
    assert (v.address, v.shape, v.dtype, v.device, v.strides) == (addr, (7, 584), "uint8",
                                                                 "cuda:3", None)


# ---- binding rules ---------------------------------------------------------------------------


def test_rules_match_the_reference_cache_layouts():
    """The arrays KVCaches.allocate makes (host numpy) satisfy the rules of their geometry."""
    caches = KVCaches.allocate(CFG, max_seqs=3, max_context=200, page_size=32)
    geometry = CacheGeometry.of(caches)
    rules = binding_rules(CFG, 4, geometry)
    tensors = {k: v for k, v in host_tensors(rules).items()
               if not k.startswith(("swa_", "compressed_", "index_keys_", "compressor_ring_"))}
    for l, a in caches.swa.items():
        tensors[f"swa_{l}"] = a
    for k in caches.compressed:
        tensors[f"compressed_{k}"] = caches.compressed[k]
        tensors[f"index_keys_{k}"] = caches.index_keys[k]
    for k, ring in caches.ring.items():
        tensors[f"compressor_ring_{k}"] = ring
    binding = validate_binding(rules, tensors, CPU)
    assert set(binding.pointers) == set(rules)
    assert binding.ptr("swa_0") == caches.swa[0].ctypes.data
    assert rules["logits"].shape == (192, CFG.vocab_size // 4)
    assert {n for n in rules if n.startswith("compressor_ring_")} == {
        f"compressor_ring_{s.index}" for s in CFG.layers if s.owns_compressor and s.ratio == 2}


def _bind_error(rules, tensors, match: str, device=CPU):
    with pytest.raises(BindError, match=match):
        validate_binding(rules, tensors, device)


def test_bind_rejects_missing_and_unexpected_tensors():
    rules = binding_rules(CFG, 2, GEOMETRY)
    tensors = host_tensors(rules)
    name = list(rules)[np.random.default_rng().integers(len(rules) - 1)]   # never 'logits'
    _bind_error(rules, {k: v for k, v in tensors.items() if k != name},
                rf"missing tensor\(s\) \['{name}'\]")
    _bind_error(rules, {**tensors, "swa_99": tensors["swa_0"]}, r"unexpected tensor\(s\) \['swa_99'")
    del tensors["logits"]                          # optional
    validate_binding(rules, tensors, CPU)


def test_bind_rejects_non_dlpack_and_bf16_host_arrays():
    rules = binding_rules(CFG, 2, GEOMETRY)
    tensors = host_tensors(rules)
    _bind_error(rules, {**tensors, "positions": list(range(192))},
                "'positions' .* not a DLPack producer")
    bf16 = np.zeros(rules["logits"].shape, ml_dtypes.bfloat16)
    _bind_error(rules, {**tensors, "logits": bf16}, "'logits' .* refused DLPack export")


def test_bind_rejects_wrong_dtype_and_shape():
    rng = np.random.default_rng()
    rules = binding_rules(CFG, 2, GEOMETRY)
    tensors = host_tensors(rules)
    _bind_error(rules, {**tensors, "token_ids": np.zeros(192, np.int32)},
                r"'token_ids': expected int64 \[192\], got int32 \[192\]")
    rows = int(rng.integers(1, 400))
    if rows == 192:
        rows = 191
    _bind_error(rules, {**tensors, "slot_mapping": np.zeros(rows, np.int64)},
                rf"'slot_mapping': expected int64 \[192\], got int64 \[{rows}\]")
    swa = rules["swa_3"].shape
    _bind_error(rules, {**tensors, "swa_3": np.zeros((swa[0], 528), np.uint8)},
                rf"'swa_3': expected uint8 \[{swa[0]}, 584\]")
    _bind_error(rules, {**tensors, "compressor_ring_2": np.zeros((4, 8, 1024), np.float64)},
                "'compressor_ring_2': expected float32")


def test_bind_rejects_other_devices():
    rules = binding_rules(CFG, 2, GEOMETRY)
    _bind_error(rules, host_tensors(rules), "lives on cpu:0; expected the executor's device "
                "cuda:0", device=(dlpack.KDL_CUDA, 0))
    fakes = fake_tensors(rules)
    fakes["block_tables"].device_id = 1
    _bind_error(rules, fakes, "'block_tables' lives on cuda:1; expected .* cuda:0",
                device=(dlpack.KDL_CUDA, 0))


def test_bind_rejects_misaligned_null_and_strided_tensors():
    rng = np.random.default_rng()
    rules = binding_rules(CFG, 2, GEOMETRY)
    cuda0 = (dlpack.KDL_CUDA, 0)
    fakes = fake_tensors(rules)
    fakes["positions"].address += int(rng.integers(1, ALIGN_BYTES))
    _bind_error(rules, fakes, "'positions': address 0x[0-9a-f]+ is not 16-byte aligned", cuda0)
    fakes = fake_tensors(rules)
    fakes["tokens"].address = 0
    _bind_error(rules, fakes, "'tokens': data pointer is null", cuda0)
    fakes = fake_tensors(rules)
    fakes["block_tables"].strides = (1, 192)                      # column-major
    _bind_error(rules, fakes, "'block_tables': expected a row-major contiguous", cuda0)
    tensors = host_tensors(rules)
    wide = np.zeros((192, 2 * GEOMETRY.pages_per_seq), np.int32)
    _bind_error(rules, {**tensors, "block_tables": wide[:, ::2]}, "row-major contiguous")
    raw = np.zeros(192 * 8 + 8, np.uint8)
    start = (-raw.ctypes.data) % 16 + int(rng.integers(1, 8))    # aligned to 8 or less, never 16
    unaligned = raw[start:start + 192 * 8].view(np.int64)
    _bind_error(rules, {**tensors, "context_lens": unaligned}, "'context_lens': address .* not "
                "16-byte aligned")


def test_bind_rejects_overlapping_tensors():
    rules = binding_rules(CFG, 2, GEOMETRY)
    fakes = fake_tensors(rules)
    fakes["tokens"].address = fakes["positions"].address + 16
    _bind_error(rules, fakes, "tensors 'positions' and 'tokens' overlap", (dlpack.KDL_CUDA, 0))


# ---- Executor.bind: all or nothing -----------------------------------------------------------


def test_failed_bind_leaves_the_previous_binding():
    ex, _ = make_executor()
    fakes = fake_tensors(ex.rules)
    fakes["seq_index"].dtype = "int64"
    with pytest.raises(BindError, match="seq_index"):
        ex.bind(**fakes)
    assert ex.binding is None
    good = fake_tensors(ex.rules)
    ex.bind(**good)
    before = dict(ex.binding.pointers)
    assert before == {n: t.address for n, t in good.items()}
    bad = fake_tensors(ex.rules)
    bad["swa_5"].shape = (1, 584)
    with pytest.raises(BindError, match="swa_5"):
        ex.bind(**bad)
    assert dict(ex.binding.pointers) == before


def test_rebind_after_capture_needs_the_same_addresses():
    ex, _ = make_executor()
    good = fake_tensors(ex.rules)
    ex.bind(**good)
    ex.capture("capture-stream")
    ex.bind(**good)                                           # same memory: allowed
    moved = dict(good)
    moved["tokens"] = FakeCudaTensor((192,), "int64", good["tokens"].address + (1 << 40))
    with pytest.raises(BindError, match=r"\['tokens'\] moved"):
        ex.bind(**moved)
    assert ex.binding.ptr("tokens") == good["tokens"].address


# ---- Executor.step ---------------------------------------------------------------------------


def test_step_serves_every_row_count_with_the_smallest_bucket():
    ex, rec = ready_executor()
    assert rec.captured == sorted(BUCKETS, reverse=True)       # one capture per bucket
    stream = int(np.random.default_rng().integers(1, 1 << 40))
    for rows in range(1, 193):
        rec.graph_launches.clear()
        rec.kernel_launches.clear()
        assert ex.step(rows, stream) == StepResult.SERVED == 0
        bucket = min(b for b in BUCKETS if b >= rows)
        assert rec.graph_launches == [(bucket, stream)] and ex.bucket_for(rows) == bucket
        # the replayed graph holds exactly what record(bucket) enqueued, in plan order
        expected = []
        for s in ex.plan.stages:
            expected += ([f"head.embed#{i}" for i in range(bucket)] if s.name == "head.embed"
                         else [f"{s.name}#0"])
        assert rec.kernel_launches == expected


@pytest.mark.parametrize("features, code", [
    (StepFeature.PREFILL, StepResult.PREFILL_ROWS),
    (StepFeature.PREFILL | StepFeature.LORA, StepResult.PREFILL_ROWS),
    *[(f, StepResult.UNSUPPORTED_FEATURE) for f in StepFeature
      if f not in (StepFeature.NONE, StepFeature.PREFILL)],
    (1 << 20, StepResult.UNSUPPORTED_FEATURE),                 # unknown bits fail closed
])
def test_declared_features_decline_without_launching(features, code):
    ex, rec = ready_executor()
    rows = int(np.random.default_rng().integers(1, 193))
    assert ex.step(rows, 7, int(features)) == code
    assert rec.graph_launches == [] and rec.kernel_launches == []


def test_row_count_and_state_declines_launch_nothing():
    rng = np.random.default_rng()
    ex, rec = make_executor()
    rows = int(rng.integers(1, 193))
    assert ex.step(rows, 7) == StepResult.NOT_BOUND
    ex.bind(**fake_tensors(ex.rules))
    assert ex.step(rows, 7) == StepResult.NOT_CAPTURED
    ex.capture("capture-stream")
    assert ex.step(0, 7) == StepResult.NO_ROWS
    assert ex.step(193 + int(rng.integers(0, 1000)), 7) == StepResult.TOO_MANY_ROWS
    assert rec.graph_launches == []
    ex.close()
    assert ex.step(rows, 7) == StepResult.CLOSED
    assert rec.graph_launches == [] and rec.kernel_launches == []


def test_too_many_rows_follows_the_largest_captured_bucket():
    ex, rec = ready_executor(buckets=(1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64))
    assert ex.step(64, 5) == StepResult.SERVED
    assert ex.step(65, 5) == StepResult.TOO_MANY_ROWS
    assert rec.graph_launches == [(64, 5)]


def test_step_takes_plain_ints_only():
    ex, rec = ready_executor()
    for bad in [(np.int64(4), 7), (4.0, 7), (True, 7), (4, "7"), (4, None)]:
        with pytest.raises(TypeError, match="plain ints"):
            ex.step(*bad)
    with pytest.raises(TypeError, match="plain ints"):
        ex.step(4, 7, StepFeature.PREFILL)                    # an IntFlag is not a plain int
    for bad in [(4, 0), (4, 1), (-1, 7), (4, -3)]:         # 0 and 1: CU_STREAM_LEGACY
        with pytest.raises(ValueError, match="legacy default stream"):
            ex.step(*bad)
    assert rec.graph_launches == []


def test_executor_rejects_bad_construction():
    for kw, match in [({"tp": 2, "rank": 2}, "rank < tp"), ({"tp": 0, "rank": 0}, "tp >= 1"),
                      ({"buckets": (0, 4)}, "buckets"), ({"buckets": (8, 256)}, "buckets")]:
        args = {"tp": 2, "rank": 0, **kw}
        with pytest.raises(ValueError, match=match):
            Executor(CFG, None, None, device=FakeDevice(), geometry=GEOMETRY, **args)


# ---- capture, plan, close --------------------------------------------------------------------


def test_capture_refuses_the_incomplete_decode_plan_naming_its_stages():
    rec = Recorder()
    ex, _ = make_executor(plan=decode_plan(CFG), recorder=rec)
    with pytest.raises(RuntimeError, match="bind"):
        ex.capture("capture-stream")
    ex.bind(**fake_tensors(ex.rules))
    with pytest.raises(NotImplementedError) as info:
        ex.capture("capture-stream")
    msg = str(info.value)
    for part in ("head.embed", "tail.argmax_pick", "engram.lookup (layers 1, 4)",
                 f"[{NOT_WIRED}]", "attn.sparse_mqa (layers 0-9)",
                 "attn.compressor (layers 2, 4, 6)"):
        assert part in msg, part
    assert rec.captured == [] and not ex.captured
    assert ex.step(1, 7) == StepResult.NOT_CAPTURED


def test_real_plan_names_every_stage_of_the_v41_step():
    cfg = ModelConfig.preset("v41-flash")
    plan = decode_plan(cfg)
    backbone = [s for s in cfg.layers if not s.is_dspark]
    assert len(backbone) == 40
    layer_roles = {s.range_name for s in plan.stages if s.layer == 20}
    assert {"attn.sparse_mqa", "attn.indexer", "attn.compressor", "ffn.moe_routed"} <= layer_roles
    assert [s.name for s in plan.stages if s.layer is None] == [
        "head.rows_prep", "head.embed", "head.embed_allreduce", "head.engram_hash",
        "tail.mhc_post_collapse",
        "tail.norm", "tail.lm_head_argmax", "tail.argmax_pick"]
    with pytest.raises(NotImplementedError, match=f"{len(plan.stages)} of {len(plan.stages)}"):
        plan.launches(1)


def test_plan_records_in_order_inside_balanced_nvtx_ranges():
    log: list = []

    class Ranges:
        def __init__(self):
            self.stack, self.events = [], []

        def push(self, name):
            self.stack.append(name)
            self.events.append(("push", name))

        def pop(self):
            self.events.append(("pop", self.stack.pop()))

    plan = Plan([Stage("head.a", "f", build=lambda r: [FakeSpec("a", log)]),
                 Stage("layer00.attn.x", "f", 0, build=lambda r: [FakeSpec("x", log)] * r),
                 Stage("layer00.ffn.y", "f", 0, build=lambda r: []),
                 Stage("layer01.attn.x", "f", 1, build=lambda r: [FakeSpec("x1", log)]),
                 Stage("tail.t", "f", build=lambda r: [FakeSpec("t", log)])])
    ranges = Ranges()
    assert plan.record("s", 3, ranges) == 6
    assert log == ["a", "x", "x", "x", "x1", "t"] and ranges.stack == []
    pushes = [n for kind, n in ranges.events if kind == "push"]
    assert pushes == ["head.a", "layer00", "attn.x", "ffn.y", "layer01", "attn.x", "tail.t"]


def test_stage_and_plan_validation():
    with pytest.raises(ValueError, match="exactly one of build or missing"):
        Stage("a", "f")
    with pytest.raises(ValueError, match="exactly one of build or missing"):
        Stage("a", "f", build=lambda r: [], missing=NO_KERNEL)
    s = Stage("a", "f", missing=NO_KERNEL)
    with pytest.raises(ValueError, match=r"used twice: \['a'\]"):
        Plan([s, s])
    with pytest.raises(KeyError, match="no stage 'b'"):
        Plan([s]).wire("b", lambda r: [])


def test_close_releases_graphs_and_an_owned_bundle_once():
    class Bundle:
        closes = 0

        def close(self):
            Bundle.closes += 1

    rec = Recorder()
    ex = Executor(CFG, Bundle(), None, tp=1, rank=0, device=FakeDevice(), geometry=GEOMETRY,
                  plan=complete_plan(rec), buckets=(1, 2, 4), capture_graphs=rec,
                  owns_bundle=True)
    ex.bind(**fake_tensors(ex.rules))
    ex.capture("capture-stream")
    graphs = list(ex._graphs.graphs.values())
    ex.close()
    ex.close()
    assert all(g.closed for g in graphs) and Bundle.closes == 1 and ex.binding is None
    with pytest.raises(RuntimeError, match="closed"):
        ex.bind(**fake_tensors(ex.rules))
    with pytest.raises(RuntimeError, match="closed"):
        ex.capture("capture-stream")


def test_step_makes_no_driver_call_of_its_own(monkeypatch):
    """Every driver call of our code goes through a module's `driver()` (executor.cuda's,
    imported by name into the others); with all of them made to raise, a served or declined step
    (on an already wrapped stream handle) still completes: it makes no sync, copy or allocation,
    only the graph launch, which the fake records. tests/gpu/test_executor.py proves it on a GPU.
    """
    import sys

    ex, rec = ready_executor()
    assert ex.step(5, 11) == StepResult.SERVED                     # wraps stream 11 once

    def no_driver():
        raise AssertionError("step called the CUDA driver")

    patched = [m for name, m in sys.modules.items()
               if name.startswith("executor.") and callable(getattr(m, "driver", None))]
    assert {"executor.cuda", "executor.graphs", "executor.runtime"} <= {m.__name__ for m in patched}
    for module in patched:
        monkeypatch.setattr(module, "driver", no_driver)
    rows = [int(r) for r in np.random.default_rng().integers(1, 193, size=16)]
    assert [ex.step(r, 11) for r in rows] == [StepResult.SERVED] * len(rows)
    assert ex.step(500, 11) == StepResult.TOO_MANY_ROWS
    assert len(rec.graph_launches) == 1 + len(rows)


def test_missing_stage_kinds_match_the_kernel_tree():
    """NOT_WIRED stages name a family module that exists; NO_KERNEL ones one that does not, so
    the refusal message cannot go stale when a kernel lands (update decode_plan then)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for stage in decode_plan(ModelConfig.preset("v41-flash")).stages:
        module = root / (stage.family.replace(".", "/") + ".py")
        if stage.missing == NOT_WIRED:
            assert module.is_file(), f"{stage.name}: {module} missing"
        else:
            assert stage.missing == NO_KERNEL
            assert not (root / "kernels" / f"{stage.family}.py").is_file(), stage.name


def test_executor_bind_rejects_host_arrays_and_keeps_nothing():
    ex, _ = make_executor()
    with pytest.raises(BindError, match="lives on cpu:0; expected the executor's device cuda:0"):
        ex.bind(**host_tensors(ex.rules))
    assert ex.binding is None
    assert ex.step(1, 7) == StepResult.NOT_BOUND


def test_wire_all_wires_in_one_pass_and_names_unknown_stages():
    plan = decode_plan(CFG)
    names = [s.name for s in plan.stages[:3]]
    wired = plan.wire_all({n: (lambda r: []) for n in names})
    assert [s.name for s in wired.stages if s.build is not None] == names
    assert len(wired.missing_stages()) == len(plan.stages) - 3
    assert plan.missing_stages() == list(plan.stages)          # the original is unchanged
    with pytest.raises(KeyError, match="no stage 'nope'"):
        plan.wire_all({"nope": lambda r: []})
    with pytest.raises(ValueError, match="used twice"):
        Plan([plan.stages[0], plan.stages[0]])
