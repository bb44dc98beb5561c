#!/usr/bin/env bash
# One H200 run of the device matrix's speed, before and after a change, side by side in one call:
# `pytest -m verify` over $BACKENDS x $SUITES with -n $JOBS --dist loadgroup, in the tree BEFORE (an
# export of the commit before the change) and in this tree, each once cold (Triton's cache and
# kda-verify's disk cache emptied) and once warm (the same caches again), in the order before-cold,
# after-cold, after-warm, before-warm.  Each run prints its wall and its time breakdown (`kda-verify
# time breakdown`, summed over the workers); summary.txt has them together, with the ratios, and a
# check that every cell's status is the same in the four runs (a cache never changes a verdict).
#
#   OUT=DIR BEFORE=DIR tools/device/matrix_speed_job.sh      (run from the repository root)
#   OUT=DIR BEFORE=none RUNS="after-cold after-warm after-warm-n8" tools/device/matrix_speed_job.sh
#
# RUNS: the runs, in order (default: before-cold after-cold after-warm before-warm; the before runs
# are dropped with BEFORE=none).  A name is TREE-cold|warm[-nJ][-mps]: -nJ runs that one with J
# workers, -mps with CUDA's multi-process service started for it (where nvidia-cuda-mps-control
# exists; the run is skipped, saying so, where it does not).  PROFILE=1 adds, after the runs, one
# worker's warm run of triton x default under cProfile (profile.txt: the 45 heaviest by cumulative
# and by own time).  FLASH_KDA_KEEP=1 returns the built flash_kda as flash_kda.tgz (FLASH_KDA_BUILT
# takes it in a later call).
#
# BEFORE: e.g. mkdir -p .vendor/before && git archive 7073469 | tar -x -C .vendor/before
# Carry (54 MiB, no __pycache__ in them): .whl/fla_core-0.6.0-py3-none-any.whl (1 MB), .vendor/aiter-upstream
# (23 MB), .vendor/before (2.4 MB), and for moonshot .vendor/flashkda-fwdsub with .vendor/cutlass-5c149f5 (30 MB).
# Moonshot needs its CUTLASS build (tools/build_flash_kda.sh, about 95 s on 16 cores), done first so that
# it does not share the CPU with a timed run: with it the job takes about 8 to 9 minutes when the after
# tree is as slow as before (145 + 90 s per tree).  FLASH_KDA_BUILT=FILE.tgz (an installed flash_kda, as
# house_job.sh returns it) skips the build; MOONSHOT=off leaves moonshot out of the matrix (then the
# job takes about 6 minutes and the summary says so).
# PHASES=1 runs every pytest with tools/device/worker_profile.py (OUT/phases-NAME: each worker's start-up,
# collection and test phases; cProfile of the workers named in PROFILE_WORKERS, e.g. gw0,gw7).
# Env: JOBS (16), BACKENDS (triton,fla,aiter,moonshot), SUITES (smoke,default,stress,k3-prefill),
# AITER (.vendor/aiter-upstream), MOONSHOT (build | off), BUILD_JOBS (16), DEADLINE (540 s: no step runs
# past it), T_COLD (200), T_WARM (150): one run's limit.  OUT gets log.txt, summary.txt and one
# NAME.txt (the pytest output) per run.
set -u -o pipefail
export PYTHONUNBUFFERED=1 AITER_TRITON_ONLY=1
OUT=${OUT:?OUT: expected the output directory in the environment, got none}
BEFORE=${BEFORE:?BEFORE: expected the before tree (a directory, or none) in the environment, got nothing}
RUNS=${RUNS:-before-cold after-cold after-warm before-warm}
if [ "$BEFORE" = none ]; then
  RUNS=$(for r in $RUNS; do case $r in before-*) ;; *) printf '%s ' "$r";; esac; done); BEFORE=$PWD
else
  [ -d "$BEFORE/verification" ] || { echo "matrix_speed_job.sh: BEFORE: expected a source tree with verification/ (or none), got '$BEFORE'"; exit 2; }
