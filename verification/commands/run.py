"""`kda-verify run`: the matrix backend x route x case, recorded as it goes, then the report.

Each finished cell is appended to DIR/results.jsonl at once (an interrupted run loses
nothing; --resume skips the finished cells, and refuses a selection other than the one DIR
records).  The headline says how many cells were judged: ``VERIFIED n of N cells: ...``, or
``NOTHING VERIFIED: N cells skipped (reason)``; after Ctrl-C the report is written with the
headline ``INTERRUPTED: k of n selected cells not run; ...`` and one line says so.  Every
option is checked (backends loaded, routes resolved, the resume's selection compared) before
--out is created: a refused run creates nothing.

Exit status (verification.judging.policy.exit_code): 0 when at least one cell was judged and every judged
cell passed (or is a listed known failure); 1 when any failed, was mistrusted, crashed or
errored; 2 on bad input or a bad environment, when the harness ran out of memory on a cell,
and when nothing was verified (every cell skipped: backend unavailable, case not applicable)
unless --allow-nothing-verified; 3 on an internal error; 130 when interrupted.

On a machine without CUDA, a run of the ``triton`` backend on the CPU turns on Triton's
interpreter (TRITON_INTERPRET=1) before Triton is first imported, and says so.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from kda_kernels.base import BUILTIN_BACKENDS
from verification.running.cases import SUITES
from verification.running.selection import fuzz_args, select_cases, setup_interpreter, split_list

NAME = "run"
HELP = "run every (backend, route, case) cell of the chosen suites and write the report"
EXAMPLES = """\
kda-verify run --backend triton --route seg --suite smoke --case smoke/dense-T64-lb-5 --out kda-runs/dense
kda-verify run --backend emulator --suite smoke --case 'smoke/dense-*' --out runs/dense
kda-verify run --backend emulator-bad --route carry_scaled --suite stress --case stress/weak-gate-lb-0.01 --out runs/controls   # exits 1: a negative control fails
kda-verify run --backend triton,fla --suite smoke,stress,default,k3-prefill --out runs/gpu   # needs: cuda, fla
kda-verify run --backend triton --route seg --suite long --case 'long/T16384-*' --out runs/long   # needs: cuda
kda-verify run --backend emulator --route flashkda --suite fuzz --fuzz-n 3 --fuzz-seed 1 --out runs/fuzz
kda-verify run --backend triton --route seg --suite stress --case 'stress/weak-gate-lb-0.0*' --out runs/weak
kda-verify run --backend emulator --suite smoke --out runs/r1 --resume --isolate --timeout 600 --max-cells 1
"""


def add_arguments(p):
    p.add_argument("--backend", action="append", required=True, metavar="BACKEND",
                   help=f"built-in name ({', '.join(BUILTIN_BACKENDS)}) or package.module:factory; "
                        "repeatable or comma-separated")
    p.add_argument("--route", action="append", metavar="ROUTE",
                   help="route name (default: every route of the backend); repeatable or comma-separated")
    p.add_argument("--suite", action="append", required=True, metavar="SUITE",
                   help=f"case suite ({', '.join(SUITES)}, serving); repeatable or comma-separated (serving alone)")
    p.add_argument("--case", action="append", metavar="ID",
                   help="only cases whose id matches (exact or shell glob, e.g. 'stress/weak-*'); repeatable")
    add_fuzz_arguments(p)
    p.add_argument("--decode-backend", action="append", metavar="BACKEND",
                   help="with --suite serving: the backend running the decode and spec calls (default: --backend, "
                        "which runs the prefill calls)")
    p.add_argument("--decode-route", action="append", metavar="ROUTE",
                   help="with --suite serving: decode trace routes (default: every trace route of the decode "
                        "backend running decode or spec calls); --route then picks the prefill routes")
    p.add_argument("--long", choices=("auto", "yes", "no"), default="auto",
                   help="include the suites' long cases (64k tokens, production shapes): auto = on CUDA only "
                        "(a case named by --case always runs)")
    p.add_argument("--out", required=True, metavar="DIR", help="results directory (results.jsonl, report.*)")
    p.add_argument("--resume", action="store_true", help="skip cells already recorded in DIR/results.jsonl "
                   "(the same backends, routes, suites, cases and fuzz draw as the run that wrote them)")
    p.add_argument("--isolate", action="store_true",
                   help="run each cell in a child process: a kernel that kills its process is recorded as crashed")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="with --isolate: a cell running longer is killed and recorded as crashed")
    p.add_argument("--device", metavar="DEVICE", help="torch device for problems, oracle and kernels "
                                                  "(default: cuda if available, else cpu)")
    p.add_argument("--max-cells", type=int, metavar="N", help="stop after running N cells (resume later)")
    p.add_argument("--tolerances", metavar="PATH", help="tolerances file (default: verification/judging/tolerances.yaml)")
    p.add_argument("--no-report", action="store_true", help="do not write the report at the end")
    p.add_argument("--allow-nothing-verified", action="store_true",
                   help="exit 0 when every cell was skipped (a CI job that expects an unavailable backend); "
                        "without it a run that judged no cell exits 2")
    p.add_argument("--guards", choices=("auto", "on", "off"), default="auto",
                   help="memory guards around every buffer of each cell (auto: on for CUDA devices)")
    p.add_argument("--no-cache", action="store_true",
                   help="compute every truth and baseline, neither reading nor writing kda-verify's disk cache "
                        "(verification/running/cache.py; the same as KDA_VERIFY_CACHE=off)")


def add_fuzz_arguments(p):
    """--fuzz-n / --fuzz-seed: the size and seed of the fuzz suite's draw (every command with --suite)."""
    p.add_argument("--fuzz-n", metavar="N", help="with --suite fuzz: how many cases to draw (default 20); a fuzz "
                   "case id (fuzz/fuzz0-123) names a case of one draw, so a rerun needs the same N and seed")
    p.add_argument("--fuzz-seed", metavar="SEED", help="with --suite fuzz: the seed of the draw (default 0)")


