"""One-shot all-reduce (Lamport, -0.0 sentinel): specs, peer-buffer layout, byte formula, reference.

    plain:     out[r, :] = bf16( sum_s x_s[r, :] )                   s = 0, 1, ..., world-1
    residual:  out[r, :] = bf16( residual[r, :] + sum_s x_s[r, :] )   (one rounding, fp32 math)

x_s is rank s's BF16 [rows, D] input; the sum is an fp32 left fold in FIXED rank order
((x_0 + x_1) + x_2) + x_3, so every rank computes the same bits. Before sending, a -0.0 input
lane becomes +0.0 (-0.0 is the "not arrived" sentinel); the reference does the same.

How (per rank, one launch, no host state):
- Each rank owns a receive buffer of 2 generations x world slots x max_rows x D bf16, filled with
  -0.0 (0x8000) once at set-up and shared with its peers over CUDA IPC. `control` (device u32[4]:
  generation, CTA arrivals, failed, 0) holds the only per-call state.
- A thread takes 16-byte chunks (8 bf16, grid stride): it pushes its input chunk into slot
  [gen][rank] of every rank's buffer, then polls its own slots [gen][0..world) until no lane holds
  0x8000, sums them in rank order, writes out, and resets the slots it read to 0x8000.
- The last CTA to finish flips the generation. Two generations suffice: a peer can run at most
  one call ahead (it cannot finish call n+1 before this rank sent its n+1 data, which it does
  only after finishing call n, slots reset included).
- A poll that exceeds `timeout_us` (on %globaltimer) stores 1 into status[s] for the silent rank
  s and into control[2]; every later poll of this rank gives up at once. `status` is host-mapped
  pinned memory, so the host reads it without synchronizing (collectives/oneshot.py).

PTX ABI: plain    (u64 inp, u64 out, u64 peers, u64 control, u64 status, u32 rank, u32 rows,
                   u32 timeout_us)
         residual (u64 inp, u64 residual, u64 out, u64 peers, u64 control, u64 status, u32 rank,
                   u32 rows, u32 timeout_us)
peers is a device u64[world] of receive-buffer bases (peers[rank] = own). All buffers 16-byte
aligned; out may alias residual or inp.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.common_ref import (
    BF16,
    BF16_PER_VECTOR,
    H200_NUM_SMS,
    check_rows,
    params_dict,
    persistent_grid,
    to_bf16,
)

CTA_THREADS = 256
MAX_CTAS = 2 * H200_NUM_SMS            # one wave at any register count this kernel uses
GENERATIONS = 2
SENTINEL_BITS = 0x8000                 # bf16 -0.0
CONTROL_WORDS = 4                      # generation, arrivals, failed, unused
MAX_ROWS = 192
WORLD_SIZES = (2, 4, 8)
_COMMON = (("peers", "u64"), ("control", "u64"), ("status", "u64"), ("rank", "u32"),
           ("rows", "u32"), ("timeout_us", "u32"))
PARAMS_PLAIN = (("inp", "u64"), ("out", "u64")) + _COMMON
PARAMS_RESIDUAL = (("inp", "u64"), ("residual", "u64"), ("out", "u64")) + _COMMON


@dataclass(frozen=True)
class OneShotSpec:
    """One compiled one-shot all-reduce: world size, row width, row capacity, epilogue."""

    name: str
    world: int
    width: int
    max_rows: int
    epilogue: str                       # "none" | "residual"
    params: tuple[tuple[str, str], ...]
    block: tuple[int, int, int] = (CTA_THREADS, 1, 1)
    smem_bytes: int = 0

    @property
    def chunks_per_row(self) -> int:
        return self.width // BF16_PER_VECTOR

    @property
    def slot_bytes(self) -> int:
        """One rank's rows in one generation: max_rows x width bf16."""
        return self.max_rows * self.width * 2

    @property
    def buffer_bytes(self) -> int:
        """The receive buffer each rank shares: generations x world slots."""
        return GENERATIONS * self.world * self.slot_bytes

    def slot_offset(self, generation: int, source: int) -> int:
        """Byte offset of the slot that rank `source` fills in generation `generation`."""
        return (generation * self.world + source) * self.slot_bytes

    def grid(self, rows: int) -> tuple[int, int, int]:
        check_rows(rows, self.name)
        if rows > self.max_rows:
            raise ValueError(f"{self.name}: rows={rows} exceeds the buffer capacity of "
                             f"{self.max_rows} rows")
        return persistent_grid(rows * self.chunks_per_row, CTA_THREADS, MAX_CTAS)

    def bytes_moved(self, rows: int) -> int:
        return oneshot_bytes(rows, self.width, self.world, self.epilogue)

    def to_dict(self) -> dict:
        return {"family": "allreduce", "name": self.name, "world": self.world,
                "width": self.width, "max_rows": self.max_rows, "epilogue": self.epilogue,
                "params": params_dict(self.params), "block": list(self.block),
                "smem_bytes": self.smem_bytes, "max_ctas": MAX_CTAS,
                "generations": GENERATIONS}


