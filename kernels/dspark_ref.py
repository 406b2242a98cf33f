"""DSpark round kernels (model doc §4, §2.5): aux states, greedy acceptance, compressor-ring rollback.

Three small kernels keep a DSpark round on the device (no host read between verify and draft):

Aux states (verify step, after each target layer's attn.mhc_pre has applied the pending post):

    aux[r, target, :] = bf16( (((s0 + s1) + s2) + s3) * 0.25 )      s_i = float(streams[r, i, :])

  streams BF16 [R, S, D], aux BF16 [R, T, D] (T target layers; `target` picks the slot). The sum
  is sequential in fp32 and 0.25 is exact, which is what NumPy's mean over axis 1 does
  (executor/reference/step.py's aux), so the two agree bitwise.
  PTX ABI: (u64 streams, u64 aux, u32 target, u32 rows).

Greedy acceptance (after the verify step's argmax pick), one thread per row:

    a_s        = longest k with token_ids[f + 1 + j] == tokens[f + j] for all j < k
                 (f the first row of sequence s's block; drafts are the block's rows 1..)
    accepted[s] = a_s,  bonus[s] = tokens[f + a_s]
    context_slots[r] = slot_mapping[r] if r - f <= a_s else -1     (padding rows: -1)

  token_ids int64 [R] (the verify rows: bonus, d_1..d_k), tokens int64 [R] (the greedy pick),
  seq_index int32 [R] (-1 padding; a sequence's rows adjacent, in position order), slot_mapping
  int64 [R]; accepted int32 [S], bonus int64 [S] indexed by seq_index; context_slots int64 [R] are
  the SWA slots the draft stages' context KV is written at (rows past the accepted count write
  nothing). A block of one row (decode) accepts 0 and its bonus is its greedy token.
  PTX ABI: (u64 token_ids, u64 tokens, u64 seq_index, u64 slot_mapping, u64 accepted,
  u64 bonus, u64 context_slots, u32 rows).

Compressor-ring rollback (one ratio-2 kv source's ring), one CTA per row:

    row r of sequence s with positions[r] - positions[f] > accepted[s] (rejected):
        ring[state_lines[s], positions[r] % ring_rows, :] = NaN      (1024 fp32)

  The rejected rows are exactly the positions >= P + a + 1 the block wrote into the ring, which
  is what KVCaches.rollback_compressor_rings forgets (the ring holds no later position). Poison
  rather than nothing: the GPU path relies on the positional invariant and never reads them, so
  writing NaN makes any violation visible instead of silently pooling a rejected position.
  PTX ABI: (u64 ring, u64 positions, u64 seq_index, u64 state_lines, u64 accepted, u32 rows).

Markov correction, step i of k (draft step, after the base logits U):

    ids[s * (k + 1) + i] = prev[s]                                   (every step, i = 0..k)
    i < k:  logit[v] = U[s * k + i, v] + sum_j w1[prev[s], j] * w2[v, j]   (fp32, j in order)
            pairs[s] = (f32 bits of max logit, first local argmax + vocab_offset)

  U fp32 [S k, V_l] (this rank's vocab columns of the draft rows' base logits), w1 bf16 [V, m]
  (markov_w1, replicated), w2 bf16 [V_l, m] (this rank's markov_w2 rows), prev int64 [S] (the
  anchor `bonus` at i = 0, then the cross-rank pick of step i - 1), pairs int32 [S, 2] (what
  kernels.allreduce's pick reads), ids int64 [S (k + 1)]: the next verify step's token_ids
  (bonus, d_1..d_k per sequence). A product of two bf16 values is exact in fp32, so fused or not
  the kernel's sum is the sequential fp32 sum the reference computes: bitwise. Launch i = k only
  writes ids (the last draft). A negative prev marks a padding sequence of the bucket: only its
  ids row is written. One CTA per 256 vocab columns (w2 is read once per step whatever S is);
  each CTA's best per sequence goes to `partials` f32 [S, tiles, 2] (value, index as f32: exact
  below 2^24), the last CTA (by `counter`, u32, zero before and after every launch) reduces them:
  larger value, then lower index, a strict order, so any reduction order gives np.argmax's first
  maximum (NaN logits are not ordered: the kernel never picks one).
  PTX ABI: (u64 base, u64 w1, u64 w2, u64 prev, u64 pairs, u64 ids, u64 partials, u64 counter,
  u32 step, u32 vocab_offset, u32 seqs).

Row advance (the last stage of a verify plan: to the draft rows; of a draft plan: to the next
verify rows), one thread per sequence slot s < seqs, so a round needs no host write:

    padding slot (bonus[s] < 0): its `width` rows get token 0, position 0, seq -1, slot -1, kind
        decode; context_lens[s] = 0
    P' = context_lens[s] - k + (accepted[s] if to the draft else 0)     (the new bonus position)
    row s * width + j, j < width:   positions = P' + j, seq_index = s, block_kind = kind,
        slot_mapping = state_lines[s] * ring_slots + (P' + j) % ring_slots
        (to the draft only) token_ids = bonus[s] at j = 0, else noise_token
    context_lens[s] = P' + width

  width = k, kind draft after a verify step (whose block was P..P+k: context_lens = P + k + 1,
  so P' = P + a + 1); width = k + 1, kind verify after a draft step (P'..P'+k-1: P' =
  context_lens - k). The next verify's token_ids are the Markov stages' (above). Only the
  sequence's own context_lens entry is read, by the thread that rewrites it, so writing the rows
  in place cannot race with a read of the step's rows (every earlier kernel of the step has
  completed at the PDL wait, and the next graph starts after this one in stream order).
  token_ids, positions, context_lens int64; seq_index, state_lines, accepted int32; slot_mapping
  int64; block_kind int8; bonus int64.
  PTX ABI: (u64 token_ids, u64 positions, u64 seq_index, u64 slot_mapping, u64 block_kind,
  u64 context_lens, u64 state_lines, u64 accepted, u64 bonus, u32 ring_slots, u32 seqs).
Engram lookback of the next step's rows (sync-free rounds: before the row advance to the draft
rows, after the acceptance; before the advance to the verify rows, after the Markov stages):
`token_history` [R, c] (c = max_ngram - 1; column m of a row at position p holds the token at
p - 1 - m, the pad id before position 0), on the device. One CTA, one thread per sequence slot
s < seqs (seqs <= 256), slots with bonus[s] < 0 untouched; each thread reads everything it needs
into registers, the CTA synchronises, then it writes, so rewriting token_history in another row
layout in place cannot race:

    to the draft, verify block f = s (k + 1), a = accepted[s], new bonus position P' = P + a + 1:
        tail[m]  = token at P' - 1 - m = token_ids[f + a - m] if a >= m
                   else token_history[f, m - a - 1]                       (m < c)
        draft row s k + j, column m: the draft block [bonus, noise x (k - 1)]'s token at
                   P' + j - 1 - m if j > m, else tail[m - j]
    to the verify, draft row s k holds the tail (column m: the token at P' - 1 - m):
        verify row s (k + 1) + j, column m: token_ids[s (k + 1) + j - 1 - m] if j > m,
                   else token_history[s k, m - j]

  The tail is carried only in the draft block's first row's history, so the caller writes the
  first draft step's token_history (as every step's rows) and the device keeps it from then on.
  Tokens are copied as they are: right while Engram's compressed-vocabulary map is the identity
  (tiny; the rows prep has the same limit, docs/notes/step-wiring.md). The draft step hashes
  nothing (its stages have no Engram), so only its first rows' history is meaningful.
  token_ids, token_history, bonus int64; accepted int32.
  PTX ABI: (u64 token_ids, u64 token_history, u64 accepted, u64 bonus, u32 seqs).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.common_ref import (
    BF16_PER_VECTOR,
    H200_NUM_SMS,
    check_rows,
    params_dict,
    to_bf16,
)

CTA_THREADS = 256
MAX_CTAS = 8
RING_WIDTH = 1024                   # fp32 kv | score (executor/reference/kvcache.py)
NAN_BITS = 0x7FC00000               # the canonical quiet NaN, np.float32(np.nan)
AUX_PARAMS = (("streams", "u64"), ("aux", "u64"), ("target", "u32"), ("rows", "u32"))
ACCEPT_PARAMS = (("token_ids", "u64"), ("tokens", "u64"), ("seq_index", "u64"),
                 ("slot_mapping", "u64"), ("accepted", "u64"), ("bonus", "u64"),
                 ("context_slots", "u64"), ("rows", "u32"))
MARKOV_PARAMS = (("base", "u64"), ("w1", "u64"), ("w2", "u64"), ("prev", "u64"),
                 ("pairs", "u64"), ("ids", "u64"), ("partials", "u64"), ("counter", "u64"),
                 ("step", "u32"), ("vocab_offset", "u32"), ("seqs", "u32"))
ADVANCE_PARAMS = (("token_ids", "u64"), ("positions", "u64"), ("seq_index", "u64"),
                  ("slot_mapping", "u64"), ("block_kind", "u64"), ("context_lens", "u64"),
                  ("state_lines", "u64"), ("accepted", "u64"), ("bonus", "u64"),
                  ("ring_slots", "u32"), ("seqs", "u32"))
HISTORY_PARAMS = (("token_ids", "u64"), ("token_history", "u64"), ("accepted", "u64"),
                  ("bonus", "u64"), ("seqs", "u32"))
KIND_DECODE, KIND_VERIFY, KIND_DRAFT = range(3)     # executor/reference/rows.py BLOCK_KINDS
ROLLBACK_PARAMS = (("ring", "u64"), ("positions", "u64"), ("seq_index", "u64"),
                   ("state_lines", "u64"), ("accepted", "u64"), ("rows", "u32"))


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"dspark: {name} must be a positive int, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class AuxSpec:
    """Mean of S bf16 streams of width D into one of T aux slots; one 8-element chunk a thread."""

    name: str
    width: int
    streams: int
    targets: int
    params: tuple[tuple[str, str], ...] = AUX_PARAMS
    block: tuple[int, int, int] = (CTA_THREADS, 1, 1)
    smem_bytes: int = 0

    @property
    def chunks_per_row(self) -> int:
        return self.width // BF16_PER_VECTOR

    def grid(self, rows: int) -> tuple[int, int, int]:
        check_rows(rows, self.name)
        return (min(-(-rows * self.chunks_per_row // CTA_THREADS), H200_NUM_SMS), 1, 1)

    def to_dict(self) -> dict:
        return {"family": "dspark", "kind": "aux", "name": self.name, "width": self.width,
                "streams": self.streams, "targets": self.targets,
                "params": params_dict(self.params), "block": list(self.block),
                "smem_bytes": self.smem_bytes}


@dataclass(frozen=True)
class AcceptSpec:
    """Greedy acceptance over blocks of at most `max_block` rows; one thread a row."""

    name: str
    max_block: int
    params: tuple[tuple[str, str], ...] = ACCEPT_PARAMS
    block: tuple[int, int, int] = (CTA_THREADS, 1, 1)
    smem_bytes: int = 0

    def grid(self, rows: int) -> tuple[int, int, int]:
        check_rows(rows, self.name)
        return (min(-(-rows // CTA_THREADS), MAX_CTAS), 1, 1)

    def to_dict(self) -> dict:
        return {"family": "dspark", "kind": "accept", "name": self.name,
                "max_block": self.max_block, "params": params_dict(self.params),
                "block": list(self.block), "smem_bytes": self.smem_bytes}


@dataclass(frozen=True)
class RollbackSpec:
    """NaN the ring rows of rejected positions; one CTA (of RING_WIDTH / 4 threads) a row."""

    name: str
    ring_rows: int
    max_block: int
    params: tuple[tuple[str, str], ...] = ROLLBACK_PARAMS
    block: tuple[int, int, int] = (RING_WIDTH // 4, 1, 1)
    smem_bytes: int = 0

    def grid(self, rows: int) -> tuple[int, int, int]:
        return (check_rows(rows, self.name), 1, 1)

    def to_dict(self) -> dict:
        return {"family": "dspark", "kind": "rollback", "name": self.name,
                "ring_rows": self.ring_rows, "max_block": self.max_block,
                "params": params_dict(self.params), "block": list(self.block),
                "smem_bytes": self.smem_bytes}


@dataclass(frozen=True)
class MarkovSpec:
    """One Markov step over `vocab` local logits with a rank-`rank` correction, k = `steps`."""

    name: str
    vocab: int
    rank: int
    steps: int
    params: tuple[tuple[str, str], ...] = MARKOV_PARAMS
    block: tuple[int, int, int] = (CTA_THREADS, 1, 1)

    @property
    def tiles(self) -> int:
        return -(-self.vocab // CTA_THREADS)

    @property
    def smem_bytes(self) -> int:
        return 4 * self.rank + 8 * (CTA_THREADS // 32) + 16   # w1 row, the warps' bests, a flag

    def partials_bytes(self, max_seqs: int) -> int:
        return 8 * self.tiles * max_seqs

    def grid(self, seqs: int) -> tuple[int, int, int]:
        check_rows(seqs, self.name)
        return (self.tiles, 1, 1)

    def to_dict(self) -> dict:
        return {"family": "dspark", "kind": "markov", "name": self.name, "vocab": self.vocab,
                "rank": self.rank, "steps": self.steps, "params": params_dict(self.params),
                "block": list(self.block), "smem_bytes": self.smem_bytes}


@dataclass(frozen=True)
class AdvanceSpec:
    """The next step's row metadata from this one's, k = `steps`; one thread a sequence slot."""

    name: str
    steps: int
    to_verify: bool                 # False: verify -> draft rows; True: draft -> verify rows
    noise_token: int
    params: tuple[tuple[str, str], ...] = ADVANCE_PARAMS
    block: tuple[int, int, int] = (CTA_THREADS, 1, 1)
    smem_bytes: int = 0

    @property
    def width(self) -> int:
        """Rows per sequence of the step written."""
        return self.steps + 1 if self.to_verify else self.steps

    @property
    def kind(self) -> int:
        return KIND_VERIFY if self.to_verify else KIND_DRAFT

    def grid(self, seqs: int) -> tuple[int, int, int]:
        check_rows(seqs, self.name)
        return (min(-(-seqs // CTA_THREADS), MAX_CTAS), 1, 1)

    def to_dict(self) -> dict:
        return {"family": "dspark", "kind": "advance", "name": self.name, "steps": self.steps,
                "to_verify": self.to_verify, "noise_token": self.noise_token,
                "params": params_dict(self.params), "block": list(self.block),
                "smem_bytes": self.smem_bytes}


@dataclass(frozen=True)
class HistorySpec:
    """The Engram lookback of the next step's rows (draft or verify), k = `steps`."""

    name: str
    steps: int
    to_verify: bool                 # False: verify -> draft rows; True: draft -> verify rows
    cols: int                       # token_history columns: max_ngram - 1
    noise_token: int
    params: tuple[tuple[str, str], ...] = HISTORY_PARAMS
    block: tuple[int, int, int] = (CTA_THREADS, 1, 1)
    smem_bytes: int = 0

    def grid(self, seqs: int) -> tuple[int, int, int]:
        check_rows(seqs, self.name)
        if seqs > CTA_THREADS:
            raise ValueError(f"{self.name}: {seqs} sequence slots; one CTA serves at most "
                             f"{CTA_THREADS} (it synchronises between its reads and writes)")
        return (1, 1, 1)

    def to_dict(self) -> dict:
        return {"family": "dspark", "kind": "history", "name": self.name, "steps": self.steps,
                "to_verify": self.to_verify, "cols": self.cols, "noise_token": self.noise_token,
                "params": params_dict(self.params), "block": list(self.block),
                "smem_bytes": self.smem_bytes}


