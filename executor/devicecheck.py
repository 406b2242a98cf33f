"""`hopdec devicecheck --out DIR`: every GPU test and every benchmark, one JSON report and a table.

Run on a GPU machine (see docs/device.md). Steps:
1. `pytest -m gpu tests` in a subprocess with the bundles exported (HOPDEC_BUNDLE = the tiny one,
   HOPDEC_BUNDLE_V41 = the v41-flash one); the junit XML is parsed into the report. A skipped GPU
   test counts as a failure here: on the GPU machine nothing may skip. After a kernel fault (a
   sticky CUDA error) the test files after the faulting one's run again in a fresh process.
2. The registered benchmarks (`executor/benchmarks.py`), in process, each isolated: one that raises
   is recorded with its error and the others still run.
3. DIR/report.json (environment, tests, bandwidth rows, metrics) and DIR/table.txt (printed too).
Exit status 0 only when every GPU test passed, no benchmark failed and every target was met.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

DEFAULT_BUNDLES = ("build/bundle-tiny", "build/bundle-v41-flash-tp4",
                   "build/bundle-v41-bench-step-tp4")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path, help="report directory (created)")
    parser.add_argument("--bundle", action="append", type=Path, default=None,
                        help="kernel bundle dir (repeatable; default: "
                             f"{', '.join(DEFAULT_BUNDLES)})")
    parser.add_argument("--skip-tests", action="store_true", help="benchmarks only")
    parser.add_argument("--skip-bench", action="store_true", help="GPU tests only")
    parser.add_argument("--only", action="append", default=None, help="run only these benchmarks")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and reps")
    parser.add_argument("--test-timeout", type=int, default=900, help="seconds for pytest")
    parser.add_argument("--tests", action="append", default=None,
                        help="GPU test files/node ids to run (repeatable; default: all of tests/)")


def _bundle_configs(paths: list[Path]) -> dict[str, Path]:
    from executor.bundle import read_manifest
    found = {}
    for p in paths:
        m = read_manifest(p)              # a bad bundle fails here, naming the file
        found[m.config or p.name] = p
    return found


DISTRIBUTIONS = ("numpy", "ml_dtypes", "cupy-cuda13x", "cupy-cuda12x", "cuda-bindings", "cuda-core",
                 "nvtx", "nccl4py", "nvidia-nccl-cu13", "pytest")


def environment() -> dict:
    """Python, package versions (missing ones said so) and the driver version."""
    from importlib import metadata

    env = {"python": platform.python_version(), "host": platform.node(), "packages": {}}
    for dist in DISTRIBUTIONS:
        try:
            env["packages"][dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            env["packages"][dist] = None
    try:
        from executor.cuda import check, driver
        cu = driver()
        check(cu.cuInit(0))
        env["driver_version"] = check(cu.cuDriverGetVersion())
    except Exception as exc:  # noqa: BLE001 - no driver is a fact for the report
        env["driver_version"] = f"unavailable: {exc}"
    return env


# A kernel fault leaves the CUDA context unusable: every later test in that process fails on it.
STICKY_FAULTS = ("CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_MISALIGNED_ADDRESS",
                 "CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_ILLEGAL_INSTRUCTION",
                 "CUDA_ERROR_INVALID_ADDRESS_SPACE", "CUDA_ERROR_INVALID_PC",
                 "CUDA_ERROR_HARDWARE_STACK_ERROR", "CUDA_ERROR_ASSERT")
MAX_TEST_PASSES = 6


def run_gpu_tests(out: Path, bundles: dict[str, Path], timeout: int,
                  targets: list[str] | None = None) -> dict:
    """`pytest -m gpu` over targets; after a sticky fault the test files after the faulting one's
    run again in a fresh process (at most MAX_TEST_PASSES processes, within `timeout` in all), so
    a faulting kernel costs the rest of its own module, not the rest of the run."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if "tiny" in bundles:
        env["HOPDEC_BUNDLE"] = str(bundles["tiny"])
    if "v41-flash" in bundles:
        env["HOPDEC_BUNDLE_V41"] = str(bundles["v41-flash"])
    t0, logs, cases, rc = time.time(), [], [], 0
    pending = list(targets or ["tests"])
    for attempt in range(MAX_TEST_PASSES):
        junit = out / ("junit.xml" if attempt == 0 else f"junit-{attempt + 1}.xml")
        left = max(1, int(timeout - (time.time() - t0)))
        log, code = _pytest(pending, junit, env, left)
        logs.append(log if attempt == 0 else f"\n==== pass {attempt + 1}: {' '.join(pending)}\n{log}")
        rc = code if code else rc
        got = parse_junit(junit)["cases"] if junit.is_file() else []
        fault = next((i for i, c in enumerate(got) if _sticky(c["message"])), None)
        if fault is None or attempt == MAX_TEST_PASSES - 1:
            cases += got
            break
        # the faulting module's later cases keep their (poisoned) outcome: its kernels are
        # suspect, and re-running them case by case could spend every pass on one module
        module = _module(got[fault])
        later = next((i for i in range(fault, len(got)) if _module(got[i]) != module), len(got))
        cases += got[:later]
        pending = [o for o in pending if o.startswith("-")] + _files(got[later:])
        if later == len(got):
            break
    (out / "pytest.log").write_text("".join(logs))
    result = {"returncode": rc, "seconds": round(time.time() - t0, 1), "cases": cases}
    if not cases:
        result["error"] = "no junit xml written"
    result.update(_count(cases))
    return result


