#!/usr/bin/env bash
# One SM90 run (about 8 minutes) for FlashKDA's inverse fix and the eager references:
#   1. builds Moonshot's FlashKDA twice, side by side (pip --target dirs, both at once on the 16 cores):
#      .vendor/flashkda-1ce47ea (fp16 Neumann inverse) and .vendor/flashkda-fwdsub (8x8 fp32 forward
#      substitution, FlashKDA 7afb9f45's inverse); while they build, the GPU runs the eager references
#      fla-naive and transformers: their GPU tests (verdicts, invariances: tests/test_references.py -m gpu)
#      and the matrix smoke+default+stress+k3-prefill (kda-verify run, long cases left out);
#   2. reruns every Moonshot finding of the register (tools/fixed_in.py cases: each entry's shrink repro,
#      plus the correlated-keys stress cases its evidence names) on both builds, and turns the results into
#      fixed-in / still-fails-in (tools/fixed_in.py verdict);
#   3. the moonshot matrix smoke+default+stress+k3-prefill and its GPU tests on the fixed build;
#   4. bench: triton, fla-pinned, moonshot (fixed build), fla-naive, transformers on the same shapes, and
#      moonshot's Neumann build on the same shapes (the fix's cost).
#
#   OUT=DIR tools/device/moonshot_fix_job.sh          (run from the repository root)
#
# Carry .vendor (tools/vendor_flash_kda.sh with CUTLASS_SHARED=.vendor: cutlass-5c149f5, flashkda-1ce47ea,
# flashkda-fwdsub; 33 MB) and .whl (fla-core 0.6.0).  transformers comes from the image (5.17).
# Env: BUILD_JOBS (8 per build), STEPS (build,refs,fix,matrix,bench), SHAPES, BENCH_REPS (10), DEADLINE (540 s:
# every step is cut to what is left of it), DRY=1
# (print the steps, run nothing that needs a GPU).  DIR gets at most 6 files: log.txt, refs.tgz, fix.tgz,
# matrix.tgz, bench.json, bench_neumann.json.
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:?OUT: expected the output directory in the environment, got none}
OLD=.vendor/flashkda-1ce47ea NEW=.vendor/flashkda-fwdsub CUT=.vendor/cutlass-5c149f5
BUILD_JOBS=${BUILD_JOBS:-8} BENCH_REPS=${BENCH_REPS:-10}
SHAPES=${SHAPES:-"1x2048x12;1x8192x12;8x2048x16"}
STEPS=${STEPS:-build,refs,fix,matrix,bench} DRY=${DRY:-0}
want() { case ",$STEPS," in *",$1,"*) return 0;; *) return 1;; esac; }
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
T0=$(date +%s)
at() { echo "+$(( $(date +%s) - T0 ))s"; }
DEADLINE=${DEADLINE:-540}   # seconds: no step runs past it (the device call's limit is 600)
left() { echo $(( DEADLINE - $(date +%s) + T0 )); }
step() {   # step NAME TIMEOUT_S CMD...: run CMD bounded (and by DEADLINE), log its wall time and exit status
  local name=$1 lim=$2; shift 2
  [ "$(left)" -lt "$lim" ] && lim=$(left)
  echo; echo "=== $name (limit ${lim}s, at $(at)): $*"
  [ "$DRY" = 1 ] && { echo "(dry run)"; return 0; }
  [ "$lim" -gt 5 ] || { echo "=== $name: skipped, past the deadline"; return 0; }
  local t=$(date +%s); timeout "$lim" "$@"; local rc=$?
  echo "=== $name: exit $rc after $(( $(date +%s) - t ))s"
}
PY=python3
for t in "$OLD" "$NEW"; do       # a carry may drop the relative cutlass symlink: make it again
  [ -f "$t/cutlass/include/cutlass/cutlass.h" ] || { rm -rf "$t/cutlass"; ln -s "../$(basename "$CUT")" "$t/cutlass"; }
  [ -f "$t/cutlass/include/cutlass/cutlass.h" ] || echo "missing: $t/cutlass (carry $CUT)"
