"""`kda-verify capture`: run one backend route on a problem file and save its outputs.

    kda-verify capture --backend B [--route R] --inputs P --out O [--device D] [--taps]

The outputs file holds ``o`` and ``final_state`` (or ``state_cache``), and with ``--taps``
the stored inverse ``ws_inv`` when the backend returns it, so ``kda-verify check`` can judge
them on any machine.  Exit 0 when saved, 1 when the kernel raised (one line; the traceback in a
file), 2 on bad input or a backend that cannot run (nothing is created then).

    kda-verify capture --backend B --route R --inputs DIR --out OUT [--resume]

With a directory, every problem file DIR/NAME.safetensors (sorted by name) is run and its outputs
saved as OUT/NAME.safetensors; a problem the route does not accept is skipped with its reason
(OUT/NAME.skipped holds it), a kernel that raises leaves OUT/NAME.error (one line).  Each run
is bracketed by OUT/NAME.running, so a kernel that kills the process leaves it behind: with
``--resume`` finished problems are not run again and such a problem is marked OUT/NAME.crashed
(not retried) instead.  Exit 0 when every problem was captured or skipped, 1 when a kernel
raised or crashed, 2 on bad input (a bad problem file among them: one line naming it).

    kda-verify capture --suite serving --backend A [--route R] [--decode-backend B] [--decode-route R2]
                       (--case serving/ID | --inputs TRACE.safetensors) --out DIR [--device D]

A serving trace (a case of the serving suite, or a recorded trace file, kda-verify-trace/1) run
on one pairing (the first trace route of each side that fits, or the ones named) and saved as a
trace dump (verification/serving/dump.py, docs/traces.md "Dumps"): the trace, the initial
cache, per step and call o and the cache elements the call changed.  ``kda-verify check DIR``
judges it.  Exit 0 when saved, 1 when a call raised (the dump ends there, its manifest names the
call), 2 on bad input.
"""
from __future__ import annotations

import inspect
import sys
from pathlib import Path

NAME = "capture"
HELP = "run a backend route on a problem file and save its outputs (for kda-verify check)"
EXAMPLES = """\
kda-verify capture --backend triton --route seg --inputs p.safetensors --out o.safetensors
kda-verify capture --backend triton --route unseg --inputs p.safetensors --out o.safetensors --taps
kda-verify capture --backend emulator-bad --route carry_scaled --inputs problems/ --out outputs-bad/
kda-verify capture --backend aiter --route gluon:seg --inputs problems/ --out outputs/ --resume   # needs: cuda, aiter
kda-verify capture --suite serving --backend emulator --route flashkda --decode-route fla-recurrent --case serving/short-prompts --out dump/
kda-verify capture --suite serving --backend triton --route seg --decode-backend fla --decode-route fused_recurrent --case serving/pad-null0 --out dump-fla/   # needs: cuda, fla
"""


def add_arguments(p):
    p.add_argument("--backend", required=True, metavar="BACKEND", help="built-in name or package.module:factory")
    p.add_argument("--route", default=None, metavar="ROUTE", help="route name, or a short name the backend looks up as run does (triton: seg, unseg, "
                        "seg:cps=4; default: the backend's first route)")
    p.add_argument("--inputs", default=None, metavar="PATH",
                   help="problem file (kda-verify-problem/1), or a directory of them; with --suite serving a "
                        "trace file (kda-verify-trace/1)")
    p.add_argument("--out", required=True, metavar="PATH",
                   help="output file to write (kda-verify-outputs/1), or a directory with a directory --inputs")
    p.add_argument("--device", default=None, metavar="DEVICE", help="device to run on (default: cuda if available, else cpu)")
    p.add_argument("--taps", action="store_true", help="also save the ws_inv tap when the backend returns one")
    p.add_argument("--resume", action="store_true",
                   help="with a directory --inputs: skip problems whose outputs are already in --out")
    p.add_argument("--suite", default=None, metavar="SUITE",
                   help="serving (the only one): capture a serving trace as a trace dump directory (docs/traces.md, Dumps)")
    p.add_argument("--case", default=None, metavar="ID", help="with --suite serving: the serving case to run")
    p.add_argument("--decode-backend", default=None, metavar="BACKEND",
                   help="with --suite serving: the decode side's backend (default: --backend)")
    p.add_argument("--decode-route", default=None, metavar="ROUTE",
                   help="with --suite serving: the decode side's trace route (default: its first)")


