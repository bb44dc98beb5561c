"""The fuzz suite's size and seed on the command line: --fuzz-n / --fuzz-seed (run, calibrate,
export, debug), --kda-fuzz-n / --kda-fuzz-seed (pytest), repro lines and case lookup by id."""
import shlex
from pathlib import Path

import pytest

from kda_test_backends import write_tolerances
from verification.running.cases import _fuzz_draw, _fuzz_params, fuzz_suite, get_case, get_suite
from verification.cli import main
from verification.errors import UsageError
from verification.judging.record import RESULTS_FILE, read_records

pytest_plugins = ["pytester"]
PINNED_FUZZ0_000 = {"lens": [27, 130], "H": 2, "lb": -0.01, "g_scale": 4.0, "g_shift": 12.0, "rho": 0.0,
                    "state": "none", "state_scale": 1.0}
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tol(tmp_path_factory):
    return write_tolerances(tmp_path_factory.mktemp("tol"))


def test_case_i_is_the_same_in_every_draw_and_pinned_by_value():
    # a pure function of (seed, i): the first cases of a bigger draw are the smaller draw
    assert _fuzz_draw(30, 3)[:20] == _fuzz_draw(20, 3)
    assert _fuzz_draw(5, 0) != _fuzz_draw(5, 1)
    # pinned by value, so a change of the draw (or of a library under it) cannot pass unseen:
    # a failing id must name the same problem on every machine
    assert _fuzz_params(0, 0) == PINNED_FUZZ0_000, _fuzz_params(0, 0)


def test_a_draw_of_2000_is_cheap_and_its_ids_are_unique(monkeypatch):
    """Cheap by what it does, not by seconds on a maybe loaded host: a draw draws parameters once
    per case and builds no problem (no tensor), and a later lookup in the same draw draws nothing."""
    from verification.running import cases as cases_mod
    drawn = []
    real = cases_mod._fuzz_params
    monkeypatch.setattr(cases_mod, "_fuzz_params", lambda seed, i: drawn.append(i) or real(seed, i))

    def no_build(*a, **kw):
        raise AssertionError("drawing the fuzz suite built a problem")
    monkeypatch.setattr(cases_mod, "build_problem", no_build)
    _fuzz_draw.cache_clear()
    cases = get_suite("fuzz", n=2000)
    assert len(cases) == 2000 and len({c.id for c in cases}) == 2000
    assert all(c.suite_opts == {"n": 2000, "seed": 0} for c in cases)
    assert drawn == list(range(2000))                                       # each case's parameters once
    assert get_case("fuzz/fuzz0-1999", n=2000).params == cases[-1].params   # kept per process:
    assert len(drawn) == 2000 and _fuzz_draw.cache_info().hits >= 1        # the lookup drew nothing


def test_a_fuzz_id_names_a_case_of_one_draw():
    # an id is looked up in the draw of its run (the run's n and seed)
    assert get_case("fuzz/fuzz0-025", n=30).params == fuzz_suite(30)[25].params
    assert get_case("fuzz/fuzz2-004", n=8).suite_opts == {"n": 8, "seed": 2}     # the seed from the name
    assert get_case("fuzz/fuzz0-004").suite_opts == {"n": 20, "seed": 0}
    with pytest.raises(UsageError, match=r"^--fuzz-n: expected the n of the draw fuzz/fuzz0-025 comes from "
                                         r"\(more than 25; .*got 20 \(the default\)$"):
        get_case("fuzz/fuzz0-025")
    with pytest.raises(UsageError, match=r"^--fuzz-seed: expected the seed of fuzz/fuzz0-001 \(0\), got 3$"):
        get_case("fuzz/fuzz0-001", seed=3)
    with pytest.raises(UsageError, match=r"^--kda-fuzz-n: expected an integer >= 1, got '0'$"):
        get_case("fuzz/fuzz0-001", n="0", names=("--kda-fuzz-n", "--kda-fuzz-seed"))


def _run(tmp_path, capsys, *argv):
    rc = main(["run", "--backend", "emulator", "--route", "flashkda", "--no-report", *argv])
    return rc, capsys.readouterr()


