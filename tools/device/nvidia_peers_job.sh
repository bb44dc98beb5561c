#!/usr/bin/env bash
# One SM90 call (at most DEADLINE = 540 s of wall time) for the KDA kernels users run on NVIDIA besides ours:
# cuDNN frontend 1.32.0's kda_hopper_cuda (backend cudnn, never run before), Moonshot's FlashKDA with
# 7afb9f45's inverse (backend moonshot, build 0.0.1+1ce47ea.fwdsub7afb9f4) and its Neumann build
# (0.0.1+1ce47ea.neumann), and the eager references fla-naive and transformers.  Lanes run side by side
# on the one GPU (the builds take the CPU); every step is time-boxed (`timeout`, and cut to what is left
# of LANES_END / DEADLINE), writes under $OUT as it goes, and a step cut short loses only itself:
#
#   lane cudnn (first, in the background): a one-cell probe (NVRTC compiles the kernel), then side by side
#       the matrix smoke+default+stress+k3-prefill on route hopper_cuda (rerun --resume --isolate if the
#       process died) and the hidden-bug controls and invariances of both hopper_cuda routes (peer_checks.py:
#       the batch_invariant route tests the promise the engine does not read); then a shrink bundle of the
#       matrix's first failing cell, then long/T16384-* if time is left
#   lane refs (background): fla-naive + transformers, the same matrix beside their controls and invariances
#   builds (background, CPU): FlashKDA twice (.vendor/flashkda-1ce47ea Neumann, .vendor/flashkda-fwdsub)
#   after the builds: every Moonshot finding's repro on both builds (tools/fixed_in.py cases; the lead
#       turns fix/verdict.txt into fixed-in / still-fails-in with `tools/fixed_in.py verdict ... --write`),
#       then on the fixed build its controls and invariances beside its matrix (pytest -n 8), long/T16384-*
#   (the eager references run no long case in this call: their fp32 token loops over 16K-1M tokens are left
#   out for its time)
#   bench (after LANES_END): triton, fla-pinned, moonshot (fixed build), cudnn, fla-naive, transformers on
#       the same shapes; the Neumann build alone on them
#   summary.md (tools/device/peers_summary.py), then each lane's directory packed into one .tgz
#
#   OUT=DIR tools/device/nvidia_peers_job.sh          (run from the repository root)
#
# Carry (56.9 MB of the 64 MiB a call carries; measured with du -sb):
#   .whl                          24.4 MB: fla_core-0.6.0-py3-none-any.whl (1.1 MB) and .whl/cudnn/ (23.4 MB:
#                                 nvidia_cudnn_frontend-1.32.0 cp312 manylinux_2_28 11.6 MB, apache_tvm_ffi
#                                 0.1.15.post2 3.3 MB, cuda_bindings 13.5.0 8.4 MB, cuda_pathfinder 1.9.1 0.06 MB)
#   .vendor/flashkda-1ce47ea       2.5 MB  (tools/vendor_flash_kda.sh with CUTLASS_SHARED=.vendor)
#   .vendor/flashkda-fwdsub        2.5 MB  (the same, OVERLAY of 7afb9f45's inverse, LABEL 1ce47ea.fwdsub7afb9f4)
#   .vendor/cutlass-5c149f5       27.4 MB  (cutlass include, tools/util/include, examples/common)
# Not carried: nvidia-cutlass-dsl (cuDNN's kda_hopper engine; 92 MB by itself), cuLA (no distribution on
# the mirror; from source it needs cutlass 73c59c05, another 28 MB, and the DSL: docs/backends.md), aiter
# (its own job), .vendor/aiter-upstream (25 MB).  transformers comes from the image.
#
# Env: DEADLINE (540), LANES_END (DEADLINE - 140: the lanes stop there, bench and summary after), STEPS
# (setup,build,cudnn,refs,fix,moonshot,bench,long,pack), BUILD_JOBS (8 per build), SHAPES, BENCH_REPS (10),
# PY (python3), DRY=1 (print the steps, run nothing that needs a GPU).
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:?OUT: expected the output directory in the environment, got none}
DEADLINE=${DEADLINE:-540}
LANES_END=${LANES_END:-$((DEADLINE - 140))}
STEPS=${STEPS:-setup,build,cudnn,refs,fix,moonshot,bench,long,pack} DRY=${DRY:-0}
BUILD_JOBS=${BUILD_JOBS:-8} BENCH_REPS=${BENCH_REPS:-10}
SHAPES=${SHAPES:-"1x2048x12;1x8192x12;8x2048x16"}
SUITES=smoke,default,stress,k3-prefill
OLD=.vendor/flashkda-1ce47ea NEW=.vendor/flashkda-fwdsub CUT=.vendor/cutlass-5c149f5
K1=/tmp/fk-neumann K2=/tmp/fk-fwdsub            # the two FlashKDA install targets
want() { case ",$STEPS," in *",$1,"*) return 0;; *) return 1;; esac; }
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
exec 3>&1          # the log: step headers go here even when a step's own output goes to a file
T0=$(date +%s)
at() { echo "+$(( $(date +%s) - T0 ))s"; }
left_to() { echo $(( $1 - $(date +%s) + T0 )); }
step_until() {   # step_until END NAME TIMEOUT_S CMD...: CMD bounded by TIMEOUT_S and by END (s after start)
  local end=$1 name=$2 lim=$3; shift 3
  local l; l=$(left_to "$end"); [ "$l" -lt "$lim" ] && lim=$l
  echo "=== $name (limit ${lim}s, at $(at)): $*" >&3
  [ "$DRY" = 1 ] && { echo "(dry run)" >&3; return 0; }
  [ "$lim" -gt 5 ] || { echo "=== $name: skipped, past its end (${end}s)" >&3; return 124; }
  local t; t=$(date +%s); timeout -k 5 "$lim" "$@"; local rc=$?
  echo "=== $name: exit $rc after $(( $(date +%s) - t ))s (at $(at))" >&3
  return $rc
}
lane() { step_until "$LANES_END" "$@"; }        # a step of a lane: ends by LANES_END
last() { step_until "$DEADLINE" "$@"; }         # a step after the lanes: ends by DEADLINE
PY=${PY:-python3}
echo "nvidia_peers_job.sh at $(date -u +%FT%TZ): DEADLINE ${DEADLINE}s, LANES_END ${LANES_END}s, STEPS $STEPS"

