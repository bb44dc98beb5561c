"""What a new user meets first: the headline says how many cells were verified, a run that
verified nothing is never green, and the README's main command verifies our Triton FlashKDA
(through Triton's interpreter on a CPU-only machine)."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verification.cli import main
from verification.judging.policy import headline, nothing_verified_reason
from verification.judging.record import Record
from verification.running.run_cell import SELF_JUDGED, note_self_judged
from kda_test_backends import write_tolerances

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
DENSE = "smoke/dense-T64-lb-5"
HAVE_FLA = importlib.util.find_spec("fla") is not None


@pytest.fixture(scope="module")
def tol(tmp_path_factory):
    return write_tolerances(tmp_path_factory.mktemp("tol"))


def _recs(**counts):
    out = []
    for status, n in counts.items():
        out += [{"status": status.rstrip("_").replace("_", "-"), "backend": "fla",
                 "reason": "backend unavailable: fla is not importable" if status == "skipped" else "x"}] * n
    return out


def test_headline_forms():
    assert headline(_recs(pass_=16, known_fail=1, skipped=1)) == \
        "VERIFIED 17 of 18 cells: 16 pass, 1 known-fail, 1 skipped"
    assert headline(_recs(pass_=2, fail=1, error=1)) == "VERIFIED 3 of 4 cells: 2 pass, 1 fail, 1 error"
    assert headline(_recs(skipped=32)) == \
        "NOTHING VERIFIED: 32 cells skipped (backend fla unavailable: fla is not importable)"
    mixed = _recs(skipped=3) + [{"status": "skipped", "backend": "triton", "reason": "not applicable: K=64"}]
    assert headline(mixed) == ("NOTHING VERIFIED: 4 cells skipped (backend fla unavailable: fla is not "
                                        "importable; 1 more cell for other reasons)")
    assert headline(_recs(error=2)).startswith("NOTHING VERIFIED: 2 cells: 2 error")
    assert nothing_verified_reason(_recs(pass_=1, skipped=5)) is None
    assert nothing_verified_reason(_recs(known_fail=1)) is None
    assert nothing_verified_reason(_recs(skipped=2)) == "backend fla unavailable: fla is not importable"
    assert nothing_verified_reason([]) == "no cells"


def test_emulator_rows_say_they_judge_the_emulator_against_itself():
    rec = note_self_judged(Record(backend="emulator", status="pass"))
    assert rec.reason == SELF_JUDGED and rec.self_judged and "only the cap judges" in SELF_JUDGED
    assert note_self_judged(rec).reason == SELF_JUDGED                          # said once
    assert note_self_judged(Record(backend="triton", status="pass")).reason == ""
    assert note_self_judged(Record(backend="emulator", status="skipped", reason="r")).reason == "r"


def _nothing(capsys, rc, backend_words):
    cap = capsys.readouterr()
    err = [ln for ln in cap.err.strip().splitlines() if "nothing verified" in ln]
    assert rc == 2, cap
    assert len(err) == 1 and err[0].startswith("kda-verify run: nothing verified: ") and backend_words in err[0], cap
    assert "NOTHING VERIFIED: " in cap.out and "ALL PASS" not in cap.out and "Traceback" not in cap.err
    return err[0]


@pytest.mark.skipif(HAVE_FLA, reason="fla is installed here: its cells would run")
def test_run_of_an_uninstalled_fla_verifies_nothing_and_exits_2(tmp_path, capsys):
    rc = main(["run", "--backend", "fla", "--suite", "smoke", "--out", str(tmp_path / "d"), "--no-report",
               "--device", "cpu"])
    line = _nothing(capsys, rc, "backend fla unavailable: ")
    assert "not importable" in line
    rc = main(["run", "--backend", "fla", "--suite", "smoke", "--out", str(tmp_path / "e"), "--no-report",
               "--device", "cpu", "--allow-nothing-verified"])
    assert rc == 0 and "--allow-nothing-verified" in capsys.readouterr().err


def test_run_whose_cells_are_all_unavailable_or_not_applicable_exits_2(tmp_path, tol, capsys):
    base = ["run", "--suite", "smoke", "--tolerances", tol, "--no-report", "--device", "cpu"]
    rc = main(base + ["--backend", "kda_test_backends:unavailable", "--case", DENSE, "--out", str(tmp_path / "a")])
    _nothing(capsys, rc, "backend test-unavailable unavailable: this test backend is never available")
    # a backend that is here, on cases it does not accept
    rc = main(base + ["--backend", "kda_test_backends:dense_only", "--case", "smoke/paged-lb-5",
                      "--out", str(tmp_path / "b")])
    _nothing(capsys, rc, "not applicable")
    # one judged cell is enough for the run to count: the headline says how many
    rc = main(base + ["--backend", "emulator,kda_test_backends:unavailable", "--route", "flashkda,r1",
                      "--case", DENSE, "--out", str(tmp_path / "c")])
    out = capsys.readouterr().out
    assert rc == 0 and "VERIFIED 1 of 2 cells: 1 pass, 1 skipped" in out


@pytest.mark.skipif(HAVE_FLA, reason="fla is installed here: its cells would run")
def test_pytest_verify_of_an_uninstalled_fla_verifies_nothing_and_exits_2(pytester):
    pytester.makepyfile(test_matrix_copy=(ROOT / "tests/test_verify_matrix.py").read_text())
    res = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q", "-m", "verify", "--kda-backend", "fla",
                                       "--kda-case", DENSE, "--kda-device", "cpu")
    out = "\n".join(res.outlines)
    assert res.ret == 2, out
    assert re.search(r"NOTHING VERIFIED: 5 cells skipped \(backend fla unavailable: fla", out), out
    lines = [ln for ln in res.outlines if ln.startswith("kda-verify: nothing verified: ")]
    assert len(lines) == 1 and "backend fla unavailable" in lines[0] and lines[0].endswith("exit 2"), out
    res = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q", "-m", "verify", "--kda-backend", "fla",
                                       "--kda-case", DENSE, "--kda-device", "cpu", "--kda-allow-skips")
    assert res.ret == 0 and "--kda-allow-skips" in "\n".join(res.outlines)


def test_pytest_verify_with_a_judged_cell_prints_the_verified_headline(pytester, tol):
    pytester.makepyfile(test_matrix_copy=(ROOT / "tests/test_verify_matrix.py").read_text())
    res = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q", "-m", "verify", "--kda-backend",
                                       "emulator,kda_test_backends:unavailable", "--kda-route", "flashkda,r1",
                                       "--kda-case", DENSE, "--kda-device", "cpu", "--kda-tolerances", tol)
    out = "\n".join(res.outlines)
    assert res.ret == 0 and "VERIFIED 1 of 2 cells: 1 pass, 1 skipped" in out, out


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the main command runs the compiled kernels")
@pytest.mark.slow
def test_main_command_runs_our_triton_kernel_through_the_interpreter_on_a_cpu(tmp_path):
    """The README's main command in a fresh process without TRITON_INTERPRET: it turns the
    interpreter on itself and judges the kernel (one case here; the README times the suite)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-m", "verification", "run", "--backend", "triton", "--route", "seg",
                        "--suite", "smoke", "--case", DENSE, "--out", str(tmp_path / "smoke"), "--no-report"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Triton's CPU interpreter (TRITON_INTERPRET=1" in r.stderr
    assert "VERIFIED 1 of 1 cells: 1 pass" in r.stdout
    assert "pass       triton seg:A=fused:B=prefetch:BW=32 smoke/dense-T64-lb-5" in r.stderr
    # a user's own TRITON_INTERPRET=0 is respected: nothing runs, and that is not green
    env["TRITON_INTERPRET"] = "0"
    r = subprocess.run([sys.executable, "-m", "verification", "run", "--backend", "triton", "--route", "seg",
                        "--suite", "smoke", "--case", DENSE, "--out", str(tmp_path / "off"), "--no-report"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and "nothing verified: backend triton unavailable: no CUDA device" in r.stderr, r.stderr


def _readme_commands() -> list[str]:
    """The command lines of the README's first code block under "## Install, test, run"."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Install, test, run", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [ln.split("  #", 1)[0].strip() for ln in block.splitlines() if ln.strip()]


def test_ci_runs_the_readmes_install_test_and_main_lines_exactly_in_a_fresh_venv():
    install, test, main_cmd = _readme_commands()
    assert install == 'pip install -e ".[test]"' and test == "python -m pytest -q -n auto"
    assert main_cmd.startswith("kda-verify run --backend triton ")
    ci = [ln.strip() for ln in (ROOT / ".ci/run").read_text().splitlines()]
    lines = [ln for ln in ci if ln and not ln.startswith("#")]
    at = [lines.index(c) for c in (install, test, main_cmd)]       # each exactly as the README writes it
    assert at == sorted(at), lines
    # before the install line only what a user making a fresh environment runs (and CI's own clock)
    before = [ln for ln in lines[:at[0]] if not ln.startswith(("step ", "step()", "start=", "set -euo", "cd ",
                                                                  "trap "))]
    assert before == ['venv="$(mktemp -d)/venv"', 'python3 -m venv "$venv"', '. "$venv/bin/activate"',
                      _readme_cpu_torch_line()], before
    # no pinned torch / triton install of CI's own anywhere: the README's CPU-only torch line, and after
    # the README's lines the newest triton in pyproject's own range (what a CPU-only torch resolves)
    installs = [ln for ln in lines if re.search(r"pip3? install .*(torch|triton)", ln)]
    assert installs[0] == _readme_cpu_torch_line() and len(installs) == 2, installs
    assert "range_text()" in installs[1] and lines.index(installs[1]) > at[-1], installs


def _readme_cpu_torch_line() -> str:
    """The README's one line that installs torch's CPU-only build before the install line."""
    text = (ROOT / "README.md").read_text()
    block = text.split("install torch's CPU-only build first", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    (line,) = [ln.strip() for ln in block.splitlines() if ln.strip()]
    assert line == "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    return line


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the matrix runs the compiled kernels")
def test_pytest_verify_of_triton_on_a_cpu_runs_the_interpreter_too():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "pytest", "tests/test_verify_matrix.py", "-p", "no:cacheprovider", "-q",
                        "-m", "verify", "--kda-backend", "triton", "--kda-route", "seg", "--kda-case", DENSE],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "kda-verify: no CUDA device: the triton backend runs in Triton's CPU interpreter" in r.stderr
    assert "VERIFIED 1 of 1 cells: 1 pass" in r.stdout and "1 passed" in r.stdout
