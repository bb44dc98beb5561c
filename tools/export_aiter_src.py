#!/usr/bin/env python3
"""Write the SRC files an aiter assembly needs from git clones the user has, sha256-checked.

    python tools/export_aiter_src.py --git ROCm/aiter=<clone> [--git yhl-amd/aiter=<clone> ...]
                                     [--table upstream|newest] [--src DIR] [--base DIR]

For every row of the table (``upstream``: tools/assemble_aiter_upstream.py, the default;
``newest``: tools/assemble_aiter.py) whose repository has a clone given, writes
``git --git-dir=<clone>/.git show <commit>:<path>`` to ``SRC/<owner>+<repo>@<commit>/<path>``
(default SRC ``.vendor/aiter-src``) and checks its sha256 against the table.  ``--base DIR``
also exports the base tree of the upstream table (ROCm/aiter at its base commit, ``aiter/`` and
``COMMIT``) into DIR.  A clone is a directory with ``.git`` or a bare git directory; a fork's
commits can also be fetched into one clone (``git fetch <fork url> <commit>``), then that clone is
given once per repository name.  Rows without a clone, or whose commit the clone lacks, are listed as missing;
exit 0 when every row was written, 1 when some are missing, 2 on bad input (one line: a clone
that is not a git directory, a base commit it lacks, a sha256 that differs).
"""
from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import assemble_aiter  # noqa: E402
import assemble_aiter_upstream  # noqa: E402

TABLES = {"upstream": assemble_aiter_upstream.FILES, "newest": assemble_aiter.FILES}


def fail(msg: str):
    print(f"export_aiter_src: {msg}", file=sys.stderr)
    sys.exit(2)


def git_dir(path: Path) -> Path:
    d = path / ".git" if (path / ".git").exists() else path
    if not (d / "HEAD").is_file():
        fail(f"--git: expected a git clone or git directory, got {path}")
    return d


def git_show(gd: Path, commit: str, path: str):
    """The file's bytes at that commit, or None when the clone lacks the commit or the path."""
    res = subprocess.run(["git", f"--git-dir={gd}", "show", f"{commit}:{path}"], capture_output=True)
    return res.stdout if res.returncode == 0 else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--git", action="append", default=[], metavar="OWNER/REPO=DIR",
                    help="a clone holding that repository's commits (repeatable)")
    ap.add_argument("--table", choices=sorted(TABLES), default="upstream")
    ap.add_argument("--src", type=Path, default=assemble_aiter.ROOT / ".vendor" / "aiter-src")
    ap.add_argument("--base", type=Path, default=None, metavar="DIR",
                    help="also export ROCm/aiter's aiter/ tree at the upstream table's base commit into DIR")
    a = ap.parse_args(argv)
    clones = {}
    for item in a.git:
        repo, sep, path = item.partition("=")
        if not sep or "/" not in repo:
            fail(f"--git: expected OWNER/REPO=DIR, got {item!r}")
        clones[repo] = git_dir(Path(path))
    if a.base is not None:
        if "ROCm/aiter" not in clones:
            fail("--base: expected --git ROCm/aiter=<clone> as well, got none")
        commit = assemble_aiter_upstream.BASE_COMMIT
        res = subprocess.run(["git", f"--git-dir={clones['ROCm/aiter']}", "archive", commit, "aiter"],
                             capture_output=True)
        if res.returncode != 0:
            fail(f"--base: expected commit {commit} in the ROCm/aiter clone, got: {res.stderr.decode().strip()}")
        a.base.mkdir(parents=True, exist_ok=True)
        tarfile.open(fileobj=io.BytesIO(res.stdout)).extractall(a.base)
        (a.base / "COMMIT").write_text(commit + "\n")
        print(f"base: ROCm/aiter @ {commit[:10]} -> {a.base}")
    missing = 0
    for repo, commit, path, _dest, digest, _why in TABLES[a.table]:
        target = a.src / f"{repo.replace('/', '+')}@{commit}" / path
        if repo not in clones:
            print(f"missing (no --git {repo}=...): {repo} @ {commit[:10]} {path}")
            missing += 1
            continue
        data = git_show(clones[repo], commit, path)
        if data is None:
            print(f"missing (not in the {repo} clone; git fetch it): {repo} @ {commit[:10]} {path}")
            missing += 1
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        got = assemble_aiter.sha256(target)
        if got != digest:
            fail(f"{target}: expected sha256 {digest}, got {got}")
        print(f"ok: {repo} @ {commit[:10]} {path}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
