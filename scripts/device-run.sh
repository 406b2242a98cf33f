#!/usr/bin/env bash
# The one command run on the GPU machine: install carried wheels, print the machine, run devicecheck.
#
#   bash scripts/device-run.sh [extra devicecheck args]       (from the repository root)
#
# Expects the bundles built on the build machine under build/ (build/bundle-tiny,
# build/bundle-v41-flash-tp4, build/bundle-v41-bench-step-tp4 for the step benchmark) and missing
# Python packages as wheels under .whl/ (see docs/device.md).
# HOPDEC_BUNDLES="dir1 dir2" overrides the bundle directories.
# Writes everything under $OUT (default ./devicecheck-out): report.json, table.txt, junit.xml,
# pytest.log and this script's log, device-run.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/devicecheck-out}"
mkdir -p "$OUT"
exec > >(tee "$OUT/device-run.log") 2>&1

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
PY="${PYTHON:-python3}"

if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || { echo "wheel install failed"; exit 3; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu \
    --format=csv || echo "nvidia-smi failed"
"$PY" - <<'PYEOF'
import importlib, sys
print("python", sys.version.split()[0])
for name in ("numpy", "ml_dtypes", "cupy", "cuda.bindings", "cuda.core", "nvtx", "nccl.core",
             "pytest"):
    try:
        m = importlib.import_module(name)
        print(f"{name:14s} {getattr(m, '__version__', '?'):12s} {getattr(m, '__file__', '')}")
    except Exception as exc:
        print(f"{name:14s} MISSING ({type(exc).__name__}: {exc})")
PYEOF
BUNDLE_DIRS="${HOPDEC_BUNDLES:-build/bundle-tiny build/bundle-v41-flash-tp4 build/bundle-v41-bench-step-tp4}"
for b in $BUNDLE_DIRS; do
  if [ -f "$b/manifest.json" ]; then echo "bundle $b: $(ls "$b"/*.cubin | wc -l) cubins"; \
  else echo "bundle $b: MISSING"; fi
done

echo "== devicecheck"
BUNDLES=()
for b in $BUNDLE_DIRS; do
  [ -f "$b/manifest.json" ] && BUNDLES+=(--bundle "$b")
done
"$PY" -m executor.devicecheck --out "$OUT" "${BUNDLES[@]}" "$@"
rc=$?
echo "== devicecheck exit status $rc"
exit $rc
