"""`kda-verify shrink`: reduce a failing cell to the smallest problem that fails the same way.

    kda-verify shrink --backend B --route R --case ID --out DIR [--max-runs N] [--device D] [--isolate]
    kda-verify shrink --from-results RUNDIR --cell KEY --out DIR

The cell is run and judged as ``kda-verify run`` judges it; while it fails, the problem is
reduced (verification/shrink.py) and DIR receives the bundle (verification/bundle.py):
problem / truth / outputs safetensors, repro.py, REPORT.md, shrink.json; repro.py is run once
in a fresh process from another directory and the outcome printed (and stated in REPORT.md).
Exit 0 with a shrunk failing problem written, 1 when the cell passes (nothing to shrink), 2 on bad input
(an unknown case or route, a backend that cannot run, a cell that is skipped here).
"""
from __future__ import annotations

import shlex
import sys

NAME = "shrink"
HELP = "reduce a failing cell to its smallest failing problem and write an upstream-ready bundle"
EXAMPLES = """\
kda-verify shrink --backend emulator-bad --route wrong_L_sign --case smoke/initial-state-kv-lb-5 --out shrunk/wrong-L
kda-verify shrink --backend aiter --route triton:seg --case stress/empty-seq-middle --out shrunk/aiter-empty --isolate   # needs: cuda, aiter
kda-verify shrink --from-results runs/bad --cell 'emulator-bad|wrong_L_sign|smoke/initial-state-kv-lb-5' --out shrunk/a
"""


def add_arguments(p):
    p.add_argument("--backend", metavar="BACKEND", help="built-in name or package.module:factory")
    p.add_argument("--route", metavar="ROUTE", help="route name of the cell")
    p.add_argument("--case", metavar="ID", help="case id, e.g. stress/empty-seq-middle")
    p.add_argument("--from-results", metavar="PATH", help="a run's results directory (with results.jsonl)")
    p.add_argument("--cell", metavar="KEY", help="with --from-results: the cell key backend|route|case")
    p.add_argument("--out", required=True, metavar="PATH", help="directory to write the bundle into")
    p.add_argument("--max-runs", default="200", metavar="N", help="at most this many cell runs (default 200)")
    p.add_argument("--fuzz-n", metavar="N", help="for a fuzz case id: the n of its draw")
    p.add_argument("--fuzz-seed", metavar="SEED", help="for a fuzz case id: the seed of its draw")
    p.add_argument("--device", default=None, metavar="DEVICE",
                   help="device to run on (default: cuda if available, else cpu)")
    p.add_argument("--tolerances", default=None, metavar="FILE", help="tolerance file (default: tolerances.yaml)")
    p.add_argument("--isolate", action="store_true",
                   help="run each cell in a child process (as run --isolate): a kernel that kills it is a crash")
    p.add_argument("--timeout", default=None, metavar="SECONDS",
                   help="with --isolate: a cell running longer is killed and counts as crashed")


def _from_results(args):
    """(backend spec, route, case id, fuzz n, fuzz seed) of a cell in a results directory."""
    from pathlib import Path

    from verification.errors import UsageError
    from verification.record import RESULTS_FILE, read_records
    if not args.cell:
        raise UsageError("--cell: expected a cell key backend|route|case with --from-results, got none")
    path = Path(args.from_results) / RESULTS_FILE
    if not path.is_file():
        raise UsageError(f"--from-results: expected a results directory holding {RESULTS_FILE}, got "
                         f"{args.from_results!r} (no {path})")
    recs = [r for r in read_records(path) if r.get("key") == args.cell]
    if not recs:
        keys = sorted({r.get("key", "") for r in read_records(path)})
        raise UsageError(f"--cell: expected a key of {path} (e.g. {keys[0] if keys else 'none there'}), "
                         f"got {args.cell!r}")
    rec = recs[-1]
    parts = shlex.split(rec.get("repro", ""))
    opt = {parts[i]: parts[i + 1] for i in range(len(parts) - 1) if parts[i].startswith("--")}
    return (rec.get("backend_spec") or rec["backend"], rec["route"], rec["case"], opt.get("--fuzz-n"),
            opt.get("--fuzz-seed"))