def make_spec(world: int, width: int, epilogue: str = "none",
              max_rows: int = MAX_ROWS) -> OneShotSpec:
    if world not in WORLD_SIZES:
        raise ValueError(f"one-shot all-reduce: world {world}, expected one of {WORLD_SIZES}")
    if width <= 0 or width % BF16_PER_VECTOR:
        raise ValueError(f"one-shot all-reduce: width {width} must be a positive multiple of 8")
    if not 1 <= max_rows <= MAX_ROWS:
        raise ValueError(f"one-shot all-reduce: max_rows {max_rows} outside 1..{MAX_ROWS}")
    if epilogue not in ("none", "residual"):
        raise ValueError(f"one-shot all-reduce: epilogue {epilogue!r}, expected 'none' or "
                         "'residual'")
    params = PARAMS_PLAIN if epilogue == "none" else PARAMS_RESIDUAL
    suffix = "" if epilogue == "none" else "_residual"
    return OneShotSpec(f"allreduce_oneshot_w{world}_d{width}{suffix}", world, width, max_rows,
                       epilogue, params)


def oneshot_bytes(rows: int, width: int, world: int, epilogue: str = "none") -> int:
    """HBM bytes one rank's launch moves: read its input, push world copies (written into the
    ranks' buffers), read world slots, reset them, write out (+ read the residual)."""
    row_bytes = rows * width * 2
    return row_bytes * (1 + 3 * world + 1 + (1 if epilogue == "residual" else 0))


def bus_bandwidth_gbps(rows: int, width: int, world: int, us: float) -> float:
    """nccl-tests' bus bandwidth of an all-reduce: size/time x 2(world-1)/world."""
    return rows * width * 2 / (us * 1e-6) * 2 * (world - 1) / world / 1e9


def sanitize_ref(x: np.ndarray) -> np.ndarray:
    """-0.0 becomes +0.0 (the bits a rank sends); everything else, NaN included, is unchanged."""
    bits = np.ascontiguousarray(x, dtype=BF16).view(np.uint16)
    return np.where(bits == SENTINEL_BITS, np.uint16(0), bits).view(BF16)


def _check_inputs(inputs, who: str) -> list[np.ndarray]:
    xs = [np.asarray(x) for x in inputs]
    if not xs or any(x.dtype != BF16 or x.ndim != 2 or x.shape != xs[0].shape for x in xs):
        raise TypeError(f"{who}: one bf16 [rows, D] array per rank expected, got "
                        f"{[(x.dtype, x.shape) for x in xs]}")
    return xs


def rank_sum_f32(inputs) -> np.ndarray:
    """fp32 left fold over ranks in rank order, of the sanitized bf16 inputs (what every rank
    accumulates before its epilogue)."""
    xs = _check_inputs(inputs, "rank_sum_f32")
    acc = sanitize_ref(xs[0]).astype(np.float32)
    for x in xs[1:]:
        acc = acc + sanitize_ref(x).astype(np.float32)
    return acc


def allreduce_ref(inputs) -> np.ndarray:
    """Exactly what the plain kernel writes on every rank: bf16(rank-ordered fp32 sum)."""
    return to_bf16(rank_sum_f32(inputs))


def allreduce_residual_ref(inputs, residual: np.ndarray) -> np.ndarray:
    """Exactly what the residual kernel writes: bf16(float(residual) + rank-ordered fp32 sum)."""
    acc = rank_sum_f32(inputs)
    if residual.dtype != BF16 or residual.shape != acc.shape:
        raise TypeError(f"allreduce_residual_ref: residual must be bf16 {acc.shape}, got "
                        f"{residual.dtype} {residual.shape}")
    return to_bf16(residual.astype(np.float32) + acc)


def allreduce_f64(inputs, residual: np.ndarray | None = None) -> np.ndarray:
    """Float64 ground truth (order-free), for the error budget of the fp32 fold."""
    xs = _check_inputs(inputs, "allreduce_f64")
    total = sum(x.astype(np.float64) for x in xs)
    return total if residual is None else total + residual.astype(np.float64)


