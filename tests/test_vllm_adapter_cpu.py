"""The vLLM-facing adapter without a GPU: the opt-in switch, the name map against binding_rules,
binding by vLLM name in place (addresses identical, copies refused with the view that fits), step
forwarding and its stream checks, the host-side decision against Executor.step, reason strings,
and `open`'s validation and clean-up.

Device tensors are test_executor_cpu's FakeCudaTensor (a DLPack capsule at an address nobody
dereferences), graphs its Recorder; inputs are drawn fresh per run (unseeded default_rng).
"""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
from test_executor_cpu import CFG, GEOMETRY, FakeCudaTensor, fake_tensors, make_executor

from executor.bind import BindError, CacheGeometry, TensorRule, binding_rules
from executor.bundle import MANIFEST_ARCH, MANIFEST_FORMAT, BundleError
from executor.graphs import BUCKETS
from executor.reasons import StepFeature, StepResult
from executor.vllm_adapter import (
    VLLM_NAMES,
    HopdecBackend,
    decide_step,
    decode_backend_enabled,
    fallback_reason,
    step_features,
    vllm_name_map,
)
from loader.config import ModelConfig

ON = {"decode_backend": "latency_specialized"}


def backend() -> tuple[HopdecBackend, object]:
    ex, rec = make_executor()
    return HopdecBackend(ex), rec


def vllm_fakes(b: HopdecBackend, device_id: int = 0) -> dict:
    """One FakeCudaTensor per binding (optional logits included), keyed by vLLM name."""
    by_hopdec = fake_tensors(b.executor.rules, device_id)
    return {v: by_hopdec[h] for v, h in b.names.items()}


def ready_backend() -> tuple[HopdecBackend, object, dict]:
    b, rec = backend()
    fakes = vllm_fakes(b)
    b.bind(**fakes)
    b.executor.capture("capture-stream")   # the stream test_executor_cpu's fake plan records on
    return b, rec, fakes


# ---- the switch ------------------------------------------------------------------------------


def _other_keys(rng) -> dict:
    return {f"key{int(k)}": int(k) for k in rng.integers(0, 1000, size=int(rng.integers(0, 4)))}


def test_switch_reads_vllm_spellings():
    rng = np.random.default_rng()
    other = _other_keys(rng)
    assert decode_backend_enabled({**other, **ON})
    assert decode_backend_enabled(json.dumps({**ON, **other}))
    assert decode_backend_enabled(json.dumps(ON).encode())
    for off in (None, {}, other, json.dumps(other), {"decode_backend": None}, "{}"):
        assert decode_backend_enabled(off) is False, off


@pytest.mark.parametrize("value", ["latency-specialized", "Latency_Specialized", "", "stock",
                                   True, 1, ["latency_specialized"]])
def test_switch_refuses_other_values_naming_the_key(value):
    with pytest.raises(ValueError, match=r"additional_config\['decode_backend'\] = .*expected "
                                         r"'latency_specialized'"):
        decode_backend_enabled({"decode_backend": value})
    with pytest.raises(ValueError, match="'decode_backend'"):
        decode_backend_enabled(json.dumps({"decode_backend": value}))


def test_switch_refuses_bad_json_and_non_objects():
    with pytest.raises(ValueError, match="--additional-config is not valid JSON"):
        decode_backend_enabled("{decode_backend: latency_specialized}")
    for bad in ('["decode_backend"]', "3", ["decode_backend"], 7):
        with pytest.raises(TypeError, match="additional_config must be a JSON object"):
            decode_backend_enabled(bad)


