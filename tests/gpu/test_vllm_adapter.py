"""The vLLM adapter driven from torch tensors (torch only as the caller, here in the test).

The executor under the backend runs decode_plan(tiny) with every stage wired to no launch except
`head.embed`, which launches `rows` chain-step probes adding 1 each to a u32 counter in the first
4 bytes of the bound output (`sampled_token_ids`, hopdec `tokens`). So a served step of n rows
leaves bucket(n) in the torch tensor, a declined step leaves it untouched, and every other bound
tensor keeps the random bytes it was filled with. Bound addresses are compared with data_ptr().
Needs an SM90 GPU, torch with CUDA, and a bundle with the probes (HOPDEC_BUNDLE, default
build/bundle-tiny, built for tp=4).

The DSpark round through the adapter (last test): four spawned processes, one TP rank each (all
on device 0, or HOPDEC_TP4_DEVICES), each an engine's side: torch tensors by vLLM name, bound in
place (data_ptr), `HopdecBackend.open(..., exchange=, dspark=True)` with the tiny checkpoint's
weights. The rounds and the reference checks are tests/gpu/test_dspark_round_tp4_processes.py's
(`Reference`, `check_round`: the drafts, the verify rows and their lookback, the greedy tokens,
accepted and bonus against the NumPy reference every round); what this test adds is the caller:
each round runs `backend.round()` from a device copy of every bound tensor, then, restored, the
same round split (`draft()`, a read of the drafts, `step()` of the verify rows) for the checks,
and the two must leave bit-identical torch tensors: so round()'s accepted counts and committed
tokens are checked against the reference too.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from ref_model import tiny_checkpoint
from test_dspark_round_tp4_processes import BUCKETS as ROUND_BUCKETS
from test_dspark_round_tp4_processes import ROWS, SEQS, TIMEOUT_MS, Reference, _digest, check_round

from collectives.launcher import run_ranks
from executor.bind import BindError, CacheGeometry
from executor.executor import Executor
from executor.graphs import BUCKETS
from executor.plan import decode_plan
from executor.reasons import StepFeature, StepResult
from executor.runtime import Bundle, LaunchSpec
from executor.tp_run import WeightSource, is_cache, parse_devices
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


# ---- the DSpark round through the adapter: TP 4, four processes, torch as the engine ------------

ROUNDS = 8                  # x SEQS = 3 sequences in the slot bucket of 4 (one padding slot)
ROUND_RUN_TIMEOUT_S = 540


class _EngineRank:
    """One rank's engine side: the backend, its torch tensors by vLLM name, a decode stream."""

    def __init__(self, backend: HopdecBackend, device: int):
        self.b, self.k = backend, backend.executor.config.dspark_block_size
        self.stream = torch.cuda.Stream(device=device)
        self.handle = self.stream.cuda_stream
        self.t = {}
        with torch.cuda.stream(self.stream):    # the zero fills ordered before the writes
            for vllm, hopdec in backend.names.items():
                rule = backend.executor.rules[hopdec]
                if rule.required:               # logits left out: the greedy path alone
                    self.t[vllm] = torch.zeros(rule.shape, dtype=TORCH_DTYPES[rule.dtype],
                                               device=f"cuda:{device}")
        self.vllm = {h: v for v, h in backend.names.items() if v in self.t}

    def write(self, hopdec: str, host: np.ndarray) -> None:
        with torch.cuda.stream(self.stream):
            self.t[self.vllm[hopdec]].copy_(torch.from_numpy(host))

    def read(self, hopdec: str) -> np.ndarray:
        self.stream.synchronize()
        return self.t[self.vllm[hopdec]].cpu().numpy()

    def rows(self, n: int) -> dict:
        out = {name: self.read(name)[:n] for name in (*ROWS, "token_history")}
        out["context_lens"] = self.read("context_lens")[:SEQS]
        return out

    def digests(self) -> dict:
        return {n: _digest(self.read(n)) for n in self.vllm}

    def declines(self) -> dict:
        """Every way round() declines, and that none wrote a byte of a bound tensor."""
        b, h, over = self.b, self.handle, self.b.max_seqs + 1
        before = self.digests()
        decisions = [b.decide_round([self.k + 1] * over),
                     b.decide_round([self.k + 1] * (SEQS - 1) + [self.k + 2]),
                     b.decide_round([self.k + 1] * SEQS, features=step_features(non_greedy=True)),
                     b.decide_round([self.k + 1] * (SEQS - 1) + [self.k])]
        codes = [b.round(0, h), b.round(over, h), b.draft(over, h),
                 b.round(SEQS, h, StepFeature.PREFILL),
                 b.round(SEQS, h, step_features(non_greedy=True))]
        after = self.digests()
        return {"decided": [int(d.reason) for d in decisions], "codes": [int(c) for c in codes],
                "changed": sorted(n for n in before if before[n] != after[n])}

    def one_round(self) -> dict:
        """round() from a copy of every bound tensor, then (restored) draft(), reads, step():
        what check_round takes, and which torch tensors the two runs left differently."""
        b, k = self.b, self.k
        decision = b.decide_round([k + 1] * SEQS)
        with torch.cuda.stream(self.stream):
            saved = {n: x.clone() for n, x in self.t.items()}
            round_code = b.round(decision.n_seqs, self.handle, decision.features)
            by_round = {n: x.clone() for n, x in self.t.items()}
            for n, x in self.t.items():
                x.copy_(saved[n])
            out = {"decision": int(decision.reason), "round_code": int(round_code),
                   "draft_code": int(b.draft(SEQS, self.handle))}
            out["verify_in"] = self.rows(SEQS * (k + 1))
            vocab_l = b.executor.config.vocab_size // b.executor.tp
            out["base"] = b.executor.arena.download("dspark.base", np.float32,
                                                    (SEQS * k, vocab_l))
            out["verify_code"] = int(b.step(SEQS * (k + 1), self.handle))
            out["tokens"] = self.read("tokens")[:SEQS * (k + 1)]
            out["accepted"] = self.read("accepted")[:SEQS]
            out["bonus"] = self.read("bonus")[:SEQS + 1]
            out["draft_in"] = self.rows(SEQS * k)
            out["caches"] = {n: d for n, d in self.digests().items() if is_cache(n)}
            self.stream.synchronize()
            out["round_differs"] = sorted(
                n for n, x in self.t.items()
                if not torch.equal(x.flatten().view(torch.uint8),
                                   by_round[n].flatten().view(torch.uint8)))
        return out


