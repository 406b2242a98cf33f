"""executor.stages.attn_proj on four emulated ranks (tiny, CPU): the attention's projections, KV
cache writes and output, against executor/reference/attention.py.

Per case (rows 1 (decode), 6 (a verify block), 13 real rows (decode + verify + draft + decode on
four state lines) in a bucket of 16 whose 3 padding rows carry slot -1 / sequence -1 and zero
xn) and per layer kind (0: SWA-only, 2: ratio-2 kv source, 6: ratio-1 kv source), fresh random
bf16 xn and attn.o, fresh caches whose compressor rings hold random (kv | score) rows of the 7
positions before each block; every group buffer poisoned (0xFF) first; all seven roles run in
lockstep on every rank. Checked, every element, on every rank:
- attn.qkv within 2 x `dense_tolerance` of the reference's `_linear` (wq_a | wkv) on the same xn
  (kernel and reference each within one such bound of the exact product: fp32 summation order,
  one bf16 rounding);
- attn.qr bitwise the reference's `_norm(q half, q_norm)` of the emulated qkv (the split kernel
  replays rmsnorm_ref's order); attn.kv bitwise the kv half, or, with attn_proj.FUSED_ATTN_PREP
  (attn_prep reads the kv half of attn.qkv), untouched, and the SWA checks use the kv half;
- attn.q against the reference's q = bf16(RoPE(_linear(qr, wq_b))) on the emulated qr, within
  `_q_bound`: the two wq_b outputs are 2 x dense_tolerance apart (at QGMMA_WQ_B_ROWS the QGMMA
  kernel's qgmma_tolerance + split_error_bound + dense_tolerance), the rotation adds a pair's two
  gaps (|cos|, |sin| <= 1), each side's bf16 rounding adds 2^-8 of its value;
- swa_{l}: the record of every real row bitwise insert_swa's composition (kv_norm, RoPE, bf16,
  record) on the emulated kv, and bitwise the reference insert_swa's own record wherever the
  emulated kv row equals the reference's; every other slot keeps its previous bytes;
- kv sources: the compressor ring bitwise the reference `compress` (the projection sums in
  float64 in both), compressed_{l} / index_keys_{l} records bitwise the reference's (the emulator
  runs the same compressor_ref arithmetic on the same kv_score), unpublished slots untouched;
- attn.z within 2 x dense_tolerance of the reference's grouped wo_a on the same attn.o;
  attn.partial within 2 x dense_tolerance of bf16(z·wo_bᵀ) on the emulated z, and end to end within
  `_partial_bound` of bf16(attention_rank's fp32 partial) (what AR-1 rounds each rank's to);
- replicated outputs (qkv, qr, kv, caches) identical on every rank; nothing written at or past the
  bucket's last row of any row buffer.
"""
from __future__ import annotations

import numpy as np
import pytest
from stage_checks import within_bound
from tiny_checkpoint import tiny_checkpoint

from executor.emulate.ranks import EmulatedRanks
from executor.launches import dense as dl
from executor.reference import attention as ra
from executor.reference.kvcache import KVCaches
from executor.reference.rows import RowBatch, RowBlock
from executor.reference.weights import rank_weights_from_checkpoint
from executor.stages import attn_proj
from kernels import dense_qgmma_ref as qg
from kernels import dense_ref as dr
from kernels import kvrecord_ref, rope_ref
from kernels.common_ref import BF16
from loader.checkpoint import Checkpoint
from loader.formats import bf16_round

TP = 4
MODULES = ("executor.stages.attn_proj", "stage_attn_proj_inputs")
ROLES = set(attn_proj.BUILDERS)
LAYERS = (0, 2, 6)                              # SWA-only, ratio-2 kv source, ratio-1 kv source
CASES = {"decode": (("decode", 1),), "verify": (("verify", 6),),
         "mixed": (("decode", 1), ("verify", 6), ("draft", 5), ("decode", 1))}
BUCKETS = {"decode": 1, "verify": 6, "mixed": 16}
ROW_BUFFERS = ("attn.qkv", "attn.qr", "attn.kv", "attn.q", "attn.z", "attn.partial",
               "attn.kv_score")


