"""Ahead-of-time kernel build: compile every family's specs for sm_90a into a bundle of cubins.

    python -m kernels.build --config {tiny,v41-flash,PATH.json} --tp N [--out DIR] [--jobs J]
    python -m kernels.build --config v41-flash --tp 2 --only allreduce --only elementwise \
        --out build/bundle-v41-flash-tp2-collectives    # some families only

For each family in `kernels.manifest.FAMILIES` the build asks `specs(cfg, tp)`, compiles each spec
with `compile_spec(spec, options)` (no GPU needed: `CUTE_DSL_ARCH=sm_90a`, `--gpu-arch sm_90a`,
`--keep-ptx --keep-cubin`), then checks, naming the kernel on failure:
- the PTX `.entry` parameters against `spec.params` (and against the `@cute.kernel` signature when
  the family exposes `kernel_function(spec)`): pointer ABI only, same count, same types;
- `.reqntid` against `spec.block`, dynamic shared memory against `spec.smem_bytes`;
- the cubin: an sm_90 NVIDIA ELF, its registers, and no local memory or spill at all.
Nothing is written unless every kernel passes; the manifest is replaced atomically.

Cache: a kernel's key is sha256(family sources + build sources + spec + DSL version + arch). A
kernel whose key matches the out dir's manifest (and whose cubin is intact) or a cache entry in
`$HOPDEC_CACHE_DIR` (default `~/.cache/hopdec/kernels`) is not recompiled.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import importlib
import importlib.metadata
import inspect
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kernels import cubin_info
from kernels.manifest import ARCH, FAMILIES, MANIFEST_FORMAT, MANIFEST_NAME, default_out_dir

COMPILE_OPTIONS = f"--gpu-arch {ARCH} --keep-ptx --keep-cubin"
BUILD_SOURCES = (Path(__file__), Path(cubin_info.__file__))
PY_ANNOTATION_ABI = {"cute.Pointer": ("u64",), "Pointer": ("u64",), "Int32": ("u32", "i32"),
                     "cutlass.Int32": ("u32", "i32"), "Float32": ("f32",),
                     "cutlass.Float32": ("f32",)}


class BuildError(RuntimeError):
    """One or more kernels failed to compile or to pass the checks; the message lists them all."""


@dataclass(frozen=True)
class Job:
    family: str
    spec: object
    key: str


def dsl_version() -> str:
    """'nvidia-cutlass-dsl 4.8.1 (cu12)': the version and the installed CUDA flavour(s)."""
    version = importlib.metadata.version("nvidia-cutlass-dsl")
    flavours = []
    for flavour in ("cu12", "cu13"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version(f"nvidia-cutlass-dsl-libs-{flavour}")
            flavours.append(flavour)
    return f"nvidia-cutlass-dsl {version} ({'+'.join(flavours) or 'unknown flavour'})"


def cache_dir() -> Path:
    return Path(os.environ.get("HOPDEC_CACHE_DIR") or Path.home() / ".cache/hopdec/kernels")


def load_config(config: str):
    from loader.config import ModelConfig
    if config.endswith(".json"):
        return ModelConfig.from_json(config)
    return ModelConfig.preset(config)


def family_sources(module) -> list[Path]:
    """Every `kernels/` source the family's cubins depend on: the family module, its `_ref` sibling,
    the shared ref helpers and, transitively, every `kernels.*` module they import (a family may
    reuse another family's kernel code, e.g. `wo_a` builds on `dense`)."""
    root = Path(__file__).parent
    path = Path(inspect.getsourcefile(module))
    todo = [path, path.with_name(path.stem + "_ref.py"), root / "common_ref.py"]
    seen: list[Path] = []
    while todo:
        p = todo.pop()
        if p in seen or not p.is_file():
            continue
        seen.append(p)
        todo.extend(root / f"{name}.py" for name in _imported_kernel_modules(p))
    return sorted(seen)


def _imported_kernel_modules(path: Path) -> set[str]:
    """Names of the `kernels.<name>` modules a source file imports (static, from its AST)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[1] for a in node.names if a.name.startswith("kernels.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "kernels":
                names |= {a.name for a in node.names}
            elif node.module.startswith("kernels."):
                names.add(node.module.split(".")[1])
    return names


def kernel_key(module, spec, dsl: str) -> str:
    h = hashlib.sha256()
    for path in family_sources(module) + list(BUILD_SOURCES):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    h.update(json.dumps(spec.to_dict(), sort_keys=True).encode())
    h.update(f"{dsl}|{ARCH}|{COMPILE_OPTIONS}".encode())
    return h.hexdigest()


def collect_jobs(cfg, tp: int, families: tuple[str, ...], dsl: str) -> list[Job]:
    jobs, seen = [], {}
    for family in families:
        module = importlib.import_module(family)
        for spec in module.specs(cfg, tp):
            if spec.name in seen:
                raise BuildError(f"kernel name {spec.name!r} is produced by both {seen[spec.name]} "
                                 f"and {family}")
            seen[spec.name] = family
            jobs.append(Job(family, spec, kernel_key(module, spec, dsl)))
    return jobs


@contextlib.contextmanager
def _captured_stderr():
    """Capture fd 2 (the DSL prints ptxas' log there, from C++ and Python alike)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        box = {"text": ""}
        try:
            yield box
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            box["text"] = tmp.read().decode(errors="replace")


def compile_job(family: str, spec) -> dict:
    """Compile one spec (in this process or a worker): PTX, cubin, ptxas log, seconds."""
    os.environ["CUTE_DSL_ARCH"] = ARCH
    os.environ.setdefault("CUTE_DSL_COMPILER_OPT", "remarks{ptx}")   # ptxas -v log -> stderr
    module = importlib.import_module(family)
    start = time.perf_counter()
    with _captured_stderr() as log, tempfile.TemporaryDirectory(prefix="hopdec-dsl-") as dump:
        try:   # --keep-ptx also writes files: into a scratch dir, not the caller's cwd
            compiled = module.compile_spec(spec, options=f"{COMPILE_OPTIONS} --dump-dir={dump}")
            error = None
        except Exception as exc:  # noqa: BLE001 - reported with the kernel's name below
            compiled, error = None, f"{type(exc).__name__}: {exc}"
    if error is not None:
        raise BuildError(f"{spec.name} ({family}): compile failed: {error}\n{log['text'][-4000:]}")
    if not compiled.__ptx__ or not compiled.__cubin__:
        raise BuildError(f"{spec.name}: the DSL returned no PTX/cubin (keep options ignored?)")
    return {"ptx": compiled.__ptx__, "cubin": bytes(compiled.__cubin__), "log": log["text"],
            "seconds": time.perf_counter() - start}


def signature_abi(function) -> list[tuple[str, tuple[str, ...]]]:
    """(name, allowed ABI types) per parameter of a @cute.kernel function, `self` excluded."""
    out = []
    for name, p in inspect.signature(function).parameters.items():
        if name == "self":
            continue
        ann = p.annotation if isinstance(p.annotation, str) else getattr(
            p.annotation, "__name__", str(p.annotation))
        out.append((name, PY_ANNOTATION_ABI.get(ann, ())))
    return out


def check_kernel(family_module, spec, ptx, cubin, ptxas) -> list[str]:
    """Every way the compiled kernel can disagree with its spec, as messages naming the kernel."""
    name, errors = spec.name, []
    want = [cubin_info.ABI_TO_PTX[kind] for _, kind in spec.params]
    spec_abi = ", ".join(f"{n}:{k}" for n, k in spec.params)
    if ptx.target != ARCH:
        errors.append(f"{name}: PTX targets {ptx.target!r}, expected {ARCH!r}")
    if list(ptx.params) != want:
        errors.append(f"{name}: PTX parameters ({', '.join(ptx.params)}) do not match spec.params "
                      f"({spec_abi})")
    sizes = [8 if k == "u64" else 4 for k in want]
    if list(cubin.param_sizes) != sizes:
        errors.append(f"{name}: cubin parameter sizes {list(cubin.param_sizes)}, spec needs {sizes}")
    if hasattr(family_module, "kernel_function"):
        sig = signature_abi(family_module.kernel_function(spec))
        if [n for n, _ in sig] != [n for n, _ in spec.params] or any(
                k not in allowed for (_, allowed), (_, k) in zip(sig, spec.params)):
            errors.append(f"{name}: @cute.kernel signature {sig} does not match spec.params "
                          f"({spec_abi})")
    block = tuple(spec.block)
    for where, ntid in (("PTX .reqntid", ptx.reqntid), ("cubin REQNTID", cubin.reqntid)):
        if ntid is not None and tuple(ntid) != block:
            errors.append(f"{name}: {where} {ntid} but spec.block {block}")
    if ptx.dynamic_smem != (spec.smem_bytes > 0):
        errors.append(f"{name}: PTX {'declares' if ptx.dynamic_smem else 'has no'} dynamic shared "
                      f"memory but spec.smem_bytes = {spec.smem_bytes}")
    if cubin.sm != 90:
        errors.append(f"{name}: cubin is for sm_{cubin.sm}, expected sm_90")
    spill = (ptxas["spill_stores"] + ptxas["spill_loads"]) if ptxas else cubin.frame_bytes
    if spill or cubin.frame_bytes or cubin.stack_bytes:
        errors.append(f"{name}: {spill} bytes spilled, {cubin.frame_bytes} bytes stack frame "
                      f"({cubin.registers} registers): the build forbids spills and local memory")
    return errors


def manifest_entry(job: Job, ptx, cubin, ptxas, blob: bytes) -> dict:
    spec = job.spec
    spill = (ptxas["spill_stores"] + ptxas["spill_loads"]) if ptxas else cubin.frame_bytes
    return {
        "family": job.family, "cubin": f"{spec.name}.cubin", "entry": ptx.entry,
        "params": [[n, k] for n, k in spec.params], "block": list(spec.block),
        "smem_bytes": spec.smem_bytes, "registers": cubin.registers,
        "local_bytes": cubin.frame_bytes, "spill_bytes": spill, "pdl": True,
        "pdl_wait": ptx.pdl_wait, "pdl_trigger": ptx.pdl_trigger,
        "source_hash": job.key, "cubin_sha256": hashlib.sha256(blob).hexdigest(),
        "spec": spec.to_dict(),
    }


def _cached(job: Job, out: Path, old: dict) -> tuple[dict, bytes] | None:
    """A previous build of exactly this kernel: from the out dir's manifest, else the cache dir."""
    meta = cache_dir() / f"{job.key}.json"
    candidates = [(old.get(job.spec.name), out / f"{job.spec.name}.cubin")]
    if meta.is_file():
        with contextlib.suppress(OSError, ValueError):
            candidates.append((json.loads(meta.read_text()), meta.with_suffix(".cubin")))
    for entry, path in candidates:
        if not entry or entry.get("source_hash") != job.key or not path.is_file():
            continue
        blob = path.read_bytes()
        if hashlib.sha256(blob).hexdigest() == entry.get("cubin_sha256"):
            return entry, blob
    return None


def _store_in_cache(job: Job, entry: dict, blob: bytes) -> None:
    try:
        directory = cache_dir()
        directory.mkdir(parents=True, exist_ok=True)
        _write_atomic(directory / f"{job.key}.cubin", blob)
        _write_atomic(directory / f"{job.key}.json", json.dumps(entry).encode())
    except OSError as exc:
        print(f"warning: kernel cache {cache_dir()} not writable ({exc})", file=sys.stderr)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _read_old_manifest(out: Path) -> dict:
    with contextlib.suppress(OSError, ValueError):
        return json.loads((out / MANIFEST_NAME).read_text()).get("kernels", {})
    return {}


def _compile_all(misses: list[Job], jobs: int) -> dict[str, dict | BuildError]:
    results: dict[str, dict | BuildError] = {}
    if jobs > 1 and len(misses) > 1:
        import multiprocessing
        ctx = multiprocessing.get_context("spawn")   # the DSL's MLIR state does not survive fork
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futures = {j.spec.name: pool.submit(compile_job, j.family, j.spec) for j in misses}
            for name, fut in futures.items():
                try:
                    results[name] = fut.result()
                except BuildError as exc:
                    results[name] = exc
        return results
    for j in misses:
        try:
            results[j.spec.name] = compile_job(j.family, j.spec)
        except BuildError as exc:
            results[j.spec.name] = exc
    return results


def build_bundle(config: str, tp: int, out: Path, jobs: int = 1,
                 families: tuple[str, ...] = FAMILIES, log=print) -> dict:
    """Build (or reuse) every kernel, check it, write the bundle; returns {name: 'compiled'|'cached'}."""
    os.environ["CUTE_DSL_ARCH"] = ARCH
    cfg, dsl = load_config(config), dsl_version()
    all_jobs = collect_jobs(cfg, tp, families, dsl)
    old = _read_old_manifest(out)
    entries, blobs, status, errors = {}, {}, {}, []
    misses = []
    for job in all_jobs:
        hit = _cached(job, out, old)
        if hit:
            entries[job.spec.name], blobs[job.spec.name] = hit
            status[job.spec.name] = "cached"
            log(f"{job.spec.name:44s} cached            regs {hit[0]['registers']:3d}")
        else:
            misses.append(job)
    results = _compile_all(misses, jobs)
    for job in misses:
        result = results[job.spec.name]
        if isinstance(result, BuildError):
            errors.append(str(result))
            continue
        module = importlib.import_module(job.family)
        ptx = cubin_info.parse_ptx(result["ptx"], job.spec.name)
        cub = cubin_info.parse_cubin(result["cubin"], ptx.entry, job.spec.name)
        ptxas = cubin_info.parse_ptxas_log(result["log"], ptx.entry)
        problems = check_kernel(module, job.spec, ptx, cub, ptxas)
        if problems:
            errors.extend(problems)
            continue
        entry = manifest_entry(job, ptx, cub, ptxas, result["cubin"])
        entries[job.spec.name], blobs[job.spec.name] = entry, result["cubin"]
        status[job.spec.name] = "compiled"
        _store_in_cache(job, entry, result["cubin"])
        log(f"{job.spec.name:44s} compiled {result['seconds']:5.2f} s  regs {cub.registers:3d}")
    if errors:
        raise BuildError(f"{len(errors)} kernel problem(s), bundle {out} left unchanged:\n  "
                         + "\n  ".join(errors))
    _write_bundle(out, config, tp, dsl, entries, blobs, old)
    return status


def _write_bundle(out: Path, config: str, tp: int, dsl: str, entries: dict, blobs: dict,
                  old: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, blob in blobs.items():
        path = out / f"{name}.cubin"
        if not path.is_file() or path.read_bytes() != blob:
            _write_atomic(path, blob)
    manifest = {"format": MANIFEST_FORMAT, "arch": ARCH, "config": config, "tp": tp, "dsl": dsl,
                "kernels": dict(sorted(entries.items()))}
    _write_atomic(out / MANIFEST_NAME, (json.dumps(manifest, indent=1) + "\n").encode())
    for stale in set(old) - set(entries):
        with contextlib.suppress(FileNotFoundError):
            (out / f"{stale}.cubin").unlink()


def only_families(names: list[str], out: Path) -> tuple[str, ...]:
    """The families `--only` names, in build order. A partial build rewrites the manifest with
    those kernels alone, so it refuses an out dir that holds a bundle (the default dir included)."""
    wanted = [n if n.startswith("kernels.") else f"kernels.{n}" for n in names]
    unknown = sorted(set(wanted) - set(FAMILIES))
    if unknown:
        raise BuildError(f"--only {unknown}: no such kernel family; expected names from "
                         f"{[f.removeprefix('kernels.') for f in FAMILIES]}")
    others = sorted({e.get("family") for e in _read_old_manifest(out).values()} - set(wanted))
    if others:
        raise BuildError(f"--only would drop the kernels of {others} from the bundle in {out}; "
                         f"give a partial build an --out dir of its own")
    return tuple(f for f in FAMILIES if f in wanted)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.build", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="preset name (tiny, v41-flash) or a .json")
    parser.add_argument("--tp", type=int, required=True, help="tensor-parallel degree")
    parser.add_argument("--out", type=Path, help="bundle dir (default build/bundle-CONFIG-tpN)")
    parser.add_argument("--jobs", type=int, default=1, help="parallel compile processes")
    parser.add_argument("--only", action="append", default=None, metavar="FAMILY",
                        help="build only this family (repeatable; 'allreduce' or "
                             "'kernels.allreduce'), into an --out dir of its own")
    args = parser.parse_args(argv)
    out = args.out or default_out_dir(Path(args.config).stem, args.tp)
    start = time.perf_counter()
    try:
        families = FAMILIES if args.only is None else only_families(args.only, out)
        status = build_bundle(args.config, args.tp, out, max(1, args.jobs), families)
    except BuildError as exc:
        print(f"kernel build failed: {exc}", file=sys.stderr)
        return 1
    compiled = sum(s == "compiled" for s in status.values())
    print(f"bundle {out}: {len(status)} kernels ({compiled} compiled, {len(status) - compiled} "
          f"cached) in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
