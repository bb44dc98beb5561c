"""The AMD workflow over directories, with the emulator standing in for the kernel: export
--suite writes every case's problem file, capture --inputs DIR runs every problem, check
--inputs DIR --outputs OUT judges the lot as the file form does and writes the usual report;
--resume on both sides."""
import json

import pytest

from verification.running.cases import get_suite
from verification.cli import main
from verification.judging.record import read_records

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py

CASES = ["smoke/dense-T64-lb-5", "smoke/paged-lb-5", "smoke/correlated-weak-lb-0.01"]


@pytest.fixture
def problems(tmp_path):
    d = tmp_path / "problems"
    argv = ["export", "--out", str(d)]
    for c in CASES:
        argv += ["--case", c]
    assert main(argv) == 0
    return d


def _records(d):
    return {r["case"]: r for r in read_records(d / "results.jsonl")}


def test_export_suite_writes_every_case(tmp_path, capsys):
    d = tmp_path / "p"
    assert main(["export", "--suite", "smoke,stress", "--skip-long", "--out", str(d)]) == 0
    want = [c.id for s in ("smoke", "stress") for c in get_suite(s, long=False)]
    got = sorted(p.name for p in d.glob("*.safetensors"))
    assert got == sorted(c.replace("/", "__") + ".safetensors" for c in want)
    assert main(["export", "--out", str(tmp_path / "x.safetensors")]) == 2
    assert "--case: expected a case id (or --suite" in capsys.readouterr().err


