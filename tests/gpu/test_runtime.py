"""GPU runtime behaviour, proved with the probe kernels: arena, graphs, PDL, sync-freedom, cleanup.

Needs an SM90 GPU, CuPy and a bundle with the probes (HOPDEC_BUNDLE, default build/bundle-tiny).
"""
from __future__ import annotations

import itertools
import json
import random
import shutil
import time

import numpy as np
import pytest

from executor.cuda import CudaError, check, driver
from executor.runtime import (
    Arena,
    Bundle,
    BundleError,
    Device,
    EventTimer,
    Graph,
    GraphSet,
    LaunchSpec,
)
from kernels import probes_ref as pr

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")   # uploads/downloads; devicecheck counts a skip as a failure



def _cupy_done() -> None:
    """CuPy works on the legacy stream, which our non-blocking streams do not wait for."""
    cp.cuda.Device().synchronize()


def _u32_view(arena: Arena, name: str):
    return arena.view(name, np.uint32)


def _chain(bundle, counter_ptr: int, pdl: bool, grid=None) -> LaunchSpec:
    k = bundle.kernel(pr.CHAIN_STEP.name)
    return LaunchSpec(k, grid or pr.CHAIN_STEP.grid(), (counter_ptr,), pdl=pdl)


def test_device_is_an_h200_class_sm90(dev):
    assert dev.info.compute_capability == (9, 0)
    assert dev.info.sm_count >= 100 and dev.info.l2_bytes >= 40 << 20


def test_arena_slices_aligned_disjoint_and_writable(dev, stream):
    rng = random.Random()
    reqs = [(f"s{i}", rng.randint(1, 3 << 20)) for i in range(24)]
    with Arena(dev, reqs, align=512) as arena:
        ptrs = {n: arena.ptr(n) for n, _ in reqs}
        assert all(p % 512 == 0 for p in ptrs.values())
        spans = sorted((ptrs[n], ptrs[n] + nb) for n, nb in reqs)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
        for i, (n, nb) in enumerate(reqs):          # a distinct byte per slice, read back whole
            arena.view(n, np.uint8)[:] = i + 1
        whole = cp.ndarray((arena.total_bytes,), cp.uint8,
                           cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(arena.base,
                                                 arena.total_bytes, arena), 0)).get()
        for i, (n, nb) in enumerate(reqs):
            off = arena.slices[n].offset
            assert (whole[off:off + nb] == i + 1).all(), n


