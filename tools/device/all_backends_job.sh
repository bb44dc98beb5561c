#!/usr/bin/env bash
# One SM90 run of every backend under the current verdict rules, inside one call's time:
#
#   1. the oracle's long-context figures (oracle-bench on the long shapes), on an idle GPU
#   2. Moonshot's flash_kda built in the background (tools/build_flash_kda.sh, MAX_JOBS=$BUILD_JOBS)
#   3. meanwhile the pytest runs of $RUNS side by side on the one GPU (NAME|BACKENDS|SUITES|ROUTES|WORKERS;
#      ROUTES - for every route; default: aiter (the tree in $AITER) over default and fuzz on two routes,
#      triton and fla over fuzz on one production route each)
#   4. once the build is done: moonshot over $MOONSHOT_SUITES (the four suites and fuzz $FUZZ_N)
#   5. the GPU memory of every process, sampled every 5 s (mem.csv: peak per worker)
#
#   OUT=DIR tools/device/all_backends_job.sh     (run from the repository root)
#
# Carry .whl (fla-core), .vendor/flashkda (tools/vendor_flash_kda.sh) and the aiter tree
# (.vendor/aiter-newest from tools/assemble_aiter.py, or .vendor/aiter-2026-08).  Env: AITER,
# FUZZ_N (2000), RUNS, JOBS_M (8: moonshot's workers), MOONSHOT_SUITES, BUILD_JOBS (8), T_ALL
# (460 s: what every step after the oracle bench must end within), STEPS (oracle,build,moonshot),
# FLASH_KDA_BUILT (a .tgz of an installed flash_kda, as house_job.sh returns it: unpacked into the
# path instead of a build), T_ORACLE (90 s: the oracle bench's limit),
# NO_INSTALL (set: skip `pip install -e .`, for a rehearsal on a machine whose install must stay).  DIR gets log.txt, mem.csv and one .tgz per run
# (results-*.jsonl, report.md and the pytest output; the plots stay behind to keep files small).
set -u -o pipefail
export PYTHONUNBUFFERED=1 AITER_TRITON_ONLY=1
OUT=${OUT:?OUT: expected the output directory in the environment, got none}
AITER=${AITER:-.vendor/aiter-newest} FUZZ_N=${FUZZ_N:-2000}
JOBS_M=${JOBS_M:-8} BUILD_JOBS=${BUILD_JOBS:-8} T_ALL=${T_ALL:-460}
RUNS=${RUNS:-"aiter|aiter|default,fuzz|triton:unseg,triton:seg:cps=1|4;triton-fla|triton,fla|fuzz|seg,chunk:safe_gate|4"}
MOONSHOT_SUITES=${MOONSHOT_SUITES:-smoke,default,stress,k3-prefill,fuzz}
ORACLE_SHAPES=${ORACLE_SHAPES:-1x16384x96,1x65536x12,1x1048576x12,1x131072x96}
STEPS=${STEPS-oracle,build,moonshot}
want() { case ",$STEPS," in *",$1,"*) return 0;; *) return 1;; esac; }
[ -d "$AITER/aiter" ] || { echo "all_backends_job.sh: AITER: expected a directory holding aiter/, got '$AITER'"; exit 2; }
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
T0=$(date +%s)
left() { echo $(( T_ALL - ($(date +%s) - T0) )); }
if ls .whl/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; fi
if [ -n "${FLASH_KDA_BUILT:-}" ]; then mkdir -p /tmp/site && tar -xzf "$FLASH_KDA_BUILT" -C /tmp/site && echo "flash_kda from $FLASH_KDA_BUILT"; fi
[ -n "${NO_INSTALL:-}" ] || python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed: using PYTHONPATH"
export PYTHONPATH=/tmp/site:$PWD:$PWD/$AITER
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
[ -f "$AITER/ASSEMBLY.json" ] && python3 -c "import json,sys; a=json.load(open(sys.argv[1])); print('aiter base', a['base']['commit'][:10], '+', len(a['files']), 'fork files')" "$AITER/ASSEMBLY.json"
PLUGIN=()
python3 -c "import importlib.metadata as m, sys; sys.exit(0 if any(e.name == 'kda_verify' for e in m.entry_points(group='pytest11')) else 1)" \
  || PLUGIN=(-p verification.pytest_plugin)

want oracle && { echo "=== oracle-bench at +$(( $(date +%s) - T0 ))s"; timeout "${T_ORACLE:-90}" python3 -m verification.cli oracle-bench \
  --device cuda --no-recurrence --shapes "$ORACLE_SHAPES"; echo "=== oracle-bench: exit $?"; }
