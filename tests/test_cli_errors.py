"""Bad environments at the CLI: one line, exit 2, no traceback; Ctrl-C once; internal errors exit 3
with the file that holds the traceback; the exit-code table of verification/errors.py."""
import errno
import os
import sys
import tempfile
from pathlib import Path

import pytest

from verification import errors
from verification.judging import policy
from verification.cli import main
from verification.errors import UsageError
from kda_test_backends import write_tolerances

DENSE = "smoke/dense-T64-lb-5"
# sysfs takes no new directory or file, for root too: an unwritable place on any Linux machine
UNWRITABLE = "/sys"
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux") or not os.path.isdir("/sys"),
                                reason="needs Linux's sysfs as an unwritable directory")


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


def test_usage_error_lives_in_errors_only():
    import verification.cli as cli
    assert issubclass(UsageError, ValueError) and UsageError is errors.UsageError
    assert not hasattr(cli, "UsageError") and not hasattr(cli, "ProblemError")   # no re-export left behind


@linux_only
@pytest.mark.parametrize("argv", [
    ["run", "--backend", "emulator", "--suite", "smoke", "--case", DENSE, "--out", "{ro}/sub"],
    ["run", "--backend", "emulator", "--suite", "smoke", "--case", DENSE, "--out", "{ro}"],
    ["run", "--backend", "emulator", "--suite", "smoke", "--case", DENSE, "--out", "{ro}", "--resume"],
    ["export", "--case", DENSE, "--out", "{ro}/p.safetensors"],
    ["export", "--case", DENSE, "--case", "smoke/paged-lb-5", "--out", "{ro}/dir"],
    ["oracle", "--inputs", "{problem}", "--out", "{ro}/truth.safetensors"],
    ["capture", "--backend", "emulator", "--inputs", "{problem}", "--out", "{ro}/o.safetensors"],
], ids=["run-mkdir", "run-existing", "run-resume", "export", "export-many", "oracle", "capture"])
def test_unwritable_out_is_one_line_exit_2(argv, problem, capsys):
    argv = [a.format(ro=UNWRITABLE, problem=problem) for a in argv]
    rc = main(argv)
    line = _one_line(capsys, rc, 2, f"kda-verify {argv[0]}: error: --out: expected", UNWRITABLE)
    assert "(Operation not permitted)" in line or "(Permission denied)" in line or "(Read-only" in line, line


def _read_only(monkeypatch, directory: Path):
    """Make ``directory`` refuse new files as a read-only mount does (EROFS): chmod cannot, for root."""
    real = tempfile.TemporaryFile

    def refuse(*a, dir=None, **kw):
        if dir is not None and Path(dir).resolve() == directory.resolve():
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real(*a, dir=dir, **kw)
    monkeypatch.setattr(errors.tempfile, "TemporaryFile", refuse)


def test_report_and_resume_on_a_read_only_results_dir(tmp_path, tol, monkeypatch, capsys):
    out = tmp_path / "r"
    assert main(["run", "--backend", "emulator", "--route", "flashkda", "--suite", "smoke", "--case", DENSE,
                 "--out", str(out), "--tolerances", tol, "--no-report"]) == 0
    capsys.readouterr()
    _read_only(monkeypatch, out)
    _one_line(capsys, main(["report", str(out)]), 2, "kda-verify report: error: DIR: expected a writable directory",
              "Read-only file system")
    _one_line(capsys, main(["run", "--backend", "emulator", "--route", "flashkda", "--suite", "smoke", "--case", DENSE,
                            "--out", str(out), "--resume"]), 2, "--out: expected a writable directory",
              "Read-only file system")


