"""Open a V4.1 checkpoint directory: config, index, memory-mapped shards, validated against the schema.

`Checkpoint.open(dir)` reads `config.json`, then `model.safetensors.index.json` (or a single
`model.safetensors`), maps every shard and checks every tensor against `checkpoint_schema(config)`:
missing, unexpected (beyond the explicitly ignored vision tensors), dtype, shape; shards that are
missing, truncated or have a corrupt/oversized header; index entries that point at the wrong shard
or at nothing, shard tensors the index does not list; NaN scales (UE8M0 byte 0xFF) and non-finite
values in float tensors small enough to scan (see `SCAN_MODES`; 700 GB of weights are not read).

All problems are collected and raised together as one `CheckpointError` (the first
`MAX_REPORTED` listed), and a failed open leaves no file mapped.

Besides the safetensors, the directory may hold Engram's compressed-vocabulary map
(`loader.engram_vocab.VOCAB_MAP_FILE`, int32 [vocab_size]): read and validated at open, then
served by `spec`/`get` as the replicated tensor `engram.vocab_map` (so every fetch built on
`sharding.shard` hands it to the stage that packs it). Absent, a config that needs it fails when
a rank is packed or the reference hashes (`engram_vocab.fetch_vocab_map`), not here: inspection
and tools open it without.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from loader import engram_vocab
from loader.config import ModelConfig
from loader.progress import Progress
from loader.safetensors import SafetensorsError, SafetensorsFile
from loader.schema import TensorSpec, checkpoint_schema, is_ignored

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_REPORTED = 40
# What open() reads to look for NaN/Inf: "small" = scale tensors up to 4 x SCAN_MAX_BYTES (all but
# the Engram tables': ~20 GB of V4.1's 509) and float tensors up to SCAN_MAX_BYTES (norms, biases,
# mHC, sinks, router, compressors); "all" = every scale and float tensor (also embed, head, the
# Engram scales); "none" = headers only.
SCAN_MODES = ("small", "all", "none")
SCAN_MAX_BYTES = 64 << 20
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")


class CheckpointError(ValueError):
    """A checkpoint failed validation; `problems` lists every problem found (file, tensor, what)."""

    def __init__(self, source: Path, problems: list[str]):
        self.problems = problems
        shown = problems[:MAX_REPORTED]
        more = len(problems) - len(shown)
        lines = [f"{source}: invalid checkpoint, {len(problems)} problem(s):"]
        lines += [f"  - {p}" for p in shown]
        if more:
            lines.append(f"  ... and {more} more")
        super().__init__("\n".join(lines))


class Checkpoint:
    """A validated checkpoint: `config`, `specs` (schema rows by name), zero-copy `get(name)`."""

    def __init__(self, path: Path, config: ModelConfig, specs: dict[str, TensorSpec],
                 files: dict[str, SafetensorsFile], locations: dict[str, str],
                 vocab_map: np.ndarray | None = None):
        self.path, self.config, self.specs = path, config, specs
        self.files, self.locations = files, locations
        self.vocab_map = vocab_map      # Engram's compressed-vocab map, None without its file

    @classmethod
    def open(cls, path: str | Path, scan: str = "small", progress: bool = True) -> Checkpoint:
        path = Path(path)
        if scan not in SCAN_MODES:
            raise ValueError(f"scan={scan!r}; expected one of {SCAN_MODES}")
        if not path.is_dir():
            raise CheckpointError(path, ["not a directory (expected config.json + safetensors)"])
        try:
            config = ModelConfig.from_json(path / "config.json")
        except (ValueError, TypeError, OSError) as exc:
            raise CheckpointError(path, [f"config.json: {exc}"]) from None
        specs = {t.name: t for t in checkpoint_schema(config)}
        problems: list[str] = []
        files: dict[str, SafetensorsFile] = {}
        try:
            weight_map = _read_weight_map(path, problems)
            locations, lost = _open_shards(path, weight_map, files, problems)
            checked = _check_schema(specs, files, locations, lost, problems)
            if scan != "none":
                _scan_values(path, checked, files, locations, scan, progress, problems)
            vocab_map = _read_vocab_map(path, config, problems)
        except BaseException:
            _close_all(files)
            raise
        if problems:
            _close_all(files)
            raise CheckpointError(path, problems)
        return cls(path, config, specs, files, locations, vocab_map)

    def get(self, name: str) -> np.ndarray:
        """The tensor `name` as a read-only view onto its shard's mapping (or the vocab map)."""
        if name == engram_vocab.VOCAB_MAP_NAME and self.vocab_map is not None:
            return self.vocab_map
        if name not in self.locations:
            raise KeyError(f"{self.path}: no tensor '{name}'")
        return self.files[self.locations[name]].get(name)

    def spec(self, name: str) -> TensorSpec:
        if name == engram_vocab.VOCAB_MAP_NAME and self.vocab_map is not None:
            return engram_vocab.vocab_map_spec(self.config)
        if name not in self.specs:
            raise KeyError(f"{self.path}: '{name}' is not a schema tensor")
        return self.specs[name]

    @property
    def names(self) -> list[str]:
        """Schema tensors in checkpoint order (ignored vision tensors are not included)."""
        return list(self.specs)

    def close(self) -> None:
        _close_all(self.files)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _close_all(files: dict[str, SafetensorsFile]) -> None:
    for f in files.values():
        f.close()
    files.clear()