def run(args) -> int:
    from verification.errors import UsageError
    from verification.errors import writable_dir

    if args.from_results:
        if args.backend or args.route or args.case:
            raise UsageError("--from-results: expected without --backend/--route/--case (the cell key names them), "
                             "got both")
        spec, route_name, case_id, fuzz_n, fuzz_seed = _from_results(args)
    else:
        for name, val in (("--backend", args.backend), ("--route", args.route), ("--case", args.case)):
            if not val:
                raise UsageError(f"{name}: expected with --case (or give --from-results DIR --cell KEY), got none")
        spec, route_name, case_id, fuzz_n, fuzz_seed = args.backend, args.route, args.case, args.fuzz_n, args.fuzz_seed
    try:
        max_runs = int(args.max_runs)
    except ValueError:
        max_runs = 0
    if max_runs < 1:
        raise UsageError(f"--max-runs: expected an integer >= 1, got {args.max_runs!r}")
    timeout = None
    if args.timeout is not None:
        try:
            timeout = float(args.timeout)
        except ValueError:
            timeout = -1.0
        if not timeout > 0:
            raise UsageError(f"--timeout: expected a number of seconds > 0, got {args.timeout!r}")
        if not args.isolate:
            raise UsageError("--timeout: expected together with --isolate, got it alone")
    from verification.cases import get_case
    case = get_case(case_id, n=fuzz_n, seed=fuzz_seed)
    from verification.selection import setup_interpreter
    from verification.devices import check_device
    from verification.run_cell import use_device
    from verification.run_select import load, resolve_routes
    device = check_device(args.device)
    out = writable_dir(args.out, "--out")
    note = setup_interpreter([spec], device)
    if note:
        print(note, file=sys.stderr)
    from kda_kernels.base import BackendError
    from verification.tolerances import load_tolerances
    db = load_tolerances(args.tolerances)
    lb = load(spec)
    if not lb.available:
        raise BackendError(f"--backend: {lb.name} cannot run here: {lb.reason}")
    route = resolve_routes(lb, [route_name])[0]
    use_device(device)
    from verification.bundle import write_bundle
    from verification.shrink import Shrinker, shape_text, size

    print(f"shrink {lb.name}/{route.name} on {case.id} ({device}), at most {max_runs} runs")
    sh = Shrinker(lb, route, db, device=device, log=print, isolate=args.isolate, timeout_s=timeout,
                  tolerances_path=args.tolerances)
    res = sh.shrink(case, max_runs=max_runs)
    first = res.original
    st = first.record.get("status")
    if not first.signature.failing:
        if st in ("skipped", "out-of-contract", "resource-error"):
            raise UsageError(f"--case: {lb.name}/{route.name} on {case.id} is {st} here, so there is no failure to "
                             f"shrink: {first.record.get('reason', '')[:300]}")
        print(f"{lb.name}/{route.name} on {case.id}: {st}: {first.record.get('reason', '')[:300]}")
        print("the cell does not fail: nothing to shrink")
        return 1
    argv = ["kda-verify", "shrink", "--backend", lb.spec, "--route", route.name, "--case", case.id]
    if case.suite == "fuzz" and getattr(case, "suite_opts", None):
        argv += ["--fuzz-n", str(case.suite_opts["n"]), "--fuzz-seed", str(case.suite_opts["seed"])]
    if args.isolate:
        argv += ["--isolate"] + (["--timeout", str(args.timeout)] if args.timeout else [])
    argv += ["--out", "."]                     # as REPORT.md gives it: from the bundle's directory, into it
    command = " ".join(shlex.quote(a) for a in argv)
    data = write_bundle(out, res, lb, route, case, device, command)
    print(f"{shape_text(first.problem)} -> {shape_text(res.final.problem)} (size {size(first.problem)} -> "
          f"{size(res.final.problem)}), {len(res.trace)} steps, {res.runs} runs, {res.seconds:.1f} s ({res.stopped})")
    print(f"still fails: {res.final.signature.describe()}")
    have = "problem/truth/outputs" if (out / "outputs.safetensors").exists() else "problem/truth (no outputs: a crash)"
    print(f"bundle: {out}/ (REPORT.md, repro.py, {have}.safetensors)")
    rc = data["repro_check"]
    print(f"repro.py in a fresh process: exit {rc['exit']}: " + (
          (rc["last_line"] if rc["last_line"].startswith("REPRODUCED") else "REPRODUCED") if rc["reproduced"]
          else f"did NOT reproduce ({rc['last_line']})"))
    return 0
