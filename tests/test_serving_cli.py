"""``kda-verify run --suite serving`` at the CLI: refusals (one line, exit 2), a run with test-local
RunsTraces backends (records, report, exit policy), not applicable without a baseline, Ctrl-C
(exit 130, the report INTERRUPTED)."""
from __future__ import annotations

import json

import pytest

from verification.cli import main
from verification.judging.record import read_records

EXACT = "serving_backends:exact"


@pytest.fixture
def baseline(monkeypatch):
    monkeypatch.setenv("KDA_SERVING_BASELINE", EXACT)


def _one_line(capsys, rc, want_rc, *needles):
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert rc == want_rc, cap
    assert len(err) == 1 and "Traceback" not in cap.err, cap
    for n in needles:
        assert n in err[0], err
    return err[0]


@pytest.mark.parametrize("argv, needle", [
    (["--backend", "fla-naive"], "--backend fla-naive: runs no serving-trace calls (no RunsTraces)"),
    (["--backend", EXACT, "--decode-backend", "fla-naive"],
     "--decode-backend fla-naive: runs no serving-trace calls (no RunsTraces)"),
    (["--backend", EXACT, "--route", "nope"], "--route: backend 'serving-exact' has no trace route 'nope'"),
    (["--backend", EXACT, "--route", "exact-decode"],
     "--route: trace route 'exact-decode' of 'serving-exact' runs decode, spec calls, not prefill"),
    (["--backend", EXACT, "--decode-route", "exact-prefill"],
     "--decode-route: trace route 'exact-prefill' of 'serving-exact' runs prefill calls, not decode or spec"),
    (["--backend", f"{EXACT},{EXACT}"], "--backend: expected one backend with --suite serving"),
    (["--backend", EXACT, "--suite", "smoke"], "--suite: expected serving alone"),
    (["--backend", EXACT, "--case", "serving/nope"], "--case: expected a case id (or glob) of suite serving"),
    (["--backend", EXACT, "--isolate"], "--isolate: expected without --suite serving"),
])
def test_refusals_one_line_exit_2(argv, needle, capsys, tmp_path):
    out = tmp_path / "o"
    rc = main(["run", "--suite", "serving", *argv, "--out", str(out)])
    _one_line(capsys, rc, 2, needle)
    assert not out.exists()


def test_decode_options_need_the_serving_suite(capsys, tmp_path):
    rc = main(["run", "--suite", "smoke", "--backend", "emulator", "--decode-backend", EXACT, "--out", str(tmp_path / "o")])
    _one_line(capsys, rc, 2, "--decode-backend: expected together with --suite serving")


def test_run_pass_and_fail(baseline, capsys, tmp_path):
    out = tmp_path / "ok"
    rc = main(["run", "--suite", "serving", "--backend", EXACT, "--route", "exact-prefill", "--decode-route",
               "exact-decode", "--case", "serving/spec-accepts", "--case", "serving/one-token-prompts",
               "--out", str(out)])
    cap = capsys.readouterr()
    assert rc == 0, cap
    assert "VERIFIED 2 of 2 cells: 2 pass" in cap.out
    recs = read_records(out / "results.jsonl")
    assert [r["status"] for r in recs] == ["pass", "pass"]
    r = recs[0]
    assert r["suite"] == "serving" and r["route"] == "exact-prefill+exact-decode"
    assert set(r["tensors"]) == {"o", "state_cache"} and r["margin"] < 1
    assert r["repro"].startswith("kda-verify run --suite serving --backend serving_backends:exact --route exact-prefill")
    assert (out / "report.md").exists()
    bad = tmp_path / "bad"
    rc = main(["run", "--suite", "serving", "--backend", "serving_backends:transposed", "--route", "exact-prefill",
               "--decode-backend", EXACT, "--decode-route", "exact-decode", "--case", "serving/atom-1750",
               "--out", str(bad)])
    cap = capsys.readouterr()
    assert rc == 1, cap
    rec = read_records(bad / "results.jsonl")[0]
    assert rec.backend == "serving-transposed+serving-exact" and rec.status == "fail"
    assert rec.serving["diagnosis"].startswith("layout disagreement: prefill serving-transposed:exact-prefill "
                                                  "wrote slot")
    assert "layout disagreement" in (bad / "report.md").read_text()


def test_cross_product_of_routes(baseline, capsys, tmp_path):
    rc = main(["run", "--suite", "serving", "--backend", EXACT, "--case", "serving/one-token-prompts",
               "--out", str(tmp_path / "x")])
    capsys.readouterr()
    assert rc == 0
    routes = sorted(r["route"] for r in read_records(tmp_path / "x" / "results.jsonl"))
    assert routes == ["exact-all+exact-all", "exact-all+exact-decode", "exact-prefill+exact-all",
                      "exact-prefill+exact-decode"]


