#!/usr/bin/env bash
# One H200 run of the aiter backend on aiter's newest public FlashKDA layout (the tree
# tools/assemble_aiter.py builds), then the same suites on the 2026-08 tree for comparison:
#
#   1. setup, and `kda-verify backends` with each tree (the version string says what it has)
#   2. a probe: one paged smoke cell through the adapter (fast_launch, paged cache, out=); if it
#      fails, the log keeps the traceback and the matrix still runs (each cell then says why)
#   3. newest: pytest -m verify --kda-backend aiter --kda-suite smoke,stress,k3-prefill (every
#      Triton route, paged cells included) and, at the same time, --kda-suite fuzz
#      --kda-fuzz-n $FUZZ_N on the routes $FUZZ_ROUTES
#   4. 2026-08: the matrix over $OLD_SUITES (smoke,stress: k3-prefill is all paged, which 2026-08 lacks)
#
#   OUT=DIR tools/device/aiter_job.sh [NEWEST [OLD]]     (run from the repository root)
#
# NEWEST / OLD: the directories holding aiter/ (default .vendor/aiter-newest, .vendor/aiter-2026-08);
# a missing OLD skips step 4.  Needs a CUDA torch and pytest-xdist.
# Env: FUZZ_N (2000), JOBS (8, pytest -n), FUZZ_ROUTES (triton:unseg,triton:seg:cps=1), ROUTES (the
# matrix's: the four Triton routes, gluon:seg:cps=1, triton:seg:prefetch=on),
# T_MATRIX / T_OLD (seconds each step may take: 150 / 45), OLD_SUITES (smoke,stress).  DRY=1 prints the steps and runs the
# CPU ones (a rehearsal).  DIR gets log.txt, newest.tgz, fuzz.tgz, old.tgz (results, reports, tails).
set -u -o pipefail
export PYTHONUNBUFFERED=1 AITER_TRITON_ONLY=1
OUT=${OUT:?OUT: expected the output directory in the environment, got none}
NEWEST=${1:-.vendor/aiter-newest}
OLD=${2:-.vendor/aiter-2026-08}
FUZZ_N=${FUZZ_N:-2000} JOBS=${JOBS:-8} FUZZ_ROUTES=${FUZZ_ROUTES:-triton:unseg,triton:seg:cps=1}
# the four Triton routes, and one Gluon and one prefetch route (not applicable here: the report says why)
ROUTES=${ROUTES:-triton:unseg,triton:seg,triton:seg:cps=1,triton:seg:cps=4,gluon:seg:cps=1,triton:seg:prefetch=on}
T_MATRIX=${T_MATRIX:-150} T_OLD=${T_OLD:-45} OLD_SUITES=${OLD_SUITES:-smoke,stress}
DRY=${DRY:-0}
[ -d "$NEWEST/aiter" ] || { echo "aiter_job.sh: NEWEST: expected a directory holding aiter/, got '$NEWEST'"; exit 2; }
mkdir -p "$OUT"
LOG="$OUT/log.txt"
exec > >(tee -a "$LOG") 2>&1
T0=$(date +%s)
. "$(dirname "$0")/lib.sh"      # step NAME TIMEOUT_S CMD...
PY=python3
step setup 60 bash -c '
  python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed: using PYTHONPATH"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  python3 -c "import torch, triton; print(\"torch\", torch.__version__, \"triton\", triton.__version__, \"cuda\", torch.version.cuda)"'
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PLUGIN=()
$PY -c "import importlib.metadata as m, sys; sys.exit(0 if any(e.name == 'kda_verify' for e in m.entry_points(group='pytest11')) else 1)" \
  || PLUGIN=(-p verification.pytest_plugin)
echo "pytest plugin: ${PLUGIN[*]:-entry point}"
[ -f "$NEWEST/ASSEMBLY.json" ] && { echo "--- $NEWEST/ASSEMBLY.json"; cat "$NEWEST/ASSEMBLY.json"; }
[ -f "$OLD/COMMIT" ] && echo "--- $OLD: ROCm/aiter $(cat "$OLD/COMMIT")"

NEW_PP="$PWD/$NEWEST:$PYTHONPATH"
step backends 40 env PYTHONPATH="$NEW_PP" $PY -m verification.cli backends
step probe 60 env PYTHONPATH="$NEW_PP" $PY -c '
import torch, traceback
from kda_kernels.aiter import AiterBackend
from kda_kernels.base import Route
from verification.running.cases import get_case
b = AiterBackend()
print("version:", b.version(), "| available:", b.available())
p = get_case("smoke/paged-lb-5").build("cuda")
for r in ("triton:unseg", "triton:seg:cps=1"):
    try:
        out = b.run(p, Route(r, recipe="flashkda"))
        torch.cuda.synchronize()
        print(r, "ran:", out.info["route_ran"], "| o finite:", bool(out.o.float().isfinite().all()),
              "| cache stride", tuple(out.state_cache.stride()), "vs", tuple(p.state_cache.stride()))
    except Exception:
        traceback.print_exc()
'

VERIFY=($PY -m pytest -q -p no:cacheprovider "${PLUGIN[@]}" -m verify tests/test_verify_matrix.py --kda-backend aiter
        -n "$JOBS" --dist loadgroup -rfEx)
pack() {   # pack NAME...: the report of each results directory, then one .tgz with its pytest output
  for d in "$@"; do
    [ -f "$OUT/$d.txt" ] || continue
    echo "--- $d: tail"; tail -n 40 "$OUT/$d.txt"
    [ -d "$OUT/$d" ] && timeout 60 $PY -m verification.cli report "$OUT/$d" >/dev/null 2>&1
    tar -czf "$OUT/$d.tgz" -C "$OUT" "$d.txt" $( [ -d "$OUT/$d" ] && echo "$d" ) && rm -rf "${OUT:?}/$d" "$OUT/$d.txt"
  done
}
N="$OUT/newest" F="$OUT/fuzz" O="$OUT/old"
# the matrix and the fuzz draw share the GPU (fuzz cells are tiny); each is packed as soon as it ends,
# so a run cut short still brings back what finished
step newest+fuzz $(( T_MATRIX + 10 )) bash -c "
  PYTHONPATH='$NEW_PP' timeout $T_MATRIX ${VERIFY[*]} --kda-suite smoke,stress,k3-prefill --kda-route '$ROUTES' --kda-report '$N' > '$OUT/newest.txt' 2>&1 &
  PYTHONPATH='$NEW_PP' timeout $T_MATRIX ${VERIFY[*]} --kda-suite fuzz --kda-fuzz-n $FUZZ_N --kda-route '$FUZZ_ROUTES' --kda-report '$F' > '$OUT/fuzz.txt' 2>&1 &
  wait"
pack newest fuzz
if [ -d "$OLD/aiter" ]; then
  step old $T_OLD env PYTHONPATH="$PWD/$OLD:$PYTHONPATH" bash -c \
    "${VERIFY[*]} --kda-suite $OLD_SUITES --kda-route '$ROUTES' --kda-report '$O' > '$OUT/old.txt' 2>&1"
  pack old
fi
echo "=== done at +$(( $(date +%s) - T0 ))s"
