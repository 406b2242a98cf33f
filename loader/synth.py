"""Deterministic synthetic V4.1 checkpoints: real names, dtypes and shapes; values that run finite.

`hopdec synth --config {tiny,v41-flash} [--layers N] [--seed S] --out DIR` writes `config.json`,
safetensors shards of at most `--shard-gb` and `model.safetensors.index.json`; where the config's
Engram needs a compressed-vocab map (v41), also `engram_vocab_map.npy` holding
`engram_vocab.synthetic_vocab_map(cfg, seed)` (a non-identity map), which `synth_fetch` serves too.

Determinism: every tensor draws from its own generator seeded by (seed, blake2b(name)); an FP8
weight and its scale come from one generator seeded by their common base name (they are quantized
together). Any tensor can thus be regenerated alone, in any order, by any process.

Values (chosen so a forward pass stays finite and routes/predicts varied tokens):
- linear weights ~ N(0, 1/fan_in) before quantization; embed rows ~ N(0, 1) (distinct rows);
  head ~ N(0, 1/D), so logits are O(1);
- except the sublayer output projections (`attn.wo_b`, the routed and shared experts' `w2`), which
  are 1/32 of that (OUTPUT_GAIN): with unit-gain residual branches a random 10..43-layer model is
  chaotic, so a 1-ulp difference (TP1 vs TP4 reduction order) flips a routing near-tie and then the
  greedy tokens within a few steps; trained models have small branch outputs against the residual
  stream too. With 1/32 TP1 and TP4 agree over tens of tokens and tokens stay varied;
- norms 1 + N(0, 0.05^2); router bias and VL bias N(0, 0.01^2); attn_sink N(0, 0.5^2);
- mHC: fn ~ N(0, 1/(n D)) so mixes are O(1), scale ~ U(0.3, 0.7), base near 0 for pre/post and
  2*I + N(0, 0.1^2) for comb, so Sinkhorn starts from a diagonal-dominant, well-conditioned matrix.
- Dense FP8 weights are really quantized (`formats.fp8_block_quantize`: UE8M0 per 32x32 block,
  the smallest power of two that fits the block amax in 448, RNE); Engram table rows likewise
  with one scale per row and 32 columns.
- MXFP4 experts are drawn directly (quantizing 384 x 3 float experts per layer is too slow on two
  cores): codes are i.i.d. with the law of round-to-nearest-E2M1(N(0, 2.2^2)) (what an MX
  quantizer produces for Gaussian weights, whose group amax lands at ~4..8 scale units), and the
  scale bytes sit at the level of N(0, 1/fan_in) with a -1/0/+1 binade spread plus a sparse tail
  (1 group in 512, and at least one per tensor) 13..21 binades below, so Humming's fused-E8M0
  re-rounding (range > 11) is exercised in every expert. The joint law differs from quantized
  Gaussians only in that codes and scales are independent; the marginal laws and the dynamic
  range are the same.

`--layers N` (N < num_hidden_layers) writes layers 0..N-1 plus embed, norm and head, and a config
that is the first-N slice: num_hidden_layers = N, compress_ratios[:N], kv/index source and Engram
layer lists restricted to ids < N (engram_num_embeddings sliced alongside: a prefix of the Engram
layers keeps its primes), candidate_source_layer_id -1 (NO_CANDIDATE_SOURCE) when the candidate
source is cut off, and no DSpark (num_nextn_predict_layers 0, no dspark_target_layer_ids): the stages read aux states of
target layers the slice no longer has. The slice is valid because every role refers only to
layers at or below it (model doc §1.2).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import sys
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from loader import engram_vocab, sharding
from loader.config import ModelConfig
from loader.config_checks import NO_CANDIDATE_SOURCE
from loader.formats import E4M3_MAX, fp8_block_quantize, ue8m0_scale_for_amax
from loader.progress import Progress
from loader.safetensors import DTYPES, TensorToWrite, write_safetensors
from loader.schema import BLOCK, Fmt, TensorSpec, checkpoint_schema

INDEX_NAME = "model.safetensors.index.json"
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
MXFP4_CODE_STD = 2.2  # code-unit std of the Gaussian that the E2M1 codes are drawn from
OUTPUT_GAIN_LOG2 = -5  # output projections at 2^-5 of N(0, 1/fan_in): see the module docstring
OUTPUT_PROJECTIONS = ("attn.wo_b", "shared_experts.w2")  # plus every routed expert's w2


def output_gain(name: str) -> float:
    """2^OUTPUT_GAIN_LOG2 for a sublayer output projection's weight or scale, else 1."""
    base = name.rsplit(".", 1)[0]
    is_output = base.endswith(OUTPUT_PROJECTIONS) or (".experts." in base and base.endswith(".w2"))
    return 2.0**OUTPUT_GAIN_LOG2 if is_output else 1.0
