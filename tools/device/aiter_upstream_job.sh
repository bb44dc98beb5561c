#!/usr/bin/env bash
# One GPU run of the aiter backend on an upstream ROCm/aiter tree (kimi_delta_attn FlashKDA and
# attention/chunk_kda.py), carried in .vendor/ (never committed):
#
#   1. setup, and `kda-verify backends` with the tree (the version string says what it has)
#   2. a probe: smoke/paged-lb-5 and smoke/initial-state-kv-lb-5 through chunk_kda:triton and
#      triton:unseg (what ran, o finite, the cache's strides); a traceback stays in the log
#   3. the matrix: pytest -m verify --kda-backend aiter over $SUITES (smoke, default, stress,
#      k3-prefill; the paged cells are smoke/paged-lb-5 and all of k3-prefill) on $ROUTES, and at the
#      same time --kda-suite fuzz --kda-fuzz-n $FUZZ_N (a quarter of its cases paged) on $FUZZ_ROUTES
#
#   OUT=DIR tools/device/aiter_upstream_job.sh [TREE]        (run from the repository root)
#
# TREE: the directory holding aiter/ (default .vendor/aiter-upstream).  Needs a CUDA torch and
# pytest-xdist.  Env: ROUTES (chunk_kda:triton, the four Triton FlashKDA routes, and chunk_kda:gluon
# and gluon:seg:cps=1, which are not applicable off gfx1250 / gfx950 and say so), FUZZ_ROUTES
# (chunk_kda:triton,triton:unseg), FUZZ_N (500), JOBS (8, pytest -n), SUITES, T_MATRIX (360 s: the whole job then fits one 600 s call).
# DRY=1 prints the steps and runs setup only.  DIR gets log.txt, matrix.tgz, fuzz.tgz (results,
# reports, tails).
set -u -o pipefail
export PYTHONUNBUFFERED=1 AITER_TRITON_ONLY=1
OUT=${OUT:?OUT: expected the output directory in the environment, got none}
TREE=${1:-.vendor/aiter-upstream}
ROUTES=${ROUTES:-chunk_kda:triton,triton:unseg,triton:seg,triton:seg:cps=1,triton:seg:cps=4,chunk_kda:gluon,gluon:seg:cps=1}
FUZZ_ROUTES=${FUZZ_ROUTES:-chunk_kda:triton,triton:unseg} FUZZ_N=${FUZZ_N:-500} JOBS=${JOBS:-8}
SUITES=${SUITES:-smoke,default,stress,k3-prefill} T_MATRIX=${T_MATRIX:-360} DRY=${DRY:-0}
[ -d "$TREE/aiter" ] || { echo "aiter_upstream_job.sh: TREE: expected a directory holding aiter/, got '$TREE'"; exit 2; }
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
T0=$(date +%s)
. "$(dirname "$0")/lib.sh"      # step NAME TIMEOUT_S CMD...
PY=python3
step setup 60 bash -c '
  python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed: using PYTHONPATH"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  python3 -c "import torch, triton; print(\"torch\", torch.__version__, \"triton\", triton.__version__, \"cuda\", torch.version.cuda)"'
export PYTHONPATH=$PWD/$TREE:$PWD${PYTHONPATH:+:$PYTHONPATH}
PLUGIN=()
$PY -c "import importlib.metadata as m, sys; sys.exit(0 if any(e.name == 'kda_verify' for e in m.entry_points(group='pytest11')) else 1)" \
  || PLUGIN=(-p verification.pytest_plugin)
for f in ASSEMBLY.json COMMIT README.txt; do [ -f "$TREE/$f" ] && { echo "--- $TREE/$f"; cat "$TREE/$f"; }; done

step backends 40 $PY -m verification.cli backends
step probe 90 $PY -c '
import torch, traceback
from kda_kernels.aiter import AiterBackend
from verification.running.cases import get_case
b = AiterBackend()
print("version:", b.version(), "| available:", b.available())
by = {r.name: r for r in b.routes()}
for cid in ("smoke/paged-lb-5", "smoke/initial-state-kv-lb-5"):
    p = get_case(cid).build("cuda")
    for r in ("chunk_kda:triton", "triton:unseg", "chunk_kda:gluon"):
        try:
            ok, why = b.accepts(p, by[r])
            if not ok:
                print(cid, r, why); continue
            out = b.run(p, by[r])
            torch.cuda.synchronize()
            print(cid, r, "ran:", out.info["route_ran"], "| o finite:", bool(out.o.float().isfinite().all()),
                  "| cache strides", None if out.state_cache is None else tuple(out.state_cache.stride()))
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
# the matrix and the fuzz draw share the GPU; each is packed as soon as it ends, so a run cut short
# still brings back what finished
step matrix+fuzz $(( T_MATRIX + 15 )) bash -c "
  timeout $T_MATRIX ${VERIFY[*]} --kda-suite $SUITES --kda-route '$ROUTES' --kda-report '$OUT/matrix' > '$OUT/matrix.txt' 2>&1 &
  timeout $T_MATRIX ${VERIFY[*]} --kda-suite fuzz --kda-fuzz-n $FUZZ_N --kda-route '$FUZZ_ROUTES' --kda-report '$OUT/fuzz' > '$OUT/fuzz.txt' 2>&1 &
  wait"
pack matrix fuzz
echo "=== done at +$(( $(date +%s) - T0 ))s"
