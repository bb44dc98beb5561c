"""`kda-verify selfcheck`: the oracle against itself, NumPy and mpmath (non-zero exit on any FAIL)."""
from __future__ import annotations

import json
import sys

from verification.judging.policy import exit_code

NAME = "selfcheck"
HELP = "verify the float64 oracle: its forms against each other, NumPy, mpmath, and its inverses' residuals"
EXAMPLES = """\
kda-verify selfcheck --quick
kda-verify selfcheck --json --device cuda   # needs: cuda
"""


def add_arguments(parser):
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    parser.add_argument("--quick", action="store_true", help="one seed per recipe instead of four")
    parser.add_argument("--device", default=None, metavar="DEVICE",
                        help="device of the float64 oracle, cpu or cuda[:N] (default: cuda if available, else cpu)")


def run(args) -> int:
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.running.devices import check_device
    from verification.investigating.selfcheck import format_table, selfcheck_report

    args.device = check_device(args.device)
    rep = selfcheck_report(quick=args.quick, device=args.device)
    rows = rep.pop("_rows")
    if args.json:
        json.dump(rep, sys.stdout, indent=1)
        print()
    else:
        print(format_table(rows))
        nfail = sum(not r.passed for r in rows)
        print(f"\n{len(rows)} checks, {nfail} failed, {rep['seconds']:.1f} s on {args.device}: "
              f"{'PASS' if rep['passed'] else 'FAIL'}")
    return exit_code(failed=not rep["passed"])
