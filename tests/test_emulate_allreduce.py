"""Emulated one-shot all-reduce: 4 ranks in one AddressSpace, launches from oneshot_launches.

Each rank has its own HostArena with the state OneShotAllReduce allocates (receive buffer filled
with -0.0, peer table, control, status; `init_host_ranks`) and its inputs/outputs. Inputs are
drawn as the GPU test draws them (`collectives.checks.draw_input`: about 1% -0.0 lanes, the
sentinel a rank must send as +0.0), outputs poisoned 0xFFFF. Tolerance: bitwise against
`allreduce_ref` / `allreduce_residual_ref` (`checks.expected`), the GPU test's check. After the
calls every receive buffer is -0.0 again, control holds the flipped generation and zero
arrivals, status is untouched, and rows past `rows` keep their poison. The cross-rank pick runs
between two all-reduces on the same state: tokens equal `pick_ref` of the ranks' pairs exactly.
"""
import numpy as np
import pytest

from collectives import checks
from executor.emulate import run
from executor.emulate.allreduce import Deadlock, run_ranks, waiting
from executor.hostmem import AddressSpace, HostArena, ManifestBundle
from executor.launches.allreduce import (
    init_host_ranks,
    oneshot_launches,
    pick_launches,
    rank_requests,
)
from kernels import allreduce_ref as ref
from kernels.common_ref import BF16

# (rows, fused, alias): out aliases inp (plain) or the residual (fused) when alias is set
CALLS = ((1, False, False), (7, True, False), (32, False, True), (192, True, True),
         (192, False, False), (3, True, False), (5, False, False))


class Ranks:
    """world ranks of the tiny bundle's one-shot all-reduce, `calls` buffer sets each."""

    def __init__(self, bundle, calls: int):
        rec = bundle.kernel(next(n for n in bundle.names() if n.startswith("allreduce_oneshot_")))
        self.world, self.width, self.max_rows = (rec.spec[k] for k in ("world", "width",
                                                                       "max_rows"))
        self.specs = {e: ref.make_spec(self.world, self.width, e, self.max_rows)
                      for e in ("none", "residual")}
        nbytes = self.max_rows * self.width * 2
        io = [(f"{kind}{c}", nbytes) for c in range(calls) for kind in ("inp", "res", "out")]
        self.space = AddressSpace()
        self.arenas = [HostArena(self.space, rank_requests(self.specs["none"]) + io,
                                 name=f"rank{r}") for r in range(self.world)]
        self.state = init_host_ranks(self.arenas, self.specs["none"])
        self.bundle = bundle

    def stage(self, seed: int, call: int, rows: int, fused: bool, alias: bool, rank: int):
        """Upload call `call`'s input (and residual) on `rank`, poison its out; its launches."""
        arena = self.arenas[rank]
        arena.upload(f"inp{call}", checks.draw_input(seed, call, rank, rows, self.width))
        arena.fill(f"out{call}", 0xFF)
        ptrs = {"inp": arena.ptr(f"inp{call}"), "out": arena.ptr(f"out{call}"),
                **self.state[rank]}
        if fused:
            arena.upload(f"res{call}", checks.draw_residual(seed, call, rows, self.width))
            ptrs["residual"] = arena.ptr(f"res{call}")
        if alias:
            out_of = "res" if fused else "inp"
            ptrs["out"] = arena.ptr(f"{out_of}{call}")
            arena.view(f"{out_of}{call}", np.uint16)[rows * self.width:] = 0xFFFF
        spec = self.specs["residual" if fused else "none"]
        return oneshot_launches(self.bundle, spec, ptrs, rank, rows, timeout_us=10_000_000)

    def out(self, rank: int, call: int, fused: bool, alias: bool) -> np.ndarray:
        name = ("res" if fused else "inp") if alias else "out"
        return self.arenas[rank].download(f"{name}{call}", BF16, (self.max_rows, self.width))

    def control(self, rank: int) -> np.ndarray:
        return self.space.array(self.state[rank]["control"], np.uint32, ref.CONTROL_WORDS).copy()


@pytest.fixture(scope="module")
def bundle(tiny_bundle_dir):
    return ManifestBundle(tiny_bundle_dir)


