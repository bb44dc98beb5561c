#!/usr/bin/env python3
"""Assemble aiter's newest public FlashKDA layout from source trees the user provides.

No aiter code is part of this repository.  This recipe builds ``OUT`` (default
``.vendor/aiter-newest``, git-ignored) from

  BASE  a copy of ROCm/aiter's ``aiter/`` tree (default ``.vendor/aiter-2026-08``, holding
        ``aiter/`` and optionally ``COMMIT`` with the 40-hex commit it was exported from), e.g.
            git --git-dir=<aiter clone>/.git archive HEAD aiter | tar -x -C .vendor/aiter-2026-08
  SRC   single files of aiter forks (default ``.vendor/aiter-src``), each saved as
        ``SRC/<owner>+<repo>@<commit>/<path>``, byte for byte as published (the sha256 of
        every file is checked against the table below)
  tools/aiter_shims   the stubs this project writes itself (see its README.md)

Result: OUT/aiter = BASE/aiter, overlaid with the FILES below, plus the ``intj`` stand-in at
OUT/intj, plus the source transformations in TRANSFORMS; OUT/ASSEMBLY.json records every
version (commits, paths, sha256) and every stub and transformation.  Use it with
``PYTHONPATH=OUT AITER_TRITON_ONLY=1``.

    python tools/assemble_aiter.py [--base DIR] [--src DIR] [--out DIR]

Bad input (a missing tree or file, a file whose sha256 differs) is one line on stderr, exit 2.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIMS = ROOT / "tools" / "aiter_shims"
P = "aiter/ops/triton/"

# (owner/repo, commit, path in that repo, path in OUT if not the same, sha256, why)
FILES = (
    ("zhou9402/aiter", "78bba27df3db09b04475f91cf40d7a88bc42fb55",
     P + "_triton_kernels/chunk_delta_attn/flash_kda.py", None,
     "9bd872e974293fc553f3ec03ae91c178cbe42126b62a0f8f65c15d1370c3d49a",
     "flash_kda_fwd with the paged state_cache / state_indices / has_initial_state, out=, "
     "AITER_FDA_ENABLE, AITER_FDA_USE_GLUON, fast_launch"),
    ("zhou9402/aiter", "78bba27df3db09b04475f91cf40d7a88bc42fb55",
     P + "_triton_kernels/chunk_delta_attn/chunk_delta_attn_utils.py", None,
     "2e387084d4bd4247f21bb04ade661b56b9884a49bb77be0a2aebccdf1294e499",
     "input_guard(skip=...), the tuned-config helpers flash_kda.py imports"),
    ("zhou9402/aiter", "78bba27df3db09b04475f91cf40d7a88bc42fb55",
     P + "_triton_kernels/chunk_delta_attn/chunk_fwd.py", None,
     "9a9bbb410fae80bd39655f20bf4dca8401db574f04aa9657fab2f7b0b111405d",
     "chunk_delta_attn_fwd dispatching to flash_kda_fwd under AITER_FDA_ENABLE"),
    ("lijinpei-amd/aiter", "f483019584290ba4bd7ad435b97be9e2754c87b8",
     P + "_triton_kernels/chunk_delta_attn/fast_launch.py", None,
     "c769166dea34f27d64ae1d7d6faeca47f230ea2bda8f0de9c707f233527f0c86",
     "fast_launch, which flash_kda.py and the Gluon kernels launch through"),
    ("yuychang/aiter", "20f9942b4200e489cbfaa57ab23168cc895afe8f",
     P + "_gluon_kernels/gfx950/chunk_delta_attn/flash_kda_k1.py", None,
     "6adbfbd2c70f29f1a9b0dd48b7c4851e36a789ac51fe2a81c5eff0fbcc06fd03",
     "the gfx950 Gluon K1 (gluon_k1_prepare, as flash_kda.py calls it)"),
    ("yuychang/aiter", "20f9942b4200e489cbfaa57ab23168cc895afe8f",
     P + "_gluon_kernels/gfx950/chunk_delta_attn/flash_kda_k2.py", None,
     "21e09d087619480803a9210344d80cb4ec08913b42aea38037c7a882a5288532",
     "the gfx950 Gluon K2 pass A (k2_ab_fused_fast, build_layouts, as flash_kda.py calls them)"),
    ("rebklee/aiter", "93a16518df204849b0d89e6802791edd6b2183cf",
     P + "_gluon_kernels/gfx950/chunk_delta_attn/flash_kda_k2.py",
     P + "_gluon_kernels/gfx950/chunk_delta_attn/flash_kda_k2_segment.py",
     "be8e98a00040a2b7872e91d54275b1d32f262ad61a848f6a6403703dbea9e114",
     "k2_segment_gluon (no launcher routes to it), under another module name so that it does not "
     "replace the K2 module flash_kda.py imports"),
    ("ROCm/aiter", "c38e874dc993679c5f9387bf396535f6a6dc750d",
     P + "utils/config_utils.py", None,
     "0a9a24d26b4edcea1235232af88c8f5477a9e484cf1d6b7f05fc4ff5167b6722",
     "resolve_config_dir / load_config_json (absent from the 2026-08 tree)"),
    ("shantipriya-amd/aiter", "9dcd8207e5bcca5ec0082c80e1d058e33ca6561f",
     P + "utils/tuned_config_utils.py", None,
     "0e402fb3ccffe8fa791714c6335f53de657c3045763f7cd0e1e9cbd316c6a9a7",
     "autotune_configs / get_tuned_kernel_config(backend=...)"),
    ("yuychang/aiter", "214fbe3d3b97d4c6af1d74cd78e3355f24718f5d",
     P + "utils/logger.py", None,
     "1199a4044a8a27de0822e11bb702d409a02bd766f668fd81bb8167d47ab9b9ba",
     "AiterTritonLogger with %-style arguments, as flash_kda.py logs"),
)

STUBS = (("intj/__init__.py", "intj/__init__.py",
          "stand-in for the unpublished native-launcher package fast_launch.py imports; "
          "make_launcher raises (only use_intj=True would call it)"),)

K1 = P + "_gluon_kernels/gfx950/chunk_delta_attn/flash_kda_k1.py"
UTILS = P + "_triton_kernels/chunk_delta_attn/chunk_delta_attn_utils.py"
ARCH_INFO = P + "utils/_triton/arch_info.py"


def wrap_module_constexprs(text: str) -> tuple[str, int]:
    """Append ``NAME = gl.constexpr(NAME)`` for every module-level ``NAME: gl.constexpr = gl.X(...)``
    (the original lines stay as they are, so module-level code reading ``NAME.attr`` still sees the
    layout object; the kernels, compiled later, see the constexpr).  Returns the new text and the
    number of names rebound."""
    tree = ast.parse(text)
    names = [node.target.id for node in tree.body
             if isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Call)
             and isinstance(node.target, ast.Name) and ast.unparse(node.annotation) == "gl.constexpr"
             and ast.unparse(node.value.func) != "gl.constexpr"]
    if not names:
        return text, 0
    trailer = ["", "", "# --- appended by kda-verify's tools/assemble_aiter.py: triton 3.6 compiles a Gluon kernel",
               "# --- reading a module-level layout only if it is a gl.constexpr object"]
    trailer += [f"{n} = gl.constexpr({n})" for n in names]
    return text.rstrip("\n") + "\n" + "\n".join(trailer) + "\n", len(names)


PROG = "assemble_aiter"    # the prefix of its one-line errors (a sibling tool sets its own)


def fail(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr)
    sys.exit(2)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_sources(src: Path, files) -> list:
    """(file under ``src``, path in OUT, record) of every FILES row; a missing file or one whose
    sha256 differs from the table's is bad input."""
    sources = []
    for repo, commit, path, dest, digest, why in files:
        f = src / f"{repo.replace('/', '+')}@{commit}" / path
        if not f.is_file():
            fail(f"--src: expected {repo} @ {commit} {path} at {f}, got no file")
        got = sha256(f)
        if got != digest:
            fail(f"--src: expected sha256 {digest} for {f}, got {got}")
        sources.append((f, dest or path, dict(repo=repo, commit=commit, path=path, dest=dest or path,
                                              sha256=digest, why=why)))
    return sources


