"""The runner: cells, shared truth, durable results, resume, isolation, statuses, exit codes."""
import io
import json

import pytest

from verification.running.cases import get_suite
from verification.cli import main
from verification.errors import UsageError
from verification.judging.policy import FAILING
from verification.judging.record import RESULTS_FILE, Record, read_records
from verification.running.run_matrix import run_matrix as _run_matrix
from kda_test_backends import write_tolerances
from kda_kernels.emulator import EmulatorBackend

EMULATOR_ROUTES = [r.name for r in EmulatorBackend().routes()]

SMOKE = get_suite("smoke")
DENSE = next(c for c in SMOKE if c.id == "smoke/dense-T64-lb-5")
VARLEN = next(c for c in SMOKE if c.id == "smoke/varlen-tail33-lb-5")
PAGED = next(c for c in SMOKE if c.id == "smoke/paged-lb-5")


def _quiet():
    return io.StringIO()


@pytest.fixture(scope="module")
def tol(tmp_path_factory):
    return write_tolerances(tmp_path_factory.mktemp("tol"))


@pytest.fixture
def run_matrix(tol):
    """run_matrix judged by the test tolerance file (one entry matching every cell)."""
    def run(*args, **kw):
        kw.setdefault("tolerances_path", tol)
        return _run_matrix(*args, **kw)
    return run


@pytest.mark.slow
def test_emulator_over_smoke_passes_and_truth_is_computed_once_per_case(tmp_path, run_matrix, tol):
    s = run_matrix(["emulator"], SMOKE, tmp_path, device="cpu", progress_stream=_quiet())
    routes = {r.name for r in __import__("kda_kernels.emulator", fromlist=["x"]).EmulatorBackend().routes()}
    assert s.ran == len(SMOKE) * len(routes) and s.resumed == 0
    recs = read_records(tmp_path / RESULTS_FILE, strict=True)
    assert len(recs) == s.ran and len({r["key"] for r in recs}) == s.ran
    # the emulator is its own baseline: every cell passes, with margins recorded per tensor
    assert {r["status"] for r in recs} == {"pass"}, [(r["key"], r["reason"]) for r in recs if r["status"] != "pass"]
    assert s.exit_code == 0
    for r in recs:
        # deterministic emulation: the kernel's error is exactly its baseline's
        assert r["tensors"]["o"]["err"] == r["tensors"]["o"]["baseline_err"]
        assert r["tensors"]["o"]["err"] is not None and r["metrics"]["o"]["chunk_rel_l2"]
        assert r["repro"].startswith(f"kda-verify run --backend emulator --route {r['route']} --suite smoke --case ")
        assert r["shape"]["K"] == 128 and r["seed"] == next(c.seed for c in SMOKE if c.id == r["case"])
    # one truth per case, shared by all routes; one baseline per (case, recipe)
    assert s.oracle_runs == {c.id: 1 for c in SMOKE}
    assert all(n == 1 for n in s.baseline_runs.values())
    oracle_cached = [r["timings"]["oracle_cached"] for r in recs if r["case"] == DENSE.id]
    assert oracle_cached.count(False) == 1 and oracle_cached.count(True) == len(routes) - 1


def test_an_interrupted_run_resumes_without_losing_or_repeating_a_cell(tmp_path, run_matrix, tol):
    cases = [DENSE, VARLEN]
    seen = []

    def interrupt_after_three(rec):
        seen.append(rec.key)
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_matrix(["emulator"], cases, tmp_path, device="cpu", progress_stream=_quiet(),
                   on_record=interrupt_after_three)
    assert [r["key"] for r in read_records(tmp_path / RESULTS_FILE)] == seen
    # a write cut mid-line by the interruption
    with open(tmp_path / RESULTS_FILE, "a") as f:
        f.write('{"key": "emulator|fla|smoke/x", "status": "pa')
    with pytest.raises(UsageError, match="--resume"):
        run_matrix(["emulator"], cases, tmp_path, device="cpu", progress_stream=_quiet())
    s = run_matrix(["emulator"], cases, tmp_path, device="cpu", resume=True, progress_stream=_quiet())
    total = 2 * len(EMULATOR_ROUTES)
    assert s.resumed == 3 and s.ran == total - 3
    keys = [r["key"] for r in read_records(tmp_path / RESULTS_FILE, strict=True)]
    assert len(keys) == total and len(set(keys)) == total
    assert set(keys[:3]) == set(seen)
    assert len(s.records) == total


