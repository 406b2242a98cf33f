"""Pointer-level launches of the small families: residual add, RoPE and the SWA KV-record insert.

Each builder takes a kernel spec (the `kernels/<family>_ref.py` dataclass), the device addresses
of its buffers by ABI parameter name (from any arena, host or device) and the runtime scalars, and
returns the launches of one call; `*_requests` gives the arena slices those buffers need, under
the same names, so `{name: arena.ptr(name) for name, *_ in requests}` is a valid `ptrs`.

    residual add   a f32|bf16 [R, D], b bf16 [R, D]  ->  out bf16 [R, D]        (out may alias b)
    RoPE           x bf16 [R, H, hd], table f32 [P, 32, 2], positions i32 [R]
                   in place: x's last 64 dims of every head; copy: out bf16 [R, H, hd] whole
    SWA insert     kv bf16 [R, 512], weight f32 [512], table f32 [P, 32, 2], positions i32 [R],
                   slots i64 [R]  ->  cache u8 [num_slots, 584]: 584 bytes at each slot >= 0
    attn prep      qkv bf16 [R, W + 512], q_weight f32 [W], kv_weight f32 [512], table,
                   positions, slots as the insert  ->  qr bf16 [R, W] and the insert's records

No builder needs scratch. The bundle's record of each kernel must describe the spec asked for
(same width, heads, dtype...): a bundle built for another model fails here, not in the launch.
"""
from __future__ import annotations

import json
from collections.abc import Mapping

from executor.launch import LaunchSpec
from kernels import elementwise_ref, kv_publish_ref, kvrecord_ref, rope_ref
from kernels.common_ref import DTYPE_BYTES


def kernel_for(bundle, spec):
    """The bundle's kernel named `spec.name`, checked against the spec's compile-time shape."""
    kernel = bundle.kernel(spec.name)
    built = getattr(kernel, "record", kernel).spec or {}
    want = json.loads(json.dumps(spec.to_dict()))
    differ = {k: (built[k], v) for k, v in want.items() if k in built and built[k] != v}
    if differ:
        raise ValueError(f"kernel {spec.name}: the bundle's spec differs from the one asked for "
                         f"(key: (bundle, asked)): {differ}")
    return kernel


def check_ptrs(who: str, ptrs: Mapping[str, int], align: Mapping[str, int]) -> None:
    """`ptrs` holds exactly the names of `align`, each a non-null int with that alignment."""
    missing, extra = sorted(set(align) - set(ptrs)), sorted(set(ptrs) - set(align))
    if missing or extra:
        raise ValueError(f"{who}: pointers {sorted(align)} expected; missing {missing}, "
                         f"unexpected {extra}")
    for name, need in align.items():
        p = ptrs[name]
        if isinstance(p, bool) or not isinstance(p, int) or p <= 0 or p % need:
            raise ValueError(f"{who}: {name} must be a non-null {need}-byte aligned device "
                             f"pointer, got {p!r}")


# ---- residual add (kernels.elementwise) ------------------------------------------------------

def residual_add_requests(spec: elementwise_ref.ResidualAddSpec, max_rows: int) -> list[tuple]:
    shape = f"[{max_rows}, {spec.width}]"
    return [("a", max_rows * spec.width * DTYPE_BYTES[spec.a_dtype], f"{spec.a_dtype} {shape}"),
            ("b", max_rows * spec.width * 2, f"bf16 {shape}"),
            ("out", max_rows * spec.width * 2, f"bf16 {shape}")]


def residual_add_launches(bundle, spec: elementwise_ref.ResidualAddSpec, ptrs: Mapping[str, int],
                          rows: int) -> list[LaunchSpec]:
    """out[:rows] = bf16(a + b): reads a, b; writes out (may alias b, or a when a is bf16)."""
    check_ptrs(spec.name, ptrs, {"a": 16, "b": 16, "out": 16})
    return [LaunchSpec(kernel_for(bundle, spec), spec.grid(rows),
                       (ptrs["a"], ptrs["b"], ptrs["out"], rows))]


# ---- RoPE (kernels.rope) -----------------------------------------------------------------------

def rope_requests(spec: rope_ref.RopeSpec, max_rows: int, num_positions: int) -> list[tuple]:
    xshape = f"bf16 [{max_rows}, {spec.heads}, {spec.head_dim}]"
    xbytes = max_rows * spec.heads * spec.head_dim * 2
    io = [("x", xbytes, xshape)] + ([] if spec.in_place else [("out", xbytes, xshape)])
    return io + [("table", rope_ref.table_bytes(num_positions), f"f32 [{num_positions}, 32, 2]"),
                 ("positions", max_rows * 4, f"i32 [{max_rows}]")]


