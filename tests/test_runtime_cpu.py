"""Runtime pieces that need no GPU: buckets, arena layout, manifest validation, argument packing,
check() errors, NVTX fallback, probe references."""
from __future__ import annotations

import ctypes
import itertools
import json
import random
import sys

import numpy as np
import pytest

from executor.arena import plan_slices
from executor.bundle import BundleError, Kernel, KernelRecord, read_manifest
from executor.cuda import CudaError, check
from executor.graphs import BUCKETS, bucket_table
from executor.launch import LaunchSpec
from kernels import probes_ref

# ---- buckets ---------------------------------------------------------------------------------


def test_buckets_are_vllms():
    assert BUCKETS[:5] == (1, 2, 4, 8, 16)
    assert BUCKETS[-1] == 192 and len(BUCKETS) == 27
    assert all(b % 8 == 0 for b in BUCKETS[3:])


def test_bucket_table_is_smallest_bucket_holding_rows():
    table = bucket_table()
    for rows in range(1, 193):
        expected = min(b for b in BUCKETS if b >= rows)
        assert table[rows] == expected, rows
    assert len(table) == 193


def test_bucket_table_rejects_bad_buckets():
    with pytest.raises(ValueError, match="positive ints"):
        bucket_table((0, 4))

# ---- arena layout ----------------------------------------------------------------------------


def test_arena_slices_aligned_disjoint_and_sized():
    rng = random.Random()
    reqs = [(f"s{i}", rng.randint(1, 5000), "u8 [n]") for i in range(40)]
    for align in (256, 1024):
        slices, total = plan_slices(reqs, align)
        spans = sorted((s.offset, s.end) for s in slices.values())
        assert all(s.offset % align == 0 for s in slices.values())
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
        assert [slices[n].nbytes for n, _, _ in reqs] == [nb for _, nb, _ in reqs]
        assert total >= spans[-1][1] and total % align == 0


@pytest.mark.parametrize("reqs, align, match", [
    ([("x", 16), ("x", 32)], 256, "requested twice"),
    ([("x", 0)], 256, "positive int"),
    ([("x", -4)], 256, "positive int"),
    ([("x", 1.5)], 256, "positive int"),
    ([("", 8)], 256, "non-empty"),
    ([("x",)], 256, r"\(name, nbytes"),
    ([], 256, "at least one"),
    ([("x", 8)], 128, "power of two >= 256"),
    ([("x", 8)], 768, "power of two >= 256"),
])
def test_arena_rejects_bad_requests(reqs, align, match):
    with pytest.raises(ValueError, match=match):
        plan_slices(reqs, align)

# ---- manifest validation ---------------------------------------------------------------------


def _write_bundle(tmp_path, kernels: dict, **top):
    doc = {"format": 1, "arch": "sm_90a", "config": "tiny", "tp": 4, "dsl": "test",
           "kernels": kernels}
    doc.update(top)
    for rec in kernels.values():
        if isinstance(rec, dict) and isinstance(rec.get("cubin"), str):
            (tmp_path / rec["cubin"]).write_bytes(b"\x7fELF fake")
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    return tmp_path


def _rec(**over):
    rec = {"family": "norm", "cubin": "k.cubin", "entry": "kernel_k_0",
           "params": [["x", "u64"], ["rows", "u32"], ["eps", "f32"]], "block": [256, 1, 1],
           "smem_bytes": 0, "registers": 40, "pdl": True}
    rec.update(over)
    return rec


def test_manifest_reads_a_valid_bundle(tmp_path):
    m = read_manifest(_write_bundle(tmp_path, {"k": _rec()}))
    k = m.kernels["k"]
    assert k.params == (("x", "u64"), ("rows", "u32"), ("eps", "f32"))
    assert k.block == (256, 1, 1) and k.entry == "kernel_k_0" and k.pdl
    assert k.cubin == tmp_path / "k.cubin" and m.tp == 4


@pytest.mark.parametrize("top, rec, match", [
    ({"format": 2}, {}, "format 2"),
    ({"arch": "sm_100a"}, {}, "arch 'sm_100a'"),
    ({}, {"params": [["x", "u16"]]}, "bad param"),
    ({}, {"params": "x"}, "list of"),
    ({}, {"block": [0, 1, 1]}, "3 positive ints"),
    ({}, {"block": [1024, 2, 1]}, "exceeds 1024"),
    ({}, {"smem_bytes": -1}, "smem_bytes must be >= 0"),
    ({}, {"entry": 7}, "'entry' must be str"),
])
def test_manifest_rejects_bad_fields_naming_the_kernel(tmp_path, top, rec, match):
    _write_bundle(tmp_path, {"rmsnorm_bf16_d256": _rec(**rec)}, **top)
    with pytest.raises(BundleError, match=match) as info:
        read_manifest(tmp_path)
    assert "manifest.json" in str(info.value)


