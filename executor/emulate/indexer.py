"""kernels.indexer on the host: prep, scores, top-k and the cluster top-k (kernels/indexer_kernel_ref).

Each launch reads what its kernel reads (the scores kernel follows the plan prep wrote, item by
item, through the block tables) and writes what it writes: prep every row's q fragments, scales,
weights and plan_words(rows) plan words; scores only the entries its plan's items cover (e < n,
candidate blocks for the reindex layers); top-k all k outputs of every row. Scores are
`indexer_ref.index_scores` of the dequantized query (the kernel matches it within
`score_tolerance`); the selections are `topk_ref`, which every top-k kernel equals bitwise.
"""
from __future__ import annotations

import numpy as np

from executor.emulate import NoEmulator
from executor.hostmem import OutOfBounds
from kernels import indexer_kernel_ref as ik
from kernels import indexer_ref, kvrecord_ref
from kernels.common_ref import BF16


def _spec_of(record) -> ik.IndexerSpec:
    """The IndexerSpec the record was compiled from (rebuilt by its make_* and name-checked)."""
    f = record.spec
    kind = f["kind"]
    if kind == "prep":
        spec = ik.make_prep_spec(f["heads"], f["mode"], f["ratio"], f["page_size"])
    elif kind == "scores":
        spec = ik.make_scores_spec(f["heads"], f["mode"], f["ratio"], f["page_size"])
    elif kind == "topk":
        spec = ik.make_topk_spec(f["mode"], f["topk"], f["ratio"], f["block_size"])
    elif kind == "topkc":
        spec = ik.make_topk_cluster_spec(f["mode"], f["topk"], f["ratio"], f["block_size"],
                                         f["topk_blocks"])
    else:
        raise NoEmulator(f"kernels.indexer: no CPU emulator for kernel kind {kind!r} "
                         f"({record.name})")
    if spec.name != record.name:
        raise NoEmulator(f"kernels.indexer: {record.name} is not the default {kind} kernel "
                         f"of its spec ({spec.name}); no CPU emulator for that variant")
    return spec


def emulate(record, grid, args, space) -> None:
    spec = _spec_of(record)
    rows = args["rows"]
    want = spec.grid(rows)
    if tuple(grid) != want:
        raise ValueError(f"{record.name}: grid {tuple(grid)} for {rows} rows; the kernel "
                         f"covers its rows only with grid {want}")
    {"prep": _prep, "scores": _scores, "topk": _topk, "topkc": _topk}[spec.kind](
        spec, args, space, rows)


def _row_meta(args, space, rows: int):
    return (space.array(args["positions"], np.int32, rows).copy(),
            space.array(args["seq_index"], np.int32, rows).copy())


def _prep(spec, args, space, rows: int) -> None:
    nh, t = spec.heads, ik.padded_heads(spec.heads) // ik.HEADS_PER_TILE
    q = space.array(args["q"], BF16, (rows, nh, ik.INDEX_DIM)).astype(np.float32)
    w_raw = space.array(args["w_raw"], BF16, (rows, nh)).astype(np.float32)
    positions, seq_index = _row_meta(args, space, rows)
    cands = None
    if spec.mode == "candidates":
        cands = space.array(args["cands"], np.int32, (rows, args["num_cands"])).copy()
    codes, scales, w = ik.prep_query(q, w_raw, np.float32(args["weight_scale"]))
    space.array(args["qfrag"], np.uint8, (rows, t, ik.GROUPS, ik.LANES, 8))[...] = \
        ik.fragment_order(codes)
    space.array(args["qscale"], np.float32, (rows, t, ik.GROUPS, 4, 2))[...] = \
        ik.scale_order(scales)
    space.array(args["qw"], np.float32, (rows, t, 4, 2))[...] = ik.weight_order(w)
    space.array(args["plan"], np.int32, ik.plan_words(rows))[...] = ik.work_plan(
        positions, seq_index, spec.ratio, spec.mode, cands)


def _query(spec, args, space, rows: int):
    """(dequantized q f32 [R, padded nh, 128], w f32 [R, padded nh]) from prep's layouts: the
    inverses of fragment_order / scale_order / weight_order (padding heads: q 0, w 0)."""
    t = ik.padded_heads(spec.heads) // ik.HEADS_PER_TILE
    frag = space.array(args["qfrag"], np.uint8, (rows, t, ik.GROUPS, ik.LANES, 8))
    codes = frag.reshape(rows, t, ik.GROUPS, 8, 4, 2, 4).transpose(0, 1, 3, 2, 5, 4, 6)
    scales = space.array(args["qscale"], np.float32, (rows, t, ik.GROUPS, 4, 2))
    scales = scales.transpose(0, 1, 3, 4, 2).reshape(rows, 8 * t, ik.GROUPS)
    w = space.array(args["qw"], np.float32, (rows, t, 4, 2)).reshape(rows, 8 * t)
    codes = np.ascontiguousarray(codes).reshape(rows, 8 * t, ik.INDEX_DIM)
    return ik.dequantized_query(codes, scales), w.copy()