# ---- setup: wheels into /tmp/site (fla-core) and /tmp/cudnn-site (cuDNN frontend), the FlashKDA trees' cutlass
if want setup && [ "$DRY" != 1 ]; then
  for t in "$OLD" "$NEW"; do       # a carry may drop the relative cutlass symlink: make it again
    [ -f "$t/cutlass/include/cutlass/cutlass.h" ] || { rm -rf "$t/cutlass"; ln -s "../$(basename "$CUT")" "$t/cutlass"; }
    [ -f "$t/cutlass/include/cutlass/cutlass.h" ] || echo "missing: $t/cutlass (carry $CUT)"
  done
  if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || echo "fla-core wheel: install failed"
  fi
  CW=(.whl/cudnn/nvidia_cudnn_frontend-*.whl .whl/cudnn/apache_tvm_ffi-*.whl)
  if $PY -c "import cuda.bindings.driver, cuda.bindings.nvrtc" 2>/dev/null; then
    echo "cuda-bindings: the image's ($($PY -c 'import cuda.bindings as c; print(c.__version__)' 2>&1 | tail -1))"
  else
    CW+=(.whl/cudnn/cuda_bindings-*.whl .whl/cudnn/cuda_pathfinder-*.whl)
  fi
  ls "${CW[@]}" >/dev/null 2>&1 && $PY -m pip install -q --no-index --no-deps --no-compile --upgrade \
    --target /tmp/cudnn-site "${CW[@]}" || echo "cuDNN frontend wheels: missing or install failed (carry .whl)"
