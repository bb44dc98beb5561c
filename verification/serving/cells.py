"""Cells of the serving suite: one (serving case, prefill side, decode side), its record.

The pairings of a run (``pairings``): every trace route of the prefill backend that runs the
prefill group (or the --route named) crossed with every trace route of the decode backend that
runs decode or spec calls (or the --decode-route named).  A route that runs every group is on
both lists.

The baseline of a cell is the emulator's run of the same trace with the routes' recipes: the
emulator trace route named by the prefill route's recipe runs the prefill calls, the one named
by the decode route's recipe the decode and spec calls (``baseline_pairing``).  Where the
emulator has no such route (or no trace routes at all) the cell is not applicable with that
reason, never a pass.  The baseline's per-step errors are kept for the case and reused by every
cell with the same recipes (O(steps) numbers, not outputs).  ``BASELINE_ENV`` names another
backend to take the emulator's place (the harness's own tests use a test-local exact backend).

The record (``run_serving_cell``) is a verification.judging.record.Record, like every other
cell's: backend (``A``, or ``A+B`` for two backends), route (``prefill-route+decode-route``),
recipe, case, suite "serving", status (decided by verification.judging.verdict.decide: a not-applicable
pairing is "skipped", a raising call "error", the known-failure register applies), reason, the
worst o and state items in ``tensors`` (err, threshold, margin, metric rel_l2, baseline_err,
where), the worst margin, a repro line, and ``serving``: the pairing, the first failure, the
worst (request, step) and slot, the diagnosis, and for long-decode cases the drift curve.
"""
from __future__ import annotations

import math
import os
import shlex
import time
from typing import Optional

from kda_kernels.base import BackendError, RunsTraces, load_backend
from verification.errors import UsageError
from verification.judging.metrics import dtype_name
from verification.judging.record import decode_number, encode, new_record
from verification.judging.verdict import decide, known_failure_entry
from verification.running.compile_time import compile_clock
from verification.running.run_cell import _errored, _Said, note_self_judged
from verification.running.run_select import load
from verification.serving.execute import Pairing, Side, pairing_refusal, run_pairing, trace_groups

BASELINE_ENV = "KDA_SERVING_BASELINE"     # a backend spec standing in for the emulator as the baseline


def trace_routes_of(lb, option: str = "--backend") -> list:
    """The trace routes of a loaded backend, or a UsageError naming ``option`` when it has no
    RunsTraces."""
    if not isinstance(lb.backend, RunsTraces):
        raise UsageError(f"{option} {lb.spec}: runs no serving-trace calls (no RunsTraces)")
    return list(lb.backend.trace_routes())


def pick_routes(lb, names: Optional[list], groups: tuple, option: str, backend_option: str = "--backend") -> list:
    """The trace routes of ``lb`` running any of ``groups``, or the ones ``names`` picks (each
    must be a trace route of the backend and run one of the groups: else a UsageError)."""
    have = trace_routes_of(lb, backend_option)
    fits = [r for r in have if set(r.flag("groups", ()) or ()) & set(groups)]
    if not names:
        if not fits:
            raise UsageError(f"{option}: backend {lb.name!r} has no trace route running {' or '.join(groups)} "
                             f"calls (its trace routes: {', '.join(r.name for r in have) or 'none'})")
        return fits
    by = {r.name: r for r in have}
    out = []
    for n in names:
        if n not in by:
            raise UsageError(f"{option}: backend {lb.name!r} has no trace route {n!r}; expected one of: "
                             f"{', '.join(by) or '(none)'}")
        if by[n] not in fits:
            raise UsageError(f"{option}: trace route {n!r} of {lb.name!r} runs {', '.join(by[n].flag('groups', ()))} "
                             f"calls, not {' or '.join(groups)}")
        out.append(by[n])
    return out


