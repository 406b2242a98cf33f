"""lm_head (BF16, vocab-parallel) with the fused split-vocabulary argmax: specs, rules, reference.

Per rank: logits[r, v] = sum_d x[r, d] * head[v, d] (fp32 accumulation) over the rank's V_l vocab
rows (model doc §2.3 steps 4-5). Two kernels per shape:
  "argmax"  out = int32 [rows, 2]: (f32 bits of max_v logits[r, v], argmax_v + vocab_offset),
            ties to the lower index, exactly `kernels.head_ref.local_argmax` of the kernel's
            logits; the ranks then exchange 8 B per row and `head_ref.pick_across_ranks` decides.
  "logits"  out = fp32 [rows, V_l] (for a caller that samples).

PTX ABI: (u64 x, u64 weight, u64 out, u64 keys, u64 counters, u32 rows, u32 vocab_offset).
`keys` (u64 [MAX_ROWS]) and `counters` (u32 [max_passes]) are the argmax's cross-CTA state: zero
when bound, left zero by every launch (the last CTA to arrive publishes and resets them); the
logits kernel ignores both (pass any valid pointer).

How: a warp owns 16 vocab rows (an mma.sync m16n8k16 A tile, bf16 weights straight from memory)
and the whole hidden dimension, so every logit is summed in the same order whichever warp or CTA
computes it (duplicate vocab rows give bit-identical logits: ties are real ties). Per pass of
8 * row_tiles rows, each warp keeps the best (value, index) per row over its tiles, the CTA
combines its warps, then one 64-bit `red.max` per row and CTA on the key
(ordered(value) << 32 | ~index): the largest value wins, and on equal values the larger ~index,
i.e. the lower index. The order of the atomics cannot change the result.

Ordering of values: -0 is canonicalised to +0 (numpy's argmax sees them equal); a NaN with the
sign bit clear beats every number (numpy's argmax returns the first NaN), one with it set loses
to every number. Constraints: D % 32 == 0, V_l % 16 == 0, 1 <= rows <= MAX_ROWS.

Bytes that must move per launch: weights V_l*D*2 + x rows*D*2 + out (rows*8 or rows*V_l*4).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.common_ref import BF16, H200_NUM_SMS, ceil_div, check_rows, params_dict
from kernels.head_ref import head_logits, local_argmax

WARP = 32
CTA_WARPS = 4
TILE_N = 16                  # vocab rows per warp tile (mma M)
ROW_TILE = 8                 # x rows per mma (mma N)
CHUNK_K = 32                 # hidden per warp step: 4 threads x 8 bf16 of one vocab row
MAX_ROWS = 192
CTAS_PER_SM = 3              # persistent grid: tiles strided over 3 CTAs per SM
MODES = ("argmax", "logits")
ROW_TILE_CHOICES = (1, 4)
VARIANTS = ("mma", "stream")   # register-prefetch kernel; smem-streamed kernel (R <= 8)
STREAM_WARPS = 8               # warps of the streamed kernel
STREAM_MAX_UNIT_K = 512        # hidden values per streamed unit (16 rows x 1 KB per stage)
STREAM_SMEM_BUDGET = 160 * 1024
PARAMS = (("x", "u64"), ("weight", "u64"), ("out", "u64"), ("keys", "u64"),
          ("counters", "u64"), ("rows", "u32"), ("vocab_offset", "u32"))


@dataclass(frozen=True)
class LmHeadSpec:
    """One compiled lm_head: vocab shard rows, hidden, rows per pass, argmax or logits."""

    name: str
    vocab: int                              # V_l, vocab rows of this rank
    hidden: int                             # D
    row_tiles: int = 1
    mode: str = "argmax"
    variant: str = "mma"
    unit_k: int = 0                         # stream: hidden values per unit (one smem stage)
    ctas: int = 0                           # stream: grid size (one wave, whole tiles per CTA)
    stages: int = 0                         # stream: smem ring depth

    @property
    def params(self) -> tuple[tuple[str, str], ...]:
        return PARAMS

    @property
    def block(self) -> tuple[int, int, int]:
        return ((STREAM_WARPS if self.variant == "stream" else CTA_WARPS) * WARP, 1, 1)

    @property
    def tiles(self) -> int:
        return self.vocab // TILE_N

    @property
    def ksteps(self) -> int:
        return self.hidden // self.unit_k

    @property
    def chunks(self) -> int:
        return self.unit_k // CHUNK_K

    @property
    def stage_bytes(self) -> int:
        """A unit in smem: per 32-value chunk, [row half g / g+8][lane] x 16 B (1 KB)."""
        return TILE_N * self.unit_k * 2

    def tile_range(self, cta: int) -> tuple[int, int]:
        """Whole tiles per CTA: every logit is summed by the same code path, in the same order."""
        return self.tiles * cta // self.ctas, self.tiles * (cta + 1) // self.ctas

    @property
    def rows_per_pass(self) -> int:
        return ROW_TILE * self.row_tiles

    @property
    def max_passes(self) -> int:
        return ceil_div(MAX_ROWS, self.rows_per_pass)

    @property
    def num_ctas(self) -> int:
        return min(ceil_div(self.tiles, CTA_WARPS), CTAS_PER_SM * H200_NUM_SMS)

    @property
    def smem_bytes(self) -> int:
        if self.variant == "stream":
            # ring + warp partials + per-row CTA keys (2 halves) + flag + slack
            return (self.stages * self.stage_bytes + STREAM_WARPS * TILE_N * ROW_TILE * 4
                    + ROW_TILE * 2 * 8 + 16 + 256)
        # argmax: a 64-bit key per warp and row of a pass, plus the last-arrival flag.
        return CTA_WARPS * self.rows_per_pass * 8 + 16 if self.mode == "argmax" else 0

    def grid(self, rows: int) -> tuple[int, int, int]:
        check_rows(rows, self.name)
        if rows > MAX_ROWS:
            raise ValueError(f"{self.name}: rows={rows} exceeds MAX_ROWS={MAX_ROWS}")
        if self.variant == "stream":
            if rows > ROW_TILE:
                raise ValueError(f"{self.name}: the streamed kernel takes rows <= {ROW_TILE}, got "
                                 f"{rows} (use the r32 kernel)")
            return (self.ctas, 1, 1)
        return (self.num_ctas, 1, 1)

    def keys_bytes(self) -> int:
        return MAX_ROWS * 8

    def counters_bytes(self) -> int:
        return self.max_passes * 4

    def weight_bytes(self) -> int:
        return self.vocab * self.hidden * 2

    def bytes_moved(self, rows: int) -> int:
        out = rows * 8 if self.mode == "argmax" else rows * self.vocab * 4
        return self.weight_bytes() + rows * self.hidden * 2 + out

    def to_dict(self) -> dict:
        return {"family": "lm_head", "name": self.name, "vocab": self.vocab,
                "hidden": self.hidden, "row_tiles": self.row_tiles, "mode": self.mode,
                "variant": self.variant, "unit_k": self.unit_k, "ctas": self.ctas,
                "stages": self.stages, "params": params_dict(self.params),
                "block": list(self.block), "smem_bytes": self.smem_bytes,
                "num_ctas": self.num_ctas}


def make_spec(vocab: int, hidden: int, row_tiles: int = 1, mode: str = "argmax",
              variant: str | None = None) -> LmHeadSpec:
    """Validated spec; default variant "stream" for 8 rows per pass, "mma" for 32."""
    variant = variant or ("stream" if row_tiles == 1 else "mma")
    if variant not in VARIANTS or (variant == "stream" and row_tiles != 1):
        raise ValueError(f"lm_head variant {variant!r} with row_tiles {row_tiles}; expected one "
                         f"of {VARIANTS}, 'stream' only with row_tiles 1")
    if mode not in MODES:
        raise ValueError(f"lm_head mode {mode!r}; expected one of {MODES}")
    if row_tiles not in ROW_TILE_CHOICES:
        raise ValueError(f"lm_head row_tiles {row_tiles}; expected one of {ROW_TILE_CHOICES}")
    if vocab <= 0 or vocab % TILE_N or hidden <= 0 or hidden % CHUNK_K:
        raise ValueError(f"lm_head shard [{vocab}, {hidden}]: vocab rows must be a multiple of "
                         f"{TILE_N} and hidden a multiple of {CHUNK_K}")
    name = f"lm_head_bf16_v{vocab}_d{hidden}_r{ROW_TILE * row_tiles}_{mode}"
    if variant == "mma":
        return LmHeadSpec(name, vocab, hidden, row_tiles, mode)
    unit_k = max(d for d in range(CHUNK_K, min(hidden, STREAM_MAX_UNIT_K) + 1, CHUNK_K)
                 if hidden % d == 0)
    tiles = vocab // TILE_N
    ctas = min(H200_NUM_SMS, tiles)
    probe = LmHeadSpec(name, vocab, hidden, 1, mode, variant, unit_k, ctas, 1)
    fixed = probe.smem_bytes - probe.stage_bytes
    units_per_cta = ceil_div(tiles, ctas) * (hidden // unit_k)
    stages = min(units_per_cta, (STREAM_SMEM_BUDGET - fixed) // probe.stage_bytes)
    return LmHeadSpec(name, vocab, hidden, 1, mode, variant, unit_k, ctas, stages)


def lm_head_specs(cfg, tp: int) -> list[LmHeadSpec]:
    """Streamed r8 (R <= 8: 79.5 us vs 114.5 us for the mma r8 kernel, measured 2026-11-29) and
    mma r32 (R > 8)."""
    vocab = cfg.rank_shapes(tp).vocab
    return [make_spec(vocab, cfg.hidden_size, rt, mode) for mode in MODES
            for rt in ROW_TILE_CHOICES]


def spec_from_dict(d: dict) -> LmHeadSpec:
    """The spec a manifest records (`LmHeadSpec.to_dict` output)."""
    return LmHeadSpec(d["name"], d["vocab"], d["hidden"], d["row_tiles"], d["mode"],
                      d.get("variant", "mma"), d.get("unit_k", 0), d.get("ctas", 0),
                      d.get("stages", 0))


# ---- reference ---------------------------------------------------------------------------------

def check_inputs(x: np.ndarray, head: np.ndarray) -> None:
    if x.ndim != 2 or x.dtype != BF16:
        raise TypeError(f"lm_head x must be bf16 [rows, D], got {x.dtype} {x.shape}")
    if head.ndim != 2 or head.dtype != BF16 or head.shape[1] != x.shape[1]:
        raise TypeError(f"lm_head weight must be bf16 [V_l, {x.shape[1]}], got {head.dtype} "
                        f"{head.shape}")


def lm_head_logits_ref(x: np.ndarray, head: np.ndarray) -> np.ndarray:
    """fp32 logits [rows, V_l] (fp32 accumulation, order up to NumPy)."""
    check_inputs(x, head)
    return head_logits(x, head)


def lm_head_argmax_ref(logits: np.ndarray, vocab_offset: int) -> np.ndarray:
    """int32 [rows, 2] as the kernel writes it, from given logits: (f32 bits of max, index)."""
    values, index = local_argmax(np.where(logits == 0, np.float32(0), logits), vocab_offset)
    out = np.empty((logits.shape[0], 2), np.int32)
    out[:, 0] = values.astype(np.float32).view(np.int32)
    out[:, 1] = index.astype(np.int64).astype(np.int32)
    return out


def logits_tolerance(x: np.ndarray, head: np.ndarray) -> np.ndarray:
    """|kernel - exact| bound per logit: fp32 accumulation over D, gamma_D with a factor 2."""
    d = x.shape[1]
    abs_sum = np.abs(x.astype(np.float64)) @ np.abs(head.astype(np.float64)).T
    return 2.0 * (d - 1) * 2.0**-24 * abs_sum
