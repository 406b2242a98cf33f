"""W8A16 dense linears: specs, grid/workspace rules, byte formula and the NumPy reference (no DSL).

    y[r, g, n] = sum_k x[r, g, k] * W[g, n, k],   W = e4m3(w) * 2^(s[g, n/32, k/32] - 127)

x is BF16 [rows, G*K], w is FP8 E4M3 [G, N, K] (row-major, the checkpoint layout), s is UE8M0
[G, N/32, K/32] (the checkpoint's 32x32 block scales, not vLLM's per-row repeat), fp32
accumulation. G = 1 for every plain linear; `wo_a` is the grouped case G = o_groups per rank
(`kernels/wo_a_ref.py`). Epilogues (one rounding each, at the end, as `w8a16_linear` + `to_bf16`):
  "bf16"      out = bf16(y)                          [rows, G*N] bf16
  "f32"       out = y                                [rows, G*N] f32 (input of the all-reduce)
  "residual"  out = bf16(y + float(residual))        [rows, G*N] bf16, residual bf16
  "swiglu"    out = bf16(SwiGLU(bf16(y_gate), bf16(y_up)))  [rows, N/2] bf16 (G = 1): the shared
              expert's w1|w3 with its activation, `moe_ref.shared_expert`'s two roundings; the
              weight rows are interleaved by 8 (`interleave_gate_up`: tile t = gate rows 8t..8t+7,
              then up rows 8t..8t+7, so one thread holds a gate and its up), the scales stay the
              checkpoint's [w1; w3] blocks [N/32, K/32]
  "add_f32"   out = bf16(float(bf16(y)) + residual)  [rows, G*N] bf16, residual f32: the shared
              expert's w2 plus the routed sum (F4: bf16(routed + bf16(shared)), moe_ref)

PTX ABI: (u64 x, u64 weight, u64 scales, u64 residual, u64 out, u64 workspace, u64 counters,
u32 rows). `residual` is read only by the residual epilogue, `workspace`/`counters` only when
split_k > 1; pass any valid pointer otherwise. `counters` (u32 [max_passes, tiles]) must be zero
when the executor binds it; the kernel leaves it zero again after every launch.

How the kernel computes (kernels/dense.py has the details): a warp owns 16 weight rows (one
mma.sync m16n8k16 A tile) and walks K in 64-element chunks; each thread loads two 16-byte weight
vectors, turns the e4m3 bytes into exactly scaled bf16 (bit placement + one power-of-two bf16x2
multiply: exact), and multiplies them by up to 8 x rows per n8 row tile on the tensor cores with
fp32 accumulation. A CTA's warps split its K range; their fp32 partials meet in shared memory in
warp order; split_k CTAs per tile meet in the workspace, summed in slice order by the CTA that
arrives last (a counter per pass and tile): every launch and graph replay gives the same bits.
Rows beyond 8 * row_tiles run as further passes over the same weights (L2-resident for a CTA's
slice). The summation order differs from NumPy's, so tests compare within a stated bound (below)
instead of bitwise.

Constraints: N % 16 == 0 (N % 32 for the scales), K % 32 == 0, scale bytes <= 134 (effective
block scale <= 2^7; the bf16 scale factor 2^(s-7) must be finite), 1 <= rows <= MAX_ROWS.

Bytes that must move per launch: weights G*N*K + scales G*(N/32)*(K/32) + x rows*G*K*2 +
out rows*G*N*(2 or 4) (+ residual rows*G*N*2).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.common_ref import BF16, H200_NUM_SMS, ceil_div, check_rows, params_dict, to_bf16

WARP = 32
CTA_WARPS = 4                       # warps per CTA: they split the CTA's K range
TILE_N = 16                         # weight rows per warp tile (mma.sync M)
ROW_TILE = 8                        # x rows per mma (mma.sync N)
CHUNK_K = 64                        # K per warp step: 4 threads x 16 bytes of one weight row
FP8_BLOCK = 32
MAX_ROWS = 192                      # largest decode bucket
MAX_SCALE_BYTE = 134                # 2^(s - 7) must stay a finite bf16 (s + 120 <= 254)
TARGET_CTAS = 2 * H200_NUM_SMS      # split K until a launch has at least this many CTAs
EPILOGUES = ("bf16", "f32", "residual", "swiglu", "add_f32")
GATE_UP_ROWS = TILE_N // 2              # swiglu: gate rows, then as many up rows, per tile
ROW_TILE_CHOICES = (1, 4)           # 8 rows per pass (decode, DSpark), 32 rows per pass (R > 8)
# register-prefetch mma kernel; smem-streamed kernels (R <= 8): "stream" (measured in round 3),
# "stream_xt" (x several units ahead, 2 accumulators, scales first, whole tiles per CTA: no tile
# shared between CTAs, no workspace, no fence, no atomic), "stream_xts" (stream_xt with the scale
# bytes cp.async'ed first, in their own commit group, instead of LDG + STS: round 5),
# "stream_xtb" (stream_xts whose weights arrive by a few multi-KB cp.async.bulk copies per tile
# on one mbarrier per tile, in the checkpoint layout: round 5). Round 4's "stream_x" (stream_xt
# with units split across CTAs) lost everywhere and is gone (round 5).
# Round 7: "stream_xtu" (kernels/dense_tile.py) is stream_xtb with one unit per tile and the tile's
# chunks unrolled at compile time: no per-unit index arithmetic or branch, x resident in registers
# (B fragments, loaded once per CTA) where K allows, else X_AHEAD chunks ahead, two accumulators.
# "stream_xtw" is stream_xtu with WIDE_WARPS warps a CTA: the multiply is issue-bound with 2 warps
# per SM sub-partition issuing ~60% of the cycles; 4 per sub-partition hide more of the latency.
# "stream_xtup" / "stream_xtwp": the same with every weight row of a tile slot padded by ROW_PAD
# bytes (one bulk copy a row): K % 128 == 0 puts rows g = 0..7 on the same banks, so a warp's
# 16-byte read (a quarter warp = rows g, g+1 x 64 bytes) takes 8 wavefronts instead of 4; rows
# 64 bytes apart mod 128 put g and g+1 on disjoint banks.
VARIANTS = ("mma", "stream", "stream_xt", "stream_xts", "stream_xtb", "stream_xtu", "stream_xtw",
            "stream_xtup", "stream_xtwp")
STREAM_VARIANTS = VARIANTS[1:]
VARIANT_TAGS = {"mma": "mma", "stream": "s", "stream_xt": "sxt", "stream_xts": "sxts",
                "stream_xtb": "sxtb", "stream_xtu": "sxtu",
                "stream_xtw": "sxtw", "stream_xtup": "sxtup", "stream_xtwp": "sxtwp"}
TILE_VARIANTS = ("stream_xtu", "stream_xtw", "stream_xtup", "stream_xtwp")  # a unit per tile
WIDE_VARIANTS = ("stream_xtw", "stream_xtwp")       # WIDE_WARPS warps
PADDED_VARIANTS = ("stream_xtup", "stream_xtwp")    # rows ROW_PAD bytes apart in smem
WHOLE_TILE_VARIANTS = ("stream_xt", "stream_xts", "stream_xtb", *TILE_VARIANTS)
BULK_PIECE_MAX = 8192               # stream_xtb: bytes per cp.async.bulk (whole weight rows)
BULK_MBARRIERS = 8                  # stream_xtb: mbarrier slots (one per tile of the CTA)
X_RESIDENT_WORDS = 32               # stream_xtu: x of the whole K in registers up to this (K <= 2048)
X_AHEAD = 4                         # stream_xtu: else x loads run this many chunks ahead
X_AHEAD_WIDE = 2                    # stream_xtw (4 warps per sub-partition hide the rest; at 4
                                    # wq_a|wkv took 70 registers, over the 64 of 2 CTAs a SM)
STREAM_WARPS = 8                    # warps of the streamed kernel
WIDE_WARPS = 16                     # ... of stream_xtw (2 CTAs a SM: <= 64 registers)
ROW_PAD = 64                        # stream_xtup / xtwp: extra bytes after each weight row
STREAM_X_REGS = 64                  # x ring registers per thread of stream_x / stream_xt ...
STREAM_X_SLOTS = 6                  # ... and units (8 slots of 1 chunk took ptxas to 128 regs)
STREAM_MAX_UNIT_K = 1024            # K bytes per streamed unit (16 rows x unit_k per stage)
STREAM_SMEM_BUDGET = 104 * 1024     # two CTAs per SM: the next PDL kernel streams beside this one
# Timeline variant (DenseSpec.timeline, name suffix "_timeline"; whole-tile variants only, where the
# workspace is otherwise unused): thread 0 of every CTA writes u64 [ctas, TIMELINE_WORDS] into the
# workspace: words 2p, 2p + 1 = %globaltimer (ns), %clock64 at point p (one 16-byte store), word
# 2 * len(POINTS) = %smid. The production kernels compile without a stamp (cubins unchanged).
TIMELINE_POINTS = ("entry", "issued", "before_wait", "after_wait", "first_landed", "last_landed",
                   "epilogue", "exit")
TIMELINE_WORDS = 32                 # 2 * 8 + 1 used; a 256-byte row per CTA
TIMELINE_LABELS = ("wqa_wkv", "wq_b", "wo_b")   # the step's attention linears (round 6)
PARAMS = (("x", "u64"), ("weight", "u64"), ("scales", "u64"), ("residual", "u64"),
          ("out", "u64"), ("workspace", "u64"), ("counters", "u64"), ("rows", "u32"))


def choose_split_k(tiles: int, k: int) -> int:
    """CTAs per weight tile: enough CTAs to cover the SMs twice, each warp >= 2 chunks of K."""
    chunks = ceil_div(k, CHUNK_K)
    split = max(1, ceil_div(TARGET_CTAS, tiles))
    return max(1, min(split, chunks // (2 * CTA_WARPS)))


@dataclass(frozen=True)
class DenseSpec:
    """One compiled W8A16 linear: shape, group count, rows per pass, epilogue, K split."""

    name: str
    n: int                                  # output features per group
    k: int                                  # input features per group
    groups: int = 1
    row_tiles: int = 1                      # n8 row tiles per pass: 8 * row_tiles rows
    epilogue: str = "bf16"
    split_k: int = 1
    variant: str = "mma"
    unit_k: int = 0                         # stream: K bytes per unit (one smem stage)
    ctas: int = 0                           # stream: grid size (one wave)
    stages: int = 0                         # stream: smem ring depth
    swiglu_limit: float = 0.0               # "swiglu" epilogue: the clamp L
    timeline: bool = False                  # per-CTA stamps into the workspace (TIMELINE_POINTS)

    @property
    def params(self) -> tuple[tuple[str, str], ...]:
        return PARAMS

    @property
    def block(self) -> tuple[int, int, int]:
        return ((self.warps if self.streamed else CTA_WARPS) * WARP, 1, 1)

    @property
    def warps(self) -> int:
        """Warps of a streamed CTA: STREAM_WARPS, WIDE_WARPS for stream_xtw."""
        return WIDE_WARPS if self.variant in WIDE_VARIANTS else STREAM_WARPS

    @property
    def streamed(self) -> bool:
        return self.variant in STREAM_VARIANTS

    @property
    def whole_tiles(self) -> bool:
        """stream_xt(s): CTA c owns tiles [T*c/C, T*(c+1)/C) whole (units of one tile never split)."""
        return self.variant in WHOLE_TILE_VARIANTS

    @property
    def async_scales(self) -> bool:
        """stream_xts / xtb: the scale window arrives by 4-byte cp.async (K % 128 == 0) in the
        first commit group, not by plain loads stored after the weights' copies are issued."""
        return self.variant in ("stream_xts", "stream_xtb", *TILE_VARIANTS)

    @property
    def bulk(self) -> bool:
        """stream_xtb: tile slot i of the ring holds the CTA's i-th tile as stored (16 rows x K),
        fetched by `bulk_pieces` copies of `bulk_rows` rows counted on mbarrier i."""
        return self.variant in ("stream_xtb", *TILE_VARIANTS)

    @property
    def unrolled(self) -> bool:
        """stream_xtu / xtw: one unit per tile (unit_k = K), the tile's chunks unrolled."""
        return self.variant in TILE_VARIANTS

    @property
    def x_ahead(self) -> int:
        """stream_xtu / xtw without resident x: chunks of x in flight ahead of the multiply."""
        return X_AHEAD_WIDE if self.variant in WIDE_VARIANTS else X_AHEAD

    @property
    def row_stride(self) -> int:
        """Bytes between a tile slot's weight rows in smem: K, or K + ROW_PAD (padded)."""
        return self.k + (ROW_PAD if self.variant in PADDED_VARIANTS else 0)

    @property
    def x_resident(self) -> bool:
        """stream_xtu: every chunk's x (8 words a chunk this warp owns) loaded once per CTA and
        reused by all its tiles; needs one group (x is the same for every tile)."""
        return (self.unrolled and self.groups == 1
                and 8 * ceil_div(ceil_div(self.k, CHUNK_K), self.warps) <= X_RESIDENT_WORDS)

    @property
    def bulk_rows(self) -> int:
        """Weight rows per bulk copy: the largest power of two with rows * K <= BULK_PIECE_MAX
        (padded rows: one a copy)."""
        rows = 1
        if self.variant in PADDED_VARIANTS:
            return rows
        while rows * 2 <= TILE_N and rows * 2 * self.k <= BULK_PIECE_MAX:
            rows *= 2
        return rows

    @property
    def x_slots(self) -> int:
        """Units of x in flight per thread (register ring): 2 for "stream", else as many as
        STREAM_X_REGS holds (8 words per 64-K chunk a warp owns), at most STREAM_X_SLOTS and the
        CTA's units. Registers then stay <= 128 (two CTAs per SM): 94-118 at v41 TP4."""
        if self.variant == "stream":
            return 2
        per_chunk = 8 * ceil_div(self.chunks, STREAM_WARPS)
        return max(2, min(self.units_per_cta, STREAM_X_REGS // per_chunk, STREAM_X_SLOTS))

    @property
    def accumulators(self) -> int:
        """fp32 accumulator sets per warp (alternate mma steps: half the dependent chain). One
        where a warp owns 2 chunks per unit: two sets beside a 3-unit x ring took 127-128
        registers (ptxas), at the 128 that two CTAs per SM (this kernel and the next) allow."""
        if self.variant == "stream" or (ceil_div(self.chunks, STREAM_WARPS) > 1
                                         and not self.unrolled):
            return 1
        return 2

    @property
    def tiles_per_cta(self) -> int:
        return self.units_per_cta // self.ksteps

    @property
    def units_per_cta(self) -> int:
        return max(u1 - u0 for u0, u1 in map(self.unit_range, range(self.ctas)))

    @property
    def tiles(self) -> int:
        return self.groups * self.n // TILE_N

    # ---- the streamed variant's work split (the kernel computes the same integers) ----------
    @property
    def ksteps(self) -> int:
        return self.k // self.unit_k

    @property
    def units(self) -> int:
        """Work units (tile, K step) in tile-major order; CTA c owns a contiguous range."""
        return self.tiles * self.ksteps

    @property
    def chunks(self) -> int:
        return ceil_div(self.unit_k, CHUNK_K)

    @property
    def stage_bytes(self) -> int:
        """A unit in smem: per 64-byte chunk, [row half g / g+8][lane] x 16 B (1 KB); a tile
        variant's unit is the tile slot, TILE_N rows of row_stride bytes."""
        if self.unrolled:
            return TILE_N * self.row_stride
        return self.chunks * TILE_N * CHUNK_K

    def unit_range(self, cta: int) -> tuple[int, int]:
        if self.whole_tiles:
            t0, t1 = self.tiles * cta // self.ctas, self.tiles * (cta + 1) // self.ctas
            return t0 * self.ksteps, t1 * self.ksteps
        return self.units * cta // self.ctas, self.units * (cta + 1) // self.ctas

    def cta_of_unit(self, unit: int) -> int:
        if self.whole_tiles:
            return ((unit // self.ksteps + 1) * self.ctas - 1) // self.tiles
        return ((unit + 1) * self.ctas - 1) // self.units

    @property
    def tiles_per_scale_row(self) -> int:
        """Tiles per 32-row scale block: 2, or 4 with "swiglu" (8 gate + 8 up rows a tile)."""
        return 4 if self.epilogue == "swiglu" else 2

    def scale_half(self) -> int:
        """Largest run of scale bytes (whole 32-row scale blocks) one CTA's units touch; with
        "swiglu" that of its gate rows (its up rows' run follows at this offset in smem)."""
        kg, most, per = self.k // FP8_BLOCK, 0, self.tiles_per_scale_row
        for c in range(self.ctas):
            u0, u1 = self.unit_range(c)
            t0, t1 = u0 // self.ksteps, (u1 - 1) // self.ksteps
            most = max(most, (t1 // per - t0 // per + 1) * kg)
        return -(-most // 16) * 16 if self.epilogue == "swiglu" else most

    def scale_window(self) -> int:
        """Scale bytes of the CTA's smem window: one run, or gate + up runs with "swiglu"."""
        return self.scale_half() * (2 if self.epilogue == "swiglu" else 1)

    @property
    def rows_per_pass(self) -> int:
        return ROW_TILE * self.row_tiles

    @property
    def max_passes(self) -> int:
        return ceil_div(MAX_ROWS, self.rows_per_pass)

    @property
    def smem_bytes(self) -> int:
        if self.streamed:
            # ring + scale window + warp partials + flag + alignment slack
            return (self.stages * self.stage_bytes + ceil_div(self.scale_window(), 16) * 16
                    + self.warps * TILE_N * ROW_TILE * 4 + 16 + 256
                    + (8 * BULK_MBARRIERS if self.bulk else 0))
        # fp32 partial per warp x row tile x 128 accumulators, plus the last-arrival flag.
        return CTA_WARPS * self.row_tiles * TILE_N * ROW_TILE * 4 + 16

    @property
    def out_dtype(self) -> str:
        return "f32" if self.epilogue == "f32" else "bf16"

    @property
    def out_width(self) -> int:
        """Columns of `out`: G*N, or N/2 with "swiglu" (one per gate / up pair)."""
        return self.n // 2 if self.epilogue == "swiglu" else self.groups * self.n

    def grid(self, rows: int) -> tuple[int, int, int]:
        check_rows(rows, self.name)
        if rows > MAX_ROWS:
            raise ValueError(f"{self.name}: rows={rows} exceeds MAX_ROWS={MAX_ROWS}")
        if self.streamed:
            if rows > ROW_TILE:
                raise ValueError(f"{self.name}: the streamed kernel takes rows <= {ROW_TILE}, got "
                                 f"{rows} (use the r32 mma kernel)")
            return (self.ctas, 1, 1)
        return (self.tiles * self.split_k, 1, 1)

    def passes(self, rows: int) -> int:
        return ceil_div(check_rows(rows, self.name), self.rows_per_pass)

    def workspace_bytes(self) -> int:
        """mma: fp32 [max_passes, split_k, tiles, 128 * row_tiles], 0 without a K split;
        stream: fp32 [ctas, 2, 128] (a CTA's first and last tile, when other CTAs share them);
        stream_xt: 0 (no tile is shared); timeline: the stamps, u64 [ctas, TIMELINE_WORDS]."""
        if self.timeline:
            return self.ctas * TIMELINE_WORDS * 8
        if self.whole_tiles:
            return 0
        if self.streamed:
            return self.ctas * 2 * TILE_N * ROW_TILE * 4
        if self.split_k == 1:
            return 0
        return self.max_passes * self.split_k * self.tiles * TILE_N * self.rows_per_pass * 4

    def counters_bytes(self) -> int:
        """u32 [max_passes, tiles] (stream: [tiles]), zeroed at bind time; 0 without a split."""
        if self.whole_tiles:
            return 0
        if self.streamed:
            return self.tiles * 4
        return 0 if self.split_k == 1 else self.max_passes * self.tiles * 4

    def weight_bytes(self) -> int:
        return self.groups * (self.n * self.k + (self.n // FP8_BLOCK) * (self.k // FP8_BLOCK))

    def bytes_moved(self, rows: int) -> int:
        out_bytes = 4 if self.out_dtype == "f32" else 2
        extra = rows * self.groups * self.n * {"residual": 2, "add_f32": 4}.get(self.epilogue, 0)
        return (self.weight_bytes() + rows * self.groups * self.k * 2
                + rows * self.out_width * out_bytes + extra)

    def to_dict(self) -> dict:
        return {"family": "dense", "name": self.name, "n": self.n, "k": self.k,
                "groups": self.groups, "row_tiles": self.row_tiles, "epilogue": self.epilogue,
                "split_k": self.split_k, "variant": self.variant, "unit_k": self.unit_k,
                "ctas": self.ctas, "stages": self.stages, "swiglu_limit": self.swiglu_limit,
                "params": params_dict(self.params),
                "block": list(self.block), "smem_bytes": self.smem_bytes, "tiles": self.tiles,
                "max_passes": self.max_passes} | ({"timeline": True} if self.timeline else {})

    @classmethod
    def from_dict(cls, d: dict) -> DenseSpec:
        """The spec a manifest records (`to_dict` output)."""
        return cls(d["name"], d["n"], d["k"], d["groups"], d["row_tiles"], d["epilogue"],
                   d["split_k"], d.get("variant", "mma"), d.get("unit_k", 0), d.get("ctas", 0),
                   d.get("stages", 0), d.get("swiglu_limit", 0.0), d.get("timeline", False))


def choose_stream_unit_k(tiles: int, k: int) -> int:
    """K bytes per streamed unit: best (units balanced over <= 132 CTAs, one wave) x sqrt(the 8
    consumer warps' share of 64-byte chunks), then the larger unit (fewer barriers)."""
    def score(unit_k: int) -> tuple[float, int]:
        units = tiles * (k // unit_k)
        ctas = min(H200_NUM_SMS, units)
        balance = units / (ctas * ceil_div(units, ctas))
        chunks = ceil_div(unit_k, CHUNK_K)
        fill = chunks / (STREAM_WARPS * ceil_div(chunks, STREAM_WARPS))
        return (round(balance * fill**0.5, 3), unit_k)
    cands = [d for d in range(FP8_BLOCK, min(k, STREAM_MAX_UNIT_K) + 1, FP8_BLOCK)
             if k % d == 0 and (d % CHUNK_K == 0 or d == k)]
    if not cands:
        raise ValueError(f"K={k}: no unit of <= {STREAM_MAX_UNIT_K} bytes divides it")
    return max(cands, key=score)


def stream_layout(tiles: int, k: int, whole_tiles: bool = False,
                  unit_k: int = 0) -> tuple[int, int, int]:
    """(unit_k, ctas, stages) of the streamed kernel: the whole CTA slice in the ring when it
    fits the smem budget (every weight byte in flight before griddepcontrol.wait), else a ring.
    whole_tiles: one CTA per tile up to 132, then [T*c/C, T*(c+1)/C) tiles each. unit_k: the
    choice of `choose_stream_unit_k` unless given (a candidate's)."""
    unit_k = unit_k or choose_stream_unit_k(tiles, k)
    units = tiles * (k // unit_k)
    ctas = min(H200_NUM_SMS, tiles if whole_tiles else units)
    probe = DenseSpec("probe", TILE_N, k, 1, 1, "bf16", 1, "stream", unit_k, 1, 1)
    fixed = probe.smem_bytes - probe.stage_bytes + k // FP8_BLOCK * 8
    per_cta = ceil_div(tiles, ctas) * (k // unit_k) if whole_tiles else ceil_div(units, ctas)
    stages = min(per_cta, (STREAM_SMEM_BUDGET - fixed) // probe.stage_bytes)
    if stages < min(2, per_cta):
        raise ValueError(f"K={k}: a {unit_k}-byte unit leaves room for {stages} smem stages")
    return unit_k, ctas, stages


def make_spec(label: str, n: int, k: int, *, groups: int = 1, row_tiles: int = 1,
              epilogue: str = "bf16", prefix: str = "dense_w8a16",
              variant: str | None = None, swiglu_limit: float = 0.0,
              timeline: bool = False, unit_k: int = 0) -> DenseSpec:
    """Validated spec; the name carries every compile-time choice. The step's kernel
    (`default_variant`) has the plain name, another variant the suffix `_<VARIANT_TAGS>`, a
    timeline one `_timeline` after that (never picked by the step: executor/launches/dense.py).
    unit_k (streamed only): K bytes per unit instead of `choose_stream_unit_k`'s, suffix `_u<K>`
    before `_timeline`."""
    default = default_variant(label, row_tiles)
    if default in ("stream_xts", "stream_xtb") and k % (4 * FP8_BLOCK):
        default = "stream_xt"               # 4-byte scale copies need K % 128 == 0
    variant = variant or default
    if epilogue == "swiglu":
        swiglu_limit = float(np.float32(swiglu_limit))
        if groups != 1 or n % (2 * FP8_BLOCK) or not (np.isfinite(swiglu_limit)
                                                      and swiglu_limit > 0):
            raise ValueError(f"{label}: the swiglu epilogue needs groups 1, N % 64 == 0 and a "
                             f"finite clamp > 0; got groups {groups}, N {n}, L {swiglu_limit}")
        if variant == "stream":
            raise ValueError(f"{label}: the swiglu epilogue needs whole tiles per CTA (variant "
                             f"'stream_xt(s)' or 'mma'), got {variant!r}")
    elif swiglu_limit:
        raise ValueError(f"{label}: swiglu_limit {swiglu_limit} given to epilogue {epilogue!r}")
    if variant in ("stream_xts", "stream_xtb") and k % (4 * FP8_BLOCK):
        raise ValueError(f"{label}: variant {variant!r} copies scale rows in 4-byte pieces; "
                         f"K = {k} gives {k // FP8_BLOCK}-byte rows")
    if variant not in VARIANTS or (variant != "mma" and row_tiles != 1):
        raise ValueError(f"{label}: variant {variant!r} with row_tiles {row_tiles}; expected "
                         f"one of {VARIANTS}, streamed ones only with row_tiles 1")
    if epilogue not in EPILOGUES:
        raise ValueError(f"{label}: epilogue {epilogue!r}; expected one of {EPILOGUES}")
    if row_tiles not in ROW_TILE_CHOICES:
        raise ValueError(f"{label}: row_tiles {row_tiles}; expected one of {ROW_TILE_CHOICES}")
    if n <= 0 or n % FP8_BLOCK or k <= 0 or k % FP8_BLOCK or groups < 1:
        raise ValueError(f"{label}: N={n}, K={k}, groups={groups}: N and K must be positive "
                         f"multiples of {FP8_BLOCK}")
    split = choose_split_k(groups * n // TILE_N, k)
    name = f"{prefix}_{label}_n{n}_k{k}" + (f"_g{groups}" if groups > 1 else "")
    name += f"_r{ROW_TILE * row_tiles}_{epilogue}"
    if variant != default:
        name += f"_{VARIANT_TAGS[variant]}"
    if unit_k and (variant not in STREAM_VARIANTS or k % unit_k or unit_k % CHUNK_K):
        raise ValueError(f"{label}: unit_k {unit_k} needs a streamed variant (got {variant!r}), "
                         f"K % unit_k == 0 and unit_k % {CHUNK_K} == 0 (K = {k})")
    if variant in TILE_VARIANTS:
        if unit_k not in (0, k):
            raise ValueError(f"{label}: variant {variant!r} has one unit per tile (unit_k = "
                             f"K = {k}), got unit_k {unit_k}")
        unit_k = 0                          # no `_u` suffix: K is the variant's own unit
    step_unit = (step_unit_k(label, k) if row_tiles == 1 and variant == default
                 and variant not in TILE_VARIANTS else 0)
    name += f"_u{unit_k}" if unit_k and unit_k != step_unit else ""
    unit_k = unit_k or step_unit or (k if variant in TILE_VARIANTS else 0)
    if timeline and variant not in WHOLE_TILE_VARIANTS:
        raise ValueError(f"{label}: the timeline stamps take the workspace, which only the "
                         f"whole-tile variants {WHOLE_TILE_VARIANTS} leave free; got {variant!r}")
    name += "_timeline" if timeline else ""
    if variant == "mma":
        return DenseSpec(name, n, k, groups, row_tiles, epilogue, split,
                         swiglu_limit=swiglu_limit)
    unit_k, ctas, stages = stream_layout(groups * n // TILE_N, k, variant in WHOLE_TILE_VARIANTS,
                                         unit_k)
    spec = DenseSpec(name, n, k, groups, row_tiles, epilogue, 1, variant, unit_k, ctas, stages,
                     swiglu_limit, timeline)
    if spec.unrolled and spec.smem_bytes > STREAM_SMEM_BUDGET:     # xtw: 16 warps' partials
        raise ValueError(f"{label}: variant {variant!r} needs {spec.smem_bytes} bytes of smem, "
                         f"over the {STREAM_SMEM_BUDGET} that leave room for the next kernel")
    if spec.bulk and (stages < spec.units_per_cta or spec.tiles_per_cta > BULK_MBARRIERS
                      or unit_k % CHUNK_K):
        raise ValueError(f"{label}: variant 'stream_xtb' needs the CTA's whole slice in smem "
                         f"({stages} stages for {spec.units_per_cta} units), at most "
                         f"{BULK_MBARRIERS} tiles a CTA and 64-byte chunks (unit_k {unit_k})")
    return spec


def dense_shapes(cfg, tp: int) -> dict[str, tuple[int, int, tuple[str, ...]]]:
    """label -> (N, K, epilogues): every FP8 W8A16 linear of a decode step, per rank.

    Model doc §2.2: fused wq_a|wkv (replicated), wq_b (column parallel), wo_b (row parallel: fp32
    partials for the all-reduce), the shared expert's fused w1|w3 and w2 (row parallel), the
    indexer's wq_b (replicated), Engram wkv (column parallel since round 8: its output columns
    in row-interleaved pieces, engram_kernel_ref.kv_rank_rows), DSpark main_proj (replicated).
    The compressor projections are fp32/bf16 in the checkpoint (schema UNCERTAIN), not FP8.
    """
    rs = cfg.rank_shapes(tp)
    d = cfg.hidden_size
    row_parallel = ("bf16", "f32", "residual")
    shapes = {
        "wqa_wkv": (cfg.q_lora_rank + cfg.head_dim, d, ("bf16",)),
        "wq_b": (rs.q_b_out, cfg.q_lora_rank, ("bf16",)),
        "wo_b": (d, rs.wo_b_in, row_parallel),
        "shared_w13": (2 * rs.shared_inter, d, ("bf16", "swiglu")),
        "shared_w2": (d, rs.shared_inter, row_parallel + ("add_f32",)),
        "indexer_wq_b": (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, ("bf16",)),
        "engram_wkv": ((cfg.hc_mult + 1) * d // tp,
                       cfg.engram_num_hash_cols * cfg.engram_head_dim, ("bf16",)),
        "main_proj": (d, len(cfg.dspark_target_layer_ids) * d, ("bf16",)),
    }
    if rs.dspark_moe_inter != rs.shared_inter:
        shapes["dspark_shared_w13"] = (2 * rs.dspark_moe_inter, d, ("bf16",))
        shapes["dspark_shared_w2"] = (d, rs.dspark_moe_inter, row_parallel)
    return shapes


# Layers whose R <= 8 kernel was the streamed one after round 3: measured faster inside the PDL
# chain on the H200 (devicecheck --quick, 2026-11-29, us at R=1 / R=8, streamed vs mma):
# shared w1|w3 6.14/6.49 vs 7.07/7.42, shared w2 2.85/3.21 vs 3.46/3.59, wo_a ("grouped")
# 7.07/7.47 vs 7.58/8.12, wo_b 7.40/7.83 vs 7.70/7.73. The mma kernel stayed faster where a CTA
# walks more or smaller units: wq_a|wkv 7.74 vs 8.32, wq_b 7.00 vs 8.63, indexer wq_b 5.90 vs
# 6.44, main_proj 30.4 vs 57.2, Engram wkv 46.8 vs 51.8 (docs/notes/dense-design.md).
R8_VARIANT_ROUND3 = {"shared_w13": "stream", "shared_w2": "stream", "wo_b": "stream",
                     "grouped": "stream"}
# Round 4, measured (devicecheck --quick 15:55, PDL chain, us at R = 1 / 8, docs/notes/
# dense-design.md "Round 4"): whole tiles per CTA win everywhere but shared w2 (one K step per
# tile: nothing to save) - wq_a|wkv 7.10/7.63 (mma 7.73/8.10), wq_b 6.68/7.01 (mma 7.04/7.87),
# wo_b 5.67/6.37 (stream 7.39/7.85), wo_a 5.22/5.72 (stream 7.09/7.50), indexer wq_b 4.07/4.38
# (mma 5.90/6.16), shared w1|w3 4.25/4.95 (stream_x 6.35/6.70); shared w2 stream 2.84/3.17
# (stream_xt 2.94/3.31).
R8_VARIANT_ROUND4 = {"wqa_wkv": "stream_xt", "wq_b": "stream_xt", "wo_b": "stream_xt",
                     "grouped": "stream_xt", "indexer_wq_b": "stream_xt",
                     "shared_w13": "stream_xt", "shared_w2": "stream"}
# Round 5, measured (run r5a 18:50, PDL chain of 16, us at R = 1 / 6 / 8, bf16): stream_xtb
# (bulk copies) wins on the 8-10.5 MB layers whose CTAs own 1-3 tiles of K >= 2048 - wq_a|wkv
# 6.93/7.35/7.52 (xt 7.11/7.61/7.73), wo_b 5.53/6.02/6.12 (5.65/6.16/6.32), wo_a 5.03/5.54/5.68
# (5.25/5.64/5.80); stream_xts on the K = 1280 layers - wq_b 6.62/6.86/6.95 (6.63/6.94/7.03),
# indexer wq_b 3.97/4.17/4.31 (4.07/4.29/4.41). Shared w1|w3 keeps stream_xt (its step kernel
# has the swiglu epilogue; xts was 0.07 faster with bf16, xtb 1 us slower at R = 6-8).
R8_VARIANT_ROUND5 = {**R8_VARIANT_ROUND4, "wqa_wkv": "stream_xtb", "wo_b": "stream_xtb",
                     "grouped": "stream_xtb", "wq_b": "stream_xts", "indexer_wq_b": "stream_xts"}
# Round 7, measured (run r7c, PDL chain, us at R = 1 / 6, step kernel -> stream_xtwp, the tile
# kernel of kernels/dense_tile.py at 16 warps with padded rows): wq_a|wkv 5.39 / 5.92 -> 4.62 /
# 4.90, shared w1|w3 (swiglu) 4.39 / 4.71 -> 3.28 / 3.92, wq_b 5.42 / 5.78 -> 5.07 / 5.10. wo_b
# (xtu 4.90 vs 5.23) stays: its f32 / residual tile kernels have not run on the GPU.
R8_VARIANT_ROUND7 = {**R8_VARIANT_ROUND5, "wqa_wkv": "stream_xtwp", "shared_w13": "stream_xtwp",
                     "wq_b": "stream_xtwp"}
# Round 8: wo_b -> stream_xtu (run r7c, family PDL chain, us at R = 1 / 6, bf16: step kernel xtb
# unit 2048 5.23 / 5.61 -> xtu 4.90 / 5.11; xtup 4.90 / 5.09, a tie, so the unpadded one; xtw /
# xtwp do not build for wo_b: 16 warps' partials exceed STREAM_SMEM_BUDGET). The step's wo_b
# takes the bf16 epilogue (attn_proj, also the DSpark stages); its f32 / residual kernels are
# tile kernels now too, never run before: GPU-tested first by tests/gpu/test_dense_tile_epilogues
# .py, then by test_dense with every kernel. The xtb unit-2048 kernel stays built as the candidate
# `_sxtb_u2048` (R8_UNIT_CANDIDATES).
R8_VARIANT_ROUND8 = {**R8_VARIANT_ROUND7, "wo_b": "stream_xtu"}
R8_VARIANT = R8_VARIANT_ROUND8          # revert: = R8_VARIANT_ROUND7 (round 5: _ROUND5)
# R <= 8 candidates compiled beside the step's kernel (bf16 epilogue), so the family benchmark
# measures them side by side. Round 5: stream_xt / _xts / _xtb beside each other on the layers
# round 4 gave stream_xt (the round-4
# losers `_mma`, `_s`, `_sx` are gone from the bundle; mma and stream stay for R8_VARIANT_ROUND3).
R8_CANDIDATES: dict[str, tuple[str, ...]] = {
    label: ("stream_xt", "stream_xts", "stream_xtb") for label, v in R8_VARIANT_ROUND4.items()
    if v == "stream_xt"}
# Round 6 (the timeline, docs/notes/dense-design.md): a unit costs ~600-650 cycles after the
# wait whether it holds 1 chunk per warp (wq_a|wkv, unit 512) or 2 (wo_b, unit 1024): fewer,
# larger units. (label, variant, unit_k) beside the step's kernel, with a timeline twin.
# Round 6, measured (run r6a 21:45, PDL chain of 16, us at R = 1 / 6 / 8, step kernel -> `_u`
# candidate): wq_a|wkv xtb 512 -> 1024: 6.91/7.32/7.44 -> 6.08/6.72/6.78; wq_b xts 640 -> 1280:
# 6.57/6.67/6.79 -> 5.39/5.72/5.81; wo_b xtb 1024 -> 2048: 5.45/5.97/6.18 -> 5.23/5.53/5.72.
R8_UNIT_K_ROUND6 = {"wqa_wkv": 1024, "wq_b": 1280, "wo_b": 2048}
# Round 7: wq_a|wkv unit 2560 (2 units of 5 chunks per warp; run r6b family chain R = 1 / 6 / 8
# 5.33 / 5.97 / 6.23 us against unit 1024's 6.12 / 6.77 / 6.87). Its cubin is r6b's `_u2560`.
R8_UNIT_K_ROUND7 = {**R8_UNIT_K_ROUND6, "wqa_wkv": 2560}
R8_UNIT_K: dict[str, int] = R8_UNIT_K_ROUND7    # the step's unit_k where not the chooser's;
                                                # revert: = R8_UNIT_K_ROUND6 (round 5: {})
# Candidates beside the step's kernel (the round-5 units since the switch, to see both in one run).
R8_UNIT_CANDIDATES: dict[str, tuple[tuple[str, int], ...]] = {
    "wqa_wkv": (("stream_xtb", 512), ("stream_xtb", 1024), ("stream_xtb", 2560)),
    "wo_b": (("stream_xtb", 1024), ("stream_xtb", 2048)),
    "wq_b": (("stream_xts", 640), ("stream_xts", 1280))}


# Round 7: stream_xtu (kernels/dense_tile.py) beside the step's kernel of every layer whose step
# kernel is stream_xtb / xts (bf16 epilogue; wo_b's f32 / residual take it only when switched).
R8_TILE_LABELS = ("wqa_wkv", "wq_b", "wo_b", "grouped", "indexer_wq_b", "shared_w13")


def tile_candidates(label: str, n: int, k: int, groups: int = 1) -> list[str]:
    """TILE_VARIANTS where the layer is an R8_TILE_LABELS one, K % 128 == 0 (4-byte scale
    copies) and the CTA's tiles fit the bulk ring, but the step's own variant."""
    if label not in R8_TILE_LABELS or k % (4 * FP8_BLOCK):
        return []
    out = []
    for variant in TILE_VARIANTS:
        try:
            make_spec(label, n, k, groups=groups, variant=variant)
        except ValueError:
            continue
        if variant != default_variant(label, 1):
            out.append(variant)
    return out


def default_variant(label: str, row_tiles: int) -> str:
    return R8_VARIANT.get(label, "mma") if row_tiles == 1 else "mma"


def step_unit_k(label: str, k: int) -> int:
    """The step's R <= 8 unit_k for `label` from R8_UNIT_K (0: choose_stream_unit_k's)."""
    unit = R8_UNIT_K.get(label, 0)
    return unit if unit and k % unit == 0 else 0


def unit_candidates(label: str, k: int) -> list[tuple[str, int]]:
    """(variant, unit_k) of R8_UNIT_CANDIDATES that K allows and the step does not already use."""
    default = default_variant(label, 1)
    return [(v, u) for v, u in R8_UNIT_CANDIDATES.get(label, ())
            if k % u == 0 and (v, u) != (default, step_unit_k(label, k))]


def candidate_specs(label: str, n: int, k: int, groups: int = 1,
                    prefix: str = "dense_w8a16") -> list[DenseSpec]:
    """The R <= 8 variants of `label` other than the step's (bf16 epilogue): benchmark + test."""
    default = default_variant(label, 1)
    return ([make_spec(label, n, k, groups=groups, prefix=prefix, variant=v)
             for v in R8_CANDIDATES.get(label, ()) if v != default]
            + [make_spec(label, n, k, groups=groups, prefix=prefix, variant=v)
               for v in tile_candidates(label, n, k, groups)]
            + [make_spec(label, n, k, groups=groups, prefix=prefix, variant=v, unit_k=u)
               for v, u in unit_candidates(label, k)])


def timeline_specs(shapes: dict) -> list[DenseSpec]:
    """The step's R <= 8 kernel of each TIMELINE_LABELS layer with stamps (bf16 epilogue), where
    that kernel is a whole-tile variant (executor/dense_timeline.py measures them)."""
    out = []
    for label in TIMELINE_LABELS:
        n, k, _ = shapes[label]
        step = make_spec(label, n, k)
        if step.variant in WHOLE_TILE_VARIANTS:
            out.append(make_spec(label, n, k, variant=step.variant, timeline=True))
        out += [make_spec(label, n, k, variant=v, unit_k=u, timeline=True)
                for v, u in unit_candidates(label, k)]
        out += [make_spec(label, n, k, variant=v, timeline=True)
                for v in tile_candidates(label, n, k)]
    return out


def dense_specs(cfg, tp: int) -> list[DenseSpec]:
    """8 rows per pass (R <= 8, the step's variant) and 32 (R > 8) for every layer, the
    R <= 8 candidates (`candidate_specs`; a tile variant also with the layer's swiglu epilogue,
    so the GPU tests cover it before the step takes it) and the timeline kernels."""
    shapes = dense_shapes(cfg, tp)
    return ([make_spec(label, n, k, row_tiles=rt, epilogue=epi,
                       swiglu_limit=cfg.swiglu_limit if epi == "swiglu" else 0.0)
             for label, (n, k, epis) in shapes.items()
             for epi in epis for rt in ROW_TILE_CHOICES]
            + [s for label, (n, k, _) in shapes.items() for s in candidate_specs(label, n, k)]
            + [make_spec(label, n, k, epilogue="swiglu", swiglu_limit=cfg.swiglu_limit,
                         variant=v)
               for label, (n, k, epis) in shapes.items() if "swiglu" in epis
               for v in tile_candidates(label, n, k)]
            + timeline_specs(shapes))


# ---- reference ---------------------------------------------------------------------------------

def check_weight(w: np.ndarray, s: np.ndarray, groups: int, n: int, k: int, name: str) -> None:
    """Shapes/dtypes of one W8A16 weight as the kernel reads it (raises naming the tensor)."""
    import ml_dtypes
    want_w, want_s = (groups, n, k), (groups, n // FP8_BLOCK, k // FP8_BLOCK)
    if w.dtype != np.dtype(ml_dtypes.float8_e4m3fn) or w.shape != want_w:
        raise TypeError(f"{name}: weight must be float8_e4m3fn {want_w}, got {w.dtype} {w.shape}")
    if s.dtype != np.uint8 or s.shape != want_s:
        raise TypeError(f"{name}: scales must be uint8 (UE8M0) {want_s}, got {s.dtype} {s.shape}")
    if int(s.max(initial=0)) > MAX_SCALE_BYTE:
        raise ValueError(f"{name}: scale byte {int(s.max())} > {MAX_SCALE_BYTE} (block scale "
                         "above 2^7) is outside what the kernel represents")


def dense_f32(x: np.ndarray, w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """fp32 y [rows, G*N] = per group x_g @ W_g^T via loader.formats.w8a16_linear."""
    from loader.formats import w8a16_linear
    groups, n, k = w.shape
    check_weight(w, s, groups, n, k, "dense_f32")
    if x.ndim != 2 or x.shape[1] != groups * k or x.dtype != BF16:
        raise TypeError(f"dense_f32: x must be bf16 [rows, {groups * k}], got {x.dtype} {x.shape}")
    return np.concatenate([w8a16_linear(x[:, g * k:(g + 1) * k], w[g], s[g])
                           for g in range(groups)], axis=1).astype(np.float32)


def gate_up_order(n: int) -> np.ndarray:
    """Kernel row m of a "swiglu" weight -> its row in [w1; w3] (N rows, N/2 each): tile t holds
    gate rows 8t..8t+7, then up rows 8t..8t+7 (a thread's A rows g and g+8 are a pair)."""
    m = np.arange(n)
    tile, r = m // TILE_N, m % TILE_N
    return np.where(r < GATE_UP_ROWS, 0, n // 2) + tile * GATE_UP_ROWS + r % GATE_UP_ROWS


def interleave_gate_up(w13: np.ndarray) -> np.ndarray:
    """[w1; w3] rows [..., N, K] -> the "swiglu" kernel's row order (scales are not permuted)."""
    return np.ascontiguousarray(w13[..., gate_up_order(w13.shape[-2]), :])


def deinterleave_gate_up(w: np.ndarray) -> np.ndarray:
    """The inverse of `interleave_gate_up`."""
    out = np.empty_like(w)
    out[..., gate_up_order(w.shape[-2]), :] = w
    return out


def dense_ref(spec: DenseSpec, x: np.ndarray, w: np.ndarray, s: np.ndarray,
              residual: np.ndarray | None = None) -> np.ndarray:
    """What the kernel writes, up to fp32 summation order: bf16 or f32 [rows, out_width].
    `w` is in the kernel's row order ("swiglu": `interleave_gate_up`), `s` in the checkpoint's."""
    from kernels.moe_ref import swiglu_clamped
    if spec.epilogue == "swiglu":
        h13 = to_bf16(dense_f32(x, deinterleave_gate_up(w), s))
        half = spec.n // 2
        return to_bf16(swiglu_clamped(h13[:, :half], h13[:, half:], spec.swiglu_limit))
    y = dense_f32(x, w, s)
    if spec.epilogue == "f32":
        return y
    if spec.epilogue in ("residual", "add_f32"):
        dtype = BF16 if spec.epilogue == "residual" else np.float32
        if residual is None or residual.shape != y.shape or residual.dtype != dtype:
            raise TypeError(f"{spec.name}: residual must be {np.dtype(dtype).name} {y.shape}")
        if spec.epilogue == "add_f32":          # F4: bf16(routed + bf16(shared))
            y = to_bf16(y).astype(np.float32)
        y = y + residual.astype(np.float32)
    return to_bf16(y)


def dense_tolerance(x: np.ndarray, w_f32: np.ndarray, out_dtype: str) -> np.ndarray:
    """Per-element bound |kernel - exact| for y = x @ W^T, groups already folded into w_f32.

    - fp32 accumulation in any order: |error| <= (K - 1) * 2^-24 * sum_k |x_k * W_nk| (the
      classical recursive-summation bound, gamma_K; tensor-core accumulation keeps at least fp32's
      24 bits per addition, a factor 2 of margin covers its truncating adds);
    - a bf16 output adds one rounding: <= 2^-8 * |y| (half an ulp of an 8-bit significand).
    """
    k = x.shape[1]
    abs_sum = np.abs(x.astype(np.float64)) @ np.abs(w_f32.astype(np.float64)).T
    bound = 2.0 * (k - 1) * 2.0**-24 * abs_sum
    if out_dtype == "bf16":
        exact = x.astype(np.float64) @ w_f32.astype(np.float64).T
        bound = bound + 2.0**-8 * np.abs(exact) + 2.0**-133   # + the smallest bf16 subnormal
    return bound


def epilogue_expectation(spec: DenseSpec, exact: np.ndarray, acc_bound: np.ndarray,
                         residual: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(value, per-element bound) a kernel's output is checked against, from the float64 product
    `exact` = x·Wᵀ [rows, G*N] (rows in the checkpoint's order: [w1; w3] for "swiglu") and its
    fp32 summation bound `acc_bound` (dense_tolerance's first term).

    A bf16 rounding of y adds 2^-8 |y| (half an ulp of an 8-bit significand); "add_f32" rounds
    y to bf16, adds the f32 residual (2^-24 relative) and rounds again; "swiglu" rounds gate and up (each then
    within dy of exact), applies silu(min(g, L)) * clip(u, -L, L) (|silu'| <= 1.1, clamps are
    1-Lipschitz: |dh| <= 1.1 dg (|u| + du) + |silu(g)| du; ex2.approx + div add < 2^-20
    relative) and rounds h to bf16 (2^-8 relative).
    """
    tiny = 2.0**-133                                       # the smallest bf16 subnormal
    dy = acc_bound + 2.0**-8 * (np.abs(exact) + acc_bound) + tiny   # |bf16(y) - y|
    if spec.epilogue == "f32":
        return exact, acc_bound
    if spec.epilogue in ("bf16", "residual"):
        want = exact + (residual.astype(np.float64) if spec.epilogue == "residual" else 0.0)
        return want, acc_bound + 2.0**-8 * np.abs(want) + tiny
    if spec.epilogue == "add_f32":
        want = exact + residual.astype(np.float64)          # + the f32 add's own rounding
        return want, dy + (2.0**-8 + 2.0**-24) * (np.abs(want) + dy) + tiny
    half, lim = spec.n // 2, spec.swiglu_limit
    gate, up = np.minimum(exact[:, :half], lim), np.clip(exact[:, half:], -lim, lim)
    dg, du = dy[:, :half], dy[:, half:]
    silu = gate / (1.0 + np.exp(-gate))
    err = 1.1 * dg * (np.abs(up) + du) + np.abs(silu) * du
    err = err + 2.0**-20 * (np.abs(silu) + 1.1 * dg) * (np.abs(up) + du)
    want = silu * up
    return want, err + 2.0**-8 * (np.abs(want) + err) + tiny


def random_e4m3(rng: np.random.Generator, shape) -> np.ndarray:
    """Uniform random E4M3 bytes over every finite code (zeros and subnormals included)."""
    import ml_dtypes
    raw = rng.integers(0, 256, size=shape, dtype=np.uint8)
    raw = np.where((raw & 0x7F) == 0x7F, raw & 0xF0, raw).astype(np.uint8)   # no NaN bytes
    return raw.view(ml_dtypes.float8_e4m3fn)
