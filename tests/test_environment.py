"""The supported Triton range: pyproject.toml and the runtime check say the same bounds, and a
Triton outside them stops every command and a pytest -m verify session with one line, exit 2."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from verification.running import environment
from verification.cli import main
from verification.running.environment import OVERRIDE, TRITON_RANGE, check_triton, range_text, triton_problem
from verification.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_bounds_triton_as_the_check_does():
    deps = (ROOT / "pyproject.toml").read_text()
    assert f'"triton{range_text()}"' in deps
    assert range_text() == ">=3.6,<3.10" and TRITON_RANGE == ((3, 6), (3, 10))


@pytest.mark.parametrize("version", ["3.6.0", "3.7.1", "3.8.0", "3.9.0", "3.9.1+gitabcdef", "3.6.0+rocm7.0"])
def test_versions_inside_the_range_pass(version):
    assert triton_problem(version) is None


@pytest.mark.parametrize("version", ["3.5.1", "3.3.0", "3.10.0", "4.0.0", "2.3.1"])
def test_versions_outside_the_range_name_the_version_and_the_range(version):
    line = triton_problem(version)
    assert line and "\n" not in line
    assert f"triton {version} is installed" in line and ">=3.6,<3.10" in line and OVERRIDE in line


def test_no_triton_says_so():
    assert "triton is not installed" in triton_problem(None)


def test_the_installed_triton_is_inside_the_range():
    assert triton_problem(environment.installed_triton()) is None


def test_a_command_with_triton_outside_the_range_exits_2_in_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(environment, "installed_triton", lambda: "3.10.0")
    monkeypatch.delenv(OVERRIDE, raising=False)
    out = tmp_path / "emu"
    assert main(["run", "--backend", "emulator", "--suite", "smoke", "--case", "smoke/dense-T64-lb-5",
                 "--out", str(out), "--no-report"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("kda-verify run: error: triton 3.10.0 is installed; kda-verify supports triton >=3.6,<3.10 "
                   f"(pip install 'triton>=3.6,<3.10', or {OVERRIDE}=1 to try this one anyway)")
    assert not out.exists()                      # nothing was done
    monkeypatch.setenv(OVERRIDE, "1")
    check_triton()                               # the override lets it through


def test_check_raises_usage_error(monkeypatch):
    monkeypatch.setattr(environment, "installed_triton", lambda: "3.5.0")
    monkeypatch.delenv(OVERRIDE, raising=False)
    with pytest.raises(UsageError, match=r"triton 3\.5\.0 is installed"):
        check_triton()


def test_pytest_verify_with_triton_outside_the_range_exits_2(tmp_path):
    # a plugin that fakes the installed version, loaded before kda-verify's own configure runs
    (tmp_path / "fake_triton_version.py").write_text(
        "from verification.running import environment\nenvironment.installed_triton = lambda: '3.10.0'\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != OVERRIDE}
    env["PYTHONPATH"] = f"{tmp_path}:{ROOT / 'tests'}:{env.get('PYTHONPATH', '')}"
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "fake_triton_version", "tests/test_verify_matrix.py",
                        "-p", "no:cacheprovider", "-q", "-m", "verify", "--kda-backend", "emulator",
                        "--kda-case", "smoke/dense-T64-lb-5"],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert re.search(r"kda-verify: error: triton 3\.10\.0 is installed; kda-verify supports triton >=3\.6,<3\.10",
                     r.stdout + r.stderr), r.stdout + r.stderr
