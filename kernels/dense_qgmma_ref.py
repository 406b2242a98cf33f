"""W8A16 on native FP8 wgmma (QGMMA), R <= 8: spec, layouts, the NumPy reference and its bound (no DSL).

    y[r, n] = sum_k x[r, k] * W[n, k],   W = e4m3(w) * 2^(s[n/32, k/32] - 127)   (dense_ref's)

The kernel (kernels/dense_qgmma.py) never converts a weight: it feeds the E4M3 bytes to
`wgmma.mma_async.m64n8k32.f32.e4m3.e4m3` as the A operand from registers and puts the bf16
activations through the tensor core as two E4M3 parts (W8A16 semantics kept to ~2^-17 of the
row's largest |x|):
- Work: a CTA owns a 64-row tile (tile = cta // split) and one K slice of kc = K / split bytes
  (slice = cta % split); its 2 ("stream_qg", `_sqg`) or 4 ("stream_qg4", `_sqg4`) warpgroups
  take equal runs of the slice's k32 steps.
  split > 1 (wq_a|wkv: 28 tiles x 4 slices = 112 CTAs) meets in the workspace, summed in slice
  order by the CTA that arrives last on the tile's counter (dense_stream's deterministic scheme).
- x split (per row r and slice): e = the bf16 exponent field of max|x[r, slice]| (at least
  X_EXP_MIN), s = 2^(134 - e) so max|x| * s < 256 < 448; xs = f16(x * s) (f32 multiply, exact
  but for f32 underflow, then the f32 -> f16 rounding, exact down to 2^-14), hi = e4m3(xs),
  lo = e4m3(xs - hi) (the f16 difference is exact). `split_x` is that arithmetic.
- One k32 step of one warpgroup: QGMMA(hi) from zero, QGMMA(lo) onto it (scale-d 1): the
  step's partial P = W_e4m3 . (hi + lo) over 32 K, one 32-K scale block and 32-row scale block
  per warp (rows 16w..16w+15). The partial is folded in fp32, acc += P * 2^(s_w - 63) (exact
  power of two, FFMA), INFLIGHT steps in flight (wgmma.commit_group / wait_group).
- CTA result: (acc_wg0 + acc_wg1 [+ ...]) * 2^-64 * (1 / s_row), rounded to bf16 (split 1) or as
  fp32 for the slice sum (split > 1: sum over slices in order, then bf16).

Error bound (`qgmma_tolerance`), against `dense_qgmma_ref` (the exact sum of the split x):
Hopper's FP8 wgmma adds its 32 exact E4M3 x E4M3 products with reduced precision (DeepSeek-V3
report: about 14 bits kept after aligning to the largest term), hi then lo onto the same
accumulator, so one step's partial is off by at most ~2^-13 * (sum|w hi| + sum|w lo| + |P_hi|)
<= 2^-12 * sum_32 |w| |hi + lo| (+ the lo terms' own share). Summed over steps and scaled:
  |y - ref| <= 2^-11 * sum_k |W_nk| |x~_k|          (QG_ACC_REL: a factor 2 of margin)
            + 2 * (K/32 + split + 2) * 2^-24 * sum_k |W_nk| |x~_k|   (fp32 folds and sums)
            + 2^-8 |ref| + 2^-133                      (bf16 output: half an ulp, subnormal)
with x~ = (hi + lo) / s. Against the exact bf16 x (`split_error_bound`): |x - x~| <= 2^-10 / s per
element (lo is exact while xs - hi >= 2^-6, i.e. |x s| >= 2^-2; below, lo's E4M3 subnormal grid
of 2^-9 rounds it to 2^-10; f16 underflow adds < 2^-25): 2^-10 / s = 2^(e - 144) <= 2^-17 *
2^(e - 127) <= 2^-17 max|x[r, slice]|, so y moves by at most 2^-17 * max|x| * sum|W| per slice.
A wrong element (a dropped or doubled k32 block, a wrong scale, a swapped row or token) moves y
by ~|W_block . x_block| ~ sqrt(32 / K) of |y|, about 10x the bound at K = 1280 with random data
(tests/test_dense_qgmma_cpu.py shows each of those failing the check on the CPU model).

PTX ABI: that of the dense family (dense_ref.PARAMS); `residual` unused (bf16 epilogue only).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.common_ref import BF16, H200_NUM_SMS, ceil_div
from kernels.dense_ref import FP8_BLOCK, MAX_SCALE_BYTE, ROW_TILE, DenseSpec, dense_shapes

VARIANT = "stream_qg"                # 2 warpgroups a CTA
VARIANT_WIDE = "stream_qg4"          # 4 warpgroups a CTA: 4 warps per SM sub-partition, not 2
TAGS = {VARIANT: "sqg", VARIANT_WIDE: "sqg4"}
QG_LABELS = ("wqa_wkv", "wq_b", "wo_b")   # the R <= 8 attention linears the candidate is built for
WHOLE_K_LABELS = ("wo_b",)          # whole K per CTA at one CTA per SM (wo_b: K = 2048 is past
                                    # MAX_SLICE_K, and 2 slices of 80 tiles are 160 CTAs, 2 waves)
WIDE_LABELS = ("wqa_wkv",)          # also with 4 warpgroups: at wq_b's shape ptxas serializes
                                    # the wgmmas there (C7512, insufficient registers at 64)
TILE_M = 64                         # weight rows per CTA: one wgmma M
KSTEP = 32                          # K per wgmma (e4m3): one 32-K scale block
WARPGROUPS = {VARIANT: 2, VARIANT_WIDE: 4}   # per CTA, splitting the slice's k-steps evenly
WG_THREADS = 128
INFLIGHT = {VARIANT: 4, VARIANT_WIDE: 2}    # wgmma groups (k-steps) in flight per warpgroup:
                                    # 4 warpgroups at 64 registers with 4 in flight made ptxas
                                    # serialize every wgmma (C7512, insufficient registers)
ROW_PAD = 32                        # smem weight row stride kc + 32: 4 rows of a quarter-warp's
                                    # 8-byte reads on disjoint banks (stride = 32 mod 128)
MAX_SLICE_K = 1280                  # bytes of K per CTA (64 rows x 1312 + x parts: <= 104 KB)
X_GROUP = 8                         # bf16 of x per thread-group of the split (one 16-byte load)
X_EXP_MIN = 8                       # bf16 exponent floor of the row max: s <= 2^126
SCALE_BIAS = 64                     # fold factor 2^(s_w - 127 + 64): never an fp32 subnormal
B_STEP_BYTES = 512                  # smem per k-step of x: [hi, lo][k half][token 0..7][16 B]
QG_ACC_REL = 2.0**-11               # the tensor core's per-step accumulation bound (margin 2)
SMEM_BUDGET = 104 * 1024            # dense_ref.STREAM_SMEM_BUDGET: the next kernel fits beside
SMEM_BUDGET_WHOLE = 227 * 1024      # WHOLE_K_LABELS: the SM90 per-block opt-in maximum (one CTA
                                    # per SM; the next kernel streams on the SMs this grid leaves)


def choose_split(tiles: int, k: int) -> int:
    """K slices per 64-row tile: the most slices that keep one wave (tiles * split <= 132) with
    slices of <= MAX_SLICE_K bytes, a multiple of 128 (4-byte scale copies, 2 x 2 k-steps)."""
    best = 0
    for split in range(1, k // 128 + 1):
        kc = k // split
        if k % split or kc % 128 or kc > MAX_SLICE_K or tiles * split > H200_NUM_SMS:
            continue
        best = split
    if not best:
        raise ValueError(f"K={k} with {tiles} tiles: no K slice of <= {MAX_SLICE_K} bytes (a "
                         f"multiple of 128) keeps one wave of <= {H200_NUM_SMS} CTAs")
    return best


@dataclass(frozen=True)
class QgSpec(DenseSpec):
    """A DenseSpec of variant "stream_qg" (2 warpgroups) or "stream_qg4" (4): split_k = K slices
    per tile, unit_k = the slice's K, ctas = tiles64 * split. R <= 8, bf16 epilogue, one group."""

    @property
    def warpgroups(self) -> int:
        return WARPGROUPS[self.variant]

    @property
    def inflight(self) -> int:
        return INFLIGHT[self.variant]

    @property
    def threads(self) -> int:
        return self.warpgroups * WG_THREADS

    @property
    def streamed(self) -> bool:
        return True                           # R <= 8 only (grid rejects more)

    @property
    def whole_tiles(self) -> bool:
        return self.split_k == 1

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.threads, 1, 1)

    @property
    def warps(self) -> int:
        return self.threads // 32

    @property
    def tiles64(self) -> int:
        return self.n // TILE_M

    @property
    def slice_k(self) -> int:
        return self.unit_k

    @property
    def steps(self) -> int:
        """k32 steps of a CTA's slice; each warpgroup takes wg_steps of them."""
        return self.slice_k // KSTEP

    @property
    def wg_steps(self) -> int:
        return self.steps // self.warpgroups

    @property
    def row_stride(self) -> int:
        return self.slice_k + ROW_PAD

    @property
    def red_in_x(self) -> bool:
        """Warpgroup j >= 1 puts its partials (2 KB) into its own part of the x region (dead
        once its wgmmas completed) when that part holds them; else regions of their own."""
        return self.wg_steps * B_STEP_BYTES >= WG_THREADS * 16

    def layout(self) -> dict[str, tuple[int, int]]:
        """smem regions: name -> (offset, bytes), in allocation order (the kernel's)."""
        regions = [("w", TILE_M * self.row_stride, 128), ("x", self.steps * B_STEP_BYTES, 128),
                   ("scales", ceil_div(2 * self.steps, 16) * 16, 16),
                   ("red", 0 if self.red_in_x else (self.warpgroups - 1) * WG_THREADS * 16,
                    16),
                   ("rowmax", ROW_TILE * 4, 16), ("mbar", 8, 8), ("flag", 16, 16)]
        out, at = {}, 0
        for name, size, align in regions:
            at = ceil_div(at, align) * align
            out[name] = (at, size)
            at += size
        return out

    @property
    def smem_bytes(self) -> int:
        off, size = self.layout()["flag"]
        return off + size + 256                   # + the allocator's alignment slack

    def grid(self, rows: int) -> tuple[int, int, int]:
        if not 1 <= rows <= ROW_TILE:
            raise ValueError(f"{self.name}: the QGMMA kernel takes 1 <= rows <= {ROW_TILE}, "
                             f"got {rows}")
        return (self.ctas, 1, 1)

    def workspace_bytes(self) -> int:
        """fp32 [ctas, 128 threads, 4] slice partials when split > 1."""
        return 0 if self.split_k == 1 else self.ctas * WG_THREADS * 16

    def counters_bytes(self) -> int:
        """u32 [tiles64] arrival counters (zero when bound, left zero) when split > 1."""
        return 0 if self.split_k == 1 else self.tiles64 * 4


