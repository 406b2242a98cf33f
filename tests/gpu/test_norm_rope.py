"""GPU tests of RMSNorm, residual add and RoPE against their NumPy references, through the runtime.

Bundles: HOPDEC_BUNDLE (tiny widths) and HOPDEC_BUNDLE_V41 (v41-flash widths); a missing bundle
skips its cases with the reason. Every case draws fresh inputs, poisons the output with NaN, and
compares every element. Tolerances:
- RMSNorm: bitwise. The reference replays the kernel's summation order and its IEEE-rounded
  div/sqrt/rcp/mul (see kernels/norm_ref.py); squares of bf16 are exact, so fma == mul + add.
  Row counts include 2 full grid-stride passes plus a ragged tail, so every group runs the
  software pipeline (next row's loads in flight while the current one is stored), in place too.
- residual add: bitwise (one fp32 add, one RNE rounding on both sides).
- RoPE: the compiler decides which of `x0*c`, `x1*s` it fuses into an fma, so each output carries
  up to 2 fp32 roundings of the products (2**-24 * (|x0| + |x1|) each, with |c|, |s| <= 1), which
  cancellation can make large next to the result; then the bf16 rounding (2**-8 relative). Bound:
  |got - exact| <= 2**-8 |exact| + 2**-22 (|x0| + |x1|), `exact` = float64 rotation by the same
  table values; and fewer than 1 in 1000 elements may differ from the reference's bits at all.
"""
from __future__ import annotations

import numpy as np
import pytest

from executor.runtime import Arena, LaunchSpec
from kernels import common_ref as cr
from kernels import elementwise_ref as er
from kernels import norm_ref as nr
from kernels import rope_ref as rr

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

ROWS = (1, 5, 6, 8, 17, 48, 192)
LARGE_ROWS = 6553            # 64 MiB of bf16 input at D = 5120
RNG = np.random.default_rng()


def _run(dev, stream, bundle, name, grid, buffers: dict, scalars: tuple, outputs: tuple,
         poison: tuple | None = None):
    """Upload `buffers` (name -> host array) into one arena, fill `poison` (default: the outputs)
    with NaN instead, launch `name` with (pointers in dict order) + scalars, return `outputs`."""
    poison = outputs if poison is None else poison
    with Arena(dev, [(k, max(v.nbytes, 16)) for k, v in buffers.items()]) as arena:
        for key, host in buffers.items():
            view = arena.view(key, np.uint8, (host.nbytes,))
            if key in poison:
                view[...] = 0xFF                    # NaN in bf16 and f32
            else:
                view[...] = cp.asarray(np.ascontiguousarray(host).view(np.uint8).ravel())
        cp.cuda.Device().synchronize()
        ptrs = tuple(arena.ptr(k) for k in buffers)
        LaunchSpec(bundle.kernel(name), grid, ptrs + scalars, pdl=True).launch(stream)
        stream.synchronize()
        return tuple(cp.asnumpy(arena.view(k, np.uint8, (buffers[k].nbytes,)))
                     .view(buffers[k].dtype).reshape(buffers[k].shape) for k in outputs)


def _first_mismatch(got, want) -> str:
    bad = np.argwhere(got.view(np.uint16) != want.view(np.uint16))
    if not len(bad):
        return ""
    idx = tuple(bad[0])
    return f"{len(bad)} mismatches, first at {idx}: got {got[idx]} want {want[idx]}"


