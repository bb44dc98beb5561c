"""`kda-verify shrink`: reduce a failing cell to the smallest problem that fails the same way.

    kda-verify shrink --backend B --route R --case ID --out DIR [--max-runs N] [--device D] [--isolate]
    kda-verify shrink --from-results RUNDIR --cell KEY --out DIR

The cell is run and judged as ``kda-verify run`` judges it; while it fails, the problem is
reduced (verification/investigating/shrink.py) and DIR receives the bundle (verification/reporting/bundle.py):
problem / truth / outputs safetensors, repro.py, REPORT.md, shrink.json; repro.py is run once
in a fresh process from another directory and the outcome printed (and stated in REPORT.md).
Exit 0 with a shrunk failing problem written, 1 when the cell passes (nothing to shrink), 2 on bad input
(an unknown case or route, a backend that cannot run, a cell that is skipped here).

    kda-verify shrink --suite serving --backend A --route R [--decode-backend B] --decode-route R2
                      --case serving/ID --out DIR [--max-runs N] [--device D]

A serving cell (the run --suite serving repro line's options) is shrunk to the fewest steps,
requests, rows, tokens and heads whose trace still fails the same way (a write outside the step's
slots, o drift, slot drift, a raise: verification/serving/shrink.py); DIR receives a trace dump of
the shrunk trace (kda-verify check DIR judges it), truth.safetensors, repro.py (REPRODUCED / NOT
REPRODUCED, run once in a fresh process), REPORT.md and shrink.json.  --from-results takes a
serving cell's key as well.
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

from verification.errors import UsageError

NAME = "shrink"
HELP = "reduce a failing cell to its smallest failing problem and write an upstream-ready bundle"
EXAMPLES = """\
kda-verify shrink --backend emulator-bad --route wrong_L_sign --case smoke/initial-state-kv-lb-5 --out shrunk/wrong-L
kda-verify shrink --backend aiter --route triton:seg --case stress/empty-seq-middle --out shrunk/aiter-empty --isolate   # needs: cuda, aiter
kda-verify shrink --from-results runs/bad --cell 'emulator-bad|wrong_L_sign|smoke/initial-state-kv-lb-5' --out shrunk/a
kda-verify shrink --suite serving --backend emulator --route flashkda --decode-backend emulator-bad --decode-route pad-writes-slot0 --case serving/pad-null0 --out shrunk/pad0
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
    p.add_argument("--suite", default=None, metavar="SUITE", help="serving (the only one): shrink a serving cell (a trace)")
    p.add_argument("--decode-backend", default=None, metavar="BACKEND",
                   help="with --suite serving: the decode side's backend (default: --backend)")
    p.add_argument("--decode-route", default=None, metavar="ROUTE",
                   help="with --suite serving: the decode side's trace route")


def _from_results(args):
    """(backend spec, route, case id, fuzz n, fuzz seed) of a cell in a results directory."""

    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.errors import UsageError
    from verification.judging.record import RESULTS_FILE, read_records
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
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.errors import UsageError
    from verification.errors import writable_dir

    if args.from_results and not args.suite:

        # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
        from verification.judging.record import RESULTS_FILE, read_records
        path = Path(args.from_results) / RESULTS_FILE
        if path.is_file() and args.cell and any(r.get("key") == args.cell and r.get("suite") == "serving"
                                                for r in read_records(path)):
            rec = [r for r in read_records(path) if r.get("key") == args.cell][-1]
            parts = shlex.split(rec.get("repro", ""))
            opt = {parts[i]: parts[i + 1] for i in range(len(parts) - 1) if parts[i].startswith("--")}
            args.suite, args.backend, args.route, args.case = "serving", opt.get("--backend"), opt.get("--route"), rec["case"]
            args.decode_backend, args.decode_route, args.from_results = opt.get("--decode-backend"), opt.get("--decode-route"), None
    if args.suite is not None or args.decode_backend or args.decode_route:
        return run_serving(args)
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
    max_runs = _max_runs(args)
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
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.running.cases import get_case
    case = get_case(case_id, n=fuzz_n, seed=fuzz_seed)
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.running.selection import setup_interpreter
    from verification.running.devices import check_device
    from verification.running.run_cell import use_device
    from verification.running.run_select import load, resolve_routes
    device = check_device(args.device)
    out = writable_dir(args.out, "--out")
    note = setup_interpreter([spec], device)
    if note:
        print(note, file=sys.stderr)
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from kda_kernels.base import BackendError
    from verification.judging.tolerances import load_tolerances
    db = load_tolerances(args.tolerances)
    lb = load(spec)
    if not lb.available:
        raise BackendError(f"--backend: {lb.name} cannot run here: {lb.reason}")
    route = resolve_routes(lb, [route_name])[0]
    use_device(device)
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.reporting.bundle import write_bundle
    from verification.investigating.shrink import Shrinker, shape_text, size

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


