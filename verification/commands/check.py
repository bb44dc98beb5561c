"""`kda-verify check`: judge outputs that any kernel produced anywhere against the oracle.

    kda-verify check --inputs P --outputs O --recipe R [--backend-name NAME] [--route NAME] [--json]

P is a problem file and O an output file (verification/reporting/problem_file.py).  The float64 truth of
P is computed here, the emulator recipe R gives the baseline, and the tolerances.yaml entry of
(NAME, route, input dtype, tensor) gives m, floor and cap.  A route of a backend kda-verify loads
is that backend's Route, its flags included, as run resolves it (``check_route``).  A ``ws_inv`` tensor in O (the
stored inverse, production layout) is judged too.  Prints a per-tensor table (or the verdict
as JSON); exit 0 pass, 1 fail or mistrusted, 2 bad input, an empty problem, not applicable
(no production recipe gives a sound baseline on this input) or out of contract (outside the
recipe's range, the numbers in the reason: nothing verified).  The verdict is
``verification.judging.verdict.judge`` with the same arguments as ``run`` gives it (cap lift included).

    kda-verify check --inputs DIR --outputs OUT [--recipe R] [--out RESULTS] [--resume]

With directories, every problem DIR/NAME.safetensors is judged against OUT/NAME.safetensors
(kda-verify capture's directory form) the same way, and each verdict is a cell record in
RESULTS/results.jsonl (default RESULTS = OUT) with the usual report (report.md / .html / .json);
the recipe, backend name and route default to those the outputs file records.  A problem
whose kernel raised in capture is an ``error`` cell (``crashed`` where capture left
NAME.crashed), one its route skipped (NAME.skipped) a skipped cell; a problem or outputs file
that cannot be read, or a problem with no outputs and no capture marker (bad input in the file
form), is that case's ``bad-input`` cell naming the file, and the rest are judged.
``--resume`` keeps the cells already in results.jsonl.
Exit 0 when every judged cell passed (or is a known failure), 1 when one failed, else 2 when a
file was bad input or none was judged (verification.judging.policy.exit_code).

    kda-verify check DUMP [--tolerances FILE] [--device D] [--json]

DUMP is a serving trace dump (verification/serving/dump.py: kda-verify capture --suite serving,
or a serving engine's own dump in that format).  It is judged as ``run --suite serving`` judges
the cell (the same oracle, emulator baseline, verification.serving.judge.judge_step, diagnosis,
tolerances and known-failure register) and the same verdict line is printed, then the headline;
exit codes from verification.judging.policy.  A bad or missing file of the dump: one line naming the
file, what was expected and what came, exit 2.
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

NAME = "check"
HELP = "judge a kernel's dumped outputs against the oracle, a recipe's baseline and tolerances.yaml"
EXAMPLES = """\
kda-verify check --inputs p.safetensors --outputs o.safetensors --recipe flashkda
kda-verify check --inputs p.safetensors --outputs o.safetensors --recipe fla --backend-name fla --route chunk:safe_gate
kda-verify check --inputs p.safetensors --outputs o.safetensors --recipe moonshot --json
kda-verify check --inputs problems/ --outputs outputs/ --out results/ --resume
kda-verify check dump/
"""


def add_arguments(p):
    p.add_argument("dump", nargs="?", default=None, metavar="DUMP",
                   help="a serving trace dump directory (kda-verify capture --suite serving); instead of --inputs/--outputs")
    p.add_argument("--inputs", default=None, metavar="PATH",
                   help="problem file (safetensors, kda-verify-problem/1), or a directory of them")
    p.add_argument("--outputs", default=None, metavar="PATH",
                   help="output file (safetensors, kda-verify-outputs/1), or a directory of them (kda-verify capture)")
    p.add_argument("--recipe", metavar="RECIPE", help="emulator recipe of the baseline: flashkda, fla, moonshot "
                   "(required for files; for directories the default is the one each outputs file records)")
    p.add_argument("--out", metavar="DIR", help="with directories: results directory (default: the --outputs directory)")
    p.add_argument("--resume", action="store_true", help="with directories: keep the cells already in results.jsonl")
    p.add_argument("--backend-name", default="external", metavar="NAME",
                   help="backend name for the tolerance lookup (default: external)")
    p.add_argument("--route", default=None, metavar="NAME",
                   help="route name (default: the recipe); a route of a backend kda-verify loads is judged "
                   "under its flags, as run does")
    p.add_argument("--tolerances", default=None, metavar="FILE", help="tolerance file (default: tolerances.yaml)")
    p.add_argument("--device", default=None, metavar="DEVICE",
                   help="device for the oracle and the baseline (default: cuda if available, else cpu)")
    p.add_argument("--json", action="store_true", help="print the verdict as JSON")


def _fmt(x) -> str:
    if isinstance(x, float):
        return "nan" if math.isnan(x) else ("inf" if math.isinf(x) else f"{x:.3g}")
    return str(x)


def table(verdict) -> str:
    """The per-tensor table of a verdict."""
    head = ("tensor", "metric", "err", "baseline", "threshold", "margin", "max_abs", "max_ulp", "nan%", "zero%", "tolerance")
    rows = [head]
    for name, t in verdict.tensors.items():
        m = verdict.metrics.get(name, {})
        rows.append((name, t.get("metric", ""), _fmt(t.get("err")), _fmt(t.get("baseline_err")),
                     _fmt(t.get("threshold")), _fmt(t.get("margin")), _fmt(m.get("max_abs")), _fmt(m.get("max_ulp")),
                     _fmt(100 * m.get("nan_frac", 0.0)), _fmt(100 * m.get("zero_frac", 0.0)),
                     t.get("tolerance_key", "")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def run(args) -> int:
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from kda_kernels.emulator import RECIPES
    from kda_ref.problem import validate
    from verification.errors import UsageError
    from verification.running.devices import check_device
    from verification.reporting.problem_file import load_outputs, load_problem
    from verification.judging.tolerances import load_tolerances
    if args.dump is not None:
        return run_dump(args)
    for name, val in (("--inputs", args.inputs), ("--outputs", args.outputs)):
        if not val:
            raise UsageError(f"{name}: expected with {'--outputs' if name == '--inputs' else '--inputs'} (or a trace "
                             f"dump directory: kda-verify check DUMP), got none")
    args.device = check_device(args.device)
    if Path(args.inputs).is_dir():
        return run_dir(args)
    for name, val in (("--out", args.out), ("--resume", args.resume)):
        if val:
            raise UsageError(f"{name}: expected with a directory --inputs, got the file {args.inputs!r}")
    if args.recipe is None:
        raise UsageError(f"--recipe: expected one of {', '.join(RECIPES)} for a problem file, got none")
    if args.recipe not in RECIPES:
        raise UsageError(f"--recipe: expected one of {', '.join(RECIPES)}, got {args.recipe!r}")
    db = load_tolerances(args.tolerances)
    problem = validate(load_problem(args.inputs).to(args.device))
    if problem.is_empty:
        raise UsageError(f"--inputs: {problem.empty_reason()}")
    outs = load_outputs(args.outputs, problem)
    outs = {k: v.to(args.device) for k, v in outs.items()}
    route_name = args.route or args.recipe
    verdict, _ = judge_files(problem, outs, args.recipe, args.backend_name, args.route, db, args.device)
    if args.json:
        d = verdict.to_dict()
        d.update(inputs=args.inputs, outputs=args.outputs)
        print(json.dumps(d, indent=1))
    else:
        print(f"{args.backend_name}/{route_name} (baseline: recipe {args.recipe}) on {problem.describe()}")
        print(table(verdict))
        print(f"{verdict.status.upper()}: {verdict.reason}")
    sys.stdout.flush()
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.judging.policy import exit_code
    return exit_code([verdict.status])


# ----------------------------------------------------------------------------------------
# The directory form: every problem of a directory against its outputs
# ----------------------------------------------------------------------------------------
def _case_of(problem, stem: str):
    """(case id, suite, seed, params) of an exported problem: its meta's case when that id resolves
    (the parameters a known failure may condition on), else the file's name (also for ``problem``
    None, a file that could not be read)."""
    meta = getattr(problem, "meta", None)          # None: a problem file that could not be read
    meta = meta if isinstance(meta, dict) else {}
    cid = str(meta.get("case") or stem.replace("__", "/", 1))
    params, seed = {}, meta.get("seed")
    try:
        # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
        from verification.running.cases import get_case
        c = get_case(cid)
        params, seed = dict(c.params), c.seed
    except Exception:  # noqa: BLE001 - a problem that is no built-in case has no parameters
        pass
    return cid, cid.partition("/")[0] if "/" in cid else "files", seed, params


def check_route(backend_name: str, route_name, recipe: str):
    """(backend name, Route) that check judges under, taken where run takes them: when
    ``backend_name`` is a backend kda-verify loads (a built-in name or package.module:factory) and
    a route is named, the backend's own Route object with its flags (moonshot's
    ``cutlass:state=bf16`` declares state_dtype bf16), found by verification.running.run_select.resolve_routes
    as run finds --route (a name the backend lacks is a UsageError naming --route and the
    choices), claiming ``recipe``; any other backend name (the default ``external``), or no
    route named, gives a plain Route of that name (default: the recipe's) claiming ``recipe``."""
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from kda_kernels.base import BackendError, Route
    from verification.running.run_select import load, resolve_routes
    if not route_name:
        return backend_name, Route(name=recipe, recipe=recipe)
    try:
        lb = load(backend_name)
    except BackendError:                     # not a backend of this installation: a name for the tolerances
        return backend_name, Route(name=route_name, recipe=recipe)
    return lb.name, dataclasses.replace(resolve_routes(lb, [route_name])[0], recipe=recipe)


def judge_files(problem, outs: dict, recipe: str, backend_name: str, route_name, db, device: str):
    """The verdict of outputs ``outs`` on ``problem`` (validated, on ``device``), exactly as the
    file form above judges one pair: truth, the recipe's baseline (taps when ws_inv is there),
    every recipe's baseline on request, verification.judging.verdict.judge under the route ``check_route``
    gives for ``route_name`` (--route or the outputs file's; None: none named).  Returns
    (verdict, baseline)."""
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from kda_kernels.emulator import RECIPES
    from kda_ref.truth import truth
    from verification.errors import UsageError
    from verification.judging.baselines import baseline_metrics
    from verification.judging.verdict import judge

    backend_name, route = check_route(backend_name, route_name, recipe)
    if "ws_inv" in outs and int(outs["ws_inv"].shape[-1]) != RECIPES[recipe].chunk:
        raise UsageError(f"--outputs: ws_inv: expected chunk {RECIPES[recipe].chunk} (the {recipe} recipe's), "
                         f"got {int(outs['ws_inv'].shape[-1])} (shape {list(outs['ws_inv'].shape)})")
    tr = truth(problem)
    base = baseline_metrics(problem, recipe, tr, taps="ws_inv" in outs)
    recipes = {recipe: base}

    def recipe_baselines() -> dict:          # the same cap lift and fallback as run: every recipe, once
        for r in RECIPES:
            if r not in recipes:
                recipes[r] = baseline_metrics(problem, r, tr)
        return recipes

    class _Loaded:
        taps = {k: v for k, v in outs.items() if k == "ws_inv"}

        @staticmethod
        def tensors():
            return {k: v for k, v in outs.items() if k in ("o", "final_state", "state_cache")}

    return judge(backend_name, route, problem, _Loaded(), tr, base, db, recipe_baselines=recipe_baselines), base


def run_dir(args) -> int:
    """check over directories (module docstring)."""
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from kda_kernels.emulator import RECIPES
    from kda_ref.problem import ProblemError, validate
    from verification.errors import UsageError
    from verification.commands.capture import problem_files
    from verification.errors import writable_dir
    from verification.reporting.problem_file import load_outputs, load_outputs_metadata, load_problem
    from verification.judging.policy import BAD_INPUT, DEFAULT_RECIPE, exit_code, headline
    from verification.judging.record import (RESULTS_FILE, append_record, cell_key, new_record, read_records, set_judged,
                                     set_problem)
    from verification.reporting.report_render import write_report
    from verification.judging.verdict import decide, known_failure_entry
    from verification.judging.tolerances import load_tolerances

    if args.recipe is not None and args.recipe not in RECIPES:
        raise UsageError(f"--recipe: expected one of {', '.join(RECIPES)}, got {args.recipe!r}")
    files = problem_files(args.inputs)
    outputs = Path(args.outputs)
    if not outputs.is_dir():
        raise UsageError(f"--outputs: expected a directory of outputs files with a directory --inputs, got "
                         f"{args.outputs!r} ({'a file' if outputs.exists() else 'no such directory'})")
    res_dir = writable_dir(args.out or args.outputs, "--out")
    db = load_tolerances(args.tolerances)
    results = res_dir / RESULTS_FILE
    done = {}
    if args.resume and results.exists():
        done = {r.key: r for r in read_records(results)}
    elif results.exists():
        results.unlink()
    records = list(done.values())
    # the backend and route of the directory: what its outputs files record (a problem without
    # outputs, skipped or crashed, belongs to the same capture)
    dir_meta = {}
    for f in files:
        if (outputs / f.name).exists():
            try:
                dir_meta = load_outputs_metadata(str(outputs / f.name))
                break
            except UsageError:           # unreadable: that case's error row below, the next one names the capture
                continue
    for f in files:
        stem = f.name[:-len(".safetensors")]
        target = outputs / f.name
        meta, bad = dict(dir_meta), None
        try:
            problem = validate(load_problem(str(f)).to(args.device))
        except (UsageError, ProblemError) as e:
            problem, bad = None, f"bad input: --inputs: {f.name}: {e}"
        if target.exists():
            try:
                meta = load_outputs_metadata(str(target))
            except UsageError as e:
                bad = bad or f"bad outputs file: {e}"
        cid, suite, seed, params = _case_of(problem, stem)
        recipe = args.recipe or meta.get("recipe") or DEFAULT_RECIPE
        if recipe not in RECIPES:
            raise UsageError(f"--recipe: expected one of {', '.join(RECIPES)} (none given, and {target} records "
                             f"{recipe!r}), got none")
        backend = meta.get("backend") if args.backend_name == "external" and meta.get("backend") else args.backend_name
        route_name = args.route or meta.get("route") or recipe
        key = cell_key(backend, route_name, cid)
        if key in done:
            continue
        rec = new_record(
            backend=backend, backend_spec=backend, backend_version=meta.get("version", ""), route=route_name,
            recipe=recipe, case=cid, suite=suite, seed=seed, params=params, device=meta.get("device", "unknown"),
            repro=f"kda-verify check --inputs {f} --outputs {target} --recipe {recipe} --backend-name {backend} "
                  f"--route {route_name}",
            extra={"files": {"inputs": str(f), "outputs": str(target)}})
        if problem is not None:
            set_problem(rec, problem, [1, sum(e - b for b, e in problem.seq_bounds()), problem.H]
                        if problem.cu_seqlens is not None else [problem.B, problem.T, problem.H])
        skipped, crashed, error = (outputs / f"{stem}.{x}" for x in ("skipped", "crashed", "error"))
        outs = None
        if bad is None and target.exists() and not problem.is_empty:
            try:
                outs = load_outputs(str(target), problem)
            except (UsageError, ProblemError) as e:
                bad = f"bad outputs file: {e}"
        if bad is not None:                     # this case's file cannot be judged: its row, the rest go on
            rec.status, rec.reason = BAD_INPUT, bad
        elif problem.is_empty:
            rec.status, rec.reason = "skipped", f"not applicable: {problem.empty_reason()}"
        elif not target.exists():
            if skipped.exists():
                rec.status, rec.reason = "skipped", skipped.read_text(encoding="utf-8").strip() or "not applicable"
            elif crashed.exists():
                rec.status, rec.reason = "crashed", f"the kernel killed the capture process on this problem ({crashed})"
            elif error.exists():
                rec.status, rec.reason = "error", f"the kernel raised {error.read_text(encoding='utf-8').strip()}"
            else:
                rec.status, rec.reason = BAD_INPUT, f"no outputs file {target} (was capture run on {args.inputs}?)"
        else:
            outs = {k: v.to(args.device) for k, v in outs.items()}
            t0 = time.perf_counter()
            verdict, base = judge_files(problem, outs, recipe, backend, args.route or meta.get("route"), db, args.device)
            rec.timings["check_s"] = time.perf_counter() - t0
            set_judged(rec, verdict.tensors, verdict.metrics, baseline=base)
            kf = known_failure_entry(db, backend, route_name, cid, rec.params)
            decide(verdict, known_failure=kf).apply_to(rec)
        append_record(results, rec)
        records.append(rec)
        print(f"{cid}: {rec.status}: {rec.reason[:200]}")
    paths = write_report(res_dir, records=records)
    print(headline(records))
    print(f"report: {paths['md']}")
    sys.stdout.flush()
    return exit_code([r.status for r in records])


# ----------------------------------------------------------------------------------------
# A serving trace dump
# ----------------------------------------------------------------------------------------
def run_dump(args) -> int:
    """check of a trace dump (module docstring)."""
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.running.devices import check_device
    from verification.errors import UsageError
    from verification.judging.policy import exit_code, headline
    from verification.serving.dump import MANIFEST, check_dump, verdict_line
    from verification.judging.tolerances import load_tolerances
    for name, val in (("--inputs", args.inputs), ("--outputs", args.outputs), ("--recipe", args.recipe),
                      ("--out", args.out), ("--resume", args.resume), ("--route", args.route)):
        if val:
            raise UsageError(f"{name}: expected without a trace dump (DUMP {args.dump!r} names everything), got it")
    if not Path(args.dump).is_dir():
        raise UsageError(f"DUMP: expected a trace dump directory (kda-verify capture --suite serving --out DIR), got "
                         f"{args.dump!r} ({'a file' if Path(args.dump).exists() else 'no such directory'})")
    if not (Path(args.dump) / MANIFEST).is_file():
        raise UsageError(f"{Path(args.dump) / MANIFEST}: expected a trace dump manifest (kda-verify capture --suite "
                         f"serving --out DIR), got no such file")
    device = check_device(args.device)
    rec = check_dump(args.dump, load_tolerances(args.tolerances), device=device)
    if args.json:
        print(json.dumps(rec, indent=1, default=str))
    else:
        print(verdict_line(rec))
        print(headline([rec]))
        # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
        from verification.judging.policy import FAILING
        from verification.running.run_progress import clip_words
        if rec.get("status") in FAILING:        # as run's summary names a failing cell
            print(f"  {rec['status'].upper():<10} {rec['backend']} {rec['route']} {rec['case']}: "
                  f"{clip_words(rec.get('reason', ''), 400)}")
            print(f"             repro: {rec.get('repro', '')}")
    sys.stdout.flush()
    return exit_code([rec.get("status")])
