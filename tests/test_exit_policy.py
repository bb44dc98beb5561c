"""The exit-code policy (verification/judging/policy.py) as the commands and ``pytest -m verify`` apply it:
a kernel that raises is a kernel failure everywhere; Ctrl-C (a real SIGINT) exits 130 with a
report that says INTERRUPTED and how many selected cells did not run; a refused command creates
nothing, and a resume of another selection is refused."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kda_test_backends import write_tolerances
from verification.cli import main

ROOT = Path(__file__).resolve().parents[1]
DENSE = "smoke/dense-T64-lb-5"
VARLEN = "smoke/varlen-tail33-lb-5"


@pytest.fixture(scope="module")
def tol(tmp_path_factory):
    return write_tolerances(tmp_path_factory.mktemp("tol"))


@pytest.fixture(scope="module")
def problem(tmp_path_factory):
    path = tmp_path_factory.mktemp("p") / "p.safetensors"
    assert main(["export", "--case", DENSE, "--out", str(path)]) == 0
    return path


def _one_line(capsys, rc, want_rc, *needles):
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert rc == want_rc, cap
    assert len(err) == 1 and "Traceback" not in cap.err and "Traceback" not in cap.out, cap
    for n in needles:
        assert n in err[0], err
    return err[0]


# ---------------------------------------------------------------------------- the one policy
def test_the_readme_exit_code_table_is_the_policy():
    from verification.judging import policy
    text = (ROOT / "README.md").read_text()
    table = text.split("| exit code | meaning", 1)[1].split("\n\n", 1)[0]
    codes = [int(m) for m in re.findall(r"^\| (\d+) \|", table, flags=re.M)]
    assert codes == sorted(policy.EXIT_CODES), codes
    help_codes = [int(m) for m in re.findall(r"^  (\d+) ", policy.EXIT_CODES_HELP, flags=re.M)]
    assert help_codes == codes
    # every status is judged or not, failing or not, in one place
    assert set(policy.JUDGED) | set(policy.UNJUDGED) == set(policy.STATUSES)
    assert not set(policy.JUDGED) & set(policy.UNJUDGED)


@pytest.mark.parametrize("statuses,kw,want", [
    (["pass", "skipped"], {}, 0),
    (["pass", "known-fail"], {}, 0),
    (["pass", "fail"], {}, 1),
    (["pass", "crashed"], {}, 1),
    (["pass", "error"], {}, 1),
    (["resource-error", "pass"], {}, 2),
    (["resource-error", "mistrusted"], {}, 1),
    (["skipped", "out-of-contract"], {}, 2),
    (["skipped"], {"allow_nothing_verified": True}, 0),
    ([], {}, 2),
    (["pass", "fail"], {"interrupted": True}, 130),
    (None, {}, 0),
    (None, {"failed": True}, 1),
])
def test_exit_code_from_what_happened(statuses, kw, want):
    from verification.judging.policy import exit_code
    assert exit_code(statuses, **kw) == want


def test_exit_code_of_an_exception():
    from kda_kernels.base import BackendError
    from kda_ref.problem import ProblemError
    from verification.errors import Interrupted, KernelFailure, UsageError
    from verification.judging.policy import exit_code
    assert [exit_code(error=e) for e in (UsageError("x"), ProblemError("x"), BackendError("x"))] == [2, 2, 2]
    assert exit_code(error=KeyboardInterrupt()) == exit_code(error=Interrupted("x")) == 130
    assert exit_code(error=KernelFailure("x")) == 1
    assert exit_code(error=OSError(28, "No space left on device", "f")) == 2     # the environment's, on a path
    assert exit_code(error=OSError(5, "I/O error")) == 3 and exit_code(error=KeyError("x")) == 3


def test_a_kernel_that_raises_exits_1_in_run_debug_and_capture(tmp_path, tol, problem, capsys):
    """run records the raise as an ``error`` cell (exit 1); debug and capture ran the kernel
    themselves and answered 3, an internal error of kda-verify, for the kernel's raise."""
    assert main(["run", "--backend", "kda_test_backends:raising", "--suite", "smoke", "--case", DENSE,
                 "--tolerances", tol, "--no-report", "--device", "cpu", "--out", str(tmp_path / "r")]) == 1
    capsys.readouterr()
    rc = main(["debug", "--backend", "kda_test_backends:raising_passes", "--route", "r1", "--case", DENSE,
               "--pass", "K1", "--device", "cpu"])
    line = _one_line(capsys, rc, 1, "kda-verify debug: kernel failure: test-raising r1 pass K1 raised RuntimeError: "
                                    "deliberate failure inside run_pass('K1')", "(traceback: ")
    assert "deliberate failure" in Path(line.rsplit("traceback: ", 1)[1].rstrip(")")).read_text()
    rc = main(["capture", "--backend", "kda_test_backends:raising", "--route", "r1", "--inputs", str(problem),
               "--out", str(tmp_path / "o.safetensors")])
    line = _one_line(capsys, rc, 1, "kda-verify capture: kernel failure: test-raising r1 raised RuntimeError: "
                                    "deliberate failure inside run()", "(traceback: ")
    saved = Path(line.rsplit("traceback: ", 1)[1].rstrip(")"))
    assert "Traceback (most recent call last)" in saved.read_text() and not (tmp_path / "o.safetensors").exists()
    saved.unlink()


