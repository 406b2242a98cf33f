"""executor.stages.mhc on four emulated ranks (tiny) against executor/reference/step.py.

Each test writes a stage group's input boundary buffers from values the reference computes, runs
the wired stages of every rank in lockstep (CPU emulators of the kernels), and compares every
element of the outputs with the reference function of the step. Bounds: the emulators run the
kernels' NumPy references (kernels/*_ref), which compose the same model functions the step
reference uses (mhc_ref, norm_ref, engram_ref, head_ref), so most outputs agree bitwise; where
the two sum in different orders (the 1-stream broadcast mixes vs hc_mixes_broadcast, the W8A16
wkv, the Engram gate) the bound is the one the arithmetic gives, stated at the assertion.
Padding rows (bucket > real rows) are computed like any row and nothing past the bucket is
written (no stage of this group touches a KV cache); every rank's replicated outputs are bitwise
equal. Three collectives of the lead's group have no emulated stage here and are done on the host
in their place: the embedding all-reduce (rank-order fp32 sum, as step.all_reduce), the Engram
heads all-gather (each rank's `engram.local_heads` side by side into every rank's `engram.heads`)
and the wkv output all-gather (each rank's `engram.kv_local` pieces into `engram.kv`,
allreduce_ref.gather_pieces_ref).
"""
import numpy as np
import pytest
from tiny_checkpoint import tiny_checkpoint

from executor.emulate.ranks import EmulatedRanks
from executor.reference import step
from executor.reference.kvcache import KVCaches
from executor.reference.rows import RowBatch, RowBlock
from executor.reference.weights import rank_weights_from_checkpoint
from kernels import dense_ref, engram_ref, head_ref, mhc_ref, moe_ref
from kernels import engram_kernel_ref as ek
from kernels import lm_head_ref as lr
from kernels import mhc_kernel_ref as mk
from kernels.allreduce_ref import gather_pieces_ref
from kernels.common_ref import BF16
from loader.checkpoint import Checkpoint

MODULE = "executor.stages.mhc"
POISON = 0xFF      # NaN as bf16 / f32, -1 as int: what no stage may leave past the bucket


@pytest.fixture(scope="module")
def env(tiny_bundle_dir):
    with Checkpoint.open(tiny_checkpoint(), progress=False) as ckpt:
        cfg = ckpt.config
        caches = KVCaches.allocate(cfg, max_seqs=4, max_context=64, page_size=16)
        ranks = EmulatedRanks(ckpt, tiny_bundle_dir, 4, caches, modules=(MODULE,))
        model = step.ReferenceModel(cfg, tuple(rank_weights_from_checkpoint(ckpt, 4, r)
                                               for r in range(4)))
        yield ranks, model, caches


def _batch(caches, cfg, rng, lengths, pad_to=None):
    """A RowBatch of one block per length (random tokens and starts), its Engram history, and
    the bucket: `pad_to` rows (>= real rows) or the real count."""
    blocks, prior = [], []
    for s, n in enumerate(lengths):
        start = int(rng.integers(0, 40))
        tokens = tuple(rng.integers(0, cfg.vocab_size, n).tolist())
        blocks.append(RowBlock(state_line=s, start=start, token_ids=tokens,
                               kind="verify" if n > 1 else "decode"))
        prior.append(rng.integers(0, cfg.vocab_size, start))
    rows = RowBatch.from_blocks(blocks, caches.block_tables, caches.ring_slots)
    raw = step.ngram_lookback(rows, prior, cfg.engram_max_ngram_size)
    history = engram_ref.ngram_history(raw, rows.positions, cfg.engram_max_ngram_size,
                                       cfg.engram_pad_token_id)
    bucket = rows.num_rows if pad_to is None else pad_to
    return rows, history, bucket


BATCHES = {"one": ([1], None), "verify6": ([6], None), "mix": ([1, 6, 3, 1], None),
           "padded": ([2, 1, 6], 16)}


def _poison(ranks, names):
    """Arena slices and bound caller tensors alike, on every rank."""
    for name in names:
        for rank, ctx in enumerate(ranks.contexts):
            if name in ctx.arena.slices:
                ranks.space.bytes(ctx.ptr(name), ctx.arena.nbytes(name))[...] = POISON
            else:
                ranks.tensors[rank][name].view(np.uint8)[...] = POISON