def rope_launches(bundle, spec: rope_ref.RopeSpec, ptrs: Mapping[str, int], rows: int,
                  num_positions: int) -> list[LaunchSpec]:
    """RoPE of rows x heads heads at positions[:rows] by the fp32 (cos, sin) table of
    num_positions rows. In place: rewrites the last 64 dims of each head of x; copy: writes all
    of out[:rows] (the 448 nope dims copied). Reads positions and their table rows."""
    io = {"x": 16} if spec.in_place else {"x": 16, "out": 16}
    check_ptrs(spec.name, ptrs, {**io, "table": 16, "positions": 4})
    if isinstance(num_positions, bool) or not isinstance(num_positions, int) or not (
            1 <= num_positions < 2**31):
        raise ValueError(f"{spec.name}: num_positions must be an int in [1, 2**31), got "
                         f"{num_positions!r}")
    return [LaunchSpec(kernel_for(bundle, spec), spec.grid(rows),
                       tuple(ptrs[k] for k in io) + (ptrs["table"], ptrs["positions"], rows,
                                                     num_positions))]


# ---- SWA insert (kernels.kv_publish) -----------------------------------------------------------

def swa_insert_requests(spec: kv_publish_ref.KvPublishSpec, max_rows: int, num_positions: int,
                        num_slots: int) -> list[tuple]:
    d, rec = spec.head_dim, kvrecord_ref.KV_RECORD_BYTES
    return [("kv", max_rows * d * 2, f"bf16 [{max_rows}, {d}]"),
            ("weight", d * 4, f"f32 [{d}]"),
            ("table", rope_ref.table_bytes(num_positions), f"f32 [{num_positions}, 32, 2]"),
            ("positions", max_rows * 4, f"i32 [{max_rows}]"),
            ("slots", max_rows * 8, f"i64 [{max_rows}] (-1: padding row)"),
            ("cache", num_slots * rec, f"u8 [{num_slots}, {rec}]")]


def swa_insert_launches(bundle, spec: kv_publish_ref.KvPublishSpec, ptrs: Mapping[str, int],
                        rows: int, num_positions: int, eps: float) -> list[LaunchSpec]:
    """Per row r < rows with slots[r] >= 0: RMSNorm(kv[r]) * weight, RoPE at positions[r], the
    584-byte record written at cache + slots[r] * 584. Reads kv, weight, table, positions,
    slots; writes only those records (padding rows, slot -1, write nothing)."""
    check_ptrs(spec.name, ptrs, {"kv": 16, "weight": 16, "table": 16, "positions": 4,
                                 "slots": 8, "cache": 8})
    return [LaunchSpec(kernel_for(bundle, spec), spec.grid(rows),
                       (ptrs["kv"], ptrs["weight"], ptrs["table"], ptrs["positions"],
                        ptrs["slots"], ptrs["cache"], rows, num_positions, float(eps)))]


# ---- attn prep: q_norm | kv_norm + RoPE + SWA insert (kernels.kv_publish) ------------------------

def attn_prep_requests(spec: kv_publish_ref.AttnPrepSpec, max_rows: int, num_positions: int,
                       num_slots: int) -> list[tuple]:
    w, d, rec = spec.q_width, spec.head_dim, kvrecord_ref.KV_RECORD_BYTES
    return [("qkv", max_rows * spec.row_stride * 2, f"bf16 [{max_rows}, {w + d}]"),
            ("q_weight", w * 4, f"f32 [{w}]"), ("kv_weight", d * 4, f"f32 [{d}]"),
            ("table", rope_ref.table_bytes(num_positions), f"f32 [{num_positions}, 32, 2]"),
            ("positions", max_rows * 4, f"i32 [{max_rows}]"),
            ("slots", max_rows * 8, f"i64 [{max_rows}] (-1: padding row)"),
            ("qr", max_rows * w * 2, f"bf16 [{max_rows}, {w}]"),
            ("cache", num_slots * rec, f"u8 [{num_slots}, {rec}]")]


def attn_prep_launches(bundle, spec: kv_publish_ref.AttnPrepSpec, ptrs: Mapping[str, int],
                       rows: int, num_positions: int, eps: float) -> list[LaunchSpec]:
    """One launch for rows r < rows: qr[r] = RMSNorm(qkv[r, :W]) * q_weight, and for slots[r] >= 0
    the SWA record of qkv[r, W:] (kv_norm, RoPE at positions[r]) at cache + slots[r] * 584.
    Writes qr[:rows] and those records only; qr must not overlap qkv."""
    check_ptrs(spec.name, ptrs, {"qkv": 16, "q_weight": 16, "kv_weight": 16, "table": 16,
                                 "positions": 4, "slots": 8, "qr": 16, "cache": 8})
    if isinstance(num_positions, bool) or not isinstance(num_positions, int) or not (
            1 <= num_positions < 2**31):
        raise ValueError(f"{spec.name}: num_positions must be an int in [1, 2**31), got "
                         f"{num_positions!r}")
    return [LaunchSpec(kernel_for(bundle, spec), spec.grid(rows),
                       tuple(ptrs[name] for name, kind in spec.params if kind == "u64")
                       + (rows, num_positions, float(eps)))]
