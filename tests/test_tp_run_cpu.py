"""What executor/tp_run.py decides without a GPU: devices per rank, argument checks, the weights
source, that the caller tensors it allocates and the host inputs it writes are exactly what
binding_rules and the emulated ranks (executor.emulate.ranks) use, and that the Executor it builds
wires and builds every stage at its buckets (on host memory)."""
import numpy as np
import pytest
from ref_model import new_caches, random_prompt, tiny_checkpoint, tiny_model

from executor.bind import MAX_ROWS, CacheGeometry, binding_rules, validate_binding
from executor.bundle import BundleError
from executor.dlpack import KDL_CPU
from executor.emulate.ranks import caller_tensors, fill_caller_tensors
from executor.reference.rows import RowBatch, RowBlock
from executor.tp_run import (
    RankSpec,
    TPRank,
    WeightSource,
    allocate,
    bound_rules,
    check_buckets,
    host_inputs,
    is_cache,
    parse_devices,
)


def test_parse_devices_one_gpu_by_default_else_one_ordinal_per_rank():
    assert parse_devices(None, 4) == (0, 0, 0, 0)
    assert parse_devices("  ", 4) == (0, 0, 0, 0)
    assert parse_devices("0,1,2,3", 4) == (0, 1, 2, 3)
    assert parse_devices(" 3, 2 ,1,0", 4) == (3, 2, 1, 0)
    with pytest.raises(ValueError, match="names 2 device.*world of 4"):
        parse_devices("0,1", 4)
    with pytest.raises(ValueError, match="comma-separated ordinals"):
        parse_devices("0,1,-2,3", 4)
    with pytest.raises(ValueError, match="comma-separated ordinals"):
        parse_devices("gpu0,gpu1", 2)
    with pytest.raises(ValueError, match="world must be a positive int"):
        parse_devices("0", 0)


@pytest.mark.parametrize("devices", [(0, 0, 0, 0), (0, 1, 2, 3), (3, 1, 0, 2)])
def test_rank_spec_maps_each_rank_to_its_device(devices):
    specs = [RankSpec.of(r, devices) for r in range(len(devices))]
    assert [(s.rank, s.world, s.device) for s in specs] == [
        (r, len(devices), d) for r, d in enumerate(devices)]
    with pytest.raises(ValueError, match="rank 4 outside the 4 devices"):
        RankSpec.of(4, devices)


def test_rank_spec_rejects_bad_values():
    with pytest.raises(ValueError, match="0 <= rank < world"):
        RankSpec(4, 4, 0)
    with pytest.raises(ValueError, match="device >= 0"):
        RankSpec(0, 4, -1)
    with pytest.raises(TypeError, match="RankSpec.rank must be an int"):
        RankSpec(True, 4, 0)
    with pytest.raises(TypeError, match="RankSpec.device must be an int"):
        RankSpec(0, 4, "0")


def test_weight_source_needs_exactly_one_origin(tmp_path):
    with pytest.raises(ValueError, match="exactly one of checkpoint="):
        WeightSource()
    with pytest.raises(ValueError, match="exactly one of checkpoint="):
        WeightSource(checkpoint=str(tmp_path), preset="tiny")
    with pytest.raises(ValueError, match="not a directory"):
        WeightSource(checkpoint=str(tmp_path / "missing"))


