"""kernels.allreduce_ref pick: the cross-rank greedy pick's key order equals head_ref's rule."""
import numpy as np
import pytest

from kernels.allreduce_ref import PICK_SENTINEL, make_pick_spec, ordered_key, pick_ref
from kernels.head_ref import pick_across_ranks


def _pairs(values, indices):
    return [np.stack([v.astype(np.float32).view(np.int32), i.astype(np.int32)], axis=1)
            for v, i in zip(values, indices)]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_pick_equals_the_split_vocabulary_rule(world):
    """Ties (values drawn from a small set, ±0 included) go to the lower index, as head_ref."""
    rng = np.random.default_rng()
    rows, vocab_l = 64, 1000
    values = rng.choice(np.float32([-3.5, -0.0, 0.0, 1.25, 7.0, -1e-30, 3e38]), (world, rows))
    values[:, :8] = rng.standard_normal((world, 8)).astype(np.float32)
    indices = np.stack([rng.integers(r * vocab_l, (r + 1) * vocab_l, rows) for r in range(world)])
    got = pick_ref(_pairs(values, indices))
    assert got.dtype == np.int64
    assert np.array_equal(got, pick_across_ranks(values, indices))


def test_no_valid_key_is_the_sentinel():
    """Every key of a finite value and an index < 2^31 differs from the buffers' fill."""
    rng = np.random.default_rng()
    bits = rng.integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32)
    finite = np.isfinite(bits.view(np.float32))
    pairs = np.stack([bits.view(np.int32), rng.integers(0, 2**31 - 1, bits.size).astype(np.int32)],
                     axis=1)[finite]
    assert not (ordered_key(pairs) == np.uint64(PICK_SENTINEL)).any()


def test_pick_spec_rows_and_grid():
    spec = make_pick_spec(4, 256)
    assert spec.grid(192) == (1, 1, 1) and spec.slot_bytes == 192 * 256 * 2
    with pytest.raises(ValueError):
        spec.grid(193)
