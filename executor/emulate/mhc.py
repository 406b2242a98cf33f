"""kernels.mhc on the host: one `mhc_pre` launch (post, mixes, Sinkhorn, collapse) by its reference.

Every variant of the manifest (post_lr_rcp, post_lean, post_lean_norm*,
post_lean_poll[_ms]_norm*, plain at S = 1, plain_lean at S = 4 and 1, postonly) computes the same
values within the GPU test's tolerances (`_lr` only which padded lanes run, `_rcp` Sinkhorn's divisions:
rcp.approx, measured within 7.5e-7 of div.rn against the 1e-5 tolerance, docs/perf.md run 20;
`_lean` the reduce order and a thread per row's Sinkhorn with rcp.approx), so all run
`mk.mhc_pre_ref` (postonly: its post and collapse halves). Written, as the kernel writes them:
streams_out (modes post, postonly) and x_out for rows [0, rows); except in postonly, mixes and
coeff_out for those rows (the fused-norm `_norm*` variants: also x_normed = `norm_ref.
rmsnorm_ref` of x_out, bitwise as the kernel), the workspace partials (floats 0..24 of row
(slice, r) of the [slices, rows, 32] scratch: the slice's 24 dot products and Σx²) and the
row-block counters (which must be zero before: the kernel's last-CTA election needs it, and
leaves them zero). `_lean_poll` (bitwise `_lean`'s outputs) uses `workspace` as its exchange of
tagged words and `counters[0]` as its timeout flag: both zero before, and left zero.
"""
from __future__ import annotations

import numpy as np

from executor.emulate import NoEmulator
from kernels import mhc_kernel_ref as mk
from kernels import mhc_ref
from kernels import norm_ref as nr
from kernels.common_ref import BF16


def spec_of(record) -> mk.MhcPreSpec:
    """The MhcPreSpec a manifest record was built from (NoEmulator for a kind not rebuilt)."""
    sp = record.spec
    try:
        spec = mk.spec_from_dict(sp)
    except (KeyError, ValueError) as exc:
        raise NoEmulator(f"kernels.mhc kernel {record.name!r}: no emulator for its spec "
                         f"({exc})") from None
    if spec.name != record.name:
        raise NoEmulator(f"kernels.mhc kernel {record.name!r}: its spec rebuilds as "
                         f"{spec.name!r}, a variant the emulator does not know")
    return spec


def check_grid(name: str, grid, want) -> None:
    if tuple(grid) != tuple(want):
        raise ValueError(f"{name}: launched with grid {tuple(grid)}, the kernel needs {want}")


def claim_counters(name: str, space, ptr: int, blocks: int) -> None:
    """The row-block counters a launch uses: zero before (else the last-CTA election of the
    GPU kernel picks no CTA or the wrong one), zero after (the last CTA resets its counter)."""
    counters = space.array(ptr, np.int32, blocks)
    if counters.any():
        raise ValueError(f"{name}: counters at {space.name_of(ptr)} must be zero before the "
                         f"launch, found {counters.tolist()}")
    counters[...] = 0


def claim_exchange(spec: mk.MhcPreSpec, space, exchange: int, status: int, rows: int) -> None:
    """`_lean_poll`: its rows' tagged words must be empty before the launch (a stale tagged word
    would be taken as this launch's) and are left empty (each consumer zeroes what it read); the
    timeout flag (status[0]) must be clear: a set one says an earlier launch gave up."""
    words = space.array(exchange, np.uint64, rows * spec.exchange_row_bytes // 8)
    if words.any():
        raise ValueError(f"{spec.name}: exchange at {space.name_of(exchange)} must be zero before "
                         f"the launch, found {np.count_nonzero(words)} written words")
    flag = space.array(status, np.int32, 1)
    if flag.any():
        raise ValueError(f"{spec.name}: timeout flag at {space.name_of(status)} is set: an "
                         "earlier launch's consumer gave up waiting for its words")


def slice_partials(x_new: np.ndarray, fn: np.ndarray, slices: int) -> np.ndarray:
    """[slices, R, 25] f32: each 64-wide slice's X'·fnᵀ and Σx² (the workspace scratch)."""
    rows, s = x_new.shape[:2]
    x = x_new.astype(np.float64).reshape(rows, s, slices, mk.SLICE_WIDTH)
    f = fn.astype(np.float64).reshape(mk.MIX_DIM, s, slices, mk.SLICE_WIDTH)
    dots = np.einsum("rjcw,mjcw->crm", x, f)
    squares = np.einsum("rjcw,rjcw->cr", x, x)[..., None]
    return np.concatenate([dots, squares], axis=2).astype(np.float32)


def emulate(record, grid, args, space) -> None:
    spec = spec_of(record)
    rows, s, d, m = args["rows"], spec.streams, spec.width, mk.MIX_DIM
    check_grid(spec.name, grid, spec.grid(rows))
    # Copies: streams_out may alias streams.
    x = space.array(args["streams"], BF16, (rows, s, d)).copy()
    prev = space.array(args["coeff_prev"], np.float32, (rows, m)).copy()
    sub_out = None
    if spec.mode != "plain":
        sub_out = space.array(args["sub_out"], BF16, (rows, d)).copy()
    if spec.mode == "postonly":
        x_new = mhc_ref.hc_post(sub_out, x, mk.unpack_coefficients(prev))
        collapse = mhc_ref.hc_collapse(x_new, prev[:, :s])
    else:
        fn = space.array(args["fn"], np.float32, (m, s * d)).copy()
        scale = space.array(args["scale"], np.float32, 3).copy()
        base = space.array(args["base"], np.float32, m).copy()
        if spec.polled:
            claim_exchange(spec, space, args["workspace"], args["counters"], rows)
        else:
            claim_counters(spec.name, space, args["counters"], spec.grid(rows)[1])
        out = mk.mhc_pre_ref(spec.mode, x, sub_out, prev, fn, scale, base, args["norm_eps"],
                             args["hc_eps"], spec.sinkhorn_iters)
        x_new, collapse = out.streams, out.x
        if not spec.polled:
            workspace = space.array(args["workspace"], np.float32,
                                    (spec.slices, rows, mk.PARTIAL_STRIDE))
            workspace[:, :, :mk.PARTIALS] = slice_partials(x_new, fn, spec.slices)
        space.array(args["mixes"], np.float32, (rows, m))[...] = out.mixes
        space.array(args["coeff_out"], np.float32, (rows, m))[...] = out.coeff
    if spec.mode != "plain":
        space.array(args["streams_out"], BF16, (rows, s, d))[...] = x_new.astype(BF16)
    space.array(args["x_out"], BF16, (rows, d))[...] = collapse.astype(BF16)
    if spec.norm_weight:
        weight = space.array(args["norm_weight"], BF16 if spec.norm_weight == "bf16"
                             else np.float32, d).copy()
        space.array(args["x_normed"], BF16, (rows, d))[...] = nr.rmsnorm_ref(
            collapse.astype(BF16), weight, args["norm_eps"])
