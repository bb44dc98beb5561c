"""Running a serving trace on a pairing of backends, step by step, judged as it goes.

A **pairing** names who runs what: the prefill side (backend, route) runs the ``prefill`` calls
of every step, the decode side runs the ``decode`` and ``spec`` calls (kda_kernels.trace_calls
decides the split; padding rows ride with the decode or spec call).  Both sides may be one
backend.  Each side's route must run the groups the trace has (its flag ("groups", (...))).

Per step (``TraceRun.step``): the cache buffer is copied (the state before the step), the step
is split into calls, each call runs on its side (the buffer copied before it, so the judge can
say which call changed an element), and o is assembled from the calls' outputs.  ``run_pairing``
walks the oracle (kda_ref.trace_oracle) in step with the kernel's run and the baseline's run (the
emulator with the routes' recipes: the prefill route's recipe for prefill calls, the decode
route's for decode and spec calls) and judges each step (verification.serving.judge).  Memory is
O(steps) only for the summary rows (each step's worst item, the drift curve, the baseline's
per-step errors that later cells of the same case and recipes reuse), never for outputs.

The first failing step is diagnosed (verification.serving.diagnose): a state handed from one
side to the other in another layout or dtype, a row that read the wrong state.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import math
import multiprocessing
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from kda_kernels.trace_calls import GROUPS, assemble, group_rows, split_step, trace_model
from kda_ref.trace import Trace
from kda_ref.trace_oracle import trace_oracle
from verification.serving.diagnose import diagnose
from verification.serving.judge import CallInfo, Item, changed_mask, judge_step, measure


@dataclass(frozen=True)
class Side:
    """One side of a pairing: a RunsTraces backend and one of its trace routes."""
    backend: object
    route: object

    @property
    def name(self) -> str:
        return str(getattr(self.backend, "name", type(self.backend).__name__))

    @property
    def label(self) -> str:
        return f"{self.name}:{self.route.name}"

    @property
    def groups(self) -> tuple:
        return tuple(self.route.flag("groups", ()) or ())


@dataclass(frozen=True)
class Pairing:
    prefill: Side
    decode: Side

    def side(self, group: str) -> Side:
        return self.prefill if group == "prefill" else self.decode

    def describe(self) -> str:
        return f"prefill {self.prefill.label}, decode {self.decode.label}"


class CallFailed(RuntimeError):
    """A backend raised (or returned a malformed o) in one call; the message names step and call."""

    def __init__(self, msg: str, step: int, call: str):
        super().__init__(msg)
        self.step, self.call = step, call


def trace_groups(tr: Trace) -> set:
    """The call groups the trace's steps make (kda_kernels.trace_calls.group_rows)."""
    out = set()
    phases = tr.row_phase.tolist()
    bounds = tr.step_rows.tolist()
    for s in range(len(bounds) - 1):
        out.update(group_rows(phases[bounds[s]:bounds[s + 1]]))
    return out


def pairing_refusal(tr: Trace, pairing: Pairing, groups: Optional[set] = None) -> Optional[str]:
    """Why the pairing cannot run the trace ("not applicable: ..."), or None: a side whose route
    does not run a group the trace has, or a side's trace_accepts."""
    groups = trace_groups(tr) if groups is None else groups
    for g in GROUPS:
        if g not in groups:
            continue
        side = pairing.side(g)
        if g not in side.groups:
            return (f"not applicable: the trace has {g} calls, which {side.label} does not run "
                    f"(its groups: {', '.join(side.groups) or 'none'})")
    for which, side in (("prefill", pairing.prefill), ("decode", pairing.decode)):
        if which == "prefill" and "prefill" not in groups:
            continue
        if which == "decode" and not groups & {"decode", "spec"}:
            continue
        ok, why = side.backend.trace_accepts(tr, side.route)
        if not ok:
            why = str(why or "not applicable")
            return why if why.startswith("not applicable") else f"not applicable: {why}"
    return None


@dataclass
class StepRun:
    o: torch.Tensor             # [Tstep, HV, V] as the calls returned it (NaN where no call produced a token)
    before: torch.Tensor        # the flat cache buffer before the step (a copy)
    after: torch.Tensor         # the buffer after the step (the live buffer: valid until the next step)
    calls: list                 # [CallInfo]


