"""One rank's weights for the reference step: dequantized to float32 once, cached per layer.

Every value is exact: FP8 x UE8M0 and FP4 x UE8M0 products and BF16 numbers are all float32
numbers, so the reference multiplies the very values the GPU multiplies. `fetch(name)` supplies the
rank's slice of a checkpoint tensor in its checkpoint dtype (loader.sharding does the TP cut), so
this module knows names (loader/schema.py) and formats (loader/formats.py), never files.

Routed experts follow the stock SM90 path (humming-formats §2.1): per rank, w13 = [w1; w3] and w2
are each one Humming sublayer, padded as Humming pads them, put through the fused-E8M0 transform
(which may re-round an expert's smallest groups) and sliced back. `humming_experts=False` keeps the
plain MXFP4 values instead (the official reference's weights, for "exact" comparisons).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kernels.moe_ref import ExpertShard
from loader import formats
from loader.config import LayerSpec, ModelConfig

Fetch = Callable[[str], np.ndarray]


@dataclass(frozen=True)
class HcWeights:
    """mHC weights of one sublayer: fn [m, n·D] fp32, base [m], scale [3]; fn_summed [m, D] for layer 0."""

    fn: np.ndarray
    base: np.ndarray
    scale: np.ndarray
    fn_summed: np.ndarray


@dataclass(frozen=True)
class EngramWeights:
    """Engram of one layer on one rank: its hash columns' table rows plus the replicated projection."""

    table_codes: np.ndarray   # float8_e4m3fn [rows_l, head_dim]
    table_scales: np.ndarray  # uint8 UE8M0 [rows_l, head_dim / 32]
    row_offset: int           # first global table row of this rank
    wkv: np.ndarray           # float32 [(n + 1)·D, cols·head_dim] (W8A16, replicated)
    q_weight: np.ndarray      # float32 [n, D]
    k_weight: np.ndarray      # float32 [n, D]


class LayerWeights:
    """One layer (or DSpark stage) on one rank. Attention reads its tensors through `dense`/`vector`.

    `dense(base)` is the float32 W8A16 weight of `{prefix}{base}.weight/.scale`; `vector(name)` a
    plain BF16/F32 tensor `{prefix}{name}` as float32. Both are cached.
    """

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, fetch: Fetch, prefix: str, tp: int,
                 rank: int, humming_experts: bool):
        self.cfg, self.spec, self.prefix, self.tp, self.rank = cfg, spec, prefix, tp, rank
        self._fetch, self._humming = fetch, humming_experts
        self._cache: dict[str, object] = {}

    def raw(self, name: str) -> np.ndarray:
        """The rank's slice of `{prefix}{name}` in its checkpoint dtype."""
        return self._fetch(self.prefix + name)

    def dense(self, base: str) -> np.ndarray:
        key = "dense:" + base
        if key not in self._cache:
            self._cache[key] = formats.fp8_block_dequantize(
                self.raw(base + ".weight"), self.raw(base + ".scale"), name=self.prefix + base)
        return self._cache[key]

    def vector(self, name: str) -> np.ndarray:
        key = "vector:" + name
        if key not in self._cache:
            self._cache[key] = np.asarray(self.raw(name)).astype(np.float32)
        return self._cache[key]

    def hc(self, sublayer: str) -> HcWeights:
        """mHC weights of 'attn' or 'ffn'."""
        key = "hc:" + sublayer
        if key not in self._cache:
            fn = self.vector(f"hc_{sublayer}_fn")
            n = self.cfg.hc_mult
            self._cache[key] = HcWeights(
                fn=fn, base=self.vector(f"hc_{sublayer}_base"), scale=self.vector(f"hc_{sublayer}_scale"),
                fn_summed=fn.reshape(fn.shape[0], n, -1).sum(axis=1))
        return self._cache[key]

    @property
    def num_experts(self) -> int:
        return self.cfg.dspark_n_routed_experts if self.spec.is_dspark else self.cfg.n_routed_experts

    @property
    def topk(self) -> int:
        return (self.cfg.dspark_num_experts_per_tok if self.spec.is_dspark
                else self.cfg.num_experts_per_tok)

    @functools.cached_property
    def experts(self) -> list[ExpertShard]:
        """Every routed expert's rank slice, dequantized (fused-E8M0 unless humming_experts=False)."""
        return [self._expert(e) for e in range(self.num_experts)]

    def _expert(self, e: int) -> ExpertShard:
        def pair(w: str) -> tuple[np.ndarray, np.ndarray]:
            base = f"ffn.experts.{e}.{w}"
            return np.asarray(self.raw(base + ".weight")), np.asarray(self.raw(base + ".scale"))

        (p1, s1), (p3, s3), (p2, s2) = pair("w1"), pair("w3"), pair("w2")
        w13 = (np.concatenate([p1, p3]), np.concatenate([s1.view(np.uint8), s3.view(np.uint8)]))
        return ExpertShard(w13=self._expert_weight(*w13, f"expert {e} w13"),
                           w2=self._expert_weight(p2, s2, f"expert {e} w2"))

    def _expert_weight(self, packed: np.ndarray, scales: np.ndarray, what: str) -> np.ndarray:
        name = f"{self.prefix}{what} (rank {self.rank})"
        if not self._humming:
            return formats.mxfp4_dequantize(packed, scales, name=name)
        n, k = packed.shape[0], packed.shape[1] * 2
        padded = formats.humming_pad_sublayer(packed, scales)
        fused = formats.fused_e8m0(*padded, name=name)
        return formats.fused_e8m0_dequantize(fused)[:n, :k]

    @functools.cached_property
    def shared(self) -> ExpertShard:
        w1, w3 = self.dense("ffn.shared_experts.w1"), self.dense("ffn.shared_experts.w3")
        return ExpertShard(w13=np.concatenate([w1, w3]), w2=self.dense("ffn.shared_experts.w2"))

    @functools.cached_property
    def engram(self) -> EngramWeights | None:
        if not self.spec.has_engram:
            return None
        start, _ = self.cfg.engram_rank_rows(self.spec.index, self.tp, self.rank)
        return EngramWeights(
            table_codes=np.asarray(self.raw("engram.embed.weight")),
            table_scales=np.asarray(self.raw("engram.embed.scale")).view(np.uint8),
            row_offset=int(start), wkv=self.dense("engram.wkv"),
            q_weight=self.vector("engram.q_weight"), k_weight=self.vector("engram.k_weight"))