fi
JOBS=${JOBS:-16} BACKENDS=${BACKENDS:-triton,fla,aiter,moonshot} SUITES=${SUITES:-smoke,default,stress,k3-prefill}
AITER=${AITER:-.vendor/aiter-upstream} MOONSHOT=${MOONSHOT:-build} BUILD_JOBS=${BUILD_JOBS:-16}
DEADLINE=${DEADLINE:-540} T_COLD=${T_COLD:-200} T_WARM=${T_WARM:-150}
HERE=$PWD BEFORE=$(cd "$BEFORE" && pwd) AITER=$(cd "$AITER" 2>/dev/null && pwd || echo "$AITER")
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
T0=$(date +%s)
left() { echo $(( DEADLINE - $(date +%s) + T0 )); }
if ls .whl/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; fi
if [ -n "${FLASH_KDA_BUILT:-}" ]; then
  mkdir -p /tmp/site && tar -xzf "$FLASH_KDA_BUILT" -C /tmp/site && echo "flash_kda from $FLASH_KDA_BUILT"
elif [ "$MOONSHOT" = build ]; then
  K=.vendor/flashkda-fwdsub
  [ -f "$K/cutlass/include/cutlass/cutlass.h" ] || { rm -rf "$K/cutlass"; ln -s ../cutlass-5c149f5 "$K/cutlass"; }
  t=$(date +%s)
  FLASH_KDA_TARGET=/tmp/site MAX_JOBS=$BUILD_JOBS timeout 200 tools/build_flash_kda.sh "$K" > "$OUT/build.txt" 2>&1
  echo "=== flash_kda build: exit $? after $(( $(date +%s) - t ))s"; tail -n 3 "$OUT/build.txt"
  [ "${FLASH_KDA_KEEP:-0}" = 1 ] && (cd /tmp/site && tar -czf "$OUT/flash_kda.tgz" flash_kda* 2>/dev/null) && ls -la "$OUT/flash_kda.tgz"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "$MOONSHOT" = off ] || ! PYTHONPATH=/tmp/site python3 -c "import flash_kda" 2>/dev/null; then
  BACKENDS=$(echo ",$BACKENDS," | sed 's/,moonshot,/,/; s/^,//; s/,$//')
  echo "=== moonshot left out (MOONSHOT=$MOONSHOT, or flash_kda not importable): backends $BACKENDS"
fi
# the bytecode of every tree and of what the workers import compiled now (lib.sh bytecode_once), so
# that no timed run pays for it
source "$HERE/tools/device/lib.sh"
PYTHONPATH=/tmp/site:$HERE:$AITER bytecode_once /tmp/site "$BEFORE" "$HERE/kda_kernels" "$HERE/kda_ref" "$HERE/verification" "$AITER"
echo "=== setup done at +$(( $(date +%s) - T0 ))s; backends $BACKENDS, suites $SUITES, -n $JOBS"

run() {   # run NAME TREE cold|warm LIMIT [JOBS]
  local name=$1 tree=$2 how=$3 lim=$4 side=${1%%-*} jobs=${5:-$JOBS}
  [ "$(left)" -lt "$lim" ] && lim=$(left)
  [ "$lim" -gt 10 ] || { echo "=== $name: skipped, past the deadline"; return; }
  export TRITON_CACHE_DIR=/tmp/speed/$side/triton KDA_VERIFY_CACHE_DIR=/tmp/speed/$side/kda-verify
  [ "$how" = cold ] && rm -rf "/tmp/speed/$side"
  mkdir -p "$TRITON_CACHE_DIR"
  echo; echo "=== $name (limit ${lim}s, at +$(( $(date +%s) - T0 ))s)"
  local t=$(date +%s.%N)
  local phases=() ppath=
  if [ "${PHASES:-0}" = 1 ]; then   # tools/device/worker_profile.py: each worker's phases, cProfile of $PROFILE_WORKERS
    phases=(-p worker_profile); ppath=$HERE/tools/device:
    export KDA_PROFILE_OUT=$OUT/phases-$name KDA_PROFILE_WORKERS=${PROFILE_WORKERS:-}
  fi
  ( cd "$tree" && PYTHONPATH=$ppath/tmp/site:$tree:$AITER timeout "$lim" python3 -m pytest -q -p no:cacheprovider \
      -p no:kda_verify -p verification.pytest_plugin "${phases[@]}" -m verify tests/test_verify_matrix.py -n "$jobs" \
      --dist loadgroup --kda-backend "$BACKENDS" --kda-suite "$SUITES" --junitxml "$OUT/$name.xml" > "$OUT/$name.txt" 2>&1 )
  local rc=$? wall
  wall=$(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$t" "$(date +%s.%N)")
  echo "$name $wall $rc" >> /tmp/speed/walls.txt
  echo "=== $name: exit $rc, wall ${wall}s"
  grep -E "passed|failed" "$OUT/$name.txt" | tail -n 1
  sed -n '/kda-verify time breakdown/,$p' "$OUT/$name.txt" | head -n 14
  [ "${PHASES:-0}" = 1 ] && python3 "$HERE/tools/device/worker_profile.py" "$OUT/phases-$name" | tail -n 20
}
mkdir -p /tmp/speed && : > /tmp/speed/walls.txt
for r in $RUNS; do
  tree=$HERE; [ "${r%%-*}" = before ] && tree=$BEFORE
  how=cold; lim=$T_COLD; case $r in *-warm*) how=warm; lim=$T_WARM;; esac
  j=$JOBS; case $r in *-n[0-9]*) j=$(echo "$r" | sed -E 's/.*-n([0-9]+).*/\1/');; esac
  mps=0; case $r in *-mps*) mps=1;; esac
  if [ $mps = 1 ]; then
    command -v nvidia-cuda-mps-control >/dev/null || { echo "=== $r: skipped, no nvidia-cuda-mps-control here"; continue; }
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log; mkdir -p /tmp/mps-pipe /tmp/mps-log
    nvidia-cuda-mps-control -d && echo "=== MPS started" || { echo "=== $r: skipped, MPS did not start"; continue; }
  fi
  run "$r" "$tree" "$how" "$lim" "$j"
  [ $mps = 1 ] && { echo quit | nvidia-cuda-mps-control; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; }
