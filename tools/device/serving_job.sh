#!/usr/bin/env bash
# One GPU run of the serving suite: every pairing of a prefill backend and a decode backend, through
# the CLI and, as a fallback that needs no CLI, step by step through the adapters' run_call:
#
#   1. setup: fla-core from .whl into /tmp/site, the aiter tree ($AITER, default .vendor/aiter-upstream)
#      on PYTHONPATH, versions, `kda-verify backends`
#   2. side by side on the one GPU, each bounded:
#      a. tools/device/serving_direct.py: every prefill route x decode route of its lists on the
#         generated scenarios (serving_direct.txt / .jsonl: worst o and state error per group and
#         step, anything written outside the step's slots), within $T_DIRECT
#      b. `python -m verification run --suite serving --backend P --decode-backend D` for every P in
#         $PREFILL and D in $DECODE (serving-P-D.txt and its results directory), within $T_CLI
#         (the suite is at K = V = 16 but for its long decode cases: FlashKDA's prefill, K = V = 128
#         only, is not applicable to most of it; serving_direct.py's traces are at K = V = 128);
#         a pairing whose decode backend has no route here (aiter's decode is Gluon, gfx950 / gfx1250
#         only) runs with --allow-nothing-verified
#   3. the summaries: serving_direct.txt, each run's report tail, then one .tgz per CLI run
#
#   OUT=DIR tools/device/serving_job.sh        (run from the repository root; all of it within 8 min)
#
# Carry .whl (fla-core) and the aiter tree.  Env: AITER, PREFILL (triton,aiter,fla), DECODE
# (fla,aiter), T_DIRECT (300 s), T_CLI (330 s), JOBS (6: CLI runs at a time; the pairings with
# aiter's decode end at once, not applicable on sm90), DEVICE (cuda),
# DIRECT_ARGS (more arguments of serving_direct.py, e.g. --pairs / --knobs for a rehearsal),
# NO_INSTALL (set: skip `pip install -e .`), DRY=1 (print the steps, run setup only).  DIR gets log.txt, serving_direct.*,
# serving-P-D.tgz.
set -u -o pipefail
export PYTHONUNBUFFERED=1 AITER_TRITON_ONLY=1
OUT=${OUT:?OUT: expected the output directory in the environment, got none}
AITER=${AITER:-.vendor/aiter-upstream} PREFILL=${PREFILL:-triton,aiter,fla} DECODE=${DECODE:-fla,aiter}
T_DIRECT=${T_DIRECT:-300} T_CLI=${T_CLI:-330} JOBS=${JOBS:-6} DRY=${DRY:-0} DEVICE=${DEVICE:-cuda}
DIRECT_ARGS=${DIRECT_ARGS:-}
[ -d "$AITER/aiter" ] || echo "serving_job.sh: AITER: no aiter/ in '$AITER': the aiter routes will say so"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
T0=$(date +%s)
. "$(dirname "$0")/lib.sh"      # step NAME TIMEOUT_S CMD...
pack() {   # pack NAME...: the tail of each run's output and its report, then one .tgz of both
  for d in "$@"; do
    [ -f "$OUT/$d.txt" ] || continue
    echo "--- $d: tail"; tail -n 30 "$OUT/$d.txt"
    [ -d "$OUT/$d" ] && timeout 60 python3 -m verification.cli report "$OUT/$d" >/dev/null 2>&1
    tar -czf "$OUT/$d.tgz" -C "$OUT" "$d.txt" $( [ -d "$OUT/$d" ] && echo "$d" ) && rm -rf "${OUT:?}/$d" "$OUT/$d.txt"
  done
}
if ls .whl/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; fi
python3 -c "import einops" 2>/dev/null || python3 -m pip install -q --no-deps --target /tmp/site einops >/dev/null 2>&1 \
  || echo "einops is not importable and could not be installed: fla's routes will say so"
[ -n "${NO_INSTALL:-}" ] || python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed: using PYTHONPATH"
export PYTHONPATH=/tmp/site:$PWD:$PWD/$AITER
step setup 60 bash -c '
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  python3 -c "import torch, triton; print(\"torch\", torch.__version__, \"triton\", triton.__version__, \"cuda\", torch.version.cuda)"
  python3 -c "import fla; print(\"fla-core\", fla.__version__)" || true'
[ -f "$AITER/ASSEMBLY.json" ] && python3 -c "import json,sys; a=json.load(open(sys.argv[1])); print('aiter base', a['base']['commit'][:10], '+', len(a['files']), 'files')" "$AITER/ASSEMBLY.json"
step backends 60 python3 -m verification.cli backends

# the CLI's serving runs, $JOBS at a time, each within T_CLI / (batches)
PAIRS=() ; for d in ${DECODE//,/ }; do for p in ${PREFILL//,/ }; do PAIRS+=("$p/$d"); done; done
BATCHES=$(( (${#PAIRS[@]} + JOBS - 1) / JOBS )); T_RUN=$(( T_CLI / (BATCHES > 0 ? BATCHES : 1) ))
cli_runs() {   # waits on its own runs by pid (a bare `wait` would also wait for the log's tee)
  local n=0 pids=()
  for pd in "${PAIRS[@]}"; do
    local p=${pd%/*} d=${pd#*/} extra=()
    [ "$d" = aiter ] && extra=(--allow-nothing-verified)
    ( timeout "$T_RUN" python3 -m verification run --suite serving --backend "$p" --decode-backend "$d" \
        --device "$DEVICE" --out "$OUT/serving-$p-$d" "${extra[@]}" > "$OUT/serving-$p-$d.txt" 2>&1
      echo "exit $? at +$(( $(date +%s) - T0 ))s" >> "$OUT/serving-$p-$d.txt" ) &
    pids+=($!); n=$(( n + 1 ))
    if [ $(( n % JOBS )) = 0 ]; then wait "${pids[@]}"; pids=(); fi
  done
  [ ${#pids[@]} = 0 ] || wait "${pids[@]}"
}
if [ "$DRY" = 1 ]; then
  echo "(dry run) serving_direct.py within ${T_DIRECT}s; CLI: ${PAIRS[*]}, $JOBS at a time, ${T_RUN}s each"
else
  echo; echo "=== direct + CLI side by side at +$(( $(date +%s) - T0 ))s (CLI runs ${T_RUN}s each, $JOBS at a time)"
  ( timeout "$T_DIRECT" python3 tools/device/serving_direct.py --out "$OUT" --device "$DEVICE" --budget $(( T_DIRECT - 60 )) $DIRECT_ARGS \
      > "$OUT/direct.txt" 2>&1; echo "exit $? at +$(( $(date +%s) - T0 ))s" >> "$OUT/direct.txt" ) &
  DIRECT=$!
  cli_runs
  wait "$DIRECT"
  echo "=== direct + CLI done at +$(( $(date +%s) - T0 ))s"
fi
echo "--- serving_direct"; cat "$OUT/serving_direct.txt" 2>/dev/null || tail -n 40 "$OUT/direct.txt"
for pd in "${PAIRS[@]}"; do pack "serving-${pd%/*}-${pd#*/}"; done
echo "=== done at +$(( $(date +%s) - T0 ))s"