def _read_all(ranks, name, dtype, shape):
    """Every rank's `name`, asserting they are bitwise equal (replicated work)."""
    got = [ranks.read(r, name, dtype, shape) for r in range(ranks.tp)]
    for r in range(1, ranks.tp):
        assert np.array_equal(got[r].view(np.uint8), got[0].view(np.uint8)), (name, r)
    return got[0]


def _untouched(arr, bucket):
    assert (arr[bucket:].view(np.uint8) == POISON).all(), "written past the bucket"


def _bf16_ulp_bound(want):
    """One bf16 rounding: half an ulp, 2^-9 relative (doubled for the binade step) + tiny."""
    return 2.0**-8 * np.abs(want) + 1e-30


def _close(got, want, bound, what):
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    assert np.isfinite(got).all(), f"{what}: non-finite values"
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), f"{what}: |err| {err[worst]:.3g} > bound {bound[worst]:.3g}"
    return float(err.max())


# ---- head -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_head_rows_prep_embed_and_engram_hash(env, batch):
    ranks, model, caches = env
    cfg, rng = model.cfg, np.random.default_rng()
    rows, history, bucket = _batch(caches, cfg, rng, *BATCHES[batch])
    ranks.load(rows, caches, history)
    ids_names = [f"engram.ids.l{i}" for i in cfg.engram_layer_ids]
    _poison(ranks, ["embed.partial", "tokens32", "positions32", "history32", *ids_names])
    ranks.run(bucket, roles={"head.rows_prep", "head.embed", "head.engram_hash"})
    r, d, mr = rows.num_rows, cfg.hidden_size, ranks.max_rows
    tokens = np.zeros(bucket, np.int64)
    tokens[:r] = rows.token_ids                      # padding rows carry token 0
    partials = []
    for rank, rw in enumerate(model.ranks):
        part = ranks.read(rank, "embed.partial", BF16, (mr, d))
        _untouched(part, bucket)
        local = tokens - rw.vocab_offset
        mine = (local >= 0) & (local < rw.embed.shape[0])
        want = np.zeros((bucket, d), np.float32)
        want[mine] = rw.embed[local[mine]]
        assert np.array_equal(part[:bucket].astype(np.float32), want), rank   # a copy: exact
        partials.append(part[:r])
    # Each id lives on exactly one rank, so the all-reduce (summed by hand: the lead's stage)
    # is exact and equals the reference embedding bitwise.
    assert np.array_equal(step.all_reduce(partials), step.embed(model, rows.token_ids))
    tok32 = _read_all(ranks, "tokens32", np.int32, (mr,))
    assert np.array_equal(tok32[:bucket], tokens) and (tok32[bucket:] == -1).all()
    hist32 = _read_all(ranks, "history32", np.int32, (mr, cfg.engram_max_ngram_size))
    assert np.array_equal(hist32[:r], history)
    for layer, name in zip(cfg.engram_layer_ids, ids_names):
        n = cfg.engram_max_ngram_size - 1
        mult = np.array(cfg.engram_hash_multipliers(layer), np.int64)
        primes = np.array(cfg.engram_primes_flat(layer), np.int64).reshape(n, -1)
        ids = _read_all(ranks, name, np.int64, (mr, cfg.engram_num_hash_cols))
        _untouched(ids, bucket)
        assert np.array_equal(ids[:r], engram_ref.hash_ids(history, mult, primes)), layer


# ---- one layer's mHC + norms ----------------------------------------------------------------------

def _random_coeffs(model, rng, rows, layer, sublayer):
    """Realistic packed coefficients: the reference's for random streams."""
    streams = rng.standard_normal((rows, model.cfg.hc_mult, model.cfg.hidden_size))
    state = step.StreamState(streams=step.bf16(streams), carried_pre=None)
    return step._coefficients(model.cfg, model.ranks[0].layer(layer), sublayer, state, False)


