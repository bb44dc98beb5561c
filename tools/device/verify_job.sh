#!/usr/bin/env bash
# One H200 run of the per-slice verdicts over the production backends: the four suites and fuzz
# on triton, fla and aiter (2026-08 tree), the mutants on CUDA, the planted-bug table and the
# per-slice metrics' cost, every step bounded and logged under OUT.
#
#   OUT=DIR tools/device/verify_job.sh          (run from the repository root)
#
# Carry .whl (the fla-core wheel) and .vendor/aiter-2026-08 (aiter's aiter/ tree).  Env: FUZZ_N
# (2000), JOBS (8), STEPS (matrix,fuzz,mutate,planted,slices).  OUT gets log.txt, matrix.tgz,
# fuzz.tgz, mutants.json, planted.md, slices.txt.
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:?OUT: expected the output directory in the environment, got none}
FUZZ_N=${FUZZ_N:-2000} JOBS=${JOBS:-8} STEPS=${STEPS:-matrix,fuzz,mutate,planted,slices}
want() { case ",$STEPS," in *",$1,"*) return 0;; *) return 1;; esac; }
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
T0=$(date +%s)
step() {   # step NAME TIMEOUT_S CMD...
  local name=$1 lim=$2; shift 2
  echo; echo "=== $name (limit ${lim}s, at +$(( $(date +%s) - T0 ))s): $*"
  local t=$(date +%s); timeout "$lim" "$@"; local rc=$?
  echo "=== $name: exit $rc after $(( $(date +%s) - t ))s"
}
if ls .whl/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed: using PYTHONPATH"
export PYTHONPATH=/tmp/site:$PWD:$PWD/.vendor/aiter-2026-08 AITER_TRITON_ONLY=1
PLUGIN=()
python3 -c "import importlib.metadata as m, sys; sys.exit(0 if any(e.name == 'kda_verify' for e in m.entry_points(group='pytest11')) else 1)" \
  || PLUGIN=(-p verification.pytest_plugin)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -m verification.cli backends
VERIFY=(python3 -m pytest -q -p no:cacheprovider "${PLUGIN[@]}" -m verify tests/test_verify_matrix.py
        --kda-backend triton,fla,aiter -n "$JOBS" --dist loadgroup -rfEx)
want matrix && step matrix 420 "${VERIFY[@]}" --kda-suite smoke,default,stress,k3-prefill --kda-report "$OUT/matrix"
want fuzz && step fuzz 300 "${VERIFY[@]}" --kda-suite fuzz --kda-fuzz-n "$FUZZ_N" \
  --kda-route seg,unseg:BW=64:inv=bf16x6,chunk:safe_gate,triton:seg --kda-report "$OUT/fuzz"
for d in matrix fuzz; do [ -d "$OUT/$d" ] && tar -czf "$OUT/$d.tgz" -C "$OUT" "$d" && rm -rf "${OUT:?}/$d"; done
want mutate && step mutate 300 python3 -m verification.cli mutate --device cuda --jobs "$JOBS" --json-out "$OUT/mutants.json"
want planted && step planted 120 bash -c "python3 -m verification.planted --device cuda > '$OUT/planted.md'"
want slices && step slices 120 bash -c "python3 tools/device/slice_cost.py --device cuda > '$OUT/slices.txt'"
cat "$OUT/planted.md" "$OUT/slices.txt" 2>/dev/null
echo "total $(( $(date +%s) - T0 )) s"