def _keys(spec, args, space, seq: int, entries: np.ndarray) -> np.ndarray:
    """f32 [N, 128] decoded index keys of `entries` of sequence `seq`, through its block table."""
    ps = spec.page_size
    table = space.array(args["block_tables"] + 4 * seq * args["max_pages"], np.int32,
                        int(entries.max()) // ps + 1)
    phys = table[entries // ps].astype(np.int64) * ps + entries % ps
    if phys.min() < 0:
        raise OutOfBounds(f"indexer scores: sequence {seq}'s block table gives page "
                          f"{int(table[entries // ps].min())}: a key read before the cache")
    cache = space.array(args["keys"], np.uint8, (int(phys.max()) + 1, ik.KEY_BYTES))
    return kvrecord_ref.decode_index_key(cache[phys])


def _unit_entries(spec, args, space, local_items: int, row0: int, n: int) -> np.ndarray:
    """Entries the unit's items write: dense 32 per item below n; candidates the entries (< n)
    of candidate slots 4i..4i+3 of row0 (read at the kernel's flat offsets)."""
    if spec.mode == "dense":
        return np.arange(min(local_items * ik.ITEM_KEYS, n))
    nc = args["num_cands"]
    slots = space.array(args["cands"] + 4 * row0 * nc, np.int32,
                        local_items * ik.CAND_BLOCKS_PER_ITEM).astype(np.int64)
    entries = (slots[:, None] * spec.block_size + np.arange(spec.block_size)).reshape(-1)
    ok = np.repeat(slots >= 0, spec.block_size) & (entries < n)
    return entries[ok]


def _scores(spec, args, space, rows: int) -> None:
    plan = space.array(args["plan"], np.int32, ik.plan_words(rows)).astype(np.int64)
    prefix, units = plan[1:rows + 2], plan[rows + 2:].reshape(rows, 4)
    if plan[0] != prefix[-1]:
        raise ValueError(f"{spec.name}: plan total {plan[0]} != last prefix {prefix[-1]}")
    qd, w = _query(spec, args, space, rows)
    ld = args["ld"]
    for u in range(rows):
        items = int(prefix[u + 1] - prefix[u])
        row0, nrows, seq, n = (int(v) for v in units[u])
        entries = _unit_entries(spec, args, space, items, row0, n) if items > 0 else []
        if len(entries) == 0:
            continue
        keys = _keys(spec, args, space, seq, entries)
        got = indexer_ref.index_scores(qd[row0:row0 + nrows], w[row0:row0 + nrows], keys)
        width = int(entries.max()) + 1
        for j in range(nrows):
            space.array(args["scores"] + 4 * (row0 + j) * ld, np.float32, width)[entries] = got[j]


def _topk(spec, args, space, rows: int) -> None:
    positions, seq_index = _row_meta(args, space, rows)
    visible = ik.visible_counts(positions, seq_index, spec.ratio)
    cands = None
    if spec.mode == "candidates":
        cands = space.array(args["cands"], np.int32, (rows, args["num_cands"])).copy()
    scores = np.zeros((rows, max(1, int(visible.max()))), np.float32)
    for r in np.flatnonzero(visible):                  # the visible prefix of each row's scores
        scores[r, :visible[r]] = space.array(args["scores"] + 4 * int(r) * args["ld"],
                                             np.float32, int(visible[r]))

    def select(mode, k):
        return ik.topk_ref(scores, positions, seq_index, mode, k, spec.ratio, cands,
                           spec.block_size)
    if spec.kind == "topk" or spec.mode == "candidates":
        space.array(args["out"], np.int32, (rows, spec.topk))[...] = select(spec.mode, spec.topk)
        return
    if spec.mode in ("entries", "both"):
        space.array(args["out_entries"], np.int32, (rows, spec.topk))[...] = \
            select("entries", spec.topk)
    if spec.mode in ("blocks", "both"):
        kb = spec.topk if spec.mode == "blocks" else spec.topk_blocks
        space.array(args["out_blocks"], np.int32, (rows, kb))[...] = select("blocks", kb)
