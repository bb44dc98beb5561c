"""The findings register: tolerances.yaml's known_failures with seen_on and shrink, printed by
`kda-verify findings` (md / --json); docs/findings.md's register is that table."""
import json

import pytest

from verification.cli import main
from verification.reporting.findings import BEGIN, DOC, END, HEADER, doc_table, markdown, replace_table, rows
from verification.errors import ToleranceError
from verification.judging.tolerances import load_tolerances, parse_tolerances

ENTRY = """schema: 1
entries: []
known_failures:
  - backend: aiter
    route: "triton:*"
    case: "stress/empty-seq-[sm]*"
    reason: chunks after an empty sequence take the previous sequence's id
    evidence: H200 lens [40,0,70] 10.9% NaN in o
{extra}"""


def test_the_doc_is_the_register_of_the_shipped_tolerances():
    table = doc_table(DOC.read_text(encoding="utf-8"))
    assert table is not None, f"docs/findings.md lacks the markers {BEGIN!r} / {END!r}"
    assert table == markdown(rows()), "docs/findings.md's findings register differs: python -m verification.reporting.findings --write"


def test_every_shipped_finding_says_where_it_was_seen_and_how_to_shrink_it():
    items = rows()
    assert items
    for r in items:
        assert r["seen_on"], r
        assert r["shrink"].startswith("kda-verify shrink --backend "), r
        # the command names this finding's backend and a route / case its globs match
        argv = r["shrink"].split()
        opt = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
        import fnmatch
        if opt.get("--suite") == "serving":      # a serving cell: backend A or A+B, route prefill+decode
            backend = opt["--backend"] + (f"+{opt['--decode-backend']}" if "--decode-backend" in opt else "")
            assert fnmatch.fnmatchcase(backend, r["backend"]), r
            assert fnmatch.fnmatchcase(f"{opt['--route']}+{opt['--decode-route']}", r["route"]), r
        else:
            assert opt["--backend"] == r["backend"], r
            assert fnmatch.fnmatchcase(opt["--route"], r["route"]), r
        assert fnmatch.fnmatchcase(opt["--case"], r["case"]), r


def test_seen_on_and_shrink_are_parsed_and_optional():
    db = parse_tolerances(ENTRY.format(extra='    seen_on: "aiter e4048607a5"\n    shrink: kda-verify shrink --x\n'))
    kf = db.known_failures[0]
    assert (kf.seen_on, kf.shrink) == ("aiter e4048607a5", "kda-verify shrink --x")
    kf = parse_tolerances(ENTRY.format(extra="")).known_failures[0]
    assert (kf.seen_on, kf.shrink) == ("", "")
    line = markdown(rows(parse_tolerances(ENTRY.format(extra=""))))
    assert "(not recorded)" in line and "(none recorded)" in line


@pytest.mark.parametrize("extra", ["    seen_on: ''\n", "    shrink: 3\n", "    seen_at: x\n"])
def test_a_bad_field_names_the_file_line_and_field(extra):
    with pytest.raises(ToleranceError) as e:
        parse_tolerances(ENTRY.format(extra=extra), path="t.yaml")
    msg = str(e.value)
    assert msg.startswith("t.yaml:9:") and ("seen_at" in msg or "seen_on" in msg or "shrink" in msg), msg


def test_findings_prints_short_lines_for_a_terminal(capsys):
    """The register's reasons and evidence run to 1300+ characters a row: in the terminal every line
    is at most 100 characters but the reproduce commands (whole, one a line), each finding keeps
    its heading, its command and, where cut, a pointer to its tolerances.yaml line."""
    assert main(["findings"]) == 0
    lines = capsys.readouterr().out.rstrip("\n").splitlines()
    kfs = load_tolerances().known_failures
    commands = [ln for ln in lines if ln.startswith("    reproduce: ")]
    assert [ln[len("    reproduce: "):] for ln in commands] == [k.shrink or "(none recorded)" for k in kfs]
    too_long = [ln for ln in lines if len(ln) > 100 and ln not in commands]
    assert not too_long, f"{len(too_long)} lines over 100 characters, the longest {max(map(len, too_long))}"
    assert [ln.split(" ", 1)[0] for ln in lines if ln.startswith("#")] == [f"#{i}" for i in range(1, len(kfs) + 1)]
    long_ones = [k for k in kfs if len(k.reason) > 200 or len(k.evidence) > 200]
    assert long_ones and sum("(whole text: tolerances.yaml line " in ln for ln in lines) == len(long_ones)
    assert f"    (whole text: tolerances.yaml line {long_ones[0].line}; kda-verify findings --markdown)" in lines


def test_findings_prints_md_and_json(capsys):
    assert main(["findings", "--markdown"]) == 0
    md = capsys.readouterr().out.strip().splitlines()
    assert tuple(md[:2]) == HEADER and len(md) == 2 + len(load_tolerances().known_failures)
    assert main(["findings", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [f["backend"] for f in data["findings"]] == [k.backend for k in load_tolerances().known_failures]
    assert all(set(f) >= {"seen_on", "shrink", "reason", "evidence", "params", "line"} for f in data["findings"])


def test_a_pipe_in_a_reason_does_not_break_the_table():
    t = markdown([{"backend": "b", "route": "r", "case": "c", "params": "", "seen_on": "v1", "reason": "a | b",
                   "evidence": "e", "shrink": "", "line": 1}])
    assert t.splitlines()[2].count(" | ") == t.splitlines()[0].count(" | ")


def test_replace_table_keeps_the_text_around_it():
    text = f"intro\n{BEGIN}\nold\n{END}\noutro\n"
    assert replace_table(text, "new") == f"intro\n{BEGIN}\nnew\n{END}\noutro\n"


def test_fixed_in_and_still_fails_in_are_parsed_and_rendered_as_a_column():
    db = parse_tolerances(ENTRY.format(extra='    fixed-in: "flash_kda 0.0.1+7afb9f4.fwdsub"\n'
                                             '    still-fails-in: "flash_kda 0.0.1+1ce47ea.neumann"\n'))
    kf = db.known_failures[0]
    assert (kf.fixed_in, kf.still_fails_in) == ("flash_kda 0.0.1+7afb9f4.fwdsub", "flash_kda 0.0.1+1ce47ea.neumann")
    table = markdown(rows(db))
    assert table.splitlines()[0].endswith("| fixed in / still fails in |")
    assert table.splitlines()[2].endswith(
        "| fixed in flash_kda 0.0.1+7afb9f4.fwdsub; still fails in flash_kda 0.0.1+1ce47ea.neumann |")
    assert markdown(rows(parse_tolerances(ENTRY.format(extra="")))).endswith("| (not rechecked) |")
    with pytest.raises(ToleranceError, match="fixed-in: expected a non-empty string"):
        parse_tolerances(ENTRY.format(extra="    fixed-in: ''\n"), path="t.yaml")
