"""`kda-verify report DIR`: report.md, report.html (self-contained), report.json and plots/*.png
from DIR/results.jsonl (and the per-worker DIR/results-*.jsonl of a pytest-xdist run)."""
from __future__ import annotations

from pathlib import Path

NAME = "report"
HELP = "write report.md, report.html, report.json and plots from a results directory"
EXAMPLES = """\
kda-verify report kda-runs/smoke
kda-verify report runs/fla
"""


def add_arguments(p):
    p.add_argument("dir", metavar="DIR", help="a results directory written by `kda-verify run` or --kda-report")


def run(args) -> int:
    from verification.errors import UsageError
    from verification.report import load_results, results_files, summarize, write_report

    d = Path(args.dir)
    if not d.is_dir():
        raise UsageError(f"DIR: expected a results directory, got {args.dir!r} (not a directory)")
    if not results_files(d):
        raise UsageError(f"DIR: expected results.jsonl or results-*.jsonl in {args.dir!r}, got none "
                         f"(write them with `kda-verify run --out {args.dir}` or `pytest -m verify --kda-report`)")
    from verification.errors import writable_dir
    writable_dir(d, "DIR")               # the report is written beside the results
    records = load_results(d)
    if not records:
        raise UsageError(f"DIR: expected at least one cell in the results files of {args.dir!r}, got none")
    paths = write_report(d, records=records)
    print(summarize(records)["headline"])          # the same headline as `run` and the report
    print(f"report: {paths['md']}\n        {paths['html']}\n        {paths['json']}")
    for name, p in paths["plots"].items():
        print(f"plot:   {p}")
    return 0
