"""Monte-Carlo of the routed-MoE GPU test's tolerance at one shape (docs/notes/moe-tolerance.md).

Draws what tests/gpu/test_moe_kernel.py draws for test_moe_chain_matches_reference
("one_expert" or "uniform", R rows, the DSpark-stage shape e128_k3 by default: D 5120, I 576,
top-3), computes the test's reference (kernels/moe_ref.routed_experts) and three other orders of
the same arithmetic, and prints per draw how close each comes to mk.check_routed_close's limit:

  f64   every sum in float64, rounded once (to bf16); SwiGLU in float64
  kern  the self-routed step chain's order (w13sr "bulk": 4 warps x 10 groups; w2 whole K):
        each mma k-step (32 products, exact) added to an fp32 accumulator (round to nearest),
        4 k-steps a 128-group, group partial x act scale by mul.rn/add.rn per warp slice, the
        slices in warp order; SwiGLU with ex2 (exact exp2 of the rounded fp32 argument, rounded)
  tcB   as kern, but each k-step's accumulation truncated toward zero to B fraction bits of the
        largest of |acc|, |k-step sum| and the k-step's product bound max|q| max|w| (a stand-in
        for a tensor-core accumulator narrower than fp32; Hopper's FP8 one is not documented)

Run:  OPENBLAS_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python docs/notes/moe_tolerance_sim.py \
      SEED0 COUNT [one_expert|uniform] [R] [MODELS, default f64,kern; tcB = B fraction bits]
One line per draw: seed, whether moe_ref before 24b93f6 gives the same y bitwise, then per
model: max err/limit of mk.check_routed_close, elements over, first over, the number of h13 / h
/ h-E4M3 code / ye elements that differ from the reference's, and the margins (<= 1 passes) of
the two-stage check (moe_ref.check_hidden_close, moe_ref.check_routed_given_hidden).
"""
from __future__ import annotations

import sys
import time

import numpy as np

from kernels import moe_ref
from loader import formats as f

HIDDEN, INTER, TOPK, POOL, LIMIT = 5120, 576, 3, 12, 10.0
W13_WARPS = 4
NEG_LOG2E = np.float32(-1.4426950408889634)


