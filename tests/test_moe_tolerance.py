"""kernels/moe_ref: the F2 split (h13, h, ye by pair) is the composed reference bit for bit, and
the two-stage device bound (h in `hidden_envelope`, then y against `routed_from_hidden` on that h)
accepts another summation order, rejects real errors, and survives the h-requantization cascade
that the end-to-end tolerance (mk.check_routed_close) does not (docs/notes/moe-tolerance.md)."""
import numpy as np
import pytest

from kernels import moe_kernel_ref as mk
from kernels import moe_ref
from loader import formats as f

DIM, EXPERTS, TOPK, INTER, LIMIT = 256, 16, 6, 96, 10.0


def _shard(rng, scale=0.05):
    return moe_ref.ExpertShard(moe_ref.round_bf16(rng.normal(0, scale, (2 * INTER, DIM))),
                               moe_ref.round_bf16(rng.normal(0, scale, (DIM, INTER))))


def _draw(rng, rows, experts):
    ids = np.stack([rng.choice(len(experts), TOPK, replace=False) for _ in range(rows)])
    weights = rng.random((rows, TOPK)).astype(np.float32)
    routing = moe_ref.RouterOutput(ids.astype(np.int64), weights)
    return moe_ref.round_bf16(rng.normal(0, 1, (rows, DIM))), routing


def _float64_linear(a, w):
    """W4A8 with every sum in float64, rounded once: another order of the same products."""
    q, s = f.quantize_act_fp8(a)
    return moe_ref.round_bf16((q.astype(np.float64) * np.repeat(s, 128, axis=1)[:, :a.shape[1]])
                              @ w.astype(np.float64).T)