def make_history_spec(steps: int, to_verify: bool, cols: int, noise_token: int) -> HistorySpec:
    _positive("steps", steps)
    if not isinstance(to_verify, bool):
        raise TypeError(f"dspark history: to_verify must be a bool, got {to_verify!r}")
    if isinstance(cols, bool) or not isinstance(cols, (int, np.integer)) or not 1 <= cols <= 8:
        raise ValueError(f"dspark history: cols {cols!r} must be an int in 1..8 (a model "
                         f"without Engram has no token_history)")
    if isinstance(noise_token, bool) or not isinstance(noise_token, (int, np.integer)) \
            or not 0 <= noise_token < 2**31:
        raise ValueError(f"dspark history: noise_token {noise_token!r} is not a token id")
    target = "verify" if to_verify else "draft"
    return HistorySpec(f"dspark_history_{target}_k{steps}_c{cols}_n{noise_token}", steps,
                       to_verify, int(cols), int(noise_token))


def history_cols(cfg) -> int:
    """token_history's columns (0 without Engram)."""
    return cfg.engram_max_ngram_size - 1 if cfg.engram_layer_ids else 0


def make_advance_spec(steps: int, to_verify: bool, noise_token: int) -> AdvanceSpec:
    _positive("steps", steps)
    if not isinstance(to_verify, bool):
        raise TypeError(f"dspark advance: to_verify must be a bool, got {to_verify!r}")
    if isinstance(noise_token, bool) or not isinstance(noise_token, (int, np.integer)) \
            or not 0 <= noise_token < 2**31:
        raise ValueError(f"dspark advance: noise_token {noise_token!r} is not a token id")
    target = "verify" if to_verify else "draft"
    return AdvanceSpec(f"dspark_advance_{target}_k{steps}_n{noise_token}", steps, to_verify,
                       int(noise_token))


