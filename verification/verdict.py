"""Verdicts: metrics plus a baseline plus a tolerance entry give pass, fail or mistrusted.

For every output tensor (o, final_state or state_cache), with the baseline's error b on the
same metric (the route's emulator recipe against the same oracle) and the entry (m, floor,
cap) of tolerances.yaml for (backend, route, input dtype, tensor):

    threshold = min(m * b + floor, cap)
    pass  iff  rel_l2 <= threshold(rel_l2)  and  tail_rel_l2 <= threshold(tail_rel_l2)
    margin = err / threshold (the worse of the two; > 1 fails)

The cap never asks for more than bf16 can give on the case: when even the best production
recipe (the least error over the emulated recipes flashkda, fla, moonshot on the same case,
``recipe_baselines``) errs above the cap on a tensor, that tensor's cap is lifted to
m * best + floor and the record says so (``cap_lifted``).  Example: one token whose q^.k^ is
-0.003, so o = scale (q^.k^) beta v is a near-cancellation that every recipe's bf16 rounding of
q^ and k^ gets 13-24% wrong.  A recipe that alone fails a case the others pass (Moonshot's on
correlated keys) still meets the cap.

A missing tensor, any NaN or Inf, a NaN baseline, or a changed slot the problem does not
write fails; a mostly-zero output on non-degenerate input is "mistrusted", never passed.
The case's status is the worst of its tensors': fail > mistrusted > pass.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

from verification.metrics import compare, dtype_name, tensor_metrics

JUDGED_METRICS = ("rel_l2", "tail_rel_l2")
STATUSES = ("pass", "fail", "mistrusted")


@dataclass
class Verdict:
    status: str
    reason: str
    tensors: dict = field(default_factory=dict)     # name -> {err, threshold, margin, metric, baseline_err, ...}
    metrics: dict = field(default_factory=dict)     # name -> tensor_metrics(...)
    backend: str = ""
    route: str = ""
    recipe: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def to_dict(self) -> dict:
        return {"status": self.status, "reason": self.reason, "backend": self.backend, "route": self.route,
                "recipe": self.recipe, "tensors": _jsonable(self.tensors), "metrics": _jsonable(self.metrics)}


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)          # JSON has no NaN / Infinity
    return x


def _tensors(x) -> dict:
    return x.tensors() if hasattr(x, "tensors") else dict(x)


def baseline_metrics(problem, recipe: str, truth, taps: bool = False) -> dict:
    """Metrics of the emulator's ``recipe`` against ``truth`` (name -> metrics dict); a pure
    function of its arguments, so the caller may cache it per (case, recipe).  With ``taps``
    it also holds the stored inverse's metrics (``ws_inv``) against the oracle workspace."""
    from kda_kernels.emulator import emulate
    out = emulate(problem, recipe, taps=taps)
    result = compare(out.tensors(), {k: v for k, v in _tensors(truth).items()}, problem)
    if taps:
        result.update(tap_metrics(problem, out.taps))
    return result


TAP_TENSORS = ("ws_inv",)


def tap_metrics(problem, taps: dict) -> dict:
    """Metrics of the workspace taps a backend returned (only ws_inv is judged) against the
    oracle's workspace at the tap's chunk size."""
    from kda_ref.workspace import workspace
    from verification.metrics import inverse_metrics
    result = {}
    x = (taps or {}).get("ws_inv")
    if x is not None:
        ws = workspace(problem, C=int(x.shape[-1]), inverse="exact")
        result["ws_inv"] = inverse_metrics(x, ws.ws_inv, ws.grid.tile_len)
    return result


def emulate_taps(problem, recipe: str) -> dict:
    from kda_kernels.emulator import emulate
    return emulate(problem, recipe, taps=True).taps


def _fmt(x: float) -> str:
    return f"{x:.3g}" if isinstance(x, (int, float)) else str(x)


def judge_tensor(name, met, base, tol) -> tuple[str, str, dict]:
    """(status, reason, record) of one tensor."""
    rec = {"tolerance_key": tol.key, "m": tol.m, "floor": tol.floor, "cap": tol.cap}
    if met.get("missing"):
        rec.update(err=math.nan, threshold=math.nan, margin=math.inf, metric="rel_l2", baseline_err=math.nan)
        return "fail", f"{name}: missing from the outputs", rec
    worst = None
    for metric in JUDGED_METRICS:
        err, b = met[metric], base.get(metric, math.nan) if base else math.nan
        thr = tol.threshold(b) if not math.isnan(b) else math.nan
        if math.isnan(err) or math.isnan(thr):
            margin = math.inf
        elif thr > 0:
            margin = err / thr
        else:
            margin = 0.0 if err == 0 else math.inf
        cand = {"err": err, "threshold": thr, "margin": margin, "metric": metric, "baseline_err": b}
        if worst is None or margin > worst["margin"]:
            worst = cand
    rec.update(worst)
    if met["nan_frac"] > 0 or met["inf_frac"] > 0:
        return "fail", (f"{name}: {100 * met['nan_frac']:.3g}% NaN, {100 * met['inf_frac']:.3g}% Inf "
                        f"(NaN never passes)"), rec
    if not base or math.isnan(base.get("rel_l2", math.nan)):
        return "fail", f"{name}: the baseline's error is NaN or absent, so nothing can be judged", rec
    if met.get("untouched_changed", 0):
        return "fail", f"{name}: {met['untouched_changed']} values changed in slots the problem does not write", rec
    if met["mistrusted"]:
        return "mistrusted", (f"{name}: {100 * met['zero_frac']:.3g}% exact zeros on non-degenerate input "
                              f"({100 * met['spurious_zero_frac']:.3g}% where the reference is not negligible)"), rec
    if rec["margin"] > 1:
        capped = rec["threshold"] == tol.cap
        rule = f"cap {_fmt(tol.cap)}" if capped else f"{_fmt(tol.m)}*{_fmt(rec['baseline_err'])}+{_fmt(tol.floor)}"
        return "fail", (f"{name}: {rec['metric']} {_fmt(rec['err'])} > {_fmt(rec['threshold'])} = {rule} "
                        f"(tolerance {tol.key})"), rec
    return "pass", "", rec