done
if ls .whl/*.whl >/dev/null 2>&1; then $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl; fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 | tail -1
$PY -c "import transformers, fla; print('transformers', transformers.__version__, 'fla-core', fla.__version__)" 2>&1 | tail -1
$PY -m verification.cli backends 2>&1 | tail -12
K1=/tmp/fk-neumann K2=/tmp/fk-fwdsub           # the two install targets
with() { local tgt=$1; shift; PYTHONPATH="$tgt:$PYTHONPATH" "$@"; }   # with TARGET CMD...: that build first

PLUGIN=()
$PY -c "import importlib.metadata as m, sys; sys.exit(0 if any(e.name == 'kda_verify' for e in m.entry_points(group='pytest11')) else 1)" \
  || PLUGIN=(-p verification.pytest_plugin)

# 1. both builds in the background; the references use the GPU meanwhile (in the background too)
BUILDS=()
if want build; then
  for pair in "$OLD:$K1" "$NEW:$K2"; do
    src=${pair%%:*} tgt=${pair##*:}
    echo "=== build $src -> $tgt (background, at $(at))"
    if [ "$DRY" != 1 ]; then
      ( MAX_JOBS=$BUILD_JOBS NVCC_THREADS=2 FLASH_KDA_TARGET=$tgt timeout 300 tools/build_flash_kda.sh "$src" \
          > "$OUT/build-$(basename "$src").txt" 2>&1; echo "build $src exit $? at $(at)" >> "$OUT/build-$(basename "$src").txt" ) &
      BUILDS+=($!)
    fi
  done
fi
REFS=
if want refs; then
  mkdir -p "$OUT/refs"
  ( step refs-gpu-tests 200 $PY -m pytest -q -p no:cacheprovider -m gpu -rA tests/test_references.py \
      > "$OUT/refs/gpu-tests.txt" 2>&1
    step refs-matrix 240 $PY -m verification.cli run --backend fla-naive,transformers \
      --suite smoke,default,stress,k3-prefill --long no --out "$OUT/refs/matrix" > "$OUT/refs/matrix.txt" 2>&1 ) &
  REFS=$!
fi
[ ${#BUILDS[@]} -gt 0 ] && wait "${BUILDS[@]}"
for f in "$OUT"/build-*.txt; do [ -f "$f" ] && { echo "--- $f"; tail -n 3 "$f"; }; done
for tgt in $K1 $K2; do with $tgt $PY -c "from kda_kernels.moonshot import MoonshotBackend as M; b = M(); print(b.version(), b.available())" 2>&1 | tail -1; done

# 2. every Moonshot finding's repro on both builds (both at once: small cells, one GPU)
if want fix; then
  mkdir -p "$OUT/fix"
  $PY tools/fixed_in.py cases --backend moonshot > "$OUT/fix/cases.tsv"
  printf "extra\t--route cutlass:state=fp32 --suite stress --case 'stress/correlated-keys-*' --case stress/long-T65536-correlated-lb-0.01 --long yes\n" >> "$OUT/fix/cases.tsv"
  cat "$OUT/fix/cases.tsv"
  for pair in "neumann:$K1" "fwdsub:$K2"; do
    name=${pair%%:*} tgt=${pair##*:}
    ( i=0; while IFS=$'\t' read -r line args; do
        i=$((i + 1)); eval "set -- $args"
        step "fix-$name-$line" 150 env PYTHONPATH="$tgt:$PYTHONPATH" $PY -m verification.cli run --backend moonshot "$@" \
          --out "$OUT/fix/$name/$i" --no-report > "$OUT/fix/$name-$i.txt" 2>&1
        tail -n 2 "$OUT/fix/$name-$i.txt"
      done < "$OUT/fix/cases.tsv" ) &
  done
  wait $(jobs -p | grep -vx "${REFS:-none}")
  $PY tools/fixed_in.py verdict "$OUT"/fix/neumann/* "$OUT"/fix/fwdsub/* | tee "$OUT/fix/verdict.txt"
  tar -czf "$OUT/fix.tgz" -C "$OUT" fix && rm -rf "${OUT:?}/fix"
fi

# 3. the moonshot matrix and GPU tests on the fixed build
if want matrix; then
  mkdir -p "$OUT/matrix"
  step moonshot-gpu-tests 90 env PYTHONPATH="$K2:$PYTHONPATH" $PY -m pytest -q -p no:cacheprovider -m gpu -rA \
    tests/test_moonshot.py > "$OUT/matrix/gpu-tests.txt" 2>&1; tail -n 4 "$OUT/matrix/gpu-tests.txt" 2>/dev/null
  step moonshot-matrix 220 env PYTHONPATH="$K2:$PYTHONPATH" $PY -m pytest -q -p no:cacheprovider "${PLUGIN[@]}" -m verify \
    tests/test_verify_matrix.py --kda-backend moonshot -n 8 --dist loadgroup -rfEsx \
    --kda-suite smoke,default,stress,k3-prefill --kda-report "$OUT/matrix/run" > "$OUT/matrix/run.txt" 2>&1
  tail -n 30 "$OUT/matrix/run.txt" 2>/dev/null
  [ -f "$OUT/matrix/run/report.md" ] || timeout 60 $PY -m verification.cli report "$OUT/matrix/run" >/dev/null 2>&1 || true
  tar -czf "$OUT/matrix.tgz" -C "$OUT" matrix && rm -rf "${OUT:?}/matrix"
fi
if [ -n "$REFS" ]; then
  wait "$REFS"
  echo "--- refs"; tail -n 6 "$OUT/refs/gpu-tests.txt" 2>/dev/null; tail -n 14 "$OUT/refs/matrix.txt" 2>/dev/null
  tar -czf "$OUT/refs.tgz" -C "$OUT" refs && rm -rf "${OUT:?}/refs"
fi

# 4. bench, the same shapes for every backend; moonshot's Neumann build alone afterwards
if want bench; then
  step bench 150 env PYTHONPATH="$K2:$PYTHONPATH" $PY -m verification.cli bench \
    --backend triton,fla-pinned,moonshot,fla-naive,transformers --routes seg:BW=64:inv=bf16x6 \
    --shapes "$SHAPES" --reps "$BENCH_REPS" --warmup 2 --json-out "$OUT/bench.json"
  step bench-neumann 40 env PYTHONPATH="$K1:$PYTHONPATH" $PY -m verification.cli bench --backend moonshot \
    --shapes "$SHAPES" --reps "$BENCH_REPS" --warmup 2 --json-out "$OUT/bench_neumann.json"
fi
for f in "$OUT"/build-*.txt; do [ -f "$f" ] && { echo "--- $f"; tail -n 25 "$f"; rm -f "$f"; }; done
echo "=== done at $(at)"
