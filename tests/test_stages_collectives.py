"""executor.stages.collectives on four emulated ranks: the step's all-reduces and the greedy pick."""
import numpy as np
import pytest
from tiny_checkpoint import tiny_checkpoint

from executor.emulate.ranks import EmulatedRanks
from executor.reference.kvcache import KVCaches
from kernels.allreduce_ref import allreduce_ref, pick_ref
from kernels.common_ref import BF16
from loader.checkpoint import Checkpoint

MODULES = ("executor.stages.collectives",)


@pytest.fixture(scope="module")
def ranks(tiny_bundle_dir):
    with Checkpoint.open(tiny_checkpoint(), progress=False) as ckpt:
        caches = KVCaches.allocate(ckpt.config, max_seqs=2, max_context=64, page_size=16)
        yield EmulatedRanks(ckpt, tiny_bundle_dir, 4, caches, modules=MODULES)


def _partials(rng, rows, d):
    return [(rng.standard_normal((rows, d)) * 4).astype(BF16) for _ in range(4)]


@pytest.mark.parametrize("rows", [1, 13, 192])
def test_every_allreduce_stage_sums_the_ranks_partials(ranks, rows):
    """Bitwise allreduce_ref on every rank; rows past `rows` of the output untouched."""
    rng = np.random.default_rng()
    d, cap = ranks.cfg.hidden_size, ranks.max_rows
    for role, inp, out, layers in (("head.embed_allreduce", "embed.partial", "embed.out", None),
                                   ("attn.allreduce", "attn.partial", "attn.out", {3}),
                                   ("ffn.allreduce", "ffn.partial", "ffn.out", {7})):
        parts = _partials(rng, rows, d)
        for r in range(4):
            ranks.write(inp, parts[r], ranks=[r])
            ranks.write(out, np.full((cap, d), 0xFFFF, np.uint16), ranks=[r])
        assert ranks.run(rows, roles={role}, layers=layers) == 4
        want = allreduce_ref(parts).view(np.uint16)
        for r in range(4):
            got = ranks.read(r, out, np.uint16, (cap, d))
            assert np.array_equal(got[:rows], want), (role, r)
            assert (got[rows:] == 0xFFFF).all(), (role, r)


def test_pick_between_allreduces_writes_the_same_tokens_everywhere(ranks):
    rng = np.random.default_rng()
    rows, vocab_l = 9, ranks.cfg.vocab_size // 4
    values = rng.choice(np.float32([-2.0, 0.5, 3.0]), (4, rows))
    pairs = [np.stack([values[r].view(np.int32),
                       rng.integers(r * vocab_l, (r + 1) * vocab_l, rows).astype(np.int32)], 1)
             for r in range(4)]
    for r in range(4):
        ranks.write("pick", pairs[r], ranks=[r])
        ranks.write("tokens", np.full(192, -7, np.int64), ranks=[r])
    ranks.run(rows, roles={"tail.argmax_pick"})
    want = pick_ref(pairs)
    for r in range(4):
        got = ranks.read(r, "tokens", np.int64, (192,))
        assert np.array_equal(got[:rows], want) and (got[rows:] == -7).all()
    test_every_allreduce_stage_sums_the_ranks_partials(ranks, 5)   # buffers still consistent


@pytest.mark.parametrize("rows", [1, 6, 192])
def test_engram_heads_allgather_puts_rank_r_at_column_block_r(tiny_bundle_dir, rows):
    """Bitwise gather_ref (the ranks' heads side by side, -0.0 sent as +0.0) on every rank."""
    from kernels.allreduce_ref import gather_ref
    with Checkpoint.open(tiny_checkpoint(), progress=False) as ckpt:
        caches = KVCaches.allocate(ckpt.config, max_seqs=2, max_context=64, page_size=16)
        ranks = EmulatedRanks(ckpt, tiny_bundle_dir, 4, caches,
                              modules=MODULES + ("executor.stages.mhc",))
    cfg = ranks.cfg
    layer = cfg.engram_layer_ids[-1]
    cols = cfg.rank_shapes(4).engram_hash_cols * cfg.engram_head_dim
    rng = np.random.default_rng()
    heads = [rng.standard_normal((rows, cols)).astype(BF16) for _ in range(4)]
    heads[1][0, :3] = -0.0
    for r in range(4):
        ranks.write("engram.local_heads", heads[r], ranks=[r])
        ranks.write("engram.heads", np.full((192, 4 * cols), 0xFFFF, np.uint16), ranks=[r])
    assert ranks.run(rows, roles={"engram.heads_allgather"}, layers={layer}) == 4
    want = gather_ref(heads).view(np.uint16)
    assert (want[0, cols:cols + 3] == 0).all()
    for r in range(4):
        got = ranks.read(r, "engram.heads", np.uint16, (192, 4 * cols))
        assert np.array_equal(got[:rows], want) and (got[rows:] == 0xFFFF).all()