def test_no_baseline_is_not_applicable(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("KDA_SERVING_BASELINE", "kda_test_backends:exact")     # a backend without RunsTraces
    rc = main(["run", "--suite", "serving", "--backend", EXACT, "--route", "exact-prefill", "--decode-route",
               "exact-decode", "--case", "serving/one-token-prompts", "--out", str(tmp_path / "n")])
    cap = capsys.readouterr()
    assert rc == 2, cap
    rec = read_records(tmp_path / "n" / "results.jsonl")[0]
    assert rec.status == "skipped"
    assert "runs no serving-trace calls yet (no RunsTraces), so no baseline exists" in rec.reason


def test_ctrl_c_exits_130_interrupted(baseline, capsys, tmp_path):
    out = tmp_path / "i"
    rc = main(["run", "--suite", "serving", "--backend", "serving_backends:interrupt", "--route", "exact-prefill",
               "--decode-route", "exact-decode", "--case", "serving/one-token-prompts", "--out", str(out)])
    cap = capsys.readouterr()
    assert rc == 130
    assert "INTERRUPTED: 1 of 1 selected cells not run" in cap.out
    assert "kda-verify run: interrupted: 1 of 1 selected cells not run" in cap.err
    assert "INTERRUPTED" in (out / "report.md").read_text()
    runs = json.loads((out / "run.json").read_text())["runs"]
    assert runs[-1]["interrupted"] == {"selected": 1, "not_run": 1}


def test_pytest_plugin_runs_serving_cells(baseline, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root / "tests"), env.get("PYTHONPATH", "")])
    env.pop("PYTEST_XDIST_WORKER", None)
    rep = tmp_path / "rep"
    cmd = [sys.executable, "-m", "pytest", "tests/test_verify_matrix.py", "-p", "no:cacheprovider", "-q", "-rfs",
           "-m", "verify", "--kda-suite", "serving", "--kda-backend", "serving_backends:transposed",
           "--kda-route", "exact-prefill", "--kda-decode-backend", EXACT, "--kda-decode-route", "exact-decode",
           "--kda-case", "serving/one-token-prompts", "--kda-case", "serving/mixed-kv", "--kda-report", str(rep)]
    res = subprocess.run(cmd, cwd=root, capture_output=True, text=True, env=env, timeout=240)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    # V-first: the transposed handover fails, named; K-first: the same bytes are the right layout
    assert "1 failed, 1 passed" in out, out
    assert ("verify[serving-transposed+serving-exact-exact-prefill+exact-decode-serving/one-token-prompts]" in out)
    assert "layout disagreement: prefill serving-transposed:exact-prefill wrote slot" in out
    recs = read_records(rep / "results.jsonl")
    assert sorted(r["status"] for r in recs) == ["fail", "pass"]


def test_report_shows_serving_cells_and_the_drift_curve(baseline, capsys, tmp_path):
    out = tmp_path / "d"
    rc = main(["run", "--suite", "serving", "--backend", EXACT, "--route", "exact-prefill", "--decode-route",
               "exact-decode", "--case", "serving/decode-drift-bf16", "--out", str(out)])
    capsys.readouterr()
    assert rc == 0
    rec = read_records(out / "results.jsonl")[0]
    d = rec.serving["drift"]
    assert d["decode_steps"] == 120 and d["cache_dtype"] == "bfloat16" and len(d["o_err"]) == len(d["step"])
    md = (out / "report.md").read_text()
    assert "## Serving traces" in md and "state err last 10%" in md
    assert f"request 0 step {d['worst']['step']}" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "plots" / "serving_drift.png").stat().st_size > 0


def test_long_traces_report_progress(baseline, capsys, tmp_path, monkeypatch):
    from verification.serving import cells
    monkeypatch.setattr(cells, "LONG_STEPS", 50)
    rc = main(["run", "--suite", "serving", "--backend", EXACT, "--route", "exact-prefill", "--decode-route",
               "exact-decode", "--case", "serving/decode-drift-fp32", "--out", str(tmp_path / "p")])
    err = capsys.readouterr().err
    assert rc == 0
    assert "serving-exact exact-prefill+exact-decode serving/decode-drift-fp32: step 50/121" in err
    assert "step 100/121" in err


def test_emulator_runs_the_suite_on_the_cpu(capsys, tmp_path, monkeypatch):
    """The emulator is its own baseline (its trace routes are named by their recipes)."""
    monkeypatch.delenv("KDA_SERVING_BASELINE", raising=False)
    rc = main(["run", "--suite", "serving", "--backend", "emulator", "--route", "flashkda", "--decode-route",
               "fla-recurrent", "--case", "serving/spec-accepts", "--out", str(tmp_path / "e")])
    capsys.readouterr()
    assert rc == 0
    rec = read_records(tmp_path / "e" / "results.jsonl")[0]
    assert rec.status == "pass" and rec.self_judged and rec.recipe == "flashkda+fla-recurrent"


