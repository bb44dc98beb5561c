"""``assert_kda_close``: one kernel call judged by kda-verify's verdict, as an assertion.

In the style of ``torch.testing.assert_close``: it passes silently (returning the Verdict) when
the outputs pass, and raises AssertionError whose message names the worst slice otherwise.

What judges: ``verification.commands.check.judge_files``, the function ``kda-verify check``
judges a problem file and an outputs file with, which computes the float64 truth
(kda_ref.truth), the baseline recipe's error on the same problem
(verification.judging.baselines.baseline_metrics) and calls ``verification.judging.verdict.judge``, the judge
``kda-verify run`` calls for every cell: per tensor (o; final_state, or state_cache when
paged; ws_inv when given)

    err <= min(m * baseline_err + floor, cap)   for err = rel_l2 and tail_rel_l2

and every slice (o per (sequence, head), per (sequence, 16-token block), each sequence's first
4 tokens; a state per (sequence, head); the cache per (slot, head)), with the cap lift where no
recipe meets the cap and the recipe's range (out-of-contract) as run applies them
(docs/tolerances.md).  ``verification.judging.verdict.decide`` makes the final status; the register of
known failures is not consulted (it names cases of the built-in suites, and a kernel author's
test asserts that this call is right).  Only ``pass`` passes: ``fail``, ``mistrusted``,
``out-of-contract`` and ``skipped`` (no sound baseline) raise.
"""
from __future__ import annotations

import math
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

import torch

from kda_kernels.base import Outputs
from kda_kernels.emulator import RECIPES
from kda_ref.problem import Problem, ProblemError, validate
from verification.commands.check import judge_files
from verification.errors import UsageError
from verification.judging.policy import DEFAULT_RECIPE
from verification.judging.tolerances import load_tolerances
from verification.judging.verdict import decide
from verification.reporting.problem_file import check_outputs, save_outputs, save_problem

OUTPUT_NAMES = ("o", "final_state", "state_cache")   # the order of the tuple form
TAP_NAMES = ("ws_inv",)                              # a stored inverse, judged where given


def _type_name(x) -> str:
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _check_problem(problem):
    """The validated Problem, or a one-line TypeError / ValueError naming ``problem``."""
    if not isinstance(problem, Problem):
        raise TypeError(f"problem: expected a kda_ref.problem.Problem, got {_type_name(problem)}")
    try:
        problem = validate(problem)
    except ProblemError as e:
        raise ValueError(f"problem: {e}") from None
    if problem.is_empty:
        raise ValueError(f"problem: {problem.empty_reason()}")
    return problem


def _output_tensors(outputs, problem) -> dict:
    """{name: tensor} of ``outputs`` (Outputs, a dict, or a tuple (o, final_state[, state_cache])),
    on the problem's device, held to the problem's shapes (verification.reporting.problem_file.check_outputs);
    a one-line TypeError / ValueError naming ``outputs`` otherwise."""

    form = "a kda_kernels.base.Outputs, a dict or a tuple (o, final_state[, state_cache])"
    if isinstance(outputs, Outputs):
        given = {"o": outputs.o, "final_state": outputs.final_state, "state_cache": outputs.state_cache}
        given.update({k: v for k, v in (outputs.taps or {}).items() if k in TAP_NAMES})
        where = "outputs.{}"
    elif isinstance(outputs, Mapping):
        bad = [k for k in outputs if k not in OUTPUT_NAMES + TAP_NAMES]
        if bad:
            raise ValueError(f"outputs: expected keys among {', '.join(OUTPUT_NAMES + TAP_NAMES)}, got {bad[0]!r}")
        given, where = dict(outputs), "outputs[{!r}]"
    elif isinstance(outputs, (tuple, list)):
        if not 2 <= len(outputs) <= 3:
            raise ValueError(f"outputs: expected (o, final_state) or (o, final_state, state_cache), "
                             f"got a {type(outputs).__name__} of {len(outputs)}")
        given = dict(zip(OUTPUT_NAMES, outputs))
        index = {n: i for i, n in enumerate(OUTPUT_NAMES)}
        where = "outputs[{}]"
        for n, v in given.items():
            if v is not None and not isinstance(v, torch.Tensor):
                raise TypeError(f"outputs[{index[n]}] ({n}): expected a torch.Tensor or None, got {_type_name(v)}")
    else:
        raise TypeError(f"outputs: expected {form}, got {_type_name(outputs)}")
    for n, v in given.items():
        if v is not None and not isinstance(v, torch.Tensor):
            raise TypeError(f"{where.format(n)}: expected a torch.Tensor or None, got {_type_name(v)}")
    tensors = {n: v for n, v in given.items() if v is not None}
    if "o" not in tensors:
        raise ValueError("outputs: expected the output o (a tensor [B,T,HV,V]), got none")
    if problem.paged and "state_cache" not in tensors and "final_state" in tensors:
        raise ValueError("outputs: expected a paged problem's state in state_cache (the tuple's third element, "
                         "or the key 'state_cache'), got it as final_state")
    if not problem.paged and "state_cache" in tensors:
        raise ValueError(f"outputs: expected no state_cache for state_layout {problem.state_layout!r} (its "
                         f"state is final_state), got a tensor")
    try:
        check_outputs(tensors, problem, "outputs")
    except ProblemError as e:
        raise ValueError(str(e)) from None
    return {n: t.to(problem.device) for n, t in tensors.items()}


