"""The indexer's launches (prep, scores, top-k, candidate blocks) from device addresses of any arena.

One index-source layer's indexer is three or four launches (kernels/indexer_kernel_ref.py):

    prep     q, w_raw, positions, seq_index (+ cands)  ->  qfrag, qscale, qw, plan
    scores   qfrag, qscale, qw, plan, keys, block_tables (+ cands), seq_index  ->  scores
    top-k    scores, positions, seq_index (+ cands)  ->  topk (and blocks_out)

Buffers by pointer name (R = launch rows <= shape.max_rows, nh = shape.heads, t = padded nh / 8,
E = shape.max_entries, P = shape.pages_per_seq); rows are the first R of each buffer:

    read     q             bf16 [R, nh, 128]       index query after RoPE
             w_raw         bf16 [R, nh]            weights_proj output (scaled by weight_scale)
             positions     i32 [R]                 row r sees (p + 1) // ratio entries
             seq_index     i32 [R]                 -1: padding row; a sequence's rows adjacent and
                                                   its id < R (the dense plan is indexed by it)
             cands         i32 [R, num_blocks]     read in candidates mode only (ascending, -1
                                                   tail: the candidate source's blocks_out); dense
                                                   launches pass it undereferenced
             keys          u8 [pages * page, 132]  index key records (the KV caches' index_keys)
             block_tables  i32 [max_seqs, P]       page of entry e of sequence s: [s, e // page]
    scratch  qfrag         u8 [R, t, 4, 32, 8]     prep -> scores (written for every row)
             qscale        f32 [R, t, 4, 4, 2]
             qw            f32 [R, t, 4, 2]
             plan          i32 [plan_words(R)]
             scores        f32 [R, E]              written at the entries each row's unit scans;
                                                   top-k reads only visible (candidate) entries
    written  topk          i32 [R, topk]           every row (-1 padded)
             blocks_out    i32 [R, num_blocks]     candidate source only

`requests(shape)` is the (name, nbytes, comment) list of the scratch and outputs an arena needs;
`indexer_launches` the step's launch list; `cluster_topk_launch` one cluster top-k launch (the
measured winner for the reindex layers' top-k at R <= 6, docs/perf.md run 17).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from executor.launch import LaunchSpec
from kernels import indexer_kernel_ref as ik

SCRATCH = ("qfrag", "qscale", "qw", "plan", "scores")


@dataclass(frozen=True)
class IndexerShape:
    """What one chain is sized for: the layer kind and the step's maxima."""

    heads: int
    ratio: int
    mode: str                  # "dense" | "candidates"
    topk: int
    num_blocks: int            # candidate blocks per row (candidate source / consumers)
    block_size: int
    page_size: int
    max_rows: int
    max_seqs: int
    max_entries: int           # per sequence: the scores row stride (ld)
    candidate_source: bool = False

    @classmethod
    def for_layer(cls, cfg, layer, page_size: int, max_rows: int, max_seqs: int,
                  max_entries: int) -> IndexerShape:
        """The shape of an index-source layer of a ModelConfig (as kernels.indexer.specs builds
        its kernels); max_entries: the scores row stride, >= every row's visible entries."""
        if not layer.has_indexer:
            raise ValueError(f"layer {layer.index} has no indexer")
        return cls(cfg.index_n_heads, layer.ratio,
                   "candidates" if layer.uses_candidates else "dense", cfg.index_topk,
                   cfg.candidate_topk_blocks, cfg.candidate_block_size, page_size, max_rows,
                   max_seqs, max_entries, candidate_source=layer.is_candidate_source)

    @property
    def pages_per_seq(self) -> int:
        return ik.ceil_div(self.max_entries, self.page_size)

    @property
    def tiles(self) -> int:
        return ik.padded_heads(self.heads) // ik.HEADS_PER_TILE


def default_specs(shape: IndexerShape) -> dict[str, ik.IndexerSpec]:
    """prep, scores, topk (+ blocks on the candidate source): the default chain's kernels."""
    s = shape
    topk_mode = "candidates" if s.mode == "candidates" else "entries"
    specs = {"prep": ik.make_prep_spec(s.heads, s.mode, s.ratio, s.page_size),
             "scores": ik.make_scores_spec(s.heads, s.mode, s.ratio, s.page_size),
             "topk": ik.make_topk_spec(topk_mode, s.topk, s.ratio, s.block_size)}
    if s.candidate_source:
        specs["blocks"] = ik.make_topk_spec("blocks", s.num_blocks, s.ratio, s.block_size)
    return specs


def cluster_specs(shape: IndexerShape) -> dict[str, ik.IndexerSpec]:
    """The cluster top-k kernels of the layer: topkc (entries or candidates), and on the
    candidate source blocksc (blocks alone) and bothc (entries and blocks from one read)."""
    s = shape
    if s.mode == "candidates":
        return {"topkc": ik.make_topk_cluster_spec("candidates", s.topk, s.ratio, s.block_size)}
    specs = {"topkc": ik.make_topk_cluster_spec("entries", s.topk, s.ratio, s.block_size)}
    if s.candidate_source:
        specs["blocksc"] = ik.make_topk_cluster_spec("blocks", s.num_blocks, s.ratio,
                                                     s.block_size)
        specs["bothc"] = ik.make_topk_cluster_spec("both", s.topk, s.ratio, s.block_size,
                                                   s.num_blocks)
    return specs


