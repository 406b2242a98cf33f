"""Runtime probe kernels: specs, grid rules, byte formulas and NumPy references (no DSL import).

The probes are not model kernels. They measure the machine and prove runtime behaviour:

- `probe_stream_read (u64 src, u64 partials, u32 num_vectors)`: 16-byte loads over src; each
  warp XOR-folds its words into partials[warp].
- `probe_spin (u64 out, u32 spin_ns)`: spins spin_ns (< 2**31) on %globaltimer, writes the
  elapsed ns (i64) to out[0].
- `probe_pdl_producer (u64 flag, u32 spin_ns, u32 token)`: triggers its dependents, spins, then
  stores token to flag.
- `probe_pdl_consumer (u64 flag, u64 out, u32 token)`: out[0] = (flag == token) BEFORE
  griddepcontrol.wait, out[1] = flag after it.
- `probe_chain_step (u64 counter)`: triggers, waits, then CTA 0 adds 1 to counter[0] (a chain of
  N steps counts N).

The XOR fold is order-free, so the folded partials equal the fold of the whole buffer whatever
the grid: that is what the stream-read test checks, and it keeps every load live.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

H200_NUM_SMS = 132
STREAM_THREADS = 256
STREAM_CTAS_PER_SM = 8          # 8 x 256 threads = 2048, the SM's thread limit
STREAM_UNROLL = 4               # independent 16-byte loads in flight per thread per iteration
VECTOR_BYTES = 16
WARP = 32


@dataclass(frozen=True)
class ProbeSpec:
    """One compiled probe kernel: name, PTX ABI, launch shape."""

    name: str
    kind: str                               # stream_read|spin|pdl_producer|pdl_consumer|chain_step
    params: tuple[tuple[str, str], ...]     # (name, "u64" | "u32" | "i32" | "f32") in ABI order
    block: tuple[int, int, int]
    grid_x: int                             # default CTAs; the probes take any grid
    smem_bytes: int = 0
    unroll: int = 1

    def grid(self, rows: int = 1) -> tuple[int, int, int]:
        """Probes have no rows: the grid is fixed (`rows` is accepted for the family protocol)."""
        del rows
        return (self.grid_x, 1, 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["params"] = [list(p) for p in self.params]
        d["block"] = list(self.block)
        return d


STREAM_READ = ProbeSpec(
    name="probe_stream_read", kind="stream_read",
    params=(("src", "u64"), ("partials", "u64"), ("num_vectors", "u32")),
    block=(STREAM_THREADS, 1, 1), grid_x=H200_NUM_SMS * STREAM_CTAS_PER_SM, unroll=STREAM_UNROLL)
SPIN = ProbeSpec(
    name="probe_spin", kind="spin", params=(("out", "u64"), ("spin_ns", "u32")),
    block=(WARP, 1, 1), grid_x=1)
PDL_PRODUCER = ProbeSpec(
    name="probe_pdl_producer", kind="pdl_producer",
    params=(("flag", "u64"), ("spin_ns", "u32"), ("token", "u32")), block=(WARP, 1, 1), grid_x=1)
PDL_CONSUMER = ProbeSpec(
    name="probe_pdl_consumer", kind="pdl_consumer",
    params=(("flag", "u64"), ("out", "u64"), ("token", "u32")), block=(WARP, 1, 1), grid_x=1)
CHAIN_STEP = ProbeSpec(
    name="probe_chain_step", kind="chain_step", params=(("counter", "u64"),),
    block=(128, 1, 1), grid_x=H200_NUM_SMS)

ALL_PROBES = (STREAM_READ, SPIN, PDL_PRODUCER, PDL_CONSUMER, CHAIN_STEP)


def stream_read_partials_count(grid_x: int) -> int:
    """u32 partials the stream-read probe writes: one per warp of the grid."""
    return grid_x * STREAM_THREADS // WARP


def stream_read_bytes(num_bytes: int, grid_x: int = STREAM_READ.grid_x) -> int:
    """Bytes the stream-read probe must move: the source once plus the per-warp partials."""
    return num_bytes + 4 * stream_read_partials_count(grid_x)


def check_stream_read_size(num_bytes: int) -> int:
    """Number of 16-byte vectors for a source of num_bytes; rejects what the kernel cannot take."""
    if num_bytes <= 0 or num_bytes % VECTOR_BYTES:
        raise ValueError(f"stream-read source must be a positive multiple of 16 bytes, "
                         f"got {num_bytes}")
    num_vectors = num_bytes // VECTOR_BYTES
    if num_vectors >= 2**31:
        raise ValueError(f"stream-read source of {num_bytes} bytes exceeds the i32 vector index")
    return num_vectors


def xor_fold_u32(words: np.ndarray) -> int:
    """XOR of all u32 words (what the stream-read probe computes, in any order)."""
    w = np.ascontiguousarray(words).view(np.uint32)
    return int(np.bitwise_xor.reduce(w.ravel(), initial=np.uint32(0)))


def stream_read_ref(src: np.ndarray) -> int:
    """Reference of the stream-read probe: the XOR of every u32 word of src."""
    return xor_fold_u32(src)


def chain_ref(num_steps: int, start: int = 0) -> int:
    """Counter after a chain of num_steps `probe_chain_step` launches (each adds exactly 1)."""
    return (start + num_steps) % 2**32


def stream_read_partials_ref(src: np.ndarray, grid_x: int) -> np.ndarray:
    """Exactly the u32 partials the stream-read probe writes for a grid of grid_x CTAs.

    Thread g (= cta * 256 + t) visits the vectors g, g + S, g + 2S, ... (S = grid_x * 256 threads)
    and XORs their words; lane 0 of each warp stores the XOR of its 32 threads.
    """
    words = np.ascontiguousarray(src).view(np.uint32).ravel()
    check_stream_read_size(words.size * 4)
    num_threads = grid_x * STREAM_THREADS
    vecs = words.reshape(-1, VECTOR_BYTES // 4)
    pad = (-vecs.shape[0]) % num_threads
    vecs = np.concatenate([vecs, np.zeros((pad, vecs.shape[1]), np.uint32)])   # 0 is XOR's identity
    per_thread = np.bitwise_xor.reduce(vecs.reshape(-1, num_threads, vecs.shape[1]), axis=(0, 2))
    return np.bitwise_xor.reduce(per_thread.reshape(-1, WARP), axis=1)