def pairings(prefill_lb, decode_lb, routes: Optional[list], decode_routes: Optional[list],
             decode_option: str = "--backend") -> list:
    """[(prefill Route, decode Route)]: the cross product of module docstring.  --route picks
    the prefill side's routes; --decode-route the decode side's (default: every trace route of
    the decode backend running decode or spec calls)."""
    rp = pick_routes(prefill_lb, routes, ("prefill",), "--route")
    rd = pick_routes(decode_lb, decode_routes, ("decode", "spec"), "--decode-route", decode_option)
    return [(a, b) for a in rp for b in rd]


def case_pairs(case, pairs: list, routes_chosen: bool = False) -> list:
    """The pairings a case runs: all of ``pairs``, but a long trace (``case.long``: 10^4 decode
    steps whose prefill is its first step) runs each decode route once, after the first prefill
    route, unless the prefill routes were chosen (--route).  What a long trace verifies is the
    decode kernel's drift; each prefill route is verified by the short cases, and on an H200 a long
    cell took 64-141 s, once per prefill route (up to 12 routes of a backend)."""
    if not getattr(case, "long", False) or routes_chosen:
        return list(pairs)
    first = pairs[0][0] if pairs else None
    return [(a, b) for a, b in pairs if a is first]


def one_pairing(backend: str, decode_backend: Optional[str], route: Optional[str],
                decode_route: Optional[str]) -> tuple:
    """(prefill LoadedBackend, decode LoadedBackend, prefill Route, decode Route) of one cell named
    by its options (capture's and shrink's ``--backend --decode-backend --route --decode-route``):
    the decode side is the prefill backend unless another is named; an unnamed route is the
    side's first trace route running its calls.  A backend that cannot run here is a
    BackendError naming its option; a route that does not fit, the UsageError of pick_routes."""
    la = load(backend)
    lb = la if not decode_backend or decode_backend == backend else load(decode_backend)
    for x, opt in ((la, "--backend"), (lb, "--decode-backend")):
        if not x.available:
            raise BackendError(f"{opt}: {x.name} cannot run here: {x.reason}")
    rp = pick_routes(la, [route] if route else None, ("prefill",), "--route")[0]
    rd = pick_routes(lb, [decode_route] if decode_route else None, ("decode", "spec"), "--decode-route",
                     "--decode-backend" if lb is not la else "--backend")[0]
    return la, lb, rp, rd


def cell_names(prefill_lb, decode_lb, rp, rd) -> tuple:
    """(backend, route, recipe) of a cell's record."""
    backend = prefill_lb.name if prefill_lb.name == decode_lb.name else f"{prefill_lb.name}+{decode_lb.name}"
    return backend, f"{rp.name}+{rd.name}", f"{rp.recipe}+{rd.recipe}"


def baseline_pairing(rp, rd, spec: Optional[str] = None) -> tuple:
    """(Pairing of the baseline backend's trace routes named by the recipes, None) or (None, why)."""
    spec = spec or os.environ.get(BASELINE_ENV) or "emulator"
    try:
        emu = load_backend(spec)
    except BackendError as e:
        return None, f"the baseline backend {spec!r} cannot be loaded: {e}"
    if not isinstance(emu, RunsTraces):
        return None, f"the {spec} backend runs no serving-trace calls yet (no RunsTraces), so no baseline exists"
    by = {r.name: r for r in emu.trace_routes()}
    missing = [r for r in dict.fromkeys((rp.recipe, rd.recipe)) if r not in by]
    if missing:
        return None, (f"the {spec} backend has no trace route {missing[0]!r} (the recipe of "
                      f"{rp.name if rp.recipe == missing[0] else rd.name}), so no baseline exists")
    return Pairing(Side(emu, by[rp.recipe]), Side(emu, by[rd.recipe])), None


def tolerances_for(db, pairing: Pairing, dtype: str) -> dict:
    """{group: {"o": Tolerance, "state_cache": Tolerance}} of each group's side."""
    out = {}
    for g in ("prefill", "decode", "spec"):
        side = pairing.side(g)
        out[g] = {t: db.lookup(side.name, side.route.name, dtype, t) for t in ("o", "state_cache")}
    return out