# ---- the cross-rank greedy pick (split-vocabulary argmax, model doc §2.3 step 5) -------------------
#
#   tokens[r] = global argmax over ranks of (value, index): max value, ties to the lower index
#
# Each rank holds the lm_head argmax kernel's pair per row (int32 [rows, 2] = f32 bits of its best
# logit, its global vocab index). The pick rides on the one-shot all-reduce's buffers, control word
# and generations: every rank pushes one u64 key per row, key = ordered(value) << 32 | ~index (the
# lm_head kernel's own ordering: larger key = larger value, on equal values the lower index), into
# slot [gen][rank] of every rank's receive buffer with ONE 64-bit volatile store (single-copy atomic,
# so a key is never seen torn), polls its own slots until no key is the sentinel, keeps the largest
# key in rank order, resets the slots, and writes tokens int64 [rows]. The sentinel is the
# all-reduce's own fill (0x8000 per bf16 lane: 0x8000800080008000), which is no valid key (its index
# would be 0x7FFF7FFF), so the buffers stay valid for the all-reduce that follows. Every rank writes
# the same tokens. One thread per row, one CTA; the CTA flips the generation as the all-reduce does.
#
# PTX ABI: (u64 pairs, u64 tokens, u64 peers, u64 control, u64 status, u32 rank, u32 rows,
#           u32 timeout_us)

PICK_SENTINEL = 0x8000800080008000
PICK_THREADS = 256
PARAMS_PICK = (("pairs", "u64"), ("tokens", "u64")) + _COMMON


@dataclass(frozen=True)
class PickSpec:
    """The cross-rank pick for one world size, on the all-reduce buffers of one row width."""

    name: str
    world: int
    width: int                          # the all-reduce's row width (its slot size)
    max_rows: int
    params: tuple[tuple[str, str], ...] = PARAMS_PICK
    block: tuple[int, int, int] = (PICK_THREADS, 1, 1)
    smem_bytes: int = 0

    @property
    def slot_bytes(self) -> int:
        return self.max_rows * self.width * 2

    def grid(self, rows: int) -> tuple[int, int, int]:
        check_rows(rows, self.name)
        if rows > min(self.max_rows, PICK_THREADS):
            raise ValueError(f"{self.name}: rows={rows} exceeds {min(self.max_rows, PICK_THREADS)}")
        return (1, 1, 1)

    def to_dict(self) -> dict:
        return {"family": "allreduce", "name": self.name, "kind": "pick", "world": self.world,
                "width": self.width, "max_rows": self.max_rows,
                "params": params_dict(self.params), "block": list(self.block),
                "smem_bytes": self.smem_bytes, "generations": GENERATIONS}


def make_pick_spec(world: int, width: int, max_rows: int = MAX_ROWS) -> PickSpec:
    make_spec(world, width, "none", max_rows)          # the same buffer rules
    return PickSpec(f"allreduce_pick_w{world}_d{width}", world, width, max_rows)


def ordered_key(pairs: np.ndarray) -> np.ndarray:
    """int32 [rows, 2] (f32 bits, index) -> uint64 keys: ordered(value) << 32 | ~index, with -0
    canonicalised to +0 (as the lm_head kernel orders its candidates)."""
    pairs = np.ascontiguousarray(pairs, np.int32)
    bits = pairs[:, 0].view(np.uint32).copy()
    bits[bits == 0x80000000] = 0
    negative = (bits & 0x80000000) != 0
    ordered = np.where(negative, ~bits, bits | np.uint32(0x80000000)).astype(np.uint64)
    index = (~pairs[:, 1].view(np.uint32)).astype(np.uint64)
    return (ordered << np.uint64(32)) | index


def pick_ref(rank_pairs) -> np.ndarray:
    """Exactly what every rank writes: int64 tokens [rows] from each rank's int32 [rows, 2]."""
    keys = np.stack([ordered_key(p) for p in rank_pairs])
    best = keys.max(axis=0)
    return (~(best & np.uint64(0xFFFFFFFF)).astype(np.uint32)).astype(np.int64)


# ---- the all-gather of bf16 column blocks (Engram's looked-up heads, model doc §2.1 E2) ----------
#
#   out[r, s*C:(s+1)*C] = x_s[r, :]          s = 0..world-1, x_s rank s's bf16 [rows, C]
#
# The same protocol, buffers, control and generations as the all-reduce: every rank pushes its
# rows (sanitized: -0.0 sent as +0.0, the one change of value, a zero's sign) into slot [gen][rank]
# of every rank's buffer, packed [rows, C] at the slot's start (C <= width: a slot holds
# max_rows x width lanes), then polls its own slots, copies slot s to columns [s*C, (s+1)*C) of
# out, resets the slots, and the last CTA flips the generation.
#
# PTX ABI: (u64 inp, u64 out, u64 peers, u64 control, u64 status, u32 rank, u32 rows,
#           u32 timeout_us)