def start_tree(base: Path, out: Path) -> str:
    """OUT/aiter = BASE/aiter (an OUT left by an earlier assembly is replaced); the base's commit."""
    if not (base / "aiter" / "ops" / "triton").is_dir():
        fail(f"--base: expected a copy of aiter's aiter/ tree under {base}/aiter, got none")
    base_commit = (base / "COMMIT").read_text().strip() if (base / "COMMIT").is_file() else "unknown"
    if out.exists():
        if not (out / "ASSEMBLY.json").is_file():
            fail(f"--out: {out} exists and was not made by this script (no ASSEMBLY.json); remove it first")
        shutil.rmtree(out)
    shutil.copytree(base / "aiter", out / "aiter", ignore=shutil.ignore_patterns("__pycache__"))
    return base_commit


def overlay(out: Path, sources) -> None:
    for f, dest, _ in sources:
        target = out / dest
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, target)


def add_stubs(out: Path, stubs) -> list:
    """Copy each (file of tools/aiter_shims, path in OUT, why); their records."""
    records = []
    for src, dest, why in stubs:
        target = out / dest
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(SHIMS / src, target)
        records.append(dict(file=dest, source=f"tools/aiter_shims/{src}", why=why))
    return records


def finish(out: Path, record: dict) -> None:
    """Write OUT/ASSEMBLY.json and print what went in."""
    (out / "ASSEMBLY.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"assembled {out}: base {record['base']['repo']} @ {record['base']['commit']}")
    for s in record["files"]:
        print(f"  {s['repo']} @ {s['commit'][:7]}  {s['path']}" + ("" if s["dest"] == s["path"] else f" -> {s['dest']}"))
    for s in record["stubs"]:
        print(f"  stub {s['file']}")
    for t in record["transforms"]:
        print(f"  transform {t['file']}: {t['what']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, default=ROOT / ".vendor" / "aiter-2026-08")
    ap.add_argument("--src", type=Path, default=ROOT / ".vendor" / "aiter-src")
    ap.add_argument("--out", type=Path, default=ROOT / ".vendor" / "aiter-newest")
    a = ap.parse_args(argv)

    sources = check_sources(a.src, FILES)
    base_commit = start_tree(a.base, a.out)
    overlay(a.out, sources)
    stubs = add_stubs(a.out, STUBS)

    k1 = a.out / K1
    text, n = wrap_module_constexprs(k1.read_text())
    if n == 0:
        fail(f"{K1}: expected module-level gl.constexpr layouts to wrap, found none")
    k1.write_text(text)
    transforms = [dict(file=K1, wrapped=n, what=f"{n} module-level `NAME: gl.constexpr = gl.X(...)` layouts "
                       "rebound at the end of the module as `NAME = gl.constexpr(NAME)`",
                       why="triton 3.6 rejects a bare layout object read as a global in a Gluon kernel "
                           "('SwizzledSharedLayout' object has no attribute '_flatten_ir')")]

    utils = a.out / UTILS
    utils.write_text(utils.read_text() + (SHIMS / "chunk_delta_attn_utils_compat.py").read_text())
    transforms.append(dict(file=UTILS, what="appended tools/aiter_shims/chunk_delta_attn_utils_compat.py: "
                           "chunk_delta_attn_autotune_configs(configs, default_config)",
                           why="the 2026-08 siblings the package __init__ imports (gla_output, wy_fast, "
                               "utils/cumsum) import that name, which the newer utils module dropped"))

    transforms.append(append_arch_compat(a.out))

    record = dict(base=dict(repo="ROCm/aiter", commit=base_commit, tree=str(a.base)),
                  files=[s[2] for s in sources], stubs=stubs, transforms=transforms,
                  not_provided=["CHUNK_DELTA_ATTN DEFAULT.json tuned configs: aiter's own fallbacks apply"])
    finish(a.out, record)
    return 0


def append_arch_compat(out: Path) -> dict:
    """Append tools/aiter_shims/arch_info_compat.py to the tree's arch_info; its record."""
    arch = out / ARCH_INFO
    arch.write_text(arch.read_text() + (SHIMS / "arch_info_compat.py").read_text())
    return dict(file=ARCH_INFO, what="appended tools/aiter_shims/arch_info_compat.py: a non-string "
                "arch (Triton's CUDA target, e.g. 90) becomes 'sm90'",
                why="the newest config_utils.resolve_config_dir asserts a string arch, so flash_kda "
                    "would not import on an NVIDIA GPU; AMD archs are strings and unchanged")


if __name__ == "__main__":
    sys.exit(main())