def test_manifest_missing_cubin_names_it(tmp_path):
    _write_bundle(tmp_path, {"k": _rec()})
    (tmp_path / "k.cubin").unlink()
    with pytest.raises(BundleError, match=r"kernel 'k'.*k\.cubin does not exist"):
        read_manifest(tmp_path)


def test_manifest_missing_or_corrupt(tmp_path):
    with pytest.raises(BundleError, match="no manifest.json"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(BundleError, match="not valid JSON"):
        read_manifest(tmp_path)
    _write_bundle(tmp_path, {})
    with pytest.raises(BundleError, match="non-empty"):
        read_manifest(tmp_path)

# ---- LaunchSpec packing and validation -------------------------------------------------------


def _fake_kernel(params=(("x", "u64"), ("rows", "u32"), ("off", "i32"), ("eps", "f32"))):
    rec = KernelRecord(name="fake", family="t", cubin=None, entry="e", params=tuple(params),
                       block=(128, 1, 1), smem_bytes=0, pdl=True)
    return Kernel(rec, function=None)


def test_launchspec_packs_each_value_at_its_abi_type():
    rng = np.random.default_rng()
    ptr = int(rng.integers(1, 2**63)) * 2
    rows, off = int(rng.integers(0, 2**32)), int(rng.integers(-2**31, 2**31))
    eps = float(rng.random())
    spec = LaunchSpec(_fake_kernel(), (7,), (ptr, rows, off, eps))
    assert spec.grid == (7, 1, 1)
    slots = (ctypes.c_void_p * 4).from_address(spec._params_addr)
    got = [ctypes.c_uint64.from_address(slots[0]).value,
           ctypes.c_uint32.from_address(slots[1]).value,
           ctypes.c_int32.from_address(slots[2]).value, ctypes.c_float.from_address(slots[3]).value]
    assert got[:3] == [ptr, rows, off]
    assert got[3] == np.float32(eps)


@pytest.mark.parametrize("args, exc, match", [
    ((1 << 20, 1, 1), TypeError, "takes 4 args"),
    ((1 << 20, 1, 1, 1.0, 5), TypeError, "takes 4 args"),
    ((0, 1, 1, 1.0), ValueError, "param 'x'.*non-null pointer"),
    ((1.5, 1, 1, 1.0), TypeError, r"param 'x'.*device pointer \(int\)"),
    ((1 << 20, -1, 1, 1.0), ValueError, r"param 'rows' \(u32\).*\[0, 4294967295\]"),
    ((1 << 20, 2**32, 1, 1.0), ValueError, "param 'rows'"),
    ((1 << 20, True, 1, 1.0), TypeError, "param 'rows'"),
    ((1 << 20, 1, 2**31, 1.0), ValueError, r"param 'off' \(i32\)"),
    ((1 << 20, 1, 1, "1e-6"), TypeError, "param 'eps'.*float"),
    ((1 << 20, 1, 1, 1e39), ValueError, "overflows float32"),
])
def test_launchspec_rejects_bad_args_by_name(args, exc, match):
    with pytest.raises(exc, match=match):
        LaunchSpec(_fake_kernel(), (1,), args)


@pytest.mark.parametrize("grid", [(0,), (1, 70000), (1, 1, 1, 1), "4", (2.0,)])
def test_launchspec_rejects_bad_grids(grid):
    with pytest.raises(ValueError, match="grid"):
        LaunchSpec(_fake_kernel(), grid, (1 << 20, 1, 1, 1.0))


def test_launchspec_cluster_must_tile_the_grid():
    args = (1 << 20, 1, 1, 1.0)
    assert LaunchSpec(_fake_kernel(), (8, 6), args, cluster=(4,)).cluster == (4, 1, 1)
    with pytest.raises(ValueError, match="not a multiple of the cluster"):
        LaunchSpec(_fake_kernel(), (6, 2), args, cluster=(4,))
    with pytest.raises(ValueError, match="out of range"):
        LaunchSpec(_fake_kernel(), (8,), args, cluster=(0,))


def test_launchspec_rejects_smem_beyond_opt_in():
    with pytest.raises(ValueError, match="dynamic shared memory"):
        LaunchSpec(_fake_kernel(), (1,), (1 << 20, 1, 1, 1.0), smem=100_000)

# ---- check() ---------------------------------------------------------------------------------


def test_check_unpacks_values():
    from cuda.bindings import driver as cu
    ok = cu.CUresult.CUDA_SUCCESS
    assert check((ok,)) is None
    assert check((ok, 5)) == 5
    assert check((ok, 5, "a")) == (5, "a")


def test_check_error_names_call_code_and_meaning():
    from cuda.bindings import driver as cu
    bad = cu.CUresult.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(CudaError) as info:
        check((bad, None))   # the source line has no cu* call: the error says where it was
    assert "CUDA_ERROR_INVALID_VALUE (1)" in str(info.value)
    assert "test_runtime_cpu.py" in info.value.call
    with pytest.raises(CudaError) as info:
        check((bad,), call="cuMemAlloc")
    assert str(info.value).startswith("cuMemAlloc failed: CUDA_ERROR_INVALID_VALUE")
    assert info.value.meaning   # the driver's text, or why it could not be asked


def test_check_reads_call_name_from_source_line():
    from cuda.bindings import driver as cu

    def cuFakeAlloc(nbytes):
        return (cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY,)

    with pytest.raises(CudaError, match="^cuFakeAlloc failed") as info:
        check(cuFakeAlloc(1 << 40))
    assert info.value.code_name == "CUDA_ERROR_OUT_OF_MEMORY"

# ---- NVTX fallback ---------------------------------------------------------------------------


def test_nvtx_ranges_are_noops_without_the_package(monkeypatch):
    import executor.nvtx_ranges as nr
    monkeypatch.setitem(sys.modules, "nvtx", None)   # import nvtx -> ImportError
    monkeypatch.setattr(nr, "_warned", False)
    with pytest.warns(RuntimeWarning, match="nvtx"):
        r = nr.Ranges()
    assert not r.enabled
    with r.range("layer0"):
        r.push("x")
        r.pop()

# ---- probe references ------------------------------------------------------------------------


def test_stream_read_ref_is_order_free_xor():
    rng = np.random.default_rng()
    src = rng.integers(0, 2**32, size=4096, dtype=np.uint32)
    expected = 0
    for w in src:
        expected ^= int(w)
    assert probes_ref.stream_read_ref(src) == expected
    assert probes_ref.xor_fold_u32(rng.permutation(src)) == expected
    parts = np.array([probes_ref.xor_fold_u32(c) for c in np.array_split(src, 37)], np.uint32)
    assert probes_ref.xor_fold_u32(parts) == expected


def test_stream_read_sizes():
    assert probes_ref.check_stream_read_size(64 << 20) == 4 << 20
    for bad in (0, 15, -16):
        with pytest.raises(ValueError, match="multiple of 16"):
            probes_ref.check_stream_read_size(bad)
    g = probes_ref.STREAM_READ.grid_x
    assert probes_ref.stream_read_bytes(1 << 20) == (1 << 20) + 4 * g * 8


def test_probe_specs_have_the_family_protocol():
    names = [s.name for s in probes_ref.ALL_PROBES]
    assert len(set(names)) == len(names)
    for s in probes_ref.ALL_PROBES:
        d = s.to_dict()
        assert d["name"] == s.name and len(s.grid(5)) == 3
        assert all(t in ("u64", "u32", "i32", "f32") for _, t in s.params)
        json.dumps(d)


def test_stream_read_partials_ref_folds_to_the_whole():
    rng = np.random.default_rng()
    src = rng.integers(0, 2**32, size=4 * 3001, dtype=np.uint32)   # a ragged number of vectors
    parts = probes_ref.stream_read_partials_ref(src, grid_x=2)
    assert parts.shape == (2 * 256 // 32,)
    assert probes_ref.xor_fold_u32(parts) == probes_ref.stream_read_ref(src)
    # warp 0's partial: threads 0..31, each visiting vectors t, t + 512, t + 1024, ...
    vecs = src.reshape(-1, 4)
    expected = 0
    for t in range(32):
        for v in vecs[t::512]:
            for w in v:
                expected ^= int(w)
    assert int(parts[0]) == expected

# ---- devicecheck report ----------------------------------------------------------------------


def test_devicecheck_parses_junit_and_formats_the_table(tmp_path):
    from executor.devicecheck import format_table, parse_junit
    (tmp_path / "j.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.gpu.t" name="ok" time="0.5"/>'
        '<testcase classname="tests.gpu.t" name="bad" time="0.1">'
        '<failure message="AssertionError: boom&#10;second line">tb</failure></testcase>'
        '<testcase classname="tests.gpu.t" name="skip" time="0">'
        '<skipped message="no bundle"/></testcase>'
        '<testcase classname="" name="tests.test_build" time="0">'
        '<skipped message="collection skipped">needs the DSL</skipped></testcase>'
        '</testsuite></testsuites>')
    tests = parse_junit(tmp_path / "j.xml")
    assert (tests["passed"], tests["failed"], tests["skipped"], tests["errors"]) == (1, 1, 1, 0)
    assert tests["modules_skipped"] == 1
    assert [c["outcome"] for c in tests["cases"]] == ["passed", "failed", "skipped",
                                                      "modules_skipped"]
    report = {"environment": {"device": "NVIDIA H200", "packages": {}}, "tests": tests,
              "bandwidth": [{"kernel": "k", "case": "64 MB", "rows": 1, "us": 10.0,
                             "bytes": 48_000_000, "gbps": 4800.0, "pct_hbm": 100.0,
                             "pct_stream": None}],
              "metrics": [{"metric": "m", "value": 0.7, "unit": "us", "target": "< 1 us",
                           "ok": True}],
              "benchmarks": {"x": {"ok": False, "error": "E: broke"}}, "ok": False}
    table = format_table(report)
    assert "FAILED   tests.gpu.t::bad: AssertionError: boom" in table
    assert "second line" not in table
    assert "4800" in table and "100.0" in table and "BENCHMARK FAILED x: E: broke" in table
    assert table.endswith("overall: FAIL")


def test_devicecheck_reruns_the_tests_after_a_sticky_fault(tmp_path, monkeypatch):
    """A fault in one test poisons its process: the test files after its module run again in a
    fresh process, the target's options kept; the report merges both passes."""
    import executor.devicecheck as dc
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tests/gpu").mkdir(parents=True)
    for name in ("test_a.py", "test_b.py", "test_c.py"):
        (tmp_path / "tests/gpu" / name).write_text("")
    fault = '<error message="CudaError: CUDA_ERROR_ILLEGAL_ADDRESS (700)">tb</error>'
    first = [("tests.gpu.test_a", "one[x-1]", ""), ("tests.gpu.test_a", "two", fault),
             ("tests.gpu.test_a", "three", fault), ("tests.gpu.test_b", "four", fault),
             ("tests.gpu.test_c.TestC", "five", fault)]
    calls = []

    def fake_pytest(targets, junit, env, timeout):
        calls.append(list(targets))
        rows = first if len(calls) == 1 else [(c, n, "") for c, n, _ in first[3:]]
        junit.write_text("<testsuites><testsuite>" + "".join(
            f'<testcase classname="{c}" name="{n}" time="0">{body}</testcase>'
            for c, n, body in rows) + "</testsuite></testsuites>")
        return "log\n", 1 if len(calls) == 1 else 0

    monkeypatch.setattr(dc, "_pytest", fake_pytest)
    result = dc.run_gpu_tests(tmp_path, {}, 100, ["tests", "--ignore=tests/gpu/x.py"])
    assert calls == [["tests", "--ignore=tests/gpu/x.py"],
                     ["--ignore=tests/gpu/x.py", "tests/gpu/test_b.py", "tests/gpu/test_c.py"]]
    assert [(c["name"], c["outcome"]) for c in result["cases"]] == [
        ("tests.gpu.test_a::one[x-1]", "passed"), ("tests.gpu.test_a::two", "errors"),
        ("tests.gpu.test_a::three", "errors"), ("tests.gpu.test_b::four", "passed"),
        ("tests.gpu.test_c.TestC::five", "passed")]
    assert (result["passed"], result["errors"], result["returncode"]) == (3, 2, 1)
    assert "==== pass 2" in (tmp_path / "pytest.log").read_text()


def test_nvtx_ranges_push_and_pop_with_the_package():
    pytest.importorskip("nvtx")
    from executor.nvtx_ranges import Ranges
    r = Ranges()
    assert r.enabled
    with r.range("layer0"), r.range("rmsnorm"):
        pass
    assert set(r._attrs) == {"layer0", "rmsnorm"}     # attributes built once per name


def test_external_stream_is_wrapped_not_owned():
    from executor.runtime import Stream
    s = Stream.external(0x7F00_1234)
    assert s.handle == 0x7F00_1234 and not s.owned
    s.close()                      # no driver call: the caller owns it
    assert s.cu_handle is None
    for bad in (0, -1, True, "0x10"):
        with pytest.raises(ValueError, match="external stream"):
            Stream.external(bad)
