"""CPU tests of the sparse MQA family: specs and launch geometry, shared-memory layout, row metadata,
the reference on cache bytes (bad input, poison), the cases the GPU test uses, the byte formula, and
an fp32 emulation of the kernel's split (cluster) arithmetic against the reference and its bound.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from executor.reference.rows import RowBatch, RowBlock
from executor.sparse_mqa_chain import make_case
from kernels import attention_ref, rope_ref
from kernels import sparse_mqa_ref as ref
from kernels.common_ref import BF16, to_bf16
from loader.config import ModelConfig

RNG = np.random.default_rng()


@pytest.fixture(scope="module", params=["tiny", "v41-flash"])
def cfg(request):
    return ModelConfig.preset(request.param)


def _specs(cfg):
    swa, topk = ref.sparse_mqa_specs(cfg, 4)
    return swa, topk


# ---- specs, geometry, layout ---------------------------------------------------------------------

def test_specs_cover_every_entry_and_fit_the_sm(cfg):
    for spec in _specs(cfg):
        assert spec.params == ref.PARAMS and spec.block == (ref.CTA_THREADS, 1, 1)
        assert spec.heads == cfg.rank_shapes(4).heads
        assert spec.cluster_ctas in (2, 4, 8) and ref.HEAD_DIM % spec.cluster_ctas == 0
        assert spec.entries_per_cta * spec.cluster_ctas >= spec.max_entries
        assert spec.entries_per_cta % ref.ENTRY_TILE == 0
        assert spec.entries_per_cta <= ref.CTA_THREADS          # one address per thread
        # Every count the kernel can see splits into shares within the capacity.
        for count in range(spec.max_entries + 1):
            assert ref.split_entries(count, spec.cluster_ctas) <= spec.entries_per_cta
        assert ref.CTAS_PER_SM * (spec.smem_bytes + 1024) <= 228 * 1024
        assert spec.grid(48) == (spec.cluster_ctas, 48, 1)
        assert spec.to_dict()["cluster"] == [spec.cluster_ctas, 1, 1]
    swa, topk = _specs(cfg)
    assert swa.topk == 0 and swa.swa_cols == cfg.sliding_window + cfg.dspark_block_size
    assert topk.topk == cfg.index_topk and topk.swa_cols == cfg.sliding_window


def test_v41_shapes():
    swa, topk = _specs(ModelConfig.preset("v41-flash"))
    assert (topk.cluster_ctas, topk.entries_per_cta, topk.ring_slots) == (8, 80, 256)
    assert (swa.cluster_ctas, swa.entries_per_cta) == (4, 48)
    assert ref.split_entries(128 + 512, 8) == 80        # a 64k-context row: 8 equal shares


def test_smem_layout_is_disjoint_aligned_and_conflict_free(cfg):
    for spec in list(_specs(cfg)) + ref.variant_specs(cfg, 4):
        lay = spec.layout
        regions = [(lay.records, max(spec.entries_per_cta * ref.RECORD_BYTES,
                                     spec.heads * ref.O_ROW_BYTES)),
                   (lay.addresses, spec.entries_per_cta * 8),
                   (lay.q, ref.MMA_M * ref.Q_ROW_BYTES),
                   (lay.logits, ref.MMA_M * spec.entries_per_cta * 4),
                   (lay.probs, ref.MMA_M * lay.probs_row_bytes),
                   (lay.norm, ref.MMA_M * 8)]
        push = spec.exchange == "push"
        senders = spec.cluster_ctas if push else 1      # push: one stats slot per sender CTA
        regions.append((lay.stats, senders * ref.MMA_M * ref.STATS_BYTES))
        assert (lay.consts >= 0) == (spec.split == "fixed")
        if lay.consts >= 0:
            regions.append((lay.consts, ref.CONSTS_BYTES))
        assert (lay.inbox >= 0) == push
        if push:
            regions.append((lay.inbox, senders * ref.MMA_M * ref.INBOX_ROW_BYTES))
        regions.sort()
        for (a, n), (b, _) in itertools.pairwise(regions):
            assert a + n <= b
        assert regions[-1][0] + regions[-1][1] <= lay.total == spec.smem_bytes
        assert all(off % 16 == 0 for off, _ in regions)
        # mma fragment loads (8 row groups g x 4 lanes t, 32-bit words) hit 32 distinct banks.
        for row_bytes in (ref.Q_ROW_BYTES, lay.probs_row_bytes):
            banks = {(g * row_bytes // 4 + t) % 32 for g in range(8) for t in range(4)}
            assert len(banks) == 32


# ---- row metadata ----------------------------------------------------------------------------------

def test_row_info_matches_the_attention_window_rules():
    window, ring = 16, 32
    blocks = [RowBlock(3, 40, (1,) * 6, "verify"), RowBlock(0, 2, (1,), "decode"),
              RowBlock(5, 30, (1,) * 5, "draft"), RowBlock(1, 0, (1,) * 6, "verify")]
    tables = np.zeros((8, 4), np.int32)
    rows = RowBatch.from_blocks(blocks, tables, ring, pad_to=24)
    info = ref.row_info(rows, window)
    firsts = np.array([rows.positions[rows.seq_rows(s)[0]] for s in range(rows.num_seqs)])
    real = rows.real
    seq = np.where(real, rows.seq_index, 0)
    cols, valid = attention_ref.swa_positions(rows.positions, firsts[seq],
                                              rows.context_lens[seq] - 1,
                                              rows.block_kind == 2, window)
    for r in range(rows.num_rows):
        if not real[r]:
            assert tuple(info[r]) == (0, 0, -1, -1)
            continue
        want = cols[r][valid[r]]
        assert info[r, 0] == rows.positions[r] and info[r, 3] == rows.seq_index[r]
        assert np.array_equal(np.arange(info[r, 1], info[r, 2] + 1), want)


# ---- the cases and the reference on cache bytes ------------------------------------------------------

def _spec(config: str, topk: bool) -> ref.SparseMqaSpec:
    return _specs(ModelConfig.preset(config))[1 if topk else 0]


def test_case_writes_exactly_the_records_rows_read():
    spec = _spec("v41-flash", True)
    case = make_case(spec, RNG, 2000, ["verify", "decode"], pad_rows=3)
    g = case.gathered()
    read = {rid for ids in g.record_ids for rid in ids}
    for name, cache in (("swa", case.swa), ("compressed", case.compressed)):
        written = set(np.flatnonzero((cache != 0xFF).any(axis=1)).tolist())
        assert written == {i for n, i in read if n == name}
    assert (case.topk[case.info[:, 3] >= 0] >= 0).sum() > 0.9 * 7 * spec.topk
    assert not g.valid[-3:].any()
    assert np.isfinite(g.kv).all()


def test_reference_rejects_bad_input_and_poison():
    spec = _spec("tiny", True)
    case = make_case(spec, RNG, 100, ["verify"])
    g_args = (case.swa, case.compressed, case.topk, case.block_tables, case.info,
              case.state_lines, case.page_size)
    bad_tables = case.block_tables.copy()
    # a page that row 0 selects (its top-k may hold -1 padding anywhere: -1 // page_size would
    # name the line's last page, which nothing reads)
    page = case.topk[0][case.topk[0] >= 0][0] // case.page_size
    bad_tables[0, page] = -1
    with pytest.raises(ValueError, match="unallocated"):
        ref.gather(spec, *g_args[:3], bad_tables, *g_args[4:])
    far = case.topk.copy()
    far[1, 0] = case.block_tables.shape[1] * case.page_size
    with pytest.raises(ValueError, match="outside"):
        ref.gather(spec, g_args[0], g_args[1], far, *g_args[3:])
    wide = case.info.copy()
    wide[0, 1] = max(0, wide[0, 2] - spec.swa_cols)
    with pytest.raises(ValueError, match="wider"):
        ref.gather(spec, g_args[0], g_args[1], g_args[2], g_args[3], wide, *g_args[5:])
    unwritten = case.topk.copy()
    free = np.setdiff1d(np.arange(case.info[0, 0] + 1), case.topk[case.topk >= 0])
    unwritten[0, 0] = free[0]
    with pytest.raises(ValueError, match="never written"):
        ref.gather(spec, g_args[0], g_args[1], unwritten, *g_args[3:])


def test_padding_rows_are_zero_and_rows_are_independent():
    spec = _spec("tiny", True)
    case = make_case(spec, RNG, 60, ["verify", "decode"], pad_rows=2)
    out = case.reference()
    assert not np.asarray(out[-2:], np.float32).any()
    one = make_case(spec, RNG, 60, ["decode"])
    solo = ref.sparse_mqa_ref(spec, case.q[6:7], ref.gather(
        spec, case.swa, case.compressed, case.topk[6:7], case.block_tables, case.info[6:7],
        case.state_lines, case.page_size), case.sink, case.info[6:7], case.table)
    assert np.array_equal(solo.view(np.uint16), out[6:7].view(np.uint16))
    assert one.q.shape[0] == 1


def test_bytes_formula_counts_per_row_and_unique_records():
    spec = _spec("v41-flash", True)
    case = make_case(spec, RNG, 4096, ["verify"] * 2)
    nb = ref.bytes_read(spec, case.gathered())
    valid = case.gathered().valid.sum()
    assert nb["records"] == valid * ref.RECORD_BYTES
    assert nb["unique_records"] < nb["records"]              # rows of a block share entries
    assert nb["must_read"] == nb["unique_records"] + nb["q_out"] + nb["meta"]


# ---- fp32 emulation of the kernel's split arithmetic -------------------------------------------------

def cta_shares(spec, n_swa: int) -> list[np.ndarray]:
    """Indices (into the row's SWA-then-top-k list) each CTA of the cluster takes, in its order."""
    count, S = n_swa + spec.topk, spec.cluster_ctas
    if spec.split == "fixed":
        sw, tk = spec.swa_share, spec.topk_share
        return [np.concatenate([np.arange(s * sw, min(n_swa, (s + 1) * sw)),
                                n_swa + np.arange(s * tk, min(spec.topk, (s + 1) * tk))])
                for s in range(S)]
    per = ref.split_entries(count, S)
    return [np.arange(s * per, min(count, (s + 1) * per)) for s in range(S)]


def emulate_kernel(case) -> np.ndarray:
    """The kernel's arithmetic in NumPy fp32: per-CTA shares, per-CTA (max, sum), rank-order M, L,
    P = bf16(exp(l - M) / L), per-CTA partial o, rank-order sum, bf16, inverse RoPE, bf16.
    (The mma accumulation order is modeled as one fp32 rounding of an exact sum.)"""
    spec, g = case.spec, case.gathered()
    out = np.zeros(case.q.shape, np.float32)
    for r in range(case.rows):
        pos, lo, hi, seq = case.info[r]
        if seq < 0:
            continue
        count = max(hi - lo + 1, 0) + spec.topk
        q = case.q[r].astype(np.float64)
        logits = (q @ g.kv[r, :count].T.astype(np.float64)).astype(np.float32)
        logits = np.where(g.valid[r, :count], logits * np.float32(ref.HEAD_DIM ** -0.5), -np.inf)
        shares = cta_shares(spec, max(hi - lo + 1, 0))
        stats = []
        for sh in shares:
            part = logits[:, sh]
            m = part.max(axis=1) if part.shape[1] else np.full(spec.heads, -np.inf, np.float32)
            e = np.exp(part - m[:, None]) if part.shape[1] else part
            stats.append((m, np.where(np.isfinite(m), e.sum(axis=1, dtype=np.float32), 0)))
        big = case.sink.copy()
        for m, _ in stats:
            big = np.maximum(big, m)
        norm = np.exp(case.sink - big).astype(np.float32)
        for m, total in stats:
            norm = norm + np.where(total > 0, total * np.exp(m - big), 0).astype(np.float32)
        p = to_bf16(np.exp(logits - big[:, None]) / norm[:, None]).astype(np.float32)
        o = np.zeros((spec.heads, ref.HEAD_DIM), np.float32)
        for sh in shares:
            o = o + (p[:, sh].astype(np.float64) @ g.kv[r, sh]).astype(np.float32)
        o = to_bf16(o).astype(np.float32)
        out[r] = rope_ref.apply_rope(o[None], np.array([pos]), case.table, inverse=True)[0]
    return to_bf16(out)


@pytest.mark.parametrize("config,topk,context,blocks,split", [
    ("tiny", True, 9, ["decode"], "balanced"), ("tiny", True, 300, ["verify", "verify"], "balanced"),
    ("tiny", False, 40, ["draft", "decode"], "balanced"),
    ("v41-flash", True, 1000, ["verify"], "balanced"),
    ("v41-flash", False, 500, ["draft", "verify"], "balanced"),
    ("tiny", True, 9, ["decode"], "fixed"), ("tiny", True, 300, ["verify", "verify"], "fixed"),
    ("v41-flash", True, 100, ["verify"], "fixed"), ("v41-flash", True, 1000, ["verify"], "fixed"),
    ("tiny", True, 300, ["verify", "decode"], "fixed_push"),
    ("v41-flash", True, 1000, ["verify", "decode"], "fixed_push"),
])
def test_split_arithmetic_is_within_the_bound(config, topk, context, blocks, split):
    """The kernel's fp32 split arithmetic stays inside `error_bound`, and nearly every element
    equals the reference bit for bit (the GPU test asserts the same two things)."""
    spec = _spec(config, topk)
    if split != "balanced":     # the push exchange does the fixed split's arithmetic
        spec = ref.candidate_specs(ModelConfig.preset(config), 4)[split]
        assert spec.split == "fixed"
    case = make_case(spec, RNG, context, blocks, pad_rows=1)
    want = case.reference()
    got = emulate_kernel(case)
    bound = ref.error_bound(case.q, case.gathered(), case.sink, case.info,
                            case.table.inv_freq)
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    assert (diff <= bound).all(), float((diff - bound).max())
    same = (got.view(np.uint16) == want.view(np.uint16)).mean()
    assert same >= 0.98, same


def test_bound_discriminates_a_dropped_entry():
    """Dropping one selected entry of a row moves its output beyond the bound somewhere."""
    spec = _spec("v41-flash", True)
    case = make_case(spec, RNG, 2000, ["decode"])
    g = case.gathered()
    bound = ref.error_bound(case.q, g, case.sink, case.info, case.table.inv_freq)
    want = case.reference()
    logits = np.einsum("hd,nd->hn", case.q[0].astype(np.float64), g.kv[0]) * ref.HEAD_DIM ** -0.5
    logits[:, ~g.valid[0]] = -np.inf
    heaviest = int(np.argmax(logits.max(axis=0)))
    valid = g.valid.copy()
    valid[0, heaviest] = False
    dropped = ref.sparse_mqa_ref(spec, case.q, ref.Gathered(g.kv, valid, g.record_ids), case.sink,
                                 case.info, case.table)
    diff = np.abs(dropped.astype(np.float64) - want.astype(np.float64))
    assert (diff > bound).any()
    assert want.dtype == BF16


def test_variant_specs_build_beside_the_step_kernel(cfg):
    """The step runs STEP_TOPK_VARIANT; the other candidates and the ablations build beside it
    under distinct names; the fixed split covers every slot within its capacity; the push exchange
    has a stats slot per sender and an inbox per sender, and still fits 2 CTAs per SM."""
    base = _specs(cfg)
    variants = ref.variant_specs(cfg, 4)
    cands = ref.candidate_specs(cfg, 4)
    assert sorted(cands) == ["balanced", "fixed", "fixed_push", "fixed_push_runs",
                             "fixed_push_runs_early"]
    early = cands["fixed_push_runs_early"]
    assert early.early and early.name == cands["fixed_push_runs"].name + "_early"
    assert (early.smem_bytes, early.layout) == (cands["fixed_push_runs"].smem_bytes,
                                                cands["fixed_push_runs"].layout)
    with pytest.raises(ValueError, match="early"):
        ref.make_spec(16, 128, 5, 512, 256, split="fixed", early=True)       # pull exchange
    step = [k for k, v in cands.items() if v == base[1]]
    assert len(step) == 1 and ref.STEP_TOPK_VARIANT == ref.TOPK_VARIANTS[step[0]]
    assert cands["fixed_push_runs"].qk_runs and not cands["fixed_push"].qk_runs
    assert cands["balanced"].split == "balanced" and cands["balanced"].exchange == "pull"
    f, push = cands["fixed"], cands["fixed_push"]
    assert (f.split, f.exchange, push.split, push.exchange) == ("fixed", "pull", "fixed", "push")
    assert push.name == f.name + "_push" and push.entries_per_cta == f.entries_per_cta
    # Warp w's 64 PV dims are exactly CTA w's output dims: one inbox row per (sender, head).
    assert push.cluster_ctas == ref.CTA_THREADS // 32 == ref.HEAD_DIM // 64
    assert ref.INBOX_ROW_BYTES >= 64 * 4 and ref.INBOX_ROW_BYTES % 16 == 0
    assert (f.heads, f.window, f.topk, f.ring_slots, f.swa_cols) == (
        base[1].heads, base[1].window, base[1].topk, base[1].ring_slots, base[1].swa_cols)
    assert f.swa_share * f.cluster_ctas >= f.swa_cols and f.topk_share * f.cluster_ctas >= f.topk
    assert f.swa_share + f.topk_share <= f.entries_per_cta <= ref.CTA_THREADS
    assert f.entries_per_cta % ref.ENTRY_TILE == 0
    for spec in cands.values():
        assert ref.CTAS_PER_SM * (spec.smem_bytes + 1024) <= 228 * 1024
    for n_swa in range(f.swa_cols + 1):                  # every entry in exactly one CTA
        got = np.sort(np.concatenate(cta_shares(f, n_swa)))
        assert np.array_equal(got, np.arange(n_swa + f.topk))
    ablations = [v for v in variants if v.ablation]
    assert [v.skip for v in ablations] == list(ref.PUSH_ABLATIONS)
    assert all(v.name.startswith(base[1].name + "_skip_") for v in ablations)
    assert all(v.exchange == "push" for v in ablations)
    assert all("_skip_" in v.name for v in ablations)
    names = [s.name for s in list(base) + variants]
    assert len(set(names)) == len(names)
    assert {s.name for s in cands.values()} <= set(names)
    with pytest.raises(ValueError, match="split"):
        ref.make_spec(4, 16, 5, 16, 32, split="other")
    with pytest.raises(ValueError, match="fixed"):
        ref.make_spec(4, 16, 5, 0, 32, split="fixed")
    with pytest.raises(ValueError, match="push only"):
        ref.make_spec(16, 128, 5, 512, 256, exchange="push")            # balanced split
    with pytest.raises(ValueError, match="ablations of push kernels only"):
        ref.make_spec(16, 128, 5, 512, 256, split="fixed", skip=("qk",))
    with pytest.raises(ValueError, match="exchange"):
        ref.make_spec(16, 128, 5, 512, 256, split="fixed", exchange="other")


# ---- lane maps of the push PV and the lane-run QK (kernels/sparse_mqa_push.py, _qk.py) ----------

def _prmt(a: int, b: int, selector: int) -> int:
    """PTX prmt.b32 (default mode) on Python ints."""
    pool = (a & 0xFFFFFFFF) | (b & 0xFFFFFFFF) << 32
    return sum(((pool >> 8 * ((selector >> 4 * i) & 7)) & 0xFF) << 8 * i for i in range(4))


def test_push_pv_lane_map_reads_and_pushes_every_dim_once():
    """Integer model of one PV e-step of one warp: lane (g, t) builds the B pairs of n-tile j from
    8-byte loads with the prmt selectors (column n = dim 8n + j), and the C fragment it pushes
    (dims 16t + 4c ..) equals sum_k P[h, k] V[k, d] for every head and dim exactly once."""
    from kernels.sparse_mqa_push import byte_pair, half_pair
    v = RNG.integers(0, 256, (16, 64))          # 16 entries x 64 dims (one warp's group), bytes
    p = RNG.integers(-3, 4, (16, 16))           # heads x entries
    got = np.full((16, 64), -10**9)
    for g, t in itertools.product(range(8), range(4)):
        rows = (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9)
        words = [[int.from_bytes(bytes(v[e, 8 * g + 4 * k: 8 * g + 4 * k + 4].tolist()), "little")
                  for k in range(2)] for e in rows]
        acc = np.zeros((4, 8), np.int64)
        for nt in range(8):
            sel = byte_pair(nt % 4)
            b0 = _prmt(words[0][nt // 4], words[1][nt // 4], sel) & 0xFFFF
            b1 = _prmt(words[2][nt // 4], words[3][nt // 4], sel) & 0xFFFF
            assert (b0 & 0xFF, b0 >> 8) == (v[rows[0], 8 * g + nt], v[rows[1], 8 * g + nt])
            assert (b1 & 0xFF, b1 >> 8) == (v[rows[2], 8 * g + nt], v[rows[3], 8 * g + nt])
            # C[m, n] = sum_k A[m, k] B[k, n]; this lane holds m in (g, g+8), n in (2t, 2t+1).
            for i in range(4):
                m, n = g + 8 * (i // 2), 2 * t + i % 2
                acc[i, nt] = p[m] @ v[:, 8 * n + nt]
        for half, c in itertools.product(range(2), range(4)):
            i, n0 = 2 * half + c // 2, 4 * (c % 2)
            dims = 16 * t + 4 * c + np.arange(4)
            assert (got[g + 8 * half, dims] == -10**9).all()
            got[g + 8 * half, dims] = acc[i, n0:n0 + 4]
    assert np.array_equal(got, p @ v)
    a, b = (int(x) for x in RNG.integers(0, 2**32, 2))
    for j in range(2):
        assert _prmt(a, b, half_pair(j)) == (a >> 16 * j & 0xFFFF) | (b >> 16 * j & 0xFFFF) << 16


def test_lane_run_qk_map_covers_every_dim_once():
    """Lane t's logical k pairs (2t, 2t+1), (2t+8, 2t+9) of k-step kk in group grp are the
    physical dims 64 grp + 16 t + 4 kk + (0, 1), (2, 3): A and B read the same dims, and the 32
    k-steps x 16 logical k cover the 512 dims exactly once."""
    seen = np.zeros(ref.HEAD_DIM, int)
    for grp, kk in itertools.product(range(8), range(4)):
        for t in range(4):
            base = 64 * grp + 16 * t + 4 * kk
            for logical, phys in zip((2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9),
                                     range(base, base + 4)):
                seen[phys] += 1
                # q row bytes 32t .. 32t + 31 of the group hold dims 16t .. 16t + 15: word 2kk
                # (a0 / a1) and 2kk + 1 (a2 / a3); the record word kk holds the same four dims.
                assert (phys - 64 * grp - 16 * t) // 2 in (2 * kk, 2 * kk + 1)
                assert logical % 8 // 2 == t
    assert (seen == 1).all()
