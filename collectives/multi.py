"""Multi-GPU collectives check and benchmark: links, IPC smoke test, NCCL vs one-shot, crossover.

    python -m collectives.multi --bundle DIR [--bundle DIR ...] --out DIR [--devices 0,1,2,3]
    hopdec devicecheck --only tp ...              # the same, as the devicecheck family "tp"

One process per rank (`collectives.launcher.run_ranks`, every process with NCCL_NVLS_ENABLE=0);
the world is every visible GPU, or the ordinals of `--devices` / HOPDEC_TP_DEVICES ("0,1,2,3").
A list that repeats a GPU ("0,0,0,0": 4 ranks on GPU 0) is a functional check of the IPC path
only: no NCCL (NCCL refuses two ranks of one communicator on one GPU) and no timings (the
contexts time-slice, ~7 ms a call). Fewer than 2 ranks: a "skipped" line, not a failure.

1. links (parent): `nvidia-smi topo -m`; cuDeviceCanAccessPeer and the P2P attributes (access,
   native atomics, performance rank) for every ordered pair of distinct GPUs;
2. IPC smoke (collectives/multi_ranks.py): each rank fills its IPC buffer with a keyed pattern,
   every rank reads every peer's buffer through the mapped handle (SM loads, and a copy-engine
   copy) and checks every word; then every rank stores into its slice of every peer's buffer and
   each owner checks every word of what it received;
3. all-reduce of R x 5120 bf16, R in ROWS, per VARIANT: one eager call checked, then a graph of
   CALLS_PER_GRAPH calls replayed REPLAYS times (CUDA events on each rank, median / calls; the
   report keeps the slowest rank), its last output checked again. One-shot results are compared
   bitwise with `allreduce_ref` (fp32 fold in rank order); NCCL's own summation order is
   unspecified, so its sum is checked against the float64 sum within world x 2^-8 x sum|x_s|
   (at most world - 1 bf16 roundings of partial sums no larger than sum|x_s|, plus one spare);
   the residual add after NCCL is checked bitwise from NCCL's own sum;
4. crossover: the smallest R at which NCCL is faster (plain: oneshot vs nccl; fused: the
   residual epilogue vs NCCL + the bf16 residual-add kernel), and the PathTable it implies
   (one-shot for rows below it). Measured values go into MEASURED_CROSSOVER by hand, per world.

The step (executor/stages/collectives.py) calls the plain one-shot all-reduce (embed, attn, ffn),
the all-gather and the pick; no residual-fused all-reduce. The fused variants are measured
because the AllReduce facade offers them.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from collectives.allreduce import PathTable
from kernels import allreduce_ref as ref

DEVICES_VARIABLE = "HOPDEC_TP_DEVICES"
WIDTH = 5120
ROWS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192)
QUICK_ROWS = (1, 8, 32, 64, 192)
VARIANTS = ("oneshot", "oneshot_residual", "nccl", "nccl_residual")
PAIRS = (("oneshot", "nccl"), ("oneshot_residual", "nccl_residual"))   # (custom, NCCL)
CALLS_PER_GRAPH = 20
REPLAYS = 50
NCCL_ROUNDING = 2.0 ** -8          # bf16 unit roundoff (8 significant bits, round to nearest)
RUN_TIMEOUT_S = 420

# world -> the smallest R (of ROWS) at which graph-captured NCCL beat the plain one-shot kernel
# on that many H200s (None: one-shot won at every R). Filled from device runs; absent = not
# measured. The step's all-reduce stage can read it through measured_path_table(world).
MEASURED_CROSSOVER: dict[int, int | None] = {4: None}    # run 35: 4 x H200, NV18, NVLS off


# ---- pure parts (CPU-tested) -------------------------------------------------------------------

def resolve_devices(text: str | None, visible: int) -> tuple[int, ...]:
    """Ordinals of the ranks: every visible GPU when `text` is None or blank, else "0,1,..."
    (one per rank; a repeated ordinal puts several ranks on one GPU)."""
    if isinstance(visible, bool) or not isinstance(visible, int) or visible < 0:
        raise ValueError(f"visible GPU count must be a non-negative int, got {visible!r}")
    if text is None or not text.strip():
        return tuple(range(visible))
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise ValueError(f"{DEVICES_VARIABLE}={text!r}: expected comma-separated GPU ordinals "
                         f"such as '0,1,2,3'")
    ordinals = tuple(int(p) for p in parts)
    beyond = [d for d in ordinals if d >= visible]
    if beyond:
        raise ValueError(f"{DEVICES_VARIABLE}={text!r}: GPU ordinal(s) {beyond} not visible "
                         f"({visible} GPU(s): 0..{visible - 1})")
    return ordinals


def skip_reason(devices: tuple[int, ...]) -> str | None:
    """Why the multi-GPU check cannot run (None when it can)."""
    if len(devices) < 2:
        return f"needs >= 2 GPUs, found {len(devices)}"
    if len(devices) not in ref.WORLD_SIZES:
        return (f"the one-shot kernels exist for world sizes {ref.WORLD_SIZES}, "
                f"not {len(devices)}")
    return None


@dataclass(frozen=True)
class Plan:
    """What the ranks run: shared-GPU worlds run the functional parts only."""

    def __post_init__(self):
        if not self.devices or any(isinstance(d, bool) or not isinstance(d, int) or d < 0
                                   for d in self.devices):
            raise ValueError(f"Plan: devices must be GPU ordinals, got {self.devices!r}")
        if not self.rows or any(not 1 <= n <= ref.MAX_ROWS for n in self.rows):
            raise ValueError(f"Plan: rows {self.rows!r} must lie in 1..{ref.MAX_ROWS}")
        if self.calls_per_graph < 1 or self.replays < 1:
            raise ValueError("Plan: calls_per_graph and replays must be >= 1")

    devices: tuple[int, ...]
    rows: tuple[int, ...] = ROWS
    calls_per_graph: int = CALLS_PER_GRAPH
    replays: int = REPLAYS
    timed: bool = True          # False: checks only (the GPU test)

    @property
    def world(self) -> int:
        return len(self.devices)

    @property
    def shares_gpu(self) -> bool:
        return len(set(self.devices)) < len(self.devices)

    @property
    def nccl(self) -> bool:
        return not self.shares_gpu

    @property
    def timing(self) -> bool:
        return self.timed and not self.shares_gpu

    @property
    def variants(self) -> tuple[str, ...]:
        return VARIANTS if self.nccl else VARIANTS[:2]

    @property
    def timeout_ms(self) -> int:
        """Per poll of the one-shot kernel: time-sliced contexts wait for each other's slices."""
        return 60_000 if self.shares_gpu else 10_000


