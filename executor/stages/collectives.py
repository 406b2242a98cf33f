"""The step's cross-rank stages: the three all-reduces and the greedy pick, on the one-shot kernels.

    head.embed_allreduce   embed.partial -> embed.out     (every rank: its vocab rows, zeros elsewhere)
    engram.heads_allgather engram.local_heads -> engram.heads  (rank r's hash columns at block r)
    engram.kv_allgather    engram.kv_local -> engram.kv        (the sharded wkv's output pieces)
    attn.allreduce         attn.partial  -> attn.out
    ffn.allreduce          ffn.partial   -> ffn.out
    tail.argmax_pick       pick          -> tokens        (the caller's bound int64 [192])

Each is one launch of `kernels.allreduce` (executor/launches/allreduce.py) on this rank's
collective state `ctx.collectives` (`collectives.oneshot.CollectiveState`: rank, world,
timeout_us, pointers {peers, control, status}): `OneShotAllReduce.state()` on GPUs (IPC-shared
buffers), the rank arenas' slices under the CPU emulator (`init_host_ranks`). Every
rank launches the same sequence of calls with the same rows, which the plan guarantees (every
rank wires the same stages). The one-shot kernel holds up to 192 rows, every bucket, and is
the path measured on four H200s (run 35: faster than graph-captured NCCL at every R of 1..192;
collectives.allreduce.DEFAULT_TABLE), so the step wires no NCCL path. TP 1 has no all-reduce kernel: wiring at tp=1 raises.
"""
from __future__ import annotations

from executor.launches.allreduce import gather_launches, oneshot_launches, pick_launches
from kernels import allreduce_ref as ref
from kernels import engram_kernel_ref as ek


def _state(ctx):
    state = ctx.collectives
    if state is None:
        raise RuntimeError(f"rank {ctx.rank}: the step's all-reduce stages need ctx.collectives "
                           f"(the rank's one-shot state); none was given")
    if ctx.tp == 1 or state.world != ctx.tp:
        raise ValueError(f"rank {ctx.rank}: tp={ctx.tp}, collective world {state.world}: the "
                         f"one-shot kernels exist for world sizes {ref.WORLD_SIZES}")
    return state


def _allreduce(inp: str, out: str):
    def factory(ctx, layer):
        del layer
        state = _state(ctx)
        spec = ref.make_spec(state.world, ctx.cfg.hidden_size, "none", ctx.max_rows)
        ptrs = dict(state.pointers, inp=ctx.ptr(inp), out=ctx.ptr(out))

        def build(rows):
            return oneshot_launches(ctx.bundle, spec, ptrs, state.rank, rows, state.timeout_us)
        return build
    return factory


def _heads_allgather(ctx, layer):
    del layer
    state = _state(ctx)
    cols = ctx.shapes.engram_hash_cols * ctx.cfg.engram_head_dim
    spec = ref.make_gather_spec(state.world, ctx.cfg.hidden_size, cols, ctx.max_rows)
    ptrs = dict(state.pointers, inp=ctx.ptr("engram.local_heads"), out=ctx.ptr("engram.heads"))

    def build(rows):
        return gather_launches(ctx.bundle, spec, ptrs, state.rank, rows, state.timeout_us)
    return build


def kv_gather_chunks(cfg, tp: int, rows: int) -> list[tuple[int, int]]:
    """(first row, rows) of each call of engram.kv_allgather: a rank's [R, P * C] block is
    gathered as [P * R, C] rows, at most the slots' MAX_ROWS of them a call (P * C > D)."""
    chunk = ref.MAX_ROWS // ek.kv_pieces(cfg, tp)[0]
    return [(start, min(chunk, rows - start)) for start in range(0, rows, chunk)]


def _kv_allgather(ctx, layer):
    """Every rank's wkv output pieces into engram.kv, column for column the replicated output
    (allreduce_ref.gather_pieces_ref), one gather call per row chunk (kv_gather_chunks)."""
    del layer
    state = _state(ctx)
    pieces, cols = ek.kv_pieces(ctx.cfg, ctx.tp)
    spec = ref.make_gather_spec(state.world, ctx.cfg.hidden_size, cols, ref.MAX_ROWS)
    inp, out = ctx.ptr("engram.kv_local"), ctx.ptr("engram.kv")
    local_row, row = 2 * pieces * cols, 2 * pieces * cols * state.world       # bytes

    def build(rows):
        launches = []
        for start, count in kv_gather_chunks(ctx.cfg, ctx.tp, rows):
            ptrs = dict(state.pointers, inp=inp + start * local_row, out=out + start * row)
            launches += gather_launches(ctx.bundle, spec, ptrs, state.rank, pieces * count,
                                        state.timeout_us)
        return launches
    return build


def _pick(ctx, layer):
    del layer
    state = _state(ctx)
    spec = ref.make_pick_spec(state.world, ctx.cfg.hidden_size, ctx.max_rows)
    ptrs = dict(state.pointers, pairs=ctx.ptr("pick"), tokens=ctx.ptr("tokens"))

    def build(rows):
        return pick_launches(ctx.bundle, spec, ptrs, state.rank, rows, state.timeout_us)
    return build


BUILDERS = {
    "head.embed_allreduce": _allreduce("embed.partial", "embed.out"),
    "engram.heads_allgather": _heads_allgather,
    "engram.kv_allgather": _kv_allgather,
    "attn.allreduce": _allreduce("attn.partial", "attn.out"),
    "ffn.allreduce": _allreduce("ffn.partial", "ffn.out"),
    "tail.argmax_pick": _pick,
}
