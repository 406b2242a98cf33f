"""CPU: sparse MQA launches (executor.launches.sparse_mqa) emulated on host memory, against the model
reference and with the comparison of the GPU test (tests/gpu/test_sparse_mqa.py).

Fresh cases every run from `executor.sparse_mqa_chain.make_case` (what the GPU test launches): SWA
rings and a paged compressed cache in which only the records some row must read are written, the
rest 0xFF (NaN records), block tables with -1 pages, top-k lists with -1 padding and -1 inside,
padding rows. The buffers are laid out by `requests` for a bucket of rows >= the case's (rows
past the case: a padded bucket), out poisoned 0xFF, and the launch built by `sparse_mqa_launch`
from the tiny bundle's records. Checks, every element: no NaN, padding rows exactly 0, |got - ref|
<= ref.error_bound and >= 98% bit-equal to `sparse_mqa_ref` (the GPU test's bound and share), and
every byte of the rows past the launch's still 0xFF. Kernels: the SWA-only kernel and every
non-ablation top-k candidate (ref.TOPK_VARIANTS; one reference for all).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import sparse_mqa_cases as cases

from executor.emulate import NoEmulator, run
from executor.hostmem import AddressSpace, HostArena, ManifestBundle
from executor.launch import LaunchSpec
from executor.launches.sparse_mqa import requests, sparse_mqa_launch, spec_of, uses
from executor.sparse_mqa_chain import make_case
from kernels import sparse_mqa_ref as ref
from loader.config import ModelConfig

# rows: (blocks, padding rows, bucket rows)
TOPK_CASES = {1: (["decode"], 0, 1), 6: (["verify"], 2, 16), 48: (["verify"] * 8, 0, 64),
              192: (["verify"] * 32, 0, 192)}
SWA_BLOCKS = (["decode"], ["draft"] * 3 + ["verify"], ["draft", "decode"] * 8)
TOPK_KERNELS = ("fixed_push", "fixed", "balanced")


@pytest.fixture(scope="module")
def bundle(tiny_bundle_dir):
    return ManifestBundle(tiny_bundle_dir)


def _spec(bundle, variant: str) -> ref.SparseMqaSpec:
    """The tiny bundle's kernel for `variant` ("swa" or a ref.candidate_specs key), from its
    manifest record (the step's path), checked against the spec the config gives."""
    cfg = ModelConfig.preset("tiny")
    want = (ref.sparse_mqa_specs(cfg, 4)[0] if variant == "swa"
            else ref.candidate_specs(cfg, 4)[variant])
    spec = spec_of(bundle.kernel(want.name).spec)
    assert spec == want
    return spec


def _launch_case(bundle, case, bucket: int):
    """(space, arena, launch) of `case` in an arena of `bucket` rows, out poisoned."""
    spec = case.spec
    space = AddressSpace()
    arena = HostArena(space, requests(
        spec, bucket, swa_records=case.swa.shape[0], max_seqs=case.state_lines.size,
        num_positions=case.table.num_positions, compressed_records=case.compressed.shape[0],
        pages_per_seq=case.block_tables.shape[1]))
    host = {"q": case.q, "swa": case.swa, "compressed": case.compressed, "topk": case.topk,
            "block_tables": case.block_tables, "row_info": case.info,
            "state_lines": case.state_lines, "sink": case.sink, "rope_table": case.table.cos_sin}
    for name in uses(spec):
        if name != "out":
            arena.upload(name, host[name])
    arena.fill("out", 0xFF)
    ptrs = {name: arena.ptr(name) for name in uses(spec)}
    launch = sparse_mqa_launch(bundle, spec, ptrs, case.rows,
                               pages_per_seq=case.block_tables.shape[1], page_size=case.page_size,
                               num_positions=case.table.num_positions)
    return space, arena, launch


def _emulate(bundle, case, bucket: int) -> np.ndarray:
    """The emulated out [bucket, H, 512] as bf16 bits; rows past the case must be poison."""
    space, arena, launch = _launch_case(bundle, case, bucket)
    assert launch.cluster == case.spec.cluster and launch.grid == case.spec.grid(case.rows)
    assert run([launch], space) == 1
    out = arena.download("out", np.uint16, (bucket, case.spec.heads, ref.HEAD_DIM))
    assert (out[case.rows:] == 0xFFFF).all(), "the launch wrote past its rows"
    return out[:case.rows]


@pytest.mark.parametrize("variant", TOPK_KERNELS)
@pytest.mark.parametrize("rows", sorted(TOPK_CASES))
@pytest.mark.parametrize("context", [100, 1024])
def test_emulated_topk_kernel_equals_the_reference(bundle, variant, rows, context):
    blocks, pad, bucket = TOPK_CASES[rows]
    case = make_case(_spec(bundle, variant), np.random.default_rng(), context, blocks,
                     pad_rows=pad)
    cases.check_output(case, _emulate(bundle, case, bucket))


@pytest.mark.parametrize("blocks", SWA_BLOCKS, ids=lambda b: "_".join(b))
@pytest.mark.parametrize("short", [True, False])
def test_emulated_swa_kernel_equals_the_reference(bundle, blocks, short):
    """SWA-only layers: causal rows and non-causal draft blocks; compressed / topk / block_tables
    are not handed to the builder (the kernel never reads them)."""
    spec = _spec(bundle, "swa")
    context = 7 if short else 4 * spec.window + 3
    case = make_case(spec, np.random.default_rng(), context, blocks, pad_rows=1)
    cases.check_output(case, _emulate(bundle, case, case.rows + 3))


def test_bad_page_poisons_only_its_row(bundle):
    case = make_case(_spec(bundle, "fixed"), np.random.default_rng(), 1000, ["verify", "decode"])
    tables = case.block_tables.copy()
    victim = case.topk[6][case.topk[6] >= 0][0]            # the decode row (sequence 1)
    tables[1, victim // case.page_size] = -1
    got = _emulate(bundle, dataclasses.replace(case, block_tables=tables), 8)
    got = got.view(case.q.dtype).astype(np.float32)
    assert np.isnan(got[6]).all()
    assert not np.isnan(got[:6]).any()


def test_builder_and_emulator_refuse_what_the_kernel_cannot_run(bundle):
    spec = _spec(bundle, "fixed")
    case = make_case(spec, np.random.default_rng(), 300, ["decode"])
    space, arena, launch = _launch_case(bundle, case, 4)
    ptrs = {name: arena.ptr(name) for name in uses(spec) if name != "topk"}
    with pytest.raises(KeyError, match="'topk'"):
        sparse_mqa_launch(bundle, spec, ptrs, 1, pages_per_seq=1, page_size=64, num_positions=9)
    with pytest.raises(ValueError, match="grid"):           # one cluster per row, not 2 rows
        run([LaunchSpec(launch.kernel, spec.grid(2), launch.args, cluster=spec.cluster)], space)
    ablation = next(n for n in bundle.names() if n.startswith("sparse_mqa_topk")
                    and "_skip_" in n)
    with pytest.raises(NoEmulator, match=ablation):
        run([LaunchSpec(bundle.kernel(ablation), launch.grid, launch.args,
                        cluster=launch.cluster)], space)