def _pytest(targets: list[str], junit: Path, env: dict, timeout: int) -> tuple[str, int]:
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", *targets, "-q", "-rs",
           "-p", "no:cacheprovider", f"--junitxml={junit}"]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                              check=False)
        return proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        return f"{out}{err}\npytest timed out after {timeout}s", -1


def _sticky(message: str) -> bool:
    return any(code in message for code in STICKY_FAULTS)


def _module(case: dict) -> str:
    return case["name"].split("::", 1)[0]


def _files(cases: list[dict]) -> list[str]:
    """The test files of junit cases (classname `tests.gpu.test_x[.TestClass]`), in order."""
    files = []
    for case in cases:
        parts = _module(case).split(".")
        for cut in range(len(parts), 0, -1):
            path = str(Path(*parts[:cut]).with_suffix(".py"))
            if Path(path).is_file():
                if path not in files:
                    files.append(path)
                break
    return files


def _count(cases: list[dict]) -> dict:
    counts = dict.fromkeys(("passed", "failed", "skipped", "errors", "modules_skipped"), 0)
    for case in cases:
        counts[case["outcome"]] += 1
    return counts


def parse_junit(path: Path) -> dict:
    """Counts and per-case outcomes (with the failure/skip message) from a pytest junit XML."""
    root = ET.parse(path).getroot()
    cases = []
    for tc in root.iter("testcase"):
        outcome, message = "passed", ""
        for tag, name in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
            node = tc.find(tag)
            if node is not None:
                outcome, message = name, (node.get("message") or node.text or "")[:500]
                if node.text and tag == "skipped":
                    message = f"{message}: {node.text}"[:500]
                break
        if outcome == "skipped" and not tc.get("classname"):
            # a whole module skipped at collection (e.g. a CPU module needing the DSL): none of
            # its tests was selected by -m gpu, so it is reported but is not a skipped GPU test
            outcome = "modules_skipped"
        cases.append({"name": f"{tc.get('classname')}::{tc.get('name')}", "outcome": outcome,
                      "seconds": float(tc.get("time") or 0), "message": message})
    return {**_count(cases), "cases": cases}


def run_benchmarks(bundles: dict[str, Path], only, quick: bool,
                   out_dir: Path | None = None) -> tuple[dict, list, list]:
    from executor.benchmarks import BENCHMARKS, BenchContext, result_dicts
    from executor.runtime import Bundle, Device

    status = {}
    try:
        dev = Device(0)
    except Exception as exc:  # noqa: BLE001 - no GPU: the report says so instead of a traceback
        status["setup"] = {"ok": False, "error": f"no device: {type(exc).__name__}: {exc}"}
        return status, [], []
    loaded = {}
    ctx = None
    try:
        loaded = {cfg: Bundle.load(dev, p) for cfg, p in bundles.items()}
        ctx = BenchContext(dev, dev.stream(), loaded, quick=quick, out_dir=out_dir)
        for name, fn in BENCHMARKS:
            if only and name not in only:
                continue
            t0 = time.time()
            try:
                fn(ctx)
                status[name] = {"ok": True, "seconds": round(time.time() - t0, 1)}
            except Exception as exc:  # noqa: BLE001 - one broken benchmark must not hide the rest
                status[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                "traceback": traceback.format_exc()[-3000:]}
            print(f"benchmark {name}: {'ok' if status[name]['ok'] else status[name]['error']}",
                  flush=True)
        bw, metrics = result_dicts(ctx)
    finally:
        if ctx is not None:
            ctx.close()
        for b in loaded.values():
            b.close()
        dev.close()
    return status, bw, metrics


