"""One-GPU stand-ins for the step's cross-rank stages (the step benchmark only, never a real step).

A one-shot all-reduce spins until its peers push, so one rank alone on one GPU cannot run
`executor.stages.collectives`. This module claims the same roles with local launches of the same
shape of data movement, so the other stages of one rank run and time as in the real step:

    head.embed_allreduce   embed.partial -> embed.out   residual add (bf16 + zeros): a copy
    attn.allreduce         attn.partial  -> attn.out    (reads R x D x 2 twice, writes once; the
    ffn.allreduce          ffn.partial   -> ffn.out      one-shot reads 4 partials and writes once)
    engram.heads_allgather no launch: engram.heads keeps what it holds (R x 6144 bf16, <= 2.4 MB)
    engram.kv_allgather    no launch: engram.kv keeps what it holds (R x 25600 bf16, <= 9.8 MB;
                           the rank's wkv writes its R x 6400 into engram.kv_local)
    tail.argmax_pick       no launch: the rank's own argmax stays in `pick`, `tokens` is not written

The outputs are this rank's partials, not sums over ranks: values differ from the real step,
shapes, bytes and launches per sublayer match. `local.zeros` must stay zero (nothing writes it;
the arena is zeroed before the weights are packed). The all-reduce's own latency is measured
apart (collectives benchmark) and added to the step's time by the benchmark.
"""
from __future__ import annotations

from executor.launches.small import kernel_for, residual_add_launches
from executor.wiring import Buffer
from kernels import elementwise_ref
from kernels.common_ref import BF16

ZEROS = "local.zeros"


def buffers(cfg, tp: int, max_rows: int) -> list[Buffer]:
    del tp
    return [Buffer(ZEROS, BF16, (max_rows, cfg.hidden_size),
                   "zero operand of the local all-reduce stand-in (never written)")]


def _copy(inp: str, out: str):
    def factory(ctx, layer):
        del layer
        spec = elementwise_ref.make_spec(ctx.cfg.hidden_size, "bf16")
        kernel_for(ctx.bundle, spec)                   # in the bundle, or a clear error now
        ptrs = {"a": ctx.ptr(inp), "b": ctx.ptr(ZEROS), "out": ctx.ptr(out)}
        return lambda rows: residual_add_launches(ctx.bundle, spec, ptrs, rows)
    return factory


def _nothing(ctx, layer):
    del ctx, layer
    return lambda rows: []


BUILDERS = {
    "head.embed_allreduce": _copy("embed.partial", "embed.out"),
    "engram.heads_allgather": _nothing,
    "engram.kv_allgather": _nothing,
    "attn.allreduce": _copy("attn.partial", "attn.out"),
    "ffn.allreduce": _copy("ffn.partial", "ffn.out"),
    "tail.argmax_pick": _nothing,
}