# ---------------------------------------------------------------------------- Ctrl-C, a real SIGINT
def _env(hold: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT), env.get("PYTHONPATH", "")])
    env["KDA_TEST_HOLD"] = str(hold)
    env.pop("PYTEST_XDIST_WORKER", None)
    return env


def _interrupt_when(proc, ready, timeout_s: float = 420):
    """Send SIGINT to ``proc`` once ``ready()`` holds (polled: no fixed sleep, whatever the load).
    The marker is the held cell's own (kda_test_backends.held writes it as it starts waiting), so
    every cell before it has been recorded and reported."""
    t0 = time.monotonic()
    while not ready():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"exited {proc.returncode} before the marker:\n{out}\n{err}")
        if time.monotonic() - t0 > timeout_s:
            proc.kill()
            pytest.fail(f"no marker after {timeout_s} s")
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    return proc.communicate(timeout=timeout_s)


@pytest.mark.slow
def test_ctrl_c_during_run_exits_130_with_a_report_of_the_cells_not_run_and_resume_finishes(tmp_path, tol):
    hold, out = tmp_path / "hold", tmp_path / "r"
    hold.write_text("held")
    # cells (case-major): dense fast, dense held, varlen fast, varlen held; the second one is held
    argv = [sys.executable, "-m", "verification", "run", "--backend", "kda_test_backends:held", "--suite", "smoke",
            "--case", DENSE, "--case", VARLEN, "--tolerances", tol, "--device", "cpu", "--out", str(out)]
    proc = subprocess.Popen(argv, cwd=ROOT, env=_env(hold), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = _interrupt_when(proc, lambda: Path(f"{hold}.waiting").exists())
    finally:
        hold.unlink(missing_ok=True)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stdout + stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("kda-verify run: interrupted: 3 of 4 selected cells not run; "), stderr
    assert "--resume" in last and "Traceback" not in stderr and stderr.count("interrupted") == 1, stderr
    head = "INTERRUPTED: 3 of 4 selected cells not run; VERIFIED 1 of 1 cells: 1 pass"
    assert f"**{head}**" in (out / "report.md").read_text()
    summary = json.loads((out / "report.json").read_text())["summary"]
    assert summary["headline"] == head and summary["not_run"] == 3 and summary["ok"] is False
    # --resume continues: the held cell now answers at once
    r = subprocess.run(argv + ["--resume"], cwd=ROOT, env=_env(hold), capture_output=True, text=True, timeout=420)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 cells run, 1 already done" in r.stdout and "VERIFIED 4 of 4 cells: 4 pass" in r.stdout
    assert "**VERIFIED 4 of 4 cells: 4 pass**" in (out / "report.md").read_text()


@pytest.mark.slow
def test_ctrl_c_during_pytest_verify_exits_130_with_a_report_of_the_cells_not_run(tmp_path, tol):
    hold, rep = tmp_path / "hold", tmp_path / "rep"
    hold.write_text("held")
    argv = [sys.executable, "-m", "pytest", "tests/test_verify_matrix.py", "-p", "no:cacheprovider", "-q",
            "-m", "verify", "--kda-backend", "kda_test_backends:held", "--kda-case", DENSE, "--kda-case", VARLEN,
            "--kda-device", "cpu", "--kda-tolerances", tol, "--kda-report", str(rep)]
    proc = subprocess.Popen(argv, cwd=ROOT, env=_env(hold), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = _interrupt_when(proc, lambda: Path(f"{hold}.waiting").exists())
    finally:
        hold.unlink(missing_ok=True)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stdout + stderr
    head = "INTERRUPTED: 3 of 4 selected cells not run; VERIFIED 1 of 1 cells: 1 pass"
    assert head in stdout, stdout
    assert f"**{head}**" in (rep / "report.md").read_text()
    assert json.loads((rep / "report.json").read_text())["summary"]["not_run"] == 3


# ---------------------------------------------------------------------------- refused: nothing created
@pytest.mark.parametrize("flags,needle", [
    (["--backend", "no_such_module:factory"], "--backend"),
    (["--backend", "emulator", "--route", "nope"], "--route: backend 'emulator' has no route 'nope'"),
])
def test_a_refused_run_creates_no_out_directory(tmp_path, tol, capsys, flags, needle):
    out = tmp_path / "a" / "r"
    rc = main(["run", *flags, "--suite", "smoke", "--case", DENSE, "--tolerances", tol, "--no-report",
               "--device", "cpu", "--out", str(out)])
    _one_line(capsys, rc, 2, "kda-verify run: error: ", needle)
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("change,needle", [
    (["--suite", "smoke,stress"], "--suite smoke,stress"),
    (["--case", VARLEN], f"--case {VARLEN}"),
    (["--route", "fla"], "--route fla"),
    (["--backend", "emulator,kda_test_backends:exact"], "--backend emulator,kda_test_backends:exact"),
])
def test_a_resume_of_another_selection_is_refused_and_changes_nothing(tmp_path, tol, capsys, change, needle):
    out = tmp_path / "r"
    first = {"--backend": "emulator", "--route": "flashkda", "--suite": "smoke", "--case": DENSE}
    argv = ["run", "--tolerances", tol, "--no-report", "--device", "cpu", "--out", str(out)]
    assert main(argv + [x for kv in first.items() for x in kv]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    again = dict(first, **{change[0]: change[1]})
    rc = main(argv + [x for kv in again.items() for x in kv] + ["--resume"])
    line = _one_line(capsys, rc, 2, "kda-verify run: error: --resume: expected the selection of the run in ",
                     f"got {needle}")
    assert "--backend emulator --route flashkda --suite smoke --case smoke/dense-T64-lb-5" in line, line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # the same selection, spelled in another order, resumes
    assert main(argv + ["--case", DENSE, "--suite", "smoke", "--route", "flashkda", "--backend", "emulator",
                        "--resume"]) == 0


def test_long_is_part_of_the_selection_only_where_it_picks_cells(tmp_path, tol, capsys):
    out = tmp_path / "r"
    argv = ["run", "--backend", "emulator", "--route", "flashkda", "--suite", "stress", "--tolerances", tol,
            "--no-report", "--device", "cpu", "--out", str(out), "--max-cells", "1"]
    assert main(argv + ["--long", "no"]) == 0                 # stress holds long cases: --long picks cells
    capsys.readouterr()
    line = _one_line(capsys, main(argv + ["--long", "yes", "--resume"]), 2, "--resume: expected the selection",
                     "--suite stress --long no), got --long yes;")
    assert main(argv + ["--resume"]) == 0                      # auto on a CPU: no, the same cells
    smoke = tmp_path / "s"
    base = ["run", "--backend", "emulator", "--route", "flashkda", "--suite", "smoke", "--case", DENSE,
            "--tolerances", tol, "--no-report", "--device", "cpu", "--out", str(smoke)]
    assert main(base + ["--long", "no"]) == 0 and main(base + ["--long", "yes", "--resume"]) == 0, line
