# Shared by the device jobs that source it (`. "$(dirname "$0")/lib.sh"` after OUT and DRY are set):
#   step NAME TIMEOUT_S CMD...   run CMD bounded by TIMEOUT_S, log its start (seconds since T0), wall
#                                time and exit status; the job goes on whatever CMD returns.  With
#                                DRY=1 only the step named setup runs (a rehearsal prints the others).
# T0 is the job's start (set here when the caller has not set it).
T0=${T0:-$(date +%s)}
step() {
  local name=$1 lim=$2; shift 2
  echo; echo "=== $name (limit ${lim}s, at +$(( $(date +%s) - T0 ))s): $*"
  local t=$(date +%s)
  if [ "${DRY:-0}" = 1 ] && [ "$name" != setup ]; then echo "(dry run)"; return 0; fi
  timeout "$lim" "$@"; local rc=$?
  echo "=== $name: exit $rc after $(( $(date +%s) - t ))s"
  return 0
}

# bytecode_once DIR...: the bytecode of DIR... and of every module a matrix worker imports, compiled
# once into $PYTHONPYCACHEPREFIX (default /tmp/pycache), as a pip install leaves it: the image's
# site-packages (torch, triton, sympy, ...) carry no .pyc and take none (read-only, or written with
# PYTHONDONTWRITEBYTECODE), so every pytest worker compiled ~2200 modules from source, about 7 s of
# its start-up on the H200.  Prints how many .pyc torch has of its own, so the log says whether it
# was needed.
bytecode_once() {
  export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pycache}; unset PYTHONDONTWRITEBYTECODE
  mkdir -p "$PYTHONPYCACHEPREFIX"
  python3 -c "import importlib.util as u, pathlib as p; d = p.Path(u.find_spec('torch').origin).parent; print('torch .pyc of its own:', len(list(d.rglob('*.pyc'))), 'of', len(list(d.rglob('*.py'))), 'modules')"
  python3 -m compileall -q -j 0 "$@" >/dev/null 2>&1
  python3 -m pytest -q -p no:cacheprovider -p no:kda_verify -p verification.pytest_plugin -m verify \
      tests/test_verify_matrix.py --collect-only --kda-backend "${BACKENDS:-triton,fla,aiter}" --kda-suite smoke >/dev/null 2>&1
  echo "bytecode in $PYTHONPYCACHEPREFIX: $(find "$PYTHONPYCACHEPREFIX" -name '*.pyc' | wc -l) files"
}
