"""The vLLM adapter driven from torch tensors (torch only as the caller, here in the test).

The executor under the backend runs decode_plan(tiny) with every stage wired to no launch except
`head.embed`, which launches `rows` chain-step probes adding 1 each to a u32 counter in the first
4 bytes of the bound output (`sampled_token_ids`, hopdec `tokens`). So a served step of n rows
leaves bucket(n) in the torch tensor, a declined step leaves it untouched, and every other bound
tensor keeps the random bytes it was filled with. Bound addresses are compared with data_ptr().
Needs an SM90 GPU, torch with CUDA, and a bundle with the probes (HOPDEC_BUNDLE, default
build/bundle-tiny, built for tp=4).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from executor.bind import BindError, CacheGeometry
from executor.executor import Executor
from executor.graphs import BUCKETS
from executor.plan import decode_plan
from executor.reasons import StepResult
from executor.runtime import Bundle, LaunchSpec
from executor.vllm_adapter import HopdecBackend, fallback_reason, step_features
from kernels import probes_ref as pr
from loader.config import ModelConfig

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

BUNDLE = Path(os.environ.get("HOPDEC_BUNDLE", "build/bundle-tiny"))
CFG = ModelConfig.preset("tiny")
GEOMETRY = CacheGeometry(max_seqs=2, ring_slots=32, ring_rows=8, page_size=64, num_pages=8,
                         pages_per_seq=4)
TORCH_DTYPES = {"int8": torch.int8, "int32": torch.int32, "int64": torch.int64,
                "uint8": torch.uint8, "float32": torch.float32}


@pytest.fixture(scope="module")
def bundle(dev):
    if not (BUNDLE / "manifest.json").is_file():
        pytest.skip(f"no kernel bundle at {BUNDLE} (set HOPDEC_BUNDLE or run make bundle)")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    b = Bundle.load(dev, BUNDLE)
    yield b
    b.close()


def _probe_backend(dev, bundle) -> HopdecBackend:
    holder: dict = {}

    def counting(rows: int):
        ptr = holder["ex"].binding.ptr("tokens")
        k = bundle.kernel(pr.CHAIN_STEP.name)
        return [LaunchSpec(k, pr.CHAIN_STEP.grid(), (ptr,)) for _ in range(rows)]

    plan = decode_plan(CFG)
    for stage in plan.stages:
        plan = plan.wire(stage.name, counting if stage.name == "head.embed" else lambda r: [])
    ex = Executor(CFG, bundle, None, tp=1, rank=0, device=dev, geometry=GEOMETRY, plan=plan)
    holder["ex"] = ex
    return HopdecBackend(ex)


def _torch_tensors(b: HopdecBackend) -> dict:
    """One random-filled torch tensor per binding on cuda:0, by vLLM name; outputs zeroed."""
    gen = torch.Generator(device="cuda").manual_seed(int(np.random.default_rng().integers(1 << 62)))
    out = {}
    for vllm, hopdec in b.names.items():
        rule = b.executor.rules[hopdec]
        bytes_ = torch.randint(0, 256, (int(np.prod(rule.shape)) * _itemsize(rule.dtype),),
                               dtype=torch.uint8, device="cuda", generator=gen)
        out[vllm] = bytes_.view(TORCH_DTYPES[rule.dtype]).view(rule.shape)
    out["sampled_token_ids"].zero_()
    return out


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=TORCH_DTYPES[dtype]).element_size()


def test_bind_from_torch_is_in_place_and_refuses_copies(dev, bundle):
    b = _probe_backend(dev, bundle)
    try:
        t = _torch_tensors(b)
        positions_buf = torch.zeros(8192, dtype=torch.int64, device="cuda")   # vLLM-sized
        with pytest.raises(BindError, match=r"Bind positions\[:192\]: a view of the same"):
            b.bind(**{**t, "positions": positions_buf})
        layer = CFG.layers[-1].index
        name = f"swa_kv_cache_{layer}"
        blocks = t[name].view(GEOMETRY.max_seqs, GEOMETRY.ring_slots, 584)
        with pytest.raises(BindError, match=rf"Bind {name}\.view\(64, 584\)"):
            b.bind(**{**t, name: blocks})
        with pytest.raises(BindError, match=r"'input_ids' \(hopdec 'token_ids'\) is int32"):
            b.bind(**{**t, "input_ids": t["input_ids"].to(torch.int32)})
        wide = torch.zeros(192, 2 * GEOMETRY.pages_per_seq, dtype=torch.int32, device="cuda")
        with pytest.raises(BindError, match=r"'block_table' .* \.contiguous\(\) would copy"):
            b.bind(**{**t, "block_table": wide[:, ::2]})
        with pytest.raises(BindError, match="'seq_lens' .* lives on cpu:0"):
            b.bind(**{**t, "seq_lens": t["seq_lens"].cpu()})
        assert b.bound_addresses == {}

        t["positions"] = positions_buf[:192]
        t[name] = blocks.view(-1, 584)
        b.bind(**t)
        assert b.bound_addresses == {n: x.data_ptr() for n, x in t.items()}
        assert b.bound_addresses["positions"] == positions_buf.data_ptr()
    finally:
        b.close()


def test_step_on_the_torch_stream_writes_the_torch_output(dev, bundle):
    b = _probe_backend(dev, bundle)
    try:
        t = _torch_tensors(b)
        b.bind(**t)
        b.capture()
        inputs = {n: x.clone() for n, x in t.items() if n != "sampled_token_ids"}
        out = t["sampled_token_ids"]
        assert torch.cuda.current_stream().cuda_stream == 0           # torch's legacy default
        with pytest.raises(ValueError, match="legacy default stream"):
            b.step(1, torch.cuda.current_stream().cuda_stream)
        decode_stream = torch.cuda.Stream()
        rng = np.random.default_rng()
        with torch.cuda.stream(decode_stream):
            handle = torch.cuda.current_stream().cuda_stream
            for rows in [1, 6, 48, 192, *rng.integers(1, 193, size=4).tolist()]:
                out.zero_()
                decision = b.decide([1] * int(rows), features=step_features())
                assert decision.use_hopdec
                assert b.step(decision.n_rows, handle, decision.features) == StepResult.SERVED
                decode_stream.synchronize()
                assert int(out[0]) == min(x for x in BUCKETS if x >= rows), rows
                assert not out[1:].any()
            out.zero_()
            for batch, kw in [([7], {}), ([6] * 33, {}), ([1], {"any_prefill": True}),
                              ([1], {"features": step_features(non_greedy=True)})]:
                decision = b.decide(batch, **kw)
                assert not decision.use_hopdec
                code = b.step(decision.n_rows, handle, decision.features)
                assert code == decision.reason and fallback_reason(code).startswith("hopdec decl")
            decode_stream.synchronize()
        assert not out.any()
        for n, x in inputs.items():           # bytes: the random float32 bits hold NaNs
            assert torch.equal(t[n].flatten().view(torch.uint8), x.flatten().view(torch.uint8)), \
                f"{n} was written"
        assert b.bound_addresses == {n: x.data_ptr() for n, x in t.items()}
    finally:
        b.close()


def test_open_binds_torch_tensors_and_declines_until_captured(bundle, tmp_path):
    config_path = tmp_path / "config.json"
    CFG.to_json(config_path)
    b = HopdecBackend.open(config_path, BUNDLE, None, tp=4, rank=0, geometry=GEOMETRY,
                           device_ordinal=torch.cuda.current_device())
    try:
        t = _torch_tensors(b)
        b.bind(**t)
        assert b.bound_addresses == {n: x.data_ptr() for n, x in t.items()}
        stream = torch.cuda.Stream()
        assert b.decide([1]).reason == StepResult.NOT_CAPTURED
        assert b.step(1, stream.cuda_stream) == StepResult.NOT_CAPTURED
        with pytest.raises(NotImplementedError):      # no weights given: the plan stays unwired
            b.capture()
        assert b.step(1, stream.cuda_stream) == StepResult.NOT_CAPTURED
    finally:
        b.close()
    assert b.step(1, 7) == StepResult.CLOSED
