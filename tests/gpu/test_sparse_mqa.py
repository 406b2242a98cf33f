"""GPU tests of the sparse MQA kernel against kernels/sparse_mqa_ref.py, on real cache bytes.

Bundles: HOPDEC_BUNDLE (tiny) and HOPDEC_BUNDLE_V41 (v41-flash); a missing bundle skips its cases.
Every case draws fresh inputs (executor.sparse_mqa_chain.make_case): SWA rings and a paged
compressed cache in which only the records some row must read are written, everything else 0xFF
(NaN records, NaN/inf scales), block tables with -1 pages, top-k lists with -1 padding and -1
inside, padding rows; the output is poisoned with NaN before the launch. Checks, every element:
- no NaN anywhere: a read of any unwritten record, or an unwritten output, would leave one;
- padding rows are exactly 0;
- |got - ref| <= ref.error_bound (each probability may round to the adjacent BF16 value, each
  side rounds o once and again after the inverse RoPE; the docstring of error_bound derives it),
  and >= 98% of the elements equal the reference bit for bit (the fp32 split emulation in
  tests/test_sparse_mqa_cpu.py gives >= 99.9%; a dropped or wrong entry breaks both);
- a second launch is bit-identical (deterministic cluster reduction);
- the push exchange (the step's kernel) equals the pull exchange of the same split bit for bit.
Bad input shows as NaN in its own row only: a top-k entry on an unallocated page; a launch
without the cluster attribute writes NaN everywhere rather than wrong numbers.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import sparse_mqa_cases as cases

from executor.runtime import LaunchSpec
from executor.sparse_mqa_chain import SparseMqaBuffers, make_case
from kernels import sparse_mqa_ref as ref

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

RNG = np.random.default_rng()
# R = 1, 5 (draft), 6 (verify), 12 (two verifies), 48 (eight verifies), with and without padding.
BLOCKS = {1: ["decode"], 6: ["verify"], 12: ["verify", "verify"], 48: ["verify"] * 8}
CONTEXTS = {"tiny": (9, 100, 1024, 32768), "v41-flash": (100, 1024, 32768, 131072)}


@pytest.fixture(scope="module")
def setup(preset, preset_bundle):
    """(preset name, config, bundle) for each preset whose bundle is built."""
    return (preset, *preset_bundle)


def _run(dev, stream, bundle, case, twice: bool = False):
    bufs = SparseMqaBuffers(dev, bundle, case)
    try:
        bufs.launch.launch(stream)
        stream.synchronize()
        first = bufs.output()
        if twice:
            bufs.launch.launch(stream)
            stream.synchronize()
            assert np.array_equal(first.view(np.uint16), bufs.output().view(np.uint16)), \
                "a second launch differs"
        return first
    finally:
        bufs.close()


def _specs(cfg):
    return ref.sparse_mqa_specs(cfg, 4)


def _topk_spec(cfg, variant: str) -> ref.SparseMqaSpec:
    """A top-k kernel by variant key (ref.TOPK_VARIANTS; the step runs STEP_TOPK_VARIANT)."""
    return ref.candidate_specs(cfg, 4)[variant]


VARIANTS = tuple(ref.TOPK_VARIANTS)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows", sorted(BLOCKS))
@pytest.mark.parametrize("context_index", range(4))
def test_topk_kernel(dev, stream, setup, rows, context_index, variant):
    name, cfg, bundle = setup
    contexts = CONTEXTS[name]
    spec = _topk_spec(cfg, variant)
    context = contexts[context_index]
    pad = 2 if rows in (6, 12) else 0
    case = make_case(spec, RNG, context, BLOCKS[rows], pad_rows=pad)
    cases.check_output(case, _run(dev, stream, bundle, case, twice=rows == 12))


@pytest.mark.parametrize("blocks", [["decode"], ["draft"], ["verify"], ["draft"] * 3 + ["verify"],
                                    ["draft", "decode"] * 8])
@pytest.mark.parametrize("short", [True, False])
def test_swa_kernel(dev, stream, setup, blocks, short):
    """SWA-only layers (0, 1, DSpark stages): causal rows and non-causal draft blocks."""
    _, cfg, bundle = setup
    spec = _specs(cfg)[0]
    context = 7 if short else 4 * cfg.sliding_window + 3
    case = make_case(spec, RNG, context, blocks, pad_rows=1)
    cases.check_output(case, _run(dev, stream, bundle, case))


@pytest.mark.parametrize("variant", VARIANTS)
def test_bad_page_poisons_only_its_row(dev, stream, setup, variant):
    _, cfg, bundle = setup
    spec = _topk_spec(cfg, variant)
    case = make_case(spec, RNG, 1000, ["verify", "decode"])
    tables = case.block_tables.copy()
    victim = case.topk[6][case.topk[6] >= 0][0]    # the decode row (sequence 1)
    tables[1, victim // case.page_size] = -1
    bad = dataclasses.replace(case, block_tables=tables)
    got = _run(dev, stream, bundle, bad).astype(np.float32)
    assert np.isnan(got[6]).all()
    assert not np.isnan(got[:6]).any()


@pytest.mark.parametrize("variant", VARIANTS)
def test_launch_without_cluster_writes_nan(dev, stream, setup, variant):
    _, cfg, bundle = setup
    spec = _topk_spec(cfg, variant)
    case = make_case(spec, RNG, 300, ["decode"])
    bufs = SparseMqaBuffers(dev, bundle, case)
    try:
        plain = LaunchSpec(bundle.kernel(spec.name), spec.grid(case.rows), bufs.launch.args)
        plain.launch(stream)
        stream.synchronize()
        assert np.isnan(bufs.output().astype(np.float32)).all()
    finally:
        bufs.close()


@pytest.mark.parametrize("context_index", range(4))
def test_push_exchange_equals_pull(dev, stream, setup, context_index):
    """fixed_push differs from fixed only in how the cluster exchanges (stores before the barrier
    instead of DSMEM loads after it), in PV's dim-to-column map and in the record copy order: every
    sum has the same terms in the same order, so the outputs are bit-identical (a dim pushed to
    the wrong CTA or column, a stats slot read from the wrong sender, shows here exactly)."""
    name, cfg, bundle = setup
    specs = ref.candidate_specs(cfg, 4)
    for blocks in (BLOCKS[1], BLOCKS[48]):
        case = make_case(specs["fixed"], RNG, CONTEXTS[name][context_index], blocks, pad_rows=1)
        pull = _run(dev, stream, bundle, case)
        push = _run(dev, stream, bundle, dataclasses.replace(case, spec=specs["fixed_push"]))
        assert not np.isnan(pull.astype(np.float32)).any()
        diff = np.argwhere(pull.view(np.uint16) != push.view(np.uint16))
        assert diff.size == 0, (f"{len(diff)} elements differ; first (row, head, dim) "
                                f"{diff[0].tolist()}")


@pytest.mark.parametrize("context_index", range(4))
def test_early_equals_fixed_push_runs(dev, stream, setup, context_index):
    """fixed_push_runs_early only moves the address chain and the record copies before the PDL
    wait (q after it); everything after the records land is the same code, so the outputs are
    bit-identical to fixed_push_runs (a record copied before its address was resolved, or q
    read before it landed, shows here)."""
    name, cfg, bundle = setup
    specs = ref.candidate_specs(cfg, 4)
    for blocks in (BLOCKS[1], BLOCKS[48]):
        case = make_case(specs["fixed_push_runs"], RNG, CONTEXTS[name][context_index], blocks,
                         pad_rows=1)
        want = _run(dev, stream, bundle, case)
        got = _run(dev, stream, bundle, dataclasses.replace(
            case, spec=specs["fixed_push_runs_early"]))
        assert not np.isnan(want.astype(np.float32)).any()
        diff = np.argwhere(want.view(np.uint16) != got.view(np.uint16))
        assert diff.size == 0, (f"{len(diff)} elements differ; first (row, head, dim) "
                                f"{diff[0].tolist()}")