def make_markov_spec(vocab: int, rank: int, steps: int) -> MarkovSpec:
    _positive("vocab", vocab), _positive("rank", rank), _positive("steps", steps)
    if rank % BF16_PER_VECTOR or rank > CTA_THREADS * BF16_PER_VECTOR:
        raise ValueError(f"dspark markov: rank {rank} must be a multiple of {BF16_PER_VECTOR} "
                         f"and at most {CTA_THREADS * BF16_PER_VECTOR}")
    if vocab >= 1 << 24:
        raise ValueError(f"dspark markov: {vocab} local columns: indices pass through f32")
    return MarkovSpec(f"dspark_markov_v{vocab}_m{rank}_k{steps}", vocab, rank, steps)


def make_aux_spec(width: int, streams: int, targets: int) -> AuxSpec:
    _positive("width", width), _positive("streams", streams), _positive("targets", targets)
    if width % BF16_PER_VECTOR:
        raise ValueError(f"dspark aux: width {width} is not a multiple of {BF16_PER_VECTOR}")
    return AuxSpec(f"dspark_aux_d{width}_s{streams}_t{targets}", width, streams, targets)


def make_accept_spec(max_block: int) -> AcceptSpec:
    return AcceptSpec(f"dspark_accept_b{_positive('max_block', max_block)}", max_block)


