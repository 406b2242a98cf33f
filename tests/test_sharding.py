"""loader.sharding: shards reassemble every tensor; TP products summed/concatenated over ranks match."""
import dataclasses

import numpy as np
import pytest
from tiny_checkpoint import tiny_checkpoint

from loader.checkpoint import Checkpoint
from loader.config import ModelConfig
from loader.formats import fp8_block_dequantize, fp8_block_scales_per_row, mxfp4_dequantize
from loader.schema import Split, checkpoint_schema
from loader.sharding import rank_nbytes, rank_range, rank_shape, rank_tensors, shard


@pytest.fixture(scope="module")
def ckpt():
    with Checkpoint.open(tiny_checkpoint(), progress=False) as ck:
        yield ck


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shards_reassemble_every_tensor(ckpt, tp):
    seen = set()
    for name, spec in ckpt.specs.items():
        full = ckpt.get(name)
        parts = [shard(ckpt, spec, tp, r) for r in range(tp)]
        for r, part in enumerate(parts):
            assert part.shape == rank_shape(spec, tp, r)
            assert part.nbytes == rank_nbytes(spec, tp, r)
            assert np.shares_memory(part, full)  # a view of the mapping, not a copy
        if spec.split is Split.REPLICATED:
            address = full.__array_interface__["data"][0]
            assert all(p.shape == full.shape and p.__array_interface__["data"][0] == address
                       for p in parts)
        else:
            whole = np.concatenate(parts, axis=spec.split.dim)
            assert whole.tobytes() == np.ascontiguousarray(full).tobytes(), name
        seen.add(spec.split)
    assert seen == set(Split)  # the tiny schema exercises every split rule


def test_engram_table_cut_follows_hash_columns(ckpt):
    cfg = ckpt.config
    for layer in cfg.engram_layer_ids:
        spec = ckpt.spec(f"layers.{layer}.engram.embed.weight")
        for r in range(4):
            assert rank_range(spec, 4, r) == cfg.engram_rank_rows(layer, 4, r)


def test_rank_tensors_is_lazy_and_complete(ckpt):
    it = rank_tensors(ckpt, 4, 3)
    first = next(it)
    assert first[0] == ckpt.names[0]
    names = [first[0]] + [n for n, _ in it]
    assert names == ckpt.names


def _fp8(ckpt, base):
    return ckpt.get(f"{base}.weight"), ckpt.get(f"{base}.scale")


@pytest.mark.parametrize("tp", [2, 4])
def test_row_parallel_sum_and_column_parallel_concat(ckpt, tp):
    """wo_b (row) partial products sum to the full product; wq_b (column) outputs concatenate.

    Both sides dequantize the same e4m3 bytes with the same 2^k scales, so the weights are equal
    exactly; products run in float64 from float32 inputs (x and w have <= 24-bit significands),
    so each partial dot product is exact to ~2^-53 relative of its magnitude: the summed partials
    differ from the full product only by float64 reassociation, bounded by 1e-12 x sum |x w|.
    """
    rng = np.random.default_rng()
    base = "layers.5.attn.wo_b"
    w, s = _fp8(ckpt, base)
    spec_w, spec_s = ckpt.spec(f"{base}.weight"), ckpt.spec(f"{base}.scale")
    x = rng.standard_normal((7, w.shape[1])).astype(np.float32)
    full_w = fp8_block_dequantize(w, s).astype(np.float64)
    want = x @ full_w.T
    got = np.zeros_like(want)
    for r in range(tp):
        part = fp8_block_dequantize(shard(ckpt, spec_w, tp, r), shard(ckpt, spec_s, tp, r))
        lo, hi = rank_range(spec_w, tp, r)
        got += x[:, lo:hi].astype(np.float64) @ part.astype(np.float64).T
    bound = 1e-12 * (np.abs(x) @ np.abs(full_w).T)
    assert (np.abs(got - want) <= bound).all()

    base = "layers.5.attn.wq_b"
    w, s = _fp8(ckpt, base)
    spec_w, spec_s = ckpt.spec(f"{base}.weight"), ckpt.spec(f"{base}.scale")
    x = rng.standard_normal((3, w.shape[1])).astype(np.float32)
    want = x @ fp8_block_dequantize(w, s).T
    parts = [x @ fp8_block_dequantize(shard(ckpt, spec_w, tp, r), shard(ckpt, spec_s, tp, r)).T
             for r in range(tp)]
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), want)  # same dots, same order


