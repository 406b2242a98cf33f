"""executor.emulate.ranks + executor.wiring: four emulated ranks, bound tensors, a wired stage."""
import numpy as np
import pytest
from tiny_checkpoint import tiny_checkpoint

from executor.emulate.ranks import EmulatedRanks
from executor.reference.kvcache import KVCaches
from executor.reference.rows import RowBatch, RowBlock
from executor.wiring import builders
from kernels.common_ref import BF16
from kernels.norm_ref import rmsnorm_ref
from loader.checkpoint import Checkpoint


@pytest.fixture(scope="module")
def ckpt():
    with Checkpoint.open(tiny_checkpoint(), progress=False) as c:
        yield c


def _rows(caches, rng):
    blocks = [RowBlock(state_line=1, start=9, token_ids=tuple(rng.integers(0, 100, 6).tolist()),
                       kind="verify"),
              RowBlock(state_line=0, start=30, token_ids=(5,))]
    return RowBatch.from_blocks(blocks, caches.block_tables, caches.ring_slots)


def test_ranks_get_their_own_arenas_and_caller_tensors(ckpt, tiny_bundle_dir):
    caches = KVCaches.allocate(ckpt.config, max_seqs=2, max_context=64, page_size=16)
    ranks = EmulatedRanks(ckpt, tiny_bundle_dir, 4, caches, modules=("stage_norm_probe",))
    rng = np.random.default_rng()
    rows = _rows(caches, rng)
    history = np.zeros((rows.num_rows, ckpt.config.engram_max_ngram_size), np.int64)
    ranks.load(rows, caches, history)
    bases = {a.base for a in ranks.arenas}
    assert len(bases) == 4
    for r in range(4):
        tokens = ranks.read(r, "token_ids", np.int64, (192,))
        assert np.array_equal(tokens[:7], rows.token_ids) and not tokens[7:].any()
        slots = ranks.read(r, "slot_mapping", np.int64, (192,))
        assert (slots[7:] == -1).all()
        layer = next(iter(caches.swa))
        assert np.array_equal(ranks.tensors[r][f"swa_{layer}"], caches.swa[layer])
    # Only attn.norm is wired; everything else stays missing.
    wired = [s for s in ranks.plans[0].stages if s.build is not None]
    assert {s.range_name for s in wired} == {"attn.norm"}
    assert len(wired) == len([s for s in ckpt.config.layers if not s.is_dspark])


def test_a_wired_stage_runs_on_every_rank(ckpt, tiny_bundle_dir):
    cfg = ckpt.config
    caches = KVCaches.allocate(cfg, max_seqs=2, max_context=64, page_size=16)
    ranks = EmulatedRanks(ckpt, tiny_bundle_dir, 4, caches, modules=("stage_norm_probe",))
    rng = np.random.default_rng()
    rows, d = 7, cfg.hidden_size
    x = rng.standard_normal((rows, d)).astype(BF16)
    ranks.write("x", x)
    ranks.write("xn", np.full((ranks.max_rows, d), 0xFFFF, np.uint16))
    assert ranks.run(rows, roles={"attn.norm"}, layers={2}) == 4
    w = ckpt.get("layers.2.attn_norm.weight")
    want = rmsnorm_ref(x, w, cfg.rms_norm_eps).view(np.uint16)
    for r in range(4):
        got = ranks.read(r, "xn", np.uint16, (ranks.max_rows, d))
        assert np.array_equal(got[:rows], want)
        assert (got[rows:] == 0xFFFF).all()


def test_two_modules_claiming_one_role_is_an_error():
    with pytest.raises(ValueError, match="attn.norm"):
        builders(("stage_norm_probe", "stage_norm_probe"))