def test_emulator_bad_handover_named_against_the_emulator(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("KDA_SERVING_BASELINE", raising=False)
    rc = main(["run", "--suite", "serving", "--backend", "emulator-bad", "--route", "handover-transposed",
               "--decode-backend", "emulator", "--decode-route", "fla-recurrent", "--case", "serving/atom-1750",
               "--out", str(tmp_path / "b")])
    capsys.readouterr()
    assert rc == 1
    rec = read_records(tmp_path / "b" / "results.jsonl")[0]
    assert rec.status == "fail"
    assert rec.reason.startswith("layout disagreement: prefill emulator-bad:handover-transposed wrote slot 1 "
                                    "K-first where the trace's cache is V-first (step 0, request 0)")


def test_padding_write_over_a_slot_read_later_in_the_step_is_named(capsys, tmp_path, monkeypatch):
    """emulator-bad's pad-writes-last-slot: the decode call's padding row writes the last slot,
    which the spec call reads next in the same step."""
    monkeypatch.delenv("KDA_SERVING_BASELINE", raising=False)
    rc = main(["run", "--suite", "serving", "--backend", "emulator", "--route", "flashkda", "--decode-backend",
               "emulator-bad", "--decode-route", "pad-writes-last-slot", "--case", "serving/pad-null0",
               "--out", str(tmp_path / "c")])
    capsys.readouterr()
    assert rc == 1
    rec = read_records(tmp_path / "c" / "results.jsonl")[0]
    assert rec.reason.startswith("slot overwritten before it was read: call decode emulator-bad:pad-writes-last-slot "
                                    "(no row of it names slot 6; its padding row(s) [15]")
    assert "changed slot 6 in step 4 before spec emulator-bad:pad-writes-last-slot read it for request 3" in rec.reason


def test_one_pairing_names_the_option_of_a_backend_that_cannot_run():
    """capture's and shrink's serving forms load their two sides through serving.cells.one_pairing:
    the decode side is the prefill backend unless another is named, an unnamed route the side's
    first trace route, and a backend that cannot run here a BackendError naming its option."""
    import pytest

    from kda_kernels.base import BackendError
    from verification.serving import cells
    la, lb, rp, rd = cells.one_pairing("emulator", None, None, None)
    assert lb is la and "prefill" in rp.flag("groups") and set(rd.flag("groups")) & {"decode", "spec"}
    with pytest.raises(BackendError, match="^--decode-backend: "):
        cells.one_pairing("emulator", "moonshot", None, None)     # flash_kda needs a GPU build


def _first_chunks(n_items: int, workers: int) -> list:
    """The items xdist's ``--dist load`` sends each worker first (LoadScheduling.schedule): a
    chunk of max(2, items / workers / 4) consecutive items per worker, round robin when there are
    fewer than two per worker."""
    if n_items < 2 * workers:
        return [list(range(w, n_items, workers)) for w in range(workers)]
    chunk = max(2, n_items // workers // 4)
    return [list(range(w * chunk, min(n_items, (w + 1) * chunk))) for w in range(workers)]


@pytest.mark.parametrize("workers", [5, 3, 16, 0])
def test_long_serving_cells_start_first_each_on_a_worker_of_its_own(workers):
    """On the H200 the two long cells of fla + fla were adjacent, went to one worker as its first
    chunk and ran back to back (69 s of a 90 s run).  Scheduled, every long cell is in a different
    worker's first chunk under xdist's default ``--dist load`` and among the first units under
    ``loadgroup`` (one unit per worker to begin with, the ones after as workers free up); every
    cell is kept.  A worker cannot see the mode (xdist sets its dist option to "no")."""
    from types import SimpleNamespace
    from verification.pytest_plugin import _scheduled
    from verification.serving.cases import serving_suite
    cases = serving_suite()
    assert sum(c.long for c in cases) >= 2
    cells = [(SimpleNamespace(name="b"), SimpleNamespace(name=f"r{i}"), c) for c in cases for i in range(3 if not c.long else 1)]
    out = _scheduled(cells, workers)
    assert sorted(id(x[2]) for x in out) == sorted(id(x[2]) for x in cells) and not any(g for *_, g in out)
    where = [i for i, x in enumerate(out) if x[2].long]
    if not workers:
        assert where == list(range(len(where)))
        return
    chunks = _first_chunks(len(out), workers)
    owners = [next(w for w, ch in enumerate(chunks) if i in ch) for i in where]
    assert len(set(owners)) == len(where), (where, chunks)
    assert where[-1] < len(where) * max(2, len(out) // workers // 4)
