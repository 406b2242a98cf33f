"""executor.stages.attn_index on four emulated ranks against the reference attention (CPU, tiny).

Each case prefills random sequences into fresh caches (the reference's SWA insert and compressor
on random inputs), then runs the reference attention of every backbone layer in order on fresh
random inputs (its cache writes, top-k and candidates included), and replays the same layers on
the emulated ranks: the layer's `xn`, `attn.qr`, `attn.qkv` (its q half the reference's wq_a
output, whose q_norm the folded indexer wq_b computes: attn_proj.FOLD_Q_NORM, R <= 8) and per-rank
`attn.q` (the reference's values)
are written, `attn.indexer` and `attn.sparse_mqa` run, and their outputs are compared:

- index query / weights: `attn.index_w` bitwise the reference's weights_proj (both round the
  exact sum to fp32, then bf16); `attn.index_q` within the W8A16 dense bound (fp32 sums in another
  order, dense_ref.dense_tolerance) carried through the RoPE rotation (see `_q_bound`).
- top-k (and the candidate source's blocks): bitwise the selection that the reference rule
  (indexer_ref) makes on scores of the stage's own query and weights (proves the chain's
  wiring); against the reference's `index_topk` bitwise, except rows where the two selections
  differ only among entries whose reference scores lie within twice the measured score
  perturbation (the index query may differ by bf16 ulps: see `_explained`).
- o: per rank, the reference's A13-A14 (attention_ref.sparse_mqa on the reference's gather of the
  stage's top-k, inverse RoPE, bf16) within one bf16 ulp: the emulator and the reference do the
  same float64 math on the same entries, summed in another order (masked slots), and round P and
  o to bf16, so a value that straddles a rounding boundary moves by one ulp.
- padding rows: top-k all -1, o zero; rows past the launch untouched; no cache byte written; the
  replicated outputs (top-k, candidates, index query) identical on every rank.
"""
import numpy as np
import pytest
from tiny_checkpoint import tiny_checkpoint

from executor.emulate.ranks import EmulatedRanks
from executor.reference import attention as ra
from executor.reference.kvcache import KVCaches
from executor.reference.rows import RowBatch, RowBlock
from executor.reference.weights import rank_weights_from_checkpoint
from kernels import attention_ref, indexer_ref
from kernels import dense_ref as dr
from kernels import sparse_mqa_ref as sm
from kernels.common_ref import BF16
from loader.checkpoint import Checkpoint
from loader.formats import bf16_round

TP = 4
MODULES = ("executor.stages.attn_index", "stage_attn_index_inputs")
ROLES = {"attn.indexer", "attn.sparse_mqa"}
MAX_CONTEXT = 192
SENTINEL = 0x7FBF                # a bf16 NaN no kernel writes


@pytest.fixture(scope="module")
def ckpt():
    with Checkpoint.open(tiny_checkpoint(), progress=False) as c:
        yield c


@pytest.fixture(scope="module")
def lws(ckpt):
    return [rank_weights_from_checkpoint(ckpt, TP, r) for r in range(TP)]


def _backbone(cfg):
    return [s for s in cfg.layers if not s.is_dspark]


def _random_x(rng, rows, d):
    return rng.standard_normal((rows, d)).astype(BF16).astype(np.float32)


def _prefill(cfg, lws, caches, line, length, rng):
    """SWA entries, compressor rings, entries and index keys of positions 0..length-1."""
    for first in range(0, length, 6):
        n = min(6, length - first)
        rows = RowBatch.from_blocks([RowBlock(line, first, (0,) * n, "verify")],
                                    caches.block_tables, caches.ring_slots)
        for spec in _backbone(cfg):
            lw, x = lws[0].layer(spec.index), _random_x(rng, n, cfg.hidden_size)
            ra.insert_swa(lw, x, rows, caches, cfg)
            if spec.owns_compressor:
                ra.compress(lw, x, rows, caches, cfg)


