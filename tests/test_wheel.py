"""The installed package, not the checkout: a wheel built from the sources holds
verification/judging/tolerances.yaml, and installed with --no-deps into a directory of its own (no
editable link, no repository next to it) ``load_tolerances()`` finds it there, and the public API
``kda_verify.assert_kda_close`` imports from it.  The wheel is built
from a copy of the sources (pyproject.toml, README.md, the four packages), so the build leaves
nothing in the checkout; --no-build-isolation uses the installed setuptools (no network).  Code
only the tests and tools use (tests/planted.py, tests/errors_table.py, the tests' helper
modules) is not in the wheel."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kda_ref", "kda_kernels", "kda_verify", "verification")
# modules only tests and tools import: they live in tests/, and no copy may ship under a package
TEST_ONLY = ("planted.py", "errors_table.py")

pytest.importorskip("setuptools")
pytest.importorskip("wheel")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path_factory.mktemp("dist")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "--wheel-dir", str(dist), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    wheels = sorted(dist.glob("kda_verify-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_the_wheel_holds_the_tolerances(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "verification/judging/tolerances.yaml" in names, sorted(n for n in names if not n.endswith(".py"))
    assert not any(n == "tolerances.yaml" for n in names)


def test_the_wheel_holds_every_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for pkg in PACKAGES:
        assert f"{pkg}/__init__.py" in names, (pkg, sorted({n.split("/")[0] for n in names}))


def test_installed_from_the_wheel_the_default_tolerances_load(wheel, tmp_path):
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target),
                        str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    code = ("import verification, verification.judging.tolerances as t; db = t.load_tolerances(); "
            "import kda_verify; assert callable(kda_verify.assert_kda_close); "
            "print(kda_verify.__file__); print(t.DEFAULT_PATH); print(len(db))")
    env = {k: v for k, v in os.environ.items() if k != "KDA_TOLERANCES"}
    env["PYTHONPATH"] = str(target)
    (tmp_path / "elsewhere").mkdir()
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path / "elsewhere", env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    module, path, entries = r.stdout.split()
    assert Path(module).is_relative_to(target), f"imported {module}, not the wheel's copy under {target}"
    assert Path(module) == target / "kda_verify" / "__init__.py"
    assert Path(path) == target / "verification" / "judging" / "tolerances.yaml"
    assert int(entries) >= 5


def test_the_wheel_ships_no_test_only_module(wheel):
    """No module of the wheel is test code: none named like a module of tests/ (the helpers the
    tests import, tests/planted.py and tests/errors_table.py among them), none named test_*.py
    or conftest.py, nothing under a tests/ folder."""
    names = [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")]
    helpers = {p.name for p in (ROOT / "tests").glob("*.py")} | set(TEST_ONLY)
    shipped = [n for n in names if Path(n).name in helpers or Path(n).name.startswith("test_")
               or Path(n).name == "conftest.py" or "tests" in Path(n).parts[:-1]]
    assert not shipped, f"test-only modules in the wheel: {shipped}"