def _check_recipe(recipe) -> str:
    if recipe is None:
        return DEFAULT_RECIPE
    if not isinstance(recipe, str):
        raise TypeError(f"recipe: expected a recipe name ({', '.join(RECIPES)}), got {_type_name(recipe)}")
    if recipe not in RECIPES:
        raise ValueError(f"recipe: expected one of {', '.join(RECIPES)}, got {recipe!r}")
    return recipe


def _split_route(route) -> tuple[str, Optional[str]]:
    """(backend name, route name) for the tolerance lookup: "BACKEND/ROUTE" (a tolerances.yaml
    entry's backend and route, e.g. "triton/seg"); None: ("external", None), the default entry."""
    if route is None:
        return "external", None
    if not isinstance(route, str):
        raise TypeError(f"route: expected a name BACKEND/ROUTE (e.g. 'triton/seg') or None, got {_type_name(route)}")
    backend, sep, name = route.partition("/")
    if not sep or not backend or not name:
        raise ValueError(f"route: expected BACKEND/ROUTE, a tolerances.yaml entry's backend and route "
                         f"(e.g. 'triton/seg', 'fla/chunk:safe_gate'), got {route!r}")
    return backend, name


def _tolerances(path):
    if path is not None and not isinstance(path, (str, Path)):
        raise TypeError(f"tolerances: expected a path to a tolerances YAML file or None, got {_type_name(path)}")
    try:
        return load_tolerances(None if path is None else str(path))
    except UsageError as e:
        raise ValueError(_as_argument(str(e))) from None


def _as_argument(msg: str) -> str:
    """A command-line option named at the start of a message, as this function's argument."""
    for flag, arg in (("--outputs", "outputs"), ("--route", "route"), ("--tolerances", "tolerances"),
                      ("--inputs", "problem")):
        if msg.startswith(flag + ":"):
            return arg + msg[len(flag):]
    return msg


def save_repro(problem, outputs, directory, *, recipe: Optional[str] = None, route: Optional[str] = None) -> str:
    """Write ``problem`` and ``outputs`` as DIRECTORY/problem.safetensors and
    DIRECTORY/outputs.safetensors (verification/reporting/problem_file.py) and return the ``kda-verify
    check`` command that judges them as ``assert_kda_close`` does."""
    problem = _check_problem(problem)
    tensors = _output_tensors(outputs, problem)
    recipe = _check_recipe(recipe)
    backend, route_name = _split_route(route)
    d = Path(directory)
    save_problem(str(d / "problem.safetensors"), problem)
    save_outputs(str(d / "outputs.safetensors"), tensors,
                 {"recipe": recipe, "backend": backend, **({"route": route_name} if route_name else {})})
    return _check_command(d, recipe, backend, route_name)


def _check_command(d: Path, recipe: str, backend: str, route_name: Optional[str]) -> str:
    cmd = (f"kda-verify check --inputs {shlex.quote(str(d / 'problem.safetensors'))} "
           f"--outputs {shlex.quote(str(d / 'outputs.safetensors'))} --recipe {recipe}")
    if route_name:
        cmd += f" --backend-name {shlex.quote(backend)} --route {shlex.quote(route_name)}"
    return cmd


def _g(x) -> str:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return str(x)
    return "nan" if math.isnan(x) else ("inf" if math.isinf(x) else f"{x:.3g}")


def _margin_key(rec: dict) -> float:
    m = rec.get("margin", math.nan)
    m = float(m) if isinstance(m, (int, float)) else math.nan
    return math.inf if math.isnan(m) else m


def worst_slice_line(verdict) -> str:
    """The worst tensor of a verdict and its worst slice, on one line: tensor, slice (sequence and
    head, or sequence and token block), error, threshold, margin."""
    if not verdict.tensors:
        return "no tensor was judged"
    name, rec = max(verdict.tensors.items(), key=lambda kv: _margin_key(kv[1]))
    sl = rec.get("slice")
    if sl:
        line = (f"{name} {sl['where']}: rel_l2 {_g(sl['err'])} > threshold {_g(sl['threshold'])} "
                if sl["margin"] > 1 else f"{name} {sl['where']}: rel_l2 {_g(sl['err'])}, threshold "
                f"{_g(sl['threshold'])} ")
        line += (f"(margin {_g(sl['margin'])}; its baseline {_g(sl['baseline_err'])}, the tensor's "
                 f"{_g(sl['tensor_baseline_err'])})")
        tm = rec.get("tensor_margin", rec.get("margin"))
        line += (f"; whole {name}: {rec.get('metric')} {_g(rec.get('err'))}, threshold {_g(rec.get('threshold'))}, "
                 f"margin {_g(tm)}")
        return line
    return (f"{name} (whole tensor, no slice judged): {rec.get('metric')} {_g(rec.get('err'))}, threshold "
            f"{_g(rec.get('threshold'))}, margin {_g(rec.get('margin'))}")