def test_run_draws_n_cases_and_each_repro_line_reruns_its_cell_alone(tmp_path, capsys, tol):
    out = tmp_path / "r"
    rc, _ = _run(tmp_path, capsys, "--suite", "fuzz", "--fuzz-n", "30", "--fuzz-seed", "0", "--case", "fuzz/fuzz0-02[5-6]",
                 "--out", str(out), "--tolerances", tol)
    assert rc == 0
    recs = read_records(out / RESULTS_FILE, strict=True)
    assert [r["case"] for r in recs] == ["fuzz/fuzz0-025", "fuzz/fuzz0-026"]
    rec = recs[0]
    assert "--fuzz-n 30 --fuzz-seed 0" in rec.repro, rec.repro
    argv = shlex.split(rec.repro.replace("--out DIR", f"--out {tmp_path / 'again'}"))
    assert argv[:2] == ["kda-verify", "run"]
    assert main([*argv[1:], "--no-report", "--tolerances", tol]) == 0
    again = read_records(tmp_path / "again" / RESULTS_FILE, strict=True)
    assert len(again) == 1 and again[0]["key"] == rec.key
    assert again[0]["params"] == rec.params and again[0]["seed"] == rec.seed
    assert again[0]["tensors"]["o"]["err"] == rec.tensors["o"]["err"]
    # without the draw's n the id is not in the (default) draw, and the error says why
    rc, cap = _run(tmp_path, capsys, "--suite", "fuzz", "--case", "fuzz/fuzz0-025", "--out", str(tmp_path / "x"))
    assert rc == 2 and "(fuzz ids depend on the draw: this one is --fuzz-n 20 --fuzz-seed 0)" in cap.err


def test_export_and_debug_take_the_draw_of_a_fuzz_id(tmp_path, capsys):
    from verification.reporting.problem_file import load_problem
    path = tmp_path / "p.safetensors"
    assert main(["export", "--case", "fuzz/fuzz0-025", "--fuzz-n", "30", "--out", str(path)]) == 0
    p = load_problem(str(path))
    want = get_case("fuzz/fuzz0-025", n=30).build()
    assert p.T == want.T and p.H == want.H and bool((p.q == want.q).all())
    assert main(["export", "--case", "fuzz/fuzz0-025", "--out", str(path)]) == 2
    assert "--fuzz-n: expected the n of the draw fuzz/fuzz0-025 comes from" in capsys.readouterr().err
    from verification.cli import build_parser
    args = build_parser().parse_args(["debug", "--backend", "emulator", "--route", "flashkda", "--case",
                                      "fuzz/fuzz0-025", "--fuzz-n", "30", "--fuzz-seed", "0"])
    assert (args.fuzz_n, args.fuzz_seed) == ("30", "0")


def test_calibrate_takes_the_fuzz_options(capsys):
    assert main(["calibrate", "--backend", "emulator", "--suite", "fuzz", "--fuzz-n", "0"]) == 2
    assert capsys.readouterr().err.strip() == "kda-verify calibrate: error: --fuzz-n: expected an integer >= 1, got '0'"


def test_pytest_draws_n_cases_and_properties_carry_the_draw(pytester, tmp_path, tol):
    pytester.makepyfile(test_matrix_fuzz=(ROOT / "tests/test_verify_matrix.py").read_text())
    xml = tmp_path / "junit.xml"
    res = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q", "-m", "verify", "--kda-backend", "emulator",
                                       "--kda-route", "flashkda", "--kda-suite", "fuzz", "--kda-fuzz-n", "30",
                                       "--kda-case", "fuzz/fuzz0-025", "--kda-device", "cpu", "--kda-tolerances", tol,
                                       "--junitxml", str(xml))
    out = "\n".join(res.outlines)
    assert res.ret == 0 and "1 passed" in out, out
    import xml.etree.ElementTree as ET
    (case,) = list(ET.parse(xml).getroot().iter("testcase"))
    assert case.get("name") == "verify[emulator-flashkda-fuzz/fuzz0-025]"
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert "--case fuzz/fuzz0-025 --fuzz-n 30 --fuzz-seed 0 " in props["repro"]