class Setup:
    def __init__(self, ckpt, bundle_dir):
        from loader.sharding import shard

        self.cfg = cfg = ckpt.config
        self.fetch = lambda name: shard(ckpt, ckpt.spec(name), TP, 1)
        self.caches = KVCaches.allocate(cfg, max_seqs=4, max_context=64, page_size=16)
        self.ranks = EmulatedRanks(ckpt, bundle_dir, TP, self.caches, modules=MODULES)
        self.refs = [rank_weights_from_checkpoint(ckpt, TP, r) for r in range(TP)]
        self.shapes = cfg.rank_shapes(TP)
        self.widths = {b.name: int(np.prod(b.shape[1:])) * np.dtype(b.dtype).itemsize
                       for b in attn_proj.buffers(cfg, TP, self.ranks.max_rows)}
        self.widths["attn.partial"] = cfg.hidden_size * 2

    def rows(self, rng, case: str) -> RowBatch:
        lines = rng.permutation(self.caches.max_seqs)
        blocks = []
        for line, (kind, n) in zip(lines, CASES[case]):
            start = int(rng.integers(8, 64 - n))
            tokens = tuple(int(t) for t in rng.integers(0, self.cfg.vocab_size, n))
            blocks.append(RowBlock(int(line), start, tokens, kind))
        return RowBatch.from_blocks(blocks, self.caches.block_tables, self.caches.ring_slots,
                                    pad_to=BUCKETS[case])

    def caches_for(self, rng, rows: RowBatch) -> KVCaches:
        """Fresh caches whose ratio-2 rings hold the 7 positions before each block."""
        caches = self.caches.copy()
        rr = caches.ring_rows
        for layer, ring in caches.ring.items():
            for s in range(rows.num_seqs):
                line, start = rows.state_lines[s], int(rows.positions[rows.seq_rows(s)[0]])
                for p in range(max(0, start - rr + 1), start):
                    ring[line, p % rr] = rng.standard_normal(ring.shape[-1])
                    caches.ring_pos[layer][line, p % rr] = p
        return caches

    def read(self, rank, name, dtype, shape):
        return self.ranks.read(rank, name, dtype, shape)


@pytest.fixture(scope="module")
def setup(tiny_bundle_dir):
    with Checkpoint.open(tiny_checkpoint(), progress=False) as ckpt:
        yield Setup(ckpt, tiny_bundle_dir)


# ---- comparisons --------------------------------------------------------------------------------

def _bits(a) -> np.ndarray:
    return np.asarray(a).astype(BF16).view(np.uint16)