def kernel_names(world: int, width: int = WIDTH) -> tuple[str, ...]:
    """The kernels one run needs: both one-shot epilogues and the bf16 residual add."""
    return (ref.make_spec(world, width).name, ref.make_spec(world, width, "residual").name,
            f"residual_add_bf16_bf16_d{width}")


def find_bundle(world: int, candidates) -> Path:
    """The first bundle dir whose manifest holds every kernel of `kernel_names(world)`."""
    from executor.bundle import BundleError, read_manifest
    need, seen = kernel_names(world), []
    for path in candidates:
        path = Path(path)
        try:
            names = read_manifest(path).kernels
        except BundleError:
            continue
        if all(n in names for n in need):
            return path
        seen.append(str(path))
    raise LookupError(f"no bundle holds {list(need)} (looked in {seen or 'nothing'}); build one "
                      f"with: python -m kernels.build --config v41-flash --tp {world} --only "
                      f"allreduce --only elementwise --out build/bundle-v41-flash-tp{world}-"
                      f"collectives")


def nccl_sum_report(got: np.ndarray, inputs, world: int) -> dict:
    """NCCL's bf16 sum against the float64 sum: elements outside world x 2^-8 x sum_s |x_s|."""
    xs = [np.asarray(x, np.float64) for x in inputs]
    exact = sum(xs)
    bound = world * NCCL_ROUNDING * sum(np.abs(x) for x in xs)
    err = np.abs(got.astype(np.float64) - exact)
    bad = ~(err <= bound)                       # NaN (unwritten, poisoned) counts as bad
    with np.errstate(divide="ignore", invalid="ignore"):
        worst = float(np.nanmax(np.where(bound > 0, err / bound, np.where(err > 0, np.inf, 0))))
    report = {"mismatches": int(bad.sum()), "worst_err_over_bound": worst}
    if bad.any():
        r, c = (int(v) for v in np.argwhere(bad)[0])
        report["first"] = (r, c, float(got[r, c]), float(exact[r, c]))
    return report