def _step(cfg, lws, kinds, pad_to, rng):
    """Fresh caches with one prefilled sequence per block kind, and the step's RowBatch."""
    caches = KVCaches.allocate(cfg, max_seqs=len(kinds), max_context=MAX_CONTEXT)
    blocks = []
    for line, kind in enumerate(kinds):
        start = int(rng.integers(40, MAX_CONTEXT - 8))
        _prefill(cfg, lws, caches, line, start, rng)
        n = {"decode": 1, "verify": 6, "draft": cfg.dspark_block_size}[kind]
        blocks.append(RowBlock(line, start, (0,) * n, kind))
    return caches, RowBatch.from_blocks(blocks, caches.block_tables, caches.ring_slots, pad_to)


def _reference_layer(cfg, lws, spec, rows, caches, rng):
    """The reference's inputs and outputs of one layer (its cache writes happen here)."""
    i, r = spec.index, rows.num_rows
    x = _random_x(rng, r, cfg.hidden_size)
    lw = lws[0].layer(i)
    shared = ra.attention_shared(lw, x, rows, caches, cfg)
    table = ra.rope_for(cfg, spec.ratio)
    heads = cfg.rank_shapes(TP).heads
    q = [bf16_round(ra._rope(ra._linear(shared.qr, w.layer(i), "attn.wq_b").reshape(
        r, heads, cfg.head_dim), rows.positions, table)) for w in lws]
    q_pre = bf16_round(ra._linear(x, lw, "attn.wq_a"))      # attn.qkv's q half (pre-q_norm)
    qkv = np.concatenate([q_pre, np.zeros((r, cfg.head_dim), np.float32)], axis=1)
    out = {"x": x, "qr": shared.qr, "q": q, "qkv": qkv}
    if spec.has_indexer:
        nh, hd = cfg.index_n_heads, cfg.index_head_dim
        iq = ra._linear(shared.qr, lw, "attn.indexer.wq_b")
        out["iq_linear"] = iq
        out["iq"] = bf16_round(ra._rope(iq.reshape(r, nh, hd), rows.positions, table))
        out["iw"] = ra._linear(x, lw, "attn.indexer.weights_proj.weight")
        out["topk"] = caches.step_topk[i][1].copy()
        if spec.is_candidate_source:
            out["cands"] = caches.step_candidates[i][1].copy()
    return out