def buffers(shape: IndexerShape) -> dict[str, tuple[int, str]]:
    """Every buffer of the launches, by pointer name: (bytes at shape.max_rows, comment)."""
    s = shape
    r, t, nh = s.max_rows, s.tiles, s.heads
    pages = s.max_seqs * s.pages_per_seq
    return {
        "q": (2 * r * nh * ik.INDEX_DIM, f"bf16 [{r}, {nh}, 128]"),
        "w_raw": (2 * r * nh, f"bf16 [{r}, {nh}]"),
        "positions": (4 * r, f"i32 [{r}]"),
        "seq_index": (4 * r, f"i32 [{r}]"),
        "cands": (4 * r * s.num_blocks, "i32 [R, blocks] in"),
        "qfrag": (4 * r * t * ik.GROUPS * ik.LANES * 2, f"u8 [{r}, {t}, 4, 32, 8]"),
        "qscale": (4 * r * t * 32, f"f32 [{r}, {t}, 4, 4, 2]"),
        "qw": (4 * r * t * 8, f"f32 [{r}, {t}, 4, 2]"),
        "plan": (4 * ik.plan_words(r), f"i32 [{ik.plan_words(r)}]"),
        "keys": (pages * s.page_size * ik.KEY_BYTES, "u8 [pages * page, 132]"),
        "block_tables": (4 * s.max_seqs * s.pages_per_seq,
                         f"i32 [{s.max_seqs}, {s.pages_per_seq}]"),
        "scores": (4 * r * s.max_entries, f"f32 [{r}, {s.max_entries}]"),
        "topk": (4 * r * s.topk, f"i32 [{r}, {s.topk}]"),
        "blocks_out": (4 * r * s.num_blocks, f"i32 [{r}, {s.num_blocks}]"),
    }


def requests(shape: IndexerShape, names=None) -> list[tuple[str, int, str]]:
    """Arena requests for `names` (default: the scratch and the outputs the indexer itself
    owns; the step provides q, w_raw, positions, seq_index, cands, keys, block_tables)."""
    if names is None:
        names = SCRATCH + ("topk",) + (("blocks_out",) if shape.candidate_source else ())
    table = buffers(shape)
    return [(name, *table[name]) for name in names]


def _ptr(ptrs: Mapping[str, int], name: str, who: str) -> int:
    try:
        return ptrs[name]
    except KeyError:
        raise KeyError(f"{who}: no device address for buffer {name!r}; given "
                       f"{sorted(ptrs)}") from None


def _check_rows(shape: IndexerShape, rows: int, who: str) -> None:
    if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= shape.max_rows:
        raise ValueError(f"{who}: rows must be an int in [1, {shape.max_rows}] (the shape's "
                         f"max_rows), got {rows!r}")


def indexer_launches(bundle, shape: IndexerShape, ptrs: Mapping[str, int], rows: int,
                     weight_scale: float, cluster_topk: bool = False) -> list[LaunchSpec]:
    """prep, scores, then the top-k: by default `topk` (+ `blocks`, candidate source) as the
    chain's default; with cluster_topk the cluster kernel of the layer's mode instead (candidates:
    topkc into ptrs['topk']; candidate source: bothc into topk and blocks_out in one launch;
    other dense layers: topkc entries). Buffers: the module docstring."""
    who = f"indexer launches ({shape.mode}, ratio {shape.ratio})"
    _check_rows(shape, rows, who)
    s = shape

    def p(name):
        return _ptr(ptrs, name, who)

    def args(key):                        # built per launch: a layer passes only what it uses
        if key == "prep":
            return (p("q"), p("w_raw"), p("positions"), p("seq_index"), p("cands"), p("qfrag"),
                    p("qscale"), p("qw"), p("plan"), rows, s.num_blocks, float(weight_scale))
        if key == "scores":
            return (p("qfrag"), p("qscale"), p("qw"), p("plan"), p("keys"), p("block_tables"),
                    p("cands"), p("seq_index"), p("scores"), rows, s.max_entries,
                    s.pages_per_seq, s.num_blocks)
        out = p("topk") if key == "topk" else p("blocks_out")
        return (p("scores"), p("positions"), p("seq_index"), p("cands"), out, rows,
                s.max_entries, s.num_blocks)
    specs = default_specs(s)
    keys = list(specs) if not cluster_topk else ["prep", "scores"]
    out = [LaunchSpec(bundle.kernel(specs[k].name), specs[k].grid(rows), args(k)) for k in keys]
    if cluster_topk:
        variants = cluster_specs(s)
        spec = variants["bothc" if s.candidate_source else "topkc"]
        out.append(cluster_topk_launch(bundle, s, spec, ptrs, rows))
    return out


def cluster_topk_launch(bundle, shape: IndexerShape, spec: ik.IndexerSpec,
                        ptrs: Mapping[str, int], rows: int) -> LaunchSpec:
    """One cluster top-k launch (a spec of `cluster_specs(shape)`) on ptrs['scores']: writes
    ptrs['topk'] (modes entries, candidates, both) and/or ptrs['blocks_out'] (blocks, both).
    The entries and blocks modes take both output pointers and write only their own."""
    who = f"indexer cluster top-k {spec.name}"
    _check_rows(shape, rows, who)

    def p(name):
        return _ptr(ptrs, name, who)
    if spec.mode == "candidates":                       # the default top-k's ABI
        args = (p("scores"), p("positions"), p("seq_index"), p("cands"), p("topk"), rows,
                shape.max_entries, shape.num_blocks)
    else:
        args = (p("scores"), p("positions"), p("seq_index"), p("topk"), p("blocks_out"), rows,
                shape.max_entries)
    return LaunchSpec(bundle.kernel(spec.name), spec.grid(rows), args, cluster=spec.cluster)
