"""Pointer-level launches of the one-shot all-reduce and pick, and a rank's state on host memory.

`oneshot_launches` is what `collectives.oneshot.OneShotAllReduce.launch_spec` builds (it calls
it), from addresses alone; `pick_launches` the cross-rank greedy pick on the same state. Per rank
the all-reduce touches:

    inp       bf16 [rows, width]   read (its lanes are pushed, -0.0 sent as +0.0)
    residual  bf16 [rows, width]   read (residual epilogue only)
    out       bf16 [rows, width]   written; may alias inp or residual
    peers     u64 [world]          read: every rank's receive buffer, peers[rank] its own
    control   u32 [4]              generation, CTA arrivals, failed: read, the last CTA flips the
                                   generation and zeroes the arrivals
    status    u32 [world]          written only on a timeout (1 for the silent rank)
    + every rank's receive buffer (2 generations x world slots x max_rows x width bf16,
      -0.0 filled at set-up): this rank's slot [gen][rank] of each written; its own slots
      [gen][0..world) read and reset to -0.0, rows x width lanes of each.

On the GPU, peers + control share one 256-byte allocation (`STATE_BYTES`, control at
`CONTROL_OFFSET`), status is pinned host memory and the buffers are IPC-shared; `rank_requests` +
`init_host_ranks` lay the same state out in host arenas of one AddressSpace, for the emulator.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from executor.launch import LaunchSpec
from executor.launches.small import check_ptrs, kernel_for
from kernels import allreduce_ref as ref

STATE_BYTES = 256                       # peer table (<= 8 x u64) + control (4 x u32)
CONTROL_OFFSET = 128


def oneshot_launches(bundle, spec: ref.OneShotSpec, ptrs: Mapping[str, int], rank: int, rows: int,
                     timeout_us: int) -> list[LaunchSpec]:
    """The launch of one all-reduce call of `rows` rows on rank `rank` (ptrs: inp, out[,
    residual], peers, control, status). Every rank must make the same sequence of calls."""
    io = ("inp", "out") if spec.epilogue == "none" else ("inp", "residual", "out")
    check_ptrs(spec.name, ptrs, {**dict.fromkeys(io, 16), "peers": 8, "control": 4,
                                 "status": 4})
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < spec.world:
        raise ValueError(f"{spec.name}: rank {rank!r} outside 0..{spec.world - 1}")
    return [LaunchSpec(kernel_for(bundle, spec), spec.grid(rows),
                       tuple(ptrs[k] for k in io) + (ptrs["peers"], ptrs["control"],
                                                     ptrs["status"], rank, rows, timeout_us))]


def pick_launches(bundle, spec: ref.PickSpec, ptrs: Mapping[str, int], rank: int, rows: int,
                  timeout_us: int) -> list[LaunchSpec]:
    """The cross-rank greedy pick of `rows` rows on rank `rank`, on the all-reduce's state (ptrs:
    pairs, tokens, peers, control, status). Reads pairs int32 [rows, 2] (the lm_head argmax's
    f32 bits and global index per row); writes tokens int64 [rows], the same on every rank;
    pushes one u64 key per row into slot [gen][rank] of every receive buffer, resets its own."""
    check_ptrs(spec.name, ptrs, {"pairs": 8, "tokens": 8, "peers": 8, "control": 4,
                                 "status": 4})
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < spec.world:
        raise ValueError(f"{spec.name}: rank {rank!r} outside 0..{spec.world - 1}")
    return [LaunchSpec(kernel_for(bundle, spec), spec.grid(rows),
                       (ptrs["pairs"], ptrs["tokens"], ptrs["peers"], ptrs["control"],
                        ptrs["status"], rank, rows, timeout_us))]


def gather_launches(bundle, spec: ref.GatherSpec, ptrs: Mapping[str, int], rank: int, rows: int,
                    timeout_us: int) -> list[LaunchSpec]:
    """The all-gather of `rows` rows on rank `rank`, on the all-reduce's state (ptrs: inp,
    out, peers, control, status): inp bf16 [rows, C] -> out bf16 [rows, world * C], the same on
    every rank."""
    check_ptrs(spec.name, ptrs, {"inp": 16, "out": 16, "peers": 8, "control": 4, "status": 4})
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < spec.world:
        raise ValueError(f"{spec.name}: rank {rank!r} outside 0..{spec.world - 1}")
    return [LaunchSpec(kernel_for(bundle, spec), spec.grid(rows),
                       (ptrs["inp"], ptrs["out"], ptrs["peers"], ptrs["control"],
                        ptrs["status"], rank, rows, timeout_us))]


def rank_requests(spec: ref.OneShotSpec) -> list[tuple]:
    """The arena slices of one rank's all-reduce (and pick) state, for the emulator: on the GPU
    OneShotAllReduce allocates them (IPC buffer, 256 device bytes, pinned status)."""
    w = spec.world
    return [("allreduce.buffer", spec.buffer_bytes,
             f"bf16 [2, {w}, {spec.max_rows}, {spec.width}] receive slots, -0.0 filled"),
            ("allreduce.state", STATE_BYTES, f"u64 peers[{w}], u32 control[4] at {CONTROL_OFFSET}"),
            ("allreduce.status", 4 * w, f"u32 [{w}] timed-out sources")]


def init_host_ranks(arenas: Sequence, spec: ref.OneShotSpec) -> list[dict[str, int]]:
    """Set up the state of `world` ranks, one HostArena each (holding `rank_requests` slices):
    receive buffers -0.0, peer tables in rank order, control and status zero. Returns each
    rank's {peers, control, status} pointers for `oneshot_launches`."""
    if len(arenas) != spec.world:
        raise ValueError(f"{spec.name}: {len(arenas)} rank arenas for world {spec.world}")
    buffers = [a.ptr("allreduce.buffer") for a in arenas]
    out = []
    for arena in arenas:
        arena.view("allreduce.buffer", np.uint16)[...] = ref.SENTINEL_BITS
        arena.fill("allreduce.state", 0)
        arena.fill("allreduce.status", 0)
        arena.upload("allreduce.state", np.array(buffers, np.uint64))
        out.append({"peers": arena.ptr("allreduce.state"),
                    "control": arena.ptr("allreduce.state") + CONTROL_OFFSET,
                    "status": arena.ptr("allreduce.status")})
    return out