done
if [ "${PROFILE:-0}" = 1 ] && [ "$(left)" -gt 40 ]; then
  echo "=== profile: one worker, triton x default, warm (at +$(( $(date +%s) - T0 ))s)"
  export TRITON_CACHE_DIR=/tmp/speed/after/triton KDA_VERIFY_CACHE_DIR=/tmp/speed/after/kda-verify
  PYTHONPATH=/tmp/site:$HERE:$AITER timeout "$(( $(left) - 5 ))" python3 -m cProfile -o /tmp/prof.out -m pytest -q -p no:cacheprovider \
      -p no:kda_verify -p verification.pytest_plugin -m verify tests/test_verify_matrix.py -p no:xdist \
      --kda-backend triton --kda-suite default > "$OUT/profile-run.txt" 2>&1
  echo "=== profile: exit $?"; tail -n 3 "$OUT/profile-run.txt"
  python3 -c "
import pstats, sys
p = pstats.Stats('/tmp/prof.out', stream=sys.stdout)
p.sort_stats('cumulative').print_stats(45)
p.sort_stats('tottime').print_stats(45)" > "$OUT/profile.txt" 2>&1 || true
fi

{
  echo "matrix: --kda-backend $BACKENDS --kda-suite $SUITES -n $JOBS --dist loadgroup"
  python3 - "$OUT" /tmp/speed/walls.txt <<'EOF'
import sys, xml.etree.ElementTree as ET
from pathlib import Path
out, walls = Path(sys.argv[1]), {}
for line in open(sys.argv[2]):
    name, wall, rc = line.split()
    walls[name] = (float(wall), int(rc))
for name, (wall, rc) in walls.items():
    print(f"{name:<12} wall {wall:7.1f} s  exit {rc}")
for how in ("cold", "warm"):
    b, a = walls.get(f"before-{how}"), walls.get(f"after-{how}")
    if a and b:
        print(f"{how}: after / before = {a[0] / b[0]:.2f} ({b[0]:.1f} s -> {a[0]:.1f} s)")
status = {}
for name in walls:
    f = out / f"{name}.xml"
    if not f.exists():
        continue
    cells = {}
    for tc in ET.parse(f).iter("testcase"):
        props = {p.get("name"): p.get("value") for p in tc.iter("property")}
        if "kda_cell_status" in props:
            cells[tc.get("name")] = props["kda_cell_status"]
    status[name] = cells
    f.unlink()
names = list(status)
for other in names[1:]:
    a, b = status[names[0]], status[other]
    differ = sorted(k for k in set(a) & set(b) if a[k] != b[k])
    print(f"statuses {names[0]} vs {other}: {len(set(a) & set(b))} cells in both, {len(differ)} differ"
          + (f" (e.g. {differ[0]}: {a[differ[0]]} vs {b[differ[0]]})" if differ else ""))
EOF
} | tee "$OUT/summary.txt"
echo "=== done at +$(( $(date +%s) - T0 ))s"
