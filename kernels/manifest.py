"""The kernel families a bundle holds, and the bundle's `manifest.json` format (read without the DSL).

A bundle directory holds one `<name>.cubin` per kernel and `manifest.json`:

    {"format": 1, "arch": "sm_90a", "config": "tiny", "tp": 4, "dsl": "nvidia-cutlass-dsl 4.8.1 (cu12)",
     "kernels": {"<name>": {"family": "kernels.norm", "cubin": "<name>.cubin", "entry": "<PTX .entry>",
        "params": [["x", "u64"], ["rows", "u32"], ["eps", "f32"]], "block": [128, 1, 1],
        "smem_bytes": 0, "registers": 40, "local_bytes": 0, "spill_bytes": 0, "pdl": true,
        "pdl_wait": true, "pdl_trigger": true, "source_hash": "<sha256>", "cubin_sha256": "<sha256>",
        "spec": {...}}}}

`params` is the launch ABI in order ("u64" pointer, "u32"/"i32" 32-bit integer, "f32"); `block` is
the exact block the kernel requires (`.reqntid`); `smem_bytes` the dynamic shared memory to pass.
Every kernel is launched with programmatic stream serialization (`pdl`).
"""
from __future__ import annotations

import json
from pathlib import Path

# Family modules (CuTe DSL side). Each has `specs(cfg, tp)` and `compile_spec(spec, options)`;
# its `<module>_ref` sibling holds the DSL-free spec, grid rule and reference.
FAMILIES = (
    "kernels.norm", "kernels.split_norm",
    "kernels.elementwise",
    "kernels.rope",
    "kernels.probes",
    "kernels.allreduce",
    "kernels.moe", "kernels.swiglu",
    "kernels.dense", "kernels.dense_qnorm", "kernels.wo_a", "kernels.lm_head",
    "kernels.dense_qgmma",          # candidate: W8A16 on FP8 wgmma (not in the step)
    "kernels.indexer", "kernels.kv_publish", "kernels.compressor",
    "kernels.sparse_mqa",
    "kernels.mhc", "kernels.router",
    "kernels.embed", "kernels.engram",
    "kernels.rows",
    "kernels.dspark",
    "kernels.linear_bf16",
)
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
ARCH = "sm_90a"
ENTRY_KEYS = ("family", "cubin", "entry", "params", "block", "smem_bytes", "registers",
              "local_bytes", "spill_bytes", "pdl", "source_hash", "spec")
ABI_TYPES = ("u64", "u32", "i32", "f32")


def default_out_dir(config: str, tp: int) -> Path:
    return Path("build") / f"bundle-{config}-tp{tp}"


def load_manifest(bundle_dir: str | Path) -> dict:
    """Read and validate a bundle's manifest; errors name the file and the offending key."""
    path = Path(bundle_dir) / MANIFEST_NAME
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no kernel manifest (build one with "
                                "`python -m kernels.build --config CONFIG --tp N`)") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    validate_manifest(data, str(path))
    return data


def validate_manifest(data: dict, source: str = "<manifest>") -> None:
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{source}: expected a manifest of format {MANIFEST_FORMAT}")
    if data.get("arch") != ARCH:
        raise ValueError(f"{source}: arch {data.get('arch')!r}, expected {ARCH!r}")
    kernels = data.get("kernels")
    if not isinstance(kernels, dict) or not kernels:
        raise ValueError(f"{source}: 'kernels' must be a non-empty object")
    for name, entry in kernels.items():
        missing = [k for k in ENTRY_KEYS if k not in entry]
        if missing:
            raise ValueError(f"{source}: kernel {name!r} lacks {missing}")
        for param in entry["params"]:
            if len(param) != 2 or param[1] not in ABI_TYPES:
                raise ValueError(f"{source}: kernel {name!r} parameter {param!r}: expected "
                                 f"[name, one of {ABI_TYPES}]")
        if len(entry["block"]) != 3 or entry["cubin"] != f"{name}.cubin":
            raise ValueError(f"{source}: kernel {name!r} has a malformed block or cubin name")