def fresh_cache(spec, device="cpu") -> torch.Tensor:
    """A trace's flat cache buffer before its first step: every slot NaN, so a read of a slot
    nothing wrote shows in o; the guard rows, the padding between slots and, under the NULL-block
    convention, slot 0 a fixed finite pattern in [-1, 1), so that a padding row which reads its pad
    slot and writes a state back changes bits there (NaN read, NaN written would leave them equal:
    fla's unguarded decode kernel did exactly that on the CPU and went unseen)."""
    buf = spec.allocate(float("nan"), device=device)
    gen = torch.Generator().manual_seed(0)
    pattern = (torch.rand(buf.numel(), generator=gen) * 2 - 1).to(buf.dtype).to(buf.device)
    keep = spec.outside_slots(device=buf.device)
    if spec.pad == "null0":
        view = torch.zeros(buf.numel(), dtype=torch.bool, device=buf.device)
        spec.view(view)[0] = True
        keep = keep | view
    buf[keep] = pattern[keep]
    return buf


class TraceRun:
    """A pairing's run of a trace over its own cache buffer (``fresh_cache``).  ``step(s)`` runs
    step s; steps must be taken in order."""

    def __init__(self, tr: Trace, pairing: Pairing, device="cpu", record_writers: bool = True):
        self.trace, self.pairing = tr, pairing
        self.cache = fresh_cache(tr.cache, device=device)
        self.model = trace_model(tr, self.cache.device)
        self.record_writers = record_writers

    def step(self, s: int) -> StepRun:
        tr = self.trace
        before = self.cache.clone()
        calls = split_step(tr, s, self.cache, self.model)
        outs, infos = [], []
        T = int(tr.row_tokens()[int(tr.step_rows[s + 1])] - tr.row_tokens()[int(tr.step_rows[s])])
        for c in calls:
            side = self.pairing.side(c.group)
            label = f"{c.group} {side.label}"
            snap = self.cache.clone() if self.record_writers else None
            try:
                out = side.backend.run_call(c, side.route)
            except Exception as e:  # noqa: BLE001 - the kernel's failure is a result
                msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
                raise CallFailed(f"step {s} call {label} (rows {c.rows.tolist()}) raised {type(e).__name__}: {msg}",
                                 s, label) from e
            want = (1, c.tokens, tr.HV, tr.V)
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise CallFailed(f"step {s} call {label}: expected o of shape {list(want)}, got {got}", s, label)
            outs.append(out)
            rows = c.rows.tolist()
            infos.append(CallInfo(group=c.group, label=label, rows=rows,
                                  tables=[tr.state_indices[r].tolist() for r in rows],
                                  phases=[int(tr.row_phase[r]) for r in rows],
                                  changed=changed_mask(snap, self.cache) if snap is not None else None))
        o = assemble(calls, outs, T)
        return StepRun(o=o, before=before, after=self.cache, calls=infos)


def same_pairing(a: Pairing, b: Pairing) -> bool:
    """Whether two pairings run the same backends' same routes on each side (by name): a kernel
    that is its own baseline is run once."""
    return all(x.name == y.name and x.route.name == y.route.name
               for x, y in ((a.prefill, b.prefill), (a.decode, b.decode)))


def compact(m: dict) -> dict:
    """A baseline's ``measure`` of one step, kept small: row errors only (what judge_step reads)."""
    return {"rows": {r: (v[0],) for r, v in m["rows"].items()}, "step": m["step"], "slots": dict(m["slots"])}


@dataclass
class PairingResult:
    """What one pairing did on one trace (``run_pairing``)."""
    status: str                                   # pass | fail | not-applicable | error
    reason: str = ""
    steps: int = 0                                # steps judged
    first_failure: Optional[Item] = None
    worst: Optional[Item] = None                  # the judged item of largest margin (failing or not)
    worst_o: Optional[Item] = None
    worst_state: Optional[Item] = None
    failures: list = field(default_factory=list)  # the first MAX_FAILURES failing items
    failing_steps: int = 0
    diagnosis: Optional[str] = None
    drift: Optional[dict] = None                  # long-decode cases: error against decode step
    baseline_rows: Optional[list] = None          # the baseline's compact errors per step (reusable)
    not_applicable: list = field(default_factory=list)
    # seconds: "kernel" (the pairing's steps: split, calls, copies), "baseline" (the baseline's
    # steps and their measure), "oracle" (the truth's steps), "metrics" (measure, judge, the rest)
    seconds: dict = field(default_factory=lambda: {"kernel": 0.0, "baseline": 0.0, "oracle": 0.0, "metrics": 0.0})


MAX_FAILURES = 20
DRIFT_POINTS = 400
# Where the baseline (the emulator's run of the routes' recipes) runs, whatever device the kernel
# runs on: its per-step errors are the recipes' rounding, not the device's, and on the host its
# ~120 small operations per decode token neither launch GPU kernels nor wait on the device.  On
# one H200 shared by 15 workers a 10^4-step decode cell ran past 170 s with the baseline beside
# the kernel on the GPU.
BASELINE_DEVICE = "cpu"


