#!/usr/bin/env bash
# One GPU run of the serving suite's speed and of the fla NULL-block finding's repro:
#
#   1. cold (Triton's and kda-verify's caches emptied): `pytest -m verify --kda-suite serving` for every
#      prefill backend of $PREFILL with each decode backend of $DECODE, all pairings at once, each with
#      -n $JOBS workers (3 x 5 = 15 workers on the one GPU); the wall of the whole, each run's exit,
#      its last lines and its time breakdown (serving-P-D.txt)
#   2. the finding: `kda-verify shrink` of fla's chunk + fused_recurrent pairing on serving/pad-null0,
#      the bundle's repro.py in a fresh process, and `kda-verify check` of the bundle's dump
#
#   OUT=DIR tools/device/serving_speed_job.sh        (from the repository root; carry .whl's fla-core wheel
#                                                    and the aiter tree)
# Env: PREFILL (triton,aiter,fla), DECODE (fla,aiter), JOBS (5), AITER (.vendor/aiter-upstream),
# T_SUITE (240 s), T_SHRINK (150 s).  OUT gets log.txt and one serving.tgz of everything else.
set -u -o pipefail
export PYTHONUNBUFFERED=1 AITER_TRITON_ONLY=1
OUT=${OUT:?OUT: expected the output directory in the environment, got none}
PREFILL=${PREFILL:-triton,aiter,fla} DECODE=${DECODE:-fla,aiter} JOBS=${JOBS:-5}
AITER=${AITER:-.vendor/aiter-upstream} T_SUITE=${T_SUITE:-240} T_SHRINK=${T_SHRINK:-150}
mkdir -p "$OUT/serving"
exec > >(tee -a "$OUT/log.txt") 2>&1
T0=$(date +%s)
if ls .whl/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/$AITER
export TRITON_CACHE_DIR=/tmp/serving-speed/triton KDA_VERIFY_CACHE_DIR=/tmp/serving-speed/kda-verify
rm -rf /tmp/serving-speed && mkdir -p "$TRITON_CACHE_DIR"
source tools/device/lib.sh
bytecode_once kda_ref kda_kernels verification "$AITER" /tmp/site
python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla-core', fla.__version__)"
echo "=== setup done at +$(( $(date +%s) - T0 ))s"

t=$(date +%s.%N); pids=(); names=()
for d in ${DECODE//,/ }; do for p in ${PREFILL//,/ }; do
  n=serving-$p-$d; names+=("$n")
  ( timeout "$T_SUITE" python3 -m pytest -q -p no:cacheprovider -p no:kda_verify -p verification.pytest_plugin \
      -m verify tests/test_verify_matrix.py --kda-suite serving --kda-backend "$p" --kda-decode-backend "$d" \
      -n "$JOBS" -rfE --kda-report "$OUT/serving/$n" > "$OUT/serving/$n.txt" 2>&1
    echo "exit $? at +$(( $(date +%s) - T0 ))s" >> "$OUT/serving/$n.txt" ) &
  pids+=($!)
done; done
wait "${pids[@]}"
wall=$(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$t" "$(date +%s.%N)")
echo "=== serving suite, every pairing at once (cold): wall ${wall}s"
for n in "${names[@]}"; do
  echo "--- $n: $(tail -n 1 "$OUT/serving/$n.txt")"
  grep -E "passed|failed|skipped|error" "$OUT/serving/$n.txt" | tail -n 1
  sed -n '/kda-verify time breakdown/,/other/p' "$OUT/serving/$n.txt" | head -n 13
done

echo; echo "=== finding: shrink fla chunk:safe_gate + fused_recurrent on serving/pad-null0 (at +$(( $(date +%s) - T0 ))s)"
timeout "$T_SHRINK" python3 -m verification shrink --backend fla --route chunk:safe_gate --decode-route fused_recurrent \
    --suite serving --case serving/pad-null0 --out "$OUT/serving/shrunk-fla-pad-null0" > "$OUT/serving/shrink.txt" 2>&1
echo "shrink: exit $?"; tail -n 25 "$OUT/serving/shrink.txt"
if [ -f "$OUT/serving/shrunk-fla-pad-null0/repro.py" ]; then
  (cd /tmp && timeout 60 python3 "$OUT/serving/shrunk-fla-pad-null0/repro.py"); echo "repro.py: exit $?"
  timeout 60 python3 -m verification check "$OUT/serving/shrunk-fla-pad-null0"; echo "check: exit $?"
fi
tar -czf "$OUT/serving.tgz" -C "$OUT" serving && rm -rf "${OUT:?}/serving"
echo "=== done at +$(( $(date +%s) - T0 ))s"