@dataclass(frozen=True)
class Row:
    """One (variant, rows) result over all ranks."""

    variant: str
    rows: int
    us: float | None            # slowest rank's graph per-call median (None: not timed)
    us_fastest: float | None
    mismatches: int             # summed over ranks and over the eager and the graph check
    ranks_agree: bool           # every rank wrote the same bits


def aggregate(rank_values: list[dict]) -> list[Row]:
    """Combine the ranks' `results` lists (see multi_ranks.allreduce_cases) into Rows."""
    by_case: dict[tuple[str, int], list[dict]] = {}
    for value in rank_values:
        for res in value["results"]:
            by_case.setdefault((res["variant"], res["rows"]), []).append(res)
    rows = []
    for (variant, n), per_rank in by_case.items():
        if len(per_rank) != len(rank_values):
            raise ValueError(f"{variant} at {n} rows: {len(per_rank)} of {len(rank_values)} "
                             f"ranks reported")
        times = [r["us"] for r in per_rank if r["us"] is not None]
        rows.append(Row(variant, n, max(times) if times else None,
                        min(times) if times else None,
                        sum(c["mismatches"] for r in per_rank for c in r["checks"]),
                        len({r["digest"] for r in per_rank}) == 1))
    return sorted(rows, key=lambda r: (r.rows, VARIANTS.index(r.variant)))


def crossover(rows: list[Row], custom: str, nccl: str) -> int | None:
    """The smallest R at which `nccl` took less time per call than `custom` (None: never)."""
    times = {(r.variant, r.rows): r.us for r in rows}
    for n in sorted({r.rows for r in rows}):
        a, b = times.get((custom, n)), times.get((nccl, n))
        if a is not None and b is not None and b < a:
            return n
    return None


def path_table(cross: int | None, max_rows: int = ref.MAX_ROWS) -> PathTable:
    """One-shot below the crossover, NCCL from it on (all one-shot when NCCL never won)."""
    if cross is None or cross > max_rows:
        return PathTable(((max_rows, "oneshot"),))
    if cross <= 1:
        return PathTable(((max_rows, "nccl"),))
    return PathTable(((cross - 1, "oneshot"), (max_rows, "nccl")))


def measured_path_table(world: int) -> PathTable | None:
    """The table MEASURED_CROSSOVER implies for `world` GPUs; None where it was not measured."""
    if world not in MEASURED_CROSSOVER:
        return None
    return path_table(MEASURED_CROSSOVER[world])