def _check_sublayer(ranks, cfg, want_streams, want_coeff, coeff_name, want_x, norm_weight,
                    bucket, what):
    """streams, packed coefficients, collapse x and normed xn of the real rows against the
    reference; every rank equal; nothing past the bucket."""
    r, d, n, mr = want_x.shape[0], cfg.hidden_size, cfg.hc_mult, ranks.max_rows
    errs = {}
    streams = _read_all(ranks, "streams", BF16, (mr, n, d))
    # hc_post in the kernel ref and the model ref: the same fp32 formula, one bf16 rounding.
    errs["streams"] = _close(streams[:r].astype(np.float32), want_streams,
                             _bf16_ulp_bound(want_streams), f"{what} streams")
    coeff = _read_all(ranks, coeff_name, np.float32, (mr, mk.MIX_DIM))
    _untouched(coeff, bucket)
    want_packed = mk.pack_coefficients(want_coeff)
    # Sinkhorn of mixes whose sums may differ in order: the GPU test's 1e-5 (rcp.approx: 7.5e-7).
    errs["coeff"] = _close(coeff[:r], want_packed, np.full_like(want_packed, 1e-5),
                           f"{what} {coeff_name}")
    x = _read_all(ranks, "x", BF16, (mr, d))
    _untouched(x, bucket)
    errs["x"] = _close(x[:r].astype(np.float32), want_x, _bf16_ulp_bound(want_x), f"{what} x")
    xn = _read_all(ranks, "xn", BF16, (mr, d))
    _untouched(xn, bucket)
    # The norm of the kernel's own x (norm_ref is the kernel's bitwise reference): one rounding.
    want_xn = step.rms_norm(want_x, norm_weight, cfg.rms_norm_eps)
    errs["xn"] = _close(xn[:r].astype(np.float32), want_xn, _bf16_ulp_bound(want_xn) +
                        2.0**-8 * np.abs(want_xn), f"{what} xn")
    return errs


def _run_ffn_half(ranks, model, rng, layer, streams, attn_coeffs, bucket):
    """ffn.mhc_pre + ffn.norm from given streams (pre attention post) and attention coeffs."""
    cfg, r = model.cfg, streams.shape[0]
    attn_out = step.bf16(rng.standard_normal((bucket, cfg.hidden_size)))
    ranks.write("streams", step.bf16(np.concatenate(
        [streams, rng.standard_normal((bucket - r, *streams.shape[1:]))])).astype(BF16))
    packed = mk.pack_coefficients(attn_coeffs)
    ranks.write("coeff.attn", np.concatenate([packed, np.tile(packed[:1], (bucket - r, 1))]))
    ranks.write("attn.out", attn_out.astype(BF16))
    _poison(ranks, ["coeff.ffn", "x", "xn"])
    ranks.run(bucket, roles={"ffn.mhc_pre", "ffn.norm"}, layers={layer})
    lw = model.ranks[0].layer(layer)
    state = step.StreamState(streams=streams, carried_pre=attn_coeffs.pre)
    state.streams = mhc_ref.hc_post(attn_out[:r], streams, attn_coeffs)
    ffn_coeffs = step._coefficients(cfg, lw, "ffn", state, broadcast=False)
    want_x = step.bf16(mhc_ref.hc_collapse(state.streams, attn_coeffs.pre))
    return _check_sublayer(ranks, cfg, state.streams, ffn_coeffs, "coeff.ffn", want_x,
                           lw.vector("ffn_norm.weight"), bucket, f"layer {layer} ffn")


