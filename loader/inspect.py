"""`hopdec inspect CKPT [--tp 4]`: validate a checkpoint; print tensors, bytes per format and per rank.

The per-rank table uses the byte classes of model doc §3 and prints, per backbone layer, our bytes
next to §3's figures (MB = 1e6 B, rank 0), so a one-layer slice (`hopdec synth --layers 1`) can be
compared with the doc line by line. `--schema` prints the same tables for a config (preset name or
config.json) from the schema alone, without files: the whole-model figures of §3.

Exit status: 0 valid, 1 invalid (the problems go to stderr), 2 bad arguments.
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from loader.checkpoint import SCAN_MODES, Checkpoint, CheckpointError
from loader.config import ModelConfig
from loader.schema import CLASSES, Fmt, TensorSpec, checkpoint_schema
from loader.sharding import rank_nbytes

MB = 1e6

# Model doc §3 (and §1.1/§2 for embed/head/Engram), per rank at TP4, in MB:
# (class, label, doc MB, scope). Scope "layer" = per backbone layer, "expert" = per routed expert
# of one layer, "model" = whole model.
DOC_FIGURES: tuple[tuple[str, str, float, str], ...] = (
    ("attention", "attention (wq_a|wkv rep + wq_b/wo_a/wo_b 1/4)", 38.5, "layer"),
    ("mhc", "mHC fns (2 x 24 x 4D fp32)", 3.9, "layer"),
    ("router", "router gate (bf16)", 3.9, "layer"),
    ("shared_expert", "shared expert (1/4)", 8.85, "layer"),
    ("dense", "dense per layer (the four rows above)", 55.25, "layer"),
    ("routed_experts", "routed expert (1/4, MXFP4)", 4.70, "expert"),
    ("routed_experts", "all routed experts (saturation)", 72_200.0, "model"),
    ("compressor_indexer", "compressors / indexers (rep)", 113.0, "model"),
    ("engram_wkv", "Engram wkv (rep, 2 layers)", 315.0, "model"),
    ("engram_table", "Engram tables (1/4 of 2 x ~101 GB)", 50_500.0, "model"),
    ("embed", "embed (vocab/4, bf16)", 331.0, "model"),
    ("head", "lm_head (vocab/4, bf16)", 331.0, "model"),
)
# The doc's figures hold for these widths (those of the v41-flash preset).
DOC_WIDTHS = ("hidden_size", "q_lora_rank", "num_attention_heads", "head_dim", "o_groups",
              "o_lora_rank", "n_routed_experts", "moe_intermediate_size", "vocab_size", "hc_mult")


def class_bytes(specs: list[TensorSpec], tp: int, rank: int,
                keep: Callable[[TensorSpec], bool] = lambda t: True) -> Counter:
    """Bytes held by `rank` per class, over the specs `keep` selects."""
    out: Counter = Counter()
    for t in specs:
        if keep(t):
            out[t.cls] += rank_nbytes(t, tp, rank)
    return out


def _table(rows: list[tuple], header: tuple, out) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for i, row in enumerate([header, *rows]):
        print("  " + "  ".join(str(x).rjust(w) if j else str(x).ljust(w)
                               for j, (x, w) in enumerate(zip(row, widths))), file=out)
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths), file=out)


def print_report(cfg: ModelConfig, specs: list[TensorSpec], tp: int, out=None) -> None:
    """Tensor counts and bytes by class and format; per-rank bytes; the §3 comparison (to `out`,
    default the sys.stdout of the call: a default bound at import would outlive a redirect)."""
    out = sys.stdout if out is None else out
    count, total = Counter(t.cls for t in specs), Counter()
    fmt_count, fmt_bytes = Counter(t.fmt for t in specs), Counter()
    for t in specs:
        total[t.cls] += t.nbytes
        fmt_bytes[t.fmt] += t.nbytes
    print(f"\ntensors by class ({len(specs)} tensors, {sum(total.values()) / 1e9:.3f} GB):", file=out)
    _table([(c, count[c], f"{total[c] / MB:,.2f}") for c in CLASSES if count[c]],
           ("class", "tensors", "MB"), out)
    print("\nbytes by format:", file=out)
    _table([(f.value, fmt_count[f], f"{fmt_bytes[f] / MB:,.2f}") for f in Fmt if fmt_count[f]],
           ("format", "tensors", "MB"), out)
    ranks = [class_bytes(specs, tp, r) for r in range(tp)]
    print(f"\nper-rank bytes at tp={tp} (MB):", file=out)
    rows = [(c, *(f"{rb[c] / MB:,.2f}" for rb in ranks)) for c in CLASSES if count[c]]
    rows.append(("total", *(f"{sum(rb.values()) / MB:,.2f}" for rb in ranks)))
    _table(rows, ("class", *(f"rank {r}" for r in range(tp))), out)
    _print_doc_comparison(cfg, specs, tp, out)


def _print_doc_comparison(cfg: ModelConfig, specs: list[TensorSpec], tp: int, out) -> None:
    real = ModelConfig.preset("v41-flash")
    if any(getattr(cfg, k) != getattr(real, k) for k in DOC_WIDTHS):
        print("\n(no model doc §3 comparison: the config's widths are not V4.1-Flash's)", file=out)
        return
    L = cfg.num_hidden_layers
    backbone = class_bytes(specs, tp, 0, lambda t: t.layer is not None and t.layer < L)
    whole = class_bytes(specs, tp, 0)
    backbone["dense"] = sum(backbone[c] for c in ("attention", "mhc", "router", "shared_expert"))
    experts = L * cfg.n_routed_experts
    rows = []
    for cls, label, doc, scope in DOC_FIGURES:
        if scope == "layer":
            ours = backbone[cls] / L
        elif scope == "expert":
            ours = backbone[cls] / experts
        elif cfg.num_hidden_layers != real.num_hidden_layers and cls not in ("embed", "head"):
            rows.append((label, scope, "(slice)", f"{doc:,.2f}", "-"))  # whole-model figure
            continue
        else:
            ours = whole[cls]
        if not ours:
            rows.append((label, scope, "absent", f"{doc:,.2f}", "-"))
            continue
        ours /= MB
        rows.append((label, scope, f"{ours:,.2f}", f"{doc:,.2f}", f"{100 * (ours / doc - 1):+.2f}%"))
    note = "" if tp == 4 else f" (doc figures are TP4; this is tp={tp})"
    print(f"\nmodel doc §3 comparison, rank 0, per backbone layer / expert / model{note}:", file=out)
    _table(rows, ("what", "per", "ours MB", "doc MB", "diff"), out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="checkpoint directory (or, with --schema, a preset name "
                        "or config.json)")
    parser.add_argument("--tp", type=int, default=4, choices=(1, 2, 4))
    parser.add_argument("--scan", default="small", choices=SCAN_MODES,
                        help="which tensors to scan for NaN/Inf (default: scales and small floats)")
    parser.add_argument("--schema", action="store_true",
                        help="print the tables of a config's schema; read no checkpoint")
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def run(args: argparse.Namespace) -> int:
    if args.schema:
        path = Path(args.checkpoint)
        try:
            cfg = (ModelConfig.from_json(path) if path.suffix == ".json"
                   else ModelConfig.preset(args.checkpoint))
        except (ValueError, TypeError, OSError) as exc:
            print(f"hopdec inspect: {exc}", file=sys.stderr)
            return 2
        print(f"schema of {args.checkpoint} (no files read)")
        print_report(cfg, checkpoint_schema(cfg), args.tp)
        return 0
    try:
        ckpt = Checkpoint.open(args.checkpoint, scan=args.scan, progress=not args.quiet)
    except CheckpointError as exc:
        print(f"hopdec inspect: {exc}", file=sys.stderr)
        return 1
    with ckpt:
        cfg = ckpt.config
        extra = len(ckpt.locations) - len(ckpt.specs)
        print(f"{ckpt.path}: valid ({len(ckpt.specs)} tensors"
              f"{f', {extra} ignored vision tensors' if extra else ''}, {len(ckpt.files)} shard(s),"
              f" scan={args.scan})")
        print(f"config: {cfg.num_hidden_layers} layers + {cfg.num_nextn_predict_layers} DSpark "
              f"stages, hidden {cfg.hidden_size}, {cfg.n_routed_experts} experts x "
              f"{cfg.moe_intermediate_size}, vocab {cfg.vocab_size}")
        print_report(cfg, list(ckpt.specs.values()), args.tp)
    return 0
