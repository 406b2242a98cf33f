"""Launches of the W8A16 dense linears, the grouped wo_a and the lm_head from device addresses.

The step wiring, the benchmarks (executor/bench_dense.py) and the CPU emulator tests build these
kernels' LaunchSpecs here, from pointers into any arena (device `Arena` or `HostArena`):

    spec = dense_spec(bundle, "wo_b", rows, epilogue="f32")      # r8 kernel at R <= 8, else r32
    launch = dense_launch(bundle, spec, ptrs, rows)               # ptrs: buffer name -> address

Buffers of a dense / wo_a launch (DenseSpec s, G = s.groups; `dense_requests` sizes them):
  read   x          bf16 [rows, G*K]        (row stride G*K, packed)
  read   weight     e4m3 [G, N, K]          (checkpoint layout)
  read   scales     ue8m0 u8 [G, N/32, K/32] (bytes <= 134)
  read   residual   bf16 [rows, G*N]        epilogue "residual" only; may be `out` itself
                    f32 [rows, G*N]         epilogue "add_f32" (the routed sum); not `out`
  write  out        bf16 [rows, G*N] (f32 for epilogue "f32"; [rows, N/2] for "swiglu", whose
                    weight rows are dense_ref.interleave_gate_up'd); rows >= `rows` untouched
  scratch workspace f32, s.workspace_bytes() (split-K partials; stream: shared-tile partials)
  scratch counters  u32, s.counters_bytes(): zero when bound, left zero by every launch
Buffers of an lm_head launch (LmHeadSpec h):
  read   x          bf16 [rows, D];  weight bf16 [V_l, D] (this rank's vocab rows)
  write  out        argmax: int32 [rows, 2] (f32 bits of the max, index + vocab_offset);
                    logits: f32 [rows, V_l]
  scratch keys      u64 [MAX_ROWS], counters u32 [max_passes]: argmax only, zero when bound,
                    left zero by every launch
A pointer the kernel does not read (residual, workspace, counters, keys when the spec does not use
them) may be left out of `ptrs`: the kernel is handed `x` instead, as the ABI allows.
"""
from __future__ import annotations

from collections.abc import Mapping

from executor.launch import LaunchSpec
from kernels import dense_qgmma_ref as qr
from kernels import dense_ref as dr
from kernels import lm_head_ref as lr

ROW_TILES_SMALL, ROW_TILES_LARGE = 1, 4      # 8 rows per pass at R <= 8 (measured), 32 above


def row_tiles_for(rows: int) -> int:
    """Rows per pass of the kernel the step uses at `rows` (8 up to R = 8, 32 above)."""
    return ROW_TILES_SMALL if rows <= dr.ROW_TILE else ROW_TILES_LARGE


def _record_spec(bundle, name: str) -> dict:
    return bundle.manifest.kernels[name].spec


def _one(matches: list[str], what: str) -> str:
    if len(matches) != 1:
        raise LookupError(f"bundle has {len(matches)} kernels for {what} ({matches}); "
                          f"expected exactly one")
    return matches[0]


# ---- dense W8A16 and grouped wo_a ---------------------------------------------------------------

def dense_spec(bundle, label: str, rows: int, epilogue: str = "bf16",
               prefix: str = "dense_w8a16") -> dr.DenseSpec:
    """The bundle's kernel for layer `label` (dense_ref.dense_shapes) at `rows` rows: the
    plain-named one (variant dense_ref.R8_VARIANT at R <= 8); the R <= 8 candidates beside it
    carry a variant tag after the epilogue (`_mma`, `_s`, `_sxt`) and are never picked."""
    tail = f"_r{dr.ROW_TILE * row_tiles_for(rows)}_{epilogue}"
    head = f"{prefix}_{label}_n"
    name = _one([n for n in bundle.names() if n.startswith(head) and n.endswith(tail)],
                f"{head}*{tail}")
    return dr.DenseSpec.from_dict(_record_spec(bundle, name))


def qgmma_spec(bundle, label: str) -> qr.QgSpec:
    """The bundle's QGMMA kernel of `label` (kernels.dense_qgmma, variant stream_qg, tag `_sqg`;
    R <= 8, bf16 epilogue): a QgSpec, launched by dense_launch (the dense family's ABI)."""
    head, tail = f"dense_w8a16_{label}_n", f"_r{dr.ROW_TILE}_bf16_{qr.TAGS[qr.VARIANT]}"
    name = _one([n for n in bundle.names() if n.startswith(head) and n.endswith(tail)],
                f"{head}*{tail}")
    return qr.QgSpec.from_dict(_record_spec(bundle, name))


def wo_a_spec(bundle, rows: int) -> dr.DenseSpec:
    """The grouped wo_a kernel at `rows` rows (kernels/wo_a_ref.py names it)."""
    return dense_spec(bundle, "grouped", rows, prefix="wo_a_fp8")


