"""Known failures in tolerances.yaml: a listed failing cell is reported as known-fail with its
reason (and does not fail the run); an unlisted one still fails; the schema is enforced."""
import pytest

from verification.judging.policy import FAILING
from verification.judging.record import Record
from verification.running.run_cell import apply_known_failure
from verification.errors import ToleranceError
from verification.judging.tolerances import load_tolerances, parse_tolerances

HEAD = """schema: 1
entries:
  - {backend: "*", route: "*", dtype: "*", tensor: "*", m: 2, floor: 0, cap: 0.05, reason: r, calibrated_on: c}
"""


def _rec(status="fail", backend="emulator", route="moonshot", case="smoke/correlated-weak-lb-0.01"):
    """A record as the runner writes it: with the case's parameters (a fuzz id gets them from _fuzz_rec)."""
    from verification.running.cases import get_case
    params = {} if case.startswith("fuzz/") else dict(get_case(case).params)
    return Record(backend=backend, route=route, case=case, params=params, status=status,
                  reason="o: rel_l2 3.4 > 0.05")


def test_listed_failure_becomes_known_fail_with_its_reason():
    db = load_tolerances()
    rec = apply_known_failure(_rec(), db)
    assert rec.status == "known-fail" and "known-fail" not in FAILING
    assert "fp16 accumulation" in rec.reason and rec.known_failure["status"] == "fail"


def test_unlisted_failure_still_fails():
    db = load_tolerances()
    for rec in (_rec(route="flashkda"), _rec(backend="triton"), _rec(case="smoke/dense-T64-lb-5")):
        assert apply_known_failure(rec, db)["status"] == "fail"


def test_a_listed_cell_that_passes_is_flagged_as_stale():
    rec = apply_known_failure(_rec(status="pass"), load_tolerances())
    assert rec.status == "pass" and "remove the entry" in rec.reason


def test_known_failure_schema_errors_name_the_field():
    bad = HEAD + "known_failures:\n  - {backend: a, route: b, case: c, reason: d, evidence: e, why: f}\n"
    with pytest.raises(ToleranceError, match="unknown field 'why'"):
        parse_tolerances(bad)
    missing = HEAD + "known_failures:\n  - {backend: a, route: b, case: c, reason: d}\n"
    with pytest.raises(ToleranceError, match="missing field 'evidence'"):
        parse_tolerances(missing)


# ----- params: conditions on the case's parameters (fuzz cases have no descriptive name) ----------
# The five moonshot cells that failed in `kda-verify run --backend emulator --suite fuzz --fuzz-n 300`
# before the moonshot entry had params (all correlated keys, beta_raw 4, a weak gate).
FUZZ_FAILURES_300 = {"fuzz0-022", "fuzz0-148", "fuzz0-180", "fuzz0-189", "fuzz0-213"}


def _fuzz_rec(i: int, status="fail", route="moonshot", **change):
    from verification.running.cases import get_suite
    case = {c.name: c for c in get_suite("fuzz", n=300, seed=0)}[f"fuzz0-{i:03d}"]
    params = {**case.params, **change}
    rec = _rec(status=status, route=route, case=case.id)
    rec.params = params
    return rec


def _moonshot_entry():
    return next(kf for kf in load_tolerances().known_failures if kf.route == "moonshot")


def test_fuzz_case_with_the_known_parameters_is_known_fail():
    rec = apply_known_failure(_fuzz_rec(148), load_tolerances())        # rho 0.9, beta_raw 4, lb -0.3
    assert rec.status == "known-fail" and "fp16 accumulation" in rec.reason
    assert rec.known_failure["params"] == "rho>=0.9, beta_raw>=4, lb>=-0.3"
    assert "parameters rho>=0.9, beta_raw>=4, lb>=-0.3" in rec.reason


def test_fuzz_failures_outside_the_parameters_still_fail():
    db = load_tolerances()
    for rec in (_fuzz_rec(148, rho=0.5), _fuzz_rec(148, lb=-1.0), _fuzz_rec(148, beta_raw=0.0),
                _fuzz_rec(148, route="flashkda"), _fuzz_rec(0)):
        assert apply_known_failure(rec, db)["status"] == "fail", rec.params
    no_beta = _fuzz_rec(148)
    del no_beta["params"]["beta_raw"]                      # unset: no default is filled in
    assert apply_known_failure(no_beta, db)["status"] == "fail"
    no_params = _fuzz_rec(148)
    no_params.params = {}                                  # a record without params matches no params entry
    assert apply_known_failure(no_params, db)["status"] == "fail"


def test_the_moonshot_entry_matches_the_failing_fuzz_cases_and_little_else():
    from verification.running.cases import get_suite
    kf = _moonshot_entry()
    matched = {c.name for c in get_suite("fuzz", n=300, seed=0)
               if kf.matches("emulator", "moonshot", c.id, c.params)}
    assert FUZZ_FAILURES_300 <= matched
    assert matched - FUZZ_FAILURES_300 == {"fuzz0-125"}    # the one case of the region that passes (lb -0.3, rho 1)


def test_the_moonshot_entry_still_matches_exactly_the_named_correlated_cases():
    """With params it covers the named cases its former case glob "*correlated*" covered, no other."""
    import fnmatch

    from verification.running.cases import SUITES, get_suite
    kf = _moonshot_entry()
    named = [c for s in SUITES if s != "fuzz" for c in get_suite(s)]
    by_params = {c.id for c in named if kf.matches("emulator", "moonshot", c.id, c.params)}
    assert by_params == {c.id for c in named if fnmatch.fnmatchcase(c.id, "*correlated*")}
    assert len(by_params) == 4