def test_out_naming_an_existing_file_or_directory(tmp_path, problem, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    _one_line(capsys, main(["run", "--backend", "emulator", "--suite", "smoke", "--out", str(f)]), 2,
              "--out: expected a directory", "an existing file")
    _one_line(capsys, main(["run", "--backend", "emulator", "--suite", "smoke", "--out", str(f / "sub")]), 2,
              "--out: expected a directory", str(f / "sub"))
    _one_line(capsys, main(["oracle", "--inputs", str(problem), "--out", str(tmp_path)]), 2,
              "--out: expected a file path", "an existing directory")
    _one_line(capsys, main(["capture", "--backend", "emulator", "--inputs", str(problem), "--out", str(tmp_path)]),
              2, "--out: expected a file path")
    _one_line(capsys, main(["export", "--case", DENSE, "--case", "smoke/paged-lb-5", "--out", str(f)]), 2,
              "--out: expected a directory", "an existing file")
    assert f.read_text() == "x"                              # nothing was overwritten


def test_debug_of_a_backend_without_passes_is_one_line(capsys):
    rc = main(["debug", "--backend", "emulator", "--route", "flashkda", "--case", DENSE, "--device", "cpu"])
    _one_line(capsys, rc, 2, "kda-verify debug: error: --backend: expected a backend with passes", "'emulator'")


def test_ctrl_c_during_run_prints_interrupted_once(tmp_path, monkeypatch, capsys):
    import verification.running.run_matrix as matrix_module

    def interrupted(*a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(matrix_module, "run_matrix", interrupted)
    rc = main(["run", "--backend", "emulator", "--suite", "smoke", "--case", DENSE, "--out", str(tmp_path / "r")])
    line = _one_line(capsys, rc, 130, "kda-verify run: interrupted", "--resume")
    assert line.count("interrupted") == 1


def test_internal_error_exits_3_with_one_line_naming_the_saved_traceback(tmp_path, monkeypatch, capsys):
    import verification.commands.report as report_cmd

    def broken(args):
        return {}["no such key"]            # a bug of kda-verify's own, not bad input
    monkeypatch.setattr(report_cmd, "run", broken)
    rc = main(["report", str(tmp_path)])
    line = _one_line(capsys, rc, 3, "kda-verify report: internal error: KeyError", "traceback: ")
    saved = Path(line.rsplit("traceback: ", 1)[1].rstrip(")"))
    assert saved == tmp_path / "kda-verify-traceback.txt"           # beside the results it was asked about
    text = saved.read_text()
    assert "Traceback (most recent call last)" in text and "KeyError: 'no such key'" in text and "broken" in text
    # without a directory to hold it, a temporary file does
    monkeypatch.setattr(report_cmd, "run", lambda args: 1 / 0)
    line = _one_line(capsys, main(["report", str(tmp_path / "absent")]), 3, "internal error: ZeroDivisionError")
    saved = Path(line.rsplit("traceback: ", 1)[1].rstrip(")"))
    assert saved.parent == Path(tempfile.gettempdir()) and "ZeroDivisionError" in saved.read_text()
    saved.unlink()


def test_exit_codes_0_pass_1_kernel_failure_2_bad_input(tmp_path, tol, capsys):
    base = ["run", "--suite", "smoke", "--case", DENSE, "--tolerances", tol, "--no-report", "--device", "cpu"]
    assert main(base + ["--backend", "emulator", "--route", "flashkda", "--out", str(tmp_path / "a")]) == 0
    assert main(base + ["--backend", "kda_test_backends:nan", "--out", str(tmp_path / "b")]) == 1
    assert main(base + ["--backend", "kda_test_backends:raising", "--out", str(tmp_path / "c")]) == 1
    assert main(base + ["--backend", "no_such_module:factory", "--out", str(tmp_path / "d")]) == 2
    assert main(base + ["--backend", "kda_test_backends:unavailable", "--out", str(tmp_path / "e")]) == 2
    capsys.readouterr()
    assert (policy.EXIT_OK, policy.EXIT_FAIL, policy.EXIT_USAGE, policy.EXIT_INTERNAL) == (0, 1, 2, 3)


def test_an_os_error_on_a_path_during_a_command_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    import verification.commands.report as report_cmd

    def full(args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "report.html"))
    monkeypatch.setattr(report_cmd, "run", full)
    _one_line(capsys, main(["report", str(tmp_path)]), 2, "kda-verify report: error:", "report.html",
              "No space left on device")