FAR_GROUP_RATE = 1 / 512  # scale groups placed 13..21 binades below the level (range > 11)


def slice_config(cfg: ModelConfig, num_layers: int | None) -> ModelConfig:
    """The config of layers 0..num_layers-1 (see the module docstring), or `cfg` itself."""
    L = cfg.num_hidden_layers
    if num_layers is None or num_layers == L:
        return cfg
    if not 1 <= num_layers < L:
        raise ValueError(f"--layers {num_layers} is outside 1..{L} for this config")
    d = cfg.to_dict()

    def keep(ids: tuple[int, ...]) -> list[int]:
        return [i for i in ids if i < num_layers]

    engram = keep(cfg.engram_layer_ids)
    d.update(
        num_hidden_layers=num_layers,
        compress_ratios=list(cfg.compress_ratios[:num_layers]),
        kv_source_layer_ids=keep(cfg.kv_source_layer_ids),
        index_source_layer_ids=keep(cfg.index_source_layer_ids),
        engram_layer_ids=engram,
        engram_num_embeddings=list(cfg.engram_num_embeddings[:len(engram)]),
        num_nextn_predict_layers=0,
        dspark_target_layer_ids=[],
    )
    if cfg.candidate_source_layer_id >= num_layers:
        d["candidate_source_layer_id"] = NO_CANDIDATE_SOURCE
    return ModelConfig.from_dict(d, source=f"first {num_layers} layers of the config")


# ---- per-tensor values ---------------------------------------------------------------------------


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    """The generator of one tensor (or FP8 weight/scale pair), from (seed, name) alone."""
    digest = hashlib.blake2b(name.encode(), digest_size=16).digest()
    words = np.frombuffer(digest, dtype=np.uint32).tolist()
    return np.random.default_rng(np.random.SeedSequence([seed & 0xFFFFFFFF, *words]))