def test_round_trip_export_capture_check(problems, tmp_path, capsys):
    out = tmp_path / "outputs"
    assert main(["capture", "--backend", "emulator", "--route", "flashkda", "--inputs", str(problems),
                 "--out", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(p.name for p in problems.glob("*.safetensors"))
    capsys.readouterr()
    assert main(["check", "--inputs", str(problems), "--outputs", str(out)]) == 0
    text = capsys.readouterr().out
    assert "VERIFIED 3 of 3 cells: 3 pass" in text
    for name in ("report.md", "report.html", "report.json", "results.jsonl"):
        assert (out / name).is_file(), name
    recs = _records(out)
    assert sorted(recs) == sorted(CASES)
    assert all(r["backend"] == "emulator" and r["route"] == "flashkda" and r["recipe"] == "flashkda"
               for r in recs.values())
    # the directory form's verdict is the file form's on the same pair
    name = "smoke__paged-lb-5.safetensors"
    assert main(["check", "--inputs", str(problems / name), "--outputs", str(out / name), "--recipe", "flashkda",
                 "--backend-name", "emulator", "--route", "flashkda", "--json"]) == 0
    single = json.loads(capsys.readouterr().out)
    rec = recs["smoke/paged-lb-5"]
    assert single["status"] == rec.status
    for t, v in single["tensors"].items():
        assert v["margin"] == pytest.approx(rec.tensors[t]["margin"], rel=1e-12), t


def test_a_planted_failure_a_known_failure_and_a_skip_read_as_such(problems, tmp_path, capsys):
    bad, known = tmp_path / "bad", tmp_path / "known"
    # emulator-bad's slots_swapped changes only paged problems: the two others are skipped
    assert main(["capture", "--backend", "emulator-bad", "--route", "slots_swapped", "--inputs", str(problems),
                 "--out", str(bad)]) == 0
    assert (bad / "smoke__dense-T64-lb-5.skipped").is_file()
    assert main(["check", "--inputs", str(problems), "--outputs", str(bad)]) == 1
    recs = _records(bad)
    assert recs["smoke/paged-lb-5"]["status"] == "fail"
    assert recs["smoke/dense-T64-lb-5"]["status"] == "skipped"
    assert "changes nothing here" in recs["smoke/dense-T64-lb-5"]["reason"]
    # the moonshot recipe on correlated keys with a weak gate is a listed known failure
    assert main(["capture", "--backend", "emulator", "--route", "moonshot", "--inputs", str(problems),
                 "--out", str(known)]) == 0
    capsys.readouterr()
    assert main(["check", "--inputs", str(problems), "--outputs", str(known)]) == 0
    recs = _records(known)
    assert recs["smoke/correlated-weak-lb-0.01"]["status"] == "known-fail"
    assert "known-fail" in capsys.readouterr().out


def test_resume_on_both_sides(problems, tmp_path, capsys):
    out = tmp_path / "outputs"
    argv = ["capture", "--backend", "emulator", "--route", "flashkda", "--inputs", str(problems), "--out", str(out)]
    assert main(argv) == 0
    # a kernel that killed the process leaves NAME.running: resume marks it crashed and does not retry it
    victim = out / "smoke__dense-T64-lb-5.safetensors"
    victim.unlink()
    (out / "smoke__dense-T64-lb-5.running").write_text("emulator/flashkda\n")
    capsys.readouterr()
    assert main(argv + ["--resume"]) == 1
    text = capsys.readouterr().out
    assert "2 resumed" in text and "1 crashed" in text and "crashed in an earlier attempt" in text
    assert (out / "smoke__dense-T64-lb-5.crashed").is_file() and not victim.exists()
    res = tmp_path / "results"
    assert main(["check", "--inputs", str(problems), "--outputs", str(out), "--out", str(res)]) == 1
    recs = _records(res)
    assert recs["smoke/dense-T64-lb-5"]["status"] == "crashed"
    # deleting the marker retries it; check --resume keeps the judged cells and judges only new keys
    (out / "smoke__dense-T64-lb-5.crashed").unlink()
    assert main(argv + ["--resume"]) == 0 and victim.exists()
    before = (res / "results.jsonl").read_text().splitlines()
    assert main(["check", "--inputs", str(problems), "--outputs", str(out), "--out", str(res), "--resume"]) == 1
    assert (res / "results.jsonl").read_text().splitlines() == before        # the crashed cell is kept as judged
    assert main(["check", "--inputs", str(problems), "--outputs", str(out), "--out", str(res)]) == 0
    assert _records(res)["smoke/dense-T64-lb-5"]["status"] == "pass"


def test_a_kernel_that_raises_is_an_error_cell(problems, tmp_path, monkeypatch, capsys):
    from kda_kernels import emulator
    real = emulator.EmulatorBackend.run

    def run(self, problem, route, **kw):
        if problem.paged:
            raise RuntimeError("boom in the kernel")
        return real(self, problem, route, **kw)
    monkeypatch.setattr(emulator.EmulatorBackend, "run", run)
    out = tmp_path / "outputs"
    assert main(["capture", "--backend", "emulator", "--route", "flashkda", "--inputs", str(problems),
                 "--out", str(out)]) == 1
    assert (out / "smoke__paged-lb-5.error").read_text().startswith("RuntimeError: boom in the kernel")
    assert main(["check", "--inputs", str(problems), "--outputs", str(out)]) == 1
    assert _records(out)["smoke/paged-lb-5"]["status"] == "error"


@pytest.mark.parametrize("what", ["bad-file", "empty-dir", "outputs-missing", "resume-file", "out-file"])
def test_bad_input_is_one_line_and_exit_2(what, problems, tmp_path, capsys):
    if what == "bad-file":
        (problems / "zz.safetensors").write_bytes(b"not safetensors")
        argv = ["capture", "--backend", "emulator", "--inputs", str(problems), "--out", str(tmp_path / "o")]
        fragment = "--inputs: zz.safetensors:"
    elif what == "empty-dir":
        (tmp_path / "empty").mkdir()
        argv = ["check", "--inputs", str(tmp_path / "empty"), "--outputs", str(tmp_path)]
        fragment = "--inputs: expected a directory holding problem files"
    elif what == "outputs-missing":
        argv = ["check", "--inputs", str(problems), "--outputs", str(tmp_path / "nope")]
        fragment = "--outputs: expected a directory of outputs files"
    elif what == "resume-file":
        argv = ["capture", "--backend", "emulator", "--inputs", str(problems / "smoke__paged-lb-5.safetensors"),
                "--out", str(tmp_path / "o.safetensors"), "--resume"]
        fragment = "--resume: expected with a directory --inputs"
    else:
        argv = ["check", "--inputs", str(problems / "smoke__paged-lb-5.safetensors"), "--outputs", str(tmp_path),
                "--recipe", "flashkda", "--out", str(tmp_path / "r")]
        fragment = "--out: expected with a directory --inputs"
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err


def test_an_unreadable_file_is_that_cases_bad_input_row_and_the_rest_are_judged(problems, tmp_path, capsys):
    """A problem file whose meta is a JSON array and an outputs file that is no safetensors file (the
    first in name order, where the directory's backend and route are read) are each their case's
    bad-input row naming the file and what was wrong (the user's files, not a kernel failure: exit
    2, not 1); the remaining case is judged."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    out = tmp_path / "outputs"
    assert main(["capture", "--backend", "emulator", "--route", "flashkda", "--inputs", str(problems),
                 "--out", str(out)]) == 0
    bad_meta = problems / "smoke__paged-lb-5.safetensors"
    with safe_open(str(bad_meta), framework="pt") as f:
        md, tensors = dict(f.metadata()), {n: f.get_tensor(n) for n in f.keys()}
    save_file(tensors, str(bad_meta), metadata=dict(md, meta="[1, 2]"))
    (out / "smoke__correlated-weak-lb-0.01.safetensors").write_bytes(b"not a safetensors file")
    capsys.readouterr()
    assert main(["check", "--inputs", str(problems), "--outputs", str(out)]) == 2
    text = capsys.readouterr().out
    assert "VERIFIED 1 of 3 cells: 1 pass, 2 bad-input" in text, text
    recs = _records(out)
    assert recs["smoke/dense-T64-lb-5"]["status"] == "pass"
    assert recs["smoke/dense-T64-lb-5"]["backend"] == "emulator"       # read from the next readable outputs file
    r = recs["smoke/paged-lb-5"]
    assert r["status"] == "bad-input" and "smoke__paged-lb-5.safetensors: meta: expected a JSON object" in r["reason"]
    r = recs["smoke/correlated-weak-lb-0.01"]
    assert r["status"] == "bad-input" and r["reason"].startswith("bad outputs file: outputs: expected a safetensors file")