@pytest.mark.parametrize("batch", ["one", "verify6", "padded"])
def test_first_layer_broadcast_mixes_then_ffn(env, batch):
    ranks, model, caches = env
    cfg, rng = model.cfg, np.random.default_rng()
    rows, _, bucket = _batch(caches, cfg, rng, *BATCHES[batch])
    r, layer = rows.num_rows, 0
    assert not model.ranks[0].layer(layer).spec.has_engram
    embedding = step.bf16(rng.standard_normal((bucket, cfg.hidden_size)))
    ranks.write("embed.out", embedding.astype(BF16))
    _poison(ranks, ["streams", "coeff.attn", "x", "xn"])
    ranks.run(bucket, roles={"attn.mhc_pre", "attn.norm"}, layers={layer})
    state = step.start_streams(embedding[:r], cfg.hc_mult)
    lw = model.ranks[0].layer(layer)
    coeffs = step._coefficients(cfg, lw, "attn", state, broadcast=True)
    want_x = step.bf16(mhc_ref.hc_collapse(state.streams, state.carried_pre))
    assert np.array_equal(want_x, embedding[:r])          # the one-hot pre reads stream 0
    _check_sublayer(ranks, cfg, state.streams, coeffs, "coeff.attn", want_x,
                    lw.vector("attn_norm.weight"), bucket, "layer 0 attn")
    streams = _read_all(ranks, "streams", BF16, (ranks.max_rows, cfg.hc_mult, cfg.hidden_size))
    _untouched(streams, bucket)
    # The broadcast is a copy: every stream of every row (padding too) is the embedding.
    assert np.array_equal(streams[:bucket], np.repeat(embedding[:, None].astype(BF16), 4, 1))
    _run_ffn_half(ranks, model, rng, layer, state.streams, coeffs, bucket)


def _pending_state(model, rng, r, layer):
    """Streams with the previous layer's FFN post pending (random out, reference coefficients)."""
    cfg = model.cfg
    streams = step.bf16(rng.standard_normal((r, cfg.hc_mult, cfg.hidden_size)))
    prev = _random_coeffs(model, rng, r, layer - 1, "ffn")
    ffn_out = step.bf16(rng.standard_normal((r, cfg.hidden_size)))
    return step.StreamState(streams=streams, carried_pre=prev.pre, pending=(ffn_out, prev))


def _write_pending(ranks, state, bucket, rng):
    r = state.streams.shape[0]
    out, prev = state.pending
    pad = bucket - r
    ranks.write("streams", step.bf16(np.concatenate(
        [state.streams, rng.standard_normal((pad, *state.streams.shape[1:]))])).astype(BF16))
    ranks.write("ffn.out", step.bf16(np.concatenate(
        [out, rng.standard_normal((pad, out.shape[1]))])).astype(BF16))
    packed = mk.pack_coefficients(prev)
    ranks.write("coeff.ffn", np.concatenate([packed, np.tile(packed[:1], (pad, 1))]))


@pytest.mark.parametrize("batch", ["one", "mix", "padded"])
def test_later_layer_pending_post_mixes_collapse_and_norms(env, batch):
    ranks, model, caches = env
    cfg, rng = model.cfg, np.random.default_rng()
    rows, _, bucket = _batch(caches, cfg, rng, *BATCHES[batch])
    layer = 2
    assert not model.ranks[0].layer(layer).spec.has_engram
    state = _pending_state(model, rng, rows.num_rows, layer)
    _write_pending(ranks, state, bucket, rng)
    _poison(ranks, ["coeff.attn", "x", "xn"])
    ranks.run(bucket, roles={"attn.mhc_pre", "attn.norm"}, layers={layer})
    lw = model.ranks[0].layer(layer)
    step.apply_pending(state)
    coeffs = step._coefficients(cfg, lw, "attn", state, broadcast=False)
    want_x = step.bf16(mhc_ref.hc_collapse(state.streams, state.carried_pre))
    _check_sublayer(ranks, cfg, state.streams, coeffs, "coeff.attn", want_x,
                    lw.vector("attn_norm.weight"), bucket, f"layer {layer} attn")
    _run_ffn_half(ranks, model, rng, layer, state.streams, coeffs, bucket)


# ---- an Engram layer ------------------------------------------------------------------------------

def _all_gather_heads(ranks, bucket):
    """Stand-in for the lead's all-gather: every rank's local heads side by side, on every rank."""
    local = ranks.contexts[0].arena.nbytes("engram.local_heads") // ranks.max_rows // 2
    parts = [ranks.read(r, "engram.local_heads", BF16, (ranks.max_rows, local))[:bucket]
             for r in range(ranks.tp)]
    ranks.write("engram.heads", np.concatenate(parts, axis=1))