fi
export PYTHONPATH=/tmp/site:/tmp/cudnn-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
# libcudnn for the frontend's compiled module: torch's own (nvidia/cudnn/lib or nvidia/cu13/lib)
CUDNN_LIBS=$($PY - <<'EOF' 2>/dev/null
import glob, os, site, sys
dirs = sorted({os.path.dirname(p) for b in site.getsitepackages() + sys.path
               for p in glob.glob(os.path.join(b, "nvidia", "**", "libcudnn.so*"), recursive=True)})
print(":".join(dirs))
EOF
)
[ -n "$CUDNN_LIBS" ] && export LD_LIBRARY_PATH=$CUDNN_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export XDG_CACHE_HOME=/tmp/xdg-cache CUDNN_FRONTEND_CAKE_CACHE_DIR=/tmp/xdg-cache/cudnn-cake
[ -z "${CUDA_HOME:-}" ] && [ -f /usr/local/cuda/include/cuda_bf16.h ] && export CUDA_HOME=/usr/local/cuda
echo "libcudnn dirs: ${CUDNN_LIBS:-none found}; CUDA_HOME=${CUDA_HOME:-unset}"
if [ "$DRY" != 1 ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" 2>&1 | tail -1
  $PY -c "import transformers, fla; print('transformers', transformers.__version__, 'fla-core', fla.__version__)" 2>&1 | tail -1
  timeout 60 $PY -c "import sys; import cudnn; print('cudnn frontend', cudnn.__version__ if hasattr(cudnn, '__version__') else '?', 'backend', cudnn.backend_version()); print('DSL modules imported by import cudnn:', sorted(m for m in sys.modules if m.split('.')[0] in ('cutlass', 'nvidia_cutlass_dsl')) or 'none')" 2>&1 | tail -3
  timeout 60 $PY -m verification.cli backends 2>&1 | tail -20
fi
PLUGIN=()
$PY -c "import importlib.metadata as m, sys; sys.exit(0 if any(e.name == 'kda_verify' for e in m.entry_points(group='pytest11')) else 1)" 2>/dev/null \
  || PLUGIN=(-p verification.pytest_plugin)
RUN=($PY -m verification.cli run)

# ---- builds (background, CPU)
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

# ---- lane cudnn (background)
matrix() {   # matrix NAME DIR RUN-ARGS...: a kda-verify run in its lane's time; a dead process -> resume isolated
  local name=$1 dir=$2; shift 2
  lane "$name" 220 "${RUN[@]}" "$@" --out "$dir" --no-report > "$dir.txt" 2>&1; local rc=$?
  tail -n 4 "$dir.txt" 2>/dev/null
  if [ "$rc" -gt 2 ] && [ "$rc" -ne 124 ] && [ -f "$dir/results.jsonl" ]; then
    echo "$name: the process died (exit $rc): the cells left, each in a child process"
    lane "$name-resume" 150 "${RUN[@]}" "$@" --out "$dir" --no-report --resume --isolate --timeout 60 >> "$dir.txt" 2>&1
    tail -n 4 "$dir.txt" 2>/dev/null
  fi
  return 0
}
LANES=()
if want cudnn; then
  mkdir -p "$OUT/cudnn"
  ( lane cudnn-probe 90 "${RUN[@]}" --backend cudnn --route hopper_cuda --suite smoke --case smoke/dense-T64-lb-5 \
        --out "$OUT/cudnn/probe" --no-report > "$OUT/cudnn/probe.txt" 2>&1; tail -n 6 "$OUT/cudnn/probe.txt" 2>/dev/null
    # the probe compiled the kernel once (NVRTC, cached on disk): the matrix and the checks side by side
    matrix cudnn-matrix "$OUT/cudnn/matrix" --backend cudnn --route hopper_cuda --suite "$SUITES" --long no &
    lane cudnn-checks 200 $PY tools/device/peer_checks.py --backend cudnn --route hopper_cuda \
        --route hopper_cuda:batch_invariant --device cuda --out "$OUT/cudnn/checks.jsonl" > "$OUT/cudnn/checks.txt" 2>&1 &
    wait
    cell=$($PY -c "
import json, sys
for ln in open(sys.argv[1]):
    r = json.loads(ln)
    if r.get('status') in ('fail', 'mistrusted', 'crashed', 'error'):
        print(r['backend'] + '|' + r['route'] + '|' + r['case']); break" "$OUT/cudnn/matrix/results.jsonl" 2>/dev/null)
    if [ -n "$cell" ]; then
      lane cudnn-shrink 90 $PY -m verification.cli shrink --from-results "$OUT/cudnn/matrix" --cell "$cell" \
          --out "$OUT/cudnn/shrunk" --max-runs 40 > "$OUT/cudnn/shrink.txt" 2>&1; tail -n 8 "$OUT/cudnn/shrink.txt"
    fi
    if want long; then
      lane cudnn-long 120 "${RUN[@]}" --backend cudnn --route hopper_cuda --suite long --case 'long/T16384-*' \
          --out "$OUT/cudnn/long" --no-report > "$OUT/cudnn/long.txt" 2>&1; tail -n 4 "$OUT/cudnn/long.txt"
    fi ) &
  LANES+=($!)
fi

# ---- lane refs (background)
if want refs; then
  mkdir -p "$OUT/refs"
  ( matrix refs-matrix "$OUT/refs/matrix" --backend fla-naive,transformers --suite "$SUITES" --long no &
    for b in fla-naive transformers; do
      lane "refs-checks-$b" 150 $PY tools/device/peer_checks.py --backend "$b" --device cuda \
          --out "$OUT/refs/checks-$b.jsonl" > "$OUT/refs/checks-$b.txt" 2>&1 &
    done
    wait ) &
  LANES+=($!)
fi

# ---- after the builds: the Moonshot findings' repros on both builds, then the fixed build's matrix and checks
[ ${#BUILDS[@]} -gt 0 ] && wait "${BUILDS[@]}"
for f in "$OUT"/build-*.txt; do [ -f "$f" ] && { echo "--- $f"; tail -n 3 "$f"; }; done
[ "$DRY" != 1 ] && { want fix || want moonshot; } && for tgt in $K1 $K2; do
  PYTHONPATH="$tgt:$PYTHONPATH" $PY -c "from kda_kernels.moonshot import MoonshotBackend as M; b = M(); print(b.version(), b.available())" 2>&1 | tail -1
done
if want fix; then
  mkdir -p "$OUT/fix"
  $PY tools/fixed_in.py cases --backend moonshot > "$OUT/fix/cases.tsv"
  printf "extra\t--route cutlass:state=fp32 --suite stress --case 'stress/correlated-keys-*' --case stress/long-T65536-correlated-lb-0.01 --long yes\n" >> "$OUT/fix/cases.tsv"
  cat "$OUT/fix/cases.tsv"
  FIX=()
  for pair in "neumann:$K1" "fwdsub:$K2"; do
    name=${pair%%:*} tgt=${pair##*:}
    ( i=0; while IFS=$'\t' read -r line args; do
        i=$((i + 1)); eval "set -- $args"
        lane "fix-$name-$line" 150 env PYTHONPATH="$tgt:$PYTHONPATH" "${RUN[@]}" --backend moonshot "$@" \
          --out "$OUT/fix/$name/$i" --no-report < /dev/null > "$OUT/fix/$name-$i.txt" 2>&1
        tail -n 2 "$OUT/fix/$name-$i.txt"
      done < "$OUT/fix/cases.tsv" ) &
    FIX+=($!)
  done
  [ ${#FIX[@]} -gt 0 ] && wait "${FIX[@]}"
  ls -d "$OUT"/fix/neumann/* "$OUT"/fix/fwdsub/* >/dev/null 2>&1 && \
    $PY tools/fixed_in.py verdict "$OUT"/fix/neumann/* "$OUT"/fix/fwdsub/* | tee "$OUT/fix/verdict.txt"
fi
if want moonshot; then
  mkdir -p "$OUT/moonshot"
  lane moonshot-checks 150 env PYTHONPATH="$K2:$PYTHONPATH" $PY tools/device/peer_checks.py --backend moonshot \
    --route cutlass:state=fp32 --device cuda --out "$OUT/moonshot/checks.jsonl" > "$OUT/moonshot/checks.txt" 2>&1 &
  MCHECKS=$!
  lane moonshot-matrix 200 env PYTHONPATH="$K2:$PYTHONPATH" $PY -m pytest -q -p no:cacheprovider "${PLUGIN[@]}" -m verify \
    tests/test_verify_matrix.py --kda-backend moonshot --kda-route cutlass:state=fp32 -n 8 --dist loadgroup -rfEsx \
    --kda-suite "$SUITES" --kda-report "$OUT/moonshot/matrix" > "$OUT/moonshot/matrix.txt" 2>&1
  tail -n 12 "$OUT/moonshot/matrix.txt" 2>/dev/null
  if want long; then
    lane moonshot-long 90 env PYTHONPATH="$K2:$PYTHONPATH" "${RUN[@]}" --backend moonshot --route cutlass:state=fp32 \
      --suite long --case 'long/T16384-*' --out "$OUT/moonshot/long" --no-report > "$OUT/moonshot/long.txt" 2>&1
    tail -n 4 "$OUT/moonshot/long.txt" 2>/dev/null
  fi
  wait "$MCHECKS"
fi
[ ${#LANES[@]} -gt 0 ] && wait "${LANES[@]}"
echo "=== lanes done at $(at)"

# ---- bench: the same shapes for every backend; the Neumann build alone afterwards
if want bench; then
  last bench 105 env PYTHONPATH="$K2:$PYTHONPATH" $PY -m verification.cli bench \
    --backend triton,fla-pinned,moonshot,cudnn,fla-naive,transformers --routes seg:BW=64:inv=bf16x6 \
    --shapes "$SHAPES" --reps "$BENCH_REPS" --warmup 2 --json-out "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
  tail -n 30 "$OUT/bench.txt" 2>/dev/null
  last bench-neumann 25 env PYTHONPATH="$K1:$PYTHONPATH" $PY -m verification.cli bench --backend moonshot \
    --shapes "$SHAPES" --reps "$BENCH_REPS" --warmup 2 --json-out "$OUT/bench_neumann.json" > "$OUT/bench_neumann.txt" 2>&1
  tail -n 6 "$OUT/bench_neumann.txt" 2>/dev/null
fi

# ---- summary, then pack each lane's directory (a file per lane comes back; the summary stays plain)
if [ "$DRY" != 1 ]; then
  timeout 30 $PY tools/device/peers_summary.py "$OUT" > "$OUT/summary.md" 2>&1
  head -c 6000 "$OUT/summary.md"
fi
if want pack && [ "$DRY" != 1 ]; then
  for d in cudnn refs fix moonshot; do
    [ -d "$OUT/$d" ] || continue
    tar -czf "$OUT/$d.tgz" -C "$OUT" "$d" && rm -rf "${OUT:?}/$d"
    [ "$(stat -c %s "$OUT/$d.tgz")" -gt 15000000 ] && split -b 15m -d "$OUT/$d.tgz" "$OUT/$d.tgz.part" && rm "$OUT/$d.tgz"
  done
  for f in "$OUT"/build-*.txt; do [ -f "$f" ] && { echo "--- $f"; tail -n 25 "$f"; }; done
  tar -czf "$OUT/builds.tgz" -C "$OUT" $(cd "$OUT" && ls build-*.txt 2>/dev/null) 2>/dev/null && rm -f "$OUT"/build-*.txt
fi
echo "=== done at $(at)"
