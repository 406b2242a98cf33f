"""Launches of the embedding lookup and the Engram kernels from device addresses of any arena.

Pure functions: a bundle (anything with `kernel(name)`: a loaded `Bundle`, or a `ManifestBundle`
on a CPU), the kernel's spec, a mapping of the kernel's pointer parameters to addresses, and the
runtime scalars give one validated LaunchSpec (PDL on). Nothing is allocated or launched here.
Buffers by pointer key (R = the launch's rows; every buffer holds at least R rows; no kernel here
needs scratch):

  embed_launch            reads  token_ids int32 [R], table bf16 [spec.table_rows, D]
                          writes out bf16 [R, D] (this rank's rows, zeros for other ids)
  engram_hash_launch      reads  tokens int32 [R, max_ngram] (raw ids, newest first), positions
                                 int32 [R], vocab_map int32 [vocab_size] (compressed ids)
                          writes ids int64 [R, (max_ngram - 1)·heads]
  engram_lookup_launch    reads  ids int64 [R, total_cols] (columns first_col .. + cols),
                                 codes uint8 (E4M3) [table_rows, head_dim],
                                 scales uint8 (UE8M0) [table_rows, head_dim / 32]
                          writes out bf16 [R, cols, head_dim] (NaN heads for ids off the table)
  engram_gate_launch      reads  streams bf16 [R, n, D], keys_and_value bf16 [R, (n + 1)·D]
                                 (wkv's output: n keys, then v), q_weight, k_weight bf16 [n, D]
                          writes out bf16 [R, n, D] (may be `streams` itself: in place)

In the step the three Engram launches are not adjacent (hash at the head, for every Engram layer;
lookup, then `wkv` (dense) and the all-gather of the heads (collectives), then the gate), so each
builder returns one LaunchSpec and the wiring places it. `embed_requests` / `engram_requests`
give the (name, nbytes, comment) slices those buffers need, for `Arena` or `HostArena`.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from executor.launch import LaunchSpec
from kernels import embed_ref as er
from kernels import engram_kernel_ref as ek


def _pointers(kernel_name: str, ptrs: Mapping[str, int], names: tuple[str, ...]) -> list[int]:
    missing = [n for n in names if n not in ptrs]
    if missing:
        raise KeyError(f"{kernel_name}: no address for {missing} (it takes {list(names)})")
    return [ptrs[n] for n in names]


def embed_launch(bundle, spec: er.EmbedSpec, ptrs: Mapping[str, int], rows: int,
                 vocab_offset: int) -> LaunchSpec:
    """ptrs: token_ids, table, out. `vocab_offset`: this rank's first vocabulary row (0 for the
    replicated table)."""
    er.launch_check(spec, rows, vocab_offset)
    token_ids, table, out = _pointers(spec.name, ptrs, ("token_ids", "table", "out"))
    return LaunchSpec(bundle.kernel(spec.name), spec.grid(rows),
                      (token_ids, table, out, rows, vocab_offset), pdl=True)


def engram_hash_launch(bundle, spec: ek.EngramHashSpec, ptrs: Mapping[str, int],
                       rows: int) -> LaunchSpec:
    """ptrs: tokens, positions, vocab_map, ids."""
    args = _pointers(spec.name, ptrs, ("tokens", "positions", "vocab_map", "ids"))
    return LaunchSpec(bundle.kernel(spec.name), spec.grid(rows), (*args, rows), pdl=True)


def engram_lookup_launch(bundle, spec: ek.EngramLookupSpec, ptrs: Mapping[str, int], rows: int,
                         first_col: int, row_offset: int, table_rows: int) -> LaunchSpec:
    """ptrs: ids, codes, scales, out. This rank's columns start at `first_col`; its table shard
    holds global rows [row_offset, row_offset + table_rows)."""
    if first_col < 0 or first_col + spec.cols > spec.total_cols:
        raise ValueError(f"{spec.name}: first_col {first_col} + {spec.cols} columns exceed "
                         f"{spec.total_cols}")
    if not 0 <= row_offset < 2**31:
        raise ValueError(f"{spec.name}: row_offset {row_offset} must be in [0, 2**31)")
    ids, codes, scales, out = _pointers(spec.name, ptrs, ("ids", "codes", "scales", "out"))
    return LaunchSpec(bundle.kernel(spec.name), spec.grid(rows),
                      (ids, codes, scales, out, rows, first_col, row_offset, table_rows),
                      pdl=True)


def engram_gate_launch(bundle, spec: ek.EngramGateSpec, ptrs: Mapping[str, int], rows: int,
                       eps: float) -> LaunchSpec:
    """ptrs: streams, keys_and_value, q_weight, k_weight, out (out = streams for in place)."""
    if not np.isfinite(eps) or eps <= 0:
        raise ValueError(f"{spec.name}: eps must be finite and > 0, got {eps!r}")
    args = _pointers(spec.name, ptrs, ("streams", "keys_and_value", "q_weight", "k_weight", "out"))
    return LaunchSpec(bundle.kernel(spec.name), spec.grid(rows), (*args, rows, eps), pdl=True)


# ---- the buffers an arena needs ------------------------------------------------------------------

def embed_requests(spec: er.EmbedSpec, max_rows: int) -> list[tuple[str, int, str]]:
    """Slices for `embed_launch` at up to `max_rows` rows (keys = its pointer names)."""
    d = spec.width
    return [("token_ids", 4 * max_rows, f"int32 [{max_rows}]"),
            ("table", 2 * spec.table_rows * d, f"bf16 [{spec.table_rows}, {d}]"),
            ("out", 2 * max_rows * d, f"bf16 [{max_rows}, {d}]")]


def engram_requests(hash_spec: ek.EngramHashSpec, lookup_spec: ek.EngramLookupSpec,
                    gate_spec: ek.EngramGateSpec, max_rows: int,
                    table_rows: int) -> list[tuple[str, int, str]]:
    """Slices for one Engram layer's hash, lookup and gate at up to `max_rows` rows: the lookup's
    `out` is "heads", the gate works in place on "streams"; every other name is the pointer's."""
    r, n, d = max_rows, gate_spec.streams, gate_spec.width
    hd, cols, total = lookup_spec.head_dim, lookup_spec.cols, lookup_spec.total_cols
    if hash_spec.cols != total:
        raise ValueError(f"{hash_spec.name} writes {hash_spec.cols} id columns, "
                         f"{lookup_spec.name} reads {total}")
    return [("tokens", 4 * r * hash_spec.max_ngram, f"int32 [{r}, {hash_spec.max_ngram}]"),
            ("positions", 4 * r, f"int32 [{r}]"),
            ("vocab_map", 4 * hash_spec.vocab_size, f"int32 [{hash_spec.vocab_size}]"),
            ("ids", 8 * r * total, f"int64 [{r}, {total}]"),
            ("codes", table_rows * hd, f"e4m3 [{table_rows}, {hd}]"),
            ("scales", table_rows * (hd // 32), f"ue8m0 [{table_rows}, {hd // 32}]"),
            ("heads", 2 * r * cols * hd, f"bf16 [{r}, {cols}, {hd}]"),
            ("streams", 2 * r * n * d, f"bf16 [{r}, {n}, {d}]"),
            ("keys_and_value", 2 * r * (n + 1) * d, f"bf16 [{r}, {(n + 1) * d}]"),
            ("q_weight", 2 * n * d, f"bf16 [{n}, {d}]"),
            ("k_weight", 2 * n * d, f"bf16 [{n}, {d}]")]


# ---- specs from a manifest -----------------------------------------------------------------------

def specs_from_bundle(bundle) -> tuple[list, ek.EngramLookupSpec, ek.EngramGateSpec, list]:
    """(hash specs by layer, lookup spec, gate spec, embed specs by table rows) rebuilt from a
    bundle's manifest (a loaded Bundle or a ManifestBundle)."""
    kernels = bundle.manifest.kernels
    hashes, lookup, gate, embeds = [], None, None, []
    for name in sorted(bundle.names()):
        sp = kernels[name].spec
        if name.startswith("engram_hash_"):
            hashes.append(ek.hash_spec_from_dict(name, sp))
        elif name.startswith("engram_lookup_"):
            lookup = ek.make_lookup_spec(sp["head_dim"], sp["cols"], sp["total_cols"])
        elif name.startswith("engram_gate_"):
            gate = ek.make_gate_spec(sp["width"], sp["streams"])
        elif name.startswith("embed_bf16_"):
            embeds.append(er.make_spec(sp["width"], sp["table_rows"]))
    if not hashes or lookup is None or gate is None or not embeds:
        raise LookupError("the bundle lacks the embed / engram kernels")
    hashes.sort(key=lambda spec: spec.layer)
    embeds.sort(key=lambda spec: spec.table_rows)
    return hashes, lookup, gate, embeds