def run_serving(args) -> int:
    """shrink of a serving cell (module docstring)."""
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.running.devices import check_device
    from verification.errors import UsageError, writable_dir
    from verification.serving.cells import baseline_pairing, one_pairing
    from verification.serving.command import select_serving_cases
    from verification.serving.execute import Pairing, Side, pairing_refusal
    from verification.serving.shrink import TraceShrinker, describe_size, shrink_command, write_trace_bundle
    from verification.judging.tolerances import load_tolerances

    if args.suite != "serving":
        raise UsageError(f"--suite: expected serving (the only suite shrink takes by name), got {args.suite!r}")
    for name, val in (("--backend", args.backend), ("--route", args.route), ("--decode-route", args.decode_route),
                      ("--case", args.case)):
        if not val:
            raise UsageError(f"{name}: expected with --suite serving (the options of the cell's repro line), got none")
    for name, val in (("--isolate", args.isolate), ("--fuzz-n", args.fuzz_n), ("--fuzz-seed", args.fuzz_seed)):
        if val:
            raise UsageError(f"{name}: expected without --suite serving, got it")
    max_runs = _max_runs(args)
    case = select_serving_cases([args.case], long=True)[0]
    device = check_device(args.device)
    la, lb, rp, rd = one_pairing(args.backend, args.decode_backend, args.route, args.decode_route)
    pairing = Pairing(Side(la.backend, rp), Side(lb.backend, rd))
    tr = case.build()
    why = pairing_refusal(tr, pairing)
    base, why2 = baseline_pairing(rp, rd)
    if why or why2:
        raise UsageError(f"--case: {la.name}:{rp.name} + {lb.name}:{rd.name} on {case.id} is not applicable here, so "
                         f"there is no failure to shrink: {why or why2}")
    out = writable_dir(args.out, "--out")
    db = load_tolerances(args.tolerances)
    print(f"shrink prefill {la.name}:{rp.name}, decode {lb.name}:{rd.name} on {case.id} ({device}), at most "
          f"{max_runs} runs")
    sh = TraceShrinker(pairing, base, db, device=device, log=print)
    res = sh.shrink(tr, max_runs=max_runs)
    if not res.original.signature.failing:
        print(f"{case.id}: {res.original.result.status}: {res.original.result.reason[:300]}")
        print("the cell does not fail: nothing to shrink")
        return 1
    command = shrink_command(la, lb, rp, rd, case.id)
    data = write_trace_bundle(out, res, la, lb, rp, rd, case.id, device, command)
    print(f"{describe_size(res.original.trace)} -> {describe_size(res.final.trace)}, {len(res.trace)} steps, "
          f"{res.runs} runs, {res.seconds:.1f} s ({res.stopped})")
    print(f"still fails: {res.final.signature.describe()}: {res.final.result.reason[:300]}")
    print(f"bundle: {out}/ (REPORT.md, repro.py, trace dump, truth.safetensors)")
    rc = data["repro_check"]
    print(f"repro.py in a fresh process: exit {rc['exit']}: " + (
          rc["last_line"] if rc["reproduced"] else f"did NOT reproduce ({rc['last_line']})"))
    return 0


def _max_runs(args) -> int:
    """--max-runs as an integer >= 1 (a UsageError naming it otherwise)."""
    try:
        max_runs = int(args.max_runs)
    except ValueError:
        max_runs = 0
    if max_runs < 1:
        raise UsageError(f"--max-runs: expected an integer >= 1, got {args.max_runs!r}")
    return max_runs
