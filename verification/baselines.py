"""Baselines: what the route's recipe, emulated, errs against the same oracle on the same case.

A cell's yardstick is the emulator's run of the route's recipe (``Route.recipe``: a name of
``RECIPES`` of kda_kernels/emulator.py) measured against the float64 truth with the same
metrics as the kernel (``baseline_metrics``); a problem off unit scale is measured at unit
scale (``unit_scale``).  ``BaselineCache`` computes each (case, recipe) once per run;
``recipe_baselines`` gives every production recipe's (for a cap lift or a degenerate baseline,
verification/verdict.py).  The verdict, not this module, decides what a baseline allows.
"""
from __future__ import annotations

import math
import time

from verification.metrics import compare

UNIT_SCALE_RANGE = (2.0 ** -8, 2.0 ** 8)   # rms(v) outside this: the baseline is measured at unit scale
TAP_TENSORS = ("ws_inv",)


def _recipes() -> dict:
    from kda_kernels.emulator import RECIPES
    return RECIPES


def recipe_chunk(recipe: str):
    """The chunk size of a production recipe, None for a name that is none."""
    recipes = _recipes()
    return recipes[recipe].chunk if recipe in recipes else None


def _tensors(x) -> dict:
    return x.tensors() if hasattr(x, "tensors") else dict(x)


def unit_scale(problem) -> float:
    """The power of two 2^round(log2 rms(v)) when rms(v) lies outside UNIT_SCALE_RANGE, else 1.

    o and every state are linear in (v, initial state) for fixed q, k, g, beta, so the exact
    forward of (v / s, S0 / s) is the exact forward of (v, S0) divided by s; a power of two
    divides every format exactly.  A recipe's error at unit scale is what it reaches without
    the under- or overflow of its fixed-range operands (fp16 u = beta (v - kd S) flushes at
    |v| ~ 1e-6 and overflows at 3e4), so a bug caught at normal scale stays caught."""
    v = problem.v.detach().double()
    if v.numel() == 0:
        return 1.0
    rms = float(v.square().mean().sqrt())
    lo, hi = UNIT_SCALE_RANGE
    if not math.isfinite(rms) or rms == 0.0 or lo <= rms <= hi:
        return 1.0
    return 2.0 ** round(math.log2(rms))


def at_unit_scale(problem, truth, s: float):
    """(problem, truth) with v, the initial state, the state cache and every truth tensor
    divided by s (``unit_scale``)."""
    ch = {"v": (problem.v.double() / s).to(problem.v.dtype)}
    if problem.initial_state is not None:
        ch["initial_state"] = (problem.initial_state.double() / s).to(problem.initial_state.dtype)
    if problem.state_cache is not None:
        ch["state_cache"] = (problem.state_cache.double() / s).to(problem.state_cache.dtype)
    return problem.replace(**ch), {k: v / s for k, v in _tensors(truth).items()}


def baseline_metrics(problem, recipe: str, truth, taps: bool = False) -> dict:
    """Metrics of the emulator's ``recipe`` against ``truth`` (name -> metrics dict); a pure
    function of its arguments, so the caller may cache it per (case, recipe).  With ``taps``
    it also holds the stored inverse's metrics (``ws_inv``) against the oracle workspace.
    On a problem off unit scale (``unit_scale``) the recipe runs at unit scale and every
    tensor's metrics carry ``unit_scale``: s."""
    from kda_kernels.emulator import emulate
    s = unit_scale(problem)
    refs = _tensors(truth)
    if s != 1.0:
        problem, refs = at_unit_scale(problem, truth, s)
    out = emulate(problem, recipe, taps=taps)
    result = compare(out.tensors(), refs, problem)
    if taps:
        result.update(tap_metrics(problem, out.taps))
    if s != 1.0:
        for m in result.values():
            m["unit_scale"] = s
    return result


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


class BaselineCache:
    """The baseline metrics of each (case, recipe): the emulated recipe against the truth."""

    def __init__(self):
        self._store: dict = {}
        self.computed: dict = {}

    def prime(self, case_id: str, recipe: str, metrics: dict, seconds: float = 0.0) -> None:
        self._store[(case_id, recipe)] = (metrics, float(seconds))

    def get(self, case, recipe: str, problem, truth) -> tuple[dict, float, bool]:
        key = (case.id, recipe)
        if key in self._store:
            m, s = self._store[key]
            return m, s, False
        t0 = time.perf_counter()
        m = baseline_metrics(problem, recipe, truth)
        s = time.perf_counter() - t0
        self.computed[key] = self.computed.get(key, 0) + 1
        self._store[key] = (m, s)
        return m, s, True

    def forget_case(self, case_id: str) -> None:
        for key in [k for k in self._store if k[0] == case_id]:
            del self._store[key]


def recipe_baselines(baseline_cache: BaselineCache, case, problem, truth, timings: dict) -> dict:
    """Every production recipe's baseline metrics on the case (for a cap lift; cached per
    case and recipe like the route's own baseline; the time is added to baseline_s)."""
    out = {}
    for recipe in _recipes():
        m, s, fresh = baseline_cache.get(case, recipe, problem, truth)
        if fresh:
            timings["baseline_s"] = timings.get("baseline_s", 0.0) + s
        out[recipe] = m
    return out
