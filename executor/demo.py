"""`hopdec demo`: the tiny model end to end on the NumPy reference: prefill, greedy DSpark decode.

Synthesizes the tiny checkpoint once (cached under ~/.cache/hopdec/checkpoints, or build/ when the
home cache is not writable; the cache key hashes the synthesizer, schema and preset, so a changed
synthesizer writes a new one), loads it at tensor parallelism 4 (per-rank weights, all-reduces
summed in rank order), prefills a prompt and decodes with DSpark k = 5, printing every round's
drafts, acceptance and times. The GPU executor is not used yet; the first line says whether this
machine could run it.
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
    return (f"SM90 GPU found ({name}): the GPU executor will run here once it exists; this demo "
            f"runs the NumPy reference on the CPU.")


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
    ckpt.close()
    return 0


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
