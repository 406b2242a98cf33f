"""Expected outputs of the DSpark kernel tests, shared by the GPU test
(tests/gpu/test_dspark_device_kernels.py, test_dspark_history_kernel.py) and the CPU emulator tests
(tests/test_dspark_kernels.py, test_executor_dspark_history.py). References only (kernels/
dspark_ref.py): the device machine has no CuTe DSL."""
from __future__ import annotations

import numpy as np

from kernels import dspark_ref as ref


def markov_want(pairs: dict, ids: dict, cap: int, fill: int = -7):
    """`markov_ref`'s pairs {sequence: pair} and ids {row: token} laid out as the kernel writes
    them: pairs [cap, 2] int32 and ids [cap] int64, `fill` (their poison) where nothing is
    written."""
    want_pairs = np.full((cap, 2), fill, np.int32)
    for s, pair in pairs.items():
        want_pairs[s] = pair
    want_ids = np.full(cap, fill, np.int64)
    for row, token in ids.items():
        want_ids[row] = token
    return want_pairs, want_ids


def history_want(spec, arrays: dict, seqs: int) -> dict:
    """Every array of one history launch (token_ids, token_history, accepted, bonus) after
    `history_ref` runs on copies of them: what the kernel must leave in each buffer."""
    want = {n: a.copy() for n, a in arrays.items()}
    ref.history_ref(spec, want["token_ids"], want["token_history"], want["accepted"],
                    want["bonus"], seqs)
    return want
