"""CPU tests of the multi-GPU check's pure parts (collectives/multi.py) and `kernels.build --only`:
device lists, the skip path, the NCCL error bound, aggregation, crossover and path table, the
report text, the topology parser. The GPU side is tests/gpu/test_collectives_multi_gpu.py."""
from __future__ import annotations

import json

import numpy as np
import pytest

from collectives import multi
from kernels import allreduce_ref as ref
from kernels.common_ref import BF16, to_bf16

TOPO_4xH200 = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV18\tNV18\tNV18\tSYS\t0-63\t0\t\tN/A
GPU1\tNV18\t X \tNV18\tNV18\tSYS\t0-63\t0\t\tN/A
GPU2\tNV18\tNV18\t X \tNV18\tSYS\t64-127\t1\t\tN/A
GPU3\tNV18\tNV18\tNV18\t X \tSYS\t64-127\t1\t\tN/A
NIC0\tSYS\tSYS\tSYS\tSYS\t X

Legend:

  X    = Self
  NV#  = Connection traversing a bonded set of # NVLinks
"""


# ---- device lists and the skip path -------------------------------------------------------------

def test_resolve_devices_default_explicit_and_shared():
    assert multi.resolve_devices(None, 4) == (0, 1, 2, 3)
    assert multi.resolve_devices("  ", 2) == (0, 1)
    assert multi.resolve_devices("1, 0", 2) == (1, 0)
    assert multi.resolve_devices("0,0,0,0", 1) == (0, 0, 0, 0)
    assert multi.resolve_devices(None, 0) == ()


@pytest.mark.parametrize("text, visible, words", [
    ("0,x", 4, "comma-separated"), ("0,-1", 4, "comma-separated"), ("0,4", 4, "[4] not visible"),
    ("0,1", 1, "[1] not visible")])
def test_resolve_devices_rejects_bad_lists(text, visible, words):
    with pytest.raises(ValueError, match="HOPDEC_TP_DEVICES") as info:
        multi.resolve_devices(text, visible)
    assert words in str(info.value)


def test_skip_reason():
    assert multi.skip_reason((0,)) == "needs >= 2 GPUs, found 1"
    assert multi.skip_reason(()) == "needs >= 2 GPUs, found 0"
    assert "world sizes" in multi.skip_reason((0, 1, 2))
    assert multi.skip_reason((0, 1)) is None and multi.skip_reason((0, 0, 0, 0)) is None


def test_plan_shared_gpu_runs_the_functional_parts_only():
    shared = multi.Plan((0, 0, 0, 0))
    assert shared.shares_gpu and not shared.nccl and not shared.timing
    assert shared.variants == ("oneshot", "oneshot_residual") and shared.timeout_ms == 60_000
    split = multi.Plan((0, 1, 2, 3))
    assert split.nccl and split.timing and split.variants == multi.VARIANTS
    assert not multi.Plan((0, 1), timed=False).timing
    for bad in ({"devices": ()}, {"devices": (0, -1)}, {"devices": (0, 1), "rows": (0,)},
                {"devices": (0, 1), "rows": (193,)}, {"devices": (0, 1), "replays": 0}):
        with pytest.raises(ValueError, match="Plan"):
            multi.Plan(**bad)


class _FakeContext:
    quick, bundles = False, {}

    def __init__(self):
        self.rows = []

    def metric(self, *args):
        self.rows.append(args)


def test_bench_tp_on_one_gpu_is_one_skipped_line(monkeypatch):
    monkeypatch.setattr(multi, "visible_gpus", lambda: 1)
    monkeypatch.delenv(multi.DEVICES_VARIABLE, raising=False)
    ctx = _FakeContext()
    multi.bench_tp(ctx)
    assert ctx.rows == [("tp: skipped: needs >= 2 GPUs, found 1", 1.0, "GPUs")]


def test_cli_on_one_gpu_skips_with_status_zero(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(multi, "visible_gpus", lambda: 1)
    monkeypatch.delenv(multi.DEVICES_VARIABLE, raising=False)
    assert multi.main(["--out", str(tmp_path / "o")]) == 0
    assert "skipped: needs >= 2 GPUs, found 1" in capsys.readouterr().out
    assert "found 1" in (tmp_path / "o" / "tp-table.txt").read_text()


def test_find_bundle_names_the_build_command(tmp_path):
    with pytest.raises(LookupError, match="--tp 2 --only allreduce --only elementwise"):
        multi.find_bundle(2, [tmp_path / "missing"])
    assert multi.kernel_names(2) == ("allreduce_oneshot_w2_d5120",
                                     "allreduce_oneshot_w2_d5120_residual",
                                     "residual_add_bf16_bf16_d5120")


# ---- NCCL's error bound ---------------------------------------------------------------------------

def _nccl_like_sum(xs, order) -> np.ndarray:
    """A bf16 sum in another order with a rounding after every add (ring reduction)."""
    acc = xs[order[0]].astype(np.float32)
    for s in order[1:]:
        acc = to_bf16(acc + xs[s].astype(np.float32)).astype(np.float32)
    return to_bf16(acc)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_nccl_bound_accepts_any_order_of_rounded_adds(world):
    rng = np.random.default_rng()
    xs = [(rng.standard_normal((9, 64), np.float32) * 4).astype(BF16) for _ in range(world)]
    for _ in range(4):
        got = _nccl_like_sum(xs, rng.permutation(world))
        report = multi.nccl_sum_report(got, xs, world)
        assert report["mismatches"] == 0 and report["worst_err_over_bound"] <= 1.0, report
    assert multi.nccl_sum_report(ref.allreduce_ref(xs), xs, world)["mismatches"] == 0


def test_nccl_bound_rejects_wrong_and_unwritten_elements():
    rng = np.random.default_rng()
    world = 4
    xs = [(rng.standard_normal((5, 32), np.float32) * 4).astype(BF16) for _ in range(world)]
    good = ref.allreduce_ref(xs)
    bound = world * multi.NCCL_ROUNDING * sum(np.abs(x.astype(np.float64)) for x in xs)
    wrong = good.astype(np.float32)
    wrong[3, 7] += 2 * bound[3, 7] + 0.5
    report = multi.nccl_sum_report(wrong.astype(BF16), xs, world)
    assert report["mismatches"] == 1 and report["first"][:2] == (3, 7)
    poisoned = good.copy()
    poisoned.view(np.uint16)[1, 2] = 0xFFFF           # bf16 NaN: never written
    assert multi.nccl_sum_report(poisoned, xs, world)["mismatches"] == 1


# ---- aggregation, crossover, path table, report ------------------------------------------------

def _rank_value(times: dict, digest="d", mismatches=0) -> dict:
    return {"results": [{"variant": v, "rows": n, "us": us, "digest": digest,
                         "checks": [{"mismatches": mismatches}, {"mismatches": 0}]}
                        for (v, n), us in times.items()]}


def _times(cross_at: int | None, jitter: float = 0.0) -> dict:
    """One-shot 4 + n/16 us, NCCL 15 us flat, or faster from `cross_at` rows on."""
    out = {}
    for n in multi.ROWS:
        one = 4.0 + n / 16 + jitter
        nccl = one - 1.0 if cross_at is not None and n >= cross_at else one + 1.0
        out.update({("oneshot", n): one, ("nccl", n): nccl, ("oneshot_residual", n): one + 0.5,
                    ("nccl_residual", n): one + 3.0})
    return out


def test_aggregate_keeps_the_slowest_rank_and_sums_mismatches():
    values = [_rank_value(_times(64)), _rank_value(_times(64, jitter=2.0), mismatches=3)]
    rows = multi.aggregate(values)
    assert len(rows) == len(multi.ROWS) * len(multi.VARIANTS)
    first = rows[0]
    assert (first.variant, first.rows) == ("oneshot", 1)
    assert first.us == pytest.approx(4.0 + 1 / 16 + 2.0)
    assert first.us_fastest == pytest.approx(4.0 + 1 / 16)
    assert first.mismatches == 3 and first.ranks_agree
    with pytest.raises(ValueError, match="1 of 2 ranks"):
        multi.aggregate([_rank_value(_times(64)), {"results": []}])


@pytest.mark.parametrize("cross_at", [1, 8, 64, 192, None])
def test_crossover_and_the_path_table_it_implies(cross_at):
    rows = multi.aggregate([_rank_value(_times(cross_at))])
    assert multi.crossover(rows, "oneshot", "nccl") == cross_at
    assert multi.crossover(rows, "oneshot_residual", "nccl_residual") is None
    table = multi.path_table(cross_at)
    assert table.max_rows == ref.MAX_ROWS
    for n in range(1, ref.MAX_ROWS + 1):
        want = "nccl" if cross_at is not None and n >= cross_at else "oneshot"
        assert table.path(n) == want, n


def test_measured_path_table_only_where_measured(monkeypatch):
    monkeypatch.setattr(multi, "MEASURED_CROSSOVER", {4: 96, 2: None})
    assert multi.measured_path_table(8) is None
    assert multi.measured_path_table(4).entries == ((95, "oneshot"), (192, "nccl"))
    assert multi.measured_path_table(2).entries == ((192, "oneshot"),)


def test_rows_failed_and_table_name_mismatches_and_split_ranks():
    values = [_rank_value(_times(32)), _rank_value(_times(32), digest="other", mismatches=2)]
    rows = multi.aggregate(values)
    failed = multi.rows_failed(rows)
    assert "oneshot at 1 rows: 2 mismatching elements" in failed
    assert "oneshot at 1 rows: ranks wrote different bits" in failed
    assert not any("nccl at 1 rows: ranks" in f for f in failed)    # NCCL's bits may differ
    text = multi.format_table(rows)
    lines = text.splitlines()
    assert lines[0].split()[:2] == ["rows", "KiB"] and len(lines) == 1 + len(multi.ROWS)
    row_32 = next(ln for ln in lines[1:] if ln.split()[0] == "32")
    assert row_32.split()[1] == "320" and "nccl" in row_32.split() and "2 bad" in row_32
    row_16 = next(ln for ln in lines[1:] if ln.split()[0] == "16")
    assert "oneshot" in row_16.split()


def test_parse_topo_links():
    links = multi.parse_topo_links(TOPO_4xH200)
    assert len(links) == 12 and set(links.values()) == {"NV18"}
    assert (0, 0) not in links and links[(3, 1)] == "NV18"
    # as nvidia-smi prints it on a terminal-less run: the header row underlined (run 35)
    underlined = TOPO_4xH200.replace("\tGPU0", "\t\x1b[4mGPU0", 1).replace(
        "GPU NUMA ID", "GPU NUMA ID\x1b[0m", 1)
    assert multi.parse_topo_links(underlined) == links
    assert multi.parse_topo_links("") == {}
    assert multi.parse_topo_links("nvidia-smi not found on PATH") == {}


def test_problems_and_report_text():
    rows = multi.aggregate([_rank_value(_times(48)), _rank_value(_times(48))])
    report = {"devices": [0, 1], "world": 2, "shares_gpu": False, "seed": 5, "bundle": "b",
              "topo": TOPO_4xH200, "topo_links": {}, "plan": {"replays": 50,
                                                              "calls_per_graph": 20},
              "pairs": [{"src": 0, "dst": 1, "can_access_peer": 1, "access": 1,
                         "native_atomics": 1, "performance_rank": 0},
                        {"src": 1, "dst": 0, "can_access_peer": 0, "access": 0,
                         "native_atomics": 0, "performance_rank": 0}],
              "smoke": [{"bytes": 64, "mismatching_words": {"load from 1": 0}},
                        {"bytes": 64, "mismatching_words": {"store from 0": 5}}],
              "failed_sources": [[], [0]], "rows": [vars(r) for r in rows],
              "table": multi.format_table(rows), "crossover": {"oneshot": 48,
                                                               "oneshot_residual": None},
              "path_table": [[47, "oneshot"], [192, "nccl"]], "rank_errors": []}
    found = multi.problems(report)
    assert found == ["GPU 1 cannot access GPU 0 as a peer",
                     "rank 1: IPC store from 0: 5 mismatching words",
                     "rank 1: one-shot timed out waiting for rank(s) [0]"]
    text = multi.format_report(report)
    assert "NCCL faster from 48 rows" in text and "NCCL never faster" in text
    assert "PROBLEMS:" in text and "GPU0\tGPU1" in text
    json.dumps(report)                                  # the CLI writes it as JSON
    report["shares_gpu"] = True                         # one GPU: peer access is moot
    assert "GPU 1 cannot access GPU 0 as a peer" not in multi.problems(report)


# ---- kernels.build --only -----------------------------------------------------------------------

def test_build_only_resolves_families_and_protects_full_bundles(tmp_path):
    from kernels import build
    assert build.only_families(["elementwise", "kernels.allreduce"], tmp_path / "new") == (
        "kernels.elementwise", "kernels.allreduce")
    with pytest.raises(build.BuildError, match="no such kernel family"):
        build.only_families(["allreduse"], tmp_path / "new")
    full = tmp_path / "full"
    full.mkdir()
    (full / "manifest.json").write_text(json.dumps({"kernels": {
        "a": {"family": "kernels.allreduce"}, "n": {"family": "kernels.norm"}}}))
    with pytest.raises(build.BuildError, match=r"drop the kernels of \['kernels.norm'\]"):
        build.only_families(["allreduce"], full)
    assert build.only_families(["allreduce", "norm"], full) == ("kernels.norm",
                                                                "kernels.allreduce")