def _float64_chain(x, routing, experts):
    """(h [R·k, I], y [R, D]) of the whole F2 + combine in that order, SwiGLU in float64."""
    topk = routing.experts.shape[1]
    h = np.zeros((routing.experts.size, INTER), np.float32)
    ye = np.zeros((routing.experts.size, DIM), np.float32)
    for p, e in enumerate(routing.experts.reshape(-1)):
        h13 = _float64_linear(x[p // topk:p // topk + 1], experts[e].w13).astype(np.float64)
        g, u = np.minimum(h13[:, :INTER], LIMIT), np.clip(h13[:, INTER:], -LIMIT, LIMIT)
        h[p] = moe_ref.round_bf16(g / (1.0 + np.exp(-g)) * u)[0]
        ye[p] = _float64_linear(h[p:p + 1], experts[e].w2)[0]
    return h, moe_ref.combine(routing.weights, ye)


@pytest.mark.parametrize("quantize_acts", [True, False])
def test_split_reference_is_the_composed_one_bit_for_bit(quantize_acts):
    rng = np.random.default_rng()
    experts = [_shard(rng) for _ in range(EXPERTS)]
    aliased = [experts[e % 3] for e in range(EXPERTS)]     # shared shard objects, one call each
    x, routing = _draw(rng, 19, experts)
    for shards in (experts, aliased):
        parts = moe_ref.routed_parts(x, routing, shards, LIMIT, quantize_acts)
        ye = np.zeros_like(parts.ye)
        for p, e in enumerate(routing.experts.reshape(-1)):   # one pair at a time
            ye[p] = moe_ref.expert_forward(x[p // TOPK][None], shards[e], LIMIT, quantize_acts)[0]
        np.testing.assert_array_equal(parts.ye, ye)
        np.testing.assert_array_equal(parts.y, moe_ref.combine(routing.weights, ye))
        np.testing.assert_array_equal(
            parts.y, moe_ref.routed_experts(x, routing, shards, LIMIT, quantize_acts))
        again_ye, again_y = moe_ref.routed_from_hidden(parts.h, routing, shards, quantize_acts)
        np.testing.assert_array_equal(again_ye, parts.ye)
        np.testing.assert_array_equal(again_y, parts.y)
    with pytest.raises(ValueError, match="routed_from_hidden: h has 18 rows"):
        moe_ref.routed_from_hidden(parts.h[:18], routing, experts)


def test_two_stage_bound_accepts_another_summation_order():
    rng = np.random.default_rng()
    experts = [_shard(rng, 0.2) for _ in range(EXPERTS)]   # h13 reaches SwiGLU's clamp
    x, routing = _draw(rng, 24, experts)
    parts = moe_ref.routed_parts(x, routing, experts, LIMIT)
    h, y = _float64_chain(x, routing, experts)
    moe_ref.check_two_stage(y, h, parts, routing, experts, LIMIT)
    # The premise itself: a third of all h13 and ye one BF16 ulp off (either way) stays inside.
    h13 = _ulp_off(rng, parts.h13)
    moe_ref.check_hidden_close(moe_ref.expert_hidden(h13, LIMIT), parts.h13, LIMIT)
    moe_ref.check_routed_given_hidden(moe_ref.combine(routing.weights, _ulp_off(rng, parts.ye)),
                                      parts.y, parts.ye, routing.weights)


def _ulp_off(rng, v):
    """v (BF16 values) with a random third of its elements moved to a BF16 neighbour."""
    bits = f.to_bf16(v).view(np.uint16).astype(np.int32)
    step = rng.choice([-1, 0, 0, 0, 0, 1], v.shape) * (bits & 0x7FFF != 0)
    return (bits + step).astype(np.uint16).view(f.to_bf16(v).dtype).astype(np.float32)


def test_two_stage_bound_rejects_a_wrong_weight_group_and_a_wrong_code():
    rng = np.random.default_rng()
    experts = [_shard(rng) for _ in range(EXPERTS)]
    x, routing = _draw(rng, 24, experts)
    routing.weights[0, 0] = 1.0     # pair 0 weighs fully below (a tiny weight could hide it)
    parts = moe_ref.routed_parts(x, routing, experts, LIMIT)
    # w13: one 32-column scale group of one gate row of the first pair's expert off by a binade
    # (a wrong FP4 offset): that h column moves by ~8% of the row's rms in every row using it.
    e = int(routing.experts[0, 0])
    bad = list(experts)
    w13 = experts[e].w13.copy()
    w13[5, 64:96] *= 2
    bad[e] = moe_ref.ExpertShard(w13, experts[e].w2)
    wrong = moe_ref.routed_parts(x, routing, bad, LIMIT)
    with pytest.raises(AssertionError, match=r"outside the envelope; first at \(pair, column\) "
                                             r"\(\d+, 5\)"):
        moe_ref.check_hidden_close(wrong.h, parts.h13, LIMIT)
    # w2: y computed from an h whose largest element of pair 0 sits one E4M3 step lower (448 ->
    # 416 of its group scale) than the h reported: y row 0 moves by ~|h_max w2| / 14.
    q, s = f.quantize_act_fp8(parts.h[:1])
    k = int(np.argmax(np.abs(parts.h[0])))
    shifted = parts.h.copy()
    shifted[0, k] = np.float32(np.sign(parts.h[0, k]) * 416.0) * s[0, k // 128]
    _, y_dev = moe_ref.routed_from_hidden(shifted, routing, experts)
    assert q[0, k].astype(np.float32) in (448.0, -448.0)
    with pytest.raises(AssertionError, match=r"out of tolerance; first at \(0, "):
        moe_ref.check_routed_given_hidden(y_dev, parts.y, parts.ye, routing.weights)
    # a wrong expert for one pair, end to end
    ids = routing.experts.copy()
    ids[3, 2] = next(i for i in range(EXPERTS) if i not in ids[3])
    swapped = moe_ref.routed_parts(x, moe_ref.RouterOutput(ids, routing.weights), experts, LIMIT)
    with pytest.raises(AssertionError, match=r"first at \(pair, column\) \(20, "):
        moe_ref.check_hidden_close(swapped.h, parts.h13, LIMIT)
    poisoned = parts.y.copy()
    poisoned[2, 9] = np.nan
    with pytest.raises(AssertionError, match="non-finite"):
        moe_ref.check_routed_given_hidden(poisoned, parts.y, parts.ye, routing.weights)


def test_one_ulp_of_a_group_max_breaks_the_end_to_end_tolerance_not_the_two_stage_bound():
    """The r6b failure's mechanism, built by hand: a row whose h is two outliers (39.5 = the
    group's amax, 38.25 just above the 416 | 448 E4M3 midpoint after scaling). The amax one BF16
    ulp up (what another h13 summation order may give: 39.5 -> 39.75) lowers every code of the
    group; 38.25 goes from code 448 to 416, 2.8 in h, and y moves by ~5% of its row rms."""
    gate = np.full((1, INTER), LIMIT, np.float32)           # silu(10) = 9.99955
    up = np.zeros((1, INTER), np.float32)
    up[0, :2] = (3.95, 3.825)
    h13 = np.concatenate([gate, up], axis=1)
    h = moe_ref.expert_hidden(h13, LIMIT)
    assert h[0, :2].tolist() == [39.5, 38.25] and not h[0, 2:].any()
    w2 = np.zeros((DIM, INTER), np.float32)
    w2[:, 0] = 1.0
    w2[:, 1] = np.where(np.arange(DIM) % 2 == 0, 1.0, -1.0)
    shard = moe_ref.ExpertShard(np.zeros((2 * INTER, DIM), np.float32), w2)
    routing = moe_ref.RouterOutput(np.zeros((1, 1), np.int64), np.ones((1, 1), np.float32))
    _, y_ref = moe_ref.routed_from_hidden(h, routing, [shard])
    moved = h.copy()
    moved[0, 0] = 39.75                     # the next BF16 above 39.5 (spacing 0.25 in [32, 64))
    moe_ref.check_hidden_close(moved, h13, LIMIT)                 # one ulp: inside the envelope
    _, y_dev = moe_ref.routed_from_hidden(moved, routing, [shard])
    with pytest.raises(AssertionError, match="out of tolerance"):
        mk.check_routed_close(y_dev, y_ref)
    q_ref, q_dev = (f.quantize_act_fp8(v)[0][0, 1].astype(np.float32) for v in (h, moved))
    assert (q_ref, q_dev) == (448.0, 416.0)
    rms = np.sqrt(np.mean(np.square(y_ref.astype(np.float64))))
    assert np.abs(y_dev - y_ref).max() > 0.045 * rms
