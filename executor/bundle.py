"""Kernel bundles: read and validate manifest.json (CPU), load every cubin into the device (GPU).

A bundle is what `python -m kernels.build` writes: one `<name>.cubin` per kernel plus a
manifest.json (format 1, arch sm_90a) recording each kernel's entry symbol, parameter ABI, block
size and dynamic shared memory. The runtime trusts nothing in it: every field is checked, every
cubin must exist, and a failure names the file and the kernel and unloads what was loaded.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from executor.cuda import check, driver

MANIFEST_FORMAT = 1
MANIFEST_ARCH = "sm_90a"
PARAM_TYPES = ("u64", "u32", "i32", "f32")
MAX_THREADS_PER_BLOCK = 1024
STATIC_SMEM_LIMIT = 48 * 1024   # above this a kernel must opt in to dynamic shared memory


class BundleError(ValueError):
    """A bundle or its manifest is unusable; the message names the file and the kernel."""


@dataclass(frozen=True)
class KernelRecord:
    """One kernel of a manifest, validated."""

    name: str
    family: str
    cubin: Path
    entry: str
    params: tuple[tuple[str, str], ...]
    block: tuple[int, int, int]
    smem_bytes: int
    pdl: bool
    registers: int | None = None
    spec: dict | None = None


@dataclass(frozen=True)
class Manifest:
    path: Path
    config: str
    tp: int
    kernels: dict[str, KernelRecord]


def _field(rec: dict, key: str, kind, where: str):
    if key not in rec:
        raise BundleError(f"{where}: missing key {key!r}")
    value = rec[key]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise BundleError(f"{where}: {key!r} must be an integer, got {value!r}")
    if kind is not int and not isinstance(value, kind):
        raise BundleError(f"{where}: {key!r} must be {kind.__name__}, got {value!r}")
    return value


def _params(value, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list):
        raise BundleError(f"{where}: 'params' must be a list of [name, type], got {value!r}")
    out = []
    for p in value:
        if (not isinstance(p, (list, tuple)) or len(p) != 2 or not isinstance(p[0], str)
                or p[1] not in PARAM_TYPES):
            raise BundleError(f"{where}: bad param {p!r}: expected [name, one of {PARAM_TYPES}]")
        out.append((p[0], p[1]))
    return tuple(out)


def _block(value, where: str) -> tuple[int, int, int]:
    ok = (isinstance(value, list) and len(value) == 3
          and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value))
    if not ok:
        raise BundleError(f"{where}: 'block' must be 3 positive ints, got {value!r}")
    if value[0] * value[1] * value[2] > MAX_THREADS_PER_BLOCK:
        raise BundleError(f"{where}: block {value} exceeds {MAX_THREADS_PER_BLOCK} threads")
    return (value[0], value[1], value[2])


def _record(bundle_dir: Path, name: str, rec, where: str) -> KernelRecord:
    if not isinstance(rec, dict):
        raise BundleError(f"{where}: expected an object, got {type(rec).__name__}")
    cubin = bundle_dir / _field(rec, "cubin", str, where)
    if not cubin.is_file():
        raise BundleError(f"{where}: cubin file {cubin} does not exist")
    smem = _field(rec, "smem_bytes", int, where)
    if smem < 0:
        raise BundleError(f"{where}: smem_bytes must be >= 0, got {smem}")
    regs = rec.get("registers")
    return KernelRecord(
        name=name, family=str(rec.get("family", "")), cubin=cubin,
        entry=_field(rec, "entry", str, where), params=_params(rec.get("params"), where),
        block=_block(rec.get("block"), where), smem_bytes=smem, pdl=bool(rec.get("pdl", False)),
        registers=regs if isinstance(regs, int) else None, spec=rec.get("spec"))


def read_manifest(bundle_dir) -> Manifest:
    """Parse and validate `bundle_dir/manifest.json` (no GPU needed)."""
    bundle_dir = Path(bundle_dir)
    path = bundle_dir / "manifest.json"
    if not path.is_file():
        raise BundleError(f"{path}: no manifest.json (build it with python -m kernels.build)")
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BundleError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise BundleError(f"{path}: top level must be an object")
    if doc.get("format") != MANIFEST_FORMAT:
        raise BundleError(f"{path}: format {doc.get('format')!r}, "
                          f"this runtime reads {MANIFEST_FORMAT}")
    if doc.get("arch") != MANIFEST_ARCH:
        raise BundleError(f"{path}: arch {doc.get('arch')!r}, this runtime needs {MANIFEST_ARCH}")
    kernels = doc.get("kernels")
    if not isinstance(kernels, dict) or not kernels:
        raise BundleError(f"{path}: 'kernels' must be a non-empty object")
    records = {name: _record(bundle_dir, name, rec, f"{path} kernel {name!r}")
               for name, rec in kernels.items()}
    return Manifest(path=path, config=str(doc.get("config", "")), tp=int(doc.get("tp", 0) or 0),
                    kernels=records)


@dataclass(frozen=True)
class Kernel:
    """A loaded kernel: its manifest record plus the CUfunction handle."""

    record: KernelRecord
    function: object            # CUfunction

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def params(self) -> tuple[tuple[str, str], ...]:
        return self.record.params

    @property
    def block(self) -> tuple[int, int, int]:
        return self.record.block

    @property
    def smem_bytes(self) -> int:
        return self.record.smem_bytes


class Bundle:
    """Every cubin of a bundle loaded as a CUmodule; `kernel(name)` hands out launchable kernels."""

    def __init__(self, manifest: Manifest, modules: list, kernels: dict[str, Kernel]):
        self.manifest = manifest
        self._modules = modules
        self._kernels = kernels

    @classmethod
    def load(cls, device, path) -> Bundle:
        manifest = read_manifest(path)
        modules, kernels = [], {}
        try:
            for rec in manifest.kernels.values():
                module, kernel = _load_kernel(device, rec)
                modules.append(module)
                kernels[rec.name] = kernel
        except BaseException:
            for m in modules:
                driver().cuModuleUnload(m)  # best effort: the original error is the one to report
            raise
        return cls(manifest, modules, kernels)

    def kernel(self, name: str) -> Kernel:
        if not self._modules:
            raise RuntimeError(f"bundle {self.manifest.path.parent} is closed (asked for {name!r})")
        try:
            return self._kernels[name]
        except KeyError:
            raise KeyError(f"bundle {self.manifest.path.parent} has no kernel {name!r}; "
                           f"it has {sorted(self._kernels)}") from None

    def names(self) -> list[str]:
        return sorted(self._kernels)

    def close(self) -> None:
        cu = driver()
        while self._modules:
            check(cu.cuModuleUnload(self._modules.pop()))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _load_kernel(device, rec: KernelRecord):
    cu = driver()
    where = f"kernel {rec.name!r} ({rec.cubin})"
    module = check(cu.cuModuleLoadData(rec.cubin.read_bytes()), call=f"cuModuleLoadData[{where}]")
    try:
        fn = check(cu.cuModuleGetFunction(module, rec.entry.encode()),
                   call=f"cuModuleGetFunction[{where}, entry {rec.entry!r}]")
        attr = cu.CUfunction_attribute
        max_threads = check(cu.cuFuncGetAttribute(
            attr.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, fn))
        threads = rec.block[0] * rec.block[1] * rec.block[2]
        if threads > max_threads:
            raise BundleError(f"{where}: block {rec.block} ({threads} threads) exceeds the "
                              f"function's limit of {max_threads} (registers?)")
        if rec.smem_bytes > STATIC_SMEM_LIMIT:
            if rec.smem_bytes > device.max_smem_optin:
                raise BundleError(f"{where}: {rec.smem_bytes} B of shared memory exceeds the "
                                  f"device's opt-in limit {device.max_smem_optin}")
            check(cu.cuFuncSetAttribute(
                fn, attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, rec.smem_bytes))
    except BaseException:
        cu.cuModuleUnload(module)
        raise
    return module, Kernel(rec, fn)
