"""Launches of the mHC step (`mhc_pre` + its RMSNorm) and the MoE router from device addresses.

Pure functions: a bundle (anything with `kernel(name)`: a loaded `Bundle`, or a `ManifestBundle`
on a CPU), the kernel's spec, a mapping of the kernel's pointer parameters to addresses, and the
runtime scalars give validated LaunchSpecs (PDL on). Nothing is allocated or launched here.
Buffers by pointer key (R = the launch's rows, D = spec.width, S = spec.streams, m = 24; every
buffer holds at least R rows, row r at r times its row size):

  mhc_pre_launch   reads  streams bf16 [R, S, D] (X), sub_out bf16 [R, D] (the sublayer output f;
                          modes post, postonly), coeff_prev f32 [R, 24] (previous sublayer's packed
                          pre|post|comb), fn f32 [24, S·D], scale f32 [4] (s0, s1, s2, unused),
                          base f32 [24] (fn, scale, base: not in mode postonly)
                   writes streams_out bf16 [R, S, D] (X' = post·f + combᵀ·X; modes post, postonly;
                          may be `streams` itself: in place), x_out bf16 [R, D] (the collapse
                          Σ pre_prev·X'), and except in mode postonly: mixes f32 [R, 24],
                          coeff_out f32 [R, 24] (this sublayer's pre|post|comb)
                   fused norm (spec.norm_weight): also reads norm_weight [D] (that dtype) and
                          writes x_normed bf16 [R, D] (the RMSNorm of x_out; no 2nd launch)
                   scratch workspace f32 [slices, R, 32] (`mk.workspace_bytes(spec, max_rows)`;
                          the launch writes floats 0..24 of each row), counters i32 [row blocks]
                          (`mk.counter_count(max_rows)`): ZERO before the first launch; every
                          launch leaves them zero, so all mhc_pre launches of a step may share one
                          workspace and one counter array (they run one after another)
                          `_lean_poll` (spec.polled): workspace = its own exchange of tagged
                          words (`mk.workspace_bytes(spec, max_rows)`, zero before the first
                          launch, left zero), counters = its timeout flag i32 [1+] (zero; a
                          consumer that gave up sets [0], which stays set: the host reads it).
                          Never share these with the other variants (their partials would read
                          as tagged words)
  mhc_norm_launch  reads  x_out bf16 [R, D], norm_weight f32 or bf16 [D]
                   writes x_normed bf16 [R, D] (`kernels.norm` RMSNorm; not in place here)
  router_launch    reads  x bf16 [R, D], weight bf16 [E, D], bias f32 [E]
                   writes logits f32 [R, E], ids i32 [R, k] (best first), weights f32 [R, k]
                   scratch counters i32 [row blocks] (`rk.counter_count(max_rows, rows_per_cta)`),
                          `_tile8p`: then u64 exchange words [max_rows, E] at rk.EXCHANGE_OFFSET
                          (`spec.scratch_bytes(max_rows)` in all): zero before the first launch,
                          left zero by every launch

Keys a mode never touches may be left out of `ptrs` (plain: sub_out, streams_out; postonly: fn,
scale, base, coeff_out, mixes, workspace, counters): the ABI still takes a non-null pointer, and
they get the `streams` address, which the kernel never dereferences through them.
`mhc_requests` / `router_requests` give the (name, nbytes, comment) slices of all those buffers
for `Arena` or `HostArena` (what `executor/mhc_router_chain.py` allocates).
"""
from __future__ import annotations

from collections.abc import Mapping

from executor.launch import LaunchSpec
from kernels import mhc_kernel_ref as mk
from kernels import norm_ref as nr
from kernels import router_ref as rk

MHC_POINTERS = tuple(name for name, kind in mk.PARAMS if kind == "u64")
ROUTER_POINTERS = tuple(name for name, kind in rk.PARAMS if kind == "u64")
NORM_POINTERS = ("x_out", "norm_weight", "x_normed")
# What each mode's kernel never reads or writes (kernels/mhc.py: `post`, `mixes_on`).
MHC_UNTOUCHED = {"post": (), "plain": ("sub_out", "streams_out"),
                 "postonly": ("fn", "scale", "base", "coeff_out", "mixes", "workspace",
                              "counters")}
# Read / written only by the fused-norm variants (spec.norm_weight); others may leave them out.
MHC_NORM_POINTERS = ("norm_weight", "x_normed")


def _pointers(kernel_name: str, ptrs: Mapping[str, int], names: tuple[str, ...],
              optional: tuple[str, ...] = (), placeholder: str = "") -> list[int]:
    missing = [n for n in names if n not in ptrs and n not in optional]
    if missing:
        raise KeyError(f"{kernel_name}: no address for {missing} (it takes {list(names)})")
    return [ptrs[n] if n in ptrs else ptrs[placeholder] for n in names]


