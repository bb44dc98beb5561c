"""The record type and its codec (verification/judging/record.py), and the one function that decides a
cell's final status (verification.judging.verdict.decide)."""
import json
import math
from types import SimpleNamespace

from verification.judging.record import (RECORD_VERSION, Record, append_record, decode_number, encode, load_records,
                                  read_records)
from verification.judging.verdict import decide


def test_non_finite_numbers_travel_as_the_strings_the_results_files_hold():
    assert encode({"a": math.nan, "b": (math.inf, -math.inf, 1.5)}) == {"a": "NaN", "b": ["Infinity", "-Infinity", 1.5]}
    for s, want in (("NaN", math.nan), ("Infinity", math.inf), ("-Infinity", -math.inf),
                    ("nan", math.nan), ("inf", math.inf), ("-inf", -math.inf)):      # and what check --json wrote
        got = decode_number(s)
        assert (math.isnan(got) and math.isnan(want)) or got == want, s
    assert math.isnan(decode_number(None)) and decode_number(2) == 2.0


def test_a_record_written_and_read_back_is_the_same_dict(tmp_path):
    rec = Record(key="b|r|c", backend="b", route="r", case="c", status="fail", reason="x",
                 margin=math.inf, extra={"guards": {"ok": False}}).to_dict()
    path = tmp_path / "results.jsonl"
    append_record(path, rec)
    line = json.loads(path.read_text())
    assert line["record_version"] == RECORD_VERSION and line["margin"] == "Infinity"
    assert read_records(path) == [encode(rec)]
    assert load_records(path)[0].extra == {"guards": {"ok": False}}


def test_a_file_written_before_the_version_field_loads_as_version_0(tmp_path):
    old = {f: None for f in Record.fields()} | {"key": "k", "status": "pass", "info": {}}
    path = tmp_path / "results-gw0.jsonl"
    path.write_text(json.dumps(old) + "\n" + '{"key": "partial', encoding="utf-8")
    (r,) = load_records(path)
    assert r.version == 0 and r.status == "pass" and r.extra == {"info": {}}
    assert read_records(path) == [old]


def _kf(params=""):
    return SimpleNamespace(line=7, reason="known", evidence="seen", describe_params=lambda: params)


def test_decide_orders_not_applicable_guard_contract_and_known_failure():
    v = SimpleNamespace
    assert decide(v(status="not-applicable", reason="degenerate")).status == "skipped"
    guard = SimpleNamespace(ok=False, reason="guard: wrote past o")
    d = decide(v(status="pass", reason="pass: m"), guard=guard)
    assert (d.status, d.reason) == ("fail", "guard: wrote past o; pass: m")
    d = decide(v(status="fail", reason="o: bad"), guard=guard, contract="lb outside", known_failure=_kf(),
               metrics={"o": {"rel_l2": 0.5, "nan_frac": 0, "inf_frac": 0}})
    assert d.status == "out-of-contract" and d.fields["contract_verdict"]["status"] == "fail"
    d = decide(v(status="mistrusted", reason="zeros"), known_failure=_kf())
    assert d.status == "known-fail" and d.fields["known_failure"]["status"] == "mistrusted"
    assert "tolerances.yaml line 7" in d.reason
    d = decide(v(status="pass", reason="pass: m"), known_failure=_kf())
    assert d.status == "pass" and "remove the entry" in d.reason
    rec = {"status": None, "reason": ""}
    assert decide(v(status="error", reason="raised")).apply_to(rec) == {"status": "error", "reason": "raised"}
