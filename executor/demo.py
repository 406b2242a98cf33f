"""`hopdec demo`: the tiny model end to end: the NumPy reference (prefill, greedy DSpark decode),
then the executor's own wired step on the CPU emulator, step by step beside the reference.

Synthesizes the tiny checkpoint once (cached under ~/.cache/hopdec/checkpoints, or build/ when the
home cache is not writable; the cache key hashes the synthesizer, schema and preset, so a changed
synthesizer writes a new one), loads it at tensor parallelism 4 (per-rank weights, all-reduces
summed in rank order), prefills a prompt and decodes with DSpark k = 5, printing every round's
drafts, acceptance and times. Then, with a kernel bundle (`--bundle`, what `make demo` builds), it
runs the executor's decode step as the GPU would receive it: every launch of the wired plan on
four TP ranks, each kernel emulated by its NumPy reference (executor/emulate/), and prints its
tokens and logits beside the reference's. The first line says whether this machine has an SM90
GPU; the demo itself runs on the CPU.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import numpy as np

DEFAULT_PROMPT = (1, 345, 678, 90, 12, 777, 5, 431)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=16, help="tokens to generate (default 16)")
    parser.add_argument("--prompt", default=",".join(map(str, DEFAULT_PROMPT)),
                        help="comma-separated token ids (tiny vocabulary: 0..1022)")
    parser.add_argument("--tp", type=int, default=4, choices=(1, 2, 4), help="tensor parallelism")
    parser.add_argument("--seed", type=int, default=0, help="synthetic checkpoint seed")
    parser.add_argument("--checkpoint", default=None, help="use this checkpoint directory instead")
    parser.add_argument("--exact", action="store_true",
                        help="no FP8 activation / KV quantization, plain MXFP4 experts")
    parser.add_argument("--bundle", default=None,
                        help="tiny TP4 kernel bundle: also run the executor's wired step on the "
                             "CPU emulator (make demo passes build/bundle-tiny)")
    parser.add_argument("--executor-steps", type=int, default=4,
                        help="decode steps of the emulated executor (default 4)")


def gpu_status() -> str:
    """One line: is there an SM90 GPU the executor could use?"""
    try:
        from executor.runtime import Device

        with Device(0) as device:
            major, minor = device.info.compute_capability
            name = device.info.name
    except Exception as exc:  # noqa: BLE001 - any failure here just means "no usable GPU"
        return f"no GPU usable here ({type(exc).__name__}); running the NumPy reference on the CPU."
    if (major, minor) != (9, 0):
        return f"GPU {name} is sm_{major}{minor}, not SM90: running the NumPy reference on the CPU."
    return (f"SM90 GPU found ({name}); this demo runs on the CPU (the reference, then the "
            f"executor's launches emulated): tests/gpu and `hopdec devicecheck` use the GPU.")


def _cache_key(seed: int) -> str:
    import loader.schema
    import loader.synth
    from loader.config import PRESET_DIR

    digest = hashlib.sha256()
    for path in (Path(loader.synth.__file__), Path(loader.schema.__file__), PRESET_DIR / "tiny.json"):
        digest.update(path.read_bytes())
    return f"tiny-seed{seed}-{digest.hexdigest()[:12]}"


def tiny_checkpoint(seed: int) -> tuple[Path, bool]:
    """(directory, freshly written) of the cached synthetic tiny checkpoint."""
    from loader.config import ModelConfig
    from loader.synth import synth

    key = _cache_key(seed)
    roots = (Path.home() / ".cache" / "hopdec" / "checkpoints", Path("build") / "checkpoints")
    for root in roots:
        path = root / key
        if (path / "config.json").is_file():
            return path, False
    for root in roots:
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp = root / f"{key}.partial"
            synth(ModelConfig.preset("tiny"), tmp, seed=seed, progress=False)
            tmp.rename(root / key)  # only a complete checkpoint gets the final name
            return root / key, True
        except OSError:
            continue
    raise OSError(f"cannot write the tiny checkpoint under any of {[str(r) for r in roots]}")


def _parse_prompt(text: str, vocab: int) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--prompt must be comma-separated integers, got {text!r}") from None
    if not ids or min(ids) < 0 or max(ids) >= vocab:
        raise ValueError(f"--prompt needs 1+ token ids in [0, {vocab}), got {ids}")
    return ids


def run(args: argparse.Namespace) -> int:
    from executor.reference import dspark
    from executor.reference.kvcache import KVCaches
    from executor.reference.step import ReferenceModel
    from executor.reference.weights import rank_weights_from_checkpoint
    from loader.checkpoint import Checkpoint, CheckpointError

    print(gpu_status())
    t0 = time.perf_counter()
    try:
        if args.checkpoint:
            path, fresh = Path(args.checkpoint), False
        else:
            path, fresh = tiny_checkpoint(args.seed)
        ckpt = Checkpoint.open(path, progress=False)
        cfg = ckpt.config
        prompt = _parse_prompt(args.prompt, cfg.vocab_size)
    except (OSError, ValueError, CheckpointError) as exc:
        print(f"hopdec demo: {exc}", file=sys.stderr)
        return 1
    if args.tokens < 1:
        print("hopdec demo: --tokens must be >= 1", file=sys.stderr)
        return 1
    print(f"checkpoint {path} ({'synthesized' if fresh else 'cached'}, "
          f"{time.perf_counter() - t0:.1f} s); tp={args.tp}, "
          f"{'exact' if args.exact else 'stock SM90'} numerics")
    ranks = tuple(rank_weights_from_checkpoint(ckpt, args.tp, r, humming_experts=not args.exact)
                  for r in range(args.tp))
    model = ReferenceModel(cfg, ranks, exact=args.exact)
    caches = KVCaches.allocate(cfg, max_seqs=1, max_context=len(prompt) + args.tokens + 16,
                               exact=args.exact)
    result = dspark.generate(model, caches, prompt, args.tokens)
    _report(result, len(prompt))
    if args.bundle and not args.exact:
        if args.tp != 4:
            print(f"executor: the tiny bundle is built for tp=4; skipped at tp={args.tp}")
        else:
            _emulated_executor(ckpt, Path(args.bundle), model, prompt, args.executor_steps)
    ckpt.close()
    return 0


def _emulated_executor(ckpt, bundle: Path, model, prompt: list[int], steps: int) -> None:
    """The executor's wired decode step, emulated, teacher-forced beside the reference."""
    from executor.emulate.ranks import EmulatedRanks
    from executor.reference.kvcache import KVCaches
    from executor.reference.prefill import prefill
    from executor.reference.rows import RowBatch, RowBlock
    from executor.reference.step import compressed_ids, decode_step, ngram_lookback
    from kernels import engram_ref

    cfg = model.cfg
    caches = KVCaches.allocate(cfg, max_seqs=1, max_context=len(prompt) + steps + 16)
    seq = list(prompt) + [prefill(model, caches, 0, prompt).next_token]
    t0 = time.perf_counter()
    ranks = EmulatedRanks(ckpt, bundle, model.tp, caches)
    launches = sum(s.build is not None for s in ranks.plans[0].stages)
    print(f"executor: {launches} wired stages per rank, 4 ranks, arenas "
          f"{ranks.arenas[0].total_bytes / 2**20:.1f} MiB each ({time.perf_counter() - t0:.1f} s); "
          f"each step emulated launch by launch on the CPU")
    print("step | position | reference | executor | max |logit diff| | launches/rank | s")
    for step in range(steps):
        rows = RowBatch.from_blocks([RowBlock(0, len(seq) - 1, (seq[-1],), "decode")],
                                    caches.block_tables, caches.ring_slots)
        raw = ngram_lookback(rows, [np.asarray(seq, np.int64)], cfg.engram_max_ngram_size)
        history = engram_ref.ngram_history(compressed_ids(cfg, raw), rows.positions,
                                           cfg.engram_max_ngram_size, cfg.engram_pad_token_id)
        t = time.perf_counter()
        ranks.load(rows, caches if step == 0 else None, history)
        count = ranks.run(rows.num_rows) // model.tp
        out = decode_step(model, rows, caches, [np.asarray(seq, np.int64)])
        vocab_l = cfg.vocab_size // model.tp
        logits = np.concatenate([ranks.read(r, "logits", np.float32, (192, vocab_l))[:1]
                                 for r in range(model.tp)], axis=1)
        token = int(ranks.read(0, "tokens", np.int64, (192,))[0])
        diff = float(np.abs(logits.astype(np.float64) - out.logits).max())
        print(f"{step:4d} | {len(seq) - 1:8d} | {int(out.tokens[0]):9d} | {token:8d} | "
              f"{diff:19.3g} | {count:13d} | {time.perf_counter() - t:.1f}")
        seq.append(int(out.tokens[0]))


