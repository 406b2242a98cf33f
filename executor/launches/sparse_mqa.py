"""Launches of the sparse MQA kernel (A13 + A14 of one rank) from device addresses.

The step wiring, `executor/sparse_mqa_chain.py` (GPU tests, benchmark) and the CPU emulator tests
build the launch here, from pointers into any arena (device `Arena` or `HostArena`):

    spec = spec_of(bundle.kernel(name).spec)       # the manifest record's spec dict
    launch = sparse_mqa_launch(bundle, spec, ptrs, rows, pages_per_seq=..., page_size=...,
                               num_positions=...)  # ptrs: ABI buffer name -> address

One launch is a thread-block cluster of spec.cluster_ctas CTAs per row: the LaunchSpec carries
`cluster=spec.cluster` (without it the kernel writes NaN). Buffers (H = spec.heads, R = rows,
S = sequences of the launch; layouts in `kernels/sparse_mqa_ref.py`, `requests` sizes them):
  read   q            bf16 [R, H, 512]   rope dims rotated
  write  out          bf16 [R, H, 512]   every element of rows [0, R) (padding rows: 0); rows
                      >= R untouched; a row with bad input (top-k entry on an unallocated page,
                      SWA range wider than spec.swa_cols) is NaN, a position outside the RoPE
                      table gives NaN rope dims
  read   swa          u8 [lines * ring_slots, 584]  the layer's SWA ring records
  read   compressed   u8 [pages * page_size, 584]   the kv source's compressed cache (top-k only)
  read   topk         i32 [R, spec.topk]            entry ids, -1 = none (top-k only)
  read   block_tables i32 [S, pages_per_seq]        compressed pages, -1 = none (top-k only)
  read   row_info     i32 [R, 4] (position, swa_lo, swa_hi, seq); seq -1: padding row
  read   state_lines  i32 [S]; sink f32 [H]; rope_table f32 [num_positions, 32, 2]
No scratch. An SWA-only kernel (spec.topk == 0) never dereferences compressed, topk and
block_tables: they may be left out of `ptrs` (the kernel is handed `q` instead).
"""
from __future__ import annotations

from collections.abc import Mapping

from executor.launch import LaunchSpec
from kernels import rope_ref
from kernels import sparse_mqa_ref as ref

# The kernel's pointer parameters, in ABI order (ref.PARAMS).
BUFFERS = ("q", "out", "swa", "compressed", "topk", "block_tables", "row_info", "state_lines",
           "sink", "rope_table")
TOPK_ONLY = ("compressed", "topk", "block_tables")


def spec_of(record_spec: dict) -> ref.SparseMqaSpec:
    """The SparseMqaSpec a manifest record's `spec` dict describes (SparseMqaSpec.to_dict)."""
    s = record_spec
    return ref.SparseMqaSpec(s["name"], s["heads"], s["window"], s["swa_cols"], s["topk"],
                             s["ring_slots"], s["cluster"][0], s["entries_per_cta"],
                             s["smem_bytes"], split=s.get("split", "balanced"),
                             skip=tuple(s.get("skip", ())),
                             exchange=s.get("exchange", "pull"),
                             qk_runs=s.get("qk_runs", False), timeline=s.get("timeline", False),
                             early=s.get("early", False),
                             params=ref.TIMELINE_PARAMS if s.get("timeline") else ref.PARAMS)


def uses(spec: ref.SparseMqaSpec) -> tuple[str, ...]:
    """The buffers this spec's kernel dereferences."""
    return BUFFERS if spec.topk else tuple(n for n in BUFFERS if n not in TOPK_ONLY)


def requests(spec: ref.SparseMqaSpec, max_rows: int, *, swa_records: int, max_seqs: int,
             num_positions: int, compressed_records: int = 0,
             pages_per_seq: int = 0) -> list[tuple[str, int, str]]:
    """(name, nbytes, comment) of every buffer `uses(spec)` for up to max_rows rows.

    swa_records = ring lines * spec.ring_slots; compressed_records = pages * page_size. Only q,
    out, row_info and topk scale with the rows; the caches are the caller's, sink and the RoPE
    table constants, state_lines / block_tables per-sequence metadata."""
    h, rec = spec.heads, ref.RECORD_BYTES
    reqs = {"q": (max_rows * h * ref.HEAD_DIM * 2, f"bf16 [{max_rows}, {h}, {ref.HEAD_DIM}]"),
            "out": (max_rows * h * ref.HEAD_DIM * 2, f"bf16 [{max_rows}, {h}, {ref.HEAD_DIM}]"),
            "swa": (swa_records * rec, f"u8 [{swa_records}, {rec}]"),
            "compressed": (compressed_records * rec, f"u8 [{compressed_records}, {rec}]"),
            "topk": (max_rows * spec.topk * 4, f"i32 [{max_rows}, {spec.topk}]"),
            "block_tables": (max_seqs * pages_per_seq * 4, f"i32 [{max_seqs}, {pages_per_seq}]"),
            "row_info": (max_rows * ref.INFO_FIELDS * 4, f"i32 [{max_rows}, {ref.INFO_FIELDS}]"),
            "state_lines": (max_seqs * 4, f"i32 [{max_seqs}]"),
            "sink": (h * 4, f"f32 [{h}]"),
            "rope_table": (rope_ref.table_bytes(num_positions),
                           f"f32 [{num_positions}, {rope_ref.PAIRS}, 2]")}
    return [(name, *reqs[name]) for name in uses(spec)]


def sparse_mqa_launch(bundle, spec: ref.SparseMqaSpec, ptrs: Mapping[str, int], rows: int, *,
                      pages_per_seq: int, page_size: int, num_positions: int,
                      stamps: int | None = None) -> LaunchSpec:
    """One cluster launch of `spec`'s kernel on `rows` rows over `ptrs` (module docstring).
    stamps: a `_timeline` build's stamp rows (u64 [spec.stamp_rows(rows), TIMELINE_WORDS],
    zeroed), required by those builds and refused by the others."""
    needed = uses(spec)
    missing = [n for n in needed if n not in ptrs]
    if missing:
        raise KeyError(f"{spec.name}: no pointer for buffer(s) {missing} (it needs "
                       f"{', '.join(needed)})")
    if spec.timeline != (stamps is not None):
        raise ValueError(f"{spec.name}: stamps {'required' if spec.timeline else 'given'}: "
                         f"only `_timeline` builds take a stamps buffer")
    args = tuple(ptrs[n] if n in ptrs else ptrs["q"] for n in BUFFERS)   # q: never dereferenced
    args += (stamps,) if spec.timeline else ()
    return LaunchSpec(bundle.kernel(spec.name), spec.grid(rows),
                      args + (rows, pages_per_seq, page_size, num_positions),
                      cluster=spec.cluster)