def _q_bound(tol: np.ndarray, got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """|bf16(R u) - bf16(R v)| for |u - v| <= 2 tol: the rope dims mix a pair's two gaps."""
    gap = 2.0 * tol
    pairs = gap[..., -rope_ref.ROPE_DIM:].reshape(*gap.shape[:-1], rope_ref.PAIRS, 2).sum(-1)
    gap[..., -rope_ref.ROPE_DIM:] = np.repeat(pairs, 2, axis=-1)
    return gap + 2.0**-8 * (np.abs(got.astype(np.float64)) + np.abs(want)) + 2.0**-133


def _partial_bound(kernel, z, z_ref, wo_b, got, want):
    """bf16(z·Wᵀ) (kernel, emulated z) vs bf16(f32(z_ref·Wᵀ)) (reference): the kernel within
    `kernel` (_wo_b_tolerance) of its exact product, the exact products |W|·|z - z_ref| apart,
    the reference's f32 and bf16 roundings 2^-24 + 2^-8 of its value."""
    gap = np.abs(z.astype(np.float64) - z_ref) @ np.abs(wo_b.astype(np.float64)).T
    return (kernel + gap
            + (2.0**-8 + 2.0**-24) * (np.abs(got.astype(np.float64)) + np.abs(want)) + 2.0**-133)


def _qgmma_bound(s: Setup, label: str, x, w) -> np.ndarray:
    """|QGMMA kernel - exact product| (kernels.dense_qgmma_ref): qgmma_tolerance of its split
    x's product, that within split_error_bound of the exact one."""
    spec = dl.qgmma_spec(s.ranks.bundle, label)
    w64 = w.astype(np.float64)
    return qg.qgmma_tolerance(spec, x, w64) + qg.split_error_bound(spec, x, np.abs(w64))


def _wo_b_tolerance(s: Setup, bucket: int, z, w) -> np.ndarray:
    """|kernel wo_b - exact z·Wᵀ|: dense_tolerance, or at attn_proj.QGMMA_WO_B_ROWS the QGMMA
    kernel's bound."""
    if bucket in attn_proj.QGMMA_WO_B_ROWS:
        return _qgmma_bound(s, "wo_b", z, w)
    return dr.dense_tolerance(z, w, "bf16")


def _wq_b_tolerance(s: Setup, bucket: int, qr, w) -> np.ndarray:
    """Half the bound of |kernel wq_b - reference _linear| (_q_bound doubles it): the plain and
    folded kernels within dense_tolerance of the exact product, as the reference is; QGMMA
    (attn_proj.QGMMA_WQ_B_ROWS) within qgmma_tolerance of its split x's product, that within
    split_error_bound of the exact one."""
    dense = dr.dense_tolerance(qr, w, "bf16")
    if bucket not in attn_proj.QGMMA_WQ_B_ROWS:
        return dense
    return 0.5 * (_qgmma_bound(s, "wq_b", qr, w) + dense)


# ---- the run ------------------------------------------------------------------------------------

def _run(s: Setup, rng, case: str, layer: int):
    cfg, bucket = s.cfg, BUCKETS[case]
    rows = s.rows(rng, case)
    caches = s.caches_for(rng, rows)
    history = np.zeros((bucket, cfg.engram_max_ngram_size), np.int64)
    s.ranks.load(rows, caches, history)
    x = np.zeros((bucket, cfg.hidden_size), BF16)     # padding rows: a zero stream's norm
    x[rows.real] = rng.standard_normal((int(rows.real.sum()), cfg.hidden_size)).astype(BF16)
    o = rng.standard_normal((bucket, s.shapes.heads, cfg.head_dim)).astype(BF16)
    for arena in s.ranks.arenas:
        for name in ROW_BUFFERS:
            arena.fill(name, 0xFF)
    s.ranks.write("xn", x)
    s.ranks.write("attn.o", o)
    s.ranks.write("positions32", rows.positions.astype(np.int32))
    launched = s.ranks.run(bucket, roles=ROLES, layers={layer})
    per_rank = (6 if attn_proj.FUSED_ATTN_PREP else 7) + (
        2 if cfg.layer(layer).owns_compressor else 0) + (
        1 if attn_proj.q_norm_folded() and bucket > dr.ROW_TILE else 0)    # + split_rmsnorm
    assert launched == TP * per_rank
    return rows, caches, x.astype(np.float32), o


def _check_projections(s: Setup, rows: RowBatch, x, layer: int) -> dict:
    cfg, bucket = s.cfg, rows.num_rows
    q_lora, hd, heads = cfg.q_lora_rank, cfg.head_dim, s.shapes.heads
    lw0 = s.refs[0].layer(layer)
    w_fused = np.concatenate([lw0.dense("attn.wq_a"), lw0.dense("attn.wkv")])
    qkv_ref = np.concatenate([ra._linear(x, lw0, "attn.wq_a"), ra._linear(x, lw0, "attn.wkv")],
                             axis=1)
    qkv = s.read(0, "attn.qkv", BF16, (bucket, q_lora + hd))
    errs = {"qkv": within_bound(qkv, qkv_ref, 2 * dr.dense_tolerance(x, w_fused, "bf16"), "qkv")}
    qr = s.read(0, "attn.qr", BF16, (bucket, q_lora))
    want_qr = ra._norm(qkv[:, :q_lora].astype(np.float32), lw0.vector("attn.q_norm.weight"),
                       cfg.rms_norm_eps)
    folded = attn_proj.folded_rows(bucket)          # wq_b normalises attn.qkv's q half itself
    if folded:
        assert (_bits(qr) == 0xFFFF).all(), "attn.qr written with q_norm folded into wq_b"
        qr = want_qr.astype(BF16)                   # what the folded kernel multiplies
    np.testing.assert_array_equal(_bits(qr), _bits(want_qr), err_msg="qr: not _norm(q half)")
    kv = s.read(0, "attn.kv", BF16, (bucket, hd))
    split = attn_proj.q_norm_folded() and bucket > dr.ROW_TILE     # split_rmsnorm copies kv
    if attn_proj.FUSED_ATTN_PREP and not split:
        assert (_bits(kv) == 0xFFFF).all(), "attn.kv written by the fused chain"
        kv = qkv[:, q_lora:]                        # attn_prep / the insert read it in place
    np.testing.assert_array_equal(_bits(kv), _bits(qkv[:, q_lora:]), err_msg="kv half")
    for r in range(1, TP):                          # replicated: the same bits on every rank
        for name, ref in (("attn.qkv", qkv),) + (() if folded else (("attn.qr", qr),)):
            np.testing.assert_array_equal(_bits(s.read(r, name, BF16, ref.shape)), _bits(ref),
                                          err_msg=f"rank {r}: {name} differs from rank 0")
    table = ra.rope_for(cfg, cfg.layer(layer).ratio)
    qr32 = qr.astype(np.float32)
    for r in range(TP):
        lw = s.refs[r].layer(layer)
        w = lw.dense("attn.wq_b")
        want = bf16_round(ra._rope(ra._linear(qr32, lw, "attn.wq_b").reshape(bucket, heads, hd),
                                   rows.positions, table))
        got = s.read(r, "attn.q", BF16, (bucket, heads, hd))
        tol = _wq_b_tolerance(s, bucket, qr, w).reshape(bucket, heads, hd)
        errs["q"] = max(errs.get("q", 0.0), within_bound(got, want, _q_bound(tol, got, want),
                                                         f"rank {r}: q"))
    return {"errs": errs, "kv": kv, "kv_ref": qkv_ref[:, q_lora:]}


def _check_swa(s: Setup, rows: RowBatch, before: KVCaches, after: KVCaches, x, layer: int,
               kv, kv_ref) -> int:
    """Records of the real rows; returns how many rows also matched insert_swa's own record."""
    cfg, lw = s.cfg, s.refs[0].layer(layer)
    real = rows.real
    y = ra._norm(kv.astype(np.float32), lw.vector("attn.kv_norm.weight"), cfg.rms_norm_eps)
    entries = bf16_round(ra._rope(y[real], rows.positions[real],
                                  ra.rope_for(cfg, cfg.layer(layer).ratio)))
    slots = rows.slot_mapping[real]
    want = before.swa[layer].copy()
    want[slots] = kvrecord_ref.encode_kv_record(entries)
    same = (_bits(kv) == _bits(kv_ref)).all(axis=1)[real]
    for r in range(TP):
        got = s.ranks.tensors[r][f"swa_{layer}"]
        np.testing.assert_array_equal(got, want, err_msg=f"rank {r}: swa_{layer} records")
        np.testing.assert_array_equal(got[slots[same]], after.swa[layer][slots[same]],
                                      err_msg=f"rank {r}: swa_{layer} vs insert_swa")
    return int(same.sum())


def _check_compressor(s: Setup, rows: RowBatch, before: KVCaches, after: KVCaches,
                      layer: int) -> None:
    ratio = s.cfg.layer(layer).ratio
    publishing = rows.real & (rows.positions % ratio == ratio - 1)
    written = (after.compressed[layer] != before.compressed[layer]).any(axis=1)
    assert written.sum() == publishing.sum()        # the comparison below is not vacuous
    for r in range(TP):
        t = s.ranks.tensors[r]
        np.testing.assert_array_equal(t[f"compressed_{layer}"], after.compressed[layer],
                                      err_msg=f"rank {r}: compressed_{layer}")
        np.testing.assert_array_equal(t[f"index_keys_{layer}"], after.index_keys[layer],
                                      err_msg=f"rank {r}: index_keys_{layer}")
        if layer in after.ring:
            np.testing.assert_array_equal(t[f"compressor_ring_{layer}"].view(np.uint32),
                                          after.ring[layer].view(np.uint32),
                                          err_msg=f"rank {r}: compressor_ring_{layer}")


def _check_output(s: Setup, o, layer: int) -> dict:
    cfg, bucket = s.cfg, o.shape[0]
    groups, lora, k = s.shapes.o_groups, cfg.o_lora_rank, cfg.o_group_in_dim
    errs = {"z": 0.0, "partial": 0.0, "partial_e2e": 0.0}
    grouped = o.reshape(bucket, groups, k)
    for r in range(TP):
        lw = s.refs[r].layer(layer)
        wo_a = lw.dense("attn.wo_a").reshape(groups, lora, k)
        wo_b = lw.dense("attn.wo_b")
        z = s.read(r, "attn.z", BF16, (bucket, groups * lora))
        # attention_heads: bf16 of the float64 grouped product (one rounding)
        z_ref = bf16_round(np.matmul(grouped.transpose(1, 0, 2).astype(np.float64),
                                     wo_a.astype(np.float64).transpose(0, 2, 1)))
        z_ref = z_ref.transpose(1, 0, 2).reshape(bucket, groups * lora)
        tol_a = np.concatenate([dr.dense_tolerance(grouped[:, g], wo_a[g], "bf16")
                                for g in range(groups)], axis=1)
        errs["z"] = max(errs["z"], within_bound(z, z_ref, 2 * tol_a, f"rank {r}: wo_a"))
        got = s.read(r, "attn.partial", BF16, (bucket, cfg.hidden_size))
        stage = bf16_round(ra._dot(z.astype(np.float32), wo_b))
        kernel = _wo_b_tolerance(s, bucket, z, wo_b)
        errs["partial"] = max(errs["partial"], within_bound(
            got, stage, kernel + dr.dense_tolerance(z, wo_b, "bf16"), f"rank {r}: wo_b"))
        # AR-1 rounds attention_rank's fp32 partial to bf16 before summing.
        want = bf16_round(ra._dot(z_ref, wo_b))
        errs["partial_e2e"] = max(errs["partial_e2e"], within_bound(
            got, want, _partial_bound(kernel, z, z_ref, wo_b, got, want), f"rank {r}: partial"))
    return errs


def _check_untouched_past(s: Setup, bucket: int) -> None:
    for r, arena in enumerate(s.ranks.arenas):
        for name in ROW_BUFFERS:
            width = s.widths[name]
            past = arena.view(name, np.uint8)[width * bucket:width * s.ranks.max_rows]
            assert (past == 0xFF).all(), f"rank {r}: {name} written past row {bucket}"


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("case", list(CASES))
def test_attention_projections_match_the_reference(setup, case, layer):
    s, rng = setup, np.random.default_rng()
    assert {s.cfg.layer(i).ratio for i in LAYERS} == {0, 1, 2}
    rows, before, x, o = _run(s, rng, case, layer)
    found = _check_projections(s, rows, x, layer)
    after = before.copy()
    lw = s.refs[0].layer(layer)
    ra.insert_swa(lw, x, rows, after, s.cfg)
    if s.cfg.layer(layer).owns_compressor:
        ra.compress(lw, x, rows, after, s.cfg)
        _check_compressor(s, rows, before, after, layer)
    _check_swa(s, rows, before, after, x, layer, found["kv"], found["kv_ref"])
    _check_output(s, o, layer)
    _check_untouched_past(s, BUCKETS[case])


def test_launch_lists_follow_the_bucket(setup):
    s = setup
    plan = s.ranks.plans[0]

    def names(role, layer, rows):
        return [spec.kernel.name for spec in plan.stage(f"layer{layer:02d}.{role}").build(rows)]
    for rows, tile in ((1, "r8"), (6, "r8"), (16, "r32")):
        assert names("attn.wq_a_wkv", 0, rows)[0].endswith(f"_{tile}_bf16")
        assert names("attn.wo_a", 0, rows)[0].startswith("wo_a_fp8_grouped_")
        qg_wo_b = rows in attn_proj.QGMMA_WO_B_ROWS          # session 9: QGMMA at R = 1
        assert names("attn.wo_b", 0, rows)[0].endswith("_r8_bf16_sqg" if qg_wo_b
                                                       else f"_{tile}_bf16")
    fused, q_lora = attn_proj.FUSED_ATTN_PREP, s.cfg.q_lora_rank
    split = f"split_rmsnorm_d{q_lora}_t512_wf32"
    if attn_proj.q_norm_folded():       # wq_b's kernel normalises; split_rmsnorm above 8 rows
        assert names("attn.q_kv_norm", 2, 6) == [f"kv_swa_insert_d512_s{q_lora + 512}"]
        assert names("attn.q_kv_norm", 2, 1) == []              # FOLD_MIN_ROWS: attn_prep
        assert names("attn.wq_a_wkv", 2, 1)[1:] == [f"attn_prep_q{q_lora}_d512"]
        assert not names("attn.wq_b", 0, 1)[0].startswith("dense_qnorm_")
        qg_tail = "_r8_bf16_sqg" if 1 in attn_proj.QGMMA_WQ_B_ROWS else "_r8_bf16"
        assert names("attn.wq_b", 0, 1)[0].endswith(qg_tail)        # QGMMA at R = 1
        assert names("attn.wq_b", 0, 6)[0].startswith("dense_qnorm_wq_b_n")
        assert names("attn.wq_a_wkv", 0, 6)[1:] == []
        assert names("attn.wq_a_wkv", 0, 16)[1:] == [split]
        assert names("attn.wq_b", 0, 16)[0].endswith("_r32_bf16")
    else:
        assert names("attn.q_kv_norm", 2, 6) == [f"attn_prep_q{q_lora}_d512" if fused
                                                 else split]
    from executor.launches import compressor as compressor_launches
    if compressor_launches.FAST_KERNELS:      # round 9 up to FAST_MAX_ROWS (bulk16 above 8)
        proj = compressor_launches.FAST_PROJ
        assert names("attn.compressor", 2, 6) == [f"compressor_proj_r2_k256_{proj}",
                                                  "compressor_publish_r2_d512_staged"]
        wide = 16 <= compressor_launches.FAST_MAX_ROWS
        assert names("attn.compressor", 2, 16)[0] == ("compressor_proj_r2_k256_bulk16" if wide
                                                      else "compressor_proj_r2_k256")
        assert names("attn.compressor", 6, 16) == (
            [f"compressor_proj_r1_k256_{proj}", "compressor_publish_r1_d512_staged"] if wide
            else ["compressor_proj_r1_k256", "compressor_publish_r1_d512"])
    else:
        assert names("attn.compressor", 2, 6) == ["compressor_proj_r2_k256",
                                                  "compressor_publish_r2_d512"]
        assert names("attn.compressor", 6, 6) == ["compressor_proj_r1_k256",
                                                  "compressor_publish_r1_d512"]
    assert names("attn.rope_swa_insert", 0, 6) == [
        f"rope_fwd_inplace_h{s.shapes.heads}_d512"] + ([] if fused else ["kv_swa_insert_d512"])
    wired = {st.range_name for st in plan.stages if st.build is not None}
    assert wired == ROLES


def test_weights_and_buffers_declared(setup):
    s = setup
    cfg = s.cfg
    arena = s.ranks.arenas[1]
    for spec in cfg.layers:
        base = f"layers.{spec.index}.attn."
        if spec.is_dspark:
            assert base + "wq_a_wkv.weight" not in arena.slices
            continue
        assert arena.nbytes(base + "wq_a_wkv.weight") == (cfg.q_lora_rank + 512) * cfg.hidden_size
        assert (base + "compressor.norm.weight.f32" in arena.slices) == spec.owns_compressor
    for name, ratio in (("rope.plain", 0), ("rope.yarn", 2)):
        want = ra.rope_for(cfg, ratio).cos_sin
        np.testing.assert_array_equal(arena.view(name, np.float32, want.shape), want)
    names = {b.name for b in attn_proj.buffers(cfg, TP, 192)}
    assert {"attn.qr", "attn.q", "attn.kv", "attn.qkv", "attn.z"} <= names
    assert "attn.o" not in names and "attn.partial" not in names      # group B's / boundary


@pytest.mark.parametrize(("bad", "layer"), [("layers.0.attn.wq_b.weight", 0),
                                            ("layers.2.attn.compressor.wgate.weight", 2),
                                            ("layers.6.attn.indexer.k_norm.weight", 6)])
def test_a_weight_of_the_wrong_shape_is_named(setup, bad, layer):
    cfg = setup.cfg

    def fetch(name):
        array = setup.fetch(name)
        return array[:-1] if name == bad else array
    assert attn_proj._layer_weights(cfg, TP, setup.fetch, cfg.layer(layer))
    with pytest.raises(TypeError, match=bad.rsplit(".", 1)[0].replace(".", r"\.")):
        attn_proj._layer_weights(cfg, TP, fetch, cfg.layer(layer))
