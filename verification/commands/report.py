"""`kda-verify report DIR`: report.md, report.html (self-contained), report.json and plots/*.png
from DIR/results.jsonl (and the per-worker DIR/results-*.jsonl of a pytest-xdist run).

`kda-verify report DIR1 DIR2 ... --out OUT`: the cells of several results directories (a suite
run in parts, a run resumed on another machine) merged, the latest record of each cell winning,
written to OUT/results.jsonl with every invocation's provenance in OUT/run.json, and the report
of the merge in OUT."""
from __future__ import annotations

from pathlib import Path

from verification.judging.policy import exit_code

NAME = "report"
HELP = "write report.md, report.html, report.json and plots from a results directory"
EXAMPLES = """\
kda-verify report runs/emu
kda-verify report runs/emu runs/bad --out runs/merged
"""


def add_arguments(p):
    p.add_argument("dirs", metavar="DIR", nargs="+",
                   help="a results directory written by `kda-verify run` or --kda-report (several: merged, with --out)")
    p.add_argument("--out", metavar="OUT", default=None,
                   help="where the merge of several DIRs goes: OUT/results.jsonl, OUT/run.json and the report")


def run(args) -> int:
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.errors import UsageError, writable_dir
    from verification.judging.record import RESULTS_FILE, record_line
    from verification.reporting.report_load import load_results, merge_provenance, results_files
    from verification.reporting.report_render import write_report

    for shown in args.dirs:
        d = Path(shown)
        if not d.is_dir():
            raise UsageError(f"DIR: expected a results directory, got {shown!r} (not a directory)")
        if not results_files(d):
            raise UsageError(f"DIR: expected results.jsonl or results-*.jsonl in {shown!r}, got none "
                             f"(write them with `kda-verify run --out {shown}` or `pytest -m verify --kda-report`)")
    if len(args.dirs) > 1 and args.out is None:
        raise UsageError(f"--out: expected a directory for the merge of {len(args.dirs)} results directories, got none")
    out = Path(args.out) if args.out is not None else Path(args.dirs[0])
    if args.out is not None and any(out.resolve() == Path(d).resolve() for d in args.dirs):
        raise UsageError(f"--out: expected a directory other than the DIRs merged, got {args.out!r}")
    writable_dir(out, "--out" if args.out is not None else "DIR")    # the report is written beside the results
    records = load_results(*args.dirs)
    if not records:
        raise UsageError(f"DIR: expected at least one cell in the results files of {', '.join(args.dirs)}, got none")
    if args.out is not None:
        held = results_files(out)
        if held:
            raise UsageError(f"--out: expected a directory without results files, got {args.out!r}, which holds "
                             f"{held[0].name}")
        (out / RESULTS_FILE).write_text("".join(record_line(rec) + "\n" for rec in records), encoding="utf-8")
        merge_provenance(args.dirs, out)
        print(f"merged {len(records)} cells of {len(args.dirs)} directories into {out / RESULTS_FILE}")
    paths = write_report(out, records=records)
    print(paths["headline"])          # the same headline as `run` and the report
    print(f"report: {paths['md']}\n        {paths['html']}\n        {paths['json']}")
    for name, p in paths["plots"].items():
        print(f"plot:   {p}")
    return exit_code()
