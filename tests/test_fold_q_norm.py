"""q_norm folded into wq_b / the indexer's wq_b (attn_proj.FOLD_Q_NORM, kernels.dense_qnorm) on
the emulated tiny step (4 ranks, CPU), and the folded kernels' spec and reference.

The step with the switch on and off, from the same state: every caller tensor (tokens, logits,
every KV cache and ring) and every arena byte equal, but the q_norm scratch (attn.qr, attn.kv:
the folded chain does not write them at R <= 8; above 8 split_rmsnorm writes attn.kv, attn_prep
does not). At a verify block (6 rows: the folded kernels) and a padded bucket of 16 (split_rmsnorm
+ the r32 kernels).
"""
import numpy as np
import pytest
from ref_model import prefilled_tiny, tiny_checkpoint, token_history

from executor.emulate.ranks import EmulatedRanks
from executor.reference.rows import RowBatch, RowBlock
from executor.stages import attn_proj
from executor.wiring import STAGE_MODULES
from kernels import dense_qnorm_ref as qr
from kernels import dense_ref as dr
from kernels import norm_ref
from kernels.common_ref import to_bf16
from loader.config import ModelConfig

SCRATCH = {"attn.qr", "attn.kv"}


def _step(bundle_dir, model, caches, rows, history):
    ranks = EmulatedRanks(tiny_checkpoint(), bundle_dir, 4, caches, modules=STAGE_MODULES)
    ranks.load(rows, caches, history)
    ranks.run(rows.num_rows)
    return ranks


def _arena_bytes(ranks) -> dict:
    return {(k, name): a.view(name, np.uint8, (a.nbytes(name),)).tobytes()
            for k, a in enumerate(ranks.arenas) for name in a.slices if name not in SCRATCH}


@pytest.mark.parametrize("verify", [1, 6, 13])
def test_step_writes_the_same_bytes_with_q_norm_folded_or_not(tiny_bundle_dir, monkeypatch,
                                                              verify):
    assert attn_proj.q_norm_folded()
    rng = np.random.default_rng()
    model, caches, seq = prefilled_tiny(rng, 4)
    toks = [seq[-1], *rng.integers(0, 1000, verify - 1).tolist()]
    kind, bucket = ("decode", 1) if verify == 1 else ("verify", 8 if verify <= 8 else 16)
    rows = RowBatch.from_blocks([RowBlock(0, len(seq) - 1, tuple(toks), kind)],
                                caches.block_tables, caches.ring_slots, pad_to=bucket)
    history = (token_history(model.cfg, rows, [np.asarray(seq + toks[1:], np.int64)])
               if model.cfg.engram_layer_ids else None)
    on = _step(tiny_bundle_dir, model, caches, rows, history)
    names = [s.kernel.name for _, specs in on.plans[0].launches(rows.num_rows) for s in specs]
    assert any(n.startswith(qr.PREFIX) for n in names) == attn_proj.folded_rows(rows.num_rows)
    monkeypatch.setattr(attn_proj, "FOLD_Q_NORM", False)
    off = _step(tiny_bundle_dir, model, caches, rows, history)
    names = [s.kernel.name for _, specs in off.plans[0].launches(rows.num_rows) for s in specs]
    assert not any(n.startswith(qr.PREFIX) for n in names)
    for k in range(4):
        for name in sorted(on.tensors[k]):
            assert on.tensors[k][name].tobytes() == off.tensors[k][name].tobytes(), (k, name)
    a, b = _arena_bytes(on), _arena_bytes(off)
    differ = sorted(key for key in a if a[key] != b[key])
    assert not differ, f"{len(differ)} arena buffers differ: {differ[:8]}"


@pytest.mark.parametrize("preset", ["tiny", "v41-flash"])
def test_specs_follow_the_step_kernels(preset):
    cfg = ModelConfig.preset(preset)
    shapes = dr.dense_shapes(cfg, 4)
    specs = qr.specs_for(cfg, 4)
    assert [s.name.split("_n")[0] for s in specs] == [f"{qr.PREFIX}_{lb}" for lb in qr.LABELS]
    for spec in specs:
        label = spec.name.removeprefix(qr.PREFIX + "_").split("_n")[0]
        base = dr.make_spec(label, *shapes[label][:2], variant=qr.VARIANT)
        assert (spec.n, spec.k, spec.variant, spec.ctas) == (base.n, base.k, base.variant,
                                                            base.ctas)
        assert spec.x_stride == cfg.q_lora_rank + cfg.head_dim and spec.x_resident
        assert spec.params == qr.PARAMS and spec.smem_bytes > base.smem_bytes
        assert qr.DenseQNormSpec.from_dict(spec.to_dict()) == spec
        assert spec.to_dict()["family"] == "dense_qnorm"
        assert spec.smem_bytes <= dr.STREAM_SMEM_BUDGET
    with pytest.raises(ValueError, match="resident"):        # K > 2048: x not resident
        qr.make_spec("wq_b", 1024, 2560, 2560 + 512, variant="stream_xtu")
    with pytest.raises(ValueError, match="whole warp"):
        qr.make_spec("wq_b", 8192, 128, 640)


def test_reference_normalises_the_q_half_only():
    rng = np.random.default_rng()
    spec = qr.specs_for(ModelConfig.preset("tiny"), 4)[0]
    x = to_bf16(rng.standard_normal((5, spec.x_stride)))
    w = rng.uniform(-2, 2, spec.k).astype(np.float32)
    xn = qr.normalized_x(spec, x, w, 1e-20)
    np.testing.assert_array_equal(xn.view(np.uint16),
                                  norm_ref.rmsnorm_ref(x[:, :spec.k], w, 1e-20).view(np.uint16))
    x2 = x.copy()
    x2[:, spec.k:] = 7.0                                       # the kv half is not read
    np.testing.assert_array_equal(qr.normalized_x(spec, x2, w, 1e-20).view(np.uint16),
                                  xn.view(np.uint16))
