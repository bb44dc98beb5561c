"""`kda-verify findings`: the findings register (tolerances.yaml's known_failures) as a table.

Each row: backend / route, case glob and parameter conditions, the library version or commit
it was seen on, why it fails, the evidence, and the `kda-verify shrink` command that
reproduces it (verification/reporting/findings.py).  For a terminal by default: lines of at most 100
characters (a reason or evidence cut to 200 characters, with a pointer to its tolerances.yaml
line), each reproduce command whole on a line of its own; the whole register as the markdown
table of docs/findings.md with --markdown, as JSON with --json.
"""
from __future__ import annotations

NAME = "findings"
HELP = "print the findings register (known failures, where seen, why, evidence, the command that reproduces)"
EXAMPLES = """\
kda-verify findings
kda-verify findings --markdown
kda-verify findings --json
kda-verify findings --tolerances my-tolerances.yaml
"""


def add_arguments(p):
    g = p.add_mutually_exclusive_group()
    g.add_argument("--markdown", action="store_true", help="print the whole register as docs/findings.md's markdown table")
    g.add_argument("--json", action="store_true", help="print the register as JSON")
    p.add_argument("--tolerances", default=None, metavar="FILE", help="tolerance file (default: tolerances.yaml)")


def run(args) -> int:
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.reporting.findings import as_json, markdown, rows, terminal
    from verification.judging.tolerances import load_tolerances

    items = rows(load_tolerances(args.tolerances))
    print(as_json(items) if args.json else markdown(items) if args.markdown else terminal(items))
    return 0