def _scores(cfg, spec, q, w_raw, rows, caches, prior):
    """Per sequence (row ids, scores [n_rows, n], visible, allowed) as index_topk computes them
    from a (pre-FP4) index query and raw head weights."""
    nh, hd = cfg.index_n_heads, cfg.index_head_dim
    qd = indexer_ref.fp4_quantize_dequantize(q)
    w = w_raw.astype(np.float32) * np.float32((hd * nh) ** -0.5)
    out = []
    for s in range(rows.num_seqs):
        idx = rows.seq_rows(s)
        pos = rows.positions[idx]
        n = int(pos[-1] + 1) // spec.ratio
        keys = caches.load_keys(spec.kv_source, caches.entry_rows(rows.block_tables[s],
                                                                   np.arange(n)))
        scores = indexer_ref.index_scores(qd[idx], w[idx], keys)
        visible = indexer_ref.visible_mask((pos + 1) // spec.ratio, n)
        allowed = visible
        if prior is not None:
            allowed = visible & indexer_ref.candidate_entry_mask(prior[idx], n,
                                                                 cfg.candidate_block_size)
        out.append((idx, scores, visible, allowed))
    return out


def _selections(cfg, spec, per_seq, rows, r):
    topk = np.full((r, cfg.index_topk), -1, np.int32)
    cands = np.full((r, cfg.candidate_topk_blocks), -1, np.int32)
    for idx, scores, visible, allowed in per_seq:
        topk[idx] = indexer_ref.topk_entries(scores, allowed, cfg.index_topk)
        if spec.is_candidate_source:
            cands[idx] = indexer_ref.candidate_blocks(scores, visible, rows.positions[idx],
                                                      cfg.candidate_block_size,
                                                      cfg.candidate_topk_blocks)
    return topk, cands


def _block_scores(scores, allowed, block_size):
    n = scores.shape[1]
    nb = -(-n // block_size)
    masked = np.pad(np.where(allowed, scores, -np.inf), ((0, 0), (0, nb * block_size - n)),
                    constant_values=-np.inf)
    return masked.reshape(len(scores), nb, block_size).max(axis=2)


def _explained(got, want, ref_scores, slack):
    """A selection that differs from the reference's only where a swapped pair's reference
    scores are within `slack` (twice the largest score perturbation): every item the reference
    took and we did not scores at most `slack` above every item we took and it did not."""
    extra = sorted(set(got.tolist()) - set(want.tolist()) - {-1})
    lost = sorted(set(want.tolist()) - set(got.tolist()) - {-1})
    if len(extra) != len(lost):
        return False
    return float(ref_scores[lost].max() - ref_scores[extra].min()) <= slack


def _q_bound(cfg, ref, lws, spec, got):
    """|index_q - reference| bound. The linear: dense_ref.dense_tolerance bounds the stage's
    distance to the exact sum, the reference's own bf16 rounding adds half an ulp (2^-8 |y|);
    the nope dims pass as they are. RoPE mixes a pair with |cos|, |sin| <= 1 (e0 + e1), then both
    sides round to bf16: + half an ulp each (2^-7 of the larger magnitude)."""
    nh, hd = cfg.index_n_heads, cfg.index_head_dim
    w = lws[0].layer(spec.index).dense("attn.indexer.wq_b").astype(np.float32)
    e = dr.dense_tolerance(ref["qr"].astype(BF16), w, "bf16")
    e = (e + 2.0**-8 * np.abs(ref["iq_linear"])).reshape(-1, nh, hd)
    rope = e[..., hd - 64:].reshape(*e.shape[:2], 32, 2).sum(axis=-1).repeat(2, axis=-1)
    top = np.maximum(np.abs(got), np.abs(ref["iq"]))[..., hd - 64:]
    bound = e.copy()
    bound[..., hd - 64:] = rope + 2.0**-7 * top + 2.0**-133
    return bound


def _ranks(ckpt, bundle_dir, caches):
    return EmulatedRanks(ckpt, bundle_dir, TP, caches, modules=MODULES)


def _read_all(ranks, name, dtype, shape):
    """`name` on every rank; they must agree (replicated outputs)."""
    got = [ranks.read(k, name, dtype, shape) for k in range(TP)]
    for k in range(1, TP):
        assert np.array_equal(got[k].view(np.uint8), got[0].view(np.uint8)), \
            f"{name}: rank {k} differs from rank 0"
    return got[0]


def _check_selection(what, got, want, stage_per_seq, ref_per_seq, rows, scores_of, stats):
    """Rows of `got` vs the reference's `want`: equal, or a swap the score perturbation explains."""
    for (idx, stage, _, allowed), (_, ref, _, ref_allowed) in zip(stage_per_seq, ref_per_seq):
        slack = 2.0 * float(np.abs(stage - ref)[allowed | ref_allowed].max(initial=0.0))
        ref_items = scores_of(ref, ref_allowed)
        for j, row in enumerate(idx):
            if np.array_equal(got[row], want[row]):
                stats[what + " rows equal"] = stats.get(what + " rows equal", 0) + 1
                continue
            stats[what + " rows explained"] = stats.get(what + " rows explained", 0) + 1
            assert _explained(got[row], want[row], ref_items[j], slack), \
                f"{what} row {row}: {got[row].tolist()} vs reference {want[row].tolist()}"
    pad = ~rows.real
    assert (got[pad] == -1).all() and (want[pad] == -1).all()


def _check_indexer(cfg, lws, spec, ref, ranks, rows, caches, got_cands, stats):
    i, r, mr = spec.index, rows.num_rows, ranks.max_rows
    nh, hd, k = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
    iw = _read_all(ranks, "attn.index_w", BF16, (mr, nh))[:r]
    assert np.array_equal(iw.view(np.uint16), ref["iw"].astype(BF16).view(np.uint16))
    iq = _read_all(ranks, "attn.index_q", BF16, (mr, nh, hd))[:r].astype(np.float64)
    err = np.abs(iq - ref["iq"])
    bound = _q_bound(cfg, ref, lws, spec, iq)
    bad = np.argwhere(err > bound)
    assert bad.size == 0, (f"layer {i} index q: error over bound at {bad[:5].tolist()}: "
                           f"{iq[tuple(bad[0])]} vs {ref['iq'][tuple(bad[0])]}, "
                           f"bound {bound[tuple(bad[0])]}")
    stats["index q max |err| / bound"] = max(stats.get("index q max |err| / bound", 0.0),
                                             float((err / bound).max()))
    topk = _read_all(ranks, f"attn.topk.{i}", np.int32, (mr, k))
    assert (topk[r:] == -2).all(), f"layer {i}: top-k written past row {r}"
    topk = topk[:r]
    src = cfg.candidate_source_layer_id
    stage_prior = got_cands[src] if spec.uses_candidates else None
    ref_prior = caches.step_candidates[src][1] if spec.uses_candidates else None
    stage = _scores(cfg, spec, iq.astype(np.float32), iw, rows, caches, stage_prior)
    refs = _scores(cfg, spec, ref["iq"], ref["iw"], rows, caches, ref_prior)
    want_topk, want_cands = _selections(cfg, spec, stage, rows, r)
    assert np.array_equal(topk, want_topk), f"layer {i}: top-k is not the stage scores' top-k"
    assert np.array_equal(_selections(cfg, spec, refs, rows, r)[0], ref["topk"])
    if spec.uses_candidates and not np.array_equal(stage_prior, ref_prior):
        stats["reindex rows on other candidates"] = int((stage_prior != ref_prior).any(1).sum())
    else:
        _check_selection("top-k", topk, ref["topk"], stage, refs, rows,
                         lambda s, a: np.where(a, s, -np.inf), stats)
    if spec.is_candidate_source:
        cands = _read_all(ranks, f"attn.candidates.{i}", np.int32,
                          (mr, cfg.candidate_topk_blocks))[:r]
        assert np.array_equal(cands, want_cands)
        bs = cfg.candidate_block_size

        def block_items(s, a):
            return _block_scores(s, a, bs)
        _check_selection("candidate", cands, ref["cands"], stage, refs, rows, block_items,
                         stats)
        got_cands[i] = cands
    return topk


def _check_o(cfg, lws, spec, ref, ranks, rows, caches, topk, stats):
    i, r, mr = spec.index, rows.num_rows, ranks.max_rows
    heads = cfg.rank_shapes(TP).heads
    kv, valid = ra.gather(spec, topk, rows, caches, cfg)
    table = ra.rope_for(cfg, spec.ratio)
    for k in range(TP):
        got = ranks.read(k, "attn.o", np.uint16, (mr, heads, sm.HEAD_DIM))
        assert (got[r:] == SENTINEL).all(), f"layer {i} rank {k}: o written past row {r}"
        o = attention_ref.sparse_mqa(ref["q"][k], kv, valid,
                                     lws[k].layer(i).vector("attn.attn_sink"))
        want = bf16_round(ra._rope(o, rows.positions, table, inverse=True)).astype(BF16)
        got = got[:r].view(BF16).astype(np.float32)
        assert (got[~rows.real] == 0).all(), f"layer {i} rank {k}: padding rows not zero"
        # one bf16 ulp of the larger magnitude (2^-7 relative), plus the smallest subnormal
        ulp = 2.0**-7 * np.maximum(np.abs(got), np.abs(want.astype(np.float32))) + 2.0**-133
        diff = np.abs(got - want.astype(np.float32))
        assert (diff <= ulp).all(), f"layer {i} rank {k}: o off by {(diff / ulp).max()} ulp"
        stats["o elements bitwise"] = stats.get("o elements bitwise", 0) + int((diff == 0).sum())
        stats["o elements"] = stats.get("o elements", 0) + diff.size


def _check_caches_untouched(ranks, caches):
    sources = {**{f"swa_{l}": a for l, a in caches.swa.items()},
               **{f"compressed_{l}": a for l, a in caches.compressed.items()},
               **{f"index_keys_{l}": a for l, a in caches.index_keys.items()},
               **{f"compressor_ring_{l}": a for l, a in caches.ring.items()}}
    for k in range(TP):
        for name, want in sources.items():
            got = ranks.read(k, name, want.dtype, want.shape)
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), \
                f"rank {k}: {name} changed"


# (block kinds, bucket, layers): 1 row; a verify block; decode + verify blocks in a padded
# bucket; draft rows with them on the SWA-only layers (the compressed layers refuse drafts).
CASES = {"decode 1": (("decode",), None, "all"), "verify 6": (("verify",), None, "all"),
         "mixed 13 in 16": (("decode", "verify", "verify"), 16, "all"),
         "draft mix 12 in 16 (swa layers)": (("decode", "draft", "verify"), 16, "swa")}


@pytest.mark.parametrize("case", CASES)
def test_indexer_and_sparse_mqa_match_the_reference(ckpt, lws, tiny_bundle_dir, monkeypatch,
                                                    case):
    cfg = ckpt.config
    rng = np.random.default_rng()
    kinds, pad_to, which = CASES[case]
    layers = [s for s in _backbone(cfg) if which == "all" or not s.ratio]
    caches, rows = _step(cfg, lws, kinds, pad_to, rng)
    refs = {s.index: _reference_layer(cfg, lws, s, rows, caches, rng) for s in layers}
    ranks = _ranks(ckpt, tiny_bundle_dir, caches)
    ranks.load(rows, caches, np.zeros((rows.num_rows, cfg.engram_max_ngram_size), np.int64))
    r, mr = rows.num_rows, ranks.max_rows
    ranks.write("positions32", rows.positions.astype(np.int32))
    ranks.write("row_info", sm.row_info(rows, cfg.sliding_window))
    got_topk, got_cands, stats = {}, {}, {}
    for spec in layers:
        i, ref = spec.index, refs[spec.index]
        ranks.write("xn", ref["x"].astype(BF16))
        ranks.write("attn.qr", ref["qr"].astype(BF16))
        ranks.write("attn.qkv", ref["qkv"].astype(BF16))   # the folded indexer wq_b's input
        for k in range(TP):
            ranks.write("attn.q", ref["q"][k].astype(BF16), ranks=[k])
        ranks.write("attn.o", np.full(ranks.arenas[0].slices["attn.o"].nbytes // 2, SENTINEL,
                                      np.uint16))
        if spec.has_indexer:
            ranks.write(f"attn.topk.{i}", np.full((mr, cfg.index_topk), -2, np.int32))
        ranks.run(r, roles=ROLES, layers={i})
        if spec.has_indexer:
            got_topk[i] = _check_indexer(cfg, lws, spec, ref, ranks, rows, caches, got_cands,
                                         stats)
        topk = got_topk[spec.topk_source] if spec.ratio else None
        if spec.ratio and not spec.has_indexer:      # reuse: the source's buffer, untouched
            held = _read_all(ranks, f"attn.topk.{spec.topk_source}", np.int32,
                             (mr, cfg.index_topk))[:r]
            assert np.array_equal(held, topk)
        _check_o(cfg, lws, spec, ref, ranks, rows, caches, topk, stats)
    _check_caches_untouched(ranks, caches)
    print(f"\n{case}: {stats}")