def backend_route_device(args):
    """(backend, route, device) of a capture: --backend loaded and available, --route among its
    routes (default its first), --device or cuda if available, else cpu; one line otherwise."""
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from kda_kernels.base import BackendError, LooksUpRoutes, load_backend
    from verification.running.devices import check_device
    from verification.errors import UsageError
    from verification.running.selection import setup_interpreter
    device = check_device(args.device)
    note = setup_interpreter([args.backend], device)   # the triton backend without CUDA: the interpreter
    if note:
        print(f"kda-verify capture: {note}", file=sys.stderr)
    backend = load_backend(args.backend)
    ok, why = backend.available()
    if not ok:
        raise BackendError(f"--backend: {backend.name} cannot run here: {why}")
    routes = backend.routes()
    if not routes:
        raise BackendError(f"--backend: {backend.name} has no routes here")
    if args.route is None:
        route = routes[0]
    else:
        match = [r for r in routes if r.name == args.route]
        if match:
            route = match[0]
        elif isinstance(backend, LooksUpRoutes):       # a short name ("seg", "seg:cps=4"), as run takes it
            try:
                route = backend.route(args.route)
            except (ValueError, KeyError) as e:
                raise UsageError(f"--route: backend {backend.name!r} cannot parse {args.route!r}: {e}") from None
        else:
            raise UsageError(f"--route: expected one of {', '.join(r.name for r in routes)}, got {args.route!r}")
    return backend, route, device


def run(args) -> int:

    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from kda_kernels.base import BackendError, ReturnsTaps
    from kda_ref.problem import validate
    from verification.errors import KernelFailure, UsageError
    from verification.judging.policy import exit_code
    from verification.reporting.problem_file import load_problem, save_outputs

    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.errors import writable_file

    if args.suite is not None or args.case or args.decode_backend or args.decode_route:
        return run_serving(args)
    if not args.inputs:
        raise UsageError("--inputs: expected a problem file or a directory of them (or --suite serving --case ID), "
                         "got none")
    if Path(args.inputs).is_dir():
        return run_dir(args)
    if args.resume:
        raise UsageError(f"--resume: expected with a directory --inputs, got the file {args.inputs!r}")
    backend, route, device = backend_route_device(args)
    writable_file(args.out, "--out")            # after the backend and route: a bad one creates nothing
    problem = validate(load_problem(args.inputs).to(device))
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from kda_kernels.base import applicable
    ok, why = applicable(backend, problem, route)
    if not ok:
        raise BackendError(f"--route: {backend.name}/{route.name} does not accept {args.inputs}: {why}")
    kwargs = {}
    if args.taps and "taps" in inspect.signature(backend.run).parameters:
        kwargs["taps"] = True
    elif args.taps and isinstance(backend, ReturnsTaps):
        backend = backend.with_taps(True)
    try:
        out = backend.run(problem, route, **kwargs)
    except Exception as e:  # noqa: BLE001 - the kernel raising is a kernel failure, not kda-verify's
        raise KernelFailure.of(e, f"{backend.name} {route.name}") from e
    tensors = {k: v.detach().cpu().contiguous() for k, v in out.tensors().items()}
    if args.taps and "ws_inv" in (out.taps or {}):
        tensors["ws_inv"] = out.taps["ws_inv"].detach().cpu().contiguous()
    meta = {"backend": backend.name, "route": route.name, "recipe": route.recipe, "device": str(device),
            "version": str(getattr(backend, "version", lambda: "")())}
    save_outputs(args.out, tensors, meta)
    print(f"saved {', '.join(sorted(tensors))} of {backend.name}/{route.name} on {device} to {args.out}")
    return exit_code()


# ----------------------------------------------------------------------------------------
# The directory form: every problem of a directory
# ----------------------------------------------------------------------------------------
def problem_files(inputs, arg: str = "--inputs") -> list:
    """The problem files of a directory (NAME.safetensors, sorted); a UsageError naming ``arg``
    when there are none."""

    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.errors import UsageError
    files = sorted(p for p in Path(inputs).glob("*.safetensors") if p.is_file())
    if not files:
        raise UsageError(f"{arg}: expected a directory holding problem files (*.safetensors, e.g. from "
                         f"kda-verify export --suite ... --out DIR), got {str(inputs)!r} with none")
    return files