def test_back_to_back_calls_on_every_rank_equal_the_reference(bundle):
    seed = int(np.random.default_rng().integers(2**32))
    ranks = Ranks(bundle, len(CALLS))
    lists = [[launch for c, (rows, fused, alias) in enumerate(CALLS)
              for launch in ranks.stage(seed, c, rows, fused, alias, r)]
             for r in range(ranks.world)]
    assert run_ranks(lists, ranks.space) == ranks.world * len(CALLS)
    assert waiting(ranks.space) == []
    for c, (rows, fused, alias) in enumerate(CALLS):
        want = checks.expected(seed, c, ranks.world, rows, ranks.width, fused)
        for r in range(ranks.world):
            got = ranks.out(r, c, fused, alias)
            report = checks.compare(got[:rows], want)
            assert report["mismatches"] == 0 and report["unwritten"] == 0, (seed, c, r, report)
            assert np.all(got[rows:].view(np.uint16) == 0xFFFF), f"call {c} rank {r}: past rows"
    for r, arena in enumerate(ranks.arenas):
        assert np.all(arena.view("allreduce.buffer", np.uint16) == ref.SENTINEL_BITS), f"rank {r}"
        assert ranks.control(r).tolist() == [len(CALLS) % 2, 0, 0, 0]
        assert np.all(arena.view("allreduce.status", np.uint32) == 0)


def test_a_rank_waits_until_the_last_rank_pushed(bundle):
    """Ranks run one after another (as emulate.run_lockstep does): the outputs appear, on every
    rank at once, when the last rank's launch pushes its input."""
    seed = int(np.random.default_rng().integers(2**32))
    ranks = Ranks(bundle, 1)
    rows = 9
    lists = [ranks.stage(seed, 0, rows, True, False, r) for r in range(ranks.world)]
    for r in range(ranks.world):
        run(lists[r], ranks.space)
        done = r == ranks.world - 1
        assert (waiting(ranks.space) == []) == done
        for q in range(ranks.world):
            got = ranks.out(q, 0, True, False)[:rows].view(np.uint16)
            assert np.all(got != 0xFFFF) if done else np.all(got == 0xFFFF), (r, q)
    want = checks.expected(seed, 0, ranks.world, rows, ranks.width, True)
    for q in range(ranks.world):
        assert checks.compare(ranks.out(q, 0, True, False)[:rows], want)["mismatches"] == 0


def test_a_missing_call_or_other_rows_deadlock_with_the_waiting_ranks_named(bundle):
    seed = int(np.random.default_rng().integers(2**32))
    ranks = Ranks(bundle, 2)
    lists = [ranks.stage(seed, 0, 4, False, False, r) for r in range(ranks.world)]
    lists[3] = []
    with pytest.raises(Deadlock, match=r"rank\(s\) \[0, 1, 2\].*waits for rank\(s\) \[3\]"):
        run_ranks(lists, ranks.space)

    ranks = Ranks(bundle, 1)
    lists = [ranks.stage(seed, 0, 5 if r == 2 else 7, False, False, r)
             for r in range(ranks.world)]
    with pytest.raises(Deadlock, match=r"rows=7.*waits for rank\(s\) \[2\]"):
        run_ranks(lists, ranks.space)


def test_a_second_call_while_the_first_waits_is_refused(bundle):
    ranks = Ranks(bundle, 2)
    launches = ranks.stage(1, 0, 2, False, False, 0) + ranks.stage(1, 1, 2, False, False, 0)
    with pytest.raises(Deadlock, match="previous all-reduce still waits"):
        run(launches, ranks.space)


def test_builder_follows_the_abi_and_rejects_bad_arguments(bundle):
    ranks = Ranks(bundle, 1)
    spec, a = ranks.specs["residual"], ranks.arenas[1]
    ptrs = {"inp": a.ptr("inp0"), "residual": a.ptr("res0"), "out": a.ptr("out0"),
            **ranks.state[1]}
    launch, = oneshot_launches(bundle, spec, ptrs, 1, 17, 5000)
    assert launch.args == (ptrs["inp"], ptrs["residual"], ptrs["out"], ptrs["peers"],
                           ptrs["control"], ptrs["status"], 1, 17, 5000)
    assert launch.grid == spec.grid(17)
    with pytest.raises(ValueError, match="missing \\['residual'\\]"):
        oneshot_launches(bundle, spec, {k: v for k, v in ptrs.items() if k != "residual"}, 1,
                         17, 5000)
    with pytest.raises(ValueError, match="inp must be a non-null 16-byte aligned"):
        oneshot_launches(bundle, spec, {**ptrs, "inp": ptrs["inp"] + 2}, 1, 17, 5000)
    with pytest.raises(ValueError, match="rank 4 outside"):
        oneshot_launches(bundle, spec, ptrs, 4, 17, 5000)
    with pytest.raises(ValueError, match="exceeds the buffer capacity"):
        oneshot_launches(bundle, spec, ptrs, 1, ranks.max_rows + 1, 5000)


