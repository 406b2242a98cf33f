"""The MoE router kernel: spec, grid and counter rules, byte formula, reference and error bounds.

One launch computes, for R rows of x [R, D] (BF16) and the gate weight W [E, D] (BF16):

  logits = x·Wᵀ (fp32 accumulation)                       -> logits [R, E] f32 (also an output)
  s = sqrt(softplus(logits)); the top-k of s + bias, ties to the lower expert index (best first)
  w = s[idx] / (Σ s[idx] + 1e-20) · routed_scaling_factor -> ids [R, k] i32, weights [R, k] f32

i.e. `moe_ref.route` (model doc §2.2 F1), in the MoE chain's input format (`executor/moe_chain.py`:
int32 ids and fp32 route weights, [R, k] row-major, slot order = best first).

How: grid = (E / 2 experts per CTA, row blocks of 16; variant `_rb32`: 32). A CTA holds its 2 experts' weight rows in
registers (loaded before the PDL wait) and computes their logits for the rows of its block; the
last CTA of a row block to arrive (acq_rel counter, reset by that CTA) selects and normalises,
a warp per row. The sum order (thread t: its vectors t, t + T, ... in order, 8 fma each; warp
butterfly; warps in order) is fixed, so equal weight rows give bitwise equal logits.

PTX ABI: (u64 x, u64 weight, u64 bias, u64 logits, u64 ids, u64 weights, u64 counters, u32 rows);
counters (i32 [row blocks]) must be zero before the first launch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.common_ref import ceil_div, check_rows, params_dict

EXPERTS_PER_CTA = 2
ROWS_PER_CTA = 16                  # default row block (the last CTA selects for its rows)
ROW_BLOCK_VARIANTS = (16, 32)
MAX_CTA_THREADS = 128
MAX_ROWS = 256
WARP = 32
ROWS_PER_STEP = 2                  # rows whose logits a CTA computes together
PARAMS = (("x", "u64"), ("weight", "u64"), ("bias", "u64"), ("logits", "u64"), ("ids", "u64"),
          ("weights", "u64"), ("counters", "u64"), ("rows", "u32"))


@dataclass(frozen=True)
class RouterSpec:
    name: str
    hidden: int
    experts: int
    topk: int
    scaling: float
    rows_per_cta: int = ROWS_PER_CTA
    params: tuple[tuple[str, str], ...] = PARAMS

    @property
    def threads(self) -> int:
        return min(MAX_CTA_THREADS, self.hidden // 8)

    @property
    def vecs_per_thread(self) -> int:
        return self.hidden // 8 // self.threads

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.threads, 1, 1)

    @property
    def smem_bytes(self) -> int:
        """Two slots of the warps' logit totals (one barrier per step), then the last-CTA flag."""
        return 4 * 2 * (self.threads // WARP) * EXPERTS_PER_CTA * ROWS_PER_STEP + 16

    def grid(self, rows: int) -> tuple[int, int, int]:
        check_rows(rows, self.name)
        if rows > MAX_ROWS:
            raise ValueError(f"{self.name}: {rows} rows; the counters plan holds {MAX_ROWS}")
        return (self.experts // EXPERTS_PER_CTA, ceil_div(rows, self.rows_per_cta), 1)

    def bytes_moved(self, rows: int) -> int:
        return router_bytes(rows, self.hidden, self.experts, self.topk)

    def to_dict(self) -> dict:
        return {"family": "router", "name": self.name, "hidden": self.hidden,
                "experts": self.experts, "topk": self.topk, "scaling": self.scaling,
                "params": params_dict(self.params), "block": list(self.block),
                "smem_bytes": self.smem_bytes, "rows_per_cta": self.rows_per_cta,
                "experts_per_cta": EXPERTS_PER_CTA}


def make_spec(hidden: int, experts: int, topk: int, scaling: float,
              rows_per_cta: int = ROWS_PER_CTA) -> RouterSpec:
    threads = min(MAX_CTA_THREADS, hidden // 8)
    if hidden % 8 or threads % WARP or (hidden // 8) % threads:
        raise ValueError(f"router hidden {hidden}: expected a multiple of 256 (whole warps of "
                         "16-byte vectors)")
    if experts % EXPERTS_PER_CTA or not 0 < topk <= min(experts, WARP):
        raise ValueError(f"router: {experts} experts, top-{topk}: expected an even expert count "
                         f"and 0 < k <= min(E, {WARP})")
    if rows_per_cta not in ROW_BLOCK_VARIANTS:
        raise ValueError(f"router row block {rows_per_cta}; expected one of {ROW_BLOCK_VARIANTS}")
    suffix = "" if rows_per_cta == ROWS_PER_CTA else f"_rb{rows_per_cta}"
    return RouterSpec(f"router_e{experts}_d{hidden}_k{topk}{suffix}", hidden, experts, topk,
                      float(np.float32(scaling)), rows_per_cta)


def router_specs(cfg) -> list[RouterSpec]:
    if cfg.scoring_func != "sqrtsoftplus" or cfg.topk_method != "noaux_tc":
        raise ValueError(f"router kernel: scoring {cfg.scoring_func!r} / {cfg.topk_method!r}; "
                         "built for sqrtsoftplus / noaux_tc")
    return [make_spec(cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok,
                      cfg.routed_scaling_factor, rb) for rb in ROW_BLOCK_VARIANTS]


def counter_count(max_rows: int = MAX_ROWS, rows_per_cta: int = ROWS_PER_CTA) -> int:
    return ceil_div(max_rows, rows_per_cta)


def router_bytes(rows: int, hidden: int, experts: int, topk: int) -> int:
    """The gate weight (BF16) and bias once, x read, logits, ids and weights written."""
    return 2 * experts * hidden + 4 * experts + rows * (2 * hidden + 4 * experts + 8 * topk)


def predicted_us(rows: int, hidden: int = 5120, experts: int = 384) -> float:
    """Floor at the measured ~4.3 TB/s plus ~4 us of launch, weight round trip and selection,
    plus ~0.04 us a row of CUDA-core fma (2 x 5120 per expert pair and row, 192 pairs)."""
    return router_bytes(rows, hidden, experts, 6) / 4.3e6 + 4.0 + 0.04 * rows


# ---- reference -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class RouterResult:
    ids: np.ndarray          # [R, k] int32, best first
    weights: np.ndarray      # [R, k] f32
    selection: np.ndarray    # [R, E] f32: s + bias (what is ranked)


def select_from_logits(logits: np.ndarray, bias: np.ndarray, topk: int,
                       scaling: float) -> RouterResult:
    """The selection half of `moe_ref.route` from given fp32 logits (tests pass the kernel's own,
    so the GEMV's rounding does not decide the ids)."""
    logits = logits.astype(np.float32)
    scores = np.sqrt(np.logaddexp(np.float32(0.0), logits)).astype(np.float32)
    selection = (scores + bias.astype(np.float32)).astype(np.float32)
    ids = np.argsort(-selection, axis=1, kind="stable")[:, :topk]
    chosen = np.take_along_axis(scores, ids, axis=1)
    weights = chosen / (chosen.sum(axis=1, keepdims=True) + np.float32(1e-20))
    return RouterResult(ids.astype(np.int32), (weights * np.float32(scaling)).astype(np.float32),
                        selection)


def logits_f64(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    return x.astype(np.float64) @ weight.astype(np.float64).T


def logits_bound(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """|fp32 kernel logit - exact|: a thread sums 8·(D/8/T) products in sequence, then 5
    butterfly steps and T/32 warp totals: at most D/T·8/8 + 9 roundings of 2^-24 Σ|x·w| (bf16
    products are exact in fp32); doubled for safety of the count."""
    terms = np.abs(x.astype(np.float64)) @ np.abs(weight.astype(np.float64)).T
    threads = min(MAX_CTA_THREADS, x.shape[1] // 8)
    ops = x.shape[1] // threads + 9
    return 2 * ops * 2.0**-24 * terms


