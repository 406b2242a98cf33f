"""Rank program of the multi-GPU check (collectives/multi.py): IPC smoke test, all-reduce cases.

`tp_rank(ctx, bundle_dir, plan, seed)` runs in one spawned process per rank (launcher.run_ranks).
Rank s's all-reduce input for case k comes from `checks.draw_input(seed, k, s, ...)`, so every
rank rebuilds every input and checks its own output with NumPy; outputs are poisoned (bf16 NaN)
before each check. Returns plain data: the smoke report and one record per (variant, rows).
"""
from __future__ import annotations

import hashlib

import numpy as np

from collectives import checks
from collectives.multi import WIDTH, Plan, nccl_sum_report
from kernels import allreduce_ref as ref
from kernels.common_ref import BF16, to_bf16

SMOKE_BYTES = 4 << 20
_GOLDEN = np.uint32(2654435761)           # Knuth's multiplicative hash: every word differs


def _key(seed: int, owner: int, phase: int) -> int:
    return int(np.random.default_rng((seed, owner, phase)).integers(1, 2**32, dtype=np.uint64))


def _pattern(cp, key: int, start: int, stop: int, out=None):
    """uint32 words start..stop of the pattern named by `key`, computed on the device; with
    `out` (a peer's mapping included) the kernel stores them there itself (SM stores)."""
    return cp.bitwise_xor(cp.arange(start, stop, dtype=cp.uint32) * _GOLDEN, np.uint32(key),
                          out=out)