def _report(result, prompt_len: int) -> None:
    print(f"prompt ({prompt_len} tokens): {result.prompt}")
    print(f"prefill: {result.prefill_s:.2f} s ({result.prefill_s / prompt_len * 1e3:.0f} ms/token, "
          f"first token {result.tokens[0]})")
    print("round | drafts                        | accepted | emitted                        "
          "| verify ms | draft ms")
    for i, r in enumerate(result.rounds):
        print(f"{i:5d} | {' '.join(f'{d:4d}' for d in r.drafts):29s} | {r.accepted:8d} | "
              f"{' '.join(f'{t:4d}' for t in r.emitted):30s} | {r.verify_s * 1e3:9.0f} | "
              f"{r.draft_s * 1e3:8.0f}")
    tokens = result.tokens
    print(f"generated {len(tokens)} tokens: {tokens}")
    if result.rounds:
        lengths = [r.accepted + 1 for r in result.rounds]
        verify = np.mean([r.verify_s for r in result.rounds])
        per_round = np.mean([r.verify_s + r.draft_s for r in result.rounds])
        print(f"acceptance length per round (bonus included): {lengths}, mean "
              f"{np.mean(lengths):.2f}")
        print(f"time per step: verify {verify * 1e3:.0f} ms, draft + verify {per_round * 1e3:.0f} ms "
              f"per round, {np.mean(lengths) / per_round:.2f} tokens/s (NumPy reference, CPU)")