def assert_kda_close(outputs, problem, *, recipe: Optional[str] = None, route: Optional[str] = None,
                     tolerances=None, repro_dir=None):
    """Judge one kernel call with kda-verify's verdict; raise AssertionError unless it passes.

    outputs: what the kernel returned for ``problem``: a kda_kernels.base.Outputs, a dict
        {o, final_state or state_cache[, ws_inv]}, or a tuple (o, final_state[, state_cache]) in
        the Problem's layouts (o [B,T,HV,V]; final_state [N,HV,K,V] for layout kv, [N,HV,V,K]
        for vk; the paged cache [slots,HV,V,K] in place of final_state when paged).
    problem: the kda_ref.problem.Problem the kernel ran on (validated here).
    recipe: the emulator recipe whose error on this problem is the baseline (kda_kernels/
        emulator.py RECIPES; default verification.judging.policy.DEFAULT_RECIPE, flashkda).
    route: "BACKEND/ROUTE" to judge under that tolerances.yaml entry and, for a backend
        kda-verify loads, that route's flags (e.g. "triton/seg", "fla/chunk:safe_gate"); None:
        the default entry (backend "external", route the recipe's name).
    tolerances: a tolerances YAML file (default: $KDA_TOLERANCES, else the package's).
    repro_dir: where a failing call writes problem.safetensors and outputs.safetensors
        (``save_repro``); the message then gives the ``kda-verify check`` line that judges them.

    Returns the verification.judging.verdict.Verdict on a pass.  Raises AssertionError naming the worst
    slice (tensor, slice, error, threshold, margin), the verdict's reason and a repro hint;
    TypeError / ValueError, one line naming the argument, for bad arguments."""
    __tracebackhide__ = True   # pytest shows the caller's line
    problem = _check_problem(problem)
    tensors = _output_tensors(outputs, problem)
    recipe = _check_recipe(recipe)
    backend, route_name = _split_route(route)
    if repro_dir is not None and not isinstance(repro_dir, (str, Path)):
        raise TypeError(f"repro_dir: expected a directory path or None, got {_type_name(repro_dir)}")
    db = _tolerances(tolerances)
    try:
        verdict, _ = judge_files(problem, tensors, recipe, backend, route_name, db, str(problem.device))
    except UsageError as e:
        raise ValueError(_as_argument(str(e))) from None
    decision = decide(verdict)
    if decision.status == "pass":
        return verdict
    raise AssertionError(failure_message(verdict, decision, problem, recipe, backend, route_name,
                                         _repro(problem, outputs, repro_dir, recipe, route)))


def _repro(problem, outputs, repro_dir, recipe: str, route: Optional[str]) -> str:
    if repro_dir is not None:
        return "judge it again from files: " + save_repro(problem, outputs, repro_dir, recipe=recipe, route=route)
    args = f"recipe={recipe!r}" + (f", route={route!r}" if route else "")
    return (f"pass repro_dir=DIR (or call kda_verify.save_repro(problem, outputs, DIR, {args})) to write the "
            f"problem and outputs files and the `kda-verify check` line that judges them the same way")


def failure_message(verdict, decision, problem, recipe: str, backend: str, route_name: Optional[str],
                    repro: str) -> str:
    """The AssertionError's message: the status and worst slice first, then each tensor, the
    verdict's reason, what judged it, the repro hint."""
    lines = [f"kda verdict {decision.status.upper()}: worst {worst_slice_line(verdict)}"]
    for name, rec in verdict.tensors.items():
        sl = rec.get("slice") or {}
        lines.append(f"  {name}: {rec.get('metric')} {_g(rec.get('err'))}, threshold {_g(rec.get('threshold'))} "
                     f"(baseline {_g(rec.get('baseline_err'))}), margin {_g(rec.get('tensor_margin', rec.get('margin')))}"
                     + (f"; worst slice {sl['where']} margin {_g(sl['margin'])}" if sl else "")
                     + f"; tolerance {rec.get('tolerance_key', '?')}")
    lines.append(f"  reason: {decision.reason}")
    lines.append(f"  judged as {backend}/{route_name or recipe} against the {recipe} recipe's baseline on "
                 f"{problem.describe()}")
    lines.append(f"  repro: {repro}")
    return "\n".join(lines)