def dense_uses(spec: dr.DenseSpec) -> tuple[str, ...]:
    """The buffers this spec's kernel touches (x, weight, scales, out always)."""
    used = ["x", "weight", "scales", "out"]
    if spec.epilogue in ("residual", "add_f32"):
        used.append("residual")
    if spec.workspace_bytes():
        used.append("workspace")
    if spec.counters_bytes():
        used.append("counters")
    return tuple(used)


def dense_requests(spec: dr.DenseSpec, max_rows: int) -> list[tuple[str, int, str]]:
    """(name, nbytes, comment) of every buffer one launch of `spec` needs, for up to max_rows."""
    g, n, k = spec.groups, spec.n, spec.k
    out_bytes = 4 if spec.out_dtype == "f32" else 2
    res_bytes, w = (4, "f32") if spec.epilogue == "add_f32" else (2, "bf16")
    reqs = {"x": (max_rows * g * k * 2, f"bf16 [{max_rows}, {g * k}]"),
            "weight": (g * n * k, f"e4m3 [{g}, {n}, {k}]"),
            "scales": (g * (n // dr.FP8_BLOCK) * (k // dr.FP8_BLOCK),
                       f"ue8m0 [{g}, {n // dr.FP8_BLOCK}, {k // dr.FP8_BLOCK}]"),
            "residual": (max_rows * g * n * res_bytes, f"{w} [{max_rows}, {g * n}]"),
            "out": (max_rows * spec.out_width * out_bytes,
                    f"{spec.out_dtype} [{max_rows}, {spec.out_width}]"),
            "workspace": (spec.workspace_bytes(), "f32 scratch (split-K partials)"),
            "counters": (spec.counters_bytes(), "u32 scratch, zero when bound")}
    return [(name, *reqs[name]) for name in dense_uses(spec)]


def _args(kernel, ptrs: Mapping[str, int], used: tuple[str, ...], scalars: dict) -> tuple:
    """The kernel's arguments in its manifest ABI order: pointers by buffer name, then scalars."""
    args = []
    for name, ptype in kernel.params:
        if ptype != "u64":
            args.append(scalars[name])
        elif name in ptrs:
            args.append(ptrs[name])
        elif name in used:
            raise KeyError(f"{kernel.name}: no pointer for buffer {name!r} (it needs "
                           f"{', '.join(used)})")
        else:
            args.append(ptrs["x"])                # never dereferenced by this kernel
    return tuple(args)


def dense_launch(bundle, spec: dr.DenseSpec, ptrs: Mapping[str, int], rows: int,
                 pdl: bool = True) -> LaunchSpec:
    """One launch of a dense / wo_a kernel over the buffers at `ptrs` (module docstring)."""
    kernel = bundle.kernel(spec.name)
    args = _args(kernel, ptrs, dense_uses(spec), {"rows": rows})
    return LaunchSpec(kernel, spec.grid(rows), args, pdl=pdl)


# ---- lm_head ------------------------------------------------------------------------------------

def lm_head_spec(bundle, mode: str, rows: int) -> lr.LmHeadSpec:
    """The bundle's lm_head kernel ("argmax" or "logits") at `rows` rows."""
    tail = f"_r{lr.ROW_TILE * row_tiles_for(rows)}_{mode}"
    name = _one([n for n in bundle.names()
                         if n.startswith("lm_head_bf16_") and n.endswith(tail)],
                f"lm_head_bf16_*{tail}")
    return lr.spec_from_dict(_record_spec(bundle, name))


def lm_head_uses(spec: lr.LmHeadSpec) -> tuple[str, ...]:
    return ("x", "weight", "out") + (("keys", "counters") if spec.mode == "argmax" else ())


def lm_head_requests(spec: lr.LmHeadSpec, max_rows: int) -> list[tuple[str, int, str]]:
    """(name, nbytes, comment) of every buffer one launch of `spec` needs, for up to max_rows."""
    v, d = spec.vocab, spec.hidden
    out = ((max_rows * 8, f"int32 [{max_rows}, 2] (value bits, index)") if spec.mode == "argmax"
           else (max_rows * v * 4, f"f32 [{max_rows}, {v}]"))
    reqs = {"x": (max_rows * d * 2, f"bf16 [{max_rows}, {d}]"),
            "weight": (v * d * 2, f"bf16 [{v}, {d}]"), "out": out,
            "keys": (spec.keys_bytes(), f"u64 [{lr.MAX_ROWS}] scratch, zero when bound"),
            "counters": (spec.counters_bytes(), "u32 scratch, zero when bound")}
    return [(name, *reqs[name]) for name in lm_head_uses(spec)]


def lm_head_launch(bundle, spec: lr.LmHeadSpec, ptrs: Mapping[str, int], rows: int,
                   vocab_offset: int, pdl: bool = True) -> LaunchSpec:
    """One lm_head launch; vocab_offset = rank * V_l turns local indices into token ids."""
    kernel = bundle.kernel(spec.name)
    args = _args(kernel, ptrs, lm_head_uses(spec), {"rows": rows, "vocab_offset": vocab_offset})
    return LaunchSpec(kernel, spec.grid(rows), args, pdl=pdl)
