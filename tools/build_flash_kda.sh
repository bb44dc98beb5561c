#!/usr/bin/env bash
# Build and install Moonshot's FlashKDA (module flash_kda) from a source tree SRC for SM90
# (a recursive clone of https://github.com/MoonshotAI/FlashKDA, or a tree exported by
# tools/vendor_flash_kda.sh), then print the installed version and the build's wall time:
#
#   tools/build_flash_kda.sh SRC
#
# Environment (defaults): FLASH_KDA_CUDA_ARCHS=90a, MAX_JOBS=16, NVCC_THREADS=4,
# FLASH_KDA_VERSION_SUFFIX=+<SRC/VENDORED's label (the FlashKDA commit, or the LABEL it was vendored
# with), else git's short HEAD>, PIP_ARGS (extra pip args), FLASH_KDA_TARGET (install into that
# directory with pip --target instead of site-packages: two builds side by side, each picked by
# PYTHONPATH; the import check below then runs with it first on PYTHONPATH).
# Needs nvcc (CUDA >= 12.9) and a CUDA build of torch in the python3 it runs.
set -euo pipefail
if [ $# -ne 1 ]; then
  echo "usage: tools/build_flash_kda.sh SRC: expected 1 argument (the FlashKDA source tree), got $#" >&2
  exit 2
fi
SRC=$(cd "$1" 2>/dev/null && pwd) || { echo "SRC: expected a directory, got '$1'" >&2; exit 2; }
[ -f "$SRC/setup.py" ] && [ -f "$SRC/csrc/flash_kda.cpp" ] || {
  echo "SRC: expected a FlashKDA tree (setup.py, csrc/flash_kda.cpp), got '$1'" >&2; exit 2; }
[ -f "$SRC/cutlass/include/cutlass/cutlass.h" ] || {
  echo "SRC: expected cutlass headers at SRC/cutlass/include (git submodule update --init, or tools/vendor_flash_kda.sh), got none in '$1'" >&2; exit 2; }
command -v nvcc >/dev/null 2>&1 || [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ] || {
  echo "nvcc: expected CUDA >= 12.9 on PATH or in \$CUDA_HOME, got none" >&2; exit 2; }
python3 -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null || {
  echo "torch: expected a CUDA build of torch in python3, got $(python3 -c 'import torch; print(torch.__version__)' 2>&1 | tail -1)" >&2; exit 2; }
if [ -z "${FLASH_KDA_VERSION_SUFFIX:-}" ]; then
  if [ -f "$SRC/VENDORED" ]; then
    FLASH_KDA_VERSION_SUFFIX=+$(awk '$1 == "label" {l = $2} $1 == "flashkda" {c = substr($2, 1, 7)} END {print (l != "" ? l : c)}' "$SRC/VENDORED")
  else
    FLASH_KDA_VERSION_SUFFIX=+$(git -C "$SRC" rev-parse --short HEAD 2>/dev/null || echo unknown)
  fi
fi
# the inverse the source builds, named in the version so the moonshot backend picks its recipe
# (kda_kernels/moonshot.py): 8x8 fp32 forward substitution from FlashKDA 7afb9f45 on, else fp16 Neumann
case "$FLASH_KDA_VERSION_SUFFIX" in
  *fwdsub*|*neumann*) ;;
  *) if grep -q "inv_fwd_subst_fused_1warp" "$SRC/csrc/smxx/utils.cuh" 2>/dev/null; then FLASH_KDA_VERSION_SUFFIX+=.fwdsub
     elif grep -q "neumann_inv_fused_1warp" "$SRC/csrc/smxx/utils.cuh" 2>/dev/null; then FLASH_KDA_VERSION_SUFFIX+=.neumann; fi ;;
esac
export FLASH_KDA_VERSION_SUFFIX
export FLASH_KDA_CUDA_ARCHS=${FLASH_KDA_CUDA_ARCHS:-90a} MAX_JOBS=${MAX_JOBS:-16} NVCC_THREADS=${NVCC_THREADS:-4}
export PATH="${CUDA_HOME:-/usr/local/cuda}/bin:$PATH"
# FlashKDA's setup.py runs `git submodule update --init cutlass` unchecked; where git is missing
# that call would raise, so a stand-in that exits 1 is put first on PATH (the headers are in SRC).
if ! command -v git >/dev/null 2>&1; then
  SHIM=$(mktemp -d); printf '#!/bin/sh\nexit 1\n' > "$SHIM/git"; chmod +x "$SHIM/git"; export PATH="$SHIM:$PATH"
fi
echo "building flash_kda from $SRC: archs $FLASH_KDA_CUDA_ARCHS, MAX_JOBS $MAX_JOBS, NVCC_THREADS $NVCC_THREADS, suffix $FLASH_KDA_VERSION_SUFFIX"
TGT=()
if [ -n "${FLASH_KDA_TARGET:-}" ]; then
  mkdir -p "$FLASH_KDA_TARGET"; FLASH_KDA_TARGET=$(cd "$FLASH_KDA_TARGET" && pwd)
  TGT=(--target "$FLASH_KDA_TARGET" --upgrade); export PYTHONPATH="$FLASH_KDA_TARGET${PYTHONPATH:+:$PYTHONPATH}"
fi
t0=$(date +%s.%N)
python3 -m pip install --no-deps --no-build-isolation "${TGT[@]}" ${PIP_ARGS:-} "$SRC"
t1=$(date +%s.%N)
cd /
VERSION=$(python3 -c "import importlib.metadata as m, os, flash_kda
d = [x for x in m.distributions(path=[os.path.dirname(os.path.dirname(flash_kda.__file__))]) if x.metadata['Name'].replace('-', '_') == 'flash_kda']
print(d[0].version if d else m.version('flash_kda'), 'from', os.path.dirname(flash_kda.__file__))")
printf 'built flash_kda %s in %.0f s\n' "$VERSION" "$(echo "$t1 - $t0" | bc -l 2>/dev/null || python3 -c "print($t1 - $t0)")"