def _better(a: Optional[Item], b: Item) -> Item:
    if a is None:
        return b
    return b if (b.margin > a.margin or (math.isnan(a.margin) and not math.isnan(b.margin))) else a


def _one_torch_thread(fn):
    """Run ``fn`` on one torch thread, restoring the caller's setting after.  The host's share of
    a serving run (the oracle, the baseline: BASELINE_DEVICE, the judge) is arrays of a few
    hundred kB, and with torch's threads contending with other processes (2 cores shared here; 16
    shared by 15 workers on the H200's host) a decode step of the long cases ran 100x slower
    (233 ms against 2.4 ms)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        prev = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(prev)
    return run


@_one_torch_thread
def run_pairing(tr: Trace, pairing: Pairing, tols: dict, baseline: Optional[Pairing] = None,
                baseline_rows: Optional[list] = None, device="cpu", drift: bool = False,
                on_step: Optional[Callable] = None) -> PairingResult:
    """Run ``tr`` on ``pairing``, judging every step against the oracle and the baseline
    (module docstring).  ``baseline``: the emulator's pairing, run alongside; or
    ``baseline_rows``: its compact per-step errors from an earlier cell (then it is not run).
    ``tols``: {group: {"o": Tolerance, "state_cache": Tolerance}} (the route of each group's
    side).  ``drift``: keep the error of every decode step (downsampled to DRIFT_POINTS bins, the
    worst of each bin).  Never raises for a kernel's sake: a call that raises is status "error"
    naming the step and the call.  The baseline runs on the host (BASELINE_DEVICE) whatever
    ``device`` is (``baseline_ahead``: in line, or beside the walk for a long trace), and the run
    holds torch to one thread (``_one_torch_thread``).  ``seconds["baseline"]`` is the time the
    walk spent on the baseline (computing it, or waiting for it)."""
    res = PairingResult(status="pass")
    kr = TraceRun(tr, pairing, device=device)
    itself = baseline is not None and baseline_rows is None and same_pairing(pairing, baseline)
    ahead = (baseline_ahead(tr, baseline) if baseline_rows is None and not itself else None)
    rows_out = [] if (ahead is not None or itself) else None
    with contextlib.ExitStack() as stack:
        if ahead is not None:
            stack.callback(ahead.close)        # a run that ends early stops the baseline beside it
        writers: dict = {}            # slot -> (side label, group, step, request) of its last write
        previous: dict = {}           # slot -> (step of its last write, its content before that write)
        drift_pts = [] if drift else None
        sec = res.seconds
        truths = iter(trace_oracle(tr))
        while True:
            t0 = time.perf_counter()
            st = next(truths, None)
            t1 = time.perf_counter()
            sec["oracle"] += t1 - t0
            if st is None:
                break
            s = st.step
            if ahead is not None:
                try:
                    rows_out.append(ahead.next())
                except CallFailed as e:
                    res.status, res.reason = "not-applicable", f"the baseline (emulator) failed: {e}"
                    return res
                base = rows_out[-1]
            elif not itself:
                base = baseline_rows[s]
            t2 = time.perf_counter()
            sec["baseline"] += t2 - t1
            try:
                r = kr.step(s)
            except CallFailed as e:
                res.status, res.reason = "error", str(e)
                res.steps = s
                return res
            t3 = time.perf_counter()
            sec["kernel"] += t3 - t2
            km = measure(st, r.o, r.after, before=r.before)
            if itself:                          # the kernel is its own baseline (the emulator): measured once
                rows_out.append(compact(km))
                base = rows_out[-1]
            v = judge_step(st, base, r.o, r.before, r.after, tols, r.calls, kernel=km)
            res.steps = s + 1
            for it in v.items:
                if it.status == "not-applicable":
                    if len(res.not_applicable) < MAX_FAILURES:
                        res.not_applicable.append(it)
                    continue
                res.worst = _better(res.worst, it)
                if it.kind == "o":
                    res.worst_o = _better(res.worst_o, it)
                elif it.kind == "state":
                    res.worst_state = _better(res.worst_state, it)
            failed = v.failed
            if failed:
                res.failing_steps += 1
                if res.first_failure is None:
                    res.first_failure = failed[0]
                    try:
                        res.diagnosis = diagnose(tr, st, v, r, pairing, writers, previous)
                    except Exception as e:  # noqa: BLE001 - a diagnosis that breaks must not hide the verdict
                        res.diagnosis = f"(diagnosis failed: {type(e).__name__}: {e})"
                res.failures.extend(failed[:max(0, MAX_FAILURES - len(res.failures))])
            if drift_pts is not None:
                _drift_point(drift_pts, st, v, base)
            view_before = tr.cache.view(r.before)
            for rp in st.plan.rows:
                c = next((c for c in r.calls if rp.row in c.rows), None)
                for _, slot in rp.writes:
                    writers[slot] = (c.label if c else "", c.group if c else "", s, rp.request)
                    previous[slot] = (s, view_before[slot].clone())
            if on_step is not None:
                on_step(s, v)
            sec["metrics"] += time.perf_counter() - t3
        res.baseline_rows = rows_out if rows_out is not None else baseline_rows
        if drift_pts is not None:
            res.drift = _drift_summary(drift_pts, tr)
        if res.first_failure is not None:
            f = res.first_failure
            res.status = "fail"
            more = f"; {res.failing_steps} failing step(s) in all" if res.failing_steps > 1 else ""
            res.reason = f"first failure at step {f.step}: {f.reason}{more}"
            if res.diagnosis:
                res.reason = f"{res.diagnosis}; {res.reason}"
        elif res.not_applicable and res.worst is None:
            res.status, res.reason = "not-applicable", res.not_applicable[0].reason
        elif res.not_applicable:
            res.status = "not-applicable"
            res.reason = (f"{len(res.not_applicable)} item(s) not judged: {res.not_applicable[0].reason} "
                          f"(the rest passed, worst margin {res.worst.margin:.3g})")
        else:
            w = res.worst
            res.reason = (f"pass: {res.steps} steps, worst margin {w.margin:.3g} ({w.kind} {w.where})" if w
                          else f"pass: {res.steps} steps, nothing to judge")
        return res


def _baseline_rows(tr: Trace, baseline: Pairing):
    """The baseline's compact errors (``compact(measure(...))``) of every step of ``tr``, in step
    order: the baseline pairing's run on BASELINE_DEVICE beside its own walk of the oracle.  A
    call that raises raises CallFailed here."""
    br = TraceRun(tr, baseline, device=BASELINE_DEVICE, record_writers=False)
    for st in trace_oracle(tr):
        b = br.step(st.step)
        yield compact(measure(st, b.o, b.after))


class BaselineInline:
    """The baseline's rows computed when asked (``next``), one step at a time in the walk's own
    thread: a short trace's (``baseline_ahead``)."""

    def __init__(self, tr: Trace, baseline: Pairing):
        self.rows = _baseline_rows(tr, baseline)

    def next(self) -> dict:
        return next(self.rows)

    def close(self) -> None:
        self.rows.close()


