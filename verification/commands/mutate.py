"""kda-verify mutate: run the mutants of our Triton FlashKDA (verification/investigating/mutants.py) through
the harness and report, per mutant, killed or survived, by which metric and case, and whether
the per-pass debugger names the patched pass."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor, as_completed

from verification.judging.policy import exit_code

NAME = "mutate"
HELP = "mutation testing: run each mutant of our Triton FlashKDA through the harness (killed? localized?)"
EXAMPLES = """\
kda-verify mutate --list
kda-verify mutate --mutant tail_gate_not_zeroed --case smoke/varlen-tail33-lb-5 --json-out mutants.json
kda-verify mutate --device cuda --jobs 8 --json-out mutants-cuda.json   # needs: cuda
"""


def add_arguments(p):
    p.add_argument("--mutant", action="append", default=[], metavar="NAME",
                   help="a mutant of the catalogue (repeatable or a comma list; default: all); --list shows them")
    p.add_argument("--list", action="store_true", help="list the catalogue and exit")
    p.add_argument("--suite", default="smoke,stress", metavar="SUITES", help="comma list of suites (default smoke,stress)")
    p.add_argument("--case", action="append", default=[], metavar="GLOB",
                   help="only cases whose id matches (repeatable)")
    p.add_argument("--long", choices=("no", "yes"), default="no",
                   help="include the long cases (64k tokens; default no: the interpreter cannot run them)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="cpu: Triton's interpreter; cuda: compiled kernels on the GPU (default: cuda if available, "
                        "else cpu)")
    p.add_argument("--taps", choices=("yes", "no"), default="yes",
                   help="judge the ws_inv tap too (default yes)")
    p.add_argument("--timeout", type=float, default=900.0, metavar="SECONDS", help="seconds per mutant (default 900)")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="mutants run at once, each in its own child process (default 1; on a GPU the children "
                        "share it: compilation, not the kernels, is what takes the time)")
    p.add_argument("--json-out", metavar="PATH", help="also write the records as JSON to PATH")


def _names(values) -> list:
    return [n.strip() for v in values for n in v.split(",") if n.strip()]


def run(args) -> int:
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.running.cases import SUITES
    from verification.errors import UsageError
    from verification.investigating.mutants import CATALOGUE, by_name
    from verification.investigating.mutate import AnchorError, check_anchors, format_table, mutant_file, needs_attention, run_in_child

    if args.list:
        for m in CATALOGUE:
            eq = "  [equivalent]" if m.equivalent else ""
            print(f"{m.name:<38} {m.pass_name:<3} {mutant_file(m):<11} {m.what}{eq}")
        return exit_code()
    try:
        mutants = by_name(_names(args.mutant))
    except ValueError as e:
        raise UsageError(str(e)) from None
    suites = _names([args.suite])
    bad = [s for s in suites if s not in SUITES]
    if bad or not suites:
        raise UsageError(f"--suite: expected a comma list of {', '.join(SUITES)}, got {args.suite!r}")
    if args.json_out:
        # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
        from verification.errors import writable_file
        writable_file(args.json_out, "--json-out")
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.running.devices import check_device
    args.device = check_device(args.device)
    if args.timeout <= 0:
        raise UsageError(f"--timeout: expected a positive number of seconds, got {args.timeout}")
    try:
        check_anchors(mutants)
    except AnchorError as e:
        raise UsageError(str(e)) from None
    if args.jobs < 1:
        raise UsageError(f"--jobs: expected a number of processes >= 1, got {args.jobs}")

    def one(m):
        return run_in_child(m, suites, args.long == "yes", args.device, case_globs=args.case or None,
                            taps=args.taps == "yes", timeout_s=args.timeout)

    records = [None] * len(mutants)
    with ThreadPoolExecutor(max_workers=min(args.jobs, max(1, len(mutants)))) as pool:
        futures = {pool.submit(one, m): i for i, m in enumerate(mutants)}
        for done, fut in enumerate(as_completed(futures), 1):
            i = futures[fut]
            rec = records[i] = fut.result()
            where = f"{rec.get('metric')}, {rec.get('case')}" if rec.get("killed") else f"{rec.get('cells')} cells"
            print(f"[{done}/{len(mutants)}] {mutants[i].name}: {rec['outcome']} ({where}; "
                  f"localized: {rec.get('localized')}) {rec.get('seconds', 0):.1f} s", flush=True)
    print(format_table(records))
    if args.json_out:
        # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
        from verification.judging.record import encode as jsonable
        with open(args.json_out, "w") as f:
            json.dump(jsonable(dict(suites=suites, device=args.device, long=args.long == "yes",
                                    taps=args.taps == "yes", records=records)), f, indent=1, allow_nan=False)
    return exit_code(failed=any(needs_attention(r) for r in records))