def format_table(report: dict) -> str:
    lines = []
    env = report["environment"]
    pk = env.get("packages", {})
    lines.append(f"hopdec devicecheck  device={env.get('device', '?')}  "
                 f"driver={env.get('driver_version')}  cuda-bindings={pk.get('cuda-bindings')}  "
                 f"cupy={pk.get('cupy-cuda13x') or pk.get('cupy-cuda12x')}  nvtx={pk.get('nvtx')}")
    t = report.get("tests")
    if t:
        lines.append(f"GPU tests: {t.get('passed', 0)} passed, {t.get('failed', 0)} failed, "
                     f"{t.get('errors', 0)} errors, {t.get('skipped', 0)} skipped "
                     f"({t.get('seconds')} s); {t.get('modules_skipped', 0)} module(s) "
                     "skipped at collection")
        for c in t.get("cases", []):
            if c["outcome"] != "passed":
                first = (c["message"].splitlines() or [""])[0]
                lines.append(f"  {c['outcome'].upper():8s} {c['name']}: {first[:160]}")
    if report.get("bandwidth"):
        lines.append("")
        lines.append(f"{'kernel':34s} {'case':>10s} {'rows':>7s} {'us':>10s} {'bytes':>13s} "
                     f"{'GB/s':>8s} {'%4.8TB/s':>9s} {'%stream':>8s}")
        for r in report["bandwidth"]:
            ps = f"{r['pct_stream']:.1f}" if r["pct_stream"] is not None else "-"
            lines.append(f"{r['kernel']:34s} {r['case']:>10s} {r['rows']:>7d} {r['us']:>10.2f} "
                         f"{r['bytes']:>13d} {r['gbps']:>8.0f} {r['pct_hbm']:>9.1f} {ps:>8s}")
    if report.get("metrics"):
        lines.append("")
        lines.append(f"{'metric':62s} {'value':>10s} {'unit':5s} {'target':>8s} ok")
        for m in report["metrics"]:
            ok = "-" if m["ok"] is None else ("yes" if m["ok"] else "NO")
            lines.append(f"{m['metric']:62s} {m['value']:>10.3f} {m['unit']:5s} "
                         f"{m['target']:>8s} {ok}")
    for name, st in report.get("benchmarks", {}).items():
        if not st["ok"]:
            lines.append(f"BENCHMARK FAILED {name}: {st['error']}")
    lines.append(f"overall: {'PASS' if report['ok'] else 'FAIL'}")
    return "\n".join(lines)


def run(args) -> int:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    paths = args.bundle or [Path(p) for p in DEFAULT_BUNDLES if Path(p, "manifest.json").is_file()]
    bundles = _bundle_configs(paths)
    report = {"environment": environment(), "bundles": {k: str(v) for k, v in bundles.items()}}
    try:
        from executor.runtime import Device
        with Device(0) as dev:
            report["environment"]["device"] = dev.info.name
            report["environment"]["device_info"] = dev.info.__dict__ | {}
    except Exception as exc:  # noqa: BLE001
        report["environment"]["device"] = f"unavailable: {exc}"
    if not args.skip_tests:
        report["tests"] = run_gpu_tests(out, bundles, args.test_timeout, args.tests)
    if not args.skip_bench:
        report["benchmarks"], report["bandwidth"], report["metrics"] = run_benchmarks(
            bundles, args.only, args.quick, out)
    tests_ok = args.skip_tests or (report["tests"].get("returncode") == 0
                                   and report["tests"].get("passed", 0) > 0
                                   and not report["tests"].get("skipped")
                                   and not report["tests"].get("failed")
                                   and not report["tests"].get("errors"))
    bench_ok = all(st["ok"] for st in report.get("benchmarks", {}).values())
    targets_ok = all(m["ok"] is not False for m in report.get("metrics", []))
    report["ok"] = bool(tests_ok and bench_ok and targets_ok)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    table = format_table(report)
    (out / "table.txt").write_text(table + "\n")
    print(table)
    return 0 if report["ok"] else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m executor.devicecheck", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
