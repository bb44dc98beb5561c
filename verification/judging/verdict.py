"""Verdicts: metrics plus a baseline plus a tolerance entry give pass, fail or mistrusted.

For every output tensor (o, final_state or state_cache), with the baseline's error b on the
same metric (the route's emulator recipe against the same oracle) and the entry (m, floor,
cap) of tolerances.yaml for (backend, route, input dtype, tensor):

    threshold = min(m * b + floor, cap)
    pass  iff  rel_l2 <= threshold(rel_l2)  and  tail_rel_l2 <= threshold(tail_rel_l2)
    margin = err / threshold (the worse of the two; > 1 fails)

The cap never asks for more than bf16 can give on the case: when even the best production
recipe (the least error over the emulated recipes of RECIPES on the same case,
``recipe_baselines``) errs above the cap on a tensor, no rounding meets the cap there and that
tensor's cap is lifted to m * max(best, the route's own baseline) + floor, so the tensor is held
to m x its own baseline; the record says so (``cap_lifted``).  Example: one token whose q^.k^ is
-0.003, so o = scale (q^.k^) beta v is a near-cancellation that every recipe's bf16 rounding of
q^ and k^ gets 5-75% wrong, by which recipe's rounding happens to cancel least (luck, not a
better recipe).  A recipe that alone fails a case the others pass (Moonshot's on correlated
keys) still meets the cap.

Every slice is judged too (``judge_slices``): o per (sequence, head), per (sequence, 16-token
block) and over each sequence's first 4 tokens, a state per (sequence, head), the paged cache
per (written slot, head), each
against the same slice of the baseline:

    slice err s = sqrt(err_sq / max(ref_sq, (NEGLIGIBLE_SLICE * rms(ref))^2 * count))
    threshold   = m * a * max(s_baseline, SLICE_FLOOR_SHARE * baseline_err of the whole tensor) + floor
    a           = 1 + 1 / sqrt(tokens) for a slice of o over a token range or over one head of
                  a sequence (the first 4 tokens: 1.5; a 16-token block: 1.25; one head of a
                  2-token sequence: 1.71), else 1     (``slice_allowance``)

A slice whose reference is negligible against the tensor's (rms below NEGLIGIBLE_SLICE of the
tensor's) is measured on the tensor's scale, so a near-zero slice raises no false alarm; the
whole tensor's baseline error is the least a slice's baseline counts for, so a slice whose
baseline happened to round well is not held to luck (a kernel and its recipe round at the same
points but not to the same bits: on one slice their errors differ by up to ~2x where the pooled
ones agree).  A slice of few tokens gets the allowance a: its error is made of a few per-token
scalar roundings (q.k, beta, the gate's running sum), so the kernel's and the recipe's differ by
more on it than on a whole sequence (the ratio's spread shrinks as 1/sqrt(tokens)); a state
carried into the next sequence still errs many times the baseline on that sequence's first
tokens.  The cap is a whole-tensor bound only.  The verdict names the worst slice.

The recipe's range.  Where a problem's magnitudes lie off the typical range (rms(v) or the
initial state's outside 2^-8..2^8, verification/judging/baselines.py) the baseline holds two figures: the
recipe on the problem as given, and ``in_range``, the same recipe with its fp16 storage given
fp32's exponent range (its precision without fp16's flush below 6.1e-5 and overflow above
65504).  Every rule above meets the in-range figure first; a tensor that fails it is
``out-of-contract``, not a failure, when the problem lies outside the recipe's range: the recipe
itself at the problem's scale returns NaN, Inf or mostly zeros, or errs so much that the kernel
is within m x of it, whole tensor and every slice, the cap not applied (``beyond_recipe_range``).
The reason gives both figures.  Measured (lens [1, 64, 200], lb -0.5): the flashkda recipe errs
1.6-1.8x its in-range error at v x 1e-5 and 11-14x at 1e-6, so a kernel doing what its recipe
does there is out of contract, a 4% bug fails down to 1e-5 (to 1e-6 with a state) and is out
of contract below, and a kernel meeting the in-range figure passes at every scale.

A degenerate baseline (NaN, Inf, or mostly zeros where the reference is not: the recipe
overflowed or underflowed on this input, e.g. the flashkda recipe's pivot factors at lb -12)
never lets the cap alone decide: the tensor is judged against the best production recipe
whose baseline is sound, and when none is, the verdict is ``not-applicable`` with the reason.

A missing tensor, any NaN or Inf, or a changed slot the problem does not write fails; an
output of another dtype than the problem and route declare fails; a mostly-zero output on
non-degenerate input is "mistrusted", never passed.  The case's status is the worst of its
tensors': fail > mistrusted > out-of-contract > not-applicable > pass.

A route claims a recipe (``Route.recipe``); when its error is well above that recipe's and
close to a recipe that rounds more (moonshot keeps the state bf16 between chunks), the reason
notes that the route's error matches the cheaper recipe (``cheaper_recipe_note``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from verification.judging.baselines import TAP_TENSORS, _tensors, emulate_taps, in_range_view, recipe_chunk, tap_metrics
from verification.judging.metrics import compare, dtype_name
from verification.judging.policy import JUDGED_METRICS, NOT_APPLICABLE, OUT_OF_CONTRACT
from verification.judging.record import decode_number as num, encode
NEGLIGIBLE_SLICE = 1e-2     # a slice whose rms is below this fraction of the tensor's is judged on the tensor's scale
SLICE_FLOOR_SHARE = 1.0     # a slice is held to at least the whole tensor's baseline error
SLICE_KINDS = {"seq_head": ("sequence", "head"), "seq_block": ("sequence", "tokens"),
               "seq_start": ("sequence", "tokens"), "slot_head": ("slot", "head")}
RECIPE_COST = ("moonshot", "fla", "flashkda")   # cheapest rounding first: bf16 state < input-dtype tiles < fp32 state


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
                "recipe": self.recipe, "tensors": encode(self.tensors), "metrics": encode(self.metrics)}


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


def lifted_cap(name: str, tol, recipe_baselines: Optional[Callable[[], dict]],
               own: Optional[dict] = None) -> Optional[dict]:
    """The cap lift of tensor ``name`` (see the module docstring), or None when the best
    recipe meets the cap on both judged metrics.  ``recipe_baselines()`` -> {recipe: metrics};
    ``own``: the route's own baseline metrics of the tensor (the lift is at least m x its
    worse judged metric + floor)."""
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
    to = tol.m * err + tol.floor
    own_err = max((float((own or {}).get(k, 0.0) or 0.0) for k in JUDGED_METRICS), default=0.0)
    if not math.isnan(own_err):
        to = max(to, tol.m * own_err + tol.floor)
    return {"from": tol.cap, "to": to, "metric": metric, "best_recipe": recipe, "best_err": err}


def degenerate(base: Optional[dict]) -> Optional[str]:
    """Why a baseline's metrics of one tensor cannot serve as a yardstick (None when they can):
    absent, NaN / Inf in the recipe's output, or mostly zeros where the reference is not (the
    recipe overflowed or underflowed on this input)."""
    if not base or base.get("missing"):
        return "absent"
    if base.get("nan_frac", 0) > 0 or base.get("inf_frac", 0) > 0:
        return f"{100 * base.get('nan_frac', 0):.3g}% NaN, {100 * base.get('inf_frac', 0):.3g}% Inf"
    err = base.get("rel_l2", math.nan)
    if not isinstance(err, (int, float)) or math.isnan(err) or math.isinf(err):
        return f"rel_l2 {err}"
    if base.get("mistrusted"):
        return f"{100 * base.get('zero_frac', 0):.3g}% exact zeros where the reference is not negligible"
    return None


def sound_recipe(name: str, recipe_baselines: Optional[Callable[[], dict]]) -> Optional[tuple]:
    """(recipe, metrics) of the production recipe with the least rel_l2 on tensor ``name`` among
    those whose baseline is sound, or None."""
    if recipe_baselines is None:
        return None
    sound = {r: m[name] for r, m in (recipe_baselines() or {}).items()
             if m and m.get(name) and degenerate(m[name]) is None}
    if not sound:
        return None
    r = min(sound, key=lambda k: sound[k]["rel_l2"])
    return r, sound[r]


def _slice_label(kind: str, label) -> str:
    a, b = SLICE_KINDS.get(kind, ("slice", "part"))
    if kind in ("seq_block", "seq_start"):
        return f"sequence {label[0]} tokens {label[1]}-{label[2]}"
    return f"{a} {label[0]} {b} {label[1]}"


def slice_allowance(kind: str, label, tokens: Optional[int] = None) -> float:
    """The factor a >= 1 on a slice's baseline (module docstring): 1 + 1/sqrt(tokens) for a slice
    of o over a token range (``seq_start``, ``seq_block``: label [sequence, first, last]) or over
    one head of a sequence of ``tokens`` tokens (o's ``seq_head``, which carries ``tokens``);
    else 1 (a state's slice, or a record written before slices carried their tokens)."""
    if kind in ("seq_block", "seq_start"):
        tokens = int(label[2]) - int(label[1]) + 1
    if tokens is None:
        return 1.0
    return 1.0 + 1.0 / math.sqrt(max(1, int(tokens)))


def slice_errors(sl: dict) -> list:
    """Per-slice relative L2 of one kind of slices (the "slices" of ``metrics.tensor_metrics``), a slice whose
    reference rms is below NEGLIGIBLE_SLICE of the whole's measured on the whole's scale."""
    ref_tot, cnt_tot = sum(sl["ref_sq"]), sum(sl["count"])
    ms = ref_tot / cnt_tot if cnt_tot else 0.0
    out = []
    for e, r, c in zip(sl["err_sq"], sl["ref_sq"], sl["count"]):
        den = max(r, NEGLIGIBLE_SLICE ** 2 * ms * c)
        out.append(0.0 if e == 0 else (math.inf if den == 0 else math.sqrt(e / den)))
    return out


def judge_slices(name: str, met: dict, base: Optional[dict], tol) -> tuple[str, str, Optional[dict]]:
    """(status, reason, record of the worst slice) of every slice of one tensor against the same
    slice of the baseline (module docstring); ("pass", "", None) when the tensor has no slices."""
    sl = met.get("slices") or {}
    bsl = (base or {}).get("slices") or {}
    whole = float((base or {}).get("rel_l2", 0.0) or 0.0)
    worst = None
    for kind, part in sl.items():
        errs = slice_errors(part)
        bpart = bsl.get(kind)
        berrs = slice_errors(bpart) if bpart and len(bpart["err_sq"]) == len(errs) else [0.0] * len(errs)
        tokens = part.get("tokens")
        for i, (e, b) in enumerate(zip(errs, berrs)):
            a = slice_allowance(kind, part["labels"][i], tokens[i] if tokens else None)
            thr = tol.m * a * max(b, SLICE_FLOOR_SHARE * whole) + tol.floor
            margin = e / thr if thr > 0 else (0.0 if e == 0 else math.inf)
            if worst is None or margin > worst["margin"]:
                worst = {"kind": kind, "label": list(part["labels"][i]), "err": e, "baseline_err": b,
                         "tensor_baseline_err": whole, "allowance": a, "threshold": thr, "margin": margin}
    if worst is None:
        return "pass", "", None
    worst["where"] = _slice_label(worst["kind"], worst["label"])
    if worst["margin"] > 1:
        return "fail", (f"{name} {worst['where']}: rel_l2 {_fmt(worst['err'])} > {_fmt(worst['threshold'])} = "
                        f"{_fmt(tol.m)}*{'' if worst['allowance'] == 1 else _fmt(worst['allowance']) + '*'}"
                        f"max({_fmt(worst['baseline_err'])} slice, {_fmt(SLICE_FLOOR_SHARE * whole)} "
                        f"tensor)+{_fmt(tol.floor)} "
                        f"(tolerance {tol.key})"), worst
    return "pass", "", worst


def beyond_recipe_range(name: str, met: dict, real: dict, tol, recipe: str, in_rec: dict,
                        in_reason: str) -> Optional[tuple[str, dict]]:
    """(reason, record) of a tensor that failed against its recipe's in-range baseline but lies
    outside that recipe's range, or None (the failure stands).  ``real``: the recipe's metrics on
    the problem as given (``in_range`` and ``off_range`` inside).  Outside the range means: at
    the problem's own scale the recipe itself returns NaN, Inf or mostly zeros (``degenerate``),
    or it errs so much more that the kernel is within m x of it, the whole tensor and every
    slice (``judge_tensor`` / ``judge_slices`` against ``real``, the cap not applied: the cap is
    for a recipe in range).  A kernel doing what its recipe does there is this, never a pass."""
    off, inr = real.get("off_range", "off the typical range"), real["in_range"]
    where = f"{name}: outside the {recipe or 'route'} recipe's range ({off}: its fp16 storage flushes or overflows)"
    bad = degenerate(real)
    if bad is not None:
        rec = dict(in_rec, recipe_range={"off_range": off, "metric": "rel_l2", "at_scale": bad,
                                         "in_range": inr.get("rel_l2")})
        return (f"{where}: the recipe returns {bad} at this scale, rel_l2 {_fmt(inr.get('rel_l2'))} in range; "
                f"the kernel's rel_l2 {_fmt(met.get('rel_l2'))} ({in_reason})"), rec
    uncapped = dataclasses.replace(tol, cap=math.inf)
    status, _, rec = judge_tensor(name, met, real, uncapped)
    s_status, _, s_rec = judge_slices(name, met, real, uncapped)
    if status != "pass" or s_status != "pass":
        return None
    if s_rec is not None:
        rec["slice"], rec["tensor_margin"], rec["margin"] = s_rec, rec["margin"], max(rec["margin"], s_rec["margin"])
    metric = in_rec.get("metric") if in_rec.get("metric") in JUDGED_METRICS else "rel_l2"
    rec["in_range"] = {k: in_rec.get(k) for k in ("err", "threshold", "margin", "metric", "baseline_err")}
    rec["recipe_range"] = {"off_range": off, "metric": metric, "at_scale": real.get(metric),
                           "in_range": inr.get(metric)}
    return (f"{where}: the recipe errs {metric} {_fmt(real.get(metric))} at this scale, {_fmt(inr.get(metric))} in "
            f"range; the kernel's {_fmt(met.get(metric))} is within {_fmt(tol.m)}x the former (margin "
            f"{rec['margin']:.3g}), not the latter ({in_reason})"), rec


def expected_dtypes(name: str, problem, route) -> tuple[tuple, str]:
    """(the dtypes an output may have, what they are in words), the one dtype rule: o the
    problem's v dtype; final_state the route's declared state dtype (flag ``state_dtype``) when
    it declares one, else fp32 or the initial state's dtype (a kernel keeping an fp32 state
    returns fp32 whatever it was given); state_cache the cache's own dtype.  ((), "") for a
    tensor without a rule."""
    if name == "o":
        return (problem.v.dtype,), "the problem's v dtype"
    if name == "final_state":
        flag = route.flag("state_dtype") if hasattr(route, "flag") else None
        if flag is not None:
            declared = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(str(flag), flag)
            return (declared,), "the route's declared state_dtype"
        given = problem.initial_state.dtype if problem.initial_state is not None else torch.float32
        return tuple(dict.fromkeys((torch.float32, given))), "fp32, or the initial state's dtype"
    if name == "state_cache":
        return (problem.state_cache.dtype,), "the cache's own dtype"
    return (), ""


def cheaper_recipe_note(name: str, rec: dict, claimed: str, recipe_baselines) -> Optional[str]:
    """A note when tensor ``name``'s error is well above the claimed recipe's baseline and matches
    a recipe that rounds more (RECIPE_COST), e.g. a state stored bf16 between chunks."""
    err, b = rec.get("err", math.nan), rec.get("baseline_err", math.nan)
    if recipe_baselines is None or claimed not in RECIPE_COST or not (err > 1.5 * b > 0):
        return None
    for r in RECIPE_COST[:RECIPE_COST.index(claimed)]:
        m = ((recipe_baselines() or {}).get(r) or {}).get(name)
        if not m or degenerate(m):
            continue
        br = m.get(rec.get("metric", "rel_l2"), math.nan)
        if br > 1.5 * b and 0.67 * br <= err <= 1.5 * br:
            return (f"{name}: error {_fmt(err)} matches the {r} recipe's {_fmt(br)}, not the claimed {claimed}'s "
                    f"{_fmt(b)}: does the route round like {r}?")
    return None


def judge(backend: str, route, problem, outputs, truth, baseline: dict, db,
          recipe_baselines: Optional[Callable[[], dict]] = None) -> Verdict:
    """The verdict of one run: ``outputs`` (Outputs or name -> tensor) against ``truth`` (Truth
    or name -> float64 tensor), with ``baseline`` (baseline_metrics of the route's recipe) and
    the matching entries of ``db`` (a ToleranceDB).  ``recipe_baselines``: a callable giving
    every production recipe's baseline metrics on this case, asked only when a tensor fails at
    its cap (to lift a cap that no recipe can meet), when the route's own baseline is
    degenerate, or when the error is well above the claimed recipe's; None keeps every cap
    and makes a degenerate baseline ``not-applicable``.  ``check``, ``run`` and the pytest
    plugin all come here with the same arguments."""
    route_name = getattr(route, "name", str(route))
    recipe = getattr(route, "recipe", "")
    at_scale, baseline = baseline, in_range_view(baseline)      # every rule below first meets the in-range recipe
    if recipe_baselines is not None:
        recipe_baselines = (lambda every=recipe_baselines: {r: in_range_view(m) for r, m in (every() or {}).items()})
    outs, refs = _tensors(outputs), _tensors(truth)
    dtype = dtype_name(problem.v.dtype)
    statuses, reasons, records, metrics, notes = [], [], {}, {}, []
    shape_errors: dict = {}
    measured = compare(outs, refs, problem, shape_errors=shape_errors)    # one device->host read for all
    for name in refs:
        if name not in ("o", "final_state", "state_cache"):
            continue
        x = outs.get(name)
        tol = db.lookup(backend, route_name, dtype, name)
        met = measured[name]
        if name in shape_errors:
            records[name] = {"tolerance_key": tol.key, "err": math.nan, "threshold": math.nan,
                             "margin": math.inf, "metric": "shape", "baseline_err": math.nan}
            metrics[name] = met
            statuses.append("fail")
            reasons.append(str(shape_errors[name]))
            continue
        base = baseline.get(name)
        why = degenerate(base)
        kernel_broken = met.get("missing") or met["nan_frac"] > 0 or met["inf_frac"] > 0
        if why is not None and not kernel_broken:
            alt = sound_recipe(name, recipe_baselines)
            if alt is None:
                records[name] = {"tolerance_key": tol.key, "err": met.get("rel_l2"), "threshold": math.nan,
                                 "margin": math.nan, "metric": "rel_l2", "baseline_err": math.nan}
                metrics[name] = met
                statuses.append("not-applicable")
                reasons.append(f"{name}: the {recipe or 'route'} recipe's baseline is degenerate here ({why}) "
                               f"and no production recipe's is sound, so nothing can judge it")
                continue
            base = alt[1]
            notes.append(f"{name}: judged against the {alt[0]} recipe (the {recipe} baseline is degenerate: {why})")
        status, reason, rec = judge_tensor(name, met, base, tol)
        if why is not None and not kernel_broken:
            rec["baseline_recipe"] = alt[0]
        if status == "fail" and rec.get("threshold") == tol.cap:
            lift = lifted_cap(name, tol, recipe_baselines, own=base)
            if lift is not None and lift["to"] > tol.cap:
                status, reason, rec2 = judge_tensor(name, met, base, dataclasses.replace(tol, cap=lift["to"]))
                rec2.update({k: v for k, v in rec.items() if k == "baseline_recipe"})
                rec = rec2
                rec["cap_lifted"] = lift
                notes.append(f"{name}: cap {_fmt(lift['from'])} lifted to {_fmt(lift['to'])}: no recipe meets it here, "
                             f"the best ({lift['best_recipe']}) errs {_fmt(lift['best_err'])} in {lift['metric']}")
        if status in ("pass", "fail") and not kernel_broken:
            s_status, s_reason, s_rec = judge_slices(name, met, base, tol)
            if s_rec is not None:
                rec["slice"] = s_rec
                rec["tensor_margin"] = rec["margin"]
                rec["margin"] = max(rec["margin"], s_rec["margin"])
            if s_status == "fail" and status == "pass":
                status, reason = "fail", s_reason
            elif status == "fail" and s_rec is not None:
                reason += (f"; worst slice {s_rec['where']}: rel_l2 {_fmt(s_rec['err'])}, its baseline "
                           f"{_fmt(s_rec['baseline_err'])}")
        real = (at_scale or {}).get(name) or {}
        if (status in ("fail", "mistrusted") and why is None and not kernel_broken
                and not met.get("untouched_changed") and real.get("in_range")):
            beyond = beyond_recipe_range(name, met, real, tol, recipe, rec, reason)
            if beyond is not None:
                status, (reason, rec) = OUT_OF_CONTRACT, beyond
        want, why_dtype = expected_dtypes(name, problem, route)
        if x is not None and want:
            rec["dtype"] = dtype_name(x.dtype)
            rec["expected_dtype"] = dtype_name(x.dtype) if x.dtype in want else " or ".join(map(dtype_name, want))
            if x.dtype not in want:
                status = "fail"
                reason = ((reason + "; ") if reason else "") + (
                    f"{name}: dtype {dtype_name(x.dtype)}, expected {rec['expected_dtype']} ({why_dtype})")
        # no cheaper-recipe note where the claimed recipe's own error at this scale explains the error
        explained = bool(real.get("in_range")) and rec.get("err", math.nan) <= 1.5 * real.get(rec.get("metric"), 0.0)
        if status in ("pass", "fail") and not kernel_broken and not explained:
            note = cheaper_recipe_note(name, rec, recipe, recipe_baselines)
            if note:
                rec["cheaper_recipe"] = note
                notes.append(note)
        records[name], metrics[name] = rec, met
        statuses.append(status)
        if reason:
            reasons.append(reason)
    taps = {k: v for k, v in (getattr(outputs, "taps", None) or {}).items() if k in TAP_TENSORS}
    if taps:
        chunk = recipe_chunk(recipe)
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
        else:
            notes.append(f"ws_inv: not judged (C = {int(taps['ws_inv'].shape[-1])}, the {recipe or 'route'} "
                         f"recipe's chunk is {chunk})")
    if "fail" in statuses:
        status = "fail"
    elif "mistrusted" in statuses:
        status = "mistrusted"
    elif OUT_OF_CONTRACT in statuses:
        status = OUT_OF_CONTRACT
    elif "not-applicable" in statuses:
        status = "not-applicable"
    else:
        status = "pass"
    if status == "pass":
        worst = max(records.items(), key=lambda kv: kv[1]["margin"]) if records else None
        if worst is None:
            reason = "pass"
        else:
            sl = worst[1].get("slice")
            where = (f"{worst[0]} {sl['where']}" if sl and sl["margin"] >= worst[1].get("tensor_margin", 0)
                     else f"{worst[0]} {worst[1]['metric']}")
            reason = f"pass: worst margin {worst[1]['margin']:.3g} ({where})"
    else:
        reason = "; ".join(reasons)
    if notes:
        reason += " (" + "; ".join(notes) + ")"
    return Verdict(status=status, reason=reason, tensors=records, metrics=metrics, backend=backend,
                   route=route_name, recipe=recipe)


# ----------------------------------------------------------------------------------------
# The final status of a cell: the one place that decides it
# ----------------------------------------------------------------------------------------
@dataclass
class Decision:
    """A cell's final status and reason, and the record fields the decision adds
    (``known_failure``: the register entry that made it known-fail; ``contract_verdict``: the
    status it would have had inside the kernel's documented range)."""
    status: str
    reason: str
    fields: dict = field(default_factory=dict)

    def apply_to(self, rec):
        """Write the decision into a record (a verification.judging.record.Record, or a dict): the fields it
        adds (into the Record's ``extra``), status, reason."""
        rec.update(self.fields)
        rec["status"], rec["reason"] = self.status, self.reason
        return rec


def known_failure_entry(db, backend: str, route: str, case: str, params: Optional[dict] = None):
    """The entry of the known-failure register (tolerances.yaml) matching the cell, or None."""
    finder = getattr(db, "known_failure", None)
    return finder(backend, route, case, params) if finder else None


def decide(verdict, *, guard=None, contract: Optional[str] = None, known_failure=None,
           metrics: Optional[dict] = None) -> Decision:
    """The final status of a cell, decided once, in this order:

    1. ``verdict``: what ``judge`` made of the metrics against the baseline and the tolerance
       entry (or any object with status and reason: a kernel that raised is "error");
       ``not-applicable`` (no sound baseline) is recorded "skipped", never a pass;
       ``out-of-contract`` (outside the recipe's range, ``beyond_recipe_range``) stays so;
    2. ``guard`` (verification.running.guards): a violated memory guard fails the cell, its reason first;
    3. ``contract``: a problem outside the kernel's documented-but-unchecked range
       (kda_kernels.base.out_of_contract) makes the cell "out-of-contract", never a pass or a
       failure; the reason says what the kernel did (``metrics``: the record's);
    4. ``known_failure``: the register entry matching the cell makes a fail or mistrusted
       "known-fail"; on a pass the reason notes that the entry may be stale."""
    status, reason = str(verdict.status), str(getattr(verdict, "reason", "") or "")
    if status == NOT_APPLICABLE:
        status, reason = "skipped", f"not applicable: {reason}"
    if guard is not None and not guard.ok:
        status = "fail"
        reason = guard.reason + (f"; {reason}" if reason else "")
    if contract:
        return Decision("out-of-contract", out_of_contract_reason(contract, status, reason, metrics),
                        {"contract_verdict": {"status": status, "reason": reason}})
    if known_failure is not None:
        return _known(status, reason, known_failure)
    return Decision(status, reason)


def out_of_contract_reason(contract: str, status: str, reason: str, metrics: Optional[dict]) -> str:
    """What the kernel did outside its contract: raised (``reason``), or returned values (o rel_l2
    and tail, NaN/Inf and exact-zero fractions of o and the state against the oracle's)."""
    if status == "error":
        did = reason
    else:
        parts = []
        for tname, m in (metrics or {}).items():
            if not isinstance(m, dict) or "rel_l2" not in m:
                continue
            bad = num(m.get("nan_frac", 0.0)) + num(m.get("inf_frac", 0.0))
            part = f"{tname} rel_l2 {num(m['rel_l2']):.3g}"
            if tname == "o" and "tail_rel_l2" in m:
                part += f" (tail {num(m['tail_rel_l2']):.3g})"
            if bad:
                part += f", {100 * bad:.3g}% NaN/Inf"
            part += (f", {100 * num(m.get('zero_frac', 0.0)):.3g}% exact zeros"
                     f" (oracle {100 * num(m.get('ref_zero_frac', 0.0)):.3g}%)")
            parts.append(part)
        finite = all(num(m.get("nan_frac", 0.0)) == 0 and num(m.get("inf_frac", 0.0)) == 0
                     for m in (metrics or {}).values() if isinstance(m, dict) and "rel_l2" in m)
        did = f"the kernel returned {'finite values' if finite else 'non-finite values'}: " + "; ".join(parts)
    return f"out of contract ({contract}); {did}"


def _known(status: str, reason: str, kf) -> Decision:
    where = f"tolerances.yaml line {kf.line}" if kf.line else "tolerances.yaml"
    conditions = kf.describe_params() if hasattr(kf, "describe_params") else ""
    if status in ("fail", "mistrusted"):
        entry = {"reason": kf.reason, "evidence": kf.evidence, "line": kf.line, "status": status}
        if conditions:
            entry["params"] = conditions
        matched = f", parameters {conditions}" if conditions else ""
        return Decision("known-fail", f"known failure ({where}{matched}: {kf.reason}): {reason}",
                        {"known_failure": entry})
    if status == "pass":
        if conditions:   # a parameter region, not one case: one pass inside it does not make it stale
            reason = (f"{reason} [passes although its parameters ({conditions}) match the "
                      f"known failure at {where}: once no case of that region fails, remove the entry]")
        else:
            reason = f"{reason} [passes although listed as a known failure at {where}: remove the entry?]"
    return Decision(status, reason)
