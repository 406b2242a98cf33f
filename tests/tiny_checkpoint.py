"""One synthetic tiny checkpoint per test session, shared by the loader test modules (read-only)."""
import atexit
import functools
import shutil
import tempfile
from pathlib import Path

from loader.config import ModelConfig
from loader.synth import synth

SEED = 7
SHARD_BYTES = 16 << 20  # several shards, so index/shard mismatches can be built


@functools.lru_cache(maxsize=1)
def tiny_checkpoint() -> Path:
    """The tiny preset synthesised with SEED in SHARD_BYTES shards. Never modify it in place."""
    root = Path(tempfile.mkdtemp(prefix="hopdec-tiny-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return synth(ModelConfig.preset("tiny"), root / "ckpt", seed=SEED, shard_bytes=SHARD_BYTES,
                 progress=False)