# ---- the name map ----------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny", "v41-flash"])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("dspark", [False, True])
def test_name_map_covers_every_binding_exactly_once(preset, tp, dspark):
    rng = np.random.default_rng()
    geometry = CacheGeometry(*(int(x) for x in rng.integers(1, 64, size=6)))
    rules = binding_rules(ModelConfig.preset(preset), tp, geometry, dspark=dspark)
    names = vllm_name_map(rules)
    assert sorted(names.values()) == sorted(rules) and len(names) == len(rules)
    assert list(names.values()) == list(rules)                 # binding_rules' order kept
    for vllm, hopdec in names.items():
        rows = [r for r in VLLM_NAMES if re.fullmatch(
            re.escape(r.hopdec).replace(r"\{i\}", r"(\d+)"), hopdec)]
        assert len(rows) == 1, hopdec
        index = re.findall(r"\d+$", hopdec)
        assert vllm == rows[0].vllm.replace("{i}", index[0] if index else "{i}")
    used = {r.vllm for r in VLLM_NAMES if any(
        re.fullmatch(re.escape(r.vllm).replace(r"\{i\}", r"\d+"), v) for v in names)}
    if preset == "v41-flash" and dspark:                       # every table row is needed
        assert used == {r.vllm for r in VLLM_NAMES}


def test_name_map_refuses_a_binding_the_table_misses():
    rules = dict(binding_rules(CFG, 2, GEOMETRY))
    rules["mystery_7"] = TensorRule("mystery_7", "int32", (192,))
    with pytest.raises(ValueError, match=r"binding 'mystery_7' matches 0 rows of VLLM_NAMES"):
        vllm_name_map(rules)


def test_readme_documents_every_row_of_the_map():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Using hopdec from vLLM", 1)[1].split("\n## ", 1)[0]
    for row in VLLM_NAMES:
        assert f"| `{row.vllm}` | `{row.hopdec}` |" in section, row.vllm


# ---- bind: in place, by vLLM name ------------------------------------------------------------


def test_bind_records_the_engine_addresses_by_vllm_name():
    b, _ = backend()
    fakes = vllm_fakes(b)
    del fakes["logits"]                                        # optional
    b.bind(**fakes)
    assert b.bound_addresses == {v: t.address for v, t in fakes.items()}
    assert dict(b.executor.binding.pointers) == {b.names[v]: t.address for v, t in fakes.items()}
    assert all(b.executor.binding.owners[i] is t for i, t in enumerate(fakes.values()))


def _refused(b: HopdecBackend, tensors: dict, match: str) -> str:
    before = b.bound_addresses
    with pytest.raises(BindError, match=match) as info:
        b.bind(**tensors)
    assert b.bound_addresses == before                         # all or nothing
    return str(info.value)


def test_conversions_are_refused_naming_the_layout_needed():
    rng = np.random.default_rng()
    b, _ = backend()
    good = vllm_fakes(b)
    b.bind(**good)
    addr = good["input_ids"].address
    _refused(b, {**good, "input_ids": FakeCudaTensor((192,), "int32", addr)},
             r"vLLM tensor 'input_ids' \(hopdec 'token_ids'\) is int32; hopdec needs int64 "
             r"\[192\], row-major contiguous, on cuda:0\. Converting it would copy")
    _refused(b, {**good, "seq_lens": FakeCudaTensor((192,), "int32", good["seq_lens"].address)},
             r"'seq_lens' \(hopdec 'context_lens'\) is int32")
    width = GEOMETRY.pages_per_seq
    strided = FakeCudaTensor((192, width), "int32", good["block_table"].address,
                             strides=(2 * width, 1))
    _refused(b, {**good, "block_table": strided}, r"'block_table' .* has strides \[8, 1\] .*"
             r"\.contiguous\(\) would copy")
    _refused(b, {**good, "positions": FakeCudaTensor((192,), "int64", addr, device_id=1)},
             r"'positions' .* lives on cuda:1; hopdec needs int64 \[192\], .* on cuda:0\. "
             r"Moving it would copy")
    host = np.zeros(192, np.int64)
    _refused(b, {**good, "positions": host}, "'positions' .* lives on cpu:0")
    _refused(b, {**good, "req_indices": list(range(192))},
             "'req_indices' .* not a DLPack producer")
    for rows in (193, int(rng.integers(194, 8193))):
        message = _refused(b, {**good, "positions": FakeCudaTensor((rows,), "int64", addr)},
                           rf"'positions' .* has shape \[{rows}\]; hopdec needs int64 \[192\]")
        assert "Bind positions[:192]: a view of the same memory, no copy." in message
    short = _refused(b, {**good, "positions": FakeCudaTensor((191,), "int64", addr)},
                     r"'positions' .* has shape \[191\]")
    assert "Bind" not in short