def _read_vocab_map(path: Path, config: ModelConfig, problems: list[str]) -> np.ndarray | None:
    """The Engram vocab map file if present (validated; a read-only array), else None."""
    file = path / engram_vocab.VOCAB_MAP_FILE
    if not file.exists():
        return None
    try:
        array = engram_vocab.load_vocab_map_file(config, file)
    except engram_vocab.EngramVocabMapError as exc:
        problems.append(str(exc))
        return None
    array.flags.writeable = False
    return array


def _read_weight_map(path: Path, problems: list[str]) -> dict[str, str] | None:
    """name -> shard file name, from the index; None for a single-file checkpoint."""
    index = path / INDEX_NAME
    if not index.exists():
        if (path / SINGLE_NAME).exists():
            return None
        raise CheckpointError(path, [f"neither {INDEX_NAME} nor {SINGLE_NAME} exists"])
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
        weight_map = data["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        message = (f"{INDEX_NAME}: unreadable ({exc!r}); expected JSON with a weight_map of "
                   f"tensor name -> shard file")
        raise CheckpointError(path, [message]) from None
    for name, shard in list(weight_map.items()):
        if not isinstance(shard, str) or Path(shard).name != shard or not shard:
            problems.append(f"{INDEX_NAME}: tensor '{name}' maps to {shard!r}, not a file name in "
                            f"the checkpoint directory")
            del weight_map[name]
    return weight_map


def _open_shards(path: Path, weight_map: dict[str, str] | None,
                 files: dict[str, SafetensorsFile],
                 problems: list[str]) -> tuple[dict[str, str], set[str]]:
    """Open every shard the index names; returns where each tensor really is, and the tensors
    the index maps to shards that are missing or unreadable (already reported per shard)."""
    indexed = weight_map is not None
    shard_names = sorted(set(weight_map.values())) if indexed else [SINGLE_NAME]
    weight_map = weight_map or {}
    for shard in shard_names:
        listed = [n for n, s in weight_map.items() if s == shard]
        if not (path / shard).is_file():
            problems.append(f"{shard}: missing, but {INDEX_NAME} maps {len(listed)} tensor(s) to "
                            f"it (e.g. '{listed[0]}')")
            continue
        try:
            files[shard] = SafetensorsFile.open(path / shard)
        except SafetensorsError as exc:
            problems.append(str(exc))
    locations: dict[str, str] = {}
    for shard, f in files.items():
        for name in f.tensors:
            if name in locations:
                problems.append(f"tensor '{name}' is in both {locations[name]} and {shard}")
                continue
            locations[name] = shard
            if indexed and name not in weight_map:
                problems.append(f"{shard}: tensor '{name}' is not listed in {INDEX_NAME}")
            elif indexed and weight_map[name] != shard:
                problems.append(f"{INDEX_NAME}: maps '{name}' to {weight_map[name]}, but it is "
                                f"in {shard}")
    for name, shard in weight_map.items():
        if shard in files and name not in locations:
            problems.append(f"{INDEX_NAME}: maps '{name}' to {shard}, which has no such tensor")
    lost = {name for name, shard in weight_map.items() if shard not in files}
    return locations, lost


def _check_schema(specs: dict[str, TensorSpec], files: dict[str, SafetensorsFile],
                  locations: dict[str, str], lost: set[str], problems: list[str]) -> list[str]:
    """Missing / unexpected / dtype / shape; returns the tensors that passed (to scan)."""
    passed = []
    for name, spec in specs.items():
        shard = locations.get(name)
        if shard is None and name in lost:
            continue  # its shard's problem is reported once, not per tensor
        if shard is None:
            problems.append(f"missing tensor '{name}' (expected {spec.dtype}{list(spec.shape)})")
            continue
        info = files[shard].tensors[name]
        if info.dtype != spec.dtype or info.shape != spec.shape:
            problems.append(f"{shard}: tensor '{name}' is {info.dtype}{list(info.shape)}, "
                            f"expected {spec.dtype}{list(spec.shape)}")
            continue
        passed.append(name)
    for name, shard in locations.items():
        if name not in specs and not is_ignored(name):
            problems.append(f"{shard}: unexpected tensor '{name}' (not in the V4.1 schema for this "
                            f"config)")
    return passed


def _scan_values(path: Path, names: list[str], files: dict[str, SafetensorsFile],
                 locations: dict[str, str], scan: str, progress: bool,
                 problems: list[str]) -> None:
    """NaN scales (0xFF) and non-finite floats, in the tensors `scan` selects."""
    chosen = []
    for name in names:
        info = files[locations[name]].tensors[name]
        if info.dtype == "F8_E8M0":
            limit = 4 * SCAN_MAX_BYTES
        elif info.dtype in FLOAT_DTYPES:
            limit = SCAN_MAX_BYTES
        else:
            continue  # e4m3 / int8 weights: too many bytes to read at open
        if scan == "all" or info.nbytes <= limit:
            chosen.append((name, info))
    bar = Progress(f"validate {path.name}", sum(i.nbytes for _, i in chosen), progress)
    for name, info in chosen:
        array = files[locations[name]].get(name)
        bad = array == 0xFF if info.dtype == "F8_E8M0" else ~np.isfinite(array.astype(np.float32))
        count = int(np.count_nonzero(bad))
        if count:
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            what = "NaN scale byte 0xFF" if info.dtype == "F8_E8M0" else "non-finite value"
            problems.append(f"{locations[name]}: tensor '{name}': {count} {what}(s), first at "
                            f"{list(first)}")
        bar.add(info.nbytes, name)
