"""CPU checks of the indexer kernels' reference, layouts and selection algorithm (kernels/indexer*).

Fresh random inputs every run. What is exact and what has a tolerance:
- the FP4 query (codes x power-of-two scales) equals `indexer_ref.fp4_quantize_dequantize` bit for
  bit: both round the same E2M1 grid with the same exact scale rule;
- the fragment-level model of the scores kernel (word addresses as the kernel computes them, the
  key permutation of the A fragment, group scales per k-step) equals `index_scores` within half an
  fp32 ulp (the reference's one rounding) plus 2^-40 of the magnitude (float64 order);
- the radix select replays to exactly `topk_entries` / `candidate_blocks` (ties, -0/+0, n <= k).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kernels import indexer_kernel_ref as ik
from kernels import indexer_ref, kvrecord_ref
from loader import formats
from loader.config import ModelConfig

RNG = np.random.default_rng()


def bf16_values(shape, scale=1.0):
    return formats.bf16_round(RNG.standard_normal(shape).astype(np.float32) * np.float32(scale))


# ---- query prep --------------------------------------------------------------------------------

@pytest.mark.parametrize("scale", [1e-3, 0.3, 1.0, 40.0])
def test_prep_query_equals_fp4_round_trip(scale):
    q = bf16_values((5, 32, 128), scale)
    q[0, 0, :32] = 0.0                        # an all-zero group: floor scale, codes 0
    q[1, 2, 32:64] *= np.float32(1e-6)        # a tiny group beside normal ones
    codes, scales, _ = ik.prep_query(q, bf16_values((5, 32)), 0.0625)
    want = indexer_ref.fp4_quantize_dequantize(q)
    np.testing.assert_array_equal(ik.dequantized_query(codes, scales), want)
    values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert set(np.unique(np.abs(values))) <= {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}
    assert np.all(np.log2(scales) == np.round(np.log2(scales)))


def test_head_weights_round_once():
    raw = bf16_values((3, 32))
    _, _, w = ik.prep_query(bf16_values((3, 32, 128)), raw, 128 ** -0.5 * 32 ** -0.5)
    np.testing.assert_array_equal(w, raw * np.float32(128 ** -0.5 * 32 ** -0.5))


# ---- layouts: a fragment-level model of the scores kernel --------------------------------------

def _fp8(words) -> np.ndarray:
    """float64 values of the 4 E4M3 bytes of an int32 word (lowest byte first)."""
    raw = np.array([words], np.int32).view(np.uint8)
    return raw.view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def key_of_fragment_row(m: int, t: int) -> int:
    """The key of A-fragment row m of tile t (the conflict-free permutation)."""
    return 4 * (m % 8) + 2 * t + m // 8


def kernel_model_scores(qfrag, qscale, qw, key_records, n_keys, rows):
    """Scores as the kernel's compute() addresses them: shared-memory words of the A fragments,
    qfrag words of the B fragments, group scale per k-step, key scale, ReLU, w; the tensor core's
    32-product sum done exactly (float64)."""
    tiles = qfrag.shape[1]
    qwords = np.frombuffer(qfrag.tobytes(), np.int32)
    scl, wts = qscale.reshape(-1), qw.reshape(-1)
    out = np.full((rows, n_keys), np.nan)
    for item in range(-(-n_keys // ik.ITEM_KEYS)):
        recs = np.zeros((ik.ITEM_KEYS, ik.KEY_BYTES), np.uint8)
        part = key_records[item * 32:(item + 1) * 32]
        recs[:part.shape[0]] = part
        smem = np.frombuffer(recs.tobytes(), np.int32)           # 33 words per key
        smem_f = np.frombuffer(recs.tobytes(), np.float32)
        for t in range(2):
            a = np.zeros((ik.GROUPS, 16, 32))
            keys = [key_of_fragment_row(m, t) for m in range(16)]
            for m, key in enumerate(keys):
                for kk in range(ik.GROUPS):
                    for c in range(4):
                        word = ik.KEY_WORDS * key + 8 * kk + c
                        a[kk, m, 4 * c:4 * c + 4] = _fp8(smem[word])
                        a[kk, m, 16 + 4 * c:20 + 4 * c] = _fp8(smem[word + 4])
            kscale = np.array([smem_f[ik.KEY_WORDS * key + 32] for key in keys], np.float64)
            for row in range(rows):
                total = np.zeros(16)
                for nt in range(tiles):
                    tile_row = row * tiles + nt
                    acc = np.zeros((16, 8))
                    for kk in range(ik.GROUPS):
                        b = np.zeros((32, 8))
                        for lane in range(32):
                            n, c = lane // 4, lane % 4
                            frag = (tile_row * ik.GROUPS + kk) * 32 + lane
                            b[4 * c:4 * c + 4, n] = _fp8(qwords[2 * frag])
                            b[16 + 4 * c:20 + 4 * c, n] = _fp8(qwords[2 * frag + 1])
                        s = [scl[((tile_row * ik.GROUPS + kk) * 4 + n // 2) * 2 + n % 2]
                             for n in range(8)]
                        acc += (a[kk] @ b) * np.array(s, np.float64)[None, :]
                    w = np.array([wts[(tile_row * 4 + n // 2) * 2 + n % 2] for n in range(8)],
                                 np.float64)
                    total += (np.maximum(acc * kscale[:, None], 0.0) * w[None, :]).sum(axis=1)
                for m, key in enumerate(keys):
                    if item * 32 + key < n_keys:
                        out[row, item * 32 + key] = total[m]
    return out


def test_lane_writes_match_fragment_rows():
    for lane in range(32):
        i, c = lane // 4, lane % 4
        assert key_of_fragment_row(i + 8 * (c % 2), c // 2) == 4 * i + c


@pytest.mark.parametrize("heads", [4, 32])
def test_fragment_layouts_reproduce_index_scores(heads):
    rows, n = 2, 45                                        # a partial second item
    q = bf16_values((rows, heads, 128))
    codes, scales, w = ik.prep_query(q, bf16_values((rows, heads)), 0.1)
    keys = RNG.standard_normal((n, 128)).astype(np.float32) * np.float32(3)
    records = kvrecord_ref.encode_index_key(keys)
    got = kernel_model_scores(ik.fragment_order(codes), ik.scale_order(scales),
                              ik.weight_order(w), records, n, rows)
    qd = ik.dequantized_query(codes, scales)
    decoded = kvrecord_ref.decode_index_key(records)
    want = indexer_ref.index_scores(qd, w, decoded)
    # the reference rounds its float64 sum to float32 once: half an fp32 ulp, plus float64 order
    tol = np.abs(want) * 2.0**-24 + ik.score_tolerance(qd, w, decoded) * 2.0**-28
    assert not np.isnan(got).any()
    assert np.all(np.abs(got - want) <= tol), np.max(np.abs(got - want) / tol)


def test_a_fragment_loads_are_bank_conflict_free():
    for t in range(2):
        for kk in range(4):
            for x in (0, 4):
                banks = {(ik.KEY_WORDS * (4 * (l // 4) + 2 * t) + l % 4 + 8 * kk + x) % 32
                         for l in range(32)}
                assert len(banks) == 32


def test_score_tolerance_catches_a_wrong_key():
    q = ik.dequantized_query(*ik.prep_query(bf16_values((1, 32, 128)), bf16_values((1, 32)),
                                            0.1)[:2])
    w = np.abs(bf16_values((1, 32))) + np.float32(0.1)
    keys = RNG.standard_normal((64, 128)).astype(np.float32)
    want = indexer_ref.index_scores(q, w, keys)
    wrong = indexer_ref.index_scores(q, w, keys[::-1].copy())
    tol = ik.score_tolerance(q, w, keys)
    assert np.mean(np.abs(wrong - want) > tol) > 0.9


# ---- selection ---------------------------------------------------------------------------------

def _scores_with_ties(n):
    kind = RNG.integers(4)
    if kind == 0:
        return RNG.standard_normal(n).astype(np.float32)
    if kind == 1:                                  # few distinct values: ties everywhere
        return RNG.integers(-3, 4, n).astype(np.float32)
    if kind == 2:                                  # +0 and -0 and a few positives
        s = np.where(RNG.random(n) < 0.5, np.float32(0.0), np.float32(-0.0))
        s[RNG.integers(0, n, 5)] = 1.0
        return s.astype(np.float32)
    base = RNG.standard_normal(n).astype(np.float32)  # near-equal: same top bits
    return (np.float32(1.0) + base * np.float32(1e-6)).astype(np.float32)


@pytest.mark.parametrize("n,k", [(1, 16), (16, 16), (17, 16), (1000, 16), (5000, 512),
                                 (70000, 512), (3000, 2048)])
def test_radix_select_equals_stable_topk(n, k):
    for _ in range(3):
        s = _scores_with_ties(n)
        got = ik.select_in_order(ik.ordered_key(s), k)
        want = indexer_ref.topk_entries(s[None], np.ones((1, n), bool), k)[0]
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n,k,ctas", [(1, 16, 8), (17, 16, 8), (1000, 16, 3), (5000, 512, 8),
                                      (70000, 512, 8), (3000, 2048, 8), (4097, 512, 5)])
def test_cluster_select_equals_radix_select(n, k, ctas):
    """The cluster variant's split (per-CTA histograms summed, per-CTA output offsets, slices of
    whole blocks as the kernel cuts them) selects exactly what the one-CTA radix select does."""
    slices = ik.topkc_slices(n, 8, ctas)
    for _ in range(3):
        keys = ik.ordered_key(_scores_with_ties(n))
        starts = [min(e0, n) for _, _, _, e0, _, _ in slices]
        np.testing.assert_array_equal(ik.cluster_select_ref(keys, k, starts),
                                      ik.select_in_order(keys, k))
        nb = -(-n // 8)
        bkeys = ik.ordered_key(RNG.standard_normal(nb).astype(np.float32))
        starts = [min(first, nb) for first, _, _, _, _, _ in slices]
        np.testing.assert_array_equal(ik.cluster_select_ref(bkeys, k, starts),
                                      ik.select_in_order(bkeys, k))


@pytest.mark.parametrize("n", [1, 8, 9, 1000, 131072, 131073, 300001])
def test_cluster_slices_cover_the_row_once(n):
    slices = ik.topkc_slices(n)
    blocks = [b for first, count, _, _, _, _ in slices for b in range(first, first + count)]
    entries = [e for _, _, _, e0, count_e, _ in slices for e in range(e0, e0 + count_e)]
    assert blocks == list(range(-(-n // 8))) and entries == list(range(n))
    for first, count, held, e0, count_e, held_e in slices:
        assert held == min(count, ik.TOPKC_SLICE // 8) and held_e <= ik.TOPKC_SLICE
        assert held_e == min(count_e, 8 * held)
    held_all = all(held == count for _, count, held, _, _, _ in slices)
    assert held_all == (n <= 131072), "a 128k-entry row is held in shared memory, no more"


@pytest.mark.parametrize("num_cands", [1, 7, 2048, 8193])
def test_cluster_candidate_slices_cover_every_slot_once(num_cands):
    """Candidates mode: slices of whole candidate blocks, in slot order; at 2048 candidate blocks
    (V4.1) every slot is held in shared memory."""
    slices = ik.topkc_candidate_slices(num_cands)
    slots = [i for first, count, _ in slices for i in range(first, first + count)]
    assert slots == list(range(8 * num_cands))
    assert all(first % 8 == 0 and held == min(count, ik.TOPKC_SLICE // 2)
               for first, count, held in slices)
    assert all(held == count for _, count, held in slices) == (num_cands <= 8192)
    keys = ik.ordered_key(_scores_with_ties(8 * num_cands))
    starts = [min(first, keys.size) for first, _, _ in slices]
    np.testing.assert_array_equal(ik.cluster_select_ref(keys, 512, starts),
                                  ik.select_in_order(keys, 512))


def test_cluster_topk_spec_geometry():
    spec = ik.make_topk_cluster_spec("both", 512, 1, 8, 2048)
    assert spec.kind == "topkc" and spec.grid(6) == (ik.TOPKC_CLUSTER, 6, 1)
    assert spec.cluster == (ik.TOPKC_CLUSTER, 1, 1) and spec.to_dict()["cluster_ctas"] == 8
    assert spec.topk == 512 and spec.topk_blocks == 2048
    lay = ik.topkc_smem_layout()
    assert lay["hist"] % 16 == 0                   # 16-byte DSMEM loads of 4 bins
    assert 2 * (spec.smem_bytes + 1024) <= 228 * 1024, "two CTAs per SM"
    with pytest.raises(ValueError, match="mode"):
        ik.make_topk_cluster_spec("sorted", 512, 1)
    with pytest.raises(ValueError, match="k_blocks"):
        ik.make_topk_cluster_spec("both", 512, 1, 8, 0)


def test_ordered_key_orders_like_floats():
    s = np.concatenate([RNG.standard_normal(1000).astype(np.float32),
                        np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, -1e-45], np.float32)])
    keys = ik.ordered_key(s)
    i, j = RNG.integers(0, s.size, (2, 5000))
    assert np.all((keys[i] > keys[j]) == (s[i] > s[j]))
    assert ik.ordered_key(np.float32(-0.0)) == ik.ordered_key(np.float32(0.0))


def _rows(positions, seqs):
    return np.array(positions, np.int64), np.array(seqs, np.int32)


def test_topk_ref_modes_agree_with_the_model_reference():
    k, nb, bs = 16, 4, 8
    pos, seq = _rows([40, 41, 42, 7, 0], [0, 0, 0, 1, -1])
    scores = RNG.standard_normal((5, 64)).astype(np.float32)
    ent = ik.topk_ref(scores, pos, seq, "entries", k, 1)
    for r in range(4):
        n = pos[r] + 1
        want = indexer_ref.topk_entries(scores[r:r + 1, :n], np.ones((1, n), bool), k)
        np.testing.assert_array_equal(ent[r], want[0])
    assert np.all(ent[4] == -1)
    blocks = ik.topk_ref(scores, pos, seq, "blocks", nb, 1, block_size=bs)
    for r in range(4):
        n = pos[r] + 1
        want = indexer_ref.candidate_blocks(scores[r:r + 1, :n], np.ones((1, n), bool),
                                            pos[r:r + 1], bs, nb)
        np.testing.assert_array_equal(blocks[r], want[0])
    cand = ik.topk_ref(scores, pos, seq, "candidates", k, 1, cands=blocks, block_size=bs)
    for r in range(4):
        n = pos[r] + 1
        inside = indexer_ref.candidate_entry_mask(blocks[r:r + 1], n, bs)
        want = indexer_ref.topk_entries(scores[r:r + 1, :n], inside, k)
        np.testing.assert_array_equal(cand[r], want[0])


def test_work_plan_covers_every_entry_once():
    pos, seq = _rows([100, 101, 102, 103, 104, 105, 7, 64, 0], [0, 0, 0, 0, 0, 0, 1, 2, -1])
    plan = ik.work_plan(pos, seq, 2, "dense")
    rows = pos.size
    total, prefix = plan[0], plan[1:rows + 2]
    units = plan[rows + 2:].reshape(rows, 4)
    assert total == prefix[-1] == sum(-(-u[3] // 32) for u in units)
    np.testing.assert_array_equal(units[:3], [[0, 6, 0, 53], [6, 1, 1, 4], [7, 1, 2, 32]])
    assert np.all(units[3:] == 0) and np.all(np.diff(prefix) >= 0)
    cands = np.array([[0, 3, 5, -1]] * 9, np.int32)
    cplan = ik.work_plan(pos, seq, 1, "candidates", cands)
    assert cplan[0] == 8                                 # 8 real rows, one item each


def test_specs_of_both_configs():
    from kernels import indexer
    for name in ("tiny", "v41-flash"):
        cfg = ModelConfig.preset(name)
        specs = indexer.specs(cfg, 4)
        kinds = {(s.kind, s.mode) for s in specs}
        assert ("topk", "blocks") in kinds and ("scores", "candidates") in kinds
        for s in specs:
            assert s.to_dict()["params"] == [list(p) for p in s.params]
            assert s.grid(6)[0] >= 1
            with pytest.raises(ValueError):
                s.grid(0)
        top = [s for s in specs if s.kind == "topk" and s.mode == "entries"]
        assert {s.topk for s in top} == {cfg.index_topk}
        variants = {(s.mode, s.topk, s.topk_blocks) for s in specs if s.kind == "topkc"}
        assert variants == {("entries", cfg.index_topk, 0),
                            ("blocks", cfg.candidate_topk_blocks, 0),
                            ("both", cfg.index_topk, cfg.candidate_topk_blocks),
                            ("candidates", cfg.index_topk, 0)}
        for s in specs:
            if s.kind == "topkc" and not s.timeline:
                assert s.params == (ik.TOPK_PARAMS if s.mode == "candidates" else ik.TOPKC_PARAMS)
        # The timeline twins (devicecheck attn_timeline) of kernels the bundle also carries.
        names = {s.name for s in specs}
        for s in (s for s in specs if s.timeline):
            assert ik.production_of(s).name in names and ik.timeline_twin(ik.production_of(s)) == s


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="page_size"):
        ik.make_scores_spec(32, "dense", 1, 48)
    with pytest.raises(ValueError, match="mode"):
        ik.make_topk_spec("sorted", 512, 1)


# ---- SWA insert (kernels/kv_publish_ref.py) ----------------------------------------------------

def test_swa_insert_ref_writes_real_rows_only():
    from kernels import kv_publish_ref as kp
    from kernels import rope_ref
    cfg = ModelConfig.preset("tiny")
    table = rope_ref.RopeTable.plain(cfg, 256)
    kv = formats.to_bf16(RNG.standard_normal((6, 512)).astype(np.float32))
    weight = (RNG.random(512) + 0.5).astype(np.float32)
    positions = RNG.integers(0, 256, 6)
    slots = np.array([3, 9, -1, 0, 15, -1])
    cache = np.full((16, 584), 0xFF, np.uint8)
    kp.swa_insert_ref(cache, kv, weight, 1e-6, table, positions, slots)
    real = slots >= 0
    untouched = np.setdiff1d(np.arange(16), slots[real])
    assert np.all(cache[untouched] == 0xFF)
    entries = kp.swa_entries(kv[real], weight, 1e-6, table, positions[real])
    np.testing.assert_array_equal(kvrecord_ref.decode_kv_record(cache[slots[real]])[:, 448:],
                                  entries[:, 448:])            # rope dims stored as bf16
    truth = rope_ref.rope_f64(
        (kv.astype(np.float64) / np.sqrt(np.mean(kv.astype(np.float64) ** 2, 1, keepdims=True)
                                         + 1e-6) * weight)[real][:, None, :],
        positions[real], table.inv_freq)[:, 0]
    # bf16 norm (2^-9 relative) then fp8 (2^-4 of the group's scale): 2^-4 * amax bounds both
    amax = np.abs(truth).max(axis=1, keepdims=True)
    got = kvrecord_ref.decode_kv_record(cache[slots[real]])
    assert np.all(np.abs(got - truth) <= amax * 2.0**-4)
    with pytest.raises(ValueError, match="beyond"):
        kp.swa_insert_ref(cache, kv, weight, 1e-6, table, positions, np.full(6, 16))


def test_held_topk_candidate_spec():
    """The round-7 top-k candidate keeping item keys in shared memory: same ABI and grid as the
    default, its keys after the default's shared memory, refused where it does not apply."""
    base = ik.make_topk_spec("entries", 512, 2)
    held = ik.make_topk_spec("entries", 512, 2, held=ik.TOPK_HELD)
    assert held.name == base.name + f"_s{ik.TOPK_HELD}"
    assert held.params == base.params and held.grid(6) == base.grid(6)
    assert held.smem_bytes == ik.topk_smem_bytes() + 4 * ik.TOPK_HELD
    assert ik.topk_smem_bytes() % 16 == 0 and held.to_dict()["held"] == ik.TOPK_HELD
    assert "held" not in base.to_dict()
    for bad in ({"mode": "candidates", "held": ik.TOPK_THREADS},
                {"mode": "entries", "held": ik.TOPK_THREADS + 1},
                {"mode": "entries", "held": 2 * ik.TOPK_HELD}):
        with pytest.raises(ValueError, match="held"):
            ik.make_topk_spec(bad["mode"], 512, 1, held=bad["held"])