@pytest.mark.parametrize("preset, tp", [("tiny", 2), ("tiny", 4), ("v41-flash", 2),
                                        ("v41-flash", 4)])
def test_kv_rank_rows_gather_back_to_the_replicated_column_order(preset, tp):
    """Every wkv output column on exactly one rank, in whole 32-row FP8 blocks, pieces no wider
    than a slot; gather_pieces_ref of the ranks' columns is the unsharded output itself."""
    from kernels import engram_kernel_ref as ek
    from kernels.allreduce_ref import gather_pieces_ref
    from loader.config import ModelConfig
    cfg = ModelConfig.preset(preset)
    n = (cfg.hc_mult + 1) * cfg.hidden_size
    pieces, cols = ek.kv_pieces(cfg, tp)
    assert cols <= cfg.hidden_size and cols % 32 == 0 and pieces * cols * tp == n
    rows = [ek.kv_rank_rows(cfg, tp, r) for r in range(tp)]
    assert np.array_equal(np.sort(np.concatenate(rows)), np.arange(n))
    for r in rows:
        blocks = r.reshape(-1, 32)
        assert (blocks[:, 0] % 32 == 0).all() and (np.diff(blocks, axis=1) == 1).all()
    full = (np.arange(3 * n) % 251).reshape(3, n).astype(BF16)      # integers < 256: exact
    assert np.array_equal(gather_pieces_ref([full[:, r] for r in rows], pieces), full)


def test_kv_rank_weight_cuts_scale_rows_with_their_weight_rows():
    """A rank's scale rows are the blocks of its weight rows (block b of the rank = rows
    32b..32b+31 of its weight)."""
    from kernels import engram_kernel_ref as ek
    from loader.config import ModelConfig
    cfg = ModelConfig.preset("tiny")
    n, k = (cfg.hc_mult + 1) * cfg.hidden_size, 64
    weight = np.repeat(np.arange(n, dtype=np.int64)[:, None], k, axis=1)
    scale = np.repeat(np.arange(n // 32, dtype=np.int64)[:, None], k // 32, axis=1)
    for rank in range(4):
        w, s = ek.kv_rank_weight(cfg, 4, rank, weight, scale)
        assert w.shape == (n // 4, k) and s.shape == (n // 128, k // 32)
        assert np.array_equal(w[:, 0], ek.kv_rank_rows(cfg, 4, rank))
        assert np.array_equal(s[:, 0], w[::32, 0] // 32)


@pytest.mark.parametrize("rows", [1, 6, 96, 97, 192])
def test_engram_kv_allgather_is_the_replicated_wkv_output(tiny_bundle_dir, rows):
    """Each rank's wkv columns (kv_rank_rows) in engram.kv_local -> every rank's engram.kv is
    the unsharded output, bitwise (-0.0 sent as +0.0); rows past `rows` untouched. Above
    max_rows / P rows the gather runs on two row chunks (two launches a rank)."""
    from kernels import engram_kernel_ref as ek
    from kernels.allreduce_ref import sanitize_ref
    with Checkpoint.open(tiny_checkpoint(), progress=False) as ckpt:
        caches = KVCaches.allocate(ckpt.config, max_seqs=2, max_context=64, page_size=16)
        ranks = EmulatedRanks(ckpt, tiny_bundle_dir, 4, caches,
                              modules=MODULES + ("executor.stages.mhc",))
    cfg = ranks.cfg
    layer = cfg.engram_layer_ids[0]
    n = (cfg.hc_mult + 1) * cfg.hidden_size
    pieces, _ = ek.kv_pieces(cfg, 4)
    rng = np.random.default_rng()
    full = rng.standard_normal((rows, n)).astype(BF16)
    full[-1, 5:9] = -0.0
    for r in range(4):
        ranks.write("engram.kv_local", full[:, ek.kv_rank_rows(cfg, 4, r)], ranks=[r])
        ranks.write("engram.kv", np.full((192, n), 0xFFFF, np.uint16), ranks=[r])
    chunks = -(-rows * pieces // 192)
    assert ranks.run(rows, roles={"engram.kv_allgather"}, layers={layer}) == 4 * chunks
    want = sanitize_ref(full).view(np.uint16)
    assert (want[-1, 5:9] == 0).all()
    for r in range(4):
        got = ranks.read(r, "engram.kv", np.uint16, (192, n))
        assert np.array_equal(got[:rows], want) and (got[rows:] == 0xFFFF).all()