def run(args) -> int:
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.reporting import provenance
    from verification.running.cases import FUZZ_N, FUZZ_SEED
    from verification.errors import Interrupted, UsageError, writable_dir
    from verification.running.devices import check_device
    from verification.judging.record import cell_key
    from verification.running.run_matrix import run_matrix
    from verification.running.run_select import check_resume, load, plan

    started = time.perf_counter()
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.serving.command import SUITE, check_serving_args, run_serving
    check_serving_args(args, split_list(args.suite))
    if SUITE in split_list(args.suite):     # the serving suite pairs trace routes: its own loop (verification/serving)
        return run_serving(args)

    if args.max_cells is not None and args.max_cells < 1:
        raise UsageError(f"--max-cells: expected an integer >= 1, got {args.max_cells}")
    if args.timeout is not None and not args.timeout > 0:
        raise UsageError(f"--timeout: expected seconds > 0, got {args.timeout}")
    if args.timeout is not None and not args.isolate:
        raise UsageError(f"--timeout: expected together with --isolate (a cell is timed out by killing its child "
                         f"process), got --timeout {args.timeout:g} alone")
    device = check_device(args.device)
    backends = split_list(args.backend)
    if getattr(args, "no_cache", False):
        # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
        from verification.running.cache import turn_off
        turn_off()
    note = setup_interpreter(backends, device)
    if note:
        print(f"kda-verify run: {note}", file=sys.stderr)
    suites = split_list(args.suite)
    fuzz_n, fuzz_seed = fuzz_args(args, suites)
    long = args.long == "yes" or (args.long == "auto" and device.startswith("cuda"))
    cases = select_cases(suites, split_list(args.case), long=long, fuzz_n=fuzz_n, fuzz_seed=fuzz_seed)
    # --long picks cells only without --case, and only from suites that hold long cases
    long_picks = not split_list(args.case) and len(select_cases(suites, None, long=True, fuzz_n=fuzz_n,
                                                                fuzz_seed=fuzz_seed)) != len(
        select_cases(suites, None, long=False, fuzz_n=fuzz_n, fuzz_seed=fuzz_seed))
    if not long and not split_list(args.case):
        left_out = len(select_cases(suites, None, long=True, fuzz_n=fuzz_n, fuzz_seed=fuzz_seed)) - len(cases)
        if left_out:
            print(f"kda-verify run: {left_out} long case(s) of suite(s) {', '.join(suites)} left out on {device} "
                  f"(--long yes runs them here)", file=sys.stderr)
    db = None
    if args.tolerances:
        # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
        from verification.judging.tolerances import load_tolerances
        db = load_tolerances(args.tolerances)
    # every option checked before --out is made: a bad backend, route or resume creates nothing
    routes = split_list(args.route) or None
    loaded = [load(b) for b in backends]
    wanted = {cell_key(lb.name, r.name, c.id) for lb, r, c in plan(loaded, routes, cases)}
    selection = {"--backend": backends, "--route": routes, "--suite": suites, "--case": split_list(args.case)}
    if long_picks:
        selection["--long"] = "yes" if long else "no"
    if "fuzz" in suites:
        selection.update({"--fuzz-n": FUZZ_N if fuzz_n is None else fuzz_n,
                          "--fuzz-seed": FUZZ_SEED if fuzz_seed is None else fuzz_seed})
    check_resume(args.out, args.resume, selection, wanted)
    writable_dir(args.out, "--out")        # after the arguments: a bad one leaves no directory behind
    prov = provenance.collect(device=device, seeds={c.id: c.seed for c in cases})
    try:
        summary = run_matrix(loaded, cases, args.out, routes=routes,
                             resume=args.resume, isolate=args.isolate, device=device, max_cells=args.max_cells,
                             db=db, tolerances_path=args.tolerances, timeout_s=args.timeout, provenance=prov,
                             guards={"auto": None, "on": True, "off": False}[args.guards], selection=selection)
    except Interrupted as stop:            # Ctrl-C: the report of what was kept, then one line, exit 130
        summary = stop.summary
    except KeyboardInterrupt:              # before the cells began: nothing to report
        raise Interrupted(f"interrupted; finished cells are in {args.out}/results.jsonl "
                          f"(continue with --resume)") from None
    return finish(args, summary, started)


