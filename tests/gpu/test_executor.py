"""Executor mechanics on the GPU with the probe kernels (the model's stages are not wired yet).

The plan is decode_plan(tiny) with every stage wired to no launch except `head.embed`, which
launches `rows` chain-step probes adding 1 each to a u32 counter in the first 4 bytes of the bound
`tokens` buffer. So a served step of n rows leaves counter == bucket(n) in the caller's memory, a
declined step leaves it untouched, and a step behind a 50 ms spin shows `step` returns at once.
Needs an SM90 GPU, CuPy and a bundle with the probes (HOPDEC_BUNDLE, default build/bundle-tiny).
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from executor.bind import BindError, CacheGeometry
from executor.cuda import check, driver
from executor.executor import Executor
from executor.graphs import BUCKETS
from executor.plan import decode_plan
from executor.reasons import StepFeature, StepResult
from executor.runtime import Arena, LaunchSpec
from kernels import probes_ref as pr
from loader.config import ModelConfig

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

CFG = ModelConfig.preset("tiny")
GEOMETRY = CacheGeometry(max_seqs=2, ring_slots=32, ring_rows=8, page_size=64, num_pages=8,
                         pages_per_seq=4)
CP_DTYPES = {"int8": cp.int8, "int32": cp.int32, "int64": cp.int64, "uint8": cp.uint8,
             "float32": cp.float32}


def _probe_executor(dev, bundle) -> Executor:
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
    return ex


def _cupy_tensors(ex: Executor) -> dict:
    return {r.name: cp.zeros(r.shape, CP_DTYPES[r.dtype]) for r in ex.rules.values()}


def test_bind_records_cupy_pointers_and_rejects_a_strided_view(dev, tiny_bundle):
    ex = _probe_executor(dev, tiny_bundle)
    try:
        tensors = _cupy_tensors(ex)
        ex.bind(**tensors)
        assert dict(ex.binding.pointers) == {n: t.data.ptr for n, t in tensors.items()}
        wide = cp.zeros((192, 2 * GEOMETRY.pages_per_seq), cp.int32)
        with pytest.raises(BindError, match="'block_tables': expected a row-major contiguous"):
            ex.bind(**{**tensors, "block_tables": wide[:, ::2]})
        assert ex.binding.ptr("block_tables") == tensors["block_tables"].data.ptr
    finally:
        ex.close()


def test_step_replays_the_bucket_into_bound_memory_and_declines_write_nothing(dev, tiny_bundle):
    ex = _probe_executor(dev, tiny_bundle)
    caller = dev.stream()
    try:
        tensors = _cupy_tensors(ex)
        ex.bind(**tensors)
        ex.capture()
        counter = tensors["tokens"].view(cp.uint32)
        rng = np.random.default_rng()
        for rows in [1, 3, 6, 48, 192, *rng.integers(1, 193, size=4).tolist()]:
            counter[:] = 0
            cp.cuda.Device().synchronize()      # CuPy's legacy-stream work before our stream's
            assert ex.step(int(rows), caller.handle) == StepResult.SERVED
            caller.synchronize()
            assert int(counter[0].get()) == min(b for b in BUCKETS if b >= rows), rows
        counter[:] = 0
        cp.cuda.Device().synchronize()
        assert ex.step(193, caller.handle) == StepResult.TOO_MANY_ROWS
        assert ex.step(6, caller.handle, int(StepFeature.PREFILL)) == StepResult.PREFILL_ROWS
        assert ex.step(6, caller.handle, int(StepFeature.LORA)) == \
            StepResult.UNSUPPORTED_FEATURE
        caller.synchronize()
        assert int(counter[0].get()) == 0
    finally:
        ex.close()


def test_step_is_sync_free_behind_a_long_kernel(dev, tiny_bundle):
    """step() returns while a 50 ms spin queued before it on the caller's stream still runs."""
    spin_ns = 50_000_000
    cu = driver()
    ex = _probe_executor(dev, tiny_bundle)
    caller = dev.stream()
    done = check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DEFAULT))
    try:
        ex.bind(**_cupy_tensors(ex))
        ex.capture()
        ex.step(6, caller.handle)                 # first use of this stream handle: warm
        caller.synchronize()
        with Arena(dev, [("out", 8)]) as arena:
            spin = LaunchSpec(tiny_bundle.kernel(pr.SPIN.name), (1,), (arena.ptr("out"), spin_ns))
            t0 = time.perf_counter()
            spin.launch(caller)
            codes = [ex.step(rows, caller.handle) for rows in (1, 6, 48, 192)]
            host_s = time.perf_counter() - t0
            check(cu.cuEventRecord(done, caller.cu_handle))
            err, = cu.cuEventQuery(done)
            still_running = err == cu.CUresult.CUDA_ERROR_NOT_READY
            caller.synchronize()
    finally:
        check(cu.cuEventDestroy(done))
        ex.close()
    print(f"host {host_s * 1e6:.1f} us for a spin launch + 4 steps")
    assert codes == [StepResult.SERVED] * 4
    assert still_running, "the spin had finished when step() returned: something waited"
    assert host_s < 0.1 * spin_ns / 1e9