class RankWeights:
    """All weights of one rank at tensor parallelism `tp`: layers built lazily, then cached."""

    def __init__(self, cfg: ModelConfig, fetch: Fetch, tp: int, rank: int,
                 humming_experts: bool = True):
        cfg.rank_shapes(tp)  # validates tp
        if not 0 <= rank < tp:
            raise ValueError(f"rank {rank} is outside 0..{tp - 1} for tp={tp}")
        self.cfg, self.tp, self.rank = cfg, tp, rank
        self._fetch, self._humming = fetch, humming_experts
        self._layers: dict[int, LayerWeights] = {}

    def layer(self, index: int) -> LayerWeights:
        if index not in self._layers:
            spec = self.cfg.layer(index)
            stage = index - self.cfg.num_hidden_layers
            prefix = f"mtp.{stage}." if spec.is_dspark else f"layers.{index}."
            self._layers[index] = LayerWeights(self.cfg, spec, self._fetch, prefix, self.tp,
                                               self.rank, self._humming)
        return self._layers[index]

    @property
    def fetch(self) -> Fetch:
        """name -> this rank's slice of a checkpoint tensor in its checkpoint dtype."""
        return self._fetch

    def _plain(self, name: str) -> np.ndarray:
        return np.asarray(self._fetch(name)).astype(np.float32)

    @functools.cached_property
    def embed(self) -> np.ndarray:
        """float32 [V_l, D]: vocabulary rows [rank·V_l, (rank+1)·V_l)."""
        return self._plain("embed.weight")

    @functools.cached_property
    def head(self) -> np.ndarray:
        """float32 [V_l, D], the same vocabulary split as `embed`."""
        return self._plain("head.weight")

    @functools.cached_property
    def norm(self) -> np.ndarray:
        return self._plain("norm.weight")

    @property
    def vocab_offset(self) -> int:
        return self.cfg.rank_shapes(self.tp).vocab_offset(self.rank)


def rank_weights_from_checkpoint(ckpt, tp: int, rank: int,
                                 humming_experts: bool = True) -> RankWeights:
    """RankWeights over an open loader.checkpoint.Checkpoint, cut by loader.sharding."""
    from loader.sharding import shard

    def fetch(name: str) -> np.ndarray:
        return shard(ckpt, ckpt.spec(name), tp, rank)

    return RankWeights(ckpt.config, fetch, tp, rank, humming_experts)
