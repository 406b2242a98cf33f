"""The caller-owned KV caches of the reference step: NumPy arrays in the byte layout the GPU uses.

Per layer l (cfg.layer(l); every backbone layer and every DSpark stage):
- `swa[l]`          uint8 [max_seqs * ring_slots, 584]: the SWA ring of each state line; position
                    p of line s lives in slot s * ring_slots + p % ring_slots (slot_mapping).
                    ring_slots = pow2 >= window + max_block_rows, so the W + 5 positions a verify or
                    draft block reads never collide with the block's own writes.
Per kv source k (owns_compressor):
- `compressed[k]`   uint8 [num_pages * page_size, 584]: compressed entries, entry e = p // ratio,
                    paged through RowBatch.block_tables.
- `index_keys[k]`   uint8 [num_pages * page_size, 132]: the entry's 128-d index key, same paging.
Per ratio-2 kv source k:
- `ring[k]`         float32 [max_seqs, ring_rows, 1024]: (kv | score) of position p in row
                    p % ring_rows (ring_rows = pow2 >= max_block_rows + 2, 8 for DSpark k = 5).
- `ring_pos[k]`     int64 [max_seqs, ring_rows]: the position each ring row holds, -1 empty.
                    Reference-only bookkeeping (the GPU relies on the positional invariant): it
                    turns pooling a missing or rolled-back position into an error, not garbage.
Record layouts: `kernels.kvrecord_ref` (584 B: 448 FP8 + 64 BF16 + 7 UE8M0 + pad; 132 B: 128 FP8 +
one f32 scale).

Exact mode (`exact=True`) stores float32 [.., 512] / [.., 128] (BF16 values) instead of records.
Unwritten memory is poison (0xFF bytes = NaN FP8 and NaN scales; NaN floats): reading it shows up.

Per-step scratch (the GPU's index buffers): `step_topk[l]` [R, topk] int32 entry ids of index
source l, `step_candidates[l]` [R, blocks] int32 candidate blocks of the candidate source, each
keyed by the step's rows so a stale read raises.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np

from kernels import kvrecord_ref as rec

RING_WIDTH = 2 * rec.HEAD_DIM  # kv | score


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclass(eq=False)
class KVCaches:
    """All KV state of the reference step; see the module docstring for every array's layout."""

    window: int
    ring_slots: int
    ring_rows: int
    page_size: int
    max_seqs: int
    exact: bool
    block_tables: np.ndarray  # [max_seqs, pages_per_seq] int32: the page allocation of each line
    swa: dict[int, np.ndarray]
    compressed: dict[int, np.ndarray]
    index_keys: dict[int, np.ndarray]
    ring: dict[int, np.ndarray]
    ring_pos: dict[int, np.ndarray]
    ratios: dict[int, int]  # kv source -> compress ratio
    step_topk: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    step_candidates: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    # The last layer's replicated attention half, shared by a step's rank calls (attention.py).
    shared_memo: dict = field(default_factory=dict)

    @classmethod
    def allocate(cls, cfg, max_seqs: int, max_context: int, page_size: int = 64,
                 max_block_rows: int = 6, exact: bool = False, seed: int | None = 0) -> KVCaches:
        """Caches for `max_seqs` state lines of up to `max_context` positions each.

        Pages are handed out as a seeded permutation (seed None: in order), so block tables are not
        the identity and paging bugs show.
        """
        for name, v in (("max_seqs", max_seqs), ("max_context", max_context),
                        ("page_size", page_size), ("max_block_rows", max_block_rows)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"KVCaches.allocate: {name} must be a positive int, got {v!r}")
        pages_per_seq = -(-max_context // page_size)
        num_pages = max_seqs * pages_per_seq
        order = (np.arange(num_pages) if seed is None
                 else np.random.default_rng(seed).permutation(num_pages))
        tables = order.reshape(max_seqs, pages_per_seq).astype(np.int32)
        # uncertain: the doc's ring is 128 slots (= window); a 6-row verify or 5-row draft block
        # must not overwrite window entries its own earlier rows still read, so it holds W + block.
        ring_slots = next_pow2(cfg.sliding_window + max_block_rows)
        ring_rows = next_pow2(max_block_rows + 2)
        entries = num_pages * page_size
        kv_shape = (lambda n: (n, rec.HEAD_DIM)) if exact else (lambda n: (n, rec.KV_RECORD_BYTES))
        key_shape = (entries, rec.INDEX_DIM) if exact else (entries, rec.INDEX_RECORD_BYTES)
        poison = _nan_array if exact else _poison_bytes
        swa, compressed, keys, ring, ring_pos, ratios = {}, {}, {}, {}, {}, {}
        for spec in cfg.layers:
            swa[spec.index] = poison(kv_shape(max_seqs * ring_slots))
            if spec.owns_compressor:
                compressed[spec.index] = poison(kv_shape(entries))
                keys[spec.index] = poison(key_shape)
                ratios[spec.index] = spec.ratio
                if spec.ratio == 2:
                    ring[spec.index] = _nan_array((max_seqs, ring_rows, RING_WIDTH))
                    ring_pos[spec.index] = np.full((max_seqs, ring_rows), -1, np.int64)
        return cls(cfg.sliding_window, ring_slots, ring_rows, page_size, max_seqs, exact, tables,
                   swa, compressed, keys, ring, ring_pos, ratios)

    def copy(self) -> KVCaches:
        return copy.deepcopy(self)

    # ---- addressing ------------------------------------------------------------------------

    def swa_slots(self, lines: np.ndarray, positions: np.ndarray) -> np.ndarray:
        lines = np.asarray(lines, np.int64)
        return lines * self.ring_slots + np.asarray(positions) % self.ring_slots

    def entry_rows(self, block_table: np.ndarray, entries: np.ndarray) -> np.ndarray:
        """Physical rows of entry ids `entries` (any shape, >= 0) via one sequence's block table."""
        entries = np.asarray(entries, np.int64)
        page = entries // self.page_size
        if np.any(page >= block_table.shape[0]):
            raise ValueError(
                f"entry {int(entries.max())} needs page {int(page.max())}, beyond the "
                f"block table's {block_table.shape[0]} pages"
            )
        pages = block_table[page].astype(np.int64)
        if np.any(pages < 0):
            raise ValueError(
                f"entries {entries[pages < 0].tolist()} fall on unallocated pages (-1)")
        return pages * self.page_size + entries % self.page_size

    # ---- records ---------------------------------------------------------------------------

    def store_kv(self, cache: np.ndarray, rows: np.ndarray, entries: np.ndarray) -> None:
        """Write [N, 512] float32 entries at physical `rows` (quantized to records unless exact)."""
        cache[rows] = entries if self.exact else rec.encode_kv_record(entries)

    def load_kv(self, cache: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """[..., 512] float32 entries at physical `rows` (any shape)."""
        rows = np.asarray(rows)
        flat = cache[rows.reshape(-1)]
        out = flat.astype(np.float32) if self.exact else rec.decode_kv_record(flat)
        return out.reshape(*rows.shape, rec.HEAD_DIM)

    def store_keys(self, layer: int, rows: np.ndarray, keys: np.ndarray) -> None:
        self.index_keys[layer][rows] = keys if self.exact else rec.encode_index_key(keys)

    def load_keys(self, layer: int, rows: np.ndarray) -> np.ndarray:
        flat = self.index_keys[layer][rows]
        return flat.astype(np.float32) if self.exact else rec.decode_index_key(flat)

    # ---- DSpark rollback -------------------------------------------------------------------

    def rollback_compressor_rings(self, state_line: int, accepted_len: int) -> None:
        """Forget ring rows of positions >= accepted_len of one sequence (model doc §2.5).

        After a verify step accepts positions < accepted_len, the ring rows the rejected rows wrote
        hold (kv, score) of positions that will be recomputed; they are marked empty (and poisoned),
        so the next step pairs its first odd position only with an accepted predecessor. Stale SWA,
        compressed and index entries need no rollback: they sit at positions no row can see until
        they are rewritten.
        """
        if not 0 <= state_line < self.max_seqs:
            raise ValueError(f"rollback: state line {state_line} outside 0..{self.max_seqs - 1}")
        if isinstance(accepted_len, bool) or not isinstance(accepted_len, (int, np.integer)) \
                or accepted_len < 0:
            raise ValueError(f"rollback: accepted_len must be an int >= 0, got {accepted_len!r}")
        for layer, pos in self.ring_pos.items():
            stale = pos[state_line] >= accepted_len
            pos[state_line, stale] = -1
            self.ring[layer][state_line, stale] = np.nan


def _poison_bytes(shape: tuple) -> np.ndarray:
    return np.full(shape, 0xFF, np.uint8)


def _nan_array(shape: tuple) -> np.ndarray:
    return np.full(shape, np.nan, np.float32)
