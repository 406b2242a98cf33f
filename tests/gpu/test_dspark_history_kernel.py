"""GPU test of kernels/dspark.py's history kernel (the next draft or verify rows' Engram lookback)
against kernels/dspark_ref.py's history_ref.

Integer copies only, so exact: every element of token_history (and of the inputs) is compared, over
fresh random token ids, histories, accepted counts (0..k) and bonus tokens (some negative: padding
slots, which must stay untouched), for 1, a few and the most sequence slots a 192-row verify
bucket holds (32) and one CTA's limit (256 slots, over a larger buffer). Everything the ref does
not write (rows past the slots, padding slots' rows) keeps its random value, so a stray write
shows. The kernel rewrites token_history in
another row layout in place; slots whose rows overlap another slot's reads are exactly the
multi-slot cases here, so a missing barrier would show as a mismatch. Bundles: HOPDEC_BUNDLE
(tiny) and HOPDEC_BUNDLE_V41 (v41-flash: another noise id).
"""
from __future__ import annotations

import dspark_cases as cases
import numpy as np
import pytest
from arena_io import launch_on_arrays

from executor.launches.dspark import history_launch
from kernels import dspark_ref as ref

pytestmark = pytest.mark.gpu
pytest.importorskip("cupy")                 # arena_io moves the arrays with CuPy


@pytest.mark.parametrize("to_verify", [False, True])
@pytest.mark.parametrize("seqs", [1, 3, 32, 256])
def test_history_kernel_is_the_ref(dev, stream, preset_bundle, to_verify, seqs):
    cfg, bundle = preset_bundle
    rng = np.random.default_rng()
    k, cols = cfg.dspark_block_size, ref.history_cols(cfg)
    spec = ref.make_history_spec(k, to_verify, cols, cfg.dspark_noise_token_id)
    rows = max(192, seqs * (k + 1))
    bonus = rng.integers(0, cfg.vocab_size, rows)
    bonus[rng.random(rows) < 0.2] = -1                  # padding slots
    arrays = {"token_ids": rng.integers(0, cfg.vocab_size, rows),
              "token_history": rng.integers(0, cfg.vocab_size, (rows, cols)),
              "accepted": rng.integers(0, k + 1, rows).astype(np.int32),
              "bonus": bonus}
    got = launch_on_arrays(dev, stream, arrays, lambda p: history_launch(bundle, spec, p, seqs))
    want = cases.history_want(spec, arrays, seqs)
    for name, a in want.items():
        bad = np.argwhere(got[name] != a)
        assert bad.size == 0, (f"{spec.name} seqs={seqs}: {name} differs at {bad[:4].tolist()} "
                               f"(got {got[name][tuple(bad[0])]}, want {a[tuple(bad[0])]})")