def _rows(width: int):
    return ROWS + ((LARGE_ROWS * 5120 // width,) if width >= 1280 else ())


# ---- RMSNorm ---------------------------------------------------------------------------------


def _pipelined_rows(spec) -> int:
    """Rows that make every thread group of the persistent grid take 2 steps, some a third."""
    return 2 * spec.max_ctas * spec.rows_per_cta + 3


@pytest.mark.parametrize("wdtype", nr.WEIGHT_DTYPES)
def test_rmsnorm_matches_reference_bitwise(dev, stream, preset_bundle, wdtype):
    cfg, bundle = preset_bundle
    for width in nr.built_widths(cfg):
        spec = nr.make_spec(width, wdtype)
        for rows in _rows(width) + (_pipelined_rows(spec),):
            x = cr.to_bf16(RNG.standard_normal((rows, width)) * RNG.uniform(0.01, 50))
            x[RNG.integers(0, rows)] = 0                       # an all-zero row
            w = RNG.uniform(-2, 2, width).astype(np.float32)
            w = cr.to_bf16(w) if wdtype == "bf16" else w
            eps = float(RNG.choice([1e-20, cfg.rms_norm_eps, 1e-6]))
            buffers = {"x": x, "w": w, "y": np.empty_like(x)}
            y, = _run(dev, stream, bundle, spec.name, spec.grid(rows), buffers,
                      (rows, eps), ("y",))
            want = nr.rmsnorm_ref(x, w, eps)
            assert not np.isnan(y.astype(np.float32)).any(), f"{spec.name} rows={rows}: unwritten"
            assert np.array_equal(y.view(np.uint16), want.view(np.uint16)), (
                f"{spec.name} rows={rows} eps={eps}: {_first_mismatch(y, want)}")


def test_rmsnorm_in_place(dev, stream, preset_bundle):
    """out == x: a group prefetches its own next row while storing the current one, and never
    reads a row another group writes; checked at one step and at 2-3 steps per group."""
    cfg, bundle = preset_bundle
    for width in nr.built_widths(cfg):
        spec = nr.make_spec(width, "bf16")
        for rows in (17, _pipelined_rows(spec)):
            x = cr.to_bf16(RNG.standard_normal((rows, spec.width)))
            w = cr.to_bf16(RNG.uniform(-2, 2, spec.width))
            with Arena(dev, [("x", x.nbytes), ("w", w.nbytes)]) as arena:
                arena.view("x", np.uint8, (x.nbytes,))[...] = cp.asarray(x.view(np.uint8).ravel())
                arena.view("w", np.uint8, (w.nbytes,))[...] = cp.asarray(w.view(np.uint8).ravel())
                cp.cuda.Device().synchronize()
                args = (arena.ptr("x"), arena.ptr("w"), arena.ptr("x"), rows, 1e-20)
                LaunchSpec(bundle.kernel(spec.name), spec.grid(rows), args).launch(stream)
                stream.synchronize()
                y = cp.asnumpy(arena.view("x", np.uint16, (rows, spec.width))).view(cr.BF16)
            want = nr.rmsnorm_ref(x, w, 1e-20)
            assert np.array_equal(y.view(np.uint16), want.view(np.uint16)), (
                f"{spec.name} in place rows={rows}: {_first_mismatch(y, want)}")


# ---- residual add --------------------------------------------------------------------------------

@pytest.mark.parametrize("a_dtype", er.A_DTYPES)
def test_residual_add_matches_reference_bitwise(dev, stream, preset_bundle, a_dtype):
    cfg, bundle = preset_bundle
    spec = er.make_spec(cfg.hidden_size, a_dtype)
    for rows in _rows(spec.width):
        a = (RNG.standard_normal((rows, spec.width)) * 3).astype(np.float32)
        a = cr.to_bf16(a) if a_dtype == "bf16" else a
        b = cr.to_bf16(RNG.standard_normal((rows, spec.width)) * 10)
        out, = _run(dev, stream, bundle, spec.name, spec.grid(rows),
                    {"a": a, "b": b, "out": np.empty_like(b)}, (rows,), ("out",))
        want = er.residual_add_ref(a, b)
        assert np.array_equal(out.view(np.uint16), want.view(np.uint16)), (
            f"{spec.name} rows={rows}: {_first_mismatch(out, want)}")


# ---- RoPE ------------------------------------------------------------------------------------------

def _rope_specs(cfg):
    return rr.step_specs(cfg, 4)


@pytest.mark.parametrize("kind", ("plain", "yarn"))
def test_rope_matches_reference(dev, stream, preset_bundle, kind):
    cfg, bundle = preset_bundle
    num_positions = min(cfg.max_position_embeddings, 1 << 17)   # keeps the table at 32 MiB
    table = rr.RopeTable.for_ratio(cfg, 1 if kind == "yarn" else 0, num_positions)
    for spec in _rope_specs(cfg):
        for rows in ROWS + (2048,):
            x = cr.to_bf16(RNG.standard_normal((rows, spec.heads, spec.head_dim)) * 4)
            pos = RNG.integers(0, num_positions, rows).astype(np.int32)
            pos[RNG.integers(0, rows)] = num_positions - 1                 # the last table row
            if rows > 5:
                pos[1] = -1 if rows % 2 else num_positions                  # out of range: NaN
            io = {"x": x} if spec.in_place else {"x": x, "out": np.empty_like(x)}
            # In place, x is the output and cannot be poisoned: an unwritten rope dim would keep
            # its input value, which differs from the rotated reference (positions > 0).
            got, = _run(dev, stream, bundle, spec.name, spec.grid(rows),
                        {**io, "table": table.cos_sin, "pos": pos}, (rows, num_positions),
                        ("x",) if spec.in_place else ("out",), poison=() if spec.in_place else None)
            want = rr.rope_ref(x, pos, table, spec.inverse)
            _check_rope(spec.name, rows, got, want, x, pos, table, spec.inverse)


def _check_rope(name, rows, got, want, x, pos, table, inverse):
    g, w = got.astype(np.float32), want.astype(np.float32)
    nan_g, nan_w = np.isnan(g), np.isnan(w)
    assert np.array_equal(nan_g, nan_w), f"{name} rows={rows}: NaN positions differ"
    nope = x.shape[-1] - rr.ROPE_DIM
    assert np.array_equal(got[..., :nope].view(np.uint16), x[..., :nope].view(np.uint16))
    valid = ~nan_w[:, 0, -1]
    exact = _rotate_f64(x[valid], pos[valid], table, inverse)
    xr = np.abs(x[valid][..., nope:].astype(np.float64)).reshape(exact.shape[:-1] + (-1, 2))
    bound = 2.0**-8 * np.abs(exact) + 2.0**-22 * np.repeat(xr.sum(-1), 2, axis=-1)
    err = np.abs(g[valid][..., nope:] - exact)
    assert np.all(err <= bound), f"{name} rows={rows}: max err/bound {np.max(err / bound)}"
    differ = np.count_nonzero(got.view(np.uint16)[~nan_w] != want.view(np.uint16)[~nan_w])
    assert differ <= max(1, got.size // 1000), f"{name} rows={rows}: {differ} elements differ"


def _rotate_f64(x, pos, table, inverse):
    """float64 rotation of the rope dims by the table's fp32 cos/sin (products exact)."""
    xr = x[..., -rr.ROPE_DIM:].astype(np.float64)
    x0, x1 = xr[..., 0::2], xr[..., 1::2]
    c = table.cos_sin[pos, :, 0].astype(np.float64)[:, None, :]
    s = table.cos_sin[pos, :, 1].astype(np.float64)[:, None, :]
    out = np.empty_like(xr)
    if inverse:
        out[..., 0::2], out[..., 1::2] = x0 * c + x1 * s, x1 * c - x0 * s
    else:
        out[..., 0::2], out[..., 1::2] = x0 * c - x1 * s, x0 * s + x1 * c
    return out