def run_dir(args) -> int:
    """capture over a directory (module docstring)."""

    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from kda_kernels.base import ReturnsTaps
    from kda_ref.problem import ProblemError, validate
    from verification.errors import UsageError
    from verification.errors import writable_dir
    from verification.reporting.problem_file import load_outputs, load_problem, save_outputs

    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.judging.policy import exit_code

    files = problem_files(args.inputs)
    backend, route, device = backend_route_device(args)
    out_dir = writable_dir(args.out, "--out")      # after the backend and route: a bad one creates nothing
    # every problem file is read before any kernel runs: a bad one is bad input, named, exit 2
    problems = []
    for f in files:
        try:
            problems.append((f, load_problem(str(f))))
        except (UsageError, ProblemError) as e:
            raise UsageError(f"--inputs: {f.name}: {e}") from None
    counts = {"captured": 0, "resumed": 0, "skipped": 0, "raised": 0, "crashed": 0}
    meta = {"backend": backend.name, "route": route.name, "recipe": route.recipe, "device": str(device),
            "version": str(getattr(backend, "version", lambda: "")())}
    for f, prob in problems:
        stem = f.name[:-len(".safetensors")]
        target = out_dir / f.name
        running, crashed = out_dir / f"{stem}.running", out_dir / f"{stem}.crashed"
        if args.resume:
            if target.exists():
                try:
                    load_outputs(str(target))
                    counts["resumed"] += 1
                    continue
                except (UsageError, ProblemError):
                    pass                     # a partial file: run it again
            if running.exists() or crashed.exists():
                if running.exists():
                    running.replace(crashed)
                counts["crashed"] += 1
                print(f"{f.name}: crashed in an earlier attempt ({crashed.name}); not run again "
                      f"(delete {crashed} to retry)")
                continue
        for stale in (out_dir / f"{stem}.skipped", out_dir / f"{stem}.error", crashed):
            if stale.exists():
                stale.unlink()
        try:
            problem = validate(prob.to(device))
        except ProblemError as e:
            raise UsageError(f"--inputs: {f.name}: {e}") from None
        # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
        from kda_kernels.base import applicable
        ok, why = applicable(backend, problem, route)
        if not ok:
            (out_dir / f"{stem}.skipped").write_text(str(why) + "\n", encoding="utf-8")
            counts["skipped"] += 1
            print(f"{f.name}: skipped: {why}")
            continue
        kwargs = {}
        if args.taps and "taps" in inspect.signature(backend.run).parameters:
            kwargs["taps"] = True
        elif args.taps and isinstance(backend, ReturnsTaps):
            backend = backend.with_taps(True)
        running.write_text(f"{backend.name}/{route.name}\n", encoding="utf-8")
        try:
            out = backend.run(problem, route, **kwargs)
        except Exception as e:  # noqa: BLE001 - a kernel that raises is a result of this problem, recorded
            line = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:500]
            (out_dir / f"{stem}.error").write_text(line + "\n", encoding="utf-8")
            running.unlink()
            counts["raised"] += 1
            print(f"{f.name}: {backend.name}/{route.name} raised {line}")
            continue
        tensors = {k: v.detach().cpu().contiguous() for k, v in out.tensors().items()}
        if args.taps and "ws_inv" in (out.taps or {}):
            tensors["ws_inv"] = out.taps["ws_inv"].detach().cpu().contiguous()
        save_outputs(str(target), tensors, dict(meta, problem=f.name))
        running.unlink()
        counts["captured"] += 1
        print(f"{f.name}: saved {', '.join(sorted(tensors))} to {target}")
    print(f"{backend.name}/{route.name} on {device}: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v)
          + f" of {len(problems)} problems in {args.inputs}")
    return exit_code(failed=bool(counts["raised"] or counts["crashed"]))


# ----------------------------------------------------------------------------------------
# The serving form: a trace dump
# ----------------------------------------------------------------------------------------
def run_serving(args) -> int:
    """capture of a serving trace on one pairing (module docstring)."""
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from kda_ref.problem import ProblemError
    from kda_ref.trace import load_trace
    from verification.running.devices import check_device
    from verification.errors import UsageError, writable_dir
    from verification.judging.policy import exit_code
    from verification.serving.cells import one_pairing
    from verification.serving.command import select_serving_cases
    from verification.serving.dump import write_dump
    from verification.serving.execute import Pairing, Side, pairing_refusal

    if args.suite != "serving":
        raise UsageError(f"--suite: expected serving (the only suite capture runs as a trace), got {args.suite!r}")
    for name, val in (("--taps", args.taps), ("--resume", args.resume)):
        if val:
            raise UsageError(f"{name}: expected without --suite serving, got it")
    if bool(args.case) == bool(args.inputs):
        raise UsageError("--case: expected exactly one of --case serving/ID and --inputs TRACE.safetensors with "
                         f"--suite serving, got {'both' if args.case else 'neither'}")
    device = check_device(args.device)
    la, lb, rp, rd = one_pairing(args.backend, args.decode_backend, args.route, args.decode_route)
    if args.case:
        case = select_serving_cases([args.case], long=True)[0]
        tr, case_id, params = case.build(), case.id, dict(case.params)
    else:
        try:
            tr = load_trace(args.inputs)
        except ProblemError as e:
            raise UsageError(f"--inputs: {e}") from None
        case_id, params = f"serving/{Path(args.inputs).stem}", {}
    why = pairing_refusal(tr, Pairing(Side(la.backend, rp), Side(lb.backend, rd)))
    if why:
        raise UsageError(f"--case: {la.name}:{rp.name} + {lb.name}:{rd.name} cannot run {case_id}: {why}")
    out = writable_dir(args.out, "--out")
    man = write_dump(out, tr, la, lb, rp, rd, case_id, device=device,
                     params=params, log=print)
    print(f"saved a trace dump of {case_id} ({tr.describe()}) on prefill {la.name}:{rp.name}, decode "
          f"{lb.name}:{rd.name} ({device}): {man['steps']} steps to {out}/")
    if man["error"]:
        print(f"the kernel raised: {man['error']['message']}")
    return exit_code(failed=bool(man["error"]))
