#!/usr/bin/env bash
# One SM90 run that builds Moonshot's FlashKDA and verifies it: the build, the adapter's GPU tests
# (invariances, contract probes), the matrix smoke+default+stress+k3-prefill on both routes, fuzz
# (route cutlass:state=fp32; the bf16 route gives the same bits, tested), and the bench side by
# side with triton and fla (configs pinned), then aiter where its tree is present.
#
#   OUT=DIR tools/device/moonshot_job.sh [SRC]     (run from the repository root)
#
# SRC: the FlashKDA tree (default .vendor/flashkda, made by tools/vendor_flash_kda.sh).  Needs
# nvcc, a CUDA torch, pytest-xdist.  .whl/ (the fla-core wheel) and .vendor/aiter* are optional.
# Env: FUZZ_N (2000), JOBS (8, pytest -n), BENCH_REPS (20), SHAPES (the default suite's + 1x8192x96),
# STEPS (build,backends,gpu-tests,matrix,probe,bench: the steps to run), PROBE_PARTS (the probe's --parts).
# Every step is bounded (timeout) and logged; DIR gets log.txt, matrix.tgz, fuzz.tgz, probe.json
# (tools/device/moonshot_probe.py), bench.json, bench_aiter.json (at most 8 files).
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:?OUT: expected the output directory in the environment, got none}
SRC=${1:-.vendor/flashkda}
FUZZ_N=${FUZZ_N:-2000} JOBS=${JOBS:-8} BENCH_REPS=${BENCH_REPS:-20}
SHAPES=${SHAPES:-"1x256x12;1x512x12;1x1664x12;1x2048x12;1x8192x12;1x16384x12;1x16384x64;1x16384x96;1x8192x32;1x8192x64;2x2664x12;4x4096x16;8x2048x16;1x8192x96"}
STEPS=${STEPS:-build,backends,gpu-tests,matrix,probe,bench} PROBE_PARTS=${PROBE_PARTS:-1,2,3,4,5}
want() { case ",$STEPS," in *",$1,"*) return 0;; *) return 1;; esac; }
DRY=${DRY:-0}     # DRY=1: every step printed and the non-GPU ones run (a CPU machine's rehearsal)
mkdir -p "$OUT"
LOG="$OUT/log.txt"
exec > >(tee -a "$LOG") 2>&1
T0=$(date +%s)
step() {   # step NAME TIMEOUT_S CMD...: run CMD bounded, log its wall time and exit status
  local name=$1 lim=$2; shift 2
  echo; echo "=== $name (limit ${lim}s, at +$(( $(date +%s) - T0 ))s): $*"
  local t=$(date +%s)
  if [ "$DRY" = 1 ] && [ "$name" != setup ] && [ "$name" != backends ]; then echo "(dry run)"; return 0; fi
  timeout "$lim" "$@"; local rc=$?
  echo "=== $name: exit $rc after $(( $(date +%s) - t ))s"
  return 0
}
PY=python3
step setup 60 bash -c '
  set -e
  if ls .whl/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; fi
  python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed: using PYTHONPATH"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  python3 -c "import torch, triton; print(\"torch\", torch.__version__, \"triton\", triton.__version__, \"cuda\", torch.version.cuda)"
  nvcc --version | tail -1 || /usr/local/cuda/bin/nvcc --version | tail -1'
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
PLUGIN=()
$PY -c "import importlib.metadata as m, sys; sys.exit(0 if any(e.name == 'kda_verify' for e in m.entry_points(group='pytest11')) else 1)" \
  || PLUGIN=(-p verification.pytest_plugin)
echo "pytest plugin: ${PLUGIN[*]:-entry point}"

want build && step build 240 tools/build_flash_kda.sh "$SRC"
want backends && step backends 30 $PY -m verification.cli backends --json
want gpu-tests && step gpu-tests 120 $PY -m pytest -q -p no:cacheprovider -m gpu -rA tests/test_moonshot.py

M="$OUT/matrix" F="$OUT/fuzz"
VERIFY=($PY -m pytest -q -p no:cacheprovider "${PLUGIN[@]}" -m verify tests/test_verify_matrix.py --kda-backend moonshot
        -n "$JOBS" --dist loadgroup -rfEsx)
# the matrix and fuzz share the GPU with the probe; fuzz cells are tiny
if want matrix; then
step matrix+fuzz 240 bash -c "
  timeout 230 ${VERIFY[*]} --kda-suite smoke,default,stress,k3-prefill --kda-report '$M' > '$OUT/matrix.txt' 2>&1 &
  timeout 230 ${VERIFY[*]} --kda-suite fuzz --kda-fuzz-n $FUZZ_N --kda-route cutlass:state=fp32 --kda-report '$F' > '$OUT/fuzz.txt' 2>&1 &
  $(want probe && echo "timeout 230 $PY tools/device/moonshot_probe.py --parts $PROBE_PARTS --json '$OUT/probe.json' > '$OUT/probe.txt' 2>&1 &")
  wait"
elif want probe; then
  step probe 120 bash -c "$PY tools/device/moonshot_probe.py --parts $PROBE_PARTS --json '$OUT/probe.json' > '$OUT/probe.txt' 2>&1"
fi
echo "--- probe"; cat "$OUT/probe.txt" 2>/dev/null; rm -f "$OUT/probe.txt"
for d in matrix fuzz; do
  [ -f "$OUT/$d.txt" ] || continue
  echo "--- $d: tail"; tail -n 60 "$OUT/$d.txt" 2>/dev/null
  [ -f "$OUT/$d/report.md" ] || timeout 60 $PY -m verification.cli report "$OUT/$d" >/dev/null 2>&1 || true
done
for d in matrix fuzz; do
  [ -d "$OUT/$d" ] && tar -czf "$OUT/$d.tgz" -C "$OUT" "$d" "$d.txt" && rm -rf "${OUT:?}/$d" "$OUT/$d.txt"
done

JSON=--json
$PY -m verification.cli bench --help 2>/dev/null | grep -q -- '--json-out' && JSON=--json-out
want bench && step bench 150 $PY -m verification.cli bench --backend triton,fla-pinned,moonshot --routes seg:BW=64:inv=bf16x6 \
  --shapes "$SHAPES" --reps "$BENCH_REPS" --warmup 3 $JSON "$OUT/bench.json"
AITER=.vendor/aiter-2026-08      # the directory holding aiter/ (optional)
if want bench && [ -d "$AITER/aiter" ]; then
  step bench-aiter 60 env PYTHONPATH="$PWD/$AITER:$PYTHONPATH" AITER_TRITON_ONLY=1 $PY -m verification.cli bench \
    --backend triton,moonshot,aiter --routes seg:BW=64:inv=bf16x6 --shapes "1x16384x12;1x8192x96" \
    --reps "$BENCH_REPS" --warmup 3 $JSON "$OUT/bench_aiter.json"
fi
echo "=== done at +$(( $(date +%s) - T0 ))s"
