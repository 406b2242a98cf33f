"""Launches of one compressor layer (A2 projection, then the A7-A9 publish) from device addresses.

The step wiring, `executor/compressor_chain.py` (GPU tests, benchmark) and the CPU emulator tests
build the two launches here, from pointers into any arena (device `Arena` or `HostArena`):

    shape = CompressorShape(ratio, hidden, max_rows, max_seqs, pages_per_seq, page_size,
                            num_pages, num_positions)
    proj, pub = compressor_launches(bundle, shape, ptrs, rows, eps)   # ptrs: name -> address

Buffers (r = ratio, D = hidden, R = rows, S = sequences of the launch; `requests` sizes them;
layouts in `kernels/compressor_kernel_ref.py`):
  read   x            bf16 [R, D]                  the layer's input rows          (projection)
  read   w            fp32 [1024, D] (r = 2: wkv | wgate), bf16 [512, D] (r = 1)     (projection)
  scratch kv_score    fp32 [R, 512 r]  written by the projection (rows >= R untouched), read by
                      the publish (a row's own and, r = 2, its previous row's)
  read   positions    i32 [R]; seq_index i32 [R] (-1: padding row, writes nothing)
  read   state_lines  i32 [S]          the sequence's line of the ring (r = 2 only)
  read   block_tables i32 [S, pages_per_seq] pages of the compressed cache, -1 = none
  read   norm_w fp32 [512], wk bf16 [128, 512], k_norm fp32 [128], table fp32 [num_positions,
         32, 2] (the layer's compress RoPE table)
  state  ring         fp32 [lines, 8, 1024] (kv | score) rows; r = 2: every real row writes row
                      p % 8 of its line, odd rows read row (p - 1) % 8; r = 1: never touched
  write  cache        u8 [num_pages * page_size, 584]  entry p // r of each publishing row
  write  keys         u8 [num_pages * page_size, 132]  its index key (same slot)
Publishing rows: real rows at odd positions (r = 2) or every real row (r = 1) whose entry's page is
allocated; nothing else of cache / keys is written. Both kernels read only rows [0, R).

Which kernels: `FAST_KERNELS` (round 9: the "bulk" projection and the "staged" publish of
`kernels/compressor_fast.py`, same buffers, same ABI, same results within the same tolerances) or
the session-1 pair; `compressor_launches(..., fast=)` picks one pair explicitly (tests, benchmark).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from executor.launch import LaunchSpec
from kernels import compressor_kernel_ref as ck
from kernels import kvrecord_ref, rope_ref

# Round 9 (docs/notes/compressor-design.md "Round 9"): the step runs the bulk projection and the
# staged publish. Revert: False (the session-1 kernels; bench_step variant "compressor_round1"
# re-wires the step with them, so one step run measures both).
FAST_KERNELS = True
# ... up to this many rows; above, the session-1 pair (run r9b, H100: round 9's pair -53 / -62 us a
# step at R = 1 / 6 but +44 at R = 48, where the bulk projection's shared memory and x re-reads
# beside the main chain cost more than its own time saves). Revert: 10**9 (bench_step variant
# "compressor_fast_all": round 9's pair at every R, bulk16 above 8 rows at r = 2).
FAST_MAX_ROWS = 8
# Round 9b: the projection copies only the x rows < R (kernels/compressor_kernel_ref "bulkr").
# Revert: "bulk" (r9b's measured kernel; bench_step variant "compressor_bulk"). Run r9d (H100):
# alone r = 2 12.86 / 12.96 us at R = 1 / 6 against bulk's 15.15 / 13.33; in the step the two tie
# (bulk +1.0 us at R = 1, -12.3 at R = 6, inside the step's own round-to-round spread of ~40 us).
FAST_PROJ = "bulkr"

# Every buffer of the two launches, in the order of `requests`.
BUFFERS = ("x", "w", "kv_score", "ring", "positions", "seq_index", "state_lines", "block_tables",
           "norm_w", "wk", "k_norm", "table", "cache", "keys")
# The publish kernel's pointer parameters, in its ABI order (ck.PUBLISH_PARAMS).
PUBLISH_BUFFERS = ("kv_score", "ring", "positions", "seq_index", "state_lines", "block_tables",
                   "norm_w", "wk", "k_norm", "table", "cache", "keys")


@dataclass(frozen=True)
class CompressorShape:
    ratio: int
    hidden: int
    max_rows: int
    max_seqs: int
    pages_per_seq: int
    page_size: int
    num_pages: int
    num_positions: int

    def __post_init__(self):
        if self.ratio not in (1, 2) or self.max_rows < 1 or self.max_seqs < 1:
            raise ValueError(f"compressor shape {self}: ratio 1 or 2, rows and seqs >= 1")

    @property
    def slots(self) -> int:
        return self.num_pages * self.page_size


def requests(shape: CompressorShape) -> list[tuple[str, int, str]]:
    """(name, nbytes, comment) of every buffer of `BUFFERS` for up to shape.max_rows rows.

    Only kv_score is scratch; ring, cache and keys are the layer's state (caller-owned KV caches),
    the weights and the RoPE table are constants, the row metadata comes with the step."""
    s = shape
    cols = ck.HEAD_DIM * s.ratio
    wdtype, wbytes = ("fp32", 4) if s.ratio == 2 else ("bf16", 2)
    kv, key = kvrecord_ref.KV_RECORD_BYTES, kvrecord_ref.INDEX_RECORD_BYTES
    return [("x", s.max_rows * s.hidden * 2, f"bf16 [{s.max_rows}, {s.hidden}]"),
            ("w", cols * s.hidden * wbytes, f"{wdtype} [{cols}, {s.hidden}]"),
            ("kv_score", s.max_rows * cols * 4, f"f32 [{s.max_rows}, {cols}] scratch"),
            ("ring", s.max_seqs * ck.RING_ROWS * ck.RING_WIDTH * 4,
             f"f32 [{s.max_seqs}, {ck.RING_ROWS}, {ck.RING_WIDTH}]"),
            ("positions", s.max_rows * 4, f"i32 [{s.max_rows}]"),
            ("seq_index", s.max_rows * 4, f"i32 [{s.max_rows}]"),
            ("state_lines", s.max_seqs * 4, f"i32 [{s.max_seqs}]"),
            ("block_tables", s.max_seqs * s.pages_per_seq * 4,
             f"i32 [{s.max_seqs}, {s.pages_per_seq}]"),
            ("norm_w", ck.HEAD_DIM * 4, f"f32 [{ck.HEAD_DIM}]"),
            ("wk", ck.INDEX_DIM * ck.HEAD_DIM * 2, f"bf16 [{ck.INDEX_DIM}, {ck.HEAD_DIM}]"),
            ("k_norm", ck.INDEX_DIM * 4, f"f32 [{ck.INDEX_DIM}]"),
            ("table", rope_ref.table_bytes(s.num_positions), f"f32 [{s.num_positions}, 32, 2]"),
            ("cache", s.slots * kv, f"u8 [{s.slots}, {kv}]"),
            ("keys", s.slots * key, f"u8 [{s.slots}, {key}]")]


def _ptr(ptrs: Mapping[str, int], name: str, who: str) -> int:
    try:
        return ptrs[name]
    except KeyError:
        raise KeyError(f"{who}: no pointer for buffer {name!r} (it needs "
                       f"{', '.join(BUFFERS)})") from None


def kernel_specs(shape: CompressorShape, fast: bool | None = None, rows: int = 1):
    """(projection, publish) specs for `rows` rows: round 9's pair when `fast` (default: the
    step's choice, FAST_KERNELS up to FAST_MAX_ROWS rows), whose r = 2 projection takes 16-row
    tiles above ck.FAST_PROJ_16_ABOVE rows."""
    if fast is None:
        fast = FAST_KERNELS and rows <= FAST_MAX_ROWS
    wide = shape.ratio == 2 and rows > ck.FAST_PROJ_16_ABOVE
    proj = ("bulk16" if wide else FAST_PROJ) if fast else ""
    return (ck.make_proj_spec(shape.ratio, shape.hidden, proj),
            ck.make_publish_spec(shape.ratio, "staged" if fast else ""))


def compressor_launches(bundle, shape: CompressorShape, ptrs: Mapping[str, int], rows: int,
                        eps: float, fast: bool | None = None) -> list[LaunchSpec]:
    """[projection, publish] of `rows` rows over the buffers at `ptrs` (module docstring)."""
    s = shape
    if not 1 <= rows <= s.max_rows:
        raise ValueError(f"compressor chain: {rows} rows, allocated for 1..{s.max_rows}")
    proj_spec, pub_spec = kernel_specs(s, fast, rows)
    who = f"compressor r{s.ratio}"
    proj = LaunchSpec(bundle.kernel(proj_spec.name), proj_spec.grid(rows),
                      (_ptr(ptrs, "x", who), _ptr(ptrs, "w", who), _ptr(ptrs, "kv_score", who),
                       rows))
    pub = LaunchSpec(bundle.kernel(pub_spec.name), pub_spec.grid(rows),
                     tuple(_ptr(ptrs, n, who) for n in PUBLISH_BUFFERS)
                     + (rows, s.pages_per_seq, s.page_size, s.num_positions, float(eps)))
    return [proj, pub]