# A trace of at least this many steps runs its baseline in a forked process (BaselineProcess) where
# the platform forks; a shorter one in line (BaselineInline).
BASELINE_PROCESS_STEPS = 2000


def baseline_ahead(tr: Trace, baseline: Pairing):
    """The baseline's run of ``tr`` for the kernel's walk: a forked process beside it for a long
    trace, in line otherwise.  Both hand over the same rows in step order (``next``) and are
    stopped by ``close``.

    Why a process: the baseline is the host's arithmetic (~120 small operations per decode token,
    about 1.8 ms per step on the H200's host); in line, a 10^4-step cell spent 18-20 s of its
    37-54 s in it.  A thread does not help: the operations' Python holds the GIL, and beside the
    kernel's walk the H200's long cells spent 22 s in the kernel's steps and 17 s judging, against
    12 s and 9 s in line (3 s saved of 54).  In a forked process the walk waited under 1 s."""
    if tr.steps >= BASELINE_PROCESS_STEPS and "fork" in multiprocessing.get_all_start_methods():
        return BaselineProcess(tr, baseline)
    return BaselineInline(tr, baseline)


def _baseline_child(conn, tr: Trace, baseline: Pairing) -> None:
    """The forked process of BaselineProcess: the baseline's rows in batches, then ("end", None);
    a call that raised: ("failed", (message, step, call)); anything else: ("raised", its name and
    message).  It uses the host only (BASELINE_DEVICE): a process forked from one that holds a
    CUDA context must not touch the GPU."""
    torch.set_num_threads(1)
    batch: list = []
    try:
        for row in _baseline_rows(tr, baseline):
            batch.append(row)
            if len(batch) >= 256:
                conn.send(("rows", batch))
                batch = []
        conn.send(("rows", batch))
        conn.send(("end", None))
    except CallFailed as e:
        conn.send(("rows", batch))
        conn.send(("failed", (str(e), e.step, e.call)))
    except BaseException as e:  # noqa: BLE001 - handed to the parent, raised there
        conn.send(("rows", batch))
        conn.send(("raised", (type(e).__name__, str(e))))
    finally:
        conn.close()