@dataclass(frozen=True)
class GatherSpec:
    """The all-gather of `cols` bf16 lanes per row and rank, on the all-reduce buffers of one
    row width."""

    name: str
    world: int
    width: int                          # the all-reduce's row width (its slot size)
    cols: int                           # C: lanes per row per rank
    max_rows: int
    params: tuple[tuple[str, str], ...] = PARAMS_PLAIN
    block: tuple[int, int, int] = (CTA_THREADS, 1, 1)
    smem_bytes: int = 0

    @property
    def chunks_per_row(self) -> int:
        return self.cols // BF16_PER_VECTOR

    @property
    def slot_bytes(self) -> int:
        return self.max_rows * self.width * 2

    def grid(self, rows: int) -> tuple[int, int, int]:
        check_rows(rows, self.name)
        if rows > self.max_rows:
            raise ValueError(f"{self.name}: rows={rows} exceeds the buffer capacity of "
                             f"{self.max_rows} rows")
        return persistent_grid(rows * self.chunks_per_row, CTA_THREADS, MAX_CTAS)

    def to_dict(self) -> dict:
        return {"family": "allreduce", "name": self.name, "kind": "gather", "world": self.world,
                "width": self.width, "cols": self.cols, "max_rows": self.max_rows,
                "params": params_dict(self.params), "block": list(self.block),
                "smem_bytes": self.smem_bytes, "max_ctas": MAX_CTAS,
                "generations": GENERATIONS}


def make_gather_spec(world: int, width: int, cols: int, max_rows: int = MAX_ROWS) -> GatherSpec:
    make_spec(world, width, "none", max_rows)          # the same buffer rules
    if cols <= 0 or cols % BF16_PER_VECTOR or cols > width:
        raise ValueError(f"all-gather: cols {cols} must be a positive multiple of "
                         f"{BF16_PER_VECTOR} and at most the slot width {width}")
    return GatherSpec(f"allreduce_gather_w{world}_d{width}_c{cols}", world, width, cols,
                      max_rows)


def gather_ref(inputs) -> np.ndarray:
    """Exactly what every rank writes: the sanitized inputs side by side, [rows, world * C]."""
    xs = _check_inputs(inputs, "gather_ref")
    return np.concatenate([sanitize_ref(x) for x in xs], axis=1)


# ---- a rank block wider than a slot: the gather of `pieces` row-interleaved blocks -------------
#
# A rank's [rows, P * C] block whose P * C exceeds the slot width (Engram's sharded wkv output:
# 6400 lanes a rank at D = 5120) is gathered as [P * rows, C] (the same bytes, each row read as P
# rows of C): out[P * r + h, s * C + c] = x_s[r, h * C + c], which in the [rows, P * world * C]
# view is column h * world * C + s * C + c. A rank that computes the output columns
# {h * world * C + rank * C + c} as its local columns h * C + c therefore gathers the
# unsharded output in its own column order. P * rows rows must fit the spec's max_rows: at more
# rows the caller launches the gather on row chunks (each chunk a call of its own).


def gather_pieces(width: int, cols: int, granule: int = BF16_PER_VECTOR) -> int:
    """The fewest P such that a rank's `cols` lanes split into P blocks of at most `width`
    lanes, each a multiple of `granule` (itself a multiple of BF16_PER_VECTOR)."""
    if granule <= 0 or granule % BF16_PER_VECTOR:
        raise ValueError(f"gather_pieces: granule {granule} is not a positive multiple of "
                         f"{BF16_PER_VECTOR}")
    for pieces in range(1, cols // granule + 1):
        piece = cols // pieces
        if cols % pieces == 0 and piece % granule == 0 and piece <= width:
            return pieces
    raise ValueError(f"gather_pieces: {cols} lanes do not split into blocks of whole {granule}-"
                     f"lane units of at most {width} lanes")


def gather_pieces_ref(inputs, pieces: int) -> np.ndarray:
    """What every rank writes when each rank's bf16 [rows, P * C] block is gathered as
    [P * rows, C]: [rows, world * P * C] (see above)."""
    xs = _check_inputs(inputs, "gather_pieces_ref")
    rows, cols = xs[0].shape
    if cols % pieces:
        raise ValueError(f"gather_pieces_ref: {cols} lanes are not {pieces} equal blocks")
    out = gather_ref([x.reshape(rows * pieces, cols // pieces) for x in xs])
    return out.reshape(rows, len(xs) * cols)
