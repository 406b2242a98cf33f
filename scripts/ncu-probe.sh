#!/usr/bin/env bash
# Nsight Compute over the first launches of chosen kernels inside their family benchmarks.
#
#   bash scripts/ncu-probe.sh                # on the GPU machine, from the repository root
#
# For each (family benchmark, kernel-name regex, launches) below: run the family's quick
# benchmark under ncu (clocks left alone, --set full), then write the details page and the
# per-instruction SASS page (stall samples) as text under $OUT/ncu/. Kernels run isolated
# under ncu (caches flushed, launches serialized): the "cold" regime, not the PDL chain.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/devicecheck-out}"
mkdir -p "$OUT/ncu"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
echo "ncu: $NCU"; "$NCU" --version | tail -1
BUNDLE="${NCU_BUNDLE:-build/bundle-v41-flash-tp4}"
PROBES="${NCU_PROBES:-mhc_router:MhcPreSm90:2 mhc_router:RouterSm90:1 dense_w8a16:DenseStreamSm90:2 dense_w8a16:DenseW8A16Sm90:2 moe_routed:MoeW13Sm90|MoeW2Sm90:2 sparse_mqa:SparseMqaSm90:1}"
i=0
for probe in $PROBES; do
  IFS=: read -r family regex count <<< "$probe"
  i=$((i + 1)); tag="$i-$family"
  echo "== $tag: $regex x $count"
  timeout "${NCU_TIMEOUT:-120}" "$NCU" --clock-control none --set full --import-source no \
      -k "regex:$regex" --launch-count "$count" -f -o "$OUT/ncu/$tag" \
      python3 -m executor.devicecheck --skip-tests --quick --only "$family" --bundle "$BUNDLE" \
      --out "/tmp/ncu-$tag" > "$OUT/ncu/$tag.log" 2>&1
  echo "   exit $? ($(grep -c '==PROF==' "$OUT/ncu/$tag.log") profiler lines)"
  if [ -f "$OUT/ncu/$tag.ncu-rep" ]; then
    "$NCU" -i "$OUT/ncu/$tag.ncu-rep" --page details --print-details all > "$OUT/ncu/$tag-details.txt" 2>&1
    "$NCU" -i "$OUT/ncu/$tag.ncu-rep" --page source --print-source sass --csv \
        > "$OUT/ncu/$tag-sass.csv" 2>&1
    rm -f "$OUT/ncu/$tag.ncu-rep"
    grep -E "Duration|Memory Throughput|DRAM Throughput|Registers Per|Achieved Occupancy" \
        "$OUT/ncu/$tag-details.txt" | head -20
  fi
done