def test_cache_blocks_get_the_flat_view_hint_and_the_view_binds():
    rng = np.random.default_rng()
    b, _ = backend()
    good = vllm_fakes(b)
    layer = int(rng.choice([s.index for s in CFG.layers]))
    name = f"swa_kv_cache_{layer}"
    lines, slots = GEOMETRY.max_seqs, GEOMETRY.ring_slots
    blocks = FakeCudaTensor((lines, slots, 584), "uint8", good[name].address)
    message = _refused(b, {**good, name: blocks}, rf"'{name}' \(hopdec 'swa_{layer}'\) has "
                       rf"shape \[{lines}, {slots}, 584\]")
    assert f"Bind {name}.view({lines * slots}, 584): the same memory, reshaped" in message
    b.bind(**{**good, name: FakeCudaTensor((lines * slots, 584), "uint8", blocks.address)})
    assert b.bound_addresses[name] == blocks.address
    odd = FakeCudaTensor((lines, slots + 1, 584), "uint8", good[name].address)
    assert "Bind" not in _refused(b, {**good, name: odd}, f"'{name}' .* has shape")


def test_names_are_checked_before_any_tensor():
    b, _ = backend()
    good = vllm_fakes(b)
    message = _refused(b, {**{k: v for k, v in good.items() if k != "input_ids"},
                           "token_ids": good["input_ids"]}, r"unexpected tensor\(s\) \['token_ids'\]")
    assert "'token_ids' -> 'input_ids'" in message
    _refused(b, {**good, "kv_caches": good["positions"]}, r"unexpected tensor\(s\) \['kv_caches'\]")
    name = f"compressed_kv_cache_{next(s.index for s in CFG.layers if s.owns_compressor)}"
    _refused(b, {k: v for k, v in good.items() if k != name},
             rf"missing tensor\(s\) \['{name}'\]; expected {name}: uint8 ")


def test_executor_errors_come_back_in_vllm_names():
    b, _ = backend()
    good = vllm_fakes(b)
    good["sampled_token_ids"].address = good["positions"].address + 16
    message = _refused(b, good, "overlap")
    assert "'positions' (vLLM 'positions')" in message
    assert "'tokens' (vLLM 'sampled_token_ids')" in message


# ---- step and decide -------------------------------------------------------------------------


def test_step_forwards_on_the_engine_stream():
    rng = np.random.default_rng()
    b, rec, _ = ready_backend()
    stream = int(rng.integers(2, 1 << 40))
    rows = int(rng.integers(1, 193))
    assert b.step(rows, stream) == StepResult.SERVED
    assert rec.graph_launches == [(min(x for x in BUCKETS if x >= rows), stream)]
    rec.graph_launches.clear()
    assert b.step(rows, stream, StepFeature.LOGPROBS) == StepResult.UNSUPPORTED_FEATURE
    assert b.step(rows, stream, int(StepFeature.PREFILL)) == StepResult.PREFILL_ROWS
    for legacy in (0, 1):
        with pytest.raises(ValueError, match=r"legacy default stream.*torch\.cuda\.stream"):
            b.step(rows, legacy)
    with pytest.raises(TypeError, match="plain ints"):
        b.step(rows, float(stream))
    assert rec.graph_launches == []


def _random_batch(rng) -> tuple[list[int], bool, int]:
    kinds = rng.choice([1, 5, 6, 7 + int(rng.integers(0, 60))], p=[0.45, 0.25, 0.25, 0.05],
                       size=int(rng.integers(0, 48)))
    features = int(rng.choice([0, 0, 0, int(StepFeature.LORA), int(StepFeature.LOGPROBS),
                               1 << int(rng.integers(6, 30))]))
    return [int(k) for k in kinds], bool(rng.random() < 0.1), features


