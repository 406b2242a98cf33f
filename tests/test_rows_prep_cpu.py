"""kernels.rows: the int64 -> int32 row prep, its emulator and launch builder (CPU)."""
import numpy as np
import pytest

from executor.emulate import run
from executor.hostmem import AddressSpace, HostArena, ManifestBundle
from executor.launches.rows import rows_prep_launch, rows_prep_requests
from executor.reference.rows import RowBatch, RowBlock
from kernels.rows_ref import make_spec, row_info_ref, rows_prep_ref
from kernels.sparse_mqa_ref import row_info
from loader.config import ModelConfig


@pytest.mark.parametrize("rows", [1, 7, 192])
def test_emulated_rows_prep_writes_int32_rows_and_history(tiny_bundle_dir, rows):
    cfg = ModelConfig.preset("tiny")
    bundle = ManifestBundle(tiny_bundle_dir)
    spec = make_spec(cfg.engram_max_ngram_size, cfg.sliding_window)
    assert spec.name in bundle.names()
    n, cap = spec.history_cols, 192
    space = AddressSpace()
    arena = HostArena(space, [("token_ids", 8 * cap), ("positions", 8 * cap),
                              ("token_history", 8 * cap * (n - 1)), ("seq_index", 4 * cap),
                              ("block_kind", cap),
                              *rows_prep_requests(spec, cap)])
    rng = np.random.default_rng()
    ids = rng.integers(0, cfg.vocab_size, cap)
    pos = rng.integers(0, 1 << 20, cap)
    hist = rng.integers(0, cfg.vocab_size, (cap, n - 1))
    seq = np.full(cap, -1, np.int32)
    seq[:rows] = np.sort(rng.integers(0, 4, rows))
    kind = rng.integers(0, 3, 4).astype(np.int8)[np.maximum(seq, 0)]
    for name, arr in (("token_ids", ids), ("positions", pos), ("token_history", hist),
                      ("seq_index", seq), ("block_kind", kind)):
        arena.upload(name, arr)
    for name in ("tokens32", "positions32", "history32", "row_info"):
        arena.fill(name, 0xFF)
    ptrs = {name: arena.ptr(name) for name in arena.slices}
    run([rows_prep_launch(bundle, spec, ptrs, rows)], space)
    want = rows_prep_ref(ids[:rows], pos[:rows], hist[:rows])
    got_t = arena.download("tokens32", np.int32, (cap,))
    got_p = arena.download("positions32", np.int32, (cap,))
    got_h = arena.download("history32", np.int32, (cap, n))
    assert np.array_equal(got_t[:rows], ids[:rows]) and np.array_equal(got_t[:rows], want[0])
    assert np.array_equal(got_p[:rows], pos[:rows])
    assert np.array_equal(got_h[:rows, 0], ids[:rows]) and np.array_equal(got_h[:rows, 1:],
                                                                          hist[:rows])
    assert (got_t[rows:] == -1).all() and (got_p[rows:] == -1).all() and (got_h[rows:] == -1).all()
    info = arena.download("row_info", np.int32, (cap, 4))
    assert np.array_equal(info[:rows], row_info_ref(pos[:rows], seq[:rows], kind[:rows],
                                                    spec.window))
    assert (info[rows:] == -1).all()


def test_row_info_equals_the_attention_block_rules():
    """row_info_ref (what the kernel computes from the bound rows) == sparse_mqa_ref.row_info."""
    rng = np.random.default_rng()
    window = 16
    for _ in range(20):
        kinds = rng.choice(["decode", "verify", "draft"], int(rng.integers(1, 5)))
        blocks = [RowBlock(state_line=s, start=int(rng.integers(0, 40)),
                           token_ids=tuple(range(1 if k == "decode" else int(rng.integers(2, 7)))),
                           kind=str(k))
                  for s, k in enumerate(kinds)]
        rb = RowBatch.from_blocks(blocks, np.zeros((8, 4), np.int32), 32, pad_to=24)
        want = row_info(rb, window)
        got = row_info_ref(rb.positions, rb.seq_index, rb.block_kind, window)
        assert np.array_equal(got, want)


def test_rows_prep_truncates_like_cvt_and_refuses_bad_specs():
    t, p, h = rows_prep_ref(np.array([2**32 + 5, -1]), np.array([7, 2**31]))
    assert t.tolist() == [5, -1] and p.tolist() == [7, -2**31] and h is None
    with pytest.raises(ValueError):
        make_spec(1, 16)
