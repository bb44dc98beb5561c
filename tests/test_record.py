"""The record type and its codec (verification/judging/record.py), and the one function that decides a
cell's final status (verification.judging.verdict.decide)."""
import json
import math
from types import SimpleNamespace

from verification.judging.record import (RECORD_VERSION, Record, append_record, decode_number, encode, new_record,
                                  read_records, set_judged)
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
    assert [r.to_dict() for r in read_records(path)] == [encode(rec)]
    assert read_records(path)[0].extra == {"guards": {"ok": False}}


def test_a_file_written_before_the_version_field_loads_as_version_0(tmp_path):
    old = {f: None for f in Record.fields()} | {"key": "k", "status": "pass", "info": {}}
    path = tmp_path / "results-gw0.jsonl"
    path.write_text(json.dumps(old) + "\n" + '{"key": "partial', encoding="utf-8")
    (r,) = read_records(path)
    assert r.version == 0 and r.status == "pass" and r.extra == {"info": {}}
    assert [r.to_dict() for r in read_records(path)] == [old]


def test_a_record_made_by_the_runner_reads_back_with_its_typed_fields(tmp_path):
    """A results file written by the current code (new_record, set_judged, the extras' accessors)
    and a version-0 line read back as Records with the same fields and the same line on disk."""
    rec = new_record(backend="b", backend_spec="b", backend_version="1", route="r", recipe="fla", case="c",
                     suite="smoke", seed=3, params={"lb": -5.0}, device="cpu", repro="kda-verify run ...")
    set_judged(rec, {"o": {"err": 0.5, "threshold": 0.25, "margin": 2.0}}, {"o": {"rel_l2": 0.5}},
               baseline={"o": {"rel_l2": 0.1, "curve": [1, 2]}})
    rec.status, rec.reason, rec.traceback = "fail", "o: 2x", "tb"
    assert rec.key == "b|r|c" and rec.margin == 2.0 and rec.baseline == {"o": {"rel_l2": 0.1}}
    assert rec["traceback"] == "tb" and rec.extra == {"traceback": "tb"} and rec.guards is None
    path = tmp_path / "results.jsonl"
    append_record(path, rec)
    v0 = {**{k: v for k, v in rec.to_dict().items()}, "key": "b|r|d", "case": "d"}
    with open(path, "a", encoding="utf-8") as f:       # a line of version 0: no record_version
        f.write(json.dumps(v0) + "\n")
    new, old = read_records(path)
    assert new.version == RECORD_VERSION and old.version == 0
    assert new.to_dict() == rec.to_dict() and new.traceback == "tb" and old.traceback == "tb"
    assert json.loads(new.to_json()) == json.loads(path.read_text().splitlines()[0])
    assert sorted(json.loads(path.read_text().splitlines()[0])) == sorted([*Record.fields(), "traceback",
                                                                           "record_version"])


def test_the_dict_form_reads_and_writes_the_same_fields():
    rec = Record(key="k")
    rec["status"] = "pass"
    rec.update(reason="r", guards={"ok": True})
    assert rec.status == "pass" and rec.reason == "r" and rec.guards == {"ok": True}
    assert rec.get("info") is None and "guards" in rec and "info" not in rec and "status" in rec
    rec.guards = None
    assert "guards" not in rec.extra


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