def test_decision_matches_what_step_returns():
    """For random batches (decode 1, draft 5, verify 6, prefill chunks, up to ~300 rows, random
    features), the host decision is the code step() returns, and only served steps launch."""
    rng = np.random.default_rng()
    b, rec, _ = ready_backend()
    seen = set()
    for _ in range(300):
        rows, prefill, features = _random_batch(rng)
        decision = b.decide(rows, any_prefill=prefill, features=features)
        assert decision.n_rows == sum(rows)
        rec.graph_launches.clear()
        code = b.step(decision.n_rows, 99, decision.features)
        assert code == decision.reason and decision.use_hopdec == (code == StepResult.SERVED)
        assert len(rec.graph_launches) == int(decision.use_hopdec)
        seen.add(decision.reason)
    assert {StepResult.SERVED, StepResult.PREFILL_ROWS, StepResult.UNSUPPORTED_FEATURE} <= seen


def test_decision_follows_the_backend_state_as_step_does():
    rng = np.random.default_rng()
    b, rec = backend()
    rows = [int(r) for r in rng.choice([1, 5, 6], size=int(rng.integers(1, 20)))]

    def agree(expected):
        decision = b.decide(rows)
        assert decision.reason == expected and not decision.use_hopdec
        assert b.step(decision.n_rows, 5, decision.features) == expected

    agree(StepResult.NOT_BOUND)
    b.bind(**vllm_fakes(b))
    agree(StepResult.NOT_CAPTURED)
    b.executor.capture("capture-stream")
    assert b.decide(rows).use_hopdec
    b.close()
    agree(StepResult.CLOSED)
    assert rec.graph_launches == []


def test_decision_rules():
    assert decide_step([1] * 192).reason == StepResult.SERVED
    assert decide_step([6] * 32).reason == StepResult.SERVED
    assert decide_step([6] * 32 + [1]).reason == StepResult.TOO_MANY_ROWS
    assert decide_step([]).reason == StepResult.NO_ROWS
    long = decide_step([1, 7])
    assert long.reason == StepResult.PREFILL_ROWS and long.features == int(StepFeature.PREFILL)
    assert decide_step([1], any_prefill=True).reason == StepResult.PREFILL_ROWS
    assert decide_step([5] * 8, max_rows=32).reason == StepResult.TOO_MANY_ROWS
    assert decide_step(np.array([3, 5], np.int32)).use_hopdec
    with pytest.raises(ValueError, match=">= 1 row"):
        decide_step([1, 0])
    with pytest.raises(ValueError, match=">= 1 row"):
        decide_step(np.array([2, -1]))
    for bad in ([1.0, 2], [[1], [2]], np.array([1.5])):
        with pytest.raises(TypeError, match="rows_per_request must hold ints"):
            decide_step(bad)
    for bad in (-1, 1.0, True, None):
        with pytest.raises(TypeError, match="features must be a non-negative int"):
            decide_step([1], features=bad)


def test_step_features_sets_one_bit_per_flag():
    flags = {"prefill": StepFeature.PREFILL, "non_greedy": StepFeature.NON_GREEDY_SAMPLING,
             "logprobs": StepFeature.LOGPROBS, "lora": StepFeature.LORA,
             "multimodal": StepFeature.MULTIMODAL, "penalties": StepFeature.PENALTIES}
    assert step_features() == 0 and type(step_features()) is int
    rng = np.random.default_rng()
    for _ in range(20):
        chosen = {k for k in flags if rng.random() < 0.5}
        expected = 0
        for k in chosen:
            expected |= int(flags[k])
        assert step_features(**{k: True for k in chosen}) == expected


def test_every_reason_code_has_its_own_log_line():
    lines = {code: fallback_reason(int(code)) for code in StepResult}
    assert len(set(lines.values())) == len(StepResult)
    assert lines[StepResult.SERVED] == "served by hopdec"
    assert all(v.startswith("hopdec declined: ") for c, v in lines.items() if c)
    code = int(np.random.default_rng().integers(8, 1 << 20))
    assert fallback_reason(code) == f"hopdec declined with unknown reason code {code}"