def test_max_cells_stops_and_resume_finishes(tmp_path, run_matrix, tol):
    s1 = run_matrix(["emulator"], [DENSE], tmp_path, routes=["flashkda", "fla"], device="cpu", max_cells=1,
                    progress_stream=_quiet())
    assert s1.ran == 1 and s1.stopped_early
    s2 = run_matrix(["emulator"], [DENSE], tmp_path, routes=["flashkda", "fla"], device="cpu", resume=True,
                    progress_stream=_quiet())
    assert s2.ran == 1 and s2.resumed == 1 and not s2.stopped_early
    assert sorted(r["route"] for r in read_records(tmp_path / RESULTS_FILE)) == ["fla", "flashkda"]


def test_statuses_skipped_error_fail_mistrusted_and_the_exit_code(tmp_path, run_matrix, tol):
    specs = ["kda_test_backends:unavailable", "kda_test_backends:dense_only", "kda_test_backends:raising",
             "kda_test_backends:nan", "kda_test_backends:zeros", "kda_test_backends:exact"]
    s = run_matrix(specs, [VARLEN], None, device="cpu", progress_stream=_quiet())
    by = {r["backend"]: r for r in s.records}
    assert by["test-unavailable"]["status"] == "skipped"
    assert by["test-unavailable"]["reason"] == "backend unavailable: this test backend is never available"
    assert by["test-dense_only"]["status"] == "skipped"
    assert by["test-dense_only"]["reason"].startswith("not applicable: varlen")
    assert by["test-raising"]["status"] == "error"
    assert "RuntimeError: deliberate failure inside run()" in by["test-raising"]["reason"]
    assert "traceback" in by["test-raising"]
    assert by["test-raising"]["timings"]["compiles"] == 0             # compile time is recorded for a raising call too
    assert "kernel_s" not in by["test-raising"]["timings"]
    assert by["test-nan"]["status"] == "fail"
    assert by["test-zeros"]["status"] in ("mistrusted", "fail")
    assert by["test-exact"]["status"] == "pass"
    assert s.exit_code == 1
    assert {r["status"] for r in s.failed} <= set(FAILING)
    # the truth was computed once for the case, although four backends ran on it
    assert s.oracle_runs == {VARLEN.id: 1}


@pytest.mark.slow
def test_isolate_records_a_killed_process_as_crashed_and_goes_on(tmp_path, run_matrix, tol):
    # the paged case: in the child too, every slot the problem does not write stays bit-identical
    s = run_matrix(["kda_test_backends:crashing", "kda_test_backends:exact"], [PAGED], tmp_path, isolate=True,
                   routes=["abort", "exit", "r1"], device="cpu", progress_stream=_quiet())
    by = {(r["backend"], r["route"]): r for r in read_records(tmp_path / RESULTS_FILE, strict=True)}
    abort = by[("test-crashing", "abort")]
    assert abort["status"] == "crashed" and "SIGABRT" in abort["reason"]
    exit3 = by[("test-crashing", "exit")]
    assert exit3["status"] == "crashed" and "exited with code 3" in exit3["reason"]
    ok = by[("test-exact", "r1")]
    assert ok["status"] == "pass" and ok["isolated"] is True, ok["reason"]
    assert ok["metrics"]["state_cache"]["untouched_changed"] == 0
    assert len(by) == 3
    assert s.oracle_runs == {PAGED.id: 1} and s.exit_code == 1