def parse_topo_links(text: str) -> dict[tuple[int, int], str]:
    """`nvidia-smi topo -m` -> {(i, j): "NV18" | "SYS" | ...} for the GPU x GPU block."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)       # nvidia-smi underlines the header row
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return {}
    header = lines[0].split()
    gpus = [h for h in header if h.startswith("GPU") and h[3:].isdigit()]
    links = {}
    for ln in lines[1:]:
        cells = ln.split()
        if not cells or not cells[0].startswith("GPU") or not cells[0][3:].isdigit():
            continue
        i = int(cells[0][3:])
        for j, cell in enumerate(cells[1:1 + len(gpus)]):
            if i != j:
                links[(i, j)] = cell
    return links


def format_table(rows: list[Row]) -> str:
    """Per-call microseconds per rows and variant, the faster path per pair, the checks."""
    by_rows: dict[int, dict[str, Row]] = {}
    for r in rows:
        by_rows.setdefault(r.rows, {})[r.variant] = r
    variants = [v for v in VARIANTS if any(v in d for d in by_rows.values())]
    head = f"{'rows':>5} {'KiB':>6} " + " ".join(f"{v:>16}" for v in variants)
    head += f" {'plain':>8} {'fused':>8}  checks"
    out = [head]
    for n, d in sorted(by_rows.items()):
        cells = []
        for v in variants:
            r = d.get(v)
            cells.append(f"{'-' if r is None or r.us is None else f'{r.us:.2f} us':>16}")
        wins = []
        for custom, nccl in PAIRS:
            a, b = d.get(custom), d.get(nccl)
            if a is None or b is None or a.us is None or b.us is None:
                wins.append(f"{'-':>8}")
            else:
                wins.append(f"{'nccl' if b.us < a.us else 'oneshot':>8}")
        bad = [f"{v}: {r.mismatches} bad" for v, r in d.items() if r.mismatches]
        split = [v for v, r in d.items() if not r.ranks_agree and v.startswith("oneshot")]
        check = "; ".join(bad + [f"{v}: ranks differ" for v in split]) or "ok"
        out.append(f"{n:>5} {n * WIDTH * 2 / 1024:>6.0f} " + " ".join(cells) + " "
                   + " ".join(wins) + "  " + check)
    return "\n".join(out)


def rows_failed(rows: list[Row]) -> list[str]:
    """What went wrong: mismatches anywhere, or one-shot ranks that disagree bitwise."""
    bad = [f"{r.variant} at {r.rows} rows: {r.mismatches} mismatching elements"
           for r in rows if r.mismatches]
    bad += [f"{r.variant} at {r.rows} rows: ranks wrote different bits"
            for r in rows if not r.ranks_agree and r.variant.startswith("oneshot")]
    return bad


# ---- the parent: links, ranks, report ----------------------------------------------------------

def visible_gpus() -> int:
    from executor.cuda import check, driver
    check(driver().cuInit(0))
    return int(check(driver().cuDeviceGetCount()))


def topo_text() -> str:
    """`nvidia-smi topo -m` as printed, or why it is missing."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "nvidia-smi not found on PATH"
    try:
        done = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=60,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi topo -m failed: {exc}"
    return done.stdout if done.returncode == 0 else f"nvidia-smi topo -m: {done.stderr.strip()}"


def peer_pairs(devices: tuple[int, ...]) -> list[dict]:
    """cuDeviceCanAccessPeer and the P2P link attributes for every ordered pair of distinct GPUs."""
    from executor.cuda import check, driver
    cu = driver()
    check(cu.cuInit(0))
    attr = cu.CUdevice_P2PAttribute
    wanted = {"access": attr.CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED,
              "native_atomics": attr.CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED,
              "performance_rank": attr.CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK}
    ordinals = sorted(set(devices))
    handles = {d: check(cu.cuDeviceGet(d)) for d in ordinals}
    pairs = []
    for i in ordinals:
        for j in ordinals:
            if i == j:
                continue
            pair = {"src": i, "dst": j,
                    "can_access_peer": int(check(cu.cuDeviceCanAccessPeer(handles[i],
                                                                          handles[j])))}
            for name, which in wanted.items():
                pair[name] = int(check(cu.cuDeviceGetP2PAttribute(which, handles[i],
                                                                  handles[j])))
            pairs.append(pair)
    return pairs


