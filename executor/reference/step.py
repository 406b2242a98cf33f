"""The whole V4.1 decode step in NumPy (model doc §2.1-§2.3): the oracle for the GPU executor.

    ids -> vocab-parallel embed (+AR-0) -> 4 streams -> 40 x [ (Engram) mHC, attention (+AR-1),
    mHC, MoE (+AR-2) ] -> mHC post -> collapse with the last FFN's pre -> norm -> split-vocab head
    -> greedy argmax

TP-faithful: every rank-split product is computed per rank from that rank's weights
(`RankWeights`), and the partials are summed where the real system all-reduces, in rank order,
in fp32, then rounded to BF16 once (`all_reduce`). Replicated work (mHC, router, Engram `wkv`,
norms) is computed once. KV caches are replicated on every rank and every rank writes the same
bytes, so one `KVCaches` serves all ranks (the attention sublayer runs per rank; its writes are
idempotent).

Delayed mHC (V4.1): a sublayer collapses its input with the *previous* sublayer's pre and carries
its own pre forward; the FFN's post/comb are applied at the start of the next layer (after which
Engram updates the streams); the last FFN's post is applied before the final collapse.
DSpark aux states are the mean over the 4 streams of each target layer's input (model doc §4).

`exact=True` turns off FP8 activation quantization in the experts (the KV caches carry their own
`exact` flag) and uses plain MXFP4 expert weights.

Engram hashes compressed token ids (`engram_history`): the raw lookback, padded with the raw pad
id before position 0, through the compressed-vocab map (`ReferenceModel.vocab_map`: the weights'
map, loader/engram_vocab.py, unless the model is given one or IDENTITY). Decode, verify and
prefill blocks all go through `decode_step`, so all hash the same way; the DSpark draft stages
have no Engram.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from executor.reference import attention
from executor.reference.float64_weights import Float64Weights
from executor.reference.rows import RowBatch
from executor.reference.weights import LayerWeights, RankWeights
from kernels import engram_ref, head_ref, mhc_ref, moe_ref
from kernels.norm_ref import rmsnorm_ref
from loader import engram_vocab, formats
from loader.config import ModelConfig


def bf16(x: np.ndarray) -> np.ndarray:
    return formats.bf16_round(x)


def all_reduce(partials: Sequence[np.ndarray]) -> np.ndarray:
    """Sum BF16 partials in rank order in fp32, round once to BF16 (the one-shot AR epilogue)."""
    total = np.zeros_like(partials[0], dtype=np.float32)
    for part in partials:
        total = total + bf16(part)
    return bf16(total)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """kernels.norm_ref RMSNorm of BF16 values, returned as float32."""
    return rmsnorm_ref(formats.to_bf16(x), weight.astype(np.float32), eps).astype(np.float32)


@dataclass(frozen=True)
class ReferenceModel:
    """The model on `tp` ranks: one RankWeights per rank. `engram_vocab_map`: None = the map the
    weights serve (loader.engram_vocab.fetch_vocab_map: a checkpoint's file, a synthetic map, the
    identity where none is needed, else an error naming the ways to supply one), an int32
    [vocab_size] array, or engram_vocab.IDENTITY (hash raw ids: the explicit opt-out).
    `rank_workers` > 1 runs the ranks' attention heads, MoE and head on that many threads
    (`map_ranks`); `float64_cache_bytes` > 0 keeps the float64 copies of the MoE, Engram,
    DSpark and head weights that every product sums over (`float64`), up to that many bytes.
    Both give the same values in less time where the weights are large."""

    cfg: ModelConfig
    ranks: tuple[RankWeights, ...]
    exact: bool = False
    engram_vocab_map: np.ndarray | str | None = None
    rank_workers: int = 1
    float64_cache_bytes: int = 0

    @property
    def tp(self) -> int:
        return len(self.ranks)

    @functools.cached_property
    def vocab_map(self) -> np.ndarray:
        """The compressed-vocab map Engram hashes through, int32 [vocab_size] (validated)."""
        if self.engram_vocab_map is None:
            return engram_vocab.fetch_vocab_map(self.cfg, self.ranks[0].fetch)
        return engram_vocab.resolve(self.cfg, self.engram_vocab_map, "ReferenceModel")

    @functools.cached_property
    def float64(self) -> Float64Weights:
        """The float64 weight copies (none kept when float64_cache_bytes is 0)."""
        return Float64Weights(self.float64_cache_bytes)

    def layer(self, index: int) -> list[LayerWeights]:
        return [r.layer(index) for r in self.ranks]

    def map_ranks(self, fn: Callable, items) -> list:
        """[fn(item) for item in items], on `rank_workers` threads when > 1. Each rank's part
        reads only its own weights and the shared inputs, and NumPy releases the GIL in its
        conversions and matmuls, so the ranks run at once and return what they would in turn."""
        items = list(items)
        if self.rank_workers <= 1 or len(items) < 2:
            return [fn(item) for item in items]
        with ThreadPoolExecutor(min(self.rank_workers, len(items))) as pool:
            return list(pool.map(fn, items))


@dataclass
class StreamState:
    """The residual streams between sublayers: X [R, n, D] plus what the delayed mHC still owes."""

    streams: np.ndarray
    carried_pre: np.ndarray                      # [R, n]: the previous sublayer's pre
    pending: tuple[np.ndarray, mhc_ref.HcCoefficients] | None = None  # (FFN out, its coeffs)
    embedding: np.ndarray | None = None          # set until the first layer (broadcast mixes)


@dataclass(frozen=True)
class StepOutput:
    """Results of one step for R rows: greedy tokens, full fp32 logits, final hidden, aux states."""

    tokens: np.ndarray   # [R] int64
    logits: np.ndarray   # [R, V] float32 (ranks' shards side by side; the GPU never gathers them)
    hidden: np.ndarray   # [R, D] BF16 values after the final norm
    aux: np.ndarray      # [R, len(dspark_target_layer_ids), D] BF16 values (empty if none)


def embed(model: ReferenceModel, token_ids: np.ndarray) -> np.ndarray:
    """Vocab-parallel lookup (each rank: its rows, zeros elsewhere) + AR-0 -> [R, D] BF16 values."""
    ids = np.asarray(token_ids, np.int64)
    vocab = model.cfg.vocab_size
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"token ids must be in [0, {vocab}), got {ids.min()}..{ids.max()}")
    partials = []
    for rank in model.ranks:
        local = ids - rank.vocab_offset
        mine = (local >= 0) & (local < rank.embed.shape[0])
        part = np.zeros((ids.shape[0], model.cfg.hidden_size), np.float32)
        part[mine] = rank.embed[local[mine]]
        partials.append(part)
    return all_reduce(partials)


def start_streams(embedding: np.ndarray, n_streams: int) -> StreamState:
    """Expand to n copies; the carried pre starts one-hot so the first layer reads the embedding."""
    rows = embedding.shape[0]
    streams = np.repeat(embedding[:, None, :], n_streams, axis=1)
    return StreamState(streams=streams, carried_pre=mhc_ref.one_hot_pre(rows, n_streams),
                       embedding=embedding)


def _coefficients(cfg: ModelConfig, lw: LayerWeights, sublayer: str, state: StreamState,
                  broadcast: bool) -> mhc_ref.HcCoefficients:
    hc = lw.hc(sublayer)
    if broadcast:
        mixes = mhc_ref.hc_mixes_broadcast(state.embedding, hc.fn_summed, cfg.rms_norm_eps)
    else:
        mixes = mhc_ref.hc_mixes(state.streams, hc.fn, cfg.rms_norm_eps)
    return mhc_ref.hc_coefficients(mixes, hc.scale, hc.base, cfg.hc_mult, cfg.hc_sinkhorn_iters,
                                   cfg.hc_eps)


def apply_pending(state: StreamState) -> None:
    """Apply the previous FFN's mHC post to the streams (delayed to the next layer's start)."""
    if state.pending is not None:
        out, coeffs = state.pending
        state.streams = mhc_ref.hc_post(out, state.streams, coeffs)
        state.pending = None


def engram_update(model: ReferenceModel, layer: int, state: StreamState,
                  history: np.ndarray) -> None:
    """E1-E3: hash, per-rank lookup of its columns, all-gather, replicated wkv, gate."""
    cfg = model.cfg
    orders, heads = cfg.engram_max_ngram_size - 1, cfg.engram_n_heads
    multipliers = np.array(cfg.engram_hash_multipliers(layer), np.int64)
    primes = np.array(cfg.engram_primes_flat(layer), np.int64).reshape(orders, heads)
    ids = engram_ref.hash_ids(history, multipliers, primes)
    cols = cfg.rank_shapes(model.tp).engram_hash_cols
    gathered = []
    for r, lw in enumerate(model.layer(layer)):
        e = lw.engram
        gathered.append(engram_ref.lookup(ids[:, r * cols:(r + 1) * cols], e.table_codes,
                                          e.table_scales, e.row_offset))
    looked_up = np.concatenate(gathered, axis=1).reshape(ids.shape[0], -1)
    e0 = model.ranks[0].layer(layer).engram
    keys_and_value = bf16(model.float64.matmul_t(looked_up, e0.wkv))
    state.streams = engram_ref.gate_update(state.streams, keys_and_value, e0.q_weight, e0.k_weight,
                                           cfg.rms_norm_eps)


def moe_sublayer(model: ReferenceModel, layer: int, x: np.ndarray) -> np.ndarray:
    """F1-F4 per rank, then AR-2 -> [R, D] BF16 values."""
    cfg = model.cfg
    lws = model.layer(layer)
    lw0 = lws[0]
    routing = moe_ref.route(x, lw0.vector("ffn.gate.weight"), lw0.vector("ffn.gate.bias"), lw0.topk,
                            cfg.routed_scaling_factor)
    partials = model.map_ranks(
        lambda lw: moe_ref.moe_partial(x, routing, lw.experts, lw.shared, cfg.swiglu_limit,
                                       not model.exact, model.float64), lws)
    return all_reduce(partials)


def run_layer(model: ReferenceModel, layer: int, state: StreamState, rows: RowBatch, caches,
              history: np.ndarray | None) -> None:
    """One decoder layer (backbone or DSpark stage) on the streams, in place."""
    cfg = model.cfg
    lws = model.layer(layer)
    lw0 = lws[0]
    # The first layer's streams are n copies of the embedding (unless Engram changes them first).
    broadcast = state.embedding is not None and not lw0.spec.has_engram
    apply_pending(state)
    if lw0.spec.has_engram:
        if history is None:
            raise ValueError(f"layer {layer} has Engram: the step needs the token history")
        engram_update(model, layer, state, history)
    attn_coeffs = _coefficients(cfg, lw0, "attn", state, broadcast)
    state.embedding = None
    x = rms_norm(mhc_ref.hc_collapse(state.streams, state.carried_pre),
                 lw0.vector("attn_norm.weight"), cfg.rms_norm_eps)
    # Per-rank partials; the replicated half (cache writes, top-k, gathers) is computed once.
    # (map_ranks only where it threads: tests record this call with the serial signature.)
    threads = {"map_ranks": model.map_ranks} if model.rank_workers > 1 else {}
    partials = attention.attention_sublayer_ranks(lws, x, rows, caches, cfg, model.tp,
                                                  exact=model.exact, **threads)
    state.streams = mhc_ref.hc_post(all_reduce(partials), state.streams, attn_coeffs)
    ffn_coeffs = _coefficients(cfg, lw0, "ffn", state, broadcast=False)
    x = rms_norm(mhc_ref.hc_collapse(state.streams, attn_coeffs.pre),
                 lw0.vector("ffn_norm.weight"), cfg.rms_norm_eps)
    state.pending = (moe_sublayer(model, layer, x), ffn_coeffs)
    state.carried_pre = ffn_coeffs.pre


def finish(model: ReferenceModel, state: StreamState, norm_weight: np.ndarray) -> np.ndarray:
    """Last post, collapse with the last FFN's pre, final norm -> [R, D] BF16 values."""
    apply_pending(state)
    return rms_norm(mhc_ref.hc_collapse(state.streams, state.carried_pre), norm_weight,
                    model.cfg.rms_norm_eps)


