#!/usr/bin/env bash
# One H200 run of the per-slice verdicts over the production backends: the four suites and fuzz
# on triton, fla and aiter (2026-08 tree), the mutants on CUDA, the planted-bug table and the
# per-slice metrics' cost, every step bounded and logged under OUT.
#
#   OUT=DIR tools/device/verify_job.sh          (run from the repository root)
#
# Carry .whl (the fla-core wheel) and .vendor/aiter-2026-08 (aiter's aiter/ tree).  Env: FUZZ_N
# (2000), JOBS (8), STEPS (oracle,matrix,fuzz,mutate,planted,slices), T_MATRIX (240 s: matrix and fuzz run
# side by side), T_MUTATE (150 s), ORACLE_SHAPES (oracle-bench's, into the log).  OUT gets log.txt,
# matrix.tgz, fuzz.tgz, mutants.json, planted.md, slices.txt.
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:?OUT: expected the output directory in the environment, got none}
FUZZ_N=${FUZZ_N:-2000} JOBS=${JOBS:-8} STEPS=${STEPS:-oracle,matrix,fuzz,mutate,planted,slices}
T_MATRIX=${T_MATRIX:-240} T_MUTATE=${T_MUTATE:-150}
ORACLE_SHAPES=${ORACLE_SHAPES:-1x16384x96,1x65536x12,1x131072x12,1x262144x12,1x1048576x12,1x131072x96}
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
want oracle && step oracle-bench 120 python3 -m verification.cli oracle-bench --device cuda --no-recurrence \
  --shapes "$ORACLE_SHAPES"
# the matrix and fuzz share the GPU (fuzz cells are tiny); each keeps its own report
MF=()
want matrix && MF+=("timeout $T_MATRIX ${VERIFY[*]} --kda-suite smoke,default,stress,k3-prefill --kda-report '$OUT/matrix' > '$OUT/matrix.txt' 2>&1 &")
want fuzz && MF+=("timeout $T_MATRIX ${VERIFY[*]} --kda-suite fuzz --kda-fuzz-n $FUZZ_N --kda-route seg,unseg:BW=64:inv=bf16x6,chunk:safe_gate,triton:seg --kda-report '$OUT/fuzz' > '$OUT/fuzz.txt' 2>&1 &")
[ ${#MF[@]} -gt 0 ] && step matrix+fuzz $(( T_MATRIX + 10 )) bash -c "${MF[*]} wait"
for d in matrix fuzz; do [ -f "$OUT/$d.txt" ] && { echo "--- $d: tail"; tail -n 30 "$OUT/$d.txt"; }; done
for d in matrix fuzz; do [ -d "$OUT/$d" ] && tar -czf "$OUT/$d.tgz" -C "$OUT" "$d" $( [ -f "$OUT/$d.txt" ] && echo "$d.txt" ) && rm -rf "${OUT:?}/$d" "$OUT/$d.txt"; done
want mutate && step mutate "$T_MUTATE" python3 -m verification.cli mutate --device cuda --jobs "$JOBS" --json-out "$OUT/mutants.json"
want planted && step planted 60 bash -c "python3 tests/planted.py --device cuda > '$OUT/planted.md'"
want slices && step slices 60 bash -c "python3 tools/device/slice_cost.py --device cuda > '$OUT/slices.txt'"
cat "$OUT/planted.md" "$OUT/slices.txt" 2>/dev/null
echo "total $(( $(date +%s) - T0 )) s"