def _all_gather_kv(ranks, bucket):
    """Stand-in for engram.kv_allgather: every rank's wkv output pieces, in place."""
    local = ranks.contexts[0].arena.nbytes("engram.kv_local") // ranks.max_rows // 2
    parts = [ranks.read(r, "engram.kv_local", BF16, (ranks.max_rows, local))[:bucket]
             for r in range(ranks.tp)]
    ranks.write("engram.kv", gather_pieces_ref(parts, ek.kv_pieces(ranks.cfg, ranks.tp)[0]))


@pytest.mark.parametrize("batch", ["verify6", "padded"])
def test_engram_layer_lookup_wkv_gate_then_plain_mixes(env, batch):
    ranks, model, caches = env
    cfg, rng = model.cfg, np.random.default_rng()
    rows, history, bucket = _batch(caches, cfg, rng, *BATCHES[batch])
    layer, r, d, n = 4, rows.num_rows, cfg.hidden_size, cfg.hc_mult
    lws = model.layer(layer)
    assert lws[0].spec.has_engram
    ranks.load(rows, caches, history)
    ranks.run(bucket, roles={"head.rows_prep", "head.engram_hash"})
    # E1: each rank's columns; gathered by hand, they are the reference's looked-up heads.
    _poison(ranks, ["engram.local_heads", "engram.kv_local", "engram.kv"])
    ranks.run(bucket, roles={"engram.lookup"}, layers={layer})
    _all_gather_heads(ranks, bucket)
    mult = np.array(cfg.engram_hash_multipliers(layer), np.int64)
    primes = np.array(cfg.engram_primes_flat(layer), np.int64).reshape(cfg.engram_max_ngram_size
                                                                         - 1, -1)
    ids = engram_ref.hash_ids(history, mult, primes)
    cols = cfg.rank_shapes(4).engram_hash_cols
    looked = np.concatenate([engram_ref.lookup(ids[:, k * cols:(k + 1) * cols],
                                               lw.engram.table_codes, lw.engram.table_scales,
                                               lw.engram.row_offset)
                             for k, lw in enumerate(lws)], axis=1).reshape(r, -1)
    heads = _read_all(ranks, "engram.heads", BF16, (ranks.max_rows, looked.shape[1]))
    # Codes x 2^scale are exact in bf16 (engram_kernel_ref: scale bytes <= 134): bitwise.
    assert np.array_equal(heads[:r].astype(np.float32), looked)
    # E2: the column-sharded W8A16 wkv (each rank its kv_rank_rows), then all-gathered: the
    # reference's replicated wkv output. Each rank writes only its columns and bucket rows.
    ranks.run(bucket, roles={"engram.wkv"}, layers={layer})
    e0 = lws[0].engram
    want_kv = step.bf16(moe_ref.matmul_t(looked, e0.wkv))
    local = (n + 1) * d // ranks.tp
    for k in range(ranks.tp):
        part = ranks.read(k, "engram.kv_local", BF16, (ranks.max_rows, local))
        _untouched(part, bucket)
        cols = ek.kv_rank_rows(cfg, ranks.tp, k)
        _close(part[:r].astype(np.float32), want_kv[:, cols], 2 * dense_ref.dense_tolerance(
            looked.astype(BF16), e0.wkv[cols], "bf16"), f"engram.kv_local rank {k}")
    _all_gather_kv(ranks, bucket)
    kv = _read_all(ranks, "engram.kv", BF16, (ranks.max_rows, (n + 1) * d))
    _untouched(kv, bucket)
    # Both sides are rounded to bf16 on their own (the kernel's fp32 sum in its order, the
    # reference's in NumPy's): a sum near a rounding boundary lands one ulp (2^-7 |y|) apart,
    # which one dense_tolerance (half an ulp + the fp32 order) does not cover: twice it does.
    _close(kv[:r].astype(np.float32), want_kv, 2 * dense_ref.dense_tolerance(
        looked.astype(BF16), e0.wkv, "bf16"), "engram.kv")
    # E3 on the reference's kv (no chained error): pending post, gate; then the plain mixes.
    ranks.write("engram.kv", np.concatenate(
        [want_kv, kv[r:bucket].astype(np.float32)]).astype(BF16))
    state = _pending_state(model, rng, r, layer)
    _write_pending(ranks, state, bucket, rng)
    _poison(ranks, ["coeff.attn", "x", "xn"])
    ranks.run(bucket, roles={"engram.gate", "attn.mhc_pre", "attn.norm"}, layers={layer})
    step.apply_pending(state)
    posted = state.streams
    state.streams = engram_ref.gate_update(posted, want_kv, e0.q_weight, e0.k_weight,
                                           cfg.rms_norm_eps)
    coeffs = step._coefficients(cfg, lws[0], "attn", state, broadcast=False)
    want_x = step.bf16(mhc_ref.hc_collapse(state.streams, state.carried_pre))
    streams = _read_all(ranks, "streams", BF16, (ranks.max_rows, n, d))
    # gate_error_bound: the kernel's fp32 evaluation and the model reference's are each within
    # `bound` of the float64 gate (the reference's pairwise sums are no deeper than the kernel's).
    exact, bound = ek.gate_error_bound(posted, want_kv, e0.q_weight, e0.k_weight,
                                       cfg.rms_norm_eps, ek.make_gate_spec(d, n))
    _close(state.streams, exact, bound, "reference gate")
    _close(streams[:r].astype(np.float32), exact, bound, "gated streams")
    _check_sublayer(ranks, cfg, state.streams, coeffs, "coeff.attn", want_x,
                    lws[0].vector("attn_norm.weight"), bucket, f"layer {layer} attn (Engram)")