def head_and_argmax(model: ReferenceModel, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-rank BF16 head logits, split-vocab greedy pick: (tokens [R], logits [R, V])."""
    values, indices = [], []
    shards = model.map_ranks(lambda rank: model.float64.matmul_t(hidden, rank.head), model.ranks)
    for rank, logits in zip(model.ranks, shards):
        v, i = head_ref.local_argmax(logits, rank.vocab_offset)
        values.append(v)
        indices.append(i)
    tokens = head_ref.pick_across_ranks(np.stack(values), np.stack(indices))
    return tokens, np.concatenate(shards, axis=1)


def ngram_lookback(rows: RowBatch, prior_tokens: Sequence[np.ndarray], max_ngram: int) -> np.ndarray:
    """[R, max_ngram] token at p-k of each row (k = 0..max_ngram-1); 0 where p-k < 0 or padding.

    `prior_tokens[s]` holds sequence s's tokens at positions 0..start-1 (before its block);
    the block's own earlier rows supply the rest. Engram maps p-k < 0 to its pad id.
    """
    out = np.zeros((rows.num_rows, max_ngram), np.int64)
    for s in range(rows.num_seqs):
        idx = rows.seq_rows(s)
        start = int(rows.positions[idx[0]])
        prior = np.asarray(prior_tokens[s], np.int64)
        if prior.shape[0] < start:
            raise ValueError(f"sequence {s}: {prior.shape[0]} prior tokens, its block starts at {start}")
        seq = np.concatenate([prior[:start], rows.token_ids[idx]])
        for j, row in enumerate(idx):
            p = start + j
            for k in range(min(max_ngram, p + 1)):
                out[row, k] = seq[p - k]
    return out


def compressed_ids(cfg: ModelConfig, tokens: np.ndarray,
                   vocab_map: np.ndarray | str | None = None) -> np.ndarray:
    """Raw token ids -> Engram's compressed ids int64 through `vocab_map` (an int32 [vocab_size]
    array, engram_vocab.IDENTITY, or None: the identity where compressed >= vocab, else
    EngramVocabMapError saying how to supply the map)."""
    table = engram_vocab.resolve(cfg, vocab_map, "compressed_ids")
    return engram_ref.compress(tokens, table)


def engram_history(model: ReferenceModel, rows: RowBatch,
                   prior_tokens: Sequence[np.ndarray]) -> np.ndarray:
    """[R, max_ngram] compressed history of each row: the raw lookback, the RAW pad id where
    p-k < 0, then the map (the compressed pad is map[pad_id], as DeepSeek's NgramHashMapping)."""
    cfg = model.cfg
    raw = ngram_lookback(rows, prior_tokens, cfg.engram_max_ngram_size)
    padded = engram_ref.ngram_history(raw, rows.positions, cfg.engram_max_ngram_size,
                                      cfg.engram_pad_token_id)
    return engram_ref.compress(padded, model.vocab_map)


def decode_step(model: ReferenceModel, rows: RowBatch, caches,
                prior_tokens: Sequence[np.ndarray]) -> StepOutput:
    """One target forward over all backbone layers for the rows of `rows` (model doc §2.1-§2.3)."""
    cfg = model.cfg
    history = engram_history(model, rows, prior_tokens) if cfg.engram_layer_ids else None
    state = start_streams(embed(model, rows.token_ids), cfg.hc_mult)
    aux = []
    for layer in range(cfg.num_hidden_layers):
        if layer in cfg.dspark_target_layer_ids:
            apply_pending(state)
            aux.append(bf16(state.streams.mean(axis=1)))
        run_layer(model, layer, state, rows, caches, history)
    hidden = finish(model, state, model.ranks[0].norm)
    tokens, logits = head_and_argmax(model, hidden)
    aux_arr = np.stack(aux, axis=1) if aux else np.zeros((rows.num_rows, 0, cfg.hidden_size))
    return StepOutput(tokens=tokens, logits=logits, hidden=hidden, aux=aux_arr)