def test_plain_progress_lines_when_not_a_tty(run_matrix, tol):
    buf = _quiet()
    run_matrix(["emulator"], [DENSE], None, routes=["flashkda"], device="cpu", progress_stream=buf, tty=False)
    line = buf.getvalue().strip()
    assert line.startswith("[1/1 100% ETA 0s] pass") and "emulator flashkda smoke/dense-T64-lb-5" in line
    assert "\r" not in buf.getvalue()


def test_cli_run_exit_codes_case_filter_and_report(tmp_path, capsys, run_matrix, tol):
    out = tmp_path / "ok"
    rc = main(["run", "--backend", "emulator", "--route", "flashkda", "--suite", "smoke",
               "--case", "smoke/dense-*", "--out", str(out), "--device", "cpu", "--tolerances", tol])
    assert rc == 0
    recs = read_records(out / RESULTS_FILE)
    assert [r["case"] for r in recs] == [DENSE.id]
    assert (out / "report.html").exists() and (out / "report.json").exists()
    prov = json.loads((out / "run.json").read_text())["runs"][0]
    assert prov["seeds"] == {DENSE.id: DENSE.seed} and "commit" in prov["git"]
    bad = tmp_path / "bad"
    assert main(["run", "--backend", "kda_test_backends:nan", "--suite", "smoke", "--case", DENSE.id,
                 "--out", str(bad), "--device", "cpu", "--no-report", "--tolerances", tol]) == 1
    capsys.readouterr()
    assert main(["run", "--backend", "emulator", "--route", "nope", "--suite", "smoke", "--out",
                 str(tmp_path / "x"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kda-verify run: error: --route:") and "'nope'" in err and "flashkda" in err
    assert main(["run", "--backend", "emulator", "--suite", "smoke", "--case", "smoke/none", "--out",
                 str(tmp_path / "y"), "--device", "cpu"]) == 2
    assert "--case:" in capsys.readouterr().err


def test_routes_across_several_backends():
    from verification.running.run_select import load, plan
    emu, exact = load("emulator"), load("kda_test_backends:exact")
    cells = plan([emu, exact], ["flashkda", "r2"], [DENSE])
    assert [(lb.name, r.name) for lb, r, _ in cells] == [("emulator", "flashkda"), ("test-exact", "r2")]
    with pytest.raises(UsageError, match=r"--route: expected routes of the chosen backends, got 'nope'.*r1, r2"):
        plan([emu, exact], ["flashkda", "nope"], [DENSE])


def test_progress_bar_on_a_tty_redraws_one_line_with_an_eta():
    from verification.running.run_progress import Progress
    buf = _quiet()
    p = Progress(4, stream=buf, tty=True)
    for st in ("pass", "fail", "pass", "skipped"):
        p.step(Record(status=st, backend="b", route="r", case="c"))
    out = buf.getvalue()
    assert out.count("\r[") == 4 and out.endswith("\n") and out.count("\n") == 1
    assert "[##########" in out and "4/4 100% ETA 0s" in out and "fail=1 pass=2 skipped=1" in out


def test_progress_cuts_a_long_reason_at_a_word_boundary():
    from verification.running.run_progress import Progress, clip_words
    assert clip_words("short", 10) == "short"
    assert clip_words("alpha beta gamma delta", 15) == "alpha beta…"
    assert clip_words("x" * 30, 10) == "x" * 9 + "…"
    reason = "o: rel_l2 " + " ".join(f"word{i:03d}" for i in range(80))     # ~650 characters
    buf = _quiet()
    Progress(1, stream=buf, tty=False).step(Record(status="fail", backend="b", route="r", case="c", reason=reason))
    line = buf.getvalue().strip()
    assert line.endswith("…") and line[:-1].split()[-1] in reason.split(), line     # a whole word, then "…"
    # the redrawn tty line too: a long case id is cut between words
    buf = _quiet()
    Progress(1, stream=buf, tty=True).step(Record(status="pass", backend="b", route="r",
                                                  case=" ".join(f"part{i:03d}" for i in range(60))))
    line = buf.getvalue().strip()
    assert line.endswith("…") and line[:-1].split()[-1].startswith("part") and len(line[:-1].split()[-1]) == 7