def make_qg_spec(label: str, n: int, k: int, variant: str = VARIANT,
                 whole_k: bool = False) -> QgSpec:
    """whole_k: one K slice per tile whatever K (smem up to SMEM_BUDGET_WHOLE, one CTA per SM)."""
    if n % TILE_M or k % 128 or variant not in WARPGROUPS:
        raise ValueError(f"{label}: the QGMMA kernel needs N % {TILE_M} == 0 and K % 128 == 0 "
                         f"and a variant of {tuple(WARPGROUPS)}, got N={n}, K={k}, {variant!r}")
    if whole_k and n // TILE_M > H200_NUM_SMS:
        raise ValueError(f"{label}: {n // TILE_M} tiles of whole K are more than one wave")
    split = 1 if whole_k else choose_split(n // TILE_M, k)
    name = f"dense_w8a16_{label}_n{n}_k{k}_r{ROW_TILE}_bf16_{TAGS[variant]}"
    spec = QgSpec(name, n, k, 1, 1, "bf16", split, variant, k // split, n // TILE_M * split, 0)
    budget = SMEM_BUDGET_WHOLE if whole_k else SMEM_BUDGET
    if spec.smem_bytes > budget:
        raise ValueError(f"{label}: {spec.smem_bytes} bytes of smem, over {budget}")
    return spec


def qg_specs(cfg, tp: int) -> list[QgSpec]:
    """The candidates: QG_LABELS at the config's per-rank shapes (wq_b's `_sqg` is wired at
    R = 1: executor/stages/attn_proj.QGMMA_WQ_B_ROWS; the others are not)."""
    shapes = dense_shapes(cfg, tp)
    return [make_qg_spec(label, shapes[label][0], shapes[label][1], variant,
                         whole_k=label in WHOLE_K_LABELS)
            for label in QG_LABELS if label in shapes
            for variant in (VARIANT,) + ((VARIANT_WIDE,) if label in WIDE_LABELS else ())]


# ---- the x split -------------------------------------------------------------------------------

def _e4m3(v: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even E4M3 of float values within +-448 (cvt.rn.satfinite), as float32."""
    import ml_dtypes
    return np.asarray(v, np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)


def row_exponents(x_slice: np.ndarray) -> np.ndarray:
    """bf16 exponent field of max|x| per row of a [rows, kc] bf16 slice, floored at X_EXP_MIN."""
    bits = np.abs(x_slice).view(np.uint16).max(axis=1).astype(np.int64)
    return np.maximum((bits >> 7) & 0xFF, X_EXP_MIN)


def split_x(spec: QgSpec, x: np.ndarray):
    """(hi, lo, inv_s): float32 [rows, K] E4M3 values of the two parts and float64 [rows, split]
    1 / s per row and slice: x ~= (hi + lo) * inv_s of its slice (module docstring)."""
    if x.dtype != BF16 or x.ndim != 2 or x.shape[1] != spec.k:
        raise TypeError(f"{spec.name}: x must be bf16 [rows, {spec.k}], got {x.dtype} {x.shape}")
    kc = spec.slice_k
    hi, lo = np.empty(x.shape, np.float32), np.empty(x.shape, np.float32)
    inv_s = np.empty((x.shape[0], spec.split_k))
    for sl in range(spec.split_k):
        xs = x[:, sl * kc:(sl + 1) * kc]
        e = row_exponents(xs)
        s = np.ldexp(np.float32(1.0), (134 - e)).astype(np.float32)[:, None]
        scaled = (xs.astype(np.float32) * s).astype(np.float16)          # f32 mul, f16 rn
        h = _e4m3(scaled)
        rest = (scaled - h.astype(np.float16)).astype(np.float16)        # exact in f16
        hi[:, sl * kc:(sl + 1) * kc], lo[:, sl * kc:(sl + 1) * kc] = h, _e4m3(rest)
        inv_s[:, sl] = np.ldexp(1.0, (e - 134))
    return hi, lo, inv_s


def split_dequant(spec: QgSpec, x: np.ndarray) -> np.ndarray:
    """float64 x~ = (hi + lo) / s [rows, K]: the activations the kernel multiplies."""
    hi, lo, inv_s = split_x(spec, x)
    per_k = np.repeat(inv_s, spec.slice_k, axis=1)
    return (hi.astype(np.float64) + lo.astype(np.float64)) * per_k


def split_error_bound(spec: QgSpec, x: np.ndarray, w_abs: np.ndarray) -> np.ndarray:
    """[rows, N] bound of |x . W - x~ . W|: 2^-10 / s per element (module docstring)."""
    _, _, inv_s = split_x(spec, x)
    per_k = np.repeat(inv_s, spec.slice_k, axis=1) * 2.0**-10
    return per_k @ w_abs.T


def dense_qgmma_ref(spec: QgSpec, x: np.ndarray, w_f64: np.ndarray) -> np.ndarray:
    """float64 [rows, N]: x~ . W exactly (w_f64 = the dequantized weight, fp8_block_dequantize):
    what the kernel computes before its accumulation roundings and the bf16 output."""
    return split_dequant(spec, x) @ w_f64.T


def qgmma_tolerance(spec: QgSpec, x: np.ndarray, w_f64: np.ndarray) -> np.ndarray:
    """[rows, N] bound of |kernel - dense_qgmma_ref| (module docstring)."""
    xt = split_dequant(spec, x)
    abs_sum = np.abs(xt) @ np.abs(w_f64).T
    exact = xt @ w_f64.T
    folds = 2.0 * (spec.k // KSTEP + spec.split_k + 2) * 2.0**-24
    acc = (QG_ACC_REL + folds) * abs_sum
    return acc + 2.0**-8 * (np.abs(exact) + acc) + 2.0**-133


# ---- a CPU model of the kernel's arithmetic (tests: the bound holds, and catches wrong elements) --

def _tc_round(v: np.ndarray, mag: np.ndarray, bits: int) -> np.ndarray:
    """v truncated toward zero to a multiple of 2^(floor(log2 mag) - bits): a tensor-core sum
    that keeps `bits` bits below the largest term it aligned to."""
    quantum = np.exp2(np.floor(np.log2(np.maximum(mag, 2.0**-300))) - bits)
    return np.trunc(v / quantum) * quantum


def qgmma_model(spec: QgSpec, x: np.ndarray, w_e4m3: np.ndarray, s: np.ndarray,
                acc_bits: int = 13, *, fault=None) -> np.ndarray:
    """float32 [rows, N] before the bf16 rounding: the kernel's order of operations with each
    k-step's QGMMA pair modelled as truncating sums (`_tc_round`, acc_bits below the largest
    term), folds and the slice sum in fp32. `fault(step, values)` may corrupt a step's products
    (tests: a wrong element must fail the bound)."""
    hi, lo, inv_s = split_x(spec, x)
    w = w_e4m3.astype(np.float32).astype(np.float64)                  # [N, K] e4m3 values
    rows, half = x.shape[0], spec.wg_steps
    out = np.zeros((rows, spec.n), np.float32)
    for sl in range(spec.split_k):
        wg_acc = []
        for wg in range(spec.warpgroups):
            acc = np.zeros((rows, spec.n), np.float32)
            for i in range(half):
                step = sl * spec.steps + wg * half + i
                ks = slice(step * KSTEP, (step + 1) * KSTEP)
                p_hi = hi[:, None, ks] * w[None, :, ks]                 # exact products
                p_lo = lo[:, None, ks] * w[None, :, ks]
                if fault is not None:
                    p_hi, p_lo = fault(step, p_hi), fault(step, p_lo)
                d = _tc_round(p_hi.sum(-1), np.abs(p_hi).max(-1), acc_bits)
                d = _tc_round(d + p_lo.sum(-1), np.maximum(np.abs(p_lo).max(-1), np.abs(d)),
                              acc_bits)
                f = np.exp2(s[np.arange(spec.n) // FP8_BLOCK, step].astype(np.float64) - 127
                            + SCALE_BIAS)
                acc = (acc.astype(np.float64) + d.astype(np.float32) * f).astype(np.float32)
            wg_acc.append(acc)
        total = wg_acc[0]
        for other in wg_acc[1:]:                                       # warpgroup order
            total = (total + other).astype(np.float32)
        part = (total * np.float32(2.0**-SCALE_BIAS)).astype(np.float32)
        part = (part * inv_s[:, sl:sl + 1].astype(np.float32)).astype(np.float32)
        out = (out + part).astype(np.float32)
    return out


# ---- the kernel's data placement (tests/test_dense_qgmma_cpu.py replays it) --------------------

def a_word_offsets(lane: int, step: int, row_stride: int) -> list[int]:
    """smem byte offsets (within a warp's 16 rows) of A registers a0..a3 of `lane` at k-step
    `step`: two 8-byte reads, row g and row g + 8 at bytes 8t..8t+7 of the step's 32-K block;
    a0 / a1 = their first words, a2 / a3 their second."""
    g, t = lane // 4, lane % 4
    lo = g * row_stride + KSTEP * step + 8 * t
    hi = lo + 8 * row_stride
    return [lo, hi, lo + 4, hi + 4]


def logical_k(actual: int) -> int:
    """The wgmma's K index j (0..31) that actual byte `actual` of the 32-K block feeds: A
    register a0 (k = 4t..4t+3) holds actual 8t..8t+3, a2 (k = 16+4t..) actual 8t+4..8t+7."""
    t, q = actual // 8, actual % 8
    return 4 * t + q if q < 4 else 16 + 4 * t + q - 4


def b_offset(step: int, part: int, token: int, actual: int) -> int:
    """smem byte of x part `part` (0 hi, 1 lo), token, actual byte of k-step `step` in the x
    region: B is K-major without swizzle, [k half][token][16 B] core matrices (LBO = SBO =
    128 B), logical k = 16 * half + byte."""
    j = logical_k(actual)
    return step * B_STEP_BYTES + part * 256 + (j // 16) * 128 + token * 16 + j % 16


def descriptor(start: int) -> int:
    """The wgmma smem matrix descriptor of a B tile at byte `start`: address >> 4 (bits 0-13),
    leading byte offset 128 >> 4 (bits 16-29), stride byte offset 128 >> 4 (bits 32-45), no
    swizzle. K-major without swizzle, the leading offset is the K step between the two 16-byte
    core-matrix columns (PTX ISA, tcgen05 descriptor table: "the stride from the first column to
    the second column of the 8x2 tile"), the stride offset the step between 8-row groups along
    N, of which N = 8 has one: both are 128 here, so the bytes read do not depend on which is
    which."""
    return ((start >> 4) & 0x3FFF) | (8 << 16) | (8 << 32)


def check_scales(s: np.ndarray) -> None:
    if int(s.max(initial=0)) > MAX_SCALE_BYTE:
        raise ValueError(f"scale byte {int(s.max())} > {MAX_SCALE_BYTE}")


def random_wide_rows(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    """bf16 x [rows, k]: normal rows, a row with one huge element, one with elements spread over
    2^-40..2^20, a row of tiny values (~2^-100), one all zero, one of huge values (~2^100: its
    1 / s is 2^93, applied after the 2^-64) - the test inputs of the split."""
    x = rng.standard_normal((rows, k))
    if rows > 1:
        x[1, rng.integers(0, k)] = 3.0e4
    if rows > 2:
        x[2] *= np.exp2(rng.uniform(-40, 20, size=k))
    if rows > 3:
        x[3] *= 2.0**-100
    if rows > 4:
        x[4] = 0.0
    if rows > 5:
        x[5] *= 2.0**100
    return x.astype(np.float32).astype(BF16)