def mhc_pre_launch(bundle, spec: mk.MhcPreSpec, ptrs: Mapping[str, int], rows: int,
                   norm_eps: float, hc_eps: float) -> LaunchSpec:
    """ptrs: MHC_POINTERS (streams, sub_out, coeff_prev, fn, scale, base, streams_out, x_out,
    coeff_out, mixes, workspace, counters, norm_weight, x_normed), less the mode's
    MHC_UNTOUCHED if wanted, and less MHC_NORM_POINTERS unless the spec fuses the norm."""
    optional = MHC_UNTOUCHED[spec.mode] + (() if spec.norm_weight else MHC_NORM_POINTERS)
    pointers = _pointers(spec.name, ptrs, MHC_POINTERS, optional, "streams")
    return LaunchSpec(bundle.kernel(spec.name), spec.grid(rows),
                      (*pointers, rows, norm_eps, hc_eps), pdl=True)


def mhc_norm_launch(bundle, norm_spec: nr.RmsNormSpec, ptrs: Mapping[str, int], rows: int,
                    eps: float) -> LaunchSpec:
    """ptrs: x_out, norm_weight, x_normed (the norm kernel's x, weight, out)."""
    x, weight, out = _pointers(norm_spec.name, ptrs, NORM_POINTERS)
    return LaunchSpec(bundle.kernel(norm_spec.name), norm_spec.grid(rows),
                      (x, weight, out, rows, eps), pdl=True)


def mhc_step_launches(bundle, spec: mk.MhcPreSpec, norm_spec: nr.RmsNormSpec,
                      ptrs: Mapping[str, int], rows: int, norm_eps: float, hc_eps: float,
                      rms_eps: float) -> list[LaunchSpec]:
    """The whole step: mhc_pre, then the RMSNorm of its collapse (two PDL launches)."""
    if norm_spec.width != spec.width:
        raise ValueError(f"{spec.name}: RMSNorm {norm_spec.name} is for width {norm_spec.width}, "
                         f"the collapse has {spec.width}")
    return [mhc_pre_launch(bundle, spec, ptrs, rows, norm_eps, hc_eps),
            mhc_norm_launch(bundle, norm_spec, ptrs, rows, rms_eps)]


def router_launch(bundle, spec: rk.RouterSpec, ptrs: Mapping[str, int],
                  rows: int) -> LaunchSpec:
    """ptrs: ROUTER_POINTERS (x, weight, bias, logits, ids, weights, counters)."""
    pointers = _pointers(spec.name, ptrs, ROUTER_POINTERS)
    return LaunchSpec(bundle.kernel(spec.name), spec.grid(rows), (*pointers, rows), pdl=True)


def mhc_requests(spec: mk.MhcPreSpec, max_rows: int = mk.MAX_ROWS,
                 norm_weight: str = "f32") -> list[tuple[str, int, str]]:
    """Every buffer of one mHC step (inputs, weights, outputs, scratch) for `max_rows` rows."""
    r, d, s, m = max_rows, spec.width, spec.streams, mk.MIX_DIM
    wbytes = 4 if norm_weight == "f32" else 2
    return [
        ("streams", 2 * r * s * d, f"bf16 [{r}, {s}, {d}] X"),
        ("sub_out", 2 * r * d, f"bf16 [{r}, {d}] sublayer output"),
        ("coeff_prev", 4 * r * m, f"f32 [{r}, {m}] previous pre|post|comb"),
        ("fn", 4 * m * s * d, f"f32 [{m}, {s * d}] weight"),
        ("scale", 16, "f32 [4] weight (3 used)"),
        ("base", 4 * m, f"f32 [{m}] weight"),
        ("streams_out", 2 * r * s * d, f"bf16 [{r}, {s}, {d}] X'"),
        ("x_out", 2 * r * d, f"bf16 [{r}, {d}] collapse"),
        ("coeff_out", 4 * r * m, f"f32 [{r}, {m}] pre|post|comb"),
        ("mixes", 4 * r * m, f"f32 [{r}, {m}]"),
        ("workspace", mk.workspace_bytes(spec, max_rows),
         f"f32 [{spec.slices}, <= {r}, {mk.PARTIAL_STRIDE}] scratch"),
        ("counters", 4 * mk.counter_count(max_rows),
         f"i32 [{mk.counter_count(max_rows)}] scratch, zeroed once"),
        ("norm_weight", wbytes * d, f"{norm_weight} [{d}] weight"),
        ("x_normed", 2 * r * d, f"bf16 [{r}, {d}] normed collapse"),
    ]


def router_requests(spec: rk.RouterSpec, max_rows: int = rk.MAX_ROWS
                    ) -> list[tuple[str, int, str]]:
    """Every buffer of the router for `max_rows` rows."""
    r, e, d, k = max_rows, spec.experts, spec.hidden, spec.topk
    scratch = spec.scratch_bytes(max_rows)
    return [
        ("x", 2 * r * d, f"bf16 [{r}, {d}]"),
        ("weight", 2 * e * d, f"bf16 [{e}, {d}] gate weight"),
        ("bias", 4 * e, f"f32 [{e}] gate bias"),
        ("logits", 4 * r * e, f"f32 [{r}, {e}]"),
        ("ids", 4 * r * k, f"i32 [{r}, {k}] best first"),
        ("weights", 4 * r * k, f"f32 [{r}, {k}] route weights"),
        ("counters", scratch, f"{scratch} bytes: i32 counters (+ u64 exchange), zeroed once"),
    ]
