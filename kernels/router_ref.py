"""The MoE router kernel: spec, grid and counter rules, byte formula, reference and error bounds.

One launch computes, for R rows of x [R, D] (BF16) and the gate weight W [E, D] (BF16):

  logits = x·Wᵀ (fp32 accumulation)                       -> logits [R, E] f32 (also an output)
  s = sqrt(softplus(logits)); the top-k of s + bias, ties to the lower expert index (best first)
  w = s[idx] / (Σ s[idx] + 1e-20) · routed_scaling_factor -> ids [R, k] i32, weights [R, k] f32

i.e. `moe_ref.route` (model doc §2.2 F1), in the MoE chain's input format (`executor/moe_chain.py`:
int32 ids and fp32 route weights, [R, k] row-major, slot order = best first).

How: grid = (E / 2 experts per CTA, row blocks of 16). A CTA holds its 2 experts' weight rows in
registers (loaded before the PDL wait) and computes their logits for the rows of its block; the
last CTA of a row block to arrive (acq_rel counter, reset by that CTA) selects and normalises,
a warp per row. The sum order (thread t: its vectors t, t + T, ... in order, 8 fma each; warp
butterfly; warps in order) is fixed, so equal weight rows give bitwise equal logits.

Variant `_tile8` (`one_pass`, kernels/router_tile.py; the decode buckets R <= 8): 3 experts per
CTA where E allows (128 CTAs for E = 384: one wave, one CTA per SM), D / 16 threads (320 at D =
5120: 2 vectors a thread), the 8 rows of its tile in one pass (one x round trip, one barrier),
and a selection that runs the tile's rows on separate warps with redux.sync arg-max rounds. Same
ABI, counters, outputs and tie rule.

Variant `_tile8p` (`polled`): the same tile, but no fence / counter / last CTA: each CTA stores its
logits' scores and selection keys also as tagged 64-bit words (one single-copy-atomic store) into
an exchange after the counters (`EXCHANGE_OFFSET`, u64 [rows, E]); CTA 0 of the row block polls its
rows' words until every tag is set (bounded by %globaltimer: POLL_TIMEOUT_NS), zeroes them and
selects. A poll that gives up (a bug or a lost producer: wrong outputs, never a hang) sets
the sticky timeout flag, the scratch's first i32 (the polled kernel has no counters): the host
reads it (the step's `ffn.router_counters`[0]), the GPU tests require it zero. The scratch
(`counters` pointer) is `scratch_bytes(max_rows)` long, zero before the first launch and left
zero by every launch (the flag too, unless a poll timed out).

PTX ABI: (u64 x, u64 weight, u64 bias, u64 logits, u64 ids, u64 weights, u64 counters, u32 rows);
counters (i32 [row blocks]) must be zero before the first launch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.common_ref import ceil_div, check_rows, params_dict

EXPERTS_PER_CTA = 2
ROWS_PER_CTA = 16                  # default row block (the last CTA selects for its rows)
ROW_BLOCK_VARIANTS = (16,)         # `_rb32` (32) lost at every bucket (run 17) and was deleted
MAX_CTA_THREADS = 128
MAX_ROWS = 256
WARP = 32
ROWS_PER_STEP = 2                  # rows whose logits a CTA computes together
ONE_PASS_ROWS = 8                  # the `_tile8` variant's row tile (rows of one pass)
MAX_BLOCK_THREADS = 1024
EXCHANGE_OFFSET = 4 * (MAX_ROWS // ONE_PASS_ROWS)   # bytes of counters before the exchange words
POLL_TIMEOUT_NS = 2_000_000        # `_tile8p`: a consumer gives up (wrong outputs, no hang)
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
    one_pass: bool = False             # the `_tile8` kernel (kernels/router_tile.py)
    experts_per_cta: int = EXPERTS_PER_CTA
    polled: bool = False               # `_tile8p`: tagged exchange words instead of the counter
    params: tuple[tuple[str, str], ...] = PARAMS

    @property
    def threads(self) -> int:
        if self.one_pass:
            return one_pass_threads(self.hidden)
        return min(MAX_CTA_THREADS, self.hidden // 8)

    @property
    def warps(self) -> int:
        return self.threads // WARP

    @property
    def vecs_per_thread(self) -> int:
        return self.hidden // 8 // self.threads

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.threads, 1, 1)

    @property
    def smem_bytes(self) -> int:
        """Two slots of the warps' logit totals (one barrier per step), then the last-CTA flag;
        one_pass: the warps' totals of the whole tile, the flag, then the bias (E floats)."""
        if self.one_pass:
            return 4 * self.warps * self.experts_per_cta * self.rows_per_cta + 16 + 4 * self.experts
        return 4 * 2 * self.warps * EXPERTS_PER_CTA * ROWS_PER_STEP + 16

    def grid(self, rows: int) -> tuple[int, int, int]:
        check_rows(rows, self.name)
        if rows > MAX_ROWS:
            raise ValueError(f"{self.name}: {rows} rows; the counters plan holds {MAX_ROWS}")
        return (self.experts // self.experts_per_cta, ceil_div(rows, self.rows_per_cta), 1)

    def bytes_moved(self, rows: int) -> int:
        return router_bytes(rows, self.hidden, self.experts, self.topk)

    def scratch_bytes(self, max_rows: int = MAX_ROWS) -> int:
        """The `counters` buffer: i32 row-block counters; polled: the exchange words after them."""
        if self.polled:
            return EXCHANGE_OFFSET + 8 * max_rows * self.experts
        return 4 * counter_count(max_rows, self.rows_per_cta)

    def to_dict(self) -> dict:
        return {"family": "router", "name": self.name, "hidden": self.hidden,
                "experts": self.experts, "topk": self.topk, "scaling": self.scaling,
                "params": params_dict(self.params), "block": list(self.block),
                "smem_bytes": self.smem_bytes, "rows_per_cta": self.rows_per_cta,
                "experts_per_cta": self.experts_per_cta, "one_pass": self.one_pass,
                "polled": self.polled}


def one_pass_threads(hidden: int) -> int:
    """`_tile8`: 2 vectors of 8 a thread where that gives whole warps (320 at D = 5120), else 1."""
    vectors = hidden // 8
    return vectors // 2 if vectors % (2 * WARP) == 0 else vectors


def one_pass_experts_per_cta(experts: int) -> int:
    """3 where E allows (E = 384: 128 CTAs, one per SM in one wave), else 2."""
    return 3 if experts % 3 == 0 else EXPERTS_PER_CTA


def make_spec(hidden: int, experts: int, topk: int, scaling: float,
              rows_per_cta: int = ROWS_PER_CTA, one_pass: bool = False,
              polled: bool = False) -> RouterSpec:
    threads = one_pass_threads(hidden) if one_pass else min(MAX_CTA_THREADS, hidden // 8)
    if hidden % 8 or threads % WARP or (hidden // 8) % threads or threads > MAX_BLOCK_THREADS:
        raise ValueError(f"router hidden {hidden}: expected a multiple of 256 (whole warps of "
                         "16-byte vectors)")
    if experts % EXPERTS_PER_CTA or not 0 < topk <= min(experts, WARP):
        raise ValueError(f"router: {experts} experts, top-{topk}: expected an even expert count "
                         f"and 0 < k <= min(E, {WARP})")
    if polled and not one_pass:
        raise ValueError("router: polled is a variant of the one-pass kernel")
    if one_pass:
        if rows_per_cta != ONE_PASS_ROWS:
            raise ValueError(f"router one-pass row tile {rows_per_cta}; expected {ONE_PASS_ROWS}")
        return RouterSpec(f"router_e{experts}_d{hidden}_k{topk}_tile{rows_per_cta}"
                          + ("p" if polled else ""), hidden, experts, topk,
                          float(np.float32(scaling)), rows_per_cta, True,
                          one_pass_experts_per_cta(experts), polled)
    if rows_per_cta not in ROW_BLOCK_VARIANTS:
        raise ValueError(f"router row block {rows_per_cta}; expected one of {ROW_BLOCK_VARIANTS}")
    suffix = "" if rows_per_cta == ROWS_PER_CTA else f"_rb{rows_per_cta}"
    return RouterSpec(f"router_e{experts}_d{hidden}_k{topk}{suffix}", hidden, experts, topk,
                      float(np.float32(scaling)), rows_per_cta)


def spec_from_dict(sp: dict) -> RouterSpec:
    """The RouterSpec a manifest record's spec dict was built from (KeyError/ValueError if not)."""
    return make_spec(sp["hidden"], sp["experts"], sp["topk"], sp["scaling"], sp["rows_per_cta"],
                     sp.get("one_pass", False), sp.get("polled", False))


def router_specs(cfg) -> list[RouterSpec]:
    """The default (row blocks of 16), the one-pass `_tile8` and `_tile8p`, in that order."""
    if cfg.scoring_func != "sqrtsoftplus" or cfg.topk_method != "noaux_tc":
        raise ValueError(f"router kernel: scoring {cfg.scoring_func!r} / {cfg.topk_method!r}; "
                         "built for sqrtsoftplus / noaux_tc")
    args = (cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok,
            cfg.routed_scaling_factor)
    return ([make_spec(*args, rb) for rb in ROW_BLOCK_VARIANTS]
            + [make_spec(*args, ONE_PASS_ROWS, one_pass=True, polled=p) for p in (False, True)])


def counter_count(max_rows: int = MAX_ROWS, rows_per_cta: int = ROWS_PER_CTA) -> int:
    return ceil_div(max_rows, rows_per_cta)


def router_bytes(rows: int, hidden: int, experts: int, topk: int) -> int:
    """The gate weight (BF16) and bias once, x read, logits, ids and weights written."""
    return 2 * experts * hidden + 4 * experts + rows * (2 * hidden + 4 * experts + 8 * topk)


def predicted_us(rows: int, hidden: int = 5120, experts: int = 384,
                 one_pass: bool = False, polled: bool = False) -> float:
    """Floor at the measured ~4.3 TB/s plus ~4 us of launch, weight round trip and selection,
    plus ~0.04 us a row of CUDA-core fma (2 x 5120 per expert pair and row, 192 pairs).
    one_pass, calibrated on the default's measured 11.8 us (R = 1, alone, L2 flushed): one x
    round trip and barrier a tile of 8 instead of one per 2 rows (~1 us each) and the tile's rows
    selected in parallel at ~0.4 us instead of ~1 us a row per warp: ~8.4 us + ~1.5 us a wave
    of 132 CTAs (128 CTAs a tile); polled: ~1.2 us less (no fence, atomic and reload)."""
    if not one_pass:
        return router_bytes(rows, hidden, experts, 6) / 4.3e6 + 4.0 + 0.04 * rows
    ctas = ceil_div(rows, ONE_PASS_ROWS) * experts // one_pass_experts_per_cta(experts)
    return (router_bytes(rows, hidden, experts, 6) / 4.3e6 + 7.5 + 1.5 * ceil_div(ctas, 132)
            - 1.2 * polled)


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
    # the `_tile8` kernel's count (D/8/T·8 + 5 + T/32 - 1 with more threads) is smaller
    threads = min(MAX_CTA_THREADS, x.shape[1] // 8)
    ops = x.shape[1] // threads + 9
    return 2 * ops * 2.0**-24 * terms