# ---- the cross-rank pick, between two all-reduces on the same state ---------------------------

class WithPick:
    """The tiny manifest, plus the pick kernel's record as the build writes it (its spec's
    to_dict) while build/bundle-tiny predates the pick kernel."""

    def __init__(self, bundle, spec: ref.PickSpec):
        self.bundle, self.spec = bundle, spec

    def kernel(self, name: str):
        from pathlib import Path

        from executor.bundle import KernelRecord
        try:
            return self.bundle.kernel(name)
        except KeyError:
            if name != self.spec.name:
                raise
        s = self.spec
        return KernelRecord(s.name, "kernels.allreduce", Path(f"{s.name}.cubin"), "", s.params,
                            s.block, s.smem_bytes, True, None, s.to_dict())


def _pick_pairs(rng, world: int, rows: int, vocab_per_rank: int = 40_000) -> list[np.ndarray]:
    """Per rank int32 [rows, 2] (f32 bits, global index): values from a small set (ties, ±0)
    and a few normal ones; index 32767 somewhere (~index has a 0x8000 half: only the whole u64
    key may be compared with the sentinel)."""
    values = rng.choice(np.float32([-3.5, -0.0, 0.0, 1.25, 7.0, -1e-30]), (world, rows))
    values[:, : rows // 2] = rng.standard_normal((world, rows // 2)).astype(np.float32)
    index = np.stack([rng.integers(r * vocab_per_rank, (r + 1) * vocab_per_rank, rows)
                      for r in range(world)])
    index[0, rng.integers(0, rows)] = 32767
    return [np.stack([values[r].view(np.int32), index[r].astype(np.int32)], axis=1)
            for r in range(world)]


@pytest.mark.parametrize("rows", (1, 7, 192))
def test_pick_between_all_reduces_equals_the_reference(bundle, rows):
    rng = np.random.default_rng()
    seed = int(rng.integers(2**32))
    ranks = Ranks(bundle, 2)
    pick = ref.make_pick_spec(ranks.world, ranks.width, ranks.max_rows)
    ranks.bundle = WithPick(bundle, pick)
    pairs = _pick_pairs(rng, ranks.world, rows)
    space, lists = ranks.space, []
    for r, arena in enumerate(ranks.arenas):
        pairs_ptr = space.add(f"rank{r}.pairs", pairs[r].copy())
        tokens = np.full(ranks.max_rows, -1, np.int64)
        ptrs = {"pairs": pairs_ptr, "tokens": space.add(f"rank{r}.tokens", tokens),
                **ranks.state[r]}
        lists.append(ranks.stage(seed, 0, rows, True, False, r)
                     + pick_launches(ranks.bundle, pick, ptrs, r, rows, 10_000_000)
                     + ranks.stage(seed, 1, 3, False, False, r))
    assert run_ranks(lists, space) == 3 * ranks.world
    want = ref.pick_ref(pairs)
    for r in range(ranks.world):
        tokens = space.array(lists[r][1].args[1], np.int64, ranks.max_rows)
        assert np.array_equal(tokens[:rows], want), (r, tokens[:rows], want)
        assert np.all(tokens[rows:] == -1), f"rank {r}: tokens written past {rows}"
        for c, (n, fused) in enumerate(((rows, True), (3, False))):
            got = ranks.out(r, c, fused, False)[:n]
            expect = checks.expected(seed, c, ranks.world, n, ranks.width, fused)
            assert checks.compare(got, expect)["mismatches"] == 0, (r, c)
        assert np.all(ranks.arenas[r].view("allreduce.buffer", np.uint16) == ref.SENTINEL_BITS)
        assert ranks.control(r).tolist() == [1, 0, 0, 0]