def make_rollback_spec(ring_rows: int, max_block: int) -> RollbackSpec:
    _positive("ring_rows", ring_rows), _positive("max_block", max_block)
    if ring_rows & (ring_rows - 1) or ring_rows < max_block + 2:
        raise ValueError(f"dspark rollback: ring_rows {ring_rows} must be a power of two >= "
                         f"max_block + 2 = {max_block + 2}")
    return RollbackSpec(f"dspark_rollback_r{ring_rows}_b{max_block}", ring_rows, max_block)


def specs_for(cfg) -> list:
    """The round's kernels for a config with DSpark stages (none without them)."""
    if not cfg.dspark_target_layer_ids:
        return []
    block = cfg.dspark_block_size + 1          # verify rows: bonus + k drafts
    return [make_aux_spec(cfg.hidden_size, cfg.hc_mult, len(cfg.dspark_target_layer_ids)),
            make_accept_spec(block),
            make_rollback_spec(1 << (block + 1).bit_length(), block),
            *(make_advance_spec(cfg.dspark_block_size, to_verify, cfg.dspark_noise_token_id)
              for to_verify in (False, True)),
            *(make_history_spec(cfg.dspark_block_size, to_verify, history_cols(cfg),
                                cfg.dspark_noise_token_id)
              for to_verify in (False, True) if history_cols(cfg))]


