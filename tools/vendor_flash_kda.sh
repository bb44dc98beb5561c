#!/usr/bin/env bash
# Export Moonshot's FlashKDA and the cutlass headers it builds against into DEST (default
# .vendor/flashkda, git-ignored), from two git directories the user provides:
#
#   tools/vendor_flash_kda.sh FLASHKDA_GITDIR CUTLASS_GITDIR [DEST]
#
# FLASHKDA_GITDIR: a clone (or bare mirror) of https://github.com/MoonshotAI/FlashKDA
# CUTLASS_GITDIR:  a clone (or bare mirror) of https://github.com/NVIDIA/cutlass holding the
#                  commit FlashKDA's `cutlass` submodule pins
# FlashKDA's HEAD is exported whole; of cutlass only include/, tools/util/include/ and
# examples/common/ at the pinned commit (FlashKDA's setup.py needs no more), placed as DEST/cutlass/.
# The tree is the user's copy of third-party code: it is never committed to this project.
# DEST/VENDORED says what was exported (FlashKDA commit, cutlass commit).
set -euo pipefail
if [ $# -lt 2 ] || [ $# -gt 3 ]; then
  echo "usage: tools/vendor_flash_kda.sh FLASHKDA_GITDIR CUTLASS_GITDIR [DEST]: expected 2 or 3 arguments, got $#" >&2
  exit 2
fi
FK=$1 CU=$2 DEST=${3:-.vendor/flashkda}
gd() {  # the git dir of a clone or a bare repository, or a one-line error (exit 2)
  local d
  d=$(git -C "$1" rev-parse --absolute-git-dir 2>/dev/null) || d=$(git --git-dir="$1" rev-parse --absolute-git-dir 2>/dev/null) || {
    echo "$2: expected a git repository (clone or bare), got '$1'" >&2; exit 2; }
  echo "$d"
}
FKG=$(gd "$FK" FLASHKDA_GITDIR)
CUG=$(gd "$CU" CUTLASS_GITDIR)
git --git-dir="$FKG" cat-file -e HEAD:setup.py 2>/dev/null && git --git-dir="$FKG" cat-file -e HEAD:csrc/flash_kda.cpp 2>/dev/null || {
  echo "FLASHKDA_GITDIR: expected MoonshotAI/FlashKDA (HEAD with setup.py and csrc/flash_kda.cpp), got '$FK'" >&2; exit 2; }
PIN=$(git --git-dir="$FKG" ls-tree HEAD cutlass | awk '$2 == "commit" {print $3}')
[ -n "$PIN" ] || { echo "FLASHKDA_GITDIR: expected a 'cutlass' submodule entry at HEAD, got none in '$FK'" >&2; exit 2; }
git --git-dir="$CUG" cat-file -e "$PIN^{commit}" 2>/dev/null || {
  echo "CUTLASS_GITDIR: expected the commit FlashKDA pins ($PIN), not found in '$CU' (fetch it there)" >&2; exit 2; }
FKC=$(git --git-dir="$FKG" rev-parse HEAD)
rm -rf "$DEST"
mkdir -p "$DEST"
git --git-dir="$FKG" archive HEAD | tar -x -C "$DEST"
rm -rf "$DEST/cutlass"
mkdir -p "$DEST/cutlass"
git --git-dir="$CUG" archive "$PIN" include tools/util/include examples/common | tar -x -C "$DEST/cutlass"
want=$(git --git-dir="$CUG" ls-tree -r "$PIN" include tools/util/include examples/common | wc -l)
got=$(find "$DEST/cutlass" -type f | wc -l)
[ "$want" -eq "$got" ] || { echo "CUTLASS_GITDIR: expected $want files under include, tools/util/include, examples/common at $PIN, exported $got (blobs missing from '$CU'?)" >&2; exit 1; }
printf 'flashkda %s\ncutlass %s\n' "$FKC" "$PIN" > "$DEST/VENDORED"
echo "exported FlashKDA ${FKC:0:7} with cutlass ${PIN:0:7} (include, tools/util/include, examples/common) into $DEST ($(du -sh "$DEST" | cut -f1))"
