"""Launch lists run on a CPU: each kernel family's NumPy reference applied to the memory a launch
names, through the kernel's exact ABI.

    space = AddressSpace(); arena = HostArena(space, requests); bundle = ManifestBundle(dir)
    specs = [LaunchSpec(bundle.kernel(name), grid, args), ...]   # the GPU code path, unchanged
    run(specs, space)                                           # every launch, in order

An emulator per family (`executor/emulate/<family>.py`, `emulate(record, grid, args, space)`;
`args` by parameter name from the manifest) reads the launch's inputs from the address space,
computes what the kernel computes (its `kernels/<family>_ref` reference, never a second copy of
the math), and writes exactly the bytes the kernel writes, no more: an emulated launch list is a
CPU proof that the launches are wired right (which buffer feeds which, sizes, row counts, argument
order). It proves nothing about the kernels themselves: their GPU tests do that.
"""
from __future__ import annotations

import importlib
from collections.abc import Iterable

# family (manifest "family") -> "module:function"
EMULATORS = {
    "kernels.norm": "executor.emulate.norm:emulate",
    "kernels.elementwise": "executor.emulate.elementwise:emulate",
    "kernels.rope": "executor.emulate.rope:emulate",
    "kernels.allreduce": "executor.emulate.allreduce:emulate",
    "kernels.moe": "executor.emulate.moe:emulate",
    "kernels.dense": "executor.emulate.dense:emulate",
    "kernels.dense_qnorm": "executor.emulate.dense_qnorm:emulate",
    "kernels.dense_qgmma": "executor.emulate.dense_qgmma:emulate",
    "kernels.wo_a": "executor.emulate.wo_a:emulate",
    "kernels.lm_head": "executor.emulate.lm_head:emulate",
    "kernels.indexer": "executor.emulate.indexer:emulate",
    "kernels.kv_publish": "executor.emulate.kv_publish:emulate",
    "kernels.compressor": "executor.emulate.compressor:emulate",
    "kernels.sparse_mqa": "executor.emulate.sparse_mqa:emulate",
    "kernels.mhc": "executor.emulate.mhc:emulate",
    "kernels.router": "executor.emulate.router:emulate",
    "kernels.embed": "executor.emulate.embed:emulate",
    "kernels.engram": "executor.emulate.engram:emulate",
    "kernels.rows": "executor.emulate.rows:emulate",
    "kernels.swiglu": "executor.emulate.swiglu:emulate",
    "kernels.dspark": "executor.emulate.dspark:emulate",
    "kernels.linear_bf16": "executor.emulate.linear_bf16:emulate",
    "kernels.split_norm": "executor.emulate.split_norm:emulate",
}


class NoEmulator(NotImplementedError):
    """A launch of a family (or kernel kind) that has no CPU emulator yet."""


def record_of(kernel):
    """The KernelRecord of a loaded Kernel or of a record itself."""
    return getattr(kernel, "record", kernel)


def emulator_for(family: str):
    target = EMULATORS.get(family)
    if target is None:
        raise NoEmulator(f"no CPU emulator for kernel family {family!r}")
    module, func = target.split(":")
    try:
        return getattr(importlib.import_module(module), func)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            raise NoEmulator(f"no CPU emulator for kernel family {family!r} ({module} is "
                             f"not written yet)") from None
        raise


def _cluster_of(spec: dict) -> tuple[int, int, int] | None:
    """The cluster a kernel's manifest spec requires (families spell it two ways), or None."""
    if spec.get("cluster"):
        return tuple(spec["cluster"])
    if spec.get("cluster_ctas"):
        return (spec["cluster_ctas"], 1, 1)
    return None


def emulate_launch(spec, space) -> None:
    """One LaunchSpec on the host address space."""
    rec = record_of(spec.kernel)
    want = _cluster_of(rec.spec or {})
    if want and spec.cluster != want:
        raise ValueError(f"kernel {rec.name!r} needs a cluster of {want}; the launch gives "
                         f"{spec.cluster} (it would trap on the GPU)")
    args = {name: value for (name, _), value in zip(rec.params, spec.args)}
    emulator_for(rec.family)(rec, spec.grid, args, space)


def run(specs: Iterable, space) -> int:
    """Every launch in order; returns how many ran."""
    count = 0
    for spec in specs:
        emulate_launch(spec, space)
        count += 1
    return count


def bind_host(space, tensors: dict, prefix: str = "") -> dict[str, int]:
    """Register a caller's host arrays (the emulator's stand-in for bound device tensors);
    returns name -> fake device address, as Binding.pointers would."""
    return {name: space.add(prefix + name, array) for name, array in tensors.items()}


def run_lockstep(plans, rows: int, space, side_last: bool = False) -> int:
    """Every rank's step, stage by stage: all ranks finish stage i before any starts stage i + 1,
    which is all an all-reduce's emulator needs to see every rank's input. Returns launches run.
    A stage of several cross-rank launches (engram.kv_allgather's row chunks) runs its ranks
    interleaved at each wait (allreduce.run_ranks), as the GPUs would.
    side_last: each side branch runs just before its join (Plan.launches), not where it forks."""
    from executor.emulate.allreduce import run_ranks  # it imports this module

    built = [plan.launches(rows, side_last) for plan in plans]
    names = [[stage.name for stage, _ in b] for b in built]
    if any(n != names[0] for n in names):
        raise ValueError("run_lockstep: the ranks' plans differ in their stages")
    count = 0
    for i in range(len(names[0])):
        count += run_ranks([b[i][1] for b in built], space)
    return count