def markov_specs_for(cfg, tp: int) -> list[MarkovSpec]:
    if not cfg.dspark_target_layer_ids:
        return []
    return [make_markov_spec(cfg.vocab_size // tp, cfg.dspark_markov_rank,
                             cfg.dspark_block_size)]


# ---- references ------------------------------------------------------------------------------

def aux_ref(streams: np.ndarray) -> np.ndarray:
    """bf16 [R, D]: the sequential fp32 sum of the S streams times 0.25, rounded once."""
    s = np.asarray(streams).astype(np.float32)
    total = s[:, 0].copy()
    for i in range(1, s.shape[1]):
        total = total + s[:, i]
    return to_bf16(total * np.float32(1.0 / s.shape[1]))


def block_starts(seq_index: np.ndarray) -> np.ndarray:
    """int64 [R]: the first row of each row's block (-1 for padding rows)."""
    seq = np.asarray(seq_index, np.int64)
    first = np.full(seq.shape, -1, np.int64)
    for r in np.flatnonzero(seq >= 0):
        first[r] = r if r == 0 or seq[r - 1] != seq[r] else first[r - 1]
    return first


def accept_ref(token_ids, tokens, seq_index, slot_mapping, num_seqs: int):
    """(accepted int32 [S], bonus int64 [S], context_slots int64 [R]); sequences without rows
    keep accepted -1, bonus -1 here (the kernel leaves them untouched)."""
    ids, toks = np.asarray(token_ids, np.int64), np.asarray(tokens, np.int64)
    seq = np.asarray(seq_index, np.int64)
    first = block_starts(seq)
    accepted = np.full(num_seqs, -1, np.int32)
    bonus = np.full(num_seqs, -1, np.int64)
    slots = np.full(seq.shape, -1, np.int64)
    for r in np.flatnonzero(seq >= 0):
        f, a = first[r], 0
        while f + a + 1 < seq.size and seq[f + a + 1] == seq[r] and ids[f + a + 1] == toks[f + a]:
            a += 1
        if r == f:
            accepted[seq[r]], bonus[seq[r]] = a, toks[f + a]
        if r - f <= a:
            slots[r] = np.asarray(slot_mapping, np.int64)[r]
    return accepted, bonus, slots


