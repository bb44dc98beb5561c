"""tools/assemble_aiter_upstream.py (sharing tools/assemble_aiter.py's recipe) and
tools/export_aiter_src.py, on stand-in trees this test writes: no aiter file is needed.  The
tables are swapped for rows naming the stand-in files, so what is checked is the recipe:
sha256 verified, files overlaid at their destinations, ASSEMBLY.json recording each file's
repository / commit / sha256, bad input one line and exit 2; and the exporter writing
``SRC/<owner>+<repo>@<commit>/<path>`` from a git clone."""
import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def _load(name):
    sys.path.insert(0, str(TOOLS))
    try:
        spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(TOOLS))


upstream = _load("assemble_aiter_upstream")
exporter = _load("export_aiter_src")
core = upstream.core


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _trees(tmp_path):
    base = tmp_path / "base"
    (base / "aiter" / "ops" / "triton" / "attention").mkdir(parents=True)
    (base / "aiter" / "ops" / "triton" / "attention" / "old.py").write_text("OLD = 1\n")
    (base / "COMMIT").write_text("e" * 40 + "\n")
    for _shim, dest, _what, _why in upstream.APPENDS:
        (base / dest).parent.mkdir(parents=True, exist_ok=True)
        (base / dest).write_text("import os\n")
    src = tmp_path / "src"
    files = []
    for repo, commit, path, dest, body in (
            ("ROCm/aiter", "a" * 40, "aiter/ops/triton/attention/new.py", None, b"NEW = 2\n"),
            ("yhl-amd/aiter", "b" * 40, "aiter/ops/triton/configs/x/DEFAULT.json",
             "aiter/ops/triton/configs/flat-DEFAULT.json", b'{"k": 1}\n')):
        f = src / f"{repo.replace('/', '+')}@{commit}" / path
        f.parent.mkdir(parents=True)
        f.write_bytes(body)
        files.append((repo, commit, path, dest, _sha(body), "why"))
    return base, src, tuple(files)


def test_assembly_overlays_checked_files_and_records_them(tmp_path, monkeypatch, capsys):
    base, src, files = _trees(tmp_path)
    monkeypatch.setattr(upstream, "FILES", files)
    out = tmp_path / "out"
    assert upstream.main(["--base", str(base), "--src", str(src), "--out", str(out)]) == 0
    att = out / "aiter" / "ops" / "triton" / "attention"
    assert (att / "old.py").read_text() == "OLD = 1\n" and (att / "new.py").read_text() == "NEW = 2\n"
    assert (out / "aiter" / "ops" / "triton" / "configs" / "flat-DEFAULT.json").read_text() == '{"k": 1}\n'
    rec = json.loads((out / "ASSEMBLY.json").read_text())
    assert rec["base"] == dict(repo="ROCm/aiter", commit="e" * 40, tree=str(base))
    assert [(f["repo"], f["commit"], f["dest"], f["sha256"]) for f in rec["files"]] == \
        [(r, c, d or p, s) for r, c, p, d, s, _ in files]
    assert rec["not_provided"] == upstream.NOT_PROVIDED
    # the project's stand-ins are copied and the appends made, each recorded with its source
    assert [(st["file"], st["source"]) for st in rec["stubs"]] == \
        [(d, f"tools/aiter_shims/{s}") for s, d, _w in upstream.STUBS]
    for s, d, _w in upstream.STUBS:
        assert (out / d).read_bytes() == (TOOLS / "aiter_shims" / s).read_bytes(), d
    assert [t["file"] for t in rec["transforms"]] == [d for _s, d, _w, _y in upstream.APPENDS]
    for s, d, _w, _y in upstream.APPENDS:
        assert (out / d).read_text() == "import os\n" + (TOOLS / "aiter_shims" / s).read_text(), d
    # a second run replaces its own output
    assert upstream.main(["--base", str(base), "--src", str(src), "--out", str(out)]) == 0


@pytest.mark.parametrize("damage", ["sha", "missing", "foreign_out", "no_base", "no_append_target"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, damage):
    base, src, files = _trees(tmp_path)
    monkeypatch.setattr(upstream, "FILES", files)
    out = tmp_path / "out"
    repo, commit, path = files[0][:3]
    f = src / f"{repo.replace('/', '+')}@{commit}" / path
    if damage == "sha":
        f.write_bytes(b"NEW = 3\n")
    elif damage == "missing":
        f.unlink()
    elif damage == "foreign_out":
        out.mkdir()
    elif damage == "no_append_target":
        (base / upstream.APPENDS[0][1]).unlink()
    else:
        base = tmp_path / "nowhere"
    with pytest.raises(SystemExit) as e:
        upstream.main(["--base", str(base), "--src", str(src), "--out", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("assemble_aiter_upstream: "), err
    assert {"sha": "expected sha256", "missing": "got no file", "foreign_out": "not made by this script",
            "no_base": "--base: expected", "no_append_target": "to append"}[damage] in err


def test_upstream_table_names_commits_and_sha256_only():
    """Every row: a 40-hex commit, a sha256, a reason; every fork row says it is a fork copy and
    why (ROCm/aiter publishes none at that path, or none that fits); every stand-in and append
    names its shim and says why."""
    for repo, commit, path, dest, digest, why in upstream.FILES:
        assert len(commit) == 40 and int(commit, 16) >= 0 and len(digest) == 64 and why, path
    forks = [(p, w) for r, _c, p, _d, _s, w in upstream.FILES if r != "ROCm/aiter"]
    assert forks and all(w.startswith("fork copy") for _p, w in forks), forks
    for shim, _dest, why in upstream.STUBS:
        assert (TOOLS / "aiter_shims" / shim).is_file() and why, shim
    for shim, _dest, what, why in upstream.APPENDS:
        assert (TOOLS / "aiter_shims" / shim).is_file() and what and why, shim


def _git(cwd, *args):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def test_exporter_writes_src_layout_from_a_clone_and_checks_sha256(tmp_path, monkeypatch, capsys):
    repo = tmp_path / "clone"
    (repo / "aiter" / "ops").mkdir(parents=True)
    (repo / "aiter" / "ops" / "k.py").write_text("K = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "k")
    commit = _git(repo, "rev-parse", "HEAD")
    row = ("ROCm/aiter", commit, "aiter/ops/k.py", None, _sha(b"K = 1\n"), "why")
    absent = ("yhl-amd/aiter", "c" * 40, "aiter/ops/c.json", None, "0" * 64, "why")
    monkeypatch.setitem(exporter.TABLES, "upstream", (row, absent))
    src = tmp_path / "src"
    assert exporter.main(["--git", f"ROCm/aiter={repo}", "--src", str(src)]) == 1     # one row missing
    assert (src / f"ROCm+aiter@{commit}" / "aiter" / "ops" / "k.py").read_text() == "K = 1\n"
    assert "missing (no --git yhl-amd/aiter=...)" in capsys.readouterr().out
    monkeypatch.setitem(exporter.TABLES, "upstream", ((*row[:4], "f" * 64, "why"),))
    with pytest.raises(SystemExit) as e:
        exporter.main(["--git", f"ROCm/aiter={repo}", "--src", str(src)])
    assert e.value.code == 2 and "expected sha256" in capsys.readouterr().err
