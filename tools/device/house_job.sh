#!/usr/bin/env bash
# One H200 run of what the house step must keep and the first production checks, side by side:
#
#   1. Moonshot's flash_kda built in the background (MAX_JOBS=$BUILD_JOBS); the installed files
#      come back as flash_kda-built.tgz (split into 15 MB parts when larger), for later runs
#   2. tools/device/bitwise_trees.py in the tree BEFORE (an export of the commit before the move)
#      and in this tree, then compared: every Triton route, six problems, bit for bit
#   3. then `pytest -m verify --kda-backend triton` over the four suites in each tree ($JOBS
#      workers each, side by side), counts in before.txt / after.txt
#   4. `kda-verify mutate --device cuda` in this tree
#   5. aiter ($AITER) over the fuzz cases named by $AITER_CASES on two routes (the draw of
#      $FUZZ_N)
#
#   OUT=DIR BEFORE=DIR tools/device/house_job.sh     (run from the repository root)
#
# Carry .whl (fla-core), .vendor/flashkda, the aiter tree and BEFORE.  Env: JOBS (4), BUILD_JOBS (4),
# T_ALL (540), AITER (.vendor/aiter-newest), FUZZ_N (2000), AITER_CASES (glob list, comma-separated),
# STEPS (build,bitwise,suites,mutate,aiter).
set -u -o pipefail
export PYTHONUNBUFFERED=1 AITER_TRITON_ONLY=1
OUT=${OUT:?OUT: expected the output directory in the environment, got none}
BEFORE=${BEFORE:?BEFORE: expected the before tree (a directory) in the environment, got none}
JOBS=${JOBS:-4} BUILD_JOBS=${BUILD_JOBS:-4} T_ALL=${T_ALL:-540} AITER=${AITER:-.vendor/aiter-newest}
FUZZ_N=${FUZZ_N:-2000} AITER_CASES=${AITER_CASES:-} STEPS=${STEPS-build,bitwise,suites,mutate,aiter}
want() { case ",$STEPS," in *",$1,"*) return 0;; *) return 1;; esac; }
[ -d "$BEFORE/kda_kernels" ] || { echo "house_job.sh: BEFORE: expected a source tree with kda_kernels/, got '$BEFORE'"; exit 2; }
BEFORE=$(cd "$BEFORE" && pwd) HERE=$PWD
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
T0=$(date +%s)
left() { echo $(( T_ALL - ($(date +%s) - T0) )); }
if ls .whl/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
VERIFY=(python3 -m pytest -q -p no:cacheprovider -p verification.pytest_plugin -m verify tests/test_verify_matrix.py --dist loadgroup -rfEx)
PIDS=()
if want build; then
  ( MAX_JOBS=$BUILD_JOBS NVCC_THREADS=2 timeout "$(left)" tools/build_flash_kda.sh .vendor/flashkda > "$OUT/build.txt" 2>&1
    echo "build exit $? at +$(( $(date +%s) - T0 ))s" >> "$OUT/build.txt"
    loc=$(cd / && python3 -c "import importlib.metadata as m; d = m.distribution('flash_kda'); print(d.locate_file(''))" 2>/dev/null) || exit 0
    files=$(cd / && python3 -c "import importlib.metadata as m; print('\n'.join(str(f) for f in m.distribution('flash_kda').files if '__pycache__' not in str(f)))")
    (cd "$loc" && tar -czf /tmp/flash_kda-built.tgz $files) && ls -l /tmp/flash_kda-built.tgz >> "$OUT/build.txt"
    split -b 15m -d /tmp/flash_kda-built.tgz "$OUT/flash_kda-built.tgz.part" ) &
  PIDS+=($!)
fi
tree_run() {   # tree_run NAME TREE: bitwise dump, then the four suites on triton, in TREE
  local name=$1 tree=$2
  cd "$tree" || return
  export PYTHONPATH=/tmp/site:$tree
  if want bitwise; then
    timeout "$(left)" python3 "$HERE/tools/device/bitwise_trees.py" dump "$OUT/$name.pt" > "$OUT/$name-bitwise.txt" 2>&1
    echo "=== $name bitwise dump: exit $? at +$(( $(date +%s) - T0 ))s"
  fi
  if want suites; then
    timeout "$(left)" "${VERIFY[@]}" -n "$JOBS" --kda-backend triton --kda-suite smoke,default,stress,k3-prefill \
      --kda-report "$OUT/$name-suites" > "$OUT/$name.txt" 2>&1
    echo "=== $name suites: exit $? at +$(( $(date +%s) - T0 ))s"
  fi
}
( tree_run before "$BEFORE" ) & PIDS+=($!)
( tree_run after "$HERE" ) & PIDS+=($!)
if want mutate; then
  ( export PYTHONPATH=/tmp/site:$HERE; timeout "$(left)" python3 -m verification.cli mutate --device cuda --jobs 4 \
      --json-out "$OUT/mutants.json" > "$OUT/mutate.txt" 2>&1; echo "=== mutate: exit $? at +$(( $(date +%s) - T0 ))s" ) &
  PIDS+=($!)
fi
if want aiter && [ -n "$AITER_CASES" ]; then
  C=(); IFS=',' read -r -a globs <<< "$AITER_CASES"; for g in "${globs[@]}"; do C+=(--kda-case "$g"); done
  ( export PYTHONPATH=/tmp/site:$HERE:$HERE/$AITER; timeout "$(left)" "${VERIFY[@]}" -n 2 --kda-backend aiter \
      --kda-route triton:unseg,triton:seg:cps=1 --kda-suite fuzz --kda-fuzz-n "$FUZZ_N" "${C[@]}" \
      --kda-report "$OUT/aiter-fuzz" > "$OUT/aiter-fuzz.txt" 2>&1; echo "=== aiter fuzz: exit $? at +$(( $(date +%s) - T0 ))s" ) &
  PIDS+=($!)
fi
wait "${PIDS[@]}"
cd "$HERE"
want bitwise && [ -f "$OUT/before.pt" ] && [ -f "$OUT/after.pt" ] && PYTHONPATH=$HERE python3 tools/device/bitwise_trees.py compare "$OUT/before.pt" "$OUT/after.pt" | tee "$OUT/bitwise.txt" | tail -n 30
for f in before-bitwise after-bitwise build mutate; do [ -f "$OUT/$f.txt" ] && { echo "--- $f"; tail -n 8 "$OUT/$f.txt"; }; done
for d in before after aiter-fuzz; do
  [ -f "$OUT/$d.txt" ] || continue
  echo "--- $d"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/$d.txt" | tail -n 30
done
rm -f "$OUT"/*.pt
keep=$(cd "$OUT" && ls -d *.txt *.json before-suites/results*.jsonl before-suites/report.md after-suites/results*.jsonl \
  after-suites/report.md aiter-fuzz/results*.jsonl aiter-fuzz/report.md 2>/dev/null | grep -v '^log.txt$')
tar -czf "$OUT/results.tgz" -C "$OUT" $keep && (cd "$OUT" && rm -rf $keep before-suites after-suites aiter-fuzz)
# over the 15 MB a result file may be: back in parts (cat results.tgz.part* > results.tgz)
[ "$(stat -c %s "$OUT/results.tgz")" -gt 15000000 ] && split -b 15m -d "$OUT/results.tgz" "$OUT/results.tgz.part" && rm "$OUT/results.tgz"
ls -l "$OUT"
echo "=== done at +$(( $(date +%s) - T0 ))s"