def fp8_quantize(w: np.ndarray, block_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """FP8 e4m3 + one UE8M0 byte per (block_rows x 32) block, by formats' ceil rule (amax fits 448).

    32x32 is `formats.fp8_block_quantize`; 1x32 (Engram table rows) applies the same rule per row.
    """
    if block_rows == BLOCK:
        return fp8_block_quantize(w)
    n, k = w.shape
    groups = w.reshape(n, k // BLOCK, BLOCK)
    scales = ue8m0_scale_for_amax(np.abs(groups).max(axis=-1), E4M3_MAX)
    inverse = np.ldexp(np.float32(1.0), 127 - scales.astype(np.int32))[..., None]
    return (groups * inverse).astype(ml_dtypes.float8_e4m3fn).reshape(n, k), scales


def _e2m1_code_lut() -> np.ndarray:
    """uint16 random -> packed byte of two E2M1 codes (low byte -> low nibble), by inverse CDF."""
    edges = (E2M1_MAGNITUDES[1:] + E2M1_MAGNITUDES[:-1]) / 2 / MXFP4_CODE_STD
    cdf = np.array([0.5 * (1 + math.erf(x / math.sqrt(2))) for x in edges])
    p_mag = np.diff(np.concatenate([[0.5], cdf, [1.0]]))  # mass of |v| rounding to each magnitude
    probs = np.concatenate([p_mag, p_mag])  # codes 0..7 positive, 8..15 negative (8 = -0)
    cum = np.cumsum(probs / probs.sum())
    code_of_u8 = np.searchsorted(cum, (np.arange(256) + 0.5) / 256).astype(np.uint8)
    v = np.arange(65536)
    return (code_of_u8[v & 255] | (code_of_u8[v >> 8] << 4)).astype(np.uint8).view(np.int8)


_CODE_LUT = _e2m1_code_lut()


def mxfp4_codes(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Packed int8 E2M1 pairs drawn directly (see the module docstring)."""
    count = math.prod(shape)
    draws = rng.integers(0, 1 << 16, size=count, dtype=np.uint16)
    return _CODE_LUT[draws].reshape(shape)  # fancy indexing: ~5x faster than take() here


def mxfp4_scales(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int,
                 gain: float = 1.0) -> np.ndarray:
    """UE8M0 bytes at the level of N(0, gain^2/fan_in) weights, -1/0/+1 binade spread, a far tail."""
    level = 127 + round(math.log2(gain * fan_in**-0.5 / MXFP4_CODE_STD))
    spread = rng.choice(np.array([-1, 0, 1], np.int16), size=shape, p=[0.25, 0.5, 0.25])
    far = rng.random(shape) < FAR_GROUP_RATE
    far.flat[rng.integers(far.size)] = True  # at least one per tensor: every expert is exercised
    spread[far] -= rng.integers(13, 22, size=int(far.sum()), dtype=np.int16)
    return (level + spread).astype(np.uint8)


def _plain_values(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    """BF16/F32 tensors: the value laws of the module docstring."""
    shape = spec.shape
    if spec.init == "hc_base":  # pre, post near 0; comb 2*I so Sinkhorn starts diagonal-dominant
        n = round(math.sqrt(shape[0] + 1)) - 1  # mix width = (2 + n) * n
        values = rng.normal(0.0, 0.1, shape)
        values[2 * n:] += 2.0 * np.eye(n).reshape(-1)
    elif spec.init == "hc_scale":
        values = rng.uniform(0.3, 0.7, shape)
    elif spec.init == "ones":
        values = 1.0 + rng.normal(0.0, spec.std, shape)
    else:
        values = rng.standard_normal(shape, dtype=np.float32) * np.float32(spec.std)
    return np.asarray(values).astype(DTYPES[spec.dtype])


class ValueSource:
    """Produces every tensor of a schema from (seed, name); caches the FP8 pair it last made, one
    per thread (threads may draw different tensors at once; a weight and its scale are asked by
    one thread one after the other)."""

    def __init__(self, seed: int):
        self.seed = seed
        self._last = threading.local()      # .pair: ((base, columns), weight, scale), per thread

    def __call__(self, spec: TensorSpec, columns: tuple[int, int] | None = None) -> np.ndarray:
        """The tensor of `spec`; `columns` (FP8 pairs only): weight columns [c0, c1) on whole
        blocks, quantized from the same whole draw (the blocks are independent: what cutting
        the whole pair gives, at a fraction of the quantization)."""
        if spec.fmt in (Fmt.FP8, Fmt.FP8_SCALE):
            key = (spec.base, columns)
            pair = getattr(self._last, "pair", None)
            if pair is None or pair[0] != key:
                pair = self._last.pair = (key, *self._fp8_pair(spec, columns))
            return pair[1] if spec.fmt is Fmt.FP8 else pair[2]
        rng = tensor_rng(self.seed, spec.name)
        if spec.fmt is Fmt.MXFP4:
            return mxfp4_codes(rng, spec.shape)
        if spec.fmt is Fmt.MXFP4_SCALE:
            return mxfp4_scales(rng, spec.shape, fan_in=spec.shape[1] * BLOCK,
                                gain=output_gain(spec.name))
        return _plain_values(spec, rng)

    def _fp8_pair(self, spec: TensorSpec, columns=None) -> tuple[np.ndarray, np.ndarray]:
        rng = tensor_rng(self.seed, spec.base)
        # Engram table rows are embeddings ~ N(0, 1) with one scale per row and 32 columns;
        # linear weights ~ N(0, 1/fan_in) with one scale per 32x32 block.
        block_rows = 1 if spec.cls == "engram_table" else BLOCK
        n, k = spec.shape
        if spec.fmt is Fmt.FP8_SCALE:
            n, k = n * block_rows, k * BLOCK
        std = np.float32(1.0 if block_rows == 1 else k**-0.5 * output_gain(spec.name))
        draw = rng.standard_normal((n, k), dtype=np.float32)     # whole: one sequential stream
        if columns is not None:
            if columns[0] % BLOCK or columns[1] % BLOCK:
                raise ValueError(f"{spec.base}: columns {columns} are not on {BLOCK}-column blocks")
            draw = draw[:, columns[0]:columns[1]]
        return fp8_quantize(draw * std, block_rows)


def synth_fetch(cfg: ModelConfig, seed: int, tp: int, rank: int):
    """fetch(name) -> rank `rank`'s slice of the tensor a synthetic checkpoint of `cfg` would hold.

    The values `synth(cfg, out, seed)` writes, generated on demand without any file: a stage
    module's `weights()` can pack a rank from it directly. A tensor cut along its rows whose
    values are drawn row after row (`_drawn_by_rows`) is drawn only up to the rank's last row
    (the first rows of a longer draw are the same values); an FP8 pair cut along its columns is
    drawn whole and only the rank's blocks quantized; any other is drawn whole and cut by
    `loader.sharding.shard`. An unknown name raises KeyError naming it. Threads may call it
    at once (every tensor has its own generator; the FP8 pair cache is per thread).
    """
    specs = {t.name: t for t in checkpoint_schema(cfg)}
    sharding.rank_range(next(iter(specs.values())), tp, rank)   # a bad tp or rank fails here
    source = ValueSource(seed)

    def fetch(name: str) -> np.ndarray:
        if name == engram_vocab.VOCAB_MAP_NAME and engram_vocab.needs_map(cfg):
            return engram_vocab.synthetic_vocab_map(cfg, seed)      # as synth() writes it
        try:
            spec = specs[name]
        except KeyError:
            raise KeyError(f"synthetic {cfg.model_type} checkpoint (seed {seed}): no tensor "
                           f"{name!r} in the schema of this config") from None
        cut = sharding.rank_range(spec, tp, rank)
        if cut is not None and spec.split.dim == 0 and _drawn_by_rows(spec):
            head = dataclasses.replace(spec, shape=(cut[1], *spec.shape[1:]))
            return source(head)[cut[0]:]
        if cut is not None and spec.split.dim == 1 and spec.fmt in (Fmt.FP8, Fmt.FP8_SCALE):
            unit = BLOCK if spec.fmt is Fmt.FP8_SCALE else 1      # a scale column: 32 weights
            return source(spec, columns=(cut[0] * unit, cut[1] * unit))
        return sharding.shard(source(spec), spec, tp, rank)

    return fetch


def _drawn_by_rows(spec: TensorSpec) -> bool:
    """Whether rows [0, n) of the tensor are what drawing an n-row tensor gives: one sequential
    draw in row-major order (normal / ones laws, MXFP4 codes), or an FP8 pair quantized per
    32-row block (or per row) from such a draw, cut on whole blocks. MXFP4 scales are not
    (their far groups are drawn after the whole spread)."""
    if spec.fmt in (Fmt.BF16, Fmt.FP32):
        return spec.init in ("normal", "ones")
    return spec.fmt in (Fmt.FP8, Fmt.FP8_SCALE, Fmt.MXFP4)


# ---- writing -------------------------------------------------------------------------------------


def plan_shards(specs: list[TensorSpec], shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive tensors, at most `shard_bytes` per shard (a larger tensor gets its own)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for t in specs:
        if shards[-1] and size + t.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def synth(cfg: ModelConfig, out: str | Path, seed: int = 0, layers: int | None = None,
          shard_bytes: int = 4 << 30, progress: bool = True) -> Path:
    """Write a synthetic checkpoint of `cfg` (its first `layers` layers) into `out`."""
    out = Path(out)
    cfg = slice_config(cfg, layers)
    specs = checkpoint_schema(cfg)
    shards = plan_shards(specs, shard_bytes)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out}: output directory is not empty (refusing to mix checkpoints)")
    out.mkdir(parents=True, exist_ok=True)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    try:
        _write(out, cfg, specs, shards, names, seed, progress)
    except BaseException:
        for name in [*names, INDEX_NAME, "config.json", engram_vocab.VOCAB_MAP_FILE]:
            # leave nothing half-written
            (out / name).unlink(missing_ok=True)
        raise
    return out


def _write(out: Path, cfg: ModelConfig, specs: list[TensorSpec], shards: list[list[TensorSpec]],
           names: list[str], seed: int, progress: bool) -> None:
    """The shards, then the index, then config.json (a reader needs all three)."""
    source = ValueSource(seed)
    bar = Progress(f"synth {out.name}", sum(t.nbytes for t in specs), progress)

    def produce(t: TensorToWrite) -> np.ndarray:
        spec = by_name[t.name]
        array = source(spec)
        bar.add(spec.nbytes, spec.name)
        return array

    by_name = {t.name: t for t in specs}
    for file_name, shard in zip(names, shards):
        write_safetensors(out / file_name, [TensorToWrite(t.name, t.dtype, t.shape) for t in shard],
                          produce, metadata={"format": "pt", "hopdec_synth_seed": str(seed)})
    weight_map = {t.name: f for f, shard in zip(names, shards) for t in shard}
    index = {"metadata": {"total_size": sum(t.nbytes for t in specs)}, "weight_map": weight_map}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=1) + "\n")
    if engram_vocab.needs_map(cfg):
        np.save(out / engram_vocab.VOCAB_MAP_FILE, engram_vocab.synthetic_vocab_map(cfg, seed))
    cfg.to_json(out / "config.json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="preset name (tiny, v41-flash) or a "
                        "config.json path")
    parser.add_argument("--layers", type=int, default=None,
                        help="write only layers 0..N-1 (+ embed, norm, head; no DSpark)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-gb", type=float, default=4.0, help="maximum shard size in GB")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def run(args: argparse.Namespace) -> int:
    path = Path(args.config)
    try:
        cfg = ModelConfig.from_json(path) if path.suffix == ".json" else ModelConfig.preset(args.config)
        start = time.monotonic()
        out = synth(cfg, args.out, args.seed, args.layers, int(args.shard_gb * 2**30),
                    progress=not args.quiet)
    except (ValueError, TypeError, OSError) as exc:
        print(f"hopdec synth: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out} in {time.monotonic() - start:.1f} s")
    return 0