def repro(prefill_lb, decode_lb, rp, rd, case) -> str:
    parts = ["kda-verify", "run", "--suite", "serving", "--backend", prefill_lb.spec, "--route", rp.name]
    if decode_lb.spec != prefill_lb.spec:
        parts += ["--decode-backend", decode_lb.spec]
    parts += ["--decode-route", rd.name, "--case", case.id, "--out", "DIR"]
    return " ".join(shlex.quote(p) for p in parts)


def _item_record(it) -> Optional[dict]:
    if it is None:
        return None
    d = it.to_dict()
    d.update(metric="rel_l2", tolerance_key="")
    return d


def _shape(tr) -> dict:
    reqs = len(set(tr.row_request.tolist()) - {-1})
    return {"B": 1, "T": tr.tokens, "steps": tr.steps, "rows": tr.rows, "tokens": tr.tokens, "requests": reqs, "H": tr.H, "HV": tr.HV,
            "K": tr.K, "V": tr.V, "slots": tr.cache.slots, "layout": tr.cache.layout,
            "cache_dtype": tr.cache.dtype, "pad": tr.cache.pad}


class TraceCache:
    """The current case's trace and its baselines' per-step errors (cells run case-major)."""

    def __init__(self):
        self.case_id = None
        self.trace = None
        self.groups = None
        self.baselines: dict = {}

    def get(self, case):
        if case.id != self.case_id:
            self.case_id, self.trace, self.baselines = case.id, None, {}
            self.trace = case.build()
            self.groups = trace_groups(self.trace)
        return self.trace


LONG_STEPS = 2000      # a trace of at least this many steps says how far it is every LONG_STEPS steps