def test_stream_read_probe_writes_exact_partials(dev, tiny_bundle, stream):
    grid_x = dev.sm_count * pr.STREAM_CTAS_PER_SM
    nbytes = (8 << 20) + 16 * random.randint(1, 4096)      # ragged: the tail loop runs too
    nparts = pr.stream_read_partials_count(grid_x)
    with Arena(dev, [("src", nbytes), ("parts", 4 * nparts)]) as arena:
        src = cp.random.randint(0, 2**32, size=nbytes // 4, dtype=cp.int64).astype(cp.uint32)
        _u32_view(arena, "src")[:] = src
        _u32_view(arena, "parts")[:] = 0xDEADBEEF          # poison
        _cupy_done()
        spec = LaunchSpec(tiny_bundle.kernel(pr.STREAM_READ.name), (grid_x,),
                          (arena.ptr("src"), arena.ptr("parts"), nbytes // 16))
        spec.launch(stream)
        stream.synchronize()
        got = _u32_view(arena, "parts").get()
    expected = pr.stream_read_partials_ref(src.get(), grid_x)
    np.testing.assert_array_equal(got, expected)            # every partial, bit for bit


def test_spin_probe_spins_at_least_the_requested_time(dev, tiny_bundle, stream):
    spin_ns = 200_000
    with Arena(dev, [("out", 8)]) as arena, _timer(stream) as timer:
        spec = LaunchSpec(tiny_bundle.kernel(pr.SPIN.name), (1,), (arena.ptr("out"), spin_ns))
        us = timer.median_us(lambda: spec.launch(stream), reps=5, warmup=1)
        elapsed = int(arena.view("out", np.int64).get()[0])
    assert spin_ns <= elapsed < spin_ns + 50_000
    assert us >= spin_ns / 1e3


class _timer:
    def __init__(self, stream):
        self.t = EventTimer(stream, max_reps=50)

    def __enter__(self):
        return self.t

    def __exit__(self, *exc):
        self.t.close()


def _stream_and_chain_specs(dev, bundle, arena, steps, pdl):
    grid_x = dev.sm_count * pr.STREAM_CTAS_PER_SM
    read = LaunchSpec(bundle.kernel(pr.STREAM_READ.name), (grid_x,),
                      (arena.ptr("src"), arena.ptr("parts"), arena.nbytes("src") // 16), pdl=pdl)
    return [read] + [_chain(bundle, arena.ptr("counter"), pdl) for _ in range(steps)]


@pytest.mark.parametrize("pdl", [True, False])
def test_graph_replay_equals_eager_bitwise(dev, tiny_bundle, stream, pdl):
    steps, nbytes = 16, 4 << 20
    grid_x = dev.sm_count * pr.STREAM_CTAS_PER_SM
    reqs = [("src", nbytes), ("parts", 4 * pr.stream_read_partials_count(grid_x)), ("counter", 4)]
    with Arena(dev, reqs) as arena:
        _u32_view(arena, "src")[:] = cp.random.randint(0, 2**32, size=nbytes // 4,
                                                       dtype=cp.int64).astype(cp.uint32)
        specs = _stream_and_chain_specs(dev, tiny_bundle, arena, steps, pdl)

        def run_eager_or_record():
            for s in specs:
                s.launch(stream)

        def state():
            stream.synchronize()
            return _u32_view(arena, "parts").get(), int(_u32_view(arena, "counter").get()[0])

        def reset():
            _u32_view(arena, "parts")[:] = 0xDEADBEEF
            _u32_view(arena, "counter")[:] = 0
            _cupy_done()

        reset()
        run_eager_or_record()
        eager = state()
        with Graph.capture(stream) as g:
            run_eager_or_record()
        try:
            reset()
            g.launch(stream)
            first = state()
            _u32_view(arena, "parts")[:] = 0xDEADBEEF
            _cupy_done()
            g.launch(stream)
            second = state()
        finally:
            g.close()
    assert eager[1] == steps and first[1] == steps and second[1] == 2 * steps
    np.testing.assert_array_equal(first[0], eager[0])
    np.testing.assert_array_equal(second[0], first[0])


@pytest.mark.parametrize("pdl, edge", [(True, "programmatic"), (False, "default")])
def test_captured_edges_are_programmatic_only_with_pdl(dev, tiny_bundle, stream, pdl, edge):
    with Arena(dev, [("counter", 4)]) as arena:
        specs = [_chain(tiny_bundle, arena.ptr("counter"), pdl) for _ in range(12)]
        with Graph.capture(stream) as g:
            for s in specs:
                s.launch(stream)
        try:
            assert g.num_nodes() == 12
            assert g.edge_types() == [edge] * 11
        finally:
            g.close()


@pytest.mark.parametrize("pdl", [True, False])
def test_pdl_overlap_is_observed_only_with_the_attribute(dev, tiny_bundle, stream, pdl):
    """The consumer reads the producer's flag before griddepcontrol.wait: with PDL it runs while
    the producer spins (flag not yet set); without the attribute it starts after (flag set)."""
    with Arena(dev, [("flag", 4), ("out", 8)]) as arena:
        for _ in range(5):
            token = random.randint(1, 2**31 - 1)
            _u32_view(arena, "flag")[:] = 0
            _u32_view(arena, "out")[:] = 0xDEADBEEF
            _cupy_done()
            producer = LaunchSpec(tiny_bundle.kernel(pr.PDL_PRODUCER.name), (1,),
                                  (arena.ptr("flag"), 100_000, token), pdl=pdl)
            consumer = LaunchSpec(tiny_bundle.kernel(pr.PDL_CONSUMER.name), (1,),
                                  (arena.ptr("flag"), arena.ptr("out"), token), pdl=pdl)
            producer.launch(stream)
            consumer.launch(stream)
            stream.synchronize()
            seen_before_wait, after_wait = (int(v) for v in _u32_view(arena, "out").get())
            assert after_wait == token                    # the wait always orders memory
            assert seen_before_wait == (0 if pdl else 1)


def test_graph_launch_returns_before_a_long_kernel_finishes(dev, tiny_bundle, stream):
    """Sync-freedom: launching a step graph behind a 50 ms spin returns to the host at once."""
    spin_ns = 50_000_000
    cu = driver()
    with Arena(dev, [("out", 8), ("counter", 4)]) as arena:
        spin = LaunchSpec(tiny_bundle.kernel(pr.SPIN.name), (1,), (arena.ptr("out"), spin_ns))
        chain = [_chain(tiny_bundle, arena.ptr("counter"), True) for _ in range(50)]
        with Graph.capture(stream) as g:
            for s in chain:
                s.launch(stream)
        done = check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DEFAULT))
        try:
            stream.synchronize()
            t0 = time.perf_counter()
            spin.launch(stream)
            g.launch(stream)
            g.launch(stream)
            host_s = time.perf_counter() - t0
            check(cu.cuEventRecord(done, stream.cu_handle))
            err, = cu.cuEventQuery(done)
            still_running = err == cu.CUresult.CUDA_ERROR_NOT_READY
            stream.synchronize()
            wall_s = time.perf_counter() - t0
        finally:
            check(cu.cuEventDestroy(done))
            g.close()
    print(f"host {host_s * 1e6:.1f} us for spin + 2 graph launches; wall {wall_s * 1e3:.2f} ms")
    assert still_running, "the spin kernel had already finished when the launches returned"
    assert host_s < 0.1 * spin_ns / 1e9 and wall_s >= spin_ns / 1e9


def test_graphset_replays_the_bucket_of_the_rows(dev, tiny_bundle, stream):
    with Arena(dev, [("counter", 4)]) as arena:
        specs = [_chain(tiny_bundle, arena.ptr("counter"), True) for _ in range(8)]
        gs = GraphSet.capture(stream, lambda rows: [s.launch(stream) for s in specs[:rows]],
                              buckets=(1, 2, 4, 8))
        try:
            counter = _u32_view(arena, "counter")
            for rows, bucket in [(1, 1), (3, 4), (5, 8), (8, 8)]:
                counter[:] = 0
                _cupy_done()
                assert gs.launch(rows, stream) == bucket
                stream.synchronize()
                assert int(counter.get()[0]) == bucket
            with pytest.raises(ValueError, match="rows=9"):
                gs.bucket_for(9)
        finally:
            gs.close()


def test_every_resource_is_released(tiny_bundle):
    """Device memory returns to its starting free amount once everything is closed."""
    dev = Device(0)
    cp.get_default_memory_pool().free_all_blocks()
    dev.synchronize()
    free0 = dev.mem_free_bytes()
    arena = Arena(dev, [("big", 256 << 20), ("counter", 4)])
    b = Bundle.load(dev, tiny_bundle.manifest.path.parent)   # a second load
    s = dev.stream()
    specs = [_chain(b, arena.ptr("counter"), True) for _ in range(20)]
    with Graph.capture(s) as g:
        for spec in specs:
            spec.launch(s)
    g.launch(s)
    timer = EventTimer(s, max_reps=10)
    s.synchronize()
    assert free0 - dev.mem_free_bytes() >= 256 << 20      # the measurement sees the arena
    for thing in (g, timer, b, arena, dev):
        thing.close()
        thing.close()                                     # idempotent
    with Device(0) as again:
        again.synchronize()
        leaked = free0 - again.mem_free_bytes()
    assert abs(leaked) <= 2 << 20, f"{leaked} bytes not returned"


def test_bad_cubin_and_bad_entry_raise_naming_the_kernel(dev, tiny_bundle, tmp_path):
    src = tiny_bundle.manifest.path.parent
    doc = json.loads(tiny_bundle.manifest.path.read_text())
    name = pr.CHAIN_STEP.name
    rec = doc["kernels"][name]
    shutil.copy(src / rec["cubin"], tmp_path / rec["cubin"])
    doc["kernels"] = {name: dict(rec, entry="no_such_entry")}
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(CudaError, match=f"cuModuleGetFunction.*{name}.*no_such_entry"):
        Bundle.load(dev, tmp_path)
    (tmp_path / rec["cubin"]).write_bytes(b"\x7fELF not really a cubin")
    doc["kernels"] = {name: rec}
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(CudaError, match=f"cuModuleLoadData.*{name}"):
        Bundle.load(dev, tmp_path)
    (tmp_path / rec["cubin"]).unlink()
    with pytest.raises(BundleError, match="does not exist"):
        Bundle.load(dev, tmp_path)


def test_launchspec_arg_errors_on_a_real_kernel(tiny_bundle):
    k = tiny_bundle.kernel(pr.PDL_CONSUMER.name)
    with pytest.raises(TypeError, match="takes 3 args"):
        LaunchSpec(k, (1,), (1 << 20, 1 << 20))
    with pytest.raises(TypeError, match="param 'token'"):
        LaunchSpec(k, (1,), (1 << 20, 1 << 20, 1.0))


def test_launch_on_an_external_callers_stream(dev, tiny_bundle):
    """A caller-owned stream (here CuPy's) is wrapped, launched on, and left open by close()."""
    from executor.runtime import Stream
    theirs = cp.cuda.Stream(non_blocking=True)
    with Arena(dev, [("counter", 4)]) as arena:
        _u32_view(arena, "counter")[:] = 0
        _cupy_done()
        s = Stream.external(theirs.ptr)
        for spec in [_chain(tiny_bundle, arena.ptr("counter"), True) for _ in range(3)]:
            spec.launch(s)
        s.close()
        theirs.synchronize()                              # still valid: we did not destroy it
        assert int(_u32_view(arena, "counter").get()[0]) == 3