class BaselineProcess:
    """``_baseline_rows`` from a forked process (``baseline_ahead``): the same rows, the same
    order, a failing call raised as CallFailed by ``next``, an interrupt as KeyboardInterrupt,
    anything else as a RuntimeError naming it."""

    STALL_S = 120.0     # no batch for this long (a batch is 256 steps, about 0.5 s on the H200's host): an error

    def __init__(self, tr: Trace, baseline: Pairing):
        ctx = multiprocessing.get_context("fork")
        self.conn, child = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_baseline_child, args=(child, tr, baseline), name="kda-verify baseline",
                                daemon=True)
        with warnings.catch_warnings():
            # Python 3.12 warns on any fork of a process with threads (torch's, CUDA's).  The child
            # runs torch on the host, on one thread, as a DataLoader's forked workers do; a child
            # that hangs anyway is an error after STALL_S, never a hung cell.
            warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks", category=DeprecationWarning)
            self.proc.start()
        child.close()
        self.rows: collections.deque = collections.deque()

    def next(self) -> dict:
        while not self.rows:
            if not self.conn.poll(self.STALL_S):
                raise RuntimeError(f"the baseline's process sent nothing for {self.STALL_S:g} s "
                                   f"({'still running' if self.proc.is_alive() else f'exit code {self.proc.exitcode}'})")
            try:
                kind, x = self.conn.recv()
            except EOFError:
                self.proc.join(5)
                raise RuntimeError(f"the baseline's process ended without its rows (exit code {self.proc.exitcode})") from None
            if kind == "rows":
                self.rows.extend(x)
            elif kind == "failed":
                raise CallFailed(*x)
            elif kind == "raised":
                if x[0] == "KeyboardInterrupt":
                    raise KeyboardInterrupt
                raise RuntimeError(f"the baseline's process raised {x[0]}: {x[1]}")
            else:
                raise RuntimeError("the baseline's process ended before the trace's last step")
        return self.rows.popleft()

    def close(self) -> None:
        """Stop the process (a run that ended early leaves it blocked on a full pipe) and reap it."""
        if self.proc.is_alive():
            self.proc.terminate()
        self.proc.join(10)
        self.conn.close()


def _drift_point(pts: list, st, v, base) -> None:
    """The decode rows' o errors and written-slot errors of one step (drift curve input)."""
    o_items = [i for i in v.items if i.kind == "o" and i.phase in ("decode", "spec")]
    if not o_items:
        return
    st_items = [i for i in v.items if i.kind == "state" and i.phase in ("decode", "spec")]
    wo = max(o_items, key=lambda i: i.err if math.isfinite(i.err) else math.inf)
    ws = max(st_items, key=lambda i: i.err if math.isfinite(i.err) else math.inf) if st_items else None
    pts.append((st.step, wo.err, wo.baseline_err, ws.err if ws else math.nan, ws.baseline_err if ws else math.nan,
                wo.request))


def _drift_summary(pts: list, tr: Trace) -> dict:
    """The drift curve: the decode steps in up to DRIFT_POINTS bins, each bin's worst o error and
    worst state error (the kernel's and the baseline's), and the worst point named."""
    if not pts:
        return {}
    n = len(pts)
    per = max(1, math.ceil(n / DRIFT_POINTS))
    out = {"decode_steps": n, "cache_dtype": tr.cache.dtype, "cache_layout": tr.cache.layout, "bin": per,
           "step": [], "o_err": [], "o_baseline": [], "state_err": [], "state_baseline": []}

    def worst(xs):
        xs = [x for x in xs if not math.isnan(x)]
        return max(xs) if xs else math.nan
    for i in range(0, n, per):
        chunk = pts[i:i + per]
        out["step"].append(chunk[-1][0])
        for k, j in (("o_err", 1), ("o_baseline", 2), ("state_err", 3), ("state_baseline", 4)):
            out[k].append(worst([p[j] for p in chunk]))
    w = max(pts, key=lambda p: p[1] if math.isfinite(p[1]) else math.inf)
    out["worst"] = {"step": w[0], "request": w[5], "o_err": w[1], "o_baseline": w[2]}
    first = pts[:max(1, n // 10)]
    last = pts[-max(1, n // 10):]
    out["o_err_first_tenth"] = worst([p[1] for p in first])
    out["o_err_last_tenth"] = worst([p[1] for p in last])
    out["state_err_first_tenth"] = worst([p[3] for p in first])
    out["state_err_last_tenth"] = worst([p[3] for p in last])
    return out