def run_serving_cell(prefill_lb, decode_lb, rp, rd, case, db, cache: TraceCache, device: str = "cpu",
                     baseline_spec: Optional[str] = None, progress=None):
    """One cell's record (module docstring); never raises for a kernel's sake.  ``progress``: a
    stream that a long trace (LONG_STEPS steps or more) writes a line to every LONG_STEPS steps."""
    backend, route, recipe = cell_names(prefill_lb, decode_lb, rp, rd)
    rec = new_record(backend=backend,
                     backend_spec=prefill_lb.spec if prefill_lb.spec == decode_lb.spec
                     else f"{prefill_lb.spec}+{decode_lb.spec}",
                     backend_version=prefill_lb.version if prefill_lb is decode_lb
                     else f"{prefill_lb.version}+{decode_lb.version}",
                     route=route, recipe=recipe, case=case.id, suite=case.suite, seed=case.seed,
                     params=dict(case.params), device=str(device), repro=repro(prefill_lb, decode_lb, rp, rd, case))
    pairing = Pairing(Side(prefill_lb.backend, rp), Side(decode_lb.backend, rd))
    rec["serving"] = {"prefill": {"backend": prefill_lb.name, "route": rp.name, "recipe": rp.recipe},
                      "decode": {"backend": decode_lb.name, "route": rd.name, "recipe": rd.recipe},
                      "reference": case.reference or None}
    for lb in (prefill_lb, decode_lb):
        if not lb.available:
            rec.update(status="skipped", reason=f"backend unavailable: {lb.reason or 'no reason given'}")
            return rec
    t0 = time.perf_counter()
    built = cache.case_id != case.id            # this cell builds the trace (the cache holds one case's)
    try:
        tr = cache.get(case)
    except Exception as e:  # noqa: BLE001 - a case that cannot build is the harness's error, recorded
        return _errored(rec, e, f"case {case.id} build")
    rec.shape = _shape(tr)
    rec["dtype"] = dtype_name(tr.v.dtype)
    build_s = time.perf_counter() - t0
    why = pairing_refusal(tr, pairing, cache.groups)
    if why is None:
        base, why = baseline_pairing(rp, rd, baseline_spec)
    if why is not None:
        rec.update(status="skipped", reason=why if why.startswith("not applicable") else f"not applicable: {why}")
        return rec
    key = (rp.recipe, rd.recipe)
    rows = cache.baselines.get(key)
    clock = compile_clock()
    mark = clock.mark()
    t1 = time.perf_counter()
    try:
        res = run_pairing(tr, pairing, tolerances_for(db, pairing, rec["dtype"]),
                          baseline=None if rows is not None else base, baseline_rows=rows,
                          device=device, drift=case.drift, on_step=_step_note(progress, rec, tr.steps))
    except Exception as e:  # noqa: BLE001 - the harness's own failure on this cell, recorded
        return _errored(rec, e, "serving trace run")
    if res.baseline_rows is not None and res.status != "error":
        cache.baselines[key] = res.baseline_rows
    rec["timings"] = _timings(res.seconds, build_s, time.perf_counter() - t1, rows is not None, built,
                              compile_how=clock.how, **clock.since(mark))
    tensors = {}
    if res.worst_o is not None:
        tensors["o"] = _item_record(res.worst_o)
    if res.worst_state is not None:
        tensors["state_cache"] = _item_record(res.worst_state)
    rec["tensors"] = encode(tensors)
    margins = [t["margin"] for t in tensors.values()]
    rec["margin"] = encode(max(margins)) if margins else None
    srv = rec["serving"]
    srv.update(steps=res.steps, failing_steps=res.failing_steps, diagnosis=res.diagnosis,
               first_failure=_item_record(res.first_failure), worst=_item_record(res.worst),
               failures=[_item_record(i) for i in res.failures[:5]])
    if res.drift:
        srv["drift"] = res.drift
    rec["serving"] = encode(srv)
    status = {"not-applicable": "not-applicable"}.get(res.status, res.status)
    kf = known_failure_entry(db, rec["backend"], rec["route"], rec["case"], rec.get("params"))
    return note_self_judged(decide(_Said(status, res.reason), known_failure=kf).apply_to(rec))


def _timings(seconds: dict, build_s: float, run_s: float, baseline_cached: bool, built: bool, **compile_info) -> dict:
    """A serving cell's ``timings`` in the parts of verification.running.timing: build (the trace,
    when this cell built it), oracle (the truth's steps), baseline (the walk's time on the
    baseline's steps: computed in line, or waited for from the process beside it; cached when an
    earlier cell's errors were reused), compile (Triton, inside the calls), kernel (the
    pairing's steps less compile), metrics (measure and judge; on a GPU the calls run
    asynchronously and the wait for them is in metrics, in the one transfer per step), and
    ``run_s``, the whole of the run."""
    compile_s = float(compile_info.get("compile_s") or 0.0)
    return {"build_s": build_s, "build_cached": not built, "oracle_s": seconds["oracle"], "oracle_cached": False,
            "baseline_s": seconds["baseline"], "baseline_cached": baseline_cached,
            "kernel_s": max(0.0, seconds["kernel"] - compile_s), "metrics_s": seconds["metrics"],
            "run_s": run_s, **compile_info}


def _step_note(stream, rec: dict, steps: int):
    if stream is None or steps < LONG_STEPS:
        return None
    t0 = time.perf_counter()

    def note(s, verdict):
        if (s + 1) % LONG_STEPS == 0:
            el = time.perf_counter() - t0
            stream.write(f"  {rec['backend']} {rec['route']} {rec['case']}: step {s + 1}/{steps} "
                         f"({el:.0f} s, about {el / (s + 1) * (steps - s - 1):.0f} s left)\n")
            stream.flush()
    return note


def worst_margin_of(rec: dict) -> float:
    m = decode_number(rec.get("margin"))
    return m if not math.isnan(m) else -1.0