# ---- open and close --------------------------------------------------------------------------


class _Closable:
    def __init__(self, log: list, what: str):
        self.log, self.what, self.ordinal = log, what, 0

    def close(self):
        self.log.append(self.what)

    def stream(self):
        return "own-stream"


def _bundle_dir(tmp_path, tp: int):
    (tmp_path / "k.cubin").write_bytes(b"\0")
    kernel = {"cubin": "k.cubin", "entry": "k", "params": [], "block": [32, 1, 1],
              "smem_bytes": 0}
    (tmp_path / "manifest.json").write_text(json.dumps(
        {"format": MANIFEST_FORMAT, "arch": MANIFEST_ARCH, "config": "tiny", "tp": tp,
         "kernels": {"k": kernel}}))
    return tmp_path


@pytest.fixture
def fake_gpu(monkeypatch):
    """executor.runtime's Device and Bundle.load replaced; the log says what was opened/closed."""
    from executor import runtime

    log: list = []

    def device(ordinal):
        log.append(f"device {ordinal}")
        return _Closable(log, "device closed")

    def load(dev, path):
        log.append("bundle loaded")
        return _Closable(log, "bundle closed")

    monkeypatch.setattr(runtime, "Device", device)
    monkeypatch.setattr(runtime.Bundle, "load", staticmethod(load))
    return log


def test_open_validates_config_and_bundle_before_the_gpu(tmp_path, fake_gpu):
    kw = {"tp": 2, "rank": 0, "geometry": GEOMETRY, "device_ordinal": 0}
    missing = tmp_path / "nowhere" / "config.json"
    with pytest.raises(FileNotFoundError, match=f"{missing}: model config not found"):
        HopdecBackend.open(missing, tmp_path, None, **kw)
    with pytest.raises(TypeError, match="config must be a ModelConfig or the path"):
        HopdecBackend.open({"vocab_size": 1}, tmp_path, None, **kw)
    with pytest.raises(BundleError, match="manifest.json: no manifest.json"):
        HopdecBackend.open(CFG, tmp_path, None, **kw)
    bundle = _bundle_dir(tmp_path, tp=4)
    with pytest.raises(BundleError, match="built for tp=4, the engine runs tp=2"):
        HopdecBackend.open(CFG, bundle, None, **kw)
    assert fake_gpu == []


def test_open_builds_the_executor_and_close_releases_everything_once(tmp_path, fake_gpu):
    config_path = tmp_path / "config.json"
    CFG.to_json(config_path)
    b = HopdecBackend.open(config_path, _bundle_dir(tmp_path, tp=2), None, tp=2, rank=1,
                           geometry=GEOMETRY, device_ordinal=3)
    assert fake_gpu == ["device 3", "bundle loaded"]
    assert b.executor.config == CFG and (b.executor.tp, b.executor.rank) == (2, 1)
    assert b.step(1, 7) == StepResult.NOT_BOUND
    b.close()
    b.close()
    assert fake_gpu[2:] == ["bundle closed", "device closed"]
    assert b.step(1, 7) == StepResult.CLOSED


def test_open_closes_what_it_opened_when_the_executor_refuses(tmp_path, fake_gpu):
    with pytest.raises(ValueError, match="0 <= rank < tp"):
        HopdecBackend.open(CFG, _bundle_dir(tmp_path, tp=2), None, tp=2, rank=2,
                           geometry=GEOMETRY, device_ordinal=0)
    assert fake_gpu == ["device 0", "bundle loaded", "bundle closed", "device closed"]


class _FakeAllReduce:
    """Stands in for collectives.oneshot.OneShotAllReduce: records its arguments and close."""

    def __init__(self, log: list, bundle, rank, world, width, exchange, *, timeout_ms):
        self.log, self.args = log, (rank, world, width, exchange, timeout_ms)
        self.silent: list[int] = []
        log.append("allreduce")

    def state(self):
        return ("comm of", self)

    def failed_sources(self):
        return self.silent

    def close(self):
        self.log.append("allreduce closed")


