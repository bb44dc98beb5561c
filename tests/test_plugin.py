"""The pytest plugin: `pytest -m verify` ids, skips, failures, JUnit properties, report, xdist."""
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kda_test_backends import write_tolerances
from kda_kernels.emulator import EmulatorBackend

EMULATOR_ROUTES = [r.name for r in EmulatorBackend().routes()]

pytest_plugins = ["pytester"]

# pytester's in-process runs drop the modules they imported when they end, and triton's compiled
# extension aborts the process when it is imported a second time; so it is imported here, once,
# before any run (the whole suite imports it earlier; this file alone would not)
try:
    import triton  # noqa: F401
except ImportError:        # no triton: the matrix never imports it either
    pass

ROOT = Path(__file__).resolve().parents[1]
MATRIX = "tests/test_verify_matrix.py"
DENSE = "smoke/dense-T64-lb-5"


def _pytest(*args, timeout=240):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    env.pop("PYTEST_XDIST_WORKER", None)
    cmd = [sys.executable, "-m", "pytest", MATRIX, "-p", "no:cacheprovider", "-q", "-rfs", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def tol(tmp_path_factory):
    return write_tolerances(tmp_path_factory.mktemp("tol"))


@pytest.fixture
def matrix(pytester):
    """An in-process pytest (no interpreter start-up) over a copy of the matrix module."""
    pytester.makepyfile(test_matrix_copy=(ROOT / MATRIX).read_text())  # a basename of its own: the real module may be imported already

    def run(*args):
        res = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q", "-rfs", *args)
        return res.ret, "\n".join(res.outlines)
    return run


def test_ids_skips_failures_junit_properties_and_report(tmp_path, tol, matrix):
    xml, rep = tmp_path / "junit.xml", tmp_path / "rep"
    rc, out = matrix("-m", "verify", "--kda-backend", "emulator,kda_test_backends:unavailable,kda_test_backends:nan",
                "--kda-route", "flashkda,r1", "--kda-case", DENSE, "--kda-device", "cpu",
                "--kda-tolerances", tol, "--junitxml", str(xml), "--kda-report", str(rep))
    assert rc == 1, out
    assert "1 failed, 1 passed, 1 skipped" in out
    assert "backend unavailable: this test backend is never available" in out
    # the failing cell: its numbers, the rule it broke and its repro line
    assert f"FAILED test_matrix_copy.py::verify[test-nan-r1-{DENSE}]" in out
    assert "NaN never passes" in out and "repro: kda-verify run --backend kda_test_backends:nan" in out
    cases = {c.get("name"): c for c in ET.parse(xml).getroot().iter("testcase")}
    assert set(cases) == {f"verify[emulator-flashkda-{DENSE}]", f"verify[test-unavailable-r1-{DENSE}]",
                          f"verify[test-nan-r1-{DENSE}]"}
    props = {p.get("name"): p.get("value") for p in cases[f"verify[emulator-flashkda-{DENSE}]"].iter("property")}
    assert props["status"] == "pass" and props["case"] == DENSE
    assert float(props["o.err"]) > 0 and float(props["o.threshold"]) >= float(props["o.err"])
    assert props["repro"].startswith("kda-verify run --backend emulator --route flashkda")
    bad = {p.get("name"): p.get("value") for p in cases[f"verify[test-nan-r1-{DENSE}]"].iter("property")}
    assert bad["status"] == "fail" and bad["o.nan_frac"] != "0"
    assert cases[f"verify[test-unavailable-r1-{DENSE}]"].find("skipped") is not None
    report = json.loads((rep / "report.json").read_text())
    assert sorted(c["key"] for c in report["cells"]) == [f"emulator|flashkda|{DENSE}", f"test-nan|r1|{DENSE}"]
    assert report["summary"]["counts"]["fail"] == 1
    assert (rep / "report.html").exists() and "kda-verify report:" in out


def test_plain_run_does_not_expand_the_matrix(matrix):
    # the pyproject's addopts deselect `verify`; the plugin then yields no item and loads nothing
    rc, out = matrix("-m", "not verify and not gpu", "--kda-backend", "no_such_module:factory", "--collect-only")
    assert rc == 5, out          # 5: no tests collected
    assert "verify[" not in out and "deselected" not in out
    # and -m verify does expand it (the same bad backend now surfaces as the options item)
    rc, out = matrix("-m", "verify", "--kda-backend", "no_such_module:factory", "--collect-only")
    assert "verify[options]" in out


def test_bad_option_is_one_failing_item_that_names_it(tol, matrix):
    rc, out = matrix("-m", "verify", "--kda-backend", "emulator", "--kda-suite", "nope", "--kda-tolerances", tol)
    assert rc == 2, out          # bad input (verification.judging.policy), as `kda-verify run --suite nope` exits
    assert "--suite: expected one of smoke" in out


@pytest.mark.slow
def test_xdist_workers_write_their_own_files_and_the_report_merges_them(tmp_path, tol):
    pytest.importorskip("xdist")
    rep = tmp_path / "rep"
    r = _pytest("-m", "verify", "-n", "2", "--dist", "loadgroup", "--kda-backend", "emulator",
                "--kda-route", "flashkda", "--kda-case", "smoke/dense-*", "--kda-case", "smoke/initial-*",
                "--kda-device", "cpu", "--kda-tolerances", tol, "--kda-report", str(rep))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 passed" in r.stdout
    assert "VERIFIED 2 of 2 cells: 2 pass" in r.stdout       # the controller counts the workers' cells
    files = sorted(p.name for p in rep.glob("results*.jsonl"))
    assert files and all(f.startswith("results-gw") for f in files)
    report = json.loads((rep / "report.json").read_text())
    assert sorted(c["case"] for c in report["cells"]) == ["smoke/dense-T64-lb-5", "smoke/initial-state-kv-lb-5"]


def test_each_xdist_worker_gets_its_own_gpu(monkeypatch):
    import torch

    from verification.pytest_plugin import pick_device

    class Config:
        def __init__(self, worker=None, device=None):
            if worker:
                self.workerinput = {"workerid": worker}
            self._device = device

        def getoption(self, name):
            assert name == "--kda-device"
            return self._device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert pick_device(Config("gw0")) == "cuda:0" and pick_device(Config("gw4")) == "cuda:1"
    assert pick_device(Config()) == "cuda" and pick_device(Config("gw2", device="cuda:0")) == "cuda:0"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device(Config("gw1")) == "cpu"


def test_without_the_plugin_the_matrix_module_says_how_to_register_it(matrix):
    rc, out = matrix("-m", "verify", "-p", "no:kda_verify")
    assert rc == 1, out
    assert "test_kda_verify_plugin_is_registered" in out and "1 failed" in out
    rc, out = matrix("-m", "verify", "--kda-backend", "emulator", "--kda-case", "smoke/dense-*", "--collect-only")
    assert "test_kda_verify_plugin_is_registered" not in out and f"{len(EMULATOR_ROUTES)} tests collected" in out


def test_unwritable_report_dir_is_one_line_exit_2(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    r = _pytest("-m", "verify", "--kda-backend", "emulator", "--kda-case", DENSE, "--kda-device", "cpu",
                "--kda-report", str(f))
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert lines == [f"Exit: kda-verify: error: --kda-report: expected a directory, got '{f}', an existing file"], lines


def test_under_xdist_a_matrix_of_skips_verifies_nothing_and_exits_2(tol):
    pytest.importorskip("xdist")
    r = _pytest("-m", "verify", "-n", "2", "--kda-backend", "kda_test_backends:unavailable", "--kda-case", "smoke/*",
                "--kda-device", "cpu", "--kda-tolerances", tol)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "NOTHING VERIFIED: 6 cells skipped (backend test-unavailable unavailable: this test backend is never " \
           "available)" in r.stdout, r.stdout
    assert r.stdout.count("kda-verify: nothing verified: ") == 1


def test_default_backends_leave_out_the_negative_controls(matrix):
    """Without --kda-backend the matrix takes every available built-in backend but emulator-bad,
    whose deliberate bugs fail by design; named, it runs (and its cells fail)."""
    rc, out = matrix("-m", "verify", "--kda-case", DENSE, "--kda-device", "cpu", "--collect-only")
    ids = [ln for ln in out.splitlines() if "verify[" in ln]
    assert ids and any("verify[emulator-flashkda-" in i for i in ids), out
    assert not any("emulator-bad" in i for i in ids), out
    rc, out = matrix("-m", "verify", "--kda-backend", "emulator-bad", "--kda-case", DENSE, "--kda-device", "cpu",
                     "--collect-only")
    assert any("verify[emulator-bad-" in ln for ln in out.splitlines()), out