# ---- tail -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("batch", ["one", "mix", "padded"])
def test_tail_post_collapse_norm_and_argmax(env, batch):
    ranks, model, caches = env
    cfg, rng = model.cfg, np.random.default_rng()
    rows, _, bucket = _batch(caches, cfg, rng, *BATCHES[batch])
    r, d, mr = rows.num_rows, cfg.hidden_size, ranks.max_rows
    state = _pending_state(model, rng, r, cfg.num_hidden_layers)
    _write_pending(ranks, state, bucket, rng)
    _poison(ranks, ["hidden", "pick", "logits"])
    ranks.run(bucket, roles={"tail.mhc_post_collapse", "tail.norm", "tail.lm_head_argmax"})
    want_hidden = step.finish(model, state, model.ranks[0].norm)
    hidden = _read_all(ranks, "hidden", BF16, (mr, d))
    _untouched(hidden, bucket)
    # postonly = apply_pending + collapse (one bf16 rounding each), then norm_ref: 1 ulp each.
    _close(hidden[:r].astype(np.float32), want_hidden, 2 * _bf16_ulp_bound(want_hidden),
           "hidden")
    values, indices = [], []
    for rank, rw in enumerate(model.ranks):
        pick = ranks.read(rank, "pick", np.int32, (mr, 2))
        _untouched(pick, bucket)
        x = hidden[:r]                                     # the kernel's own input
        logits = head_ref.head_logits(x, rw.head)
        want_v, want_i = head_ref.local_argmax(logits, rw.vocab_offset)
        got_v = pick[:r, 0].view(np.float32)
        tol = lr.logits_tolerance(x, rw.head.astype(BF16))
        # The max logit within the fp32 accumulation bound; the index exact unless a runner-up
        # lies within that bound of the max (then either is a correct argmax of the kernel).
        _close(got_v, want_v, tol.max(axis=1), f"rank {rank} pick value")
        near = (logits >= want_v[:, None] - 2 * tol).sum(axis=1) > 1
        assert np.array_equal(pick[:r, 1][~near], want_i[~near]), rank
        got_logits = ranks.read(rank, "logits", np.float32, (mr, rw.head.shape[0]))
        _untouched(got_logits, bucket)
        _close(got_logits[:r], logits, tol, f"rank {rank} logits")
        values.append(got_v)
        indices.append(pick[:r, 1].astype(np.int64))
    tokens, full = step.head_and_argmax(model, hidden[:r].astype(np.float32))
    assert full.shape == (r, model.cfg.vocab_size)        # every rank's shard once, in order
    assert np.array_equal(full, np.concatenate(
        [head_ref.head_logits(hidden[:r].astype(np.float32), rw.head) for rw in model.ranks],
        axis=1))
    picked = head_ref.pick_across_ranks(np.stack(values), np.stack(indices))
    assert np.array_equal(picked, tokens)