@pytest.fixture
def fake_collectives(monkeypatch, fake_gpu):
    """fake_gpu, plus the one-shot all-reduce and the context synchronize faked into its log."""
    from collectives import oneshot
    from executor import vllm_adapter

    monkeypatch.setattr(oneshot, "OneShotAllReduce",
                        lambda *a, **kw: _FakeAllReduce(fake_gpu, *a, **kw))
    monkeypatch.setattr(vllm_adapter, "_synchronize", lambda: fake_gpu.append("synchronize"))
    return fake_gpu


def _exchange(log: list, fail: bool = False):
    def exchange(payload: bytes):
        log.append(payload)
        if fail:
            raise TimeoutError("a peer died")
        return [payload] * 2
    return exchange


def test_open_with_exchange_owns_the_allreduce_and_closes_it_collectively(tmp_path,
                                                                          fake_collectives):
    log = fake_collectives
    exchange = _exchange(log)
    timeout = int(np.random.default_rng().integers(1, 100_000))
    b = HopdecBackend.open(CFG, _bundle_dir(tmp_path, tp=2), None, tp=2, rank=1,
                           geometry=GEOMETRY, device_ordinal=0, exchange=exchange,
                           timeout_ms=timeout)
    assert log == ["device 0", "bundle loaded", "allreduce"]
    comm = b.executor.comm
    assert comm[0] == "comm of" and comm[1].args == (1, 2, CFG.hidden_size, exchange, timeout)
    assert b.collective_timeouts() == []
    comm[1].silent = [0]
    assert b.collective_timeouts() == [0]
    assert backend()[0].collective_timeouts() == []              # no all-reduce of its own
    b.close()
    assert log[3:] == ["synchronize", "bundle closed", b"close", "allreduce closed",
                       "device closed"]
    b.close()
    assert len(log) == 8


def test_close_leaves_the_allreduce_when_the_ranks_cannot_agree(tmp_path, fake_collectives):
    b = HopdecBackend.open(CFG, _bundle_dir(tmp_path, tp=2), None, tp=2, rank=0,
                           geometry=GEOMETRY, device_ordinal=0,
                           exchange=_exchange(fake_collectives, fail=True))
    with pytest.raises(TimeoutError, match="a peer died"):
        b.close()
    assert fake_collectives[3:] == ["synchronize", "bundle closed", b"close", "device closed"]


def test_open_refuses_comm_and_exchange_together_and_cleans_up_a_failure(tmp_path,
                                                                         fake_collectives):
    bundle = _bundle_dir(tmp_path, tp=2)
    kw = {"tp": 2, "geometry": GEOMETRY, "device_ordinal": 0}
    with pytest.raises(ValueError, match="pass comm= .* or exchange= .*not both"):
        HopdecBackend.open(CFG, bundle, None, rank=0, comm=object(),
                           exchange=_exchange(fake_collectives), **kw)
    assert fake_collectives == []
    with pytest.raises(ValueError, match="0 <= rank < tp"):
        HopdecBackend.open(CFG, bundle, None, rank=2, exchange=_exchange(fake_collectives), **kw)
    assert fake_collectives == ["device 0", "bundle loaded", "allreduce", "allreduce closed",
                                "bundle closed", "device closed"]


def test_capture_with_exchange_waits_for_every_rank(monkeypatch):
    from executor import vllm_adapter

    log: list = []
    ex, rec = make_executor()
    b = HopdecBackend(ex, exchange=_exchange(log))
    b.bind(**vllm_fakes(b))
    capture = ex.capture
    monkeypatch.setattr(ex, "capture", lambda: (capture("capture-stream"), log.append("captured")))
    monkeypatch.setattr(vllm_adapter, "_synchronize", lambda: log.append("synchronize"))
    b.capture()
    assert log == ["captured", "synchronize", b"captured"]
    assert b.executor.captured and rec.captured == sorted(BUCKETS, reverse=True)
