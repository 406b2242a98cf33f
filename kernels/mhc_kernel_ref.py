"""The fused mHC step kernel: spec, grid and workspace rules, byte formula, reference and error bounds.

One launch of `mhc_pre` does, for R rows of the residual streams X [R, S, D] (BF16):

  (1) post   X' = bf16(post_prev·f + comb_prevᵀ·X)     (modes "post", "postonly"; "plain": X' = X)
  (2) mixes  mixes = (X'·fnᵀ)·rsqrt(mean(X'²) + eps)   split-K over D, deterministic reduce
  (3) coeff  pre, post, comb = M2(mixes) with Sinkhorn (the last CTA of each row block)
  (4) collapse x = bf16(Σ_i pre_prev[i]·X'_i)           (the delayed pre: known before the step)

and the BF16 RMSNorm of x (the `kernels.norm` kernel, bitwise equal to `norm_ref`) follows as a
second launch: the norm needs the whole row's Σx², a grid-wide dependency of a split-K kernel.

Coefficients travel packed, float32 [R, 24] = pre[0:4] | post[4:8] | comb[8:24] (comb[j, k] at
8 + 4j + k, row j = the source stream): the kernel reads the previous sublayer's packed
coefficients (`coeff_prev`: its post/comb for (1), its pre for (4)) and writes this sublayer's.
Mode "postonly" stops after (1) and (4) (no fn read, no mixes, no coefficients, counters and
workspace untouched): the pending post before Engram rewrites the streams, and the final collapse.
S = 1 with mode "plain" is layer 0's broadcast mixes (X = the embedding, fn summed over streams,
coeff_prev pre = one-hot so x = the embedding).

PTX ABI: (u64 streams, u64 sub_out, u64 coeff_prev, u64 fn, u64 scale, u64 base,
u64 streams_out, u64 x_out, u64 coeff_out, u64 mixes, u64 workspace, u64 counters,
u64 norm_weight, u64 x_normed, u32 rows, f32 norm_eps, f32 hc_eps). streams_out may alias streams
(a thread reads and writes the same elements); counters (i32 [row blocks]) must be zero before
the first launch (the last CTA of a row block resets its counter). norm_weight / x_normed are
read / written only by the fused-norm variants (`_lean_norm{bf16,f32}`: x_normed =
`norm_ref.rmsnorm_ref(x, norm_weight, norm_eps)` bitwise, the last CTA of each row block
normalising its rows in the `kernels.norm` order); the other variants never touch them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels import mhc_ref
from kernels.common_ref import ceil_div, check_rows, params_dict

HC_MULT = 4
MIX_DIM = HC_MULT * HC_MULT + 2 * HC_MULT      # 24
PARTIALS = MIX_DIM + 1                         # 24 dot products and Σx² per (slice, row)
PARTIAL_STRIDE = 32                            # floats per (slice, row) in the workspace
SLICE_WIDTH = 64                               # d values per CTA (8 threads x 8 bf16)
THREADS_PER_ROW = SLICE_WIDTH // 8
CTA_THREADS = 128
ROW_GROUPS = CTA_THREADS // THREADS_PER_ROW    # 16 rows per pass
ROWS_PER_CTA = 32                              # 2 passes; the row block of one counter
REDUCE_CHUNK = 16                              # lean: slices summed by one thread, in order
MAX_ROWS = 256
MODES = ("post", "plain", "postonly")
PARAMS = (("streams", "u64"), ("sub_out", "u64"), ("coeff_prev", "u64"), ("fn", "u64"),
          ("scale", "u64"), ("base", "u64"), ("streams_out", "u64"), ("x_out", "u64"),
          ("coeff_out", "u64"), ("mixes", "u64"), ("workspace", "u64"), ("counters", "u64"),
          ("norm_weight", "u64"), ("x_normed", "u64"), ("rows", "u32"), ("norm_eps", "f32"),
          ("hc_eps", "f32"))
NORM_WEIGHT_DTYPES = ("bf16", "f32")


@dataclass(frozen=True)
class MhcPreSpec:
    """One compiled mHC step: width D, stream count S, mode and Sinkhorn iterations baked in."""

    name: str
    width: int
    streams: int
    mode: str
    sinkhorn_iters: int
    live_rows: bool = False         # coefficients only for real rows (variant "_lr")
    approx_rcp: bool = False        # Sinkhorn normalises by rcp.approx (variant "_rcp")
    lean: bool = False              # live rows only, spread reduce, a thread per row (Round 4)
    norm_weight: str = ""           # lean + the RMSNorm of x (weight dtype; "" = a 2nd launch)
    polled: bool = False            # lean with tagged-word handoff, a consumer CTA a row (Round 5)
    mix_split: bool = False         # polled, R <= 4 a block: 4 warps share a row's mixes ("_ms")
    params: tuple[tuple[str, str], ...] = PARAMS
    block: tuple[int, int, int] = (CTA_THREADS, 1, 1)

    @property
    def slices(self) -> int:
        return self.width // SLICE_WIDTH

    @property
    def reduce_chunks(self) -> int:
        """lean: the slices of a partial are summed in chunks of <= REDUCE_CHUNK, one thread each."""
        return self.slices // min(REDUCE_CHUNK, self.slices)

    @property
    def exchange_x_offset(self) -> int:
        """polled: bytes of a row's exchange before its x words (the partial words [25, slices],
        padded to 16 bytes)."""
        return 8 * (PARTIALS * self.slices + (PARTIALS * self.slices) % 2)

    @property
    def exchange_row_bytes(self) -> int:
        """polled: one row's tagged words: partials [25, slices], then x as bf16 pairs [D / 2]."""
        return self.exchange_x_offset + 8 * (self.width // 2)

    @property
    def fn_region_bytes(self) -> int:
        """The fn slice (fp32); lean reuses it for the chunk sums [32 rows, 25, chunks] once the
        rows are done."""
        fn = 4 * MIX_DIM * self.streams * SLICE_WIDTH
        if not self.lean:
            return fn
        return max(fn, 4 * ROWS_PER_CTA * PARTIALS * self.reduce_chunks)

    @property
    def smem_bytes(self) -> int:
        """Dynamic smem: the fn region and the last CTA's reduced [rows, 32] sums, a flag."""
        if self.mode == "postonly":
            return 0
        # lean: the norm's 4 warp totals (16 B), then scale[3] and base[24] staged (128 B)
        return (self.fn_region_bytes + 4 * ROWS_PER_CTA * PARTIAL_STRIDE + 16
                + (16 + 128 if self.lean else 0))

    def grid(self, rows: int) -> tuple[int, int, int]:
        check_rows(rows, self.name)
        if rows > MAX_ROWS:
            raise ValueError(f"{self.name}: {rows} rows; the workspace plan holds {MAX_ROWS}")
        return (self.slices, ceil_div(rows, ROWS_PER_CTA), 1)

    def bytes_moved(self, rows: int) -> int:
        """The step's bytes; with the fused norm also its y and weight (x is re-read from L2)."""
        norm = 0
        if self.norm_weight:
            norm = 2 * rows * self.width + self.width * (2 if self.norm_weight == "bf16" else 4)
        return mhc_pre_bytes(rows, self.width, self.streams, self.mode) + norm

    def to_dict(self) -> dict:
        return {"family": "mhc", "name": self.name, "width": self.width, "streams": self.streams,
                "mode": self.mode, "sinkhorn_iters": self.sinkhorn_iters,
                "live_rows": self.live_rows,
                "approx_rcp": self.approx_rcp, "lean": self.lean,
                "norm_weight": self.norm_weight,
                "params": params_dict(self.params), "block": list(self.block),
                "smem_bytes": self.smem_bytes, "slices": self.slices,
                "rows_per_cta": ROWS_PER_CTA, "slice_width": SLICE_WIDTH,
                **({"polled": True} if self.polled else {}),
                **({"mix_split": True} if self.mix_split else {})}


def make_spec(width: int, streams: int, mode: str, sinkhorn_iters: int,
              live_rows: bool = False,
              approx_rcp: bool = False, lean: bool = False,
              norm_weight: str = "", polled: bool = False,
              mix_split: bool = False) -> MhcPreSpec:
    if mode not in MODES:
        raise ValueError(f"mHC mode {mode!r}; expected one of {MODES}")
    if width <= 0 or width % SLICE_WIDTH:
        raise ValueError(f"mHC width {width} must be a positive multiple of {SLICE_WIDTH}")
    if streams not in (1, HC_MULT) or (mode != "plain" and streams != HC_MULT):
        raise ValueError(f"mHC streams {streams} with mode {mode!r}: expected {HC_MULT} "
                         "(or 1 for the plain broadcast of layer 0)")
    if sinkhorn_iters < 1:
        raise ValueError(f"Sinkhorn needs at least one iteration, got {sinkhorn_iters}")
    if (live_rows or approx_rcp) and mode == "postonly":
        raise ValueError("mHC live_rows / approx_rcp change the coefficients tail, which "
                         "postonly has not")
    if lean and (mode == "postonly" or live_rows or approx_rcp):
        raise ValueError("mHC lean is its own tail (live rows, rcp.approx); it takes no other "
                         "variant flag and no postonly")
    slices = width // SLICE_WIDTH
    if polled and (not lean or not norm_weight or slices % 2):
        raise ValueError(f"mHC polled is a handoff of the lean tail with the norm fused (needs "
                         f"lean and norm_weight) over 16-byte pairs of words (needs an even "
                         f"slice count, got {slices})")
    if mix_split and not polled:
        raise ValueError("mHC mix_split is a body of the polled variant: it needs polled")
    if lean and slices % min(REDUCE_CHUNK, slices):
        raise ValueError(f"mHC lean: {slices} slices do not split into chunks of {REDUCE_CHUNK}")
    if norm_weight and (not lean or norm_weight not in NORM_WEIGHT_DTYPES):
        raise ValueError(f"mHC fused RMSNorm weight {norm_weight!r}: expected one of "
                         f"{NORM_WEIGHT_DTYPES}, with lean")
    suffix = (("_lr" if live_rows else "")
              + ("_rcp" if approx_rcp else "") + ("_lean" if lean else "")
              + ("_poll" if polled else "") + ("_ms" if mix_split else "")
              + (f"_norm{norm_weight}" if norm_weight else ""))
    return MhcPreSpec(f"mhc_pre_d{width}_s{streams}_{mode}{suffix}", width, streams, mode,
                      sinkhorn_iters, live_rows, approx_rcp, lean, norm_weight,
                      polled, mix_split)


def spec_from_dict(d: dict) -> MhcPreSpec:
    """The spec a manifest record (`MhcPreSpec.to_dict`) was built from."""
    return make_spec(d["width"], d["streams"], d["mode"], d["sinkhorn_iters"],
                     d.get("live_rows", False),
                     d.get("approx_rcp", False), d.get("lean", False),
                     d.get("norm_weight", ""), d.get("polled", False),
                     d.get("mix_split", False))


def mhc_specs(cfg) -> list[MhcPreSpec]:
    """What the step launches (executor/stages/mhc.py): post at R <= 8 `_lean_poll_ms_norm*`,
    above `_lr_rcp`; Engram layers `plain_lean`; layer 0 the 1-stream `plain_lean` (`plain`: its
    revert); `postonly` (Engram's pending post, the tail). `_lean` and `_lean_norm*`: the revert (MHC_POLL_ROWS = 0) and the
    bitwise reference of `_lean_poll` in the GPU tests."""
    if cfg.hc_mult != HC_MULT or cfg.hc_mix_dim != MIX_DIM:
        raise ValueError(f"mHC kernels are built for hc_mult {HC_MULT}, config has {cfg.hc_mult}")
    d, it = cfg.hidden_size, cfg.hc_sinkhorn_iters
    return [make_spec(d, HC_MULT, "post", it, live_rows=True, approx_rcp=True),
            make_spec(d, 1, "plain", it), make_spec(d, HC_MULT, "postonly", it),
            make_spec(d, HC_MULT, "post", it, lean=True),
            make_spec(d, HC_MULT, "plain", it, lean=True), make_spec(d, 1, "plain", it, lean=True),
            *[make_spec(d, HC_MULT, "post", it, lean=True, norm_weight=w)
              for w in NORM_WEIGHT_DTYPES],
            *[make_spec(d, HC_MULT, "post", it, lean=True, polled=True, norm_weight=w,
                        mix_split=ms) for ms in (False, True) for w in NORM_WEIGHT_DTYPES]]


def workspace_bytes(spec: MhcPreSpec, max_rows: int = MAX_ROWS) -> int:
    """The `workspace` scratch: f32 partials [slices, rows, 32]; polled: the tagged exchange
    words [rows, exchange_row_bytes] (zero before the first launch, left zero by every launch)."""
    if spec.polled:
        return max_rows * spec.exchange_row_bytes
    return 4 * spec.slices * max_rows * PARTIAL_STRIDE


def counter_count(max_rows: int = MAX_ROWS) -> int:
    return ceil_div(max_rows, ROWS_PER_CTA)


def mhc_pre_bytes(rows: int, width: int, streams: int, mode: str) -> int:
    """fn once; X read; (post) f read and X' written; x written; coefficients in and out."""
    fn = 0 if mode == "postonly" else 4 * MIX_DIM * streams * width
    per_row = 2 * streams * width + 2 * width + 4 * 2 * MIX_DIM + 4 * MIX_DIM
    if mode == "postonly":
        per_row -= 4 * MIX_DIM + 4 * MIX_DIM          # reads coeff_prev only, writes no mixes
    if mode != "plain":
        per_row += 2 * width + 2 * streams * width
    return fn + rows * per_row


def predicted_us(rows: int, width: int = 5120, streams: int = HC_MULT) -> float:
    """Floor at the measured ~4.3 TB/s stream read plus ~5.5 us of latency: launch ~2, the fn
    prologue round trip ~1.5, split-K reduce ~1, Sinkhorn's 41 dependent normalisations ~1."""
    return mhc_pre_bytes(rows, width, streams, "post") / 4.3e6 + 5.5


# ---- reference ---------------------------------------------------------------------------------

def pack_coefficients(c: mhc_ref.HcCoefficients) -> np.ndarray:
    rows = c.pre.shape[0]
    return np.concatenate([c.pre, c.post, c.comb.reshape(rows, -1)], axis=1).astype(np.float32)


def unpack_coefficients(packed: np.ndarray) -> mhc_ref.HcCoefficients:
    n = HC_MULT
    if packed.ndim != 2 or packed.shape[1] != MIX_DIM:
        raise ValueError(f"packed mHC coefficients must be [R, {MIX_DIM}], got {packed.shape}")
    p = packed.astype(np.float32)
    return mhc_ref.HcCoefficients(pre=p[:, :n], post=p[:, n:2 * n],
                                  comb=p[:, 2 * n:].reshape(-1, n, n))


@dataclass(frozen=True)
class MhcPreOutputs:
    streams: np.ndarray     # X' [R, S, D] BF16
    x: np.ndarray           # collapse [R, D] BF16 (before the norm)
    mixes: np.ndarray       # [R, 24] f32
    coeff: np.ndarray       # packed [R, 24] f32


def mhc_pre_ref(mode: str, streams: np.ndarray, sub_out: np.ndarray | None,
                coeff_prev: np.ndarray, fn: np.ndarray, scale: np.ndarray, base: np.ndarray,
                norm_eps: float, hc_eps: float, iters: int) -> MhcPreOutputs:
    """What one launch computes, composed from `mhc_ref` (float64 sums rounded once); for
    "postonly" only `streams` and `x` are the kernel's outputs."""
    prev = unpack_coefficients(coeff_prev)
    if mode in ("post", "postonly"):
        x_new = mhc_ref.hc_post(sub_out, streams, prev)
    elif mode == "plain":
        x_new = streams
    else:
        raise ValueError(f"mHC mode {mode!r}; expected one of {MODES}")
    return finish_ref(x_new, prev.pre[:, :streams.shape[1]], fn, scale, base, norm_eps, hc_eps,
                      iters)


def finish_ref(x_new: np.ndarray, pre_prev: np.ndarray, fn: np.ndarray, scale: np.ndarray,
               base: np.ndarray, norm_eps: float, hc_eps: float, iters: int) -> MhcPreOutputs:
    """(2)-(4) from given streams X' (tests pass the kernel's own X', so errors do not chain)."""
    mixes = mhc_ref.hc_mixes(x_new, fn, norm_eps)
    coeff = mhc_ref.hc_coefficients(mixes, scale, base, HC_MULT, iters, hc_eps)
    x = mhc_ref.hc_collapse(x_new, pre_prev)
    return MhcPreOutputs(streams=x_new, x=x, mixes=mixes, coeff=pack_coefficients(coeff))


# ---- error bounds (tests) ----------------------------------------------------------------------

def rounding_bound(exact: np.ndarray, abs_terms: np.ndarray, ops: int) -> np.ndarray:
    """|bf16(fp32 result) - exact|: half a bf16 ulp of |exact| (2^-9 relative) plus `ops` fp32
    roundings of the summed magnitudes (2^-24 each), doubled for the ulp step at a binade edge."""
    return 2.0**-7 * np.abs(exact) + ops * 2.0**-23 * abs_terms


def mixes_bound(x_new: np.ndarray, fn: np.ndarray, norm_eps: float) -> np.ndarray:
    """|mixes_kernel - mixes_f64|: each fp32 sum (the dot and Σx²) is 32 sequential fma per
    thread, 3 butterfly steps and D/64 sequential slice adds: `ops` roundings of at most 2^-24 of
    its summed magnitudes. The dot's error is ops·2^-24·Σ|x·fn|; Σx²'s relative error ops·2^-24
    moves rstd by half that, plus 2^-20 for the divide, sqrt and the final multiplies."""
    flat = x_new.reshape(x_new.shape[0], -1).astype(np.float64)
    fn64 = fn.astype(np.float64)
    abs_dot = np.abs(flat) @ np.abs(fn64).T
    rstd = 1.0 / np.sqrt(np.mean(flat * flat, axis=1, keepdims=True) + norm_eps)
    ops = 32 + 3 + x_new.shape[-1] // SLICE_WIDTH + 8
    u = ops * 2.0**-24
    return (u * abs_dot + (u + 2.0**-20) * np.abs(flat @ fn64.T)) * rstd
