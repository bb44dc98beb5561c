"""Known failures in tolerances.yaml: a listed failing cell is reported as known-fail with its
reason (and does not fail the run); an unlisted one still fails; the schema is enforced."""
import pytest

from verification.runner import FAILING, apply_known_failure
from verification.tolerances import ToleranceError, load_tolerances, parse_tolerances

HEAD = """schema: 1
entries:
  - {backend: "*", route: "*", dtype: "*", tensor: "*", m: 2, floor: 0, cap: 0.05, reason: r, calibrated_on: c}
"""


def _rec(status="fail", backend="emulator", route="moonshot", case="smoke/correlated-weak-lb-0.01"):
    return {"backend": backend, "route": route, "case": case, "status": status, "reason": "o: rel_l2 3.4 > 0.05"}


def test_listed_failure_becomes_known_fail_with_its_reason():
    db = load_tolerances()
    rec = apply_known_failure(_rec(), db)
    assert rec["status"] == "known-fail" and "known-fail" not in FAILING
    assert "fp16 accumulation" in rec["reason"] and rec["known_failure"]["status"] == "fail"


def test_unlisted_failure_still_fails():
    db = load_tolerances()
    for rec in (_rec(route="flashkda"), _rec(backend="triton"), _rec(case="smoke/dense-T64-lb-5")):
        assert apply_known_failure(rec, db)["status"] == "fail"


def test_a_listed_cell_that_passes_is_flagged_as_stale():
    rec = apply_known_failure(_rec(status="pass"), load_tolerances())
    assert rec["status"] == "pass" and "remove the entry" in rec["reason"]


def test_known_failure_schema_errors_name_the_field():
    bad = HEAD + "known_failures:\n  - {backend: a, route: b, case: c, reason: d, evidence: e, why: f}\n"
    with pytest.raises(ToleranceError, match="unknown field 'why'"):
        parse_tolerances(bad)
    missing = HEAD + "known_failures:\n  - {backend: a, route: b, case: c, reason: d}\n"
    with pytest.raises(ToleranceError, match="missing field 'evidence'"):
        parse_tolerances(missing)