def random_fused(rng, n, k):
    """tests/gpu/test_moe_kernel.py `_random_fused` for one expert (same distributions)."""
    codes = rng.integers(0, 16, (1, n, k), dtype=np.uint8)
    codes[codes == 8] = 0
    offsets = rng.integers(3, 9, (1, n, k // 32)).astype(np.uint8)
    lo = rng.integers(110, 116, 1).astype(np.int32)
    fused = f.FusedE8M0(f.mxfp4_pack(codes), offsets,
                        (np.ldexp(np.float32(1), lo - 127) / 2).astype(np.float32), lo)
    return f.fused_e8m0_dequantize(fused)[0]


def draw(seed, kind, rows):
    rng = np.random.default_rng(seed)
    experts = [moe_ref.ExpertShard(random_fused(rng, 2 * INTER, HIDDEN),
                                   random_fused(rng, HIDDEN, INTER))
               for _ in range(TOPK if kind == "one_expert" else POOL)]
    pool = np.arange(len(experts))
    if kind == "one_expert":
        ids = np.tile(rng.permutation(pool), (rows, 1))
    else:
        ids = np.stack([rng.choice(pool, TOPK, replace=False) for _ in range(rows)])
    weights = rng.random((rows, TOPK)).astype(np.float32)
    x = moe_ref.round_bf16(rng.normal(0, 1, (rows, HIDDEN)))
    return x, moe_ref.RouterOutput(ids.astype(np.int64), weights), experts


def _padded(q, w, groups):
    qf = np.zeros((q.shape[0], groups * 128))
    qf[:, :q.shape[1]] = q.astype(np.float64)
    wf = np.zeros((w.shape[0], groups * 128))
    wf[:, :w.shape[1]] = w
    return qf, wf


def _truncate(acc, ref, bits):
    """acc truncated toward zero onto the grid 2^(floor(log2 ref) - bits)."""
    ulp = np.exp2(np.floor(np.log2(np.maximum(ref, 1e-300))) - bits)
    return np.trunc(acc / ulp) * ulp


def linear(a, w, model, slices):
    """bf16 of the W4A8 product a @ w.T under `model`; returns (bf16 values, E4M3 codes)."""
    q, s = f.quantize_act_fp8(a)
    if model == "ref":
        return moe_ref.round_bf16(moe_ref.w4a8_matmul(a, w)), q
    groups = s.shape[1]
    qf, wf = _padded(q, w, groups)
    if model == "f64":          # q * s is exact in float64; one sum, rounded once
        return moe_ref.round_bf16((qf * np.repeat(s, 128, axis=1)) @ wf.T), q
    bits = int(model[2:]) if model.startswith("tc") else None
    rows, out = qf.shape[0], wf.shape[0]
    qk = np.ascontiguousarray(qf.reshape(rows, -1, 32).transpose(1, 0, 2))  # [T, rows, 32]
    wk = np.ascontiguousarray(wf.reshape(out, -1, 32).transpose(1, 2, 0))   # [T, 32, out]
    qmax, wmax = np.abs(qk).max(axis=2), np.abs(wk).max(axis=1)
    per_slice = groups // slices
    total = None
    for sl in range(slices):
        g0, g1 = sl * per_slice, (sl + 1) * per_slice if sl < slices - 1 else groups
        steps = np.matmul(qk[4 * g0:4 * g1], wk[4 * g0:4 * g1])     # exact k-step sums
        acc = np.zeros((rows, out), np.float32)
        for j in range(g0, g1):
            part = np.zeros_like(acc)
            for t in range(4 * j, 4 * j + 4):
                exact = part.astype(np.float64) + steps[t - 4 * g0]
                if bits is not None:
                    bound = qmax[t][:, None] * wmax[t][None, :]
                    ref = np.maximum(np.maximum(np.abs(part), np.abs(steps[t - 4 * g0])), bound)
                    exact = _truncate(exact, ref, bits)
                part = exact.astype(np.float32)
            acc = (acc + part * s[:, j:j + 1]).astype(np.float32)
        total = acc if total is None else (total + acc).astype(np.float32)
    return moe_ref.round_bf16(total), q


def swiglu(gate, up, model):
    if model == "ref":
        return moe_ref.swiglu_clamped(gate, up, LIMIT)
    g = np.minimum(gate.astype(np.float32), np.float32(LIMIT))
    u = np.clip(up.astype(np.float32), -LIMIT, LIMIT).astype(np.float32)
    if model == "f64":
        g64 = g.astype(np.float64)
        return g64 / (1.0 + np.exp(-g64)) * u
    t = np.exp2((g * NEG_LOG2E).astype(np.float32).astype(np.float64)).astype(np.float32)
    return ((g / (t + np.float32(1))).astype(np.float32) * u).astype(np.float32)


def expert(x, shard, model):
    h13, _ = linear(x, shard.w13, model, W13_WARPS)
    h = moe_ref.round_bf16(swiglu(h13[:, :INTER], h13[:, INTER:], model))
    ye, hq = linear(h, shard.w2, model, 1)
    return h13, h, hq, ye


def chain(x, routing, experts, model):
    """y [R, D] and, per expert, (its rows, (h13, h, h E4M3 codes, ye)); plus h13, h by pair."""
    rows, topk = routing.experts.shape
    out = np.zeros((rows, topk, HIDDEN), np.float32)
    h13_pairs = np.zeros((rows * topk, 2 * INTER), np.float32)
    h_pairs = np.zeros((rows * topk, INTER), np.float32)
    inter = {}
    for e in np.unique(routing.experts):
        r, slot = np.nonzero(routing.experts == e)
        inter[int(e)] = (r, expert(x[r], experts[int(e)], model))
        out[r, slot] = inter[int(e)][1][3]
        h13_pairs[r * topk + slot], h_pairs[r * topk + slot] = inter[int(e)][1][:2]
    y = np.zeros((rows, HIDDEN), np.float32)
    for k in range(topk):
        y += routing.weights[:, k:k + 1] * out[:, k]
    return y, inter, h13_pairs, h_pairs


def two_stage(y, h, h13_ref, h_ref, routing, experts):
    """The proposed check's margins (<= 1 passes): h in moe_ref.hidden_envelope, then y against
    moe_ref.routed_from_hidden on this h within moe_ref.routed_allowance."""
    lo, hi = moe_ref.hidden_envelope(h13_ref, LIMIT)
    up = np.where(h >= h_ref, (h - h_ref) / (hi - h_ref), (h_ref - h) / (h_ref - lo))
    ye_ref, y_ref = moe_ref.routed_from_hidden(h, routing, experts)
    err = np.abs(y.astype(np.float64) - y_ref)
    return float(up.max()), float((err / moe_ref.routed_allowance(ye_ref, routing.weights)).max())


def ratio(y, y_ref):
    """mk.check_routed_close's per-element err / limit (the test's tolerance)."""
    rms = np.sqrt(np.mean(np.square(y_ref.astype(np.float64)), axis=1, keepdims=True))
    limit = 2.0**-7 * np.abs(y_ref) + 2.0**-5 * rms
    return np.abs(y.astype(np.float64) - y_ref) / limit


def routed_before_24b93f6(x, routing, experts):
    """moe_ref.routed_experts as it was before commit 24b93f6 (one call per expert id)."""
    rows, topk = routing.experts.shape
    out = np.zeros((rows, topk, x.shape[1]), np.float32)
    for e in np.unique(routing.experts):
        r, slot = np.nonzero(routing.experts == e)
        out[r, slot] = moe_ref.expert_forward(x[r], experts[int(e)], LIMIT, True)
    y = np.zeros((rows, x.shape[1]), np.float32)
    for k in range(topk):
        y += routing.weights[:, k:k + 1] * out[:, k]
    return y


def diffs(inter, inter_ref):
    n = np.zeros(4, np.int64)
    for e, (_, parts) in inter.items():
        ref = inter_ref[e][1]
        for i in range(4):
            a, b = parts[i], ref[i]
            if i == 2:
                a, b = a.view(np.uint8), b.view(np.uint8)
            n[i] += int(np.count_nonzero(a != b))
    return n


def main(argv):
    seed0, count = int(argv[1]), int(argv[2])
    kind = argv[3] if len(argv) > 3 else "one_expert"
    rows = int(argv[4]) if len(argv) > 4 else 192
    models = argv[5].split(",") if len(argv) > 5 else ("f64", "kern")
    for seed in range(seed0, seed0 + count):
        t0 = time.time()
        x, routing, experts = draw(seed, kind, rows)
        want = moe_ref.routed_experts(x, routing, experts, LIMIT)
        y_ref, inter_ref, h13_ref, h_ref = chain(x, routing, experts, "ref")
        assert np.array_equal(y_ref, want), "the instrumented chain is not moe_ref's"
        old_equal = np.array_equal(routed_before_24b93f6(x, routing, experts), want)
        fields = [f"seed {seed}", f"pre24b93f6_bitwise {old_equal}"]
        for model in models:
            y, inter, _, h = chain(x, routing, experts, model)
            h_margin, y_margin = two_stage(y, h, h13_ref, h_ref, routing, experts)
            rat = ratio(y, want)
            over = np.argwhere(rat > 1)
            first = tuple(int(i) for i in over[0]) if len(over) else None
            worst = np.unravel_index(np.argmax(rat), rat.shape)
            fields.append(f"{model} max {rat.max():.3f} at {tuple(int(i) for i in worst)} "
                          f"over {len(over)} first {first} "
                          f"diffs {diffs(inter, inter_ref).tolist()} "
                          f"new h {h_margin:.3f} y {y_margin:.3f}")
        fields.append(f"{time.time() - t0:.1f}s")
        print(" | ".join(fields), flush=True)


if __name__ == "__main__":
    main(sys.argv)