T0=$(date +%s)      # T_ALL counts from here

( while sleep 5; do nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits \
    | sed "s/^/$(( $(date +%s) - T0 )),/"; done > "$OUT/mem.csv" 2>/dev/null ) &
MEMPID=$!
BUILD_PID=
if want build || want moonshot; then
  ( MAX_JOBS=$BUILD_JOBS timeout 300 tools/build_flash_kda.sh .vendor/flashkda > "$OUT/build.txt" 2>&1; echo "build exit $? at +$(( $(date +%s) - T0 ))s" >> "$OUT/build.txt" ) &
  BUILD_PID=$!
fi
VERIFY=(python3 -m pytest -q -p no:cacheprovider "${PLUGIN[@]}" -m verify tests/test_verify_matrix.py --dist loadgroup -rfEx)
# one pytest run per RUNS entry, side by side: NAME|BACKENDS|SUITES|ROUTES(or -)|WORKERS[|CASE GLOBS, comma-separated]
IFS=';' read -r -a RUN_LIST <<< "$RUNS"
for spec in "${RUN_LIST[@]}"; do
  IFS='|' read -r name backends suites routes workers cases <<< "$spec"
  R=(); [ "$routes" != "-" ] && R=(--kda-route "$routes")
  IFS=',' read -r -a globs <<< "${cases:-}"; for g in "${globs[@]}"; do R+=(--kda-case "$g"); done
  case ",$suites," in *,fuzz,*) R+=(--kda-fuzz-n "$FUZZ_N");; esac
  { timeout "$(left)" "${VERIFY[@]}" -n "$workers" --kda-backend "$backends" --kda-suite "$suites" \
      "${R[@]}" --kda-report "$OUT/$name" > "$OUT/$name.txt" 2>&1; echo "=== $name: exit $? at +$(( $(date +%s) - T0 ))s"; } &
done
if [ -n "$BUILD_PID" ]; then
  wait "$BUILD_PID"; tail -n 3 "$OUT/build.txt"
  if want moonshot && python3 -c "import flash_kda" 2>/dev/null; then
    F=(); case ",$MOONSHOT_SUITES," in *,fuzz,*) F=(--kda-fuzz-n "$FUZZ_N");; esac
    timeout "$(left)" "${VERIFY[@]}" -n "$JOBS_M" --kda-backend moonshot --kda-suite "$MOONSHOT_SUITES" \
      "${F[@]}" --kda-report "$OUT/moonshot" > "$OUT/moonshot.txt" 2>&1
    echo "=== moonshot: exit $? at +$(( $(date +%s) - T0 ))s"
  fi
fi
wait $(jobs -p | grep -v "^$MEMPID\$") 2>/dev/null
kill "$MEMPID" 2>/dev/null
for d in $(for spec in "${RUN_LIST[@]}"; do echo "${spec%%|*}"; done) moonshot; do
  [ -f "$OUT/$d.txt" ] || continue
  echo "--- $d"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/$d.txt" | tail -n 40
  files=("$d.txt"); [ -d "$OUT/$d" ] && files+=($(cd "$OUT" && ls "$d"/results*.jsonl "$d"/report.md 2>/dev/null))
  tar -czf "$OUT/$d.tgz" -C "$OUT" "${files[@]}" && rm -rf "${OUT:?}/$d" "$OUT/$d.txt"
  # a file over the 15 MB a result file may be comes back in parts (cat parts > $d.tgz)
  [ "$(stat -c %s "$OUT/$d.tgz")" -gt 15000000 ] && split -b 15m -d "$OUT/$d.tgz" "$OUT/$d.tgz.part" && rm "$OUT/$d.tgz"
done
python3 - "$OUT/mem.csv" <<'EOF' || true
import sys, collections
peak = collections.defaultdict(int)
for line in open(sys.argv[1]):
    parts = [p.strip() for p in line.split(",")]
    if len(parts) == 3 and parts[2].isdigit():
        peak[parts[1]] = max(peak[parts[1]], int(parts[2]))
v = sorted(peak.values(), reverse=True)
print(f"GPU memory per process (MiB, peak of 5 s samples): {len(v)} processes, max {v[0] if v else 0}, "
      f"median {v[len(v) // 2] if v else 0}, top 5 {v[:5]}")
EOF
echo "=== done at +$(( $(date +%s) - T0 ))s"
