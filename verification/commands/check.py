"""`kda-verify check`: judge outputs that any kernel produced anywhere against the oracle.

    kda-verify check --inputs P --outputs O --recipe R [--backend-name NAME] [--route NAME] [--json]

P is a problem file and O an output file (verification/problem_file.py).  The float64 truth of
P is computed here, the emulator recipe R gives the baseline, and the tolerances.yaml entry of
(NAME, route, input dtype, tensor) gives m, floor and cap.  A ``ws_inv`` tensor in O (the
stored inverse, production layout) is judged too.  Prints a per-tensor table (or the verdict
as JSON); exit 0 pass, 1 fail or mistrusted, 2 bad input, an empty problem, or not applicable
(no production recipe gives a sound baseline on this input).  The verdict is
``verification.verdict.judge`` with the same arguments as ``run`` gives it (cap lift included).
"""
from __future__ import annotations

import json
import math
import sys

NAME = "check"
HELP = "judge a kernel's dumped outputs against the oracle, a recipe's baseline and tolerances.yaml"
EXAMPLES = """\
kda-verify check --inputs p.safetensors --outputs o.safetensors --recipe flashkda
kda-verify check --inputs p.safetensors --outputs o.safetensors --recipe fla --backend-name fla --route chunk:safe_gate
kda-verify check --inputs p.safetensors --outputs o.safetensors --recipe moonshot --json
"""


def add_arguments(p):
    p.add_argument("--inputs", required=True, metavar="P", help="problem file (safetensors, kda-verify-problem/1)")
    p.add_argument("--outputs", required=True, metavar="O", help="output file (safetensors, kda-verify-outputs/1)")
    p.add_argument("--recipe", required=True, metavar="R", help="emulator recipe of the baseline: flashkda, fla, moonshot")
    p.add_argument("--backend-name", default="external", metavar="NAME",
                   help="backend name for the tolerance lookup (default: external)")
    p.add_argument("--route", default=None, metavar="NAME", help="route name for the tolerance lookup (default: R)")
    p.add_argument("--tolerances", default=None, metavar="FILE", help="tolerance file (default: tolerances.yaml)")
    p.add_argument("--device", default="cpu", metavar="D", help="device for the oracle and the baseline (default cpu)")
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
    from kda_kernels.base import Route
    from kda_kernels.emulator import RECIPES
    from kda_ref.problem import validate
    from kda_ref.truth import truth
    from verification.cli import UsageError
    from verification.problem_file import load_outputs, load_problem
    from verification.tolerances import load_tolerances
    from verification.verdict import baseline_metrics, judge

    if args.recipe not in RECIPES:
        raise UsageError(f"--recipe: expected one of {', '.join(RECIPES)}, got {args.recipe!r}")
    db = load_tolerances(args.tolerances)
    problem = validate(load_problem(args.inputs).to(args.device))
    if problem.is_empty:
        raise UsageError(f"--inputs: {problem.empty_reason()}")
    outs = load_outputs(args.outputs, problem)
    outs = {k: v.to(args.device) for k, v in outs.items()}
    route = Route(name=args.route or args.recipe, recipe=args.recipe)
    if "ws_inv" in outs and int(outs["ws_inv"].shape[-1]) != RECIPES[args.recipe].chunk:
        raise UsageError(f"--outputs: ws_inv: expected chunk {RECIPES[args.recipe].chunk} (the {args.recipe} recipe's), "
                         f"got {int(outs['ws_inv'].shape[-1])} (shape {list(outs['ws_inv'].shape)})")
    tr = truth(problem)
    want_taps = "ws_inv" in outs
    base = baseline_metrics(problem, args.recipe, tr, taps=want_taps)
    recipes = {args.recipe: base}

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

    verdict = judge(args.backend_name, route, problem, _Loaded(), tr, base, db, recipe_baselines=recipe_baselines)
    if args.json:
        d = verdict.to_dict()
        d.update(inputs=args.inputs, outputs=args.outputs)
        print(json.dumps(d, indent=1))
    else:
        print(f"{args.backend_name}/{route.name} (baseline: recipe {args.recipe}) on {problem.describe()}")
        print(table(verdict))
        print(f"{verdict.status.upper()}: {verdict.reason}")
    sys.stdout.flush()
    return {"pass": 0, "not-applicable": 2}.get(verdict.status, 1)
