"""GPU tests of the collectives: NCCL at world size 1, and the one-shot IPC all-reduce with 4
processes sharing ONE GPU (correctness, bitwise agreement across ranks, residual epilogue,
consecutive calls and graph replays, a killed rank).

4 processes on one GPU prove the protocol (IPC mapping, pushes, polls, generations, timeouts),
not TP4 performance: the contexts time-slice, so each call waits for the others' time slices.
Tolerance: bitwise everywhere. The kernel and `allreduce_ref` do the same fp32 adds in the same
rank order and one RNE rounding (two for NCCL + residual add, replayed by the reference).
Bundle: HOPDEC_BUNDLE_V41 (width 5120) if present, else HOPDEC_BUNDLE (tiny, width 256).
"""
from __future__ import annotations

import os
import random
import time
from pathlib import Path

import numpy as np
import pytest

from collectives import checks
from collectives.launcher import run_ranks
from kernels import allreduce_ref as ref
from kernels.common_ref import BF16, to_bf16

pytestmark = pytest.mark.gpu

WORLD = 4
CANDIDATES = (("HOPDEC_BUNDLE_V41", "build/bundle-v41-flash-tp4"),
              ("HOPDEC_BUNDLE", "build/bundle-tiny"))


def _bundle() -> tuple[str, int]:
    from executor.bundle import read_manifest
    for var, default in CANDIDATES:
        path = Path(os.environ.get(var, default))
        if (path / "manifest.json").is_file():
            m = read_manifest(path)
            names = [n for n in m.kernels if n.startswith(f"allreduce_oneshot_w{WORLD}_")]
            if names:
                return str(path), int(m.kernels[names[0]].spec["width"])
    pytest.skip("no bundle with the one-shot all-reduce (run make bundles)")


def _check_ok(results):
    assert all(r.ok for r in results), "\n".join(r.describe() + "\n" + r.traceback
                                                 for r in results if not r.ok)


def test_oneshot_allreduce_four_processes_one_gpu():
    bundle_dir, width = _bundle()
    seed = random.randrange(2**32)
    results = run_ranks(checks.oneshot_correctness, WORLD, devices=[0] * WORLD,
                        args=(bundle_dir, width, seed), timeout_s=240)
    _check_ok(results)
    per_rank = [r.value["reports"] for r in results]
    for rank, reports in enumerate(per_rank):
        assert results[rank].value["failed_sources"] == []
        for rep in reports:
            assert rep["unwritten"] == 0 and rep["mismatches"] == 0, (seed, rank, rep)
    # every rank wrote the same bits for every call (the digests of all ranks agree)
    for k in range(len(per_rank[0])):
        digests = {reports[k]["digest"] for reports in per_rank}
        assert len(digests) == 1, (seed, per_rank[0][k])
    phases = {rep["phase"] for rep in per_rank[0]}
    assert phases == {"eager", "back-to-back", "graph"}


def test_killed_rank_raises_on_the_others_within_the_timeout():
    bundle_dir, width = _bundle()
    timeout_ms, victim = 3000, 2
    t0 = time.monotonic()
    results = run_ranks(checks.oneshot_killed_rank, WORLD, devices=[0] * WORLD,
                        args=(bundle_dir, width, victim, timeout_ms), timeout_s=120)
    wall = time.monotonic() - t0
    assert results[victim].error_type == "RankDied" and results[victim].exitcode == -9
    for r in results:
        if r.rank == victim:
            continue
        assert r.error_type == "CollectiveTimeout", r.describe() + "\n" + r.traceback
        assert f"rank(s) [{victim}]" in r.error
    assert wall < 100, f"the survivors took {wall:.0f} s to give up"


# ---- NCCL at world size 1 ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def comm(dev):
    from collectives.nccl import NcclComm
    c = NcclComm.from_unique_id(NcclComm.unique_id(), 0, 1)
    yield c
    c.close()


def _put(ptr, x):
    """Upload and wait: a pageable cuMemcpyHtoD runs on the legacy stream, which our
    non-blocking streams do not wait for, and may return before the DMA has landed."""
    from executor.cuda import check, driver
    check(driver().cuMemcpyHtoD(ptr, np.ascontiguousarray(x), x.nbytes))
    check(driver().cuCtxSynchronize())