def run_check(plan: Plan, bundle_dir: Path, seed: int) -> dict:
    """Links, then the ranks; the report as plain data (see problems())."""
    from collectives.launcher import run_ranks
    from collectives.multi_ranks import tp_rank
    from collectives.nccl import require_nvls_disabled

    require_nvls_disabled()                     # the children inherit it (and the launcher sets it)
    text = topo_text()
    report = {"devices": list(plan.devices), "world": plan.world, "shares_gpu": plan.shares_gpu,
              "seed": seed, "bundle": str(bundle_dir), "topo": text,
              "topo_links": {f"{i}-{j}": v for (i, j), v in parse_topo_links(text).items()},
              "pairs": peer_pairs(plan.devices), "plan": asdict(plan)}
    results = run_ranks(tp_rank, plan.world, devices=list(plan.devices),
                        args=(str(bundle_dir), plan, seed), timeout_s=RUN_TIMEOUT_S)
    report["rank_errors"] = [r.describe() + "\n" + r.traceback for r in results if not r.ok]
    if report["rank_errors"]:
        return report
    values = [r.value for r in results]
    report["smoke"] = [v["smoke"] for v in values]
    report["failed_sources"] = [v["failed_sources"] for v in values]
    rows = aggregate(values)
    report["rows"] = [asdict(r) for r in rows]
    report["table"] = format_table(rows)
    if plan.timing:
        cross = {custom: crossover(rows, custom, nccl) for custom, nccl in PAIRS}
        report["crossover"] = cross
        report["path_table"] = [list(e) for e in path_table(cross["oneshot"]).entries]
    return report


def problems(report: dict) -> list[str]:
    """Everything that makes the run a failure (empty: every check passed)."""
    out = list(report.get("rank_errors", []))
    if not report["shares_gpu"]:
        out += [f"GPU {p['src']} cannot access GPU {p['dst']} as a peer"
                for p in report["pairs"] if not p["can_access_peer"]]
    for rank, smoke in enumerate(report.get("smoke", [])):
        out += [f"rank {rank}: IPC {what}: {n} mismatching words"
                for what, n in smoke["mismatching_words"].items() if n]
    for rank, silent in enumerate(report.get("failed_sources", [])):
        if silent:
            out.append(f"rank {rank}: one-shot timed out waiting for rank(s) {silent}")
    if "rows" in report:
        out += rows_failed([Row(**r) for r in report["rows"]])
    return out


def format_report(report: dict) -> str:
    shared = " (shared GPU: functional check only)" if report["shares_gpu"] else ""
    title = (f"multi-GPU collectives: world {report['world']} on GPUs {report['devices']}{shared}, "
             f"seed {report['seed']}, bundle {report['bundle']}")
    lines = [title, "", report["topo"].rstrip(), ""]
    lines += [f"peer {p['src']} -> {p['dst']}: can_access_peer {p['can_access_peer']}, "
              f"access {p['access']}, native atomics {p['native_atomics']}, performance rank "
              f"{p['performance_rank']}" for p in report["pairs"]]
    for rank, smoke in enumerate(report.get("smoke", [])):
        bad = sum(smoke["mismatching_words"].values())
        lines.append(f"IPC smoke, rank {rank}: {len(smoke['mismatching_words'])} checks of "
                     f"{smoke['bytes']} B, {bad} mismatching words")
    if "table" in report:
        plan = report["plan"]
        lines += ["", (f"all-reduce of R x {WIDTH} bf16, graph-captured per-call time (slowest "
                       f"rank, median of {plan['replays']} replays of {plan['calls_per_graph']} "
                       f"calls)"), report["table"]]
    if "crossover" in report:
        for custom, cross in report["crossover"].items():
            lines.append(f"crossover {custom}: " + ("NCCL never faster" if cross is None
                                                    else f"NCCL faster from {cross} rows"))
        lines.append(f"path table (plain): {report['path_table']}")
    found = problems(report)
    lines += ["", "PROBLEMS:" if found else "all checks passed"] + [f"  {p}" for p in found]
    return "\n".join(lines)


