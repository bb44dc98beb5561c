"""`kda-verify findings`: the findings register (tolerances.yaml's known_failures) as a table.

Each row: backend / route, case glob and parameter conditions, the library version or commit
it was seen on, why it fails, the evidence, and the `kda-verify shrink` command that
reproduces it (verification/findings.py).  Markdown by default, JSON with --json.
"""
from __future__ import annotations

NAME = "findings"
HELP = "print the findings register (known failures, where seen, why, evidence, the command that reproduces)"
EXAMPLES = """\
kda-verify findings
kda-verify findings --json
kda-verify findings --tolerances my-tolerances.yaml
"""


def add_arguments(p):
    p.add_argument("--json", action="store_true", help="print the register as JSON")
    p.add_argument("--tolerances", default=None, metavar="FILE", help="tolerance file (default: tolerances.yaml)")


def run(args) -> int:
    from verification.findings import as_json, markdown, rows
    from verification.tolerances import load_tolerances

    items = rows(load_tolerances(args.tolerances))
    print(as_json(items) if args.json else markdown(items))
    return 0
