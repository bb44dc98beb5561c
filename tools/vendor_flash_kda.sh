#!/usr/bin/env bash
# Export Moonshot's FlashKDA at one commit and the cutlass headers it builds against into DEST
# (default .vendor/flashkda, git-ignored), from two git directories the user provides:
#
#   tools/vendor_flash_kda.sh FLASHKDA_GITDIR CUTLASS_GITDIR [DEST [COMMIT]]
#
# FLASHKDA_GITDIR: a clone (or bare mirror) of https://github.com/MoonshotAI/FlashKDA
# CUTLASS_GITDIR:  a clone (or bare mirror) of https://github.com/NVIDIA/cutlass holding the
#                  commit FlashKDA's `cutlass` submodule pins
# COMMIT:          the FlashKDA commit to export (default HEAD); e.g. 1ce47ea (fp16 Neumann inverse)
#                  or 7afb9f45 (8x8 fp32 forward substitution, the fix of FlashKDA issue #34)
# Of cutlass only include/, tools/util/include/ and examples/common/ at the pinned commit are
# exported (FlashKDA's setup.py needs no more), as DEST/cutlass/.  Two builds side by side:
#   CUTLASS_SHARED=DIR  export cutlass once into DIR/cutlass-<pin7> (kept when already complete) and
#                       make DEST/cutlass a relative symlink to it: trees pinning one cutlass share it
#   OVERLAY=DIR         copy DIR's files over the exported tree (a patch the user keeps outside this
#                       project, e.g. a fix taken from elsewhere); DEST/VENDORED lists every file replaced
#   LABEL=TEXT          the build's version label (letters, digits, dots; default: the commit's 7
#                       hex digits, with ".overlay" and the overlay's hash when OVERLAY is set);
#                       tools/build_flash_kda.sh makes it the local version (flash_kda 0.0.1+LABEL)
# The tree is the user's copy of third-party code: it is never committed to this project.
# DEST/VENDORED says what was exported (FlashKDA commit, cutlass commit, overlay files).
set -euo pipefail
if [ $# -lt 2 ] || [ $# -gt 4 ]; then
  echo "usage: tools/vendor_flash_kda.sh FLASHKDA_GITDIR CUTLASS_GITDIR [DEST [COMMIT]]: expected 2 to 4 arguments, got $#" >&2
  exit 2
fi
FK=$1 CU=$2 DEST=${3:-.vendor/flashkda} REV=${4:-HEAD}
gd() {  # the git dir of a clone or a bare repository, or a one-line error (exit 2)
  local d
  d=$(git -C "$1" rev-parse --absolute-git-dir 2>/dev/null) || d=$(git --git-dir="$1" rev-parse --absolute-git-dir 2>/dev/null) || {
    echo "$2: expected a git repository (clone or bare), got '$1'" >&2; exit 2; }
  echo "$d"
}
FKG=$(gd "$FK" FLASHKDA_GITDIR)
CUG=$(gd "$CU" CUTLASS_GITDIR)
FKC=$(git --git-dir="$FKG" rev-parse --verify -q "$REV^{commit}") || {
  echo "COMMIT: expected a commit of '$FK', got '$REV' (not found there: fetch it, e.g. git fetch origin $REV)" >&2; exit 2; }
git --git-dir="$FKG" cat-file -e "$FKC:setup.py" 2>/dev/null && git --git-dir="$FKG" cat-file -e "$FKC:csrc/flash_kda.cpp" 2>/dev/null || {
  echo "FLASHKDA_GITDIR: expected MoonshotAI/FlashKDA (setup.py and csrc/flash_kda.cpp at $REV), got '$FK'" >&2; exit 2; }
PIN=$(git --git-dir="$FKG" ls-tree "$FKC" cutlass | awk '$2 == "commit" {print $3}')
[ -n "$PIN" ] || { echo "FLASHKDA_GITDIR: expected a 'cutlass' submodule entry at $REV, got none in '$FK'" >&2; exit 2; }
git --git-dir="$CUG" cat-file -e "$PIN^{commit}" 2>/dev/null || {
  echo "CUTLASS_GITDIR: expected the commit FlashKDA pins ($PIN), not found in '$CU' (fetch it there)" >&2; exit 2; }
if [ -n "${LABEL:-}" ] && ! [[ "$LABEL" =~ ^[A-Za-z0-9]([A-Za-z0-9.]*[A-Za-z0-9])?$ ]]; then
  echo "LABEL: expected letters, digits and inner dots (a PEP 440 local version), got '$LABEL'" >&2; exit 2
fi
if [ -n "${OVERLAY:-}" ] && [ ! -d "$OVERLAY" ]; then
  echo "OVERLAY: expected a directory of files to copy over the tree, got '$OVERLAY'" >&2; exit 2
fi
export_cutlass() {  # export_cutlass DIR: cutlass's three directories at PIN into DIR, checked complete
  rm -rf "$1"; mkdir -p "$1"
  git --git-dir="$CUG" archive "$PIN" include tools/util/include examples/common | tar -x -C "$1"
  local want got
  want=$(git --git-dir="$CUG" ls-tree -r "$PIN" include tools/util/include examples/common | wc -l)
  got=$(find "$1" -type f | wc -l)
  [ "$want" -eq "$got" ] || { echo "CUTLASS_GITDIR: expected $want files under include, tools/util/include, examples/common at $PIN, exported $got (blobs missing from '$CU'?)" >&2; exit 1; }
  echo "$PIN" > "$1/PINNED"
}
rm -rf "$DEST"
mkdir -p "$DEST"
git --git-dir="$FKG" archive "$FKC" | tar -x -C "$DEST"
rm -rf "$DEST/cutlass"
if [ -n "${CUTLASS_SHARED:-}" ]; then
  mkdir -p "$CUTLASS_SHARED"
  SH=$(cd "$CUTLASS_SHARED" && pwd)/cutlass-${PIN:0:7}
  if [ "$(cat "$SH/PINNED" 2>/dev/null)" = "$PIN" ]; then echo "cutlass ${PIN:0:7} already exported in $SH: shared"
  else export_cutlass "$SH"; fi
  ln -s "$(python3 -c 'import os, sys; print(os.path.relpath(sys.argv[1], sys.argv[2]))' "$SH" "$(cd "$DEST" && pwd)")" "$DEST/cutlass"
else
  export_cutlass "$DEST/cutlass"
fi
printf 'flashkda %s\ncutlass %s\n' "$FKC" "$PIN" > "$DEST/VENDORED"
if [ -n "${OVERLAY:-}" ]; then
  (cd "$OVERLAY" && find . -type f | sed 's|^\./||' | sort) | while read -r f; do
    mkdir -p "$DEST/$(dirname "$f")"; cp "$OVERLAY/$f" "$DEST/$f"
    printf 'overlay %s %s\n' "$f" "$(sha256sum "$DEST/$f" | cut -c1-12)" >> "$DEST/VENDORED"
  done
  [ -n "${LABEL:-}" ] || LABEL=${FKC:0:7}.overlay$(grep '^overlay' "$DEST/VENDORED" | sha256sum | cut -c1-8)
fi
printf 'label %s\n' "${LABEL:-${FKC:0:7}}" >> "$DEST/VENDORED"
echo "exported FlashKDA ${FKC:0:7} with cutlass ${PIN:0:7} (include, tools/util/include, examples/common$([ -n "${CUTLASS_SHARED:-}" ] && echo ", shared")) into $DEST ($(du -sh "$DEST" | cut -f1)$([ -n "${CUTLASS_SHARED:-}" ] && echo " + $(du -sh "$SH" | cut -f1) cutlass")$([ -n "${OVERLAY:-}" ] && echo "; $(grep -c '^overlay' "$DEST/VENDORED") files overlaid from $OVERLAY"))"