def _words(cp, ptr: int, nbytes: int, device: int, owner):
    """A CuPy uint32 view of `ptr` (a peer's IPC mapping included): CuPy is told the current
    device so it launches there; the kernel then loads or stores through the mapping."""
    mem = cp.cuda.UnownedMemory(ptr, nbytes, owner, device_id=device)
    return cp.ndarray((nbytes // 4,), cp.uint32, cp.cuda.MemoryPointer(mem, 0))


def ipc_smoke(ctx, seed: int, nbytes: int = SMOKE_BYTES) -> dict:
    """Peer reads (SM loads and a copy-engine copy) of every peer's buffer, then peer stores
    into every peer's buffer checked by its owner: mismatching words per (source, check)."""
    import cupy as cp

    from collectives.ipc import PeerBuffers
    from executor.cuda import check, driver

    cu, me, world = driver(), ctx.rank, ctx.world
    words, part = nbytes // 4, nbytes // 4 // ctx.world
    bad: dict[str, int] = {}
    with PeerBuffers(me, world, nbytes, ctx.exchange) as peers:
        views = [_words(cp, p, nbytes, ctx.device, peers) for p in peers.ptrs]
        _pattern(cp, _key(seed, me, 0), 0, words, out=views[me])
        cp.cuda.Device().synchronize()
        ctx.barrier()                                  # every buffer holds its owner's pattern
        for src in range(world):
            if src == me:
                continue
            want = _pattern(cp, _key(seed, src, 0), 0, words)
            bad[f"load from {src}"] = int(cp.count_nonzero(views[src] != want))
            host = np.empty(words, np.uint32)
            check(cu.cuMemcpyDtoH(host, peers.ptrs[src], nbytes))
            bad[f"copy from {src}"] = int(np.count_nonzero(host != cp.asnumpy(want)))
        ctx.barrier()                                  # all reads done before any remote store
        for dst in range(world):
            if dst != me:
                _pattern(cp, _key(seed, me, 1 + dst), me * part, (me + 1) * part,
                         out=views[dst][me * part:(me + 1) * part])
        cp.cuda.Device().synchronize()
        ctx.barrier()                                  # every remote store has landed
        own = views[me]
        for src in range(world):
            key = _key(seed, src, 1 + me) if src != me else _key(seed, me, 0)
            want = _pattern(cp, key, src * part, (src + 1) * part)
            bad[f"{'store from' if src != me else 'untouched'} {src}"] = int(
                cp.count_nonzero(own[src * part:(src + 1) * part] != want))
        cp.cuda.Device().synchronize()
        ctx.barrier()                                  # nobody closes a buffer still in use
    cp.get_default_memory_pool().free_all_blocks()
    return {"bytes": nbytes, "mismatching_words": bad}


class _Rank:
    """Device, bundle, stream, buffers, the one-shot all-reduce and (optionally) NCCL."""

    def __init__(self, ctx, dev, bundle_dir: str, plan: Plan):
        from collectives.nccl import NcclComm
        from collectives.oneshot import OneShotAllReduce
        from executor.runtime import Arena, Bundle

        self.ctx, self.plan, self.dev = ctx, plan, dev
        self.bundle = Bundle.load(self.dev, bundle_dir)
        self.stream = self.dev.stream()
        nbytes = max(plan.rows) * WIDTH * 2
        self.arena = Arena(self.dev, [(n, nbytes, f"bf16 [{max(plan.rows)}, {WIDTH}]")
                                      for n in ("inp", "res", "out", "sum")])
        self.ar = OneShotAllReduce(self.bundle, ctx.rank, ctx.world, WIDTH, ctx.exchange,
                                   timeout_ms=plan.timeout_ms)
        self.nccl = None
        if plan.nccl:
            uid = ctx.exchange(NcclComm.unique_id() if ctx.rank == 0 else b"")[0]
            self.nccl = NcclComm.from_unique_id(uid, ctx.rank, ctx.world)
        self.add = self.bundle.kernel(f"residual_add_bf16_bf16_d{WIDTH}")

    def put(self, name: str, x: np.ndarray) -> None:
        from executor.cuda import check, driver
        check(driver().cuMemcpyHtoD(self.arena.ptr(name), np.ascontiguousarray(x), x.nbytes))
        check(driver().cuCtxSynchronize())     # pageable copy on the legacy stream: wait for it

    def poison(self, name: str) -> None:
        from executor.cuda import check, driver
        check(driver().cuMemsetD16(self.arena.ptr(name), checks.POISON,
                                   self.arena.nbytes(name) // 2))
        check(driver().cuCtxSynchronize())

    def get(self, name: str, rows: int) -> np.ndarray:
        from executor.cuda import check, driver
        out = np.empty((rows, WIDTH), BF16)
        check(driver().cuMemcpyDtoH(out, self.arena.ptr(name), out.nbytes))
        return out

    def call(self, variant: str, rows: int):
        """The launches of one all-reduce call of `variant` (capturable)."""
        from executor.launch import LaunchSpec
        from kernels import elementwise_ref as er

        p = self.arena.ptr
        if variant.startswith("oneshot"):
            res = p("res") if variant == "oneshot_residual" else None
            spec = self.ar.launch_spec(rows, p("inp"), p("out"), res)
            return lambda: spec.launch(self.stream)
        count, handle = rows * WIDTH, self.stream.handle
        if variant == "nccl":
            return lambda: self.nccl.all_reduce(p("inp"), p("out"), count, "bf16", handle)
        add = LaunchSpec(self.add, er.make_spec(WIDTH, "bf16").grid(rows),
                         (p("sum"), p("res"), p("out"), rows))

        def nccl_then_add():
            self.nccl.all_reduce(p("inp"), p("sum"), count, "bf16", handle)
            add.launch(self.stream)
        return nccl_then_add

    def verify(self, variant: str, rows: int, inputs, residual) -> dict:
        """This rank's output of the last call against NumPy (see the module docstrings)."""
        got = self.get("out", rows)
        if variant == "oneshot":
            report = checks.compare(got, ref.allreduce_ref(inputs))
        elif variant == "oneshot_residual":
            report = checks.compare(got, ref.allreduce_residual_ref(inputs, residual))
        elif variant == "nccl":
            report = nccl_sum_report(got, inputs, self.ctx.world)
        else:
            total = self.get("sum", rows)
            report = nccl_sum_report(total, inputs, self.ctx.world)
            exact = checks.compare(got, to_bf16(total.astype(np.float32)
                                                + residual.astype(np.float32)))
            report["mismatches"] += exact["mismatches"]
            report["add_first"] = exact.get("first")
        report["digest"] = hashlib.sha256(got.tobytes()).hexdigest()[:16]
        return report

    def close(self) -> None:
        if self.nccl is not None:
            self.nccl.close()
        self.ar.close()
        self.arena.close()
        self.bundle.close()


def _graph_us(r: _Rank, call, timer) -> float:
    """Per-call median of a graph of plan.calls_per_graph calls, replayed plan.replays times."""
    from executor.graphs import Graph

    n = r.plan.calls_per_graph
    with Graph.capture(r.stream) as g:
        for _ in range(n):
            call()
    try:
        r.ctx.barrier()                     # every rank has captured: replays start together
        return timer.median_us(lambda: g.launch(r.stream), reps=r.plan.replays, warmup=2) / n
    finally:
        g.close()


def allreduce_cases(r: _Rank, seed: int) -> list[dict]:
    """Every (rows, variant) of the plan: eager call checked; timed graph, output checked."""
    from executor.timing import EventTimer

    timer = EventTimer(r.stream, max_reps=r.plan.replays) if r.plan.timing else None
    results = []
    try:
        for case, rows in enumerate(r.plan.rows):
            inputs = [checks.draw_input(seed, case, s, rows, WIDTH) for s in range(r.ctx.world)]
            residual = checks.draw_residual(seed, case, rows, WIDTH)
            r.put("inp", inputs[r.ctx.rank])
            r.put("res", residual)
            for variant in r.plan.variants:
                call = r.call(variant, rows)
                r.poison("out")
                r.poison("sum")
                call()
                r.stream.synchronize()
                eager = r.verify(variant, rows, inputs, residual)
                record = {"variant": variant, "rows": rows, "us": None, "checks": [eager],
                          "digest": eager["digest"]}
                if timer is not None:
                    r.poison("out")
                    r.poison("sum")
                    record["us"] = _graph_us(r, call, timer)
                    record["checks"].append(r.verify(variant, rows, inputs, residual))
                results.append(record)
        r.ar.raise_if_failed()
        return results
    finally:
        if timer is not None:
            timer.close()


def tp_rank(ctx, bundle_dir: str, plan: Plan, seed: int) -> dict:
    """One rank of the multi-GPU check: IPC smoke test, then every all-reduce case."""
    import cupy as cp

    from executor.runtime import Device

    dev = Device(ctx.device)                # primary context current before CuPy touches it
    try:
        cp.cuda.Device(ctx.device).use()
        smoke = ipc_smoke(ctx, seed)
        r = _Rank(ctx, dev, bundle_dir, plan)
        try:
            return {"smoke": smoke, "results": allreduce_cases(r, seed),
                    "failed_sources": r.ar.failed_sources()}
        finally:
            ctx.barrier()                   # nobody frees a buffer a peer may still read
            r.close()
    finally:
        dev.close()