def _get(ptr, shape, dtype):
    from executor.cuda import check, driver
    out = np.empty(shape, dtype)
    check(driver().cuMemcpyDtoH(out, ptr, out.nbytes))
    return out


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("rows", [1, 27, 192])
def test_nccl_world1_all_reduce_eager_and_captured(dev, comm, dtype, rows):
    from executor.runtime import Arena, Graph
    width = 5120
    np_dtype = BF16 if dtype == "bf16" else np.float32
    x = np.random.default_rng().standard_normal((rows, width), np.float32).astype(np_dtype)
    nbytes = x.nbytes
    stream = dev.stream()
    with Arena(dev, [("x", nbytes), ("y", nbytes)]) as arena:
        _put(arena.ptr("x"), x)
        _put(arena.ptr("y"), np.full(x.shape, np.nan, np_dtype))
        comm.all_reduce_rows(arena.ptr("x"), arena.ptr("y"), rows, width, dtype, stream.handle)
        stream.synchronize()
        np.testing.assert_array_equal(_get(arena.ptr("y"), x.shape, np_dtype).view(np.uint8),
                                      x.view(np.uint8))      # a sum over one rank is the input
        _put(arena.ptr("y"), np.full(x.shape, np.nan, np_dtype))
        with Graph.capture(stream) as g:
            comm.all_reduce(arena.ptr("x"), arena.ptr("y"), rows * width, dtype, stream.handle)
        try:
            x2 = (x.astype(np.float32) * 3).astype(np_dtype)
            _put(arena.ptr("x"), x2)
            g.launch(stream)
            stream.synchronize()
        finally:
            g.close()
        np.testing.assert_array_equal(_get(arena.ptr("y"), x.shape, np_dtype).view(np.uint8),
                                      x2.view(np.uint8))


def test_nccl_split_of_a_caller_comm_and_byte_all_gather(dev, comm):
    from collectives.nccl import NcclComm
    child = NcclComm.split_from(comm.ptr, key=0)
    try:
        assert (child.rank, child.world) == (0, 1) and child.ptr not in (0, comm.ptr)
        payload = os.urandom(72)
        assert child.all_gather_bytes(payload) == [payload]
    finally:
        child.close()
    assert comm.ptr != 0                      # the parent was wrapped, never destroyed


def test_allreduce_facade_nccl_path_with_residual_add(dev, comm):
    """World 1 through the facade: NCCL in place, then the bf16 residual add kernel."""
    from collectives.allreduce import AllReduce, PathTable
    from executor.runtime import Arena, Bundle, LaunchSpec
    from kernels import elementwise_ref as er

    bundle_dir, width = _bundle()
    spec = er.make_spec(width, "bf16")
    rows = 19
    rng = np.random.default_rng()
    x = rng.standard_normal((rows, width), np.float32).astype(BF16)
    res = (rng.standard_normal((rows, width), np.float32) * 8).astype(BF16)
    stream = dev.stream()
    with Bundle.load(dev, bundle_dir) as bundle, Arena(
            dev, [(n, rows * width * 2) for n in ("x", "res", "out")]) as arena:
        kernel = bundle.kernel(spec.name)
        facade = AllReduce(PathTable(((ref.MAX_ROWS, "nccl"),)), width, nccl=comm,
                           residual_add=lambda n, a, b, o: LaunchSpec(kernel, spec.grid(n),
                                                                      (a, b, o, n)))
        _put(arena.ptr("x"), x)
        _put(arena.ptr("res"), res)
        _put(arena.ptr("out"), np.full(x.shape, np.nan, BF16))
        assert facade.record(rows, arena.ptr("x"), arena.ptr("out"), stream,
                             residual=arena.ptr("res")) == "nccl"
        stream.synchronize()
        got = _get(arena.ptr("out"), x.shape, BF16)
    want = to_bf16(x.astype(np.float32) + res.astype(np.float32))
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
