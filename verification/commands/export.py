"""kda-verify export: write a case's inputs as a problem file, to run a kernel on another
machine (a gfx950 or gfx1250 box, say) and judge its outputs here with `kda-verify check`.
``--suite S[,S]`` writes every case of the suites (``--skip-long`` leaves out the long ones)
into the directory --out, one file per case: SUITE__NAME.safetensors."""
from __future__ import annotations
from pathlib import Path

from verification.judging.policy import exit_code

NAME = "export"
HELP = "write the inputs of a case (e.g. stress/weak-gate-lb-0.01) as a problem file (.safetensors)"
EXAMPLES = """\
kda-verify export --case stress/weak-gate-lb-0.01 --out p.safetensors
kda-verify export --case smoke/dense-T64-lb-5 --case smoke/paged-lb-5 --out problems/
kda-verify export --case fuzz/fuzz0-007 --fuzz-n 200 --out p.safetensors
kda-verify export --suite smoke,stress --skip-long --out problems/
"""


def add_arguments(p):
    p.add_argument("--case", action="append", metavar="ID",
                   help="case id (repeatable; with several, --out is a directory)")
    p.add_argument("--suite", metavar="SUITE", help="every case of these suites (comma-separated); --out is a directory")
    p.add_argument("--skip-long", action="store_true", help="with --suite: leave out the long cases")
    p.add_argument("--fuzz-n", metavar="N", help="for a fuzz case id: the n of its draw (the run's --fuzz-n; default 20)")
    p.add_argument("--fuzz-seed", metavar="SEED",
                   help="for a fuzz case id: the seed of its draw (default: the S of fuzzS-i)")
    p.add_argument("--out", required=True, metavar="PATH", help="output file, or directory for several cases")


def run(args) -> int:

    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.running.cases import get_case
    from verification.errors import writable_dir, writable_file
    from verification.reporting.problem_file import save_problem

    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.errors import UsageError
    if not args.case and not args.suite:
        raise UsageError("--case: expected a case id (or --suite SUITE[,SUITE]), got none")
    # an unknown id is a one-line error naming --case (a fuzz id past the draw's n names --fuzz-n)
    cases = [get_case(cid, n=args.fuzz_n, seed=args.fuzz_seed) for cid in (args.case or [])]
    if args.suite:
        # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
        from verification.running.cases import get_suite
        from verification.running.selection import fuzz_args, split_list
        suites = split_list([args.suite])
        n, seed = fuzz_args(args, suites + (["fuzz"] if any(c.suite == "fuzz" for c in cases) else []))
        for s in suites:
            opts = {"n": n, "seed": seed} if s == "fuzz" else {}
            cases += [c for c in get_suite(s, long=not args.skip_long, **opts) if c not in cases]
    out = Path(args.out)
    if len(cases) == 1 and not out.is_dir() and not args.suite:
        targets = [writable_file(out, "--out")]
    else:
        writable_dir(out, "--out")
        targets = [out / (c.id.replace("/", "__") + ".safetensors") for c in cases]
    for c, path in zip(cases, targets):
        save_problem(str(path), c.build(device="cpu"))
        print(f"{c.id} -> {path}")
    return exit_code()