def bundle_candidates(world: int, extra=()) -> list[Path]:
    env = os.environ.get("HOPDEC_TP_BUNDLE")
    return ([Path(env)] if env else []) + [Path(p) for p in extra] + [
        Path(f"build/bundle-v41-flash-tp{world}-collectives"),
        Path(f"build/bundle-v41-flash-tp{world}")]


def bench_tp(ctx) -> None:
    """devicecheck family "tp": the multi-GPU check on every visible GPU (or HOPDEC_TP_DEVICES);
    one skipped line on a single GPU."""
    devices = resolve_devices(os.environ.get(DEVICES_VARIABLE), visible_gpus())
    reason = skip_reason(devices)
    if reason is not None:
        ctx.metric(f"tp: skipped: {reason}", float(len(devices)), "GPUs")
        return
    plan = Plan(devices, rows=QUICK_ROWS if ctx.quick else ROWS)
    bundle = find_bundle(plan.world, bundle_candidates(
        plan.world, [b.manifest.path.parent for b in ctx.bundles.values()]))
    report = run_check(plan, bundle, random.randrange(2**32))
    print(format_report(report))
    if report["rank_errors"]:
        raise RuntimeError("tp: rank(s) failed:\n" + "\n".join(report["rank_errors"]))
    for p in report["pairs"]:
        ok = bool(p["can_access_peer"])
        link = report["topo_links"].get(f"{p['src']}-{p['dst']}", "?")
        ctx.metric(f"tp: peer access GPU {p['src']} -> {p['dst']} (topo {link})",
                   float(p["can_access_peer"]), "", "1", ok or plan.shares_gpu)
    bad = sum(sum(s["mismatching_words"].values()) for s in report["smoke"])
    ctx.metric(f"tp: IPC smoke (peer loads, copies, stores), world {plan.world}", float(bad),
               "words", "0 bad", bad == 0)
    for r in (Row(**d) for d in report["rows"]):
        timed = "graph per call (slowest rank)" if r.us is not None else "not timed (shared GPU)"
        ctx.metric(f"tp{plan.world}: {r.variant}, {r.rows} rows, {timed}", r.us or 0.0, "us",
                   "checked",
                   r.mismatches == 0 and (r.ranks_agree or r.variant.startswith("nccl")))
    for custom, cross in report.get("crossover", {}).items():
        ctx.metric(f"tp{plan.world}: crossover {custom} -> NCCL (0: NCCL never faster)",
                   float(cross or 0), "rows")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collectives.multi",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", action="append", default=[], type=Path,
                        help="bundle dir(s) to search for the world's one-shot kernels")
    parser.add_argument("--out", required=True, type=Path, help="report dir (created)")
    parser.add_argument("--devices", default=None,
                        help=f"GPU ordinals, one per rank (default: ${DEVICES_VARIABLE} or "
                             f"every visible GPU); '0,0,0,0' = functional check on GPU 0")
    parser.add_argument("--quick", action="store_true", help=f"rows {QUICK_ROWS} only")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    text = args.devices if args.devices is not None else os.environ.get(DEVICES_VARIABLE)
    devices = resolve_devices(text, visible_gpus())
    args.out.mkdir(parents=True, exist_ok=True)
    reason = skip_reason(devices)
    if reason is not None:
        print(f"tp: skipped: {reason}")
        (args.out / "tp-table.txt").write_text(f"tp: skipped: {reason}\n")
        return 0
    plan = Plan(devices, rows=QUICK_ROWS if args.quick else ROWS)
    bundle = find_bundle(plan.world, bundle_candidates(plan.world, args.bundle))
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    report = run_check(plan, bundle, seed)
    text = format_report(report)
    print(text)
    (args.out / "tp-report.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "tp-table.txt").write_text(text + "\n")
    return 1 if problems(report) else 0


if __name__ == "__main__":
    sys.exit(main())