def finish(args, summary, started: float, reason_chars: int = 240, breakdown_line: bool = True) -> int:
    """The end of a ``run`` (the matrix or the serving suite): the headline, the failing cells with
    their repro lines, the report and the time breakdown, then Interrupted (exit 130) for a run
    Ctrl-C stopped, else the exit code of verification.judging.policy, with the nothing-verified line."""
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.errors import Interrupted
    from verification.judging.policy import exit_code, headline, nothing_verified_reason
    from verification.running.run_progress import clip_words
    print(f"{summary.ran} cells run, {summary.resumed} already done")
    print(headline(summary.records, summary.not_run or 0))
    if summary.stopped_early:
        print(f"stopped after --max-cells {args.max_cells}; continue with --resume")
    shown = 10
    for r in summary.failed[:shown]:
        print(f"  {r['status'].upper():<10} {r['backend']} {r['route']} {r['case']}: "
              f"{clip_words(r.get('reason', ''), reason_chars)}")
        print(f"             repro: {r.get('repro', '').replace('--out DIR', f'--out {args.out}/repro')}")
    if len(summary.failed) > shown:
        print(f"  ... and {len(summary.failed) - shown} more failing cells (see the report)")
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.running import timing
    sums = timing.record_sums(summary.fresh)
    if args.no_report:
        bd = timing.breakdown(sums, wall_s=time.perf_counter() - started)
    else:
        # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
        from verification.reporting.report_render import write_report
        paths = write_report(args.out, timing={"started": started, "sums": sums})
        bd = paths["timing"]
        print(f"report: {paths['md']} {paths['html']}")
    save_breakdown(args.out, bd)
    if breakdown_line:
        print("time breakdown (this invocation): " + "\n".join(timing.format_lines(bd)))
    if summary.not_run is not None:
        raise Interrupted(f"interrupted: {summary.not_run} of {summary.selected} selected "
                          f"cells not run; finished cells are in {args.out}/results.jsonl"
                          + ("" if args.no_report else f", report {args.out}/report.md") + " (continue with --resume)")
    statuses = [r.get("status") for r in summary.records]
    code = exit_code(statuses, allow_nothing_verified=args.allow_nothing_verified)
    why = nothing_verified_reason(summary.records)
    if why is not None and exit_code(statuses, allow_nothing_verified=True) == 0:    # judged nothing, failed nothing
        print(f"kda-verify run: nothing verified ({why}); exit 0 (--allow-nothing-verified)" if code == 0
              else f"kda-verify run: nothing verified: {why}", file=sys.stderr)
    return code


def save_breakdown(out_dir, bd: dict) -> None:
    """Keep the breakdown with this invocation's provenance in DIR/run.json (kda-verify report
    DIR shows it again)."""
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.judging.record import RUN_FILE
    from verification.judging.record import encode as jsonable
    p = Path(out_dir) / RUN_FILE
    try:
        data = json.loads(p.read_text())
        data["runs"][-1]["time_breakdown"] = jsonable(bd)
        p.write_text(json.dumps(data, indent=1, allow_nan=False))
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        pass
