"""Every module of the four packages imports with torch, jax and jaxlib made unimportable, and
without a GPU (GPU libraries are imported lazily, inside the functions that need them)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("loader", "kernels", "executor", "collectives")
BLOCKED = ("torch", "jax", "jaxlib")

PROGRAM = """
import importlib, importlib.abc, sys
BLOCKED = {blocked!r}

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is blocked: hopdec must not import it")
        return None

sys.meta_path.insert(0, Block())
failed = []
for name in {modules!r}:
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed.append(f"{{name}}: {{type(exc).__name__}}: {{exc}}")
leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
print("\\n".join(failed + [f"leaked: {{m}}" for m in leaked]))
sys.exit(1 if failed or leaked else 0)
"""


def runtime_modules() -> list[str]:
    names = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_every_module_imports_without_torch_or_jax():
    modules = runtime_modules()
    assert len(modules) > 40 and "executor.reference.step" in modules
    program = PROGRAM.format(blocked=BLOCKED, modules=modules)
    proc = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, check=False,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_blocker_blocks():
    program = PROGRAM.format(blocked=("json",), modules=["loader.config"])
    proc = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, check=False,
                          text=True, timeout=300)
    assert proc.returncode == 1 and "json is blocked" in proc.stdout
