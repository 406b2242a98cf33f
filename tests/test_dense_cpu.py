"""CPU tests of the dense W8A16, grouped wo_a and lm_head families: specs, references, and a NumPy
model of the kernels' register-level data movement (bit conversion, K permutation, mma fragments).

The fragment model replays, lane by lane, what kernels/dense.py and kernels/lm_head.py put in the
mma.sync.m16n8k16 registers (16-byte loads, e4m3 -> bf16 bit placement, prmt selectors), decodes
the registers with the PTX ISA's fragment layout, and checks that the product is x @ W^T: a wrong
selector, permutation or lane mapping fails here, before any GPU run.
"""
from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

from kernels import dense_ref as dr
from kernels import lm_head_ref as lr
from kernels import wo_a_ref as wr
from kernels.common_ref import BF16
from kernels.head_ref import greedy_tokens, pick_across_ranks
from loader.config import ModelConfig
from loader.formats import fp8_block_dequantize

E4M3 = ml_dtypes.float8_e4m3fn


# ---- the PTX m16n8k16 fragment layout (bf16 A/B, f32 C) ----------------------------------------

def a_coords(lane: int, reg: int, half: int) -> tuple[int, int]:
    g, t = lane // 4, lane % 4
    return g + 8 * (reg % 2), 2 * t + half + 8 * (reg // 2)


def b_coords(lane: int, reg: int, half: int) -> tuple[int, int]:
    g, t = lane // 4, lane % 4
    return 2 * t + half + 8 * reg, g


def c_coords(lane: int, reg: int) -> tuple[int, int]:
    g, t = lane // 4, lane % 4
    return g + 8 * (reg // 2), 2 * t + reg % 2


def bf16_halves(word: int) -> tuple[float, float]:
    pair = np.array([word & 0xFFFF, word >> 16], np.uint16).view(BF16)
    return float(pair[0]), float(pair[1])


def mma(a_regs, b_regs) -> np.ndarray:
    """[32 lanes][4] A words, [32][2] B words -> D [16, 8] float64 (exact products and sums)."""
    a, b = np.full((16, 16), np.nan), np.full((16, 8), np.nan)
    for lane in range(32):
        for reg in range(4):
            for half, v in enumerate(bf16_halves(a_regs[lane][reg])):
                a[a_coords(lane, reg, half)] = v
        for reg in range(2):
            for half, v in enumerate(bf16_halves(b_regs[lane][reg])):
                b[b_coords(lane, reg, half)] = v
    assert not np.isnan(a).any() and not np.isnan(b).any(), "fragments do not cover the tile"
    return a @ b


def prmt(a: int, b: int, selector: int) -> int:
    data = a | (b << 32)
    out = 0
    for i in range(4):
        byte = (data >> (8 * ((selector >> (4 * i)) & 0xF))) & 0xFF
        out |= byte << (8 * i)
    return out


def e4m3x4_to_bf16x2x2(word: int, scale_byte: int) -> tuple[int, int, float]:
    """The kernel's bit placement (value x 2^-120) and the factor its bf16x2 multiply applies."""
    even = ((word << 4) & 0x07F007F0) | ((word << 8) & 0x80008000)
    odd = ((word >> 4) & 0x07F007F0) | (word & 0x80008000)
    return even & 0xFFFFFFFF, odd, 2.0 ** (scale_byte - 7)


def words(raw: np.ndarray) -> list[int]:
    return [int(w) for w in np.ascontiguousarray(raw).view(np.uint32)]


# ---- bit conversion --------------------------------------------------------------------------

def test_e4m3_bit_placement_is_exact_for_every_code_and_scale():
    codes = np.arange(256, dtype=np.uint8)
    finite = (codes & 0x7F) != 0x7F
    true = codes.view(E4M3).astype(np.float64)
    for scale in (8, 100, 127, 134):
        for c in codes[finite]:
            even, _, factor = e4m3x4_to_bf16x2x2(int(c), scale)
            got = bf16_halves(even)[0] * factor
            want = true[c] * 2.0 ** (scale - 127)
            assert got == want and np.signbit(got) == np.signbit(want), (c, scale)


# ---- dense fragment model ----------------------------------------------------------------------

def dense_chunk_model(w_bytes: np.ndarray, scale_bytes: np.ndarray, x: np.ndarray) -> np.ndarray:
    """One warp, one 64-K chunk, 16 weight rows, 8 x rows, as kernels/dense.py moves the data."""
    d = np.zeros((16, 8))
    a_regs = [[None] * 4 for _ in range(32)]
    b_regs = [[None] * 2 for _ in range(32)]
    for j in range(4):
        factors = {}
        for lane in range(32):
            g, t = lane // 4, lane % 4
            wa = words(w_bytes[g, 16 * t:16 * t + 16])
            wb = words(w_bytes[g + 8, 16 * t:16 * t + 16])
            sbyte = int(scale_bytes[(16 * t) // 32])        # one 32-K group per thread
            ea, oa, fa = e4m3x4_to_bf16x2x2(wa[j], sbyte)
            eb, ob, _ = e4m3x4_to_bf16x2x2(wb[j], sbyte)
            factors[lane] = fa
            a_regs[lane] = [ea, eb, oa, ob]
            xw = words(x[g, 16 * t:16 * t + 16])
            b_regs[lane] = [prmt(xw[2 * j], xw[2 * j + 1], 0x5410),
                            prmt(xw[2 * j], xw[2 * j + 1], 0x7632)]
        # the scale multiply is per lane on A; the two K groups of the chunk have their own factor
        part = np.zeros((16, 8))
        for group in range(2):
            lanes = [ln for ln in range(32) if (ln % 4) // 2 == group]
            masked_a = [a_regs[ln] if ln in lanes else [0, 0, 0, 0] for ln in range(32)]
            part += mma(masked_a, b_regs) * factors[lanes[0]]
        d += part
    return d


def test_dense_fragment_model_matches_the_product():
    rng = np.random.default_rng()
    w = dr.random_e4m3(rng, (16, 64))
    scales = rng.integers(110, 125, size=2).astype(np.uint8)
    x = rng.standard_normal((8, 64)).astype(BF16)
    got = dense_chunk_model(w.view(np.uint8), scales, x)            # [n, r]
    w_f = fp8_block_dequantize(np.concatenate([w, w]), scales[None, :])[:16]
    want = w_f.astype(np.float64) @ x.astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-30)


def test_dense_epilogue_index_matches_the_c_fragment():
    # kernels/dense.py: accumulator q of lane ln -> n = n0 + ln//4 + 8*(q//2), r = 2*(ln%4) + q%2
    for ln in range(32):
        for q in range(4):
            assert c_coords(ln, q) == (ln // 4 + 8 * (q // 2), 2 * (ln % 4) + q % 2)


def test_lm_head_fragment_model_matches_the_product():
    rng = np.random.default_rng()
    w = rng.standard_normal((16, 32)).astype(BF16)
    x = rng.standard_normal((8, 32)).astype(BF16)
    d = np.zeros((16, 8))
    for j in range(2):
        a_regs, b_regs = [], []
        for lane in range(32):
            g, t = lane // 4, lane % 4
            wa, wb = words(w[g, 8 * t:8 * t + 8]), words(w[g + 8, 8 * t:8 * t + 8])
            xw = words(x[g, 8 * t:8 * t + 8])
            a_regs.append([wa[2 * j], wb[2 * j], wa[2 * j + 1], wb[2 * j + 1]])
            b_regs.append([xw[2 * j], xw[2 * j + 1]])
        d += mma(a_regs, b_regs)
    want = w.astype(np.float64) @ x.astype(np.float64).T
    np.testing.assert_allclose(d, want, rtol=1e-12)


# ---- argmax keys -------------------------------------------------------------------------------

def argmax_key(values: np.ndarray, index: np.ndarray) -> np.ndarray:
    """NumPy twin of lm_head.argmax_key: (ordered(value) << 32) | ~index as uint64."""
    v = (values.astype(np.float32) + np.float32(0)).view(np.uint32).astype(np.uint64)
    ordered = np.where(v >> 31, ~v & 0xFFFFFFFF, v | 0x80000000)
    return (ordered << 32) | (~index.astype(np.uint64) & 0xFFFFFFFF)


def test_argmax_keys_reproduce_numpy_argmax_with_ties_and_signed_zero():
    rng = np.random.default_rng()
    for _ in range(50):
        v = rng.integers(-3, 4, size=257).astype(np.float32)   # many exact ties
        v[rng.integers(0, 257, size=5)] = -0.0
        keys = argmax_key(v, np.arange(v.size))
        best = int(np.argmax(keys))
        ref = lr.lm_head_argmax_ref(v[None, :], 0)
        assert best == ref[0, 1] == int(np.argmax(v))
    ordered = argmax_key(np.array([-np.inf, -1, -0.0, 0, 1e-45, 3, np.inf, np.nan], np.float32),
                         np.zeros(8, np.int64)) >> 32
    assert np.all(np.diff(ordered.astype(np.int64)[[0, 1, 3, 4, 5, 6, 7]]) > 0)
    assert ordered[2] == ordered[3]


# ---- specs -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def v41():
    return ModelConfig.preset("v41-flash")


def test_dense_shapes_at_tp4_match_the_model_doc(v41):
    shapes = dr.dense_shapes(v41, 4)
    assert shapes["wqa_wkv"][:2] == (1792, 5120)
    assert shapes["wq_b"][:2] == (8192, 1280)
    assert shapes["wo_b"][:2] == (5120, 2048)
    assert shapes["shared_w13"][:2] == (1152, 5120)
    assert shapes["shared_w2"][:2] == (5120, 576)
    assert shapes["indexer_wq_b"][:2] == (4096, 1280)
    assert shapes["engram_wkv"][:2] == (6400, 6144)      # column-sharded (round 8), was 25600
    assert shapes["main_proj"][:2] == (5120, 15360)
    assert wr.wo_a_shape(v41, 4) == (2, 1024, 4096)
    assert lr.lm_head_specs(v41, 4)[0].vocab == 32320


@pytest.mark.parametrize("config", ["tiny", "v41-flash"])
def test_specs_are_valid_and_uniquely_named(config):
    cfg = ModelConfig.preset(config)
    specs = dr.dense_specs(cfg, 4) + wr.wo_a_specs(cfg, 4) + lr.lm_head_specs(cfg, 4)
    assert len({s.name for s in specs}) == len(specs)
    for s in specs:
        d = s.to_dict()
        assert d["name"] == s.name and d["params"] == [list(p) for p in s.params]
        from_dict = dr.DenseSpec.from_dict if isinstance(s, dr.DenseSpec) else lr.spec_from_dict
        assert from_dict(d) == s
        if s.variant != "mma":
            assert s.grid(8) == s.grid(1) == (s.ctas, 1, 1) and s.ctas <= 132
            with pytest.raises(ValueError, match="rows <= 8"):
                s.grid(9)
            continue
        assert s.grid(1)[0] >= 1 and s.grid(192) == s.grid(1)
        if isinstance(s, dr.DenseSpec):
            assert s.n % dr.TILE_N == 0 and s.split_k >= 1
            assert (s.workspace_bytes() > 0) == (s.split_k > 1)
            assert s.grid(1)[0] == s.tiles * s.split_k


def test_split_k_fills_the_gpu_for_narrow_layers(v41):
    by_label = {s.name: s for s in dr.dense_specs(v41, 4)}
    wqa = by_label["dense_w8a16_wqa_wkv_n1792_k5120_r32_bf16"]
    w13 = by_label["dense_w8a16_shared_w13_n1152_k5120_r32_bf16"]
    for s in (wqa, w13):
        assert s.grid(1)[0] >= 2 * 132 and s.split_k > 1
        assert s.workspace_bytes() == s.max_passes * s.split_k * s.tiles * 16 * s.rows_per_pass * 4
        assert s.counters_bytes() == s.max_passes * s.tiles * 4


def _variants_for(n: int, k: int) -> tuple[str, ...]:
    """The streamed variants a shape allows (stream_xts / xtb / xtu / xtw: scale rows of a
    multiple of 4 bytes; stream_xtb / xtu / xtw: the CTA's slice resident, i.e. not Engram wkv /
    main_proj)."""
    return tuple(v for v in dr.STREAM_VARIANTS
                 if (v not in ("stream_xts", "stream_xtb", *dr.TILE_VARIANTS) or k % 128 == 0)
                 and (v not in ("stream_xtb", *dr.TILE_VARIANTS) or n * k <= 12 * 2**20)
                 and (v not in dr.TILE_VARIANTS or n * k > 12 * 2**20 or _fits(n, k, v)))


def _fits(n: int, k: int, variant: str) -> bool:
    """stream_xtw's 16 warps' partials (or padded rows) can take the CTA past the smem budget
    (wo_b)."""
    try:
        dr.make_spec("probe", n, k, variant=variant)
    except ValueError as exc:
        assert "leave room for the next kernel" in str(exc)
        return False
    return True


@pytest.mark.parametrize("config", ["tiny", "v41-flash"])
def test_stream_layout_is_one_wave_that_covers_every_unit_once(config):
    """The streamed kernel's integer work split (kernels/dense_stream.py computes the same):
    contiguous unit ranges partition the units, cta_of_unit inverts them, only a CTA's first and
    last tile can be shared (its two workspace slots), the scale window holds every scale block
    the CTA reads, the ring fits the smem budget, and small layers are resident in the ring."""
    cfg = ModelConfig.preset(config)
    every_layer = [dr.make_spec(label, n, k, variant=v)           # ring layouts included
                   for label, (n, k, _) in dr.dense_shapes(cfg, 4).items()
                   for v in _variants_for(n, k)]
    defaults = [s for s in dr.dense_specs(cfg, 4) + wr.wo_a_specs(cfg, 4) if s.streamed]
    assert {s.variant for s in defaults} == set(dr.STREAM_VARIANTS), "a variant is not built"
    for s in every_layer + defaults:
        assert s.k % s.unit_k == 0 and s.unit_k % 32 == 0
        label = s.name.split("_n")[0].removeprefix("dense_w8a16_").removeprefix("wo_a_fp8_")
        assert (s.unit_k <= dr.STREAM_MAX_UNIT_K or f"_u{s.unit_k}" in s.name    # a candidate's
                or s.unit_k == dr.step_unit_k(label, s.k)                       # or the step's
                or (s.unrolled and s.unit_k == s.k))                            # xtu: a tile
        assert s.stage_bytes == (16 * s.row_stride if s.unrolled else 16 * 64 * -(-s.unit_k // 64))
        assert s.smem_bytes <= dr.STREAM_SMEM_BUDGET and 1 <= s.ctas <= 132
        owner = np.full(s.units, -1)
        for c in range(s.ctas):
            u0, u1 = s.unit_range(c)
            assert u1 > u0 and (owner[u0:u1] == -1).all()
            owner[u0:u1] = c
            assert all(s.cta_of_unit(u) == c for u in (u0, u1 - 1))
            tiles = range(u0 // s.ksteps, (u1 - 1) // s.ksteps + 1)
            shared = [t for t in tiles if s.cta_of_unit(t * s.ksteps)
                      != s.cta_of_unit((t + 1) * s.ksteps - 1)]
            assert set(shared) <= {tiles[0], tiles[-1]}
            if s.whole_tiles:                         # no workspace: no tile may be shared
                assert not shared and u0 % s.ksteps == 0 and u1 % s.ksteps == 0
            per = s.tiles_per_scale_row            # "swiglu": 8 gate + 8 up rows a tile
            window = (tiles[-1] // per - tiles[0] // per + 1) * (s.k // 32)
            assert window <= s.scale_half() and s.scale_window() == s.scale_half() * (
                2 if s.epilogue == "swiglu" else 1)
        assert (owner >= 0).all()
        per_cta = s.units_per_cta
        assert per_cta == max(s.unit_range(c)[1] - s.unit_range(c)[0] for c in range(s.ctas))
        assert (s.workspace_bytes() == 0) == (s.whole_tiles and not s.timeline)
        if s.weight_bytes() <= 12 * 2**20:
            assert s.stages >= per_cta, f"{s.name}: slice not resident ({s.stages} < {per_cta})"
        else:
            assert s.stages >= 2
        if s.bulk:           # tile slot i = tile as stored, whole-row copies, one mbarrier each
            assert s.ksteps * s.stage_bytes == 16 * s.row_stride and s.stages == per_cta
            assert s.row_stride == s.k + (dr.ROW_PAD if s.variant in dr.PADDED_VARIANTS else 0)
            assert s.variant not in dr.PADDED_VARIANTS or s.bulk_rows == 1    # a copy per row
            assert 16 % s.bulk_rows == 0 and s.bulk_rows * s.k <= dr.BULK_PIECE_MAX
            assert s.bulk_rows * s.k % 16 == 0 and s.tiles_per_cta <= dr.BULK_MBARRIERS


@pytest.mark.parametrize("config", ["tiny", "v41-flash"])
def test_stream_x_ring_and_accumulators_fit_two_ctas_per_sm(config):
    """stream_xt: x_slots units of x (8 words per chunk a warp owns) within
    STREAM_X_REGS, never more slots than the CTA has units (but 2, the ring's minimum), two
    accumulator sets only where a warp owns one chunk per unit; round 3's kernel unchanged;
    stream_xtu / xtw: one unit per tile, two sets, x resident up to X_RESIDENT_WORDS, xtw with
    WIDE_WARPS warps."""
    cfg = ModelConfig.preset(config)
    for label, (n, k, _) in dr.dense_shapes(cfg, 4).items():
        for v in _variants_for(n, k):
            s = dr.make_spec(label, n, k, variant=v)
            per_chunk = 8 * -(-s.chunks // dr.STREAM_WARPS)
            if v == "stream":
                assert (s.x_slots, s.accumulators) == (2, 1)
                continue
            if v in dr.TILE_VARIANTS:   # no x ring: resident (<= X_RESIDENT_WORDS) or x_ahead
                wide = v in dr.WIDE_VARIANTS
                assert s.accumulators == 2 and s.ksteps == 1 and s.unit_k == s.k
                assert s.warps == (dr.WIDE_WARPS if wide else dr.STREAM_WARPS)
                assert s.block == (32 * s.warps, 1, 1)
                words = 8 * -(-s.chunks // s.warps)
                assert s.x_resident == (s.groups == 1 and words <= dr.X_RESIDENT_WORDS)
                assert s.x_ahead == (dr.X_AHEAD_WIDE if wide else dr.X_AHEAD)
                continue
            assert 2 <= s.x_slots <= max(2, min(s.units_per_cta, dr.STREAM_X_SLOTS))
            assert s.x_slots == 2 or s.x_slots * per_chunk <= dr.STREAM_X_REGS
            assert s.accumulators == (2 if per_chunk == 8 else 1)


def test_step_variant_names_and_candidates(v41):
    """The step's R <= 8 kernel has the plain name; every other candidate carries its variant
    tag, a timeline kernel `_timeline` after it, so the picker (executor/launches/dense.py) and the
    stage buffers see the step's."""
    specs = dr.dense_specs(v41, 4) + wr.wo_a_specs(v41, 4)
    for s in specs:
        label = s.name.split("_n")[0].removeprefix("dense_w8a16_").removeprefix("wo_a_fp8_")
        default = dr.default_variant(label, s.row_tiles)
        tag = dr.VARIANT_TAGS[s.variant]
        name = s.name.removesuffix("_timeline") if s.timeline else s.name
        assert s.timeline == s.name.endswith("_timeline")
        name = name.removesuffix(f"_u{s.unit_k}")      # a unit-size candidate (round 6)
        assert name.endswith(f"_{s.epilogue}" if s.variant == default else f"_{tag}")
    plain_r8 = {s.name: s.variant for s in specs if s.row_tiles == 1 and s.name.endswith("_bf16")}
    assert plain_r8["dense_w8a16_wq_b_n8192_k1280_r8_bf16"] == dr.R8_VARIANT.get("wq_b", "mma")
    # round 5: no R <= 8 candidates are built (the round-4 losers are gone from the bundle)
    assert all(s.variant == dr.default_variant(
        s.name.split("_n")[0].removeprefix("dense_w8a16_").removeprefix("wo_a_fp8_"),
        s.row_tiles) for s in specs) == (not dr.R8_CANDIDATES)


def test_stream_summation_model_matches_the_product():
    """NumPy replay of the streamed kernel's order of sums: per CTA, per tile, its units' fp32
    partials; shared tiles summed in CTA order. Equals x @ W^T within the fp32 bound."""
    rng = np.random.default_rng()
    spec = dr.make_spec("model", 96, 640, epilogue="f32")
    spec = dr.DenseSpec(spec.name, 96, 640, 1, 1, "f32", 1, "stream", 64, 7, 4)  # tiles split
    w, sc = _weights(rng, 1, 96, 640)
    x = rng.standard_normal((8, 640)).astype(BF16)
    wf = fp8_block_dequantize(w[0], sc[0]).astype(np.float32)
    xf = x.astype(np.float32)
    partial = {}
    for c in range(spec.ctas):
        u0, u1 = spec.unit_range(c)
        for u in range(u0, u1):
            t, ks = divmod(u, spec.ksteps)
            rows, cols = slice(16 * t, 16 * t + 16), slice(ks * 64, ks * 64 + 64)
            prod = (xf[:, cols] @ wf[rows, cols].T).astype(np.float32)
            partial[(t, c)] = partial.get((t, c), np.float32(0)) + prod
    y = np.zeros((8, 96), np.float32)
    for (t, c) in sorted(partial):
        y[:, 16 * t:16 * t + 16] += partial[(t, c)]
    exact = x.astype(np.float64) @ wf.astype(np.float64).T
    bound = dr.dense_tolerance(x, wf, "f32")
    assert np.all(np.abs(y - exact) <= bound)
    assert len({c for (t, c) in partial if t == 0}) > 1, "the model must exercise shared tiles"


def test_bad_specs_and_rows_are_rejected():
    with pytest.raises(ValueError, match="multiples of 32"):
        dr.make_spec("bad", 48, 5120)
    with pytest.raises(ValueError, match="epilogue"):
        dr.make_spec("bad", 64, 64, epilogue="gelu")
    with pytest.raises(ValueError, match="row_tiles"):
        dr.make_spec("bad", 64, 64, row_tiles=2)
    spec = dr.make_spec("ok", 64, 64)
    for rows in (0, -1, 193, True):
        with pytest.raises(ValueError):
            spec.grid(rows)
    with pytest.raises(ValueError, match="multiple"):
        lr.make_spec(100, 5120)


# ---- references --------------------------------------------------------------------------------

def _weights(rng, groups, n, k):
    w = dr.random_e4m3(rng, (groups, n, k))
    s = rng.integers(112, 124, size=(groups, n // 32, k // 32)).astype(np.uint8)
    return w, s


@pytest.mark.parametrize("epilogue", dr.EPILOGUES)
def test_dense_ref_is_within_its_bound_of_float64(epilogue):
    """dense_ref within epilogue_expectation's bound of the float64 product (the bound the GPU
    tests use), and the bound tight enough to catch a wrong scale block (a factor of 2) and, for
    "swiglu", a gate paired with the wrong up row (the checkpoint's row order fed unpermuted)."""
    rng = np.random.default_rng()
    w, s = _weights(rng, 1, 64, 160)              # checkpoint rows ([w1; w3] for swiglu)
    x = rng.standard_normal((5, 160)).astype(BF16)
    res = rng.standard_normal((5, 64)).astype(np.float32 if epilogue == "add_f32" else BF16)
    spec = dr.make_spec("t", 64, 160, epilogue=epilogue,
                        swiglu_limit=7.0 if epilogue == "swiglu" else 0.0)
    w_kernel = dr.interleave_gate_up(w) if epilogue == "swiglu" else w
    got = dr.dense_ref(spec, x, w_kernel, s, res).astype(np.float64)
    assert got.shape == (5, spec.out_width)
    wf = fp8_block_dequantize(w[0], s[0]).astype(np.float64)
    want, bound = dr.epilogue_expectation(spec, x.astype(np.float64) @ wf.T,
                                          dr.dense_tolerance(x, wf, "f32"), res)
    assert np.all(np.abs(got - want) <= bound)
    s_bad = s.copy()
    s_bad[0, 0, 0] += 1
    bad = dr.dense_ref(spec, x, w_kernel, s_bad, res).astype(np.float64)
    assert np.any(np.abs(bad - want) > bound)
    if epilogue == "swiglu":
        unpaired = dr.dense_ref(spec, x, w, s, res).astype(np.float64)
        assert np.any(np.abs(unpaired - want) > bound)


def test_swiglu_rows_pair_a_threads_accumulators_and_scales():
    """Kernel row m of a "swiglu" tile t is gate row 8t + m (m < 8) or up row N/2 + 8t + m - 8:
    accumulators q and q + 2 of a lane (C rows g, g + 8) are a gate and its up, stored at
    column 8t + g; their scale blocks are gate row t // 4 and up row N/64 + t // 4 of the
    checkpoint's (kernels/dense.py, dense_stream.py read exactly those)."""
    n = 192
    order = dr.gate_up_order(n)
    assert sorted(order) == list(range(n))
    for tile in range(n // 16):
        for ln in range(32):
            for q in range(2):
                gate_m, up_m = c_coords(ln, q)[0], c_coords(ln, q + 2)[0]
                assert order[16 * tile + gate_m] == 8 * tile + ln // 4
                assert order[16 * tile + up_m] == n // 2 + 8 * tile + ln // 4
        for m in range(16):
            assert order[16 * tile + m] // 32 == (m >= 8) * (n // 64) + tile // 4
    w = np.arange(n * 3).reshape(1, n, 3)
    np.testing.assert_array_equal(dr.deinterleave_gate_up(dr.interleave_gate_up(w)), w)
    with pytest.raises(ValueError, match="swiglu"):
        dr.make_spec("bad", 96, 64, epilogue="swiglu", swiglu_limit=7.0)     # N % 64
    with pytest.raises(ValueError, match="swiglu"):
        dr.make_spec("bad", 128, 64, epilogue="swiglu", swiglu_limit=7.0, variant="stream")
    with pytest.raises(ValueError, match="swiglu"):
        dr.make_spec("bad", 128, 64, epilogue="swiglu")                       # no clamp
    with pytest.raises(ValueError, match="stream_xts"):
        dr.make_spec("bad", 128, 96, variant="stream_xts")                    # 3-byte rows


def test_wo_a_ref_is_blockwise_per_group():
    rng = np.random.default_rng()
    w, s = _weights(rng, 2, 32, 64)
    o = rng.standard_normal((3, 128)).astype(BF16)
    spec = dr.make_spec("grouped", 32, 64, groups=2, prefix="wo_a_fp8")
    got = wr.wo_a_ref(spec, o, w, s)
    for g in range(2):
        one = dr.make_spec("g", 32, 64)
        np.testing.assert_array_equal(got[:, 32 * g:32 * (g + 1)],
                                      dr.dense_ref(one, o[:, 64 * g:64 * (g + 1)], w[g:g + 1],
                                                   s[g:g + 1]))


def test_weight_checks_name_the_problem():
    rng = np.random.default_rng()
    w, s = _weights(rng, 1, 32, 64)
    with pytest.raises(TypeError, match="scales must be uint8"):
        dr.check_weight(w, s.astype(np.int32), 1, 32, 64, "layers.0.attn.wq_b")
    s[0, 0, 0] = 200
    with pytest.raises(ValueError, match="layers.0.attn.wq_b: scale byte 200"):
        dr.check_weight(w, s, 1, 32, 64, "layers.0.attn.wq_b")


def test_split_vocab_pick_equals_full_argmax_with_cross_rank_ties():
    rng = np.random.default_rng()
    x = rng.standard_normal((6, 64)).astype(BF16)
    head = rng.standard_normal((4 * 32, 64)).astype(BF16)
    head[70] = head[5]              # a tie across ranks 0 and 2: the lower index must win
    head[5] = (x[0].astype(np.float32) * 4).astype(BF16)
    head[70] = head[5]
    shards = [head[32 * r:32 * (r + 1)] for r in range(4)]
    pairs = [lr.lm_head_argmax_ref(lr.lm_head_logits_ref(x, sh), 32 * r)
             for r, sh in enumerate(shards)]
    values = np.stack([p[:, 0].view(np.float32) for p in pairs])
    index = np.stack([p[:, 1].astype(np.int64) for p in pairs])
    picked = pick_across_ranks(values, index)
    assert picked[0] == 5
    np.testing.assert_array_equal(picked, greedy_tokens(x, shards))


@pytest.mark.parametrize("config", ["tiny", "v41-flash"])
def test_lm_head_stream_owns_whole_tiles_in_one_wave(config):
    """Whole vocab tiles per CTA (every logit summed by the same path: ties stay ties), all tiles
    once, the unit divides the hidden size, the ring fits one CTA's shared memory."""
    for s in lr.lm_head_specs(ModelConfig.preset(config), 4):
        if s.variant != "stream":
            continue
        ranges = [s.tile_range(c) for c in range(s.ctas)]
        assert ranges[0][0] == 0 and ranges[-1][1] == s.tiles and s.ctas <= 132
        assert all(a[1] == b[0] and a[1] > a[0] for a, b in itertools.pairwise(ranges))
        assert s.hidden % s.unit_k == 0 and s.unit_k % lr.CHUNK_K == 0
        assert s.stage_bytes == 16 * 2 * s.unit_k and s.smem_bytes <= 227 * 1024 and s.stages >= 1


def _quarter_warp_wavefronts(offsets: list[int]) -> int:
    """Wavefronts of one 16-byte shared load (LDS.128) under the quarter-warp model: each group
    of 8 lanes is served alone; within it, lanes on the same bank at different 4-byte words
    conflict (a broadcast of the same word does not)."""
    total = 0
    for q in range(4):
        words_per_bank: dict[int, set[int]] = {}
        for lane in range(8 * q, 8 * q + 8):
            for w in range(4):
                word = offsets[lane] // 4 + w
                words_per_bank.setdefault(word % 32, set()).add(word)
        total += max(len(v) for v in words_per_bank.values())
    return total


def test_padded_tile_rows_read_in_four_wavefronts(v41):
    """A warp's weight read in the tile variants (lane 4g + t: row g at byte 16t of a chunk):
    8 wavefronts with rows K bytes apart (K % 128 == 0), the minimum 4 with ROW_PAD."""
    for label, (n, k, _) in dr.dense_shapes(v41, 4).items():
        if k % 128 or n * k > 12 * 2**20:
            continue
        for v in ("stream_xtu", "stream_xtup"):
            try:
                s = dr.make_spec(label, n, k, variant=v)
            except ValueError:
                continue
            for chunk in (0, 1, s.k // 64 - 1):
                offs = [(lane // 4) * s.row_stride + 64 * chunk + 16 * (lane % 4)
                        for lane in range(32)]
                assert _quarter_warp_wavefronts(offs) == (4 if v == "stream_xtup" else 8), s.name