@pytest.mark.parametrize("rank", [0, 3])
def test_weight_sources_agree_checkpoint_and_synthetic(rank):
    """The tiny checkpoint (synth, seed 0) and the synthetic source give the same rank slices."""
    ckpt = tiny_checkpoint()
    cfg_a, fetch_a = WeightSource(checkpoint=str(ckpt.path)).open(4, rank)
    cfg_b, fetch_b = WeightSource(preset="tiny", seed=0).open(4, rank)
    assert cfg_a.to_dict() == cfg_b.to_dict()
    names = ["embed.weight", "head.weight", next(n for n in ckpt.specs if ".ffn.experts." in n)]
    for name in names:
        a, b = fetch_a(name), fetch_b(name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert a.tobytes() == b.tobytes(), name


def test_buckets_must_end_at_max_rows():
    assert check_buckets((192, 8, 8)) == (8, MAX_ROWS)
    for bad in [(8,), (), (0, 192)]:
        with pytest.raises(ValueError, match=f"the largest must be {MAX_ROWS}"):
            check_buckets(bad)


def _geometry():
    return CacheGeometry.of(new_caches(tiny_model(4)))


@pytest.mark.parametrize("bind_logits", [False, True])
def test_caller_tensors_match_binding_rules_exactly(bind_logits):
    cfg, geometry = tiny_checkpoint().config, _geometry()
    rules = bound_rules(cfg, 4, geometry, bind_logits)
    every = binding_rules(cfg, 4, geometry)
    want = [n for n, r in every.items() if r.required or (bind_logits and n == "logits")]
    assert list(rules) == want
    tensors = allocate(rules, np.zeros)
    assert list(tensors) == want
    for name, arr in tensors.items():
        assert arr.dtype == np.dtype(every[name].dtype) and arr.shape == every[name].shape, name
        assert arr.flags.c_contiguous and not arr.any(), name
    binding = validate_binding(every, tensors, (KDL_CPU, 0))   # what Executor.bind checks
    assert sorted(binding.pointers) == sorted(want)


def test_host_inputs_are_what_the_emulated_ranks_load():
    rng = np.random.default_rng()
    model = tiny_model(4)
    cfg, caches = model.cfg, new_caches(model)
    geometry = CacheGeometry.of(caches)
    for arr in caches.swa.values():                 # distinct bytes, so a mix-up shows
        arr[...] = rng.integers(0, 256, arr.shape, dtype=np.uint8)
    toks = tuple(random_prompt(rng, 6))
    rows = RowBatch.from_blocks([RowBlock(1, 9, toks, "verify")], caches.block_tables,
                                caches.ring_slots)
    history = rng.integers(0, 1000, (rows.num_rows, cfg.engram_max_ngram_size))
    want = caller_tensors(cfg, 4, geometry, MAX_ROWS)
    fill_caller_tensors(want, rows, caches, history)
    meta = host_inputs(cfg, 4, geometry, rows, history)
    full = host_inputs(cfg, 4, geometry, rows, history, caches)
    outputs = {"tokens", "logits"}
    assert sorted(meta) == sorted(n for n in want if not is_cache(n) and n not in outputs)
    assert sorted(full) == sorted(n for n in want if n not in outputs)
    for name, arr in full.items():
        assert arr.dtype == want[name].dtype and arr.tobytes() == want[name].tobytes(), name
        if name in meta:
            assert meta[name].tobytes() == arr.tobytes(), name
    assert (meta["slot_mapping"][rows.num_rows:] == -1).all()       # padding up to 192 rows
    assert (meta["seq_index"][rows.num_rows:] == -1).all()


def test_rank_refuses_bad_buckets_and_a_bundle_of_another_world(tiny_bundle_dir):
    """Both before any GPU call (these run on a CPU): nothing to leave half-open."""
    source, geometry = WeightSource(preset="tiny"), _geometry()
    with pytest.raises(ValueError, match=f"the largest must be {MAX_ROWS}"):
        TPRank(RankSpec(0, 4, 0), tiny_bundle_dir, source, geometry, exchange=None,
               buckets=(8,))
    with pytest.raises(BundleError, match="built for tp=4, this world is 2"):
        TPRank(RankSpec(0, 2, 0), tiny_bundle_dir, source, geometry, exchange=None)


def _wired_executor(bundle_dir, buckets, built: list):
    """An Executor made as TPRank makes it (every stage module, a one-shot state), on host
    memory: capture() packs and wires the arena, then builds each bucket's launches (LaunchSpec
    checks grids and pointers) instead of capturing them."""
    from test_executor_cpu import FakeCudaTensor, FakeDevice

    from collectives.oneshot import CollectiveState
    from executor.emulate import bind_host
    from executor.executor import Executor
    from executor.graphs import GraphSet
    from executor.hostmem import AddressSpace, HostArena, ManifestBundle

    space = AddressSpace()
    ckpt = tiny_checkpoint()
    cfg, fetch = WeightSource(checkpoint=str(ckpt.path)).open(4, 1)
    state = CollectiveState(1, 4, {"peers": 1 << 40, "control": 1 << 40, "status": 1 << 40})
    holder = {}

    def build_each(stream, record, buckets):
        del stream, record
        for b in buckets:
            built.append((b, sum(len(s.build(b)) for s in holder["ex"].plan.stages)))
        return GraphSet({b: None for b in buckets})

    ex = Executor(cfg, ManifestBundle(bundle_dir), fetch, 4, 1, state, device=FakeDevice(),
                  geometry=_geometry(), buckets=buckets, capture_graphs=build_each,
                  arena_factory=lambda requests: HostArena(space, requests, name="rank1"))
    holder["ex"] = ex
    rules = bound_rules(cfg, 4, ex.geometry, bind_logits=True)
    host = allocate(rules, np.zeros)
    ex.bind(**{n: FakeCudaTensor(a.shape, str(a.dtype), bind_host(space, {n: a})[n])
               for n, a in host.items()})
    return ex


def test_the_driver_buckets_wire_every_stage_and_a_smaller_top_bucket_cannot(tiny_bundle_dir):
    built: list = []
    ex = _wired_executor(tiny_bundle_dir, check_buckets((8, MAX_ROWS)), built)
    ex.capture("stream")
    assert ex.captured and not ex.plan.missing_stages()
    assert [b for b, _ in built] == [8, MAX_ROWS] and all(n > 0 for _, n in built)
    small = _wired_executor(tiny_bundle_dir, (8,), [])
    with pytest.raises(ValueError, match=r"allreduce_oneshot.*'max_rows': \(192, 8\)"):
        small.capture("stream")                 # the bundle's one-shot kernels hold 192 rows
    assert not small.captured
