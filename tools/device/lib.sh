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
