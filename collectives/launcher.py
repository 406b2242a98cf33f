"""Spawn-based multi-process launcher for tests and benchmarks: N ranks, an exchange, timeouts.

    results = run_ranks(program, world=4, devices=[0, 0, 0, 0], args=(...,), timeout_s=120)
    # program(ctx, *args) runs in rank ctx.rank's own process (spawned: a fresh CUDA context);
    # ctx.exchange(payload) is an all-gather of bytes through the parent, the rendezvous.
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]

`program` must be importable by the children (a module-level function). Several ranks may share
one GPU: CUDA IPC works between processes of the same device (the contexts time-slice).

Failure handling, so that nothing hangs:
- a rank that raises reports its exception (type, message, traceback) as its RankResult;
- a rank that dies (killed, crashed) is seen through its process sentinel; every exchange that
  is waiting or comes later fails on the others with RankFailure naming the dead rank;
- GPU waits on a dead rank are bounded by the kernels themselves (the one-shot all-reduce's
  timeout); the whole run is bounded by `timeout_s`, after which the parent kills what is left
  and reports those ranks as timed out.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait

CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "PYTHONUNBUFFERED": "1"}


class RankFailure(RuntimeError):
    """Another rank died or failed, so a collective step of this rank cannot complete."""


@dataclass(frozen=True)
class RankResult:
    rank: int
    ok: bool
    value: object = None
    error_type: str = ""
    error: str = ""
    traceback: str = ""
    exitcode: int | None = None

    def describe(self) -> str:
        if self.ok:
            return f"rank {self.rank}: ok"
        return f"rank {self.rank}: {self.error_type}: {self.error} (exit code {self.exitcode})"


class RankContext:
    """What a rank's program gets: its rank, the world, its device ordinal, and the exchange."""

    def __init__(self, rank: int, world: int, device: int, conn, exchange_timeout_s: float):
        self.rank, self.world, self.device = rank, world, device
        self._conn = conn
        self._timeout = exchange_timeout_s

    def exchange(self, payload: bytes) -> list[bytes]:
        """All-gather: every rank's payload in rank order (a barrier too)."""
        self._conn.send(("exchange", bytes(payload)))
        if not self._conn.poll(self._timeout):
            raise RankFailure(f"rank {self.rank}: exchange got no answer within "
                              f"{self._timeout:.0f} s")
        kind, body = self._conn.recv()
        if kind != "gathered":
            raise RankFailure(f"rank {self.rank}: exchange failed: {body}")
        return body

    def barrier(self) -> None:
        self.exchange(b"")


def _rank_main(program, rank, world, device, conn, args, exchange_timeout_s):
    os.environ.update(CHILD_ENV)
    ctx = RankContext(rank, world, device, conn, exchange_timeout_s)
    try:
        value = program(ctx, *args)
        result = RankResult(rank, True, value)
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        result = RankResult(rank, False, None, type(exc).__name__, str(exc),
                            traceback.format_exc()[-4000:])
    try:
        conn.send(("result", result))
    finally:
        conn.close()


class _Parent:
    """The parent's side: relays exchanges, notices deaths, collects results."""

    def __init__(self, procs, conns):
        self.procs, self.conns = procs, conns
        self.results: dict[int, RankResult] = {}
        self.dead: dict[int, int | None] = {}
        self.pending: dict[int, bytes] = {}

    def live(self) -> list[int]:
        return [r for r in range(len(self.procs)) if r not in self.results and r not in self.dead]

    def settle_exchange(self) -> None:
        """Answer the waiting ranks: everyone's payloads once all have sent, or a failure as soon
        as a rank that has not sent can never send (it died or already finished)."""
        n = len(self.procs)
        gone = [r for r in range(n)
                if r not in self.pending and (r in self.dead or r in self.results)]
        if gone and self.pending:
            why = "; ".join(f"rank {r} died (exit code {self.dead[r]})" if r in self.dead
                            else f"rank {r} finished" for r in gone)
            for r in self.pending:
                self.conns[r].send(("failed", f"{why}: it will never join this exchange"))
            self.pending.clear()
        elif len(self.pending) == n:
            gathered = [self.pending[r] for r in range(n)]
            for r in range(n):
                self.conns[r].send(("gathered", gathered))
            self.pending.clear()

    def on_message(self, rank: int) -> bool:
        """Handle one message from `rank`; False at end of stream (the rank is gone)."""
        try:
            kind, body = self.conns[rank].recv()
        except (EOFError, OSError):
            return False                    # the sentinel reports the death
        if kind == "result":
            self.results[rank] = body
        elif kind == "exchange":
            self.pending[rank] = body
        self.settle_exchange()
        return True

    def on_exit(self, rank: int) -> None:
        proc = self.procs[rank]
        proc.join(1)
        while rank not in self.results and self.conns[rank].poll():
            if not self.on_message(rank):   # a result sent just before exit still counts
                break
        if rank not in self.results:
            self.dead[rank] = proc.exitcode
        self.settle_exchange()


def run_ranks(program, world: int, *, devices=None, args=(), timeout_s: float = 120.0,
              exchange_timeout_s: float | None = None) -> list[RankResult]:
    """Run program(ctx, *args) in `world` spawned processes; one RankResult per rank."""
    devices = list(devices) if devices is not None else list(range(world))
    if world < 1 or len(devices) != world:
        raise ValueError(f"run_ranks: world {world} needs {world} device ordinals, "
                         f"got {devices}")
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for rank in range(world):
        parent_end, child_end = ctx.Pipe()
        p = ctx.Process(target=_rank_main, name=f"hopdec-rank{rank}",
                        args=(program, rank, world, devices[rank], child_end, args,
                              exchange_timeout_s or timeout_s))
        p.start()
        child_end.close()
        procs.append(p)
        conns.append(parent_end)
    state = _Parent(procs, conns)
    deadline = time.monotonic() + timeout_s
    try:
        while state.live():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready = wait([conns[r] for r in state.live()] + [procs[r].sentinel
                                                              for r in state.live()], left)
            for r in state.live():
                if conns[r] in ready:
                    state.on_message(r)
            for r in state.live():
                if procs[r].sentinel in ready:
                    state.on_exit(r)
    finally:
        for r, p in enumerate(procs):
            if p.is_alive() and r not in state.results:
                p.kill()
            p.join(5)
            conns[r].close()
    return [_final(r, procs[r], state, timeout_s) for r in range(world)]


def _final(rank: int, proc, state: _Parent, timeout_s: float) -> RankResult:
    if rank in state.results:
        res = state.results[rank]
        return RankResult(res.rank, res.ok, res.value, res.error_type, res.error, res.traceback,
                          proc.exitcode)
    if rank in state.dead:
        return RankResult(rank, False, None, "RankDied",
                          f"rank {rank} died without a result (exit code {state.dead[rank]})",
                          exitcode=state.dead[rank])
    return RankResult(rank, False, None, "TimeoutError",
                      f"rank {rank} did not finish within {timeout_s:.0f} s (killed)",
                      exitcode=proc.exitcode)