# ---- the group's stages chained over layers -------------------------------------------------------

def _embed_allreduce(ranks, bucket, d):
    """Stand-in for the lead's head.embed_allreduce: rank-order fp32 sum, one bf16 rounding."""
    parts = [ranks.read(r, "embed.partial", BF16, (ranks.max_rows, d))[:bucket]
             for r in range(ranks.tp)]
    ranks.write("embed.out", step.all_reduce(parts).astype(BF16))


@pytest.mark.parametrize("batch", ["one", "padded"])
def test_chained_head_layers_and_tail(env, batch):
    """Every stage of the group from the head through layers 0-4 (first, Engram, plain, Engram)
    to the tail, the other groups' sublayers replaced by random outputs written into `attn.out` /
    `ffn.out`, the lead's embedding all-reduce and Engram all-gathers done on the host. This checks
    that the buffers carry from stage to stage and layer to layer (a wrong buffer gives O(1)
    errors); the per-stage bounds above compound through 5 layers of mixes and Sinkhorn, so the
    check here is 2^-5 relative + 2^-5 absolute on the normed activations (entries ~1)."""
    ranks, model, caches = env
    cfg, rng = model.cfg, np.random.default_rng()
    rows, history, bucket = _batch(caches, cfg, rng, *BATCHES[batch])
    r, d, mr, last = rows.num_rows, cfg.hidden_size, ranks.max_rows, 4
    ranks.load(rows, caches, history)
    ranks.run(bucket, roles={"head.rows_prep", "head.embed", "head.engram_hash"})
    _embed_allreduce(ranks, bucket, d)
    state = step.start_streams(step.embed(model, rows.token_ids), cfg.hc_mult)

    def check(name, want, what):
        got = _read_all(ranks, name, BF16, (mr, d))[:r].astype(np.float32)
        _close(got, want, 2.0**-5 * (np.abs(want) + 1), what)

    attn_roles = {"engram.lookup", "engram.wkv", "engram.gate", "attn.mhc_pre", "attn.norm"}
    for layer in range(last + 1):
        lw = model.ranks[0].layer(layer)
        if lw.spec.has_engram:
            ranks.run(bucket, roles={"engram.lookup"}, layers={layer})
            _all_gather_heads(ranks, bucket)
            ranks.run(bucket, roles={"engram.wkv"}, layers={layer})
            _all_gather_kv(ranks, bucket)
        ranks.run(bucket, roles=attn_roles - {"engram.lookup", "engram.wkv"}, layers={layer})
        broadcast = state.embedding is not None and not lw.spec.has_engram
        step.apply_pending(state)
        if lw.spec.has_engram:
            step.engram_update(model, layer, state, history)
        attn_coeffs = step._coefficients(cfg, lw, "attn", state, broadcast)
        state.embedding = None
        check("xn", step.rms_norm(mhc_ref.hc_collapse(state.streams, state.carried_pre),
                                  lw.vector("attn_norm.weight"), cfg.rms_norm_eps),
              f"layer {layer} attention input")
        attn_out = step.bf16(rng.standard_normal((bucket, d)))
        ranks.write("attn.out", attn_out.astype(BF16))
        ranks.run(bucket, roles={"ffn.mhc_pre", "ffn.norm"}, layers={layer})
        state.streams = mhc_ref.hc_post(attn_out[:r], state.streams, attn_coeffs)
        ffn_coeffs = step._coefficients(cfg, lw, "ffn", state, broadcast=False)
        check("xn", step.rms_norm(mhc_ref.hc_collapse(state.streams, attn_coeffs.pre),
                                  lw.vector("ffn_norm.weight"), cfg.rms_norm_eps),
              f"layer {layer} FFN input")
        ffn_out = step.bf16(rng.standard_normal((bucket, d)))
        ranks.write("ffn.out", ffn_out.astype(BF16))
        state.pending, state.carried_pre = (ffn_out[:r], ffn_coeffs), ffn_coeffs.pre
    ranks.run(bucket, roles={"tail.mhc_post_collapse", "tail.norm", "tail.lm_head_argmax"})
    check("hidden", step.finish(model, state, model.ranks[0].norm), "final hidden")