@pytest.mark.parametrize("tp", [2, 4])
def test_expert_split_on_intermediate(ckpt, tp):
    """w1 cut on out and w2 cut on in (I/2 bytes, I/32 scales): the expert's SwiGLU-free
    product x -> w1 -> w2 summed over ranks equals the full one (float64, tolerance as above)."""
    rng = np.random.default_rng()
    w1 = [ckpt.get(f"layers.2.ffn.experts.9.w1.{k}") for k in ("weight", "scale")]
    w2 = [ckpt.get(f"layers.2.ffn.experts.9.w2.{k}") for k in ("weight", "scale")]
    specs1 = [ckpt.spec(f"layers.2.ffn.experts.9.w1.{k}") for k in ("weight", "scale")]
    specs2 = [ckpt.spec(f"layers.2.ffn.experts.9.w2.{k}") for k in ("weight", "scale")]
    x = rng.standard_normal((5, ckpt.config.hidden_size))
    d1, d2 = (mxfp4_dequantize(*w).astype(np.float64) for w in (w1, w2))
    want = (x @ d1.T) @ d2.T
    got = np.zeros_like(want)
    for r in range(tp):
        p1 = mxfp4_dequantize(*(shard(a, s, tp, r) for a, s in zip(w1, specs1)))
        p2 = mxfp4_dequantize(*(shard(a, s, tp, r) for a, s in zip(w2, specs2)))
        got += (x @ p1.astype(np.float64).T) @ p2.astype(np.float64).T
    bound = 1e-12 * ((np.abs(x) @ np.abs(d1).T) @ np.abs(d2).T)
    assert (np.abs(got - want) <= bound).all()


def test_every_v41_tensor_cuts_cleanly_at_tp4():
    """The real shapes: every split lands on whole blocks/groups (no exception) at tp 1, 2, 4."""
    specs = checkpoint_schema(ModelConfig.preset("v41-flash"))
    for tp in (1, 2, 4):
        for spec in specs:
            sizes = {rank_shape(spec, tp, r) for r in range(tp)}
            assert len(sizes) == 1 or spec.split is Split.ENGRAM_COLS
    by_name = {t.name: t for t in specs}
    assert rank_shape(by_name["layers.0.attn.wq_b.weight"], 4, 0) == (8192, 1280)
    assert rank_shape(by_name["layers.0.attn.wo_a.scale"], 4, 0) == (64, 128)
    assert rank_shape(by_name["layers.0.ffn.experts.0.w2.weight"], 4, 3) == (5120, 288)
    assert rank_shape(by_name["layers.0.ffn.experts.0.w2.scale"], 4, 3) == (5120, 18)
    assert rank_shape(by_name["head.weight"], 4, 1) == (32320, 5120)


def test_bad_tp_rank_and_uncuttable_shape(ckpt):
    spec = ckpt.spec("layers.0.attn.wq_b.weight")
    with pytest.raises(ValueError, match="tp=3 is not supported"):
        shard(ckpt, spec, 3, 0)
    with pytest.raises(ValueError, match="rank 4 is outside 0..3"):
        shard(ckpt, spec, 4, 4)
    with pytest.raises(ValueError, match="array shape \\[2, 2\\] is not the schema's"):
        shard(np.zeros((2, 2)), spec, 2, 0)
    odd = dataclasses.replace(spec, shape=(96, 256))  # 96/4 = 24 rows: not whole 32-row blocks
    with pytest.raises(ValueError, match="wq_b.weight: dim 0 .* whole 32-entry units"):
        rank_range(odd, 4, 0)


@pytest.mark.parametrize("base", ["layers.1.attn.wq_b", "layers.1.attn.wo_b", "layers.1.attn.wo_a",
                                  "layers.1.ffn.shared_experts.w1"])
def test_block_scale_cut_equals_vllm_per_row_cut(ckpt, base):
    """vLLM expands scales to rows first, then slices; our block-form cut expands to the same."""
    spec_w, spec_s = ckpt.spec(base + ".weight"), ckpt.spec(base + ".scale")
    per_row = fp8_block_scales_per_row(ckpt.get(base + ".scale"))
    for r in range(4):
        cut = rank_range(spec_w, 4, r)
        if spec_w.split.dim == 0:
            want = per_row[cut[0]:cut[1]]
        else:
            want = per_row[:, cut[0] // 32:cut[1] // 32]
        np.testing.assert_array_equal(fp8_block_scales_per_row(shard(ckpt, spec_s, 4, r)), want)