def lifted_cap(name: str, tol, recipe_baselines: Optional[Callable[[], dict]]) -> Optional[dict]:
    """The cap lift of tensor ``name`` (see the module docstring), or None when the best
    recipe meets the cap on both judged metrics.  ``recipe_baselines()`` -> {recipe: metrics}."""
    if recipe_baselines is None:
        return None
    per_recipe = {r: m.get(name) for r, m in (recipe_baselines() or {}).items() if m and m.get(name)}
    if not per_recipe:
        return None
    best = {}
    for metric in JUDGED_METRICS:
        errs = {r: m.get(metric, math.nan) for r, m in per_recipe.items()}
        errs = {r: e for r, e in errs.items() if not math.isnan(e)}
        if errs:
            r = min(errs, key=errs.get)
            best[metric] = (r, errs[r])
    over = {k: v for k, v in best.items() if v[1] > tol.cap}
    if not over:
        return None
    metric, (recipe, err) = max(over.items(), key=lambda kv: kv[1][1])
    return {"from": tol.cap, "to": tol.m * err + tol.floor, "metric": metric, "best_recipe": recipe,
            "best_err": err}


def judge(backend: str, route, problem, outputs, truth, baseline: dict, db,
          recipe_baselines: Optional[Callable[[], dict]] = None) -> Verdict:
    """The verdict of one run: ``outputs`` (Outputs or name -> tensor) against ``truth`` (Truth
    or name -> float64 tensor), with ``baseline`` (baseline_metrics of the route's recipe) and
    the matching entries of ``db`` (a ToleranceDB).  ``recipe_baselines``: a callable giving
    every production recipe's baseline metrics on this case, asked only when a tensor fails at
    its cap (to lift a cap that no recipe can meet); None keeps every cap."""
    route_name = getattr(route, "name", str(route))
    recipe = getattr(route, "recipe", "")
    outs, refs = _tensors(outputs), _tensors(truth)
    dtype = dtype_name(problem.v.dtype)
    statuses, reasons, records, metrics, lifted = [], [], {}, {}, []
    for name, ref in refs.items():
        if name not in ("o", "final_state", "state_cache"):
            continue
        x = outs.get(name)
        tol = db.lookup(backend, route_name, dtype, name)
        if x is None:
            met = compare({}, {name: ref}, problem)[name]
        else:
            try:
                met = tensor_metrics(x, ref, dtype=x.dtype, problem=problem, tensor=name)
            except ValueError as e:
                met = compare({}, {name: ref}, problem)[name]
                records[name] = {"tolerance_key": tol.key, "err": math.nan, "threshold": math.nan,
                                 "margin": math.inf, "metric": "shape", "baseline_err": math.nan}
                metrics[name] = met
                statuses.append("fail")
                reasons.append(str(e))
                continue
        status, reason, rec = judge_tensor(name, met, baseline.get(name), tol)
        if status == "fail" and rec.get("threshold") == tol.cap:
            lift = lifted_cap(name, tol, recipe_baselines)
            if lift is not None and lift["to"] > tol.cap:
                status, reason, rec = judge_tensor(name, met, baseline.get(name), dataclasses.replace(tol, cap=lift["to"]))
                rec["cap_lifted"] = lift
                lifted.append(f"{name}: cap {_fmt(lift['from'])} lifted to {_fmt(lift['to'])}, the best recipe "
                              f"({lift['best_recipe']}) errs {_fmt(lift['best_err'])} in {lift['metric']} here")
        records[name], metrics[name] = rec, met
        statuses.append(status)
        if reason:
            reasons.append(reason)
    taps = {k: v for k, v in (getattr(outputs, "taps", None) or {}).items() if k in TAP_TENSORS}
    if taps:
        from kda_kernels.emulator import RECIPES
        chunk = RECIPES[recipe].chunk if recipe in RECIPES else None
        if chunk is not None and int(taps["ws_inv"].shape[-1]) == chunk:
            base_taps = {k: baseline[k] for k in TAP_TENSORS if k in baseline} or tap_metrics(
                problem, emulate_taps(problem, recipe))
            for name, met in tap_metrics(problem, taps).items():
                tol = db.lookup(backend, route_name, dtype, name)
                status, reason, rec = judge_tensor(name, met, base_taps.get(name), tol)
                records[name], metrics[name] = rec, met
                statuses.append(status)
                if reason:
                    reasons.append(reason)
    if "fail" in statuses:
        status = "fail"
    elif "mistrusted" in statuses:
        status = "mistrusted"
    else:
        status = "pass"
    if status == "pass":
        worst = max(records.items(), key=lambda kv: kv[1]["margin"]) if records else None
        reason = ("pass" if worst is None else
                  f"pass: worst margin {worst[1]['margin']:.3g} ({worst[0]} {worst[1]['metric']})")
    else:
        reason = "; ".join(reasons)
    if lifted:
        reason += " (" + "; ".join(lifted) + ")"
    return Verdict(status=status, reason=reason, tensors=records, metrics=metrics, backend=backend,
                   route=route_name, recipe=recipe)
