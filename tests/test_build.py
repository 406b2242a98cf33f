"""The AOT kernel build (CPU only): manifest ABIs against kernels, cache, failure modes, cubin format.

The tiny bundle comes from HOPDEC_BUNDLE when it holds a manifest (what `make test` exports), else
it is built here into a temporary directory with a temporary cache.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("cutlass", reason="the kernel build needs nvidia-cutlass-dsl (the build extra)")

from kernels import build, cubin_info
from kernels.manifest import FAMILIES, load_manifest
from loader.config import ModelConfig

sys.path.insert(0, str(Path(__file__).parent))     # the deliberately bad family module
MY_FAMILIES = ("kernels.norm", "kernels.elementwise", "kernels.rope")


def _quiet(*_):
    pass


@pytest.fixture(scope="module")
def bundle(tiny_bundle_dir):
    return tiny_bundle_dir, load_manifest(tiny_bundle_dir)


def test_manifest_lists_every_spec_of_every_family(bundle):
    _, manifest = bundle
    cfg = ModelConfig.preset(manifest["config"])
    assert manifest["arch"] == "sm_90a" and manifest["dsl"].startswith("nvidia-cutlass-dsl")
    expected = {}
    for family in FAMILIES:
        for spec in importlib.import_module(family).specs(cfg, manifest["tp"]):
            expected[spec.name] = (family, spec)
    assert set(manifest["kernels"]) == set(expected)
    for name, entry in manifest["kernels"].items():
        family, spec = expected[name]
        assert entry["family"] == family
        assert [tuple(p) for p in entry["params"]] == list(spec.params), name
        assert tuple(entry["block"]) == tuple(spec.block) and entry["smem_bytes"] == spec.smem_bytes
        assert entry["spec"] == json.loads(json.dumps(spec.to_dict())), name
        assert entry["pdl"] is True and entry["spill_bytes"] == 0 and entry["local_bytes"] == 0


def test_manifest_abi_matches_cubin_and_kernel_signature(bundle):
    path, manifest = bundle
    cfg = ModelConfig.preset(manifest["config"])
    for family in MY_FAMILIES:
        module = importlib.import_module(family)
        for spec in module.specs(cfg, manifest["tp"]):
            entry = manifest["kernels"][spec.name]
            blob = (path / entry["cubin"]).read_bytes()
            assert hashlib.sha256(blob).hexdigest() == entry["cubin_sha256"]
            info = cubin_info.parse_cubin(blob, entry["entry"], spec.name)
            sizes = [8 if kind == "u64" else 4 for _, kind in entry["params"]]
            assert list(info.param_sizes) == sizes, spec.name
            assert info.reqntid == tuple(entry["block"]) and info.registers == entry["registers"]
            signature = build.signature_abi(module.kernel_function(spec))
            assert [n for n, _ in signature] == [n for n, _ in entry["params"]], spec.name
            assert all(kind in allowed for (_, allowed), (_, kind) in zip(signature,
                                                                          entry["params"]))
            # my kernels wait for their producers and trigger their dependents (PDL)
            assert entry["pdl_wait"] and entry["pdl_trigger"], spec.name


def test_cubins_are_sm90_nvidia_elf(bundle):
    path, manifest = bundle
    for name, entry in manifest["kernels"].items():
        blob = (path / entry["cubin"]).read_bytes()
        assert blob[:4] == b"\x7fELF", name
        info = cubin_info.parse_cubin(blob, entry["entry"], name)
        assert info.sm == 90 and info.registers > 0 and info.frame_bytes == 0, name


def test_second_build_recompiles_nothing_and_cache_serves_a_new_out_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HOPDEC_CACHE_DIR", str(tmp_path / "cache"))
    families = ("kernels.elementwise",)
    first = build.build_bundle("tiny", 4, tmp_path / "a", families=families, log=_quiet)
    assert set(first.values()) == {"compiled"}
    before = {p.name: p.read_bytes() for p in (tmp_path / "a").iterdir()}
    again = build.build_bundle("tiny", 4, tmp_path / "a", families=families, log=_quiet)
    assert set(again.values()) == {"cached"} and again.keys() == first.keys()
    assert {p.name: p.read_bytes() for p in (tmp_path / "a").iterdir()} == before
    other = build.build_bundle("tiny", 4, tmp_path / "b", families=families, log=_quiet)
    assert set(other.values()) == {"cached"}                  # from the cache dir, not compiled
    # a different config (other widths) is a different key: compiled, not served stale
    v41 = build.build_bundle("v41-flash", 4, tmp_path / "c", families=families, log=_quiet)
    assert set(v41.values()) == {"compiled"}


def test_wrong_abi_and_spill_fail_the_build_and_leave_the_bundle(tmp_path, monkeypatch):
    monkeypatch.setenv("HOPDEC_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "bundle"
    build.build_bundle("tiny", 4, out, families=("kernels.elementwise",), log=_quiet)
    manifest_before = (out / "manifest.json").read_bytes()
    with pytest.raises(build.BuildError) as err:
        build.build_bundle("tiny", 4, out, families=("kernels.elementwise", "bad_kernel_family"),
                           log=_quiet)
    message = str(err.value)
    assert "bad_abi_axpy: PTX parameters (u64, u64, u32, f32) do not match spec.params" in message
    assert "bad_spill_sum:" in message and "spill" in message
    assert (out / "manifest.json").read_bytes() == manifest_before
    assert not (out / "bad_abi_axpy.cubin").exists()


def test_cli_writes_the_default_layout(tmp_path, monkeypatch):
    monkeypatch.setenv("HOPDEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert build.main(["--config", "tiny", "--tp", "4"]) == 0
    manifest = load_manifest(tmp_path / "build" / "bundle-tiny-tp4")
    assert manifest["config"] == "tiny" and manifest["tp"] == 4


def test_ptx_parser_rejects_tensor_struct_params():
    ptx = (".version 8.8\n.target sm_90a\n.visible .entry k(\n .param .align 8 .b8 k_param_0[16],\n"
           " .param .u32 k_param_1\n)\n.reqntid 128, 1, 1\n{ ret; }\n")
    with pytest.raises(cubin_info.KernelBinaryError, match="pointer-ABI"):
        cubin_info.parse_ptx(ptx, "k")
    good = ptx.replace(".align 8 .b8 k_param_0[16]", ".u64 .ptr .global .align 16 k_param_0")
    info = cubin_info.parse_ptx(good, "k")
    assert info.params == ("u64", "u32") and info.reqntid == (128, 1, 1) and not info.pdl_wait


def test_corrupt_cubin_is_named():
    with pytest.raises(cubin_info.KernelBinaryError, match="my_kernel: cubin is not"):
        cubin_info.parse_cubin(b"not an elf" * 10, "entry", "my_kernel")