def _round_rank(ctx, bundle_dir: str, ckpt_dir: str, geometry, inputs: dict) -> dict:
    """One rank (a spawned process): open, bind torch tensors, write the first rows once,
    capture, the declines, ROUNDS rounds; close (collective)."""
    cfg, fetch = WeightSource(checkpoint=ckpt_dir).open(ctx.world, ctx.rank)
    torch.cuda.set_device(ctx.device)
    b = HopdecBackend.open(cfg, bundle_dir, fetch, tp=ctx.world, rank=ctx.rank,
                           geometry=geometry, device_ordinal=ctx.device, exchange=ctx.exchange,
                           timeout_ms=TIMEOUT_MS, dspark=True, buckets=ROUND_BUCKETS)
    try:
        e = _EngineRank(b, ctx.device)
        for hopdec, host in inputs.items():         # the only host write: before round 0
            e.write(hopdec, host)
        b.bind(**e.t)
        in_place = b.bound_addresses == {n: x.data_ptr() for n, x in e.t.items()}
        b.capture()
        declined = e.declines()
        rounds = [e.one_round() for _ in range(ROUNDS)]
        return {"in_place": in_place, "max_seqs": b.max_seqs, "declined": declined,
                "rounds": rounds, "failed_sources": b.collective_timeouts()}
    finally:
        b.close()


def test_dspark_rounds_through_the_adapter_from_torch_follow_the_reference():
    if not (BUNDLE / "manifest.json").is_file():
        pytest.skip(f"no kernel bundle at {BUNDLE} (set HOPDEC_BUNDLE or run make bundle)")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    world = 4
    ref = Reference(np.random.default_rng())
    geometry = CacheGeometry.of(ref.caches)
    results = run_ranks(_round_rank, world, timeout_s=ROUND_RUN_TIMEOUT_S,
                        devices=parse_devices(os.environ.get("HOPDEC_TP4_DEVICES"), world),
                        args=(str(BUNDLE), str(tiny_checkpoint().path), geometry,
                              ref.initial_inputs(geometry)))
    assert all(r.ok for r in results), "\n".join(r.describe() + "\n" + r.traceback
                                                 for r in results if not r.ok)
    values = [r.value for r in results]
    too_many, prefill, unsupported = (StepResult.TOO_MANY_ROWS, StepResult.PREFILL_ROWS,
                                      StepResult.UNSUPPORTED_FEATURE)
    for r, v in enumerate(values):
        assert v["in_place"], f"rank {r}: a bound address is not the torch tensor's data_ptr()"
        assert v["max_seqs"] == 32 and v["failed_sources"] == [], (r, v["failed_sources"])
        assert v["declined"]["decided"] == [too_many, prefill, unsupported, unsupported]
        assert v["declined"]["codes"] == [StepResult.NO_ROWS, too_many, too_many, prefill,
                                          unsupported]
        assert v["declined"]["changed"] == [], f"rank {r}: a declined call wrote"
        for rnd, one in enumerate(v["rounds"]):
            assert (one["decision"], one["round_code"]) == (0, 0), (r, rnd)
            assert one["round_differs"] == [], (
                f"rank {r} round {rnd}: round() left other bytes than draft() + step() in "
                f"{one['round_differs']}")
    for rnd in range(ROUNDS):
        check_round(ref, rnd, [v["rounds"][rnd] for v in values])
    total = ROUNDS * SEQS
    print(f"\n{ROUNDS} rounds x {SEQS} sequences through the adapter: accepted {ref.accepted}, "
          f"drafts equal {ref.draft_equal}/{ref.draft_total}, verify equal "
          f"{ref.verify_equal}/{total}, near ties {ref.ties}, worst U {ref.worst_u}")
    assert ref.draft_equal >= ref.draft_total // 2, ref.draft_equal
    assert ref.verify_equal >= total // 2, ref.verify_equal
