"""The findings register: every explained failure, recorded once in tolerances.yaml's
``known_failures`` (backend, route and case globs, parameter conditions, reason, evidence,
``seen_on``: the library version or commit, ``shrink``: the command that reproduces it,
``fixed-in`` / ``still-fails-in``: the versions where that repro was run and passed / failed).

    kda-verify findings [--markdown | --json]        # the register for a terminal, as a table (md) or JSON
    python -m verification.reporting.findings --write          # replace docs/findings.md's findings table
    python -m verification.reporting.findings --check          # exit 1 when docs/findings.md's table differs

docs/findings.md's register is this module's table between BEGIN and END, never a hand-kept
copy (tests/test_findings.py holds it to the table).
"""
from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path
from typing import Optional

from verification.judging.tolerances import load_tolerances
from verification.running.run_progress import clip_words

BEGIN = "<!-- findings register: made by `python -m verification.reporting.findings --write` from tolerances.yaml; do not edit by hand -->"
END = "<!-- end of the findings register -->"
DOC = Path(__file__).resolve().parents[2] / "docs" / "findings.md"
COLUMNS = ("backend", "route", "case", "params", "seen_on", "reason", "evidence", "shrink", "fixed_in",
           "still_fails_in", "line")
HEADER = ("| # | backend / route | case (parameters) | seen on | why it fails | evidence | reproduce "
          "| fixed in / still fails in |",
          "|---|---|---|---|---|---|---|---|")


def rows(db=None) -> list[dict]:
    """One dict per known failure of ``db`` (default: the shipped tolerances.yaml), in file order."""
    db = load_tolerances() if db is None else db
    return [{"backend": kf.backend, "route": kf.route, "case": kf.case, "params": kf.describe_params(),
             "seen_on": kf.seen_on, "reason": kf.reason, "evidence": kf.evidence, "shrink": kf.shrink,
             "fixed_in": kf.fixed_in, "still_fails_in": kf.still_fails_in, "line": kf.line}
            for kf in db.known_failures]


def _cell(text: str) -> str:
    return (text or "").replace("|", "\\|").replace("\n", " ").strip()


def markdown(items: list[dict]) -> str:
    """The register as a markdown table (HEADER, one row per finding)."""
    out = list(HEADER)
    for i, r in enumerate(items, 1):
        case = f"`{r['case']}`" + (f" ({r['params']})" if r["params"] else "")
        repro = f"`{r['shrink']}`" if r["shrink"] else "(none recorded)"
        status = "; ".join(f"{w} {_cell(r.get(k, ''))}" for w, k in (("fixed in", "fixed_in"),
                                                                     ("still fails in", "still_fails_in"))
                           if r.get(k)) or "(not rechecked)"
        out.append(f"| {i} | `{r['backend']}` / `{r['route']}` | {_cell(case)} | {_cell(r['seen_on']) or '(not recorded)'} "
                   f"| {_cell(r['reason'])} | {_cell(r['evidence'])} | {_cell(repro)} | {status} |")
    return "\n".join(out)


WIDTH = 100          # the terminal form's lines (a reproduce command is never cut: it is copied whole)
SHOWN = 200          # characters of a reason or an evidence shown there, cut at a word boundary


def terminal(items: list[dict], width: int = WIDTH, shown: int = SHOWN) -> str:
    """The register for a terminal: per finding a heading line (number, backend / route, case and
    parameters, where seen), its reason and evidence cut to ``shown`` characters and wrapped to
    ``width``, the command that reproduces it on a line of its own, and a pointer to the full text
    (its tolerances.yaml line; --markdown prints the whole table, as docs/findings.md holds it)."""

    out = []
    for i, r in enumerate(items, 1):
        case = r["case"] + (f" ({r['params']})" if r["params"] else "")
        head = f"#{i} {r['backend']} / {r['route']}: {case}"
        out += textwrap.wrap(head, width, subsequent_indent="    ")
        for label, key in (("seen on", "seen_on"), ("why", "reason"), ("evidence", "evidence")):
            text = _cell(r[key]) or "(not recorded)"
            out += textwrap.wrap(clip_words(text, shown), width, initial_indent=f"    {label}: ",
                                 subsequent_indent="      ")
        out.append(f"    reproduce: {r['shrink']}" if r["shrink"] else "    reproduce: (none recorded)")
        if len(_cell(r["reason"])) > shown or len(_cell(r["evidence"])) > shown:
            out.append(f"    (whole text: tolerances.yaml line {r['line']}; kda-verify findings --markdown)")
        out.append("")
    return "\n".join(out).rstrip("\n")


def doc_table(text: str) -> Optional[str]:
    """The table between BEGIN and END in docs/findings.md's text (None when the markers are missing)."""
    if BEGIN not in text or END not in text:
        return None
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def replace_table(text: str, table: str) -> str:
    head, rest = text.split(BEGIN, 1)
    return head + BEGIN + "\n" + table + "\n" + END + rest.split(END, 1)[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m verification.reporting.findings", description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true", help="replace the table in docs/findings.md")
    g.add_argument("--check", action="store_true", help="exit 1 when docs/findings.md's table differs")
    args = ap.parse_args(argv)
    table = markdown(rows())
    if not (args.write or args.check):
        print(table)
        return 0
    text = DOC.read_text(encoding="utf-8")
    if doc_table(text) is None:
        print(f"docs/findings.md: expected the markers {BEGIN!r} and {END!r}, got none", file=sys.stderr)
        return 2
    if args.check:
        same = doc_table(text) == table
        print("docs/findings.md's findings register is current" if same else
              "docs/findings.md's findings register differs: python -m verification.reporting.findings --write", file=sys.stderr)
        return 0 if same else 1
    DOC.write_text(replace_table(text, table), encoding="utf-8")
    print(f"wrote {len(table.splitlines()) - 2} findings into {DOC}")
    return 0


def as_json(items: list[dict]) -> str:
    return json.dumps({"findings": items}, indent=1)


if __name__ == "__main__":
    sys.exit(main())
