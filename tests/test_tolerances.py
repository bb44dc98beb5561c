"""tolerances.yaml: schema, lookup, and that the shipped entries hold on their measured basis."""
import pytest

from verification.cli import UsageError
from verification.tolerances import DEFAULT_PATH, ToleranceError, load_tolerances, parse_tolerances

GOOD = """schema: 1
entries:
  - backend: "*"
    route: "*"
    dtype: bf16
    tensor: o
    m: 2.0
    floor: 1.0e-4
    cap: 5.0e-2
    reason: default
    calibrated_on: test
  - backend: triton
    route: "seg:*"
    dtype: bf16
    tensor: o
    m: 3.0
    floor: 0
    cap: 5.0e-2
    reason: segmented routes
    calibrated_on: test
"""


def test_the_shipped_file_loads_and_every_entry_is_justified():
    db = load_tolerances()
    assert len(db) >= 5 and str(DEFAULT_PATH).endswith("tolerances.yaml")
    for _, tol in db.entries:
        assert tol.reason and tol.calibrated_on and tol.cap > 0 and tol.m >= 1.0


def test_shipped_entries_cover_every_judged_tensor():
    db = load_tolerances()
    for backend in ("emulator", "emulator-bad", "triton", "some-new-kernel"):
        for tensor in ("o", "final_state", "state_cache", "ws_inv"):
            for dtype in ("bf16", "fp16", "fp32"):
                db.lookup(backend, "any-route", dtype, tensor)
    assert db.lookup("emulator", "flashkda", "bf16", "o").m == 1.0
    assert db.lookup("emulator-bad", "carry_scaled", "bf16", "o").m == 2.0


def test_lookup_prefers_the_most_specific_entry():
    db = parse_tolerances(GOOD, "t.yaml")
    assert db.lookup("triton", "seg:cps=4", "bf16", "o").m == 3.0
    assert db.lookup("triton", "unseg", "bf16", "o").m == 2.0
    tol = db.lookup("aiter", "gluon", "bf16", "o")
    assert tol.key == "*/*/bf16/o" and tol.threshold(1e-3) == pytest.approx(2.1e-3)
    assert tol.threshold(1.0) == 5.0e-2                   # the cap binds
    with pytest.raises(ToleranceError, match="expected an entry matching backend=aiter route=gluon dtype=fp16"):
        db.lookup("aiter", "gluon", "fp16", "o")


@pytest.mark.parametrize("edit, message", [
    (("schema: 1\n", "schema: 1\nextra: 3\n"), r"t.yaml:2: unknown key 'extra'"),
    (("    reason: default\n", "    reason: default\n    margin: 3\n"), r"t.yaml:11: unknown field 'margin'"),
    (("    calibrated_on: test\n  - backend: triton", "  - backend: triton"), r"t.yaml:3: entry: missing field 'calibrated_on'"),
    (("dtype: bf16\n    tensor: o\n    m: 2.0", "dtype: bfloat\n    tensor: o\n    m: 2.0"), r"t.yaml:5: dtype: expected one of bf16"),
    (("m: 2.0", "m: -2"), r"t.yaml:7: m: expected a number >= 0, got -2"),
    (("cap: 5.0e-2\n    reason: default", "cap: 0\n    reason: default"), r"t.yaml:9: cap: expected a number > 0"),
    (("    reason: default\n", "    reason: ''\n"), r"t.yaml:10: reason: expected a non-empty string"),
    (('backend: triton\n    route: "seg:*"', 'backend: "*"\n    route: "*"'), r"t.yaml:12: entry \*/\*/bf16/o: same key as the entry at line 3"),
    (("schema: 1", "schema: 2"), r"t.yaml:1: schema: expected 1"),
])
def test_schema_errors_name_file_line_and_field(edit, message):
    text = GOOD.replace(edit[0], edit[1], 1)
    assert text != GOOD
    with pytest.raises(ToleranceError, match=message):
        parse_tolerances(text, "t.yaml")


def test_errors_are_usage_errors_for_the_cli(tmp_path):
    assert issubclass(ToleranceError, UsageError)
    with pytest.raises(ToleranceError, match="--tolerances: expected a YAML file"):
        load_tolerances(str(tmp_path / "none.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("schema: [1\n")
    with pytest.raises(ToleranceError, match="bad.yaml:"):
        load_tolerances(str(bad))