def rollback_ref(ring: np.ndarray, positions, seq_index, state_lines, accepted) -> None:
    """NaN (in place) the ring rows of every row past its sequence's accepted count."""
    pos, seq = np.asarray(positions, np.int64), np.asarray(seq_index, np.int64)
    first = block_starts(seq)
    ring_rows = ring.shape[1]
    for r in np.flatnonzero(seq >= 0):
        if pos[r] - pos[first[r]] > accepted[seq[r]]:
            ring[state_lines[seq[r]], pos[r] % ring_rows] = np.uint32(NAN_BITS).view(np.float32)


def markov_ref(base, w1, w2, prev, step: int, steps: int, vocab_offset: int):
    """({s: (f32 bits, index)} this rank's argmax pairs, {row: token} ids written) of Markov
    step `step`; a sequence whose prev is negative (a padding sequence of the bucket) gets its
    ids row only."""
    prev = np.asarray(prev, np.int64)
    ids = {s * (steps + 1) + step: int(p) for s, p in enumerate(prev)}
    pairs = {}
    if step == steps:
        return pairs, ids
    w2 = np.asarray(w2).astype(np.float32)
    for s in np.flatnonzero(prev >= 0):
        x = np.asarray(w1[int(prev[s])]).astype(np.float32)
        acc = np.zeros(w2.shape[0], np.float32)
        for j in range(x.size):                 # exact products, one fp32 rounding per add
            acc = acc + x[j] * w2[:, j]
        logits = np.asarray(base[s * steps + step], np.float32) + acc
        local = int(np.argmax(logits))
        pairs[int(s)] = (int(logits[local:local + 1].view(np.int32)[0]), local + vocab_offset)
    return pairs, ids


def advance_ref(spec: AdvanceSpec, rows: dict, state_lines, accepted, bonus,
                ring_slots: int, seqs: int) -> None:
    """Rewrite (in place) the row arrays of `rows` (token_ids, positions, seq_index,
    slot_mapping, block_kind, context_lens) for the next step, sequence slots 0..seqs-1."""
    k, width = spec.steps, spec.width
    for s in range(seqs):
        mine = slice(s * width, (s + 1) * width)
        if bonus[s] < 0:
            rows["token_ids"][mine] = 0
            rows["positions"][mine] = 0
            rows["seq_index"][mine] = -1
            rows["slot_mapping"][mine] = -1
            rows["block_kind"][mine] = KIND_DECODE
            rows["context_lens"][s] = 0
            continue
        start = int(rows["context_lens"][s]) - k + (0 if spec.to_verify else int(accepted[s]))
        pos = np.arange(start, start + width, dtype=np.int64)
        rows["positions"][mine] = pos
        rows["seq_index"][mine] = s
        rows["slot_mapping"][mine] = np.int64(state_lines[s]) * ring_slots + pos % ring_slots
        rows["block_kind"][mine] = spec.kind
        if not spec.to_verify:
            rows["token_ids"][mine] = [bonus[s]] + [spec.noise_token] * (k - 1)
        rows["context_lens"][s] = start + width


def history_ref(spec: HistorySpec, token_ids, token_history, accepted, bonus,
                seqs: int) -> None:
    """What the history kernel writes, in place, into token_history [R, cols]: the next step's
    lookback, sequence slots 0..seqs-1, those with bonus < 0 skipped."""
    k, c = spec.steps, spec.cols
    ids = np.asarray(token_ids, np.int64).copy()       # every read sees the step's values
    hist = np.asarray(token_history, np.int64).copy()
    for s in range(seqs):
        if bonus[s] < 0:
            continue
        if spec.to_verify:
            f, src = s * (k + 1), s * k
            block = ids[f:f + k + 1]
            for j in range(k + 1):
                token_history[f + j] = [block[j - 1 - m] if j > m else hist[src, m - j]
                                        for m in range(c)]
            continue
        f, a = s * (k + 1), int(accepted[s])
        tail = [ids[f + a - m] if a >= m else hist[f, m - a - 1] for m in range(c)]
        block = [int(bonus[s])] + [spec.noise_token] * (k - 1)
        for j in range(k):
            token_history[s * k + j] = [block[j - 1 - m] if j > m else tail[m - j]
                                        for m in range(c)]
