"""kda-verify debug: one pass (or every pass) of a route against the oracle, with the first
(sequence, head, chunk or segment, row) whose error exceeds its threshold."""
from __future__ import annotations

import json
import sys

NAME = "debug"
HELP = "run one pass of a backend's route on oracle-fed inputs and show where the error enters"
EXAMPLES = """\
kda-verify debug --backend triton --route seg:cps=4 --case stress/weak-gate-lb-0.01 --pass all
kda-verify debug --backend triton --route unseg --inputs p.safetensors --pass K1 --taps
kda-verify debug --backend fla --route chunk:safe_gate --case smoke/paged-lb-5 --pass h,o --json   # needs: cuda, fla
"""


def add_arguments(p):
    p.add_argument("--backend", required=True, metavar="BACKEND", help="built-in name or package.module:factory")
    p.add_argument("--route", required=True, metavar="ROUTE", help="route name (see kda-verify backends)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--case", metavar="ID", help="case id, e.g. stress/one-chunk-per-segment-lb-0.1")
    src.add_argument("--inputs", metavar="PATH", help="a problem file (.safetensors)")
    p.add_argument("--fuzz-n", metavar="N", help="for a fuzz case id: the n of its draw (the run's --fuzz-n; default 20)")
    p.add_argument("--fuzz-seed", metavar="SEED",
                   help="for a fuzz case id: the seed of its draw (default: the S of fuzzS-i)")
    p.add_argument("--pass", dest="passes", default="all", metavar="PASS",
                   help="the pass to run: K1, A, B, C (FlashKDA-style) or gate, intra, h, o (fla), or all; "
                        "comma list allowed (default all)")
    p.add_argument("--device", default=None, metavar="DEVICE", help="cpu or cuda[:N] (default: cuda if available, else cpu)")
    p.add_argument("--threshold", action="append", default=[], metavar="TENSOR=VALUE",
                   help="override a row-error threshold, e.g. ws_inv=1e-2")
    p.add_argument("--taps", action="store_true",
                   help="hold K1's stored inverse to the verdict's ws_inv rule too, as a run with taps is judged "
                        "(backends that return taps: triton)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def run(args) -> int:
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from kda_kernels.base import LooksUpRoutes, ReturnsTaps, RunsPasses, load_backend
    from verification.errors import UsageError
    from verification.judging.policy import exit_code
    from verification.investigating.debug import THRESHOLDS, debug_passes, format_reports, reports_to_json

    thresholds = {}
    for item in args.threshold:
        name, _, val = item.partition("=")
        if name not in THRESHOLDS:
            raise UsageError(f"--threshold: expected TENSOR=VALUE with TENSOR in {', '.join(THRESHOLDS)}, got {item!r}")
        try:
            thresholds[name] = float(val)
        except ValueError:
            raise UsageError(f"--threshold: expected a number after {name}=, got {val!r}") from None
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.running.devices import check_device
    device = check_device(args.device)
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.running.selection import setup_interpreter
    note = setup_interpreter([args.backend], device)   # the triton backend without CUDA: the interpreter
    if note:
        print(f"kda-verify debug: {note}", file=sys.stderr)
    backend = load_backend(args.backend)
    if not isinstance(backend, RunsPasses):
        raise UsageError(f"--backend: expected a backend with passes (triton, aiter, fla), got {args.backend!r}, "
                         f"which exposes none (no run_pass / debug_plan)")
    if args.taps:
        if not isinstance(backend, ReturnsTaps):
            raise UsageError(f"--taps: expected a backend that returns taps (triton), got {args.backend!r}")
        backend = backend.with_taps(True)
    ok, why = backend.available()
    if not ok:
        raise UsageError(f"--backend: {args.backend} cannot run here: {why}")
    routes = {r.name: r for r in backend.routes()}
    route = routes.get(args.route)
    if route is None and isinstance(backend, LooksUpRoutes):
        route = backend.route(args.route)   # canonicalises or raises a one-line error
    if route is None:
        raise UsageError(f"--route: expected one of {', '.join(routes)}, got {args.route!r}")
    if args.case:
        # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
        from verification.running.cases import get_case
        problem, label = get_case(args.case, n=args.fuzz_n, seed=args.fuzz_seed).build(device=device), args.case
    else:
        # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
        from verification.reporting.problem_file import load_problem
        problem, label = load_problem(args.inputs).to(device), args.inputs
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from kda_kernels.base import applicable
    ok, why = applicable(backend, problem, route)
    if not ok:
        raise UsageError(f"--case: {why}")
    passes = [x.strip() for x in args.passes.split(",") if x.strip()]
    try:
        reports = debug_passes(backend, problem, route, passes, thresholds)
    except ValueError as e:
        if str(e).startswith("--"):          # the library's message names the argument: bad input
            raise UsageError(str(e)) from None
        raise
    if args.json:
        print(json.dumps(reports_to_json(reports), indent=1))
    else:
        print(format_reports(reports, header=f"{backend.name} {route.name} on {label}: {problem.describe()}"))
    return exit_code(failed=not all(r.ok for r in reports))
