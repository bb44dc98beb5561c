"""`kda-verify calibrate`: measure a backend's routes on a suite and propose tolerance entries.

The rule and the proposal are verification/investigating/calibrate.py's (its docstring); this module parses
the arguments, prints the table and the diff, and writes --out.
"""
from __future__ import annotations

import sys
from pathlib import Path

from verification.commands.run import add_fuzz_arguments
from verification.judging.policy import exit_code

NAME = "calibrate"
HELP = "measure a backend's routes on a suite and propose tolerances (a diff; the file is never rewritten)"
EXAMPLES = """\
kda-verify calibrate --backend emulator --from-results runs/emu
kda-verify calibrate --backend triton --route seg --suite smoke --case smoke/dense-T64-lb-5 --out proposal.yaml
kda-verify calibrate --backend fla --suite smoke,stress --out proposal-fla.yaml   # needs: cuda, fla
"""


def add_arguments(p):
    p.add_argument("--backend", required=True, metavar="BACKEND", help="built-in name or package.module:factory")
    p.add_argument("--suite", action="append", metavar="SUITE", help="suite(s); repeatable or comma list")
    p.add_argument("--from-results", metavar="DIR", help="propose from the results.jsonl of an earlier run "
                   "(kda-verify run / pytest -m verify --kda-report DIR) instead of measuring again")
    p.add_argument("--route", action="append", metavar="ROUTE", help="routes (default: all); repeatable or comma list")
    p.add_argument("--case", action="append", metavar="ID", help="only cases matching (exact or glob)")
    add_fuzz_arguments(p)
    p.add_argument("--device", metavar="DEVICE", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--long", choices=("auto", "yes", "no"), default="auto", help="include long cases (auto: on CUDA)")
    p.add_argument("--headroom", type=float, default=2.0, metavar="FACTOR",
                   help="m = FACTOR times the worst observed ratio kernel/baseline, rounded up (default 2)")
    p.add_argument("--tolerances", metavar="PATH", help="the file to diff against (default: verification/judging/tolerances.yaml)")
    p.add_argument("--out", metavar="PATH", help="also write the proposed entries as a YAML file")


def run(args) -> int:
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.investigating.calibrate import (collect_groups, earlier_provenance, earlier_records, is_long,
                                                      measure, measured_where, proposal_diff, proposal_yaml, propose,
                                                      proposed_file)
    from verification.reporting import provenance
    from verification.running.selection import fuzz_args, select_cases, split_list
    from verification.running.devices import check_device
    from verification.errors import UsageError
    from verification.judging.tolerances import DEFAULT_PATH, load_tolerances, parse_tolerances

    if not (args.headroom >= 1.0):
        raise UsageError(f"--headroom: expected a number >= 1, got {args.headroom}")
    device = check_device(args.device)
    if not args.from_results:                    # the triton backend on a machine without CUDA: the interpreter
        # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
        from verification.running.selection import setup_interpreter
        note = setup_interpreter([args.backend], device)
        if note:
            print(f"kda-verify calibrate: {note}", file=sys.stderr)
    tol_path = Path(args.tolerances or DEFAULT_PATH)
    db = load_tolerances(str(tol_path))
    long = args.long == "yes" or (args.long == "auto" and device.startswith("cuda"))
    suites = split_list(args.suite)
    if args.from_results:
        records = earlier_records(args.from_results, args.backend, split_list(args.route), split_list(args.case))
        suites = sorted({r.get("suite", "?") for r in records}) or ["?"]
        long = any(is_long(r.get("case", "")) for r in records)      # what the records hold, not this machine
    else:
        if not suites:
            raise UsageError("--suite: expected at least one suite (or --from-results DIR), got none")
        fuzz_n, fuzz_seed = fuzz_args(args, suites)
        cases = select_cases(suites, split_list(args.case), long=long, fuzz_n=fuzz_n, fuzz_seed=fuzz_seed)
        records = measure(args.backend, cases, split_list(args.route), device)
    groups = collect_groups(records, db)
    counts: dict = {}
    for r in records:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print(f"calibrate: {len(records)} cells ({', '.join(f'{v} {k}' for k, v in sorted(counts.items()))}); "
          f"headroom {args.headroom:g}")
    for r in records:
        if r["status"] in ("error", "crashed"):
            print(f"  not measured: {r['backend']} {r['route']} {r['case']}: {r['reason'][:160]}")
    if not groups:
        raise UsageError("--backend/--suite: expected at least one cell that ran, got none "
                         "(every cell was skipped, crashed or errored; see above)")
    prov = provenance.collect(device=device)
    earlier = earlier_provenance(args.from_results) if args.from_results else None
    dev, day, commit = measured_where(prov, earlier, records, args.from_results)
    where = (f"{dev}, {day}, commit {commit}, "
             f"suite {'+'.join(suites)}{'' if long else ' (no long cases)'}")
    proposals = []
    print(f"\n{'entry':<40} {'cells':>5} {'worst ratio':>11} {'m now':>6} {'m new':>6} {'cap now':>8} {'cap new':>8}")
    for key, g in sorted(groups.items()):
        e = propose(g, args.headroom, where)
        proposals.append(e)
        now_m = f"{g.existing.m:g}" if g.existing else "-"
        now_cap = f"{g.existing.cap:g}" if g.existing else "-"
        flag = "  LOOSENS" if "note" in e else ("  new" if g.existing is None else "")
        print(f"{'/'.join(key):<40} {g.cells:>5} {g.worst_ratio:>11.3g} {now_m:>6} {e['m']:>6g} {now_cap:>8} "
              f"{e['cap']:>8g}{flag}")
        for bad in g.nonfinite[:5]:
            print(f"    non-finite error (no tolerance passes it): {bad}")
    text = tol_path.read_text()
    new_text = proposed_file(text, db, proposals)
    parse_tolerances(new_text, f"{tol_path} (proposed)")          # the proposal must itself be schema-valid
    print("\n" + (proposal_diff(text, new_text, tol_path) or "(no change proposed)\n"), end="")
    if args.out:
        header = (f"kda-verify calibrate proposal ({prov['time_utc']}): {prov['command']}\n"
                  f"Review, then copy the entries you accept into {tol_path.name}; loosening needs a note.")
        body = proposal_yaml(proposals, header)
        parse_tolerances(body, args.out)
        Path(args.out).write_text(body)
        print(f"proposal written to {args.out} ({tol_path} unchanged)", file=sys.stderr)
    return exit_code()