def test_a_passing_case_in_the_region_is_noted_but_not_called_stale():
    rec = apply_known_failure(_fuzz_rec(125, status="pass"), load_tolerances())
    assert rec.status == "pass" and "match the known failure at tolerances.yaml line" in rec.reason
    assert "once no case of that region fails, remove the entry" in rec.reason


KF = "known_failures:\n  - {backend: emulator, route: moonshot, case: '*', reason: d, evidence: e, params: %s}\n"


def test_params_conditions_comparisons_numbers_and_ranges():
    db = parse_tolerances(HEAD + KF % "{lb: ['>=-0.3', '<0'], H: 2, rho: '== 1', g_scale: '>1e-1'}")
    kf = db.known_failures[0]
    assert kf.describe_params() == "lb>=-0.3, lb<0, H==2, rho==1, g_scale>0.1"
    ok = {"lb": -0.3, "H": 2, "rho": 1.0, "g_scale": 4.0}
    assert kf.matches("emulator", "moonshot", "fuzz/x", ok)
    for bad in ({"lb": -0.31}, {"lb": 0.0}, {"H": 1}, {"rho": 0.9}, {"g_scale": 0.1}, {"H": True},
                {"lb": float("nan")}, {"H": "2"}):
        assert not kf.matches("emulator", "moonshot", "fuzz/x", {**ok, **bad}), bad
    assert not kf.matches("emulator", "moonshot", "fuzz/x", {k: v for k, v in ok.items() if k != "rho"})
    assert not kf.matches("emulator", "moonshot", "fuzz/x", None)
    assert not kf.matches("emulator", "fla", "fuzz/x", ok)                # the globs still apply


@pytest.mark.parametrize("value, message", [
    ("{rho: '=>0.9'}", r"t.yaml:5: known failure emulator/moonshot/\*: params.rho: expected a number or a "
                       r"comparison '<op><number>' with op one of >=, <=, >, <, ==, or a list of them, got '=>0.9'"),
    ("{rho: '>= high'}", r"params.rho: expected a number or a comparison .*, got '>= high'"),
    ("{rho: '>=nan'}", r"params.rho: expected .*, got '>=nan'"),
    ("{rho: .nan}", r"params.rho: expected .*, got nan"),
    ("{rho: true}", r"params.rho: expected .*, got True"),
    ("{rho: [0.9, [1]]}", r"params.rho: expected .*, got \[1\]"),
    ("{rho: []}", r"params.rho: expected .* or a non-empty list of them, got \[\]"),
    ("{beta: '>=4'}", r"known failure emulator/moonshot/\*: params: expected numeric case parameters "
                      r"\(B, T, H, .*rho.*\), got 'beta'"),
    ("{state: kv}", r"params: expected numeric case parameters .*, got 'state'"),
    ("{}", r"known failure emulator/moonshot/\*: params: expected a mapping of case parameter to condition "
           r".*, got \{\}"),
    ("[rho]", r"params: expected a mapping of case parameter to condition .*, got \['rho'\]"),
    ("'rho>=0.9'", r"params: expected a mapping .*, got 'rho>=0.9'"),
])
def test_bad_params_name_the_entry_the_field_what_was_expected_and_what_came(value, message):
    with pytest.raises(ToleranceError, match=message):
        parse_tolerances(HEAD + KF % value, "t.yaml")


def test_calibrate_leaves_a_params_matched_fuzz_failure_out():
    from verification.investigating.calibrate import collect_groups
    db = load_tolerances()
    rec, other = _fuzz_rec(148), _fuzz_rec(148, rho=0.5)
    for r in (rec, other):
        r.dtype, r.metrics = "bf16", {"o": {"rel_l2": 0.065, "tail_rel_l2": 0.065}}
    assert collect_groups([rec], db) == {}
    assert collect_groups([other], db) != {}


@pytest.mark.slow
def test_run_reports_a_fuzz_case_in_the_region_as_known_fail(tmp_path, capsys):
    from verification.cli import main
    from verification.judging.record import read_records
    out = tmp_path / "fz"
    assert main(["run", "--backend", "emulator", "--route", "moonshot", "--suite", "fuzz", "--case",
                 "fuzz/fuzz0-148", "--fuzz-n", "300", "--out", str(out), "--device", "cpu"]) == 0
    capsys.readouterr()
    (rec,) = read_records(out / "results.jsonl")
    assert rec.status == "known-fail" and rec.known_failure["status"] == "fail"
    assert rec.known_failure["params"] == "rho>=0.9, beta_raw>=4, lb>=-0.3"


def test_every_numeric_parameter_a_suite_sets_can_be_conditioned_on():
    from verification.running.cases import NUMERIC_PARAMS, SUITES, get_suite
    cases = [c for s in SUITES if s != "fuzz" for c in get_suite(s)] + get_suite("fuzz", n=300, seed=0)
    numeric = {k for c in cases for k, v in c.params.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert numeric <= set(NUMERIC_PARAMS), numeric - set(NUMERIC_PARAMS)
    assert {"rho", "beta_raw", "lb", "H", "g_scale", "g_shift", "state_scale"} <= numeric
