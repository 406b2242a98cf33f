"""kernels.engram on the host: hash ids, FP8 table lookup and the gate
(kernels/engram_kernel_ref.py), each writing exactly the rows < `rows` of its output."""
from __future__ import annotations

import numpy as np

from executor.emulate import NoEmulator
from kernels import engram_kernel_ref as ek
from kernels.common_ref import BF16


def _hash(record, grid, args, space) -> None:
    sp, rows = record.spec, args["rows"]
    # One thread per row and no grid-stride: a grid short of `rows` would leave ids unwritten.
    covered = grid[0] * record.block[0]
    if covered < rows:
        raise ValueError(f"{record.name}: grid {grid} x {record.block[0]} threads covers "
                         f"{covered} rows of {rows}")
    spec = ek.hash_spec_from_dict(record.name, sp)
    tokens = space.array(args["tokens"], np.int32, (rows, spec.max_ngram))
    positions = space.array(args["positions"], np.int32, (rows,))
    vocab_map = (space.array(args["vocab_map"], np.int32, (spec.vocab_size,)) if spec.mapped
                 else np.arange(spec.vocab_size, dtype=np.int32))   # unread by that kernel
    ids = ek.hash_ref(spec, tokens.copy(), positions.copy(), vocab_map.copy())
    space.array(args["ids"], np.int64, (rows, spec.cols))[...] = ids


def _lookup(record, grid, args, space) -> None:
    sp, rows, table_rows = record.spec, args["rows"], args["table_rows"]
    spec = ek.make_lookup_spec(sp["head_dim"], sp["cols"], sp["total_cols"])
    hd = spec.head_dim
    ids = space.array(args["ids"], np.int64, (rows, spec.total_cols))
    codes = space.array(args["codes"], np.uint8, (table_rows, hd))
    scales = space.array(args["scales"], np.uint8, (table_rows, hd // 32))
    heads = ek.lookup_ref(spec, ids.copy(), codes, scales, args["first_col"], args["row_offset"])
    space.array(args["out"], BF16, (rows, spec.cols, hd))[...] = heads


def _gate(record, grid, args, space) -> None:
    sp, rows = record.spec, args["rows"]
    n, d = sp["streams"], sp["width"]
    streams = space.array(args["streams"], BF16, (rows, n, d)).copy()   # out may alias streams
    kv = space.array(args["keys_and_value"], BF16, (rows, (n + 1) * d)).copy()
    qw = space.array(args["q_weight"], BF16, (n, d)).copy()
    kw = space.array(args["k_weight"], BF16, (n, d)).copy()
    out = ek.gate_ref(streams, kv, qw, kw, float(np.float32(args["eps"])))
    space.array(args["out"], BF16, (rows, n, d))[...] = out


# Lookup and gate grid-stride (over (row, column, 16 codes) and over rows): any grid gives
# the same bytes.
_KINDS = {"engram_hash_": _hash, "engram_lookup_": _lookup, "engram_gate_": _gate}


def emulate(record, grid, args, space) -> None:
    for prefix, kind in _KINDS.items():
        if record.name.startswith(prefix):
            return kind(record, grid, args, space)
    raise NoEmulator(f"no CPU emulator for engram kernel {record.name!r}")
