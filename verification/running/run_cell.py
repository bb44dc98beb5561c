"""One cell: one route of one backend on one case, judged and recorded (``run_cell``).

The cell's record is a ``verification.judging.record.Record`` (made by ``new_record``): who ran (backend,
route, recipe), on what (case id, suite, seed, shape), the verdict (status in policy.STATUSES, a
one-line reason, per-tensor err / threshold / margin from ``verification.judging.verdict.judge``), the full
metrics, the baseline's metrics, timings and a repro command.  The final status is
verification.judging.verdict.decide's (the verdict, the guards, the contract, the register of known
failures); ``run_cell`` only runs and records, and never raises for a kernel's sake.

The truth of a case (``kda_ref.truth.truth``, float64) is computed once per run and shared by
every backend and route (``TruthCache``); the baseline, the emulated route recipe measured against
that truth, once per (case, recipe) (verification.judging.baselines.BaselineCache).  A harness step that
runs out of memory is retried once with the cache emptied (``harness_call``); a second
out-of-memory is the cell's ``resource-error``, never a kernel failure.
"""
from __future__ import annotations

import gc
import importlib
import shlex
import time
import traceback
from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch

from kda_kernels.base import applicable, out_of_contract
from verification.judging import verdict as verdict_mod
from verification.judging.baselines import BaselineCache, recipe_baselines
from verification.judging.metrics import compare
from verification.judging.policy import DEFAULT_RECIPE, JUDGED, RESOURCE_ERROR
from verification.judging.record import Record, new_record, scalar_metrics, set_judged, set_problem
from verification.judging.record import encode as jsonable
from verification.running import cache as disk
from verification.running import room
from verification.running.compile_time import compile_clock
from verification.running.guards import guarded_run
from verification.running.run_select import LoadedBackend, as_loaded

# the module, read at each call (tests patch its ``truth``); ``kda_ref.truth`` is also the function
truth_module = importlib.import_module("kda_ref.truth")


STDERR_TAIL_CHARS = 4000


# Caches shared by every cell of a run
def _sync(device) -> None:
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(device)


def _no_lock():
    return nullcontext()


class TruthCache:
    """The Problem and float64 Truth of each case, computed once per run.

    Holds the ``keep`` most recently used cases (cells run case-major, so 1 suffices);
    ``computed`` counts truth evaluations per case id (a case computed twice is a bug
    in the caller's ordering, visible in the record's timings)."""

    def __init__(self, device: str = "cpu", keep: int = 1):
        self.device = device
        self.keep = max(1, int(keep))
        self._problems: OrderedDict = OrderedDict()
        self._truths: OrderedDict = OrderedDict()
        self.computed: dict[str, int] = {}
        self.lock_wait_s: dict[str, float] = {}
        self.build_s: dict[str, float] = {}       # seconds each case's build took (its inputs drawn)
        self.disk_s = 0.0           # seconds on the disk cache (verification/running/cache.py): keys, loads, stores
        self.loaded: dict[str, int] = {}          # truths found on disk per case id (not computed)
        self._big = None            # verification.running.room.BigCaseLock, made on the first large case

    def _enter(self, case) -> None:
        """Before building ``case``: leaving a large case drops it, returns its memory to the
        device and releases the big-case lock; a case over this worker's share of the device
        (verification.running.room.is_big) first takes that lock (the seconds waited: lock_wait_s)."""
        leaving = self._big is not None and self._big.held and self._big.case_id != case.id
        big = str(self.device).startswith("cuda") and room.is_big(case, self.device)
        if leaving or big:                  # the memory of other cases goes back to the device first
            self.forget_others(case.id)
            _free_memory(self.device)
        if leaving:
            self._big.release()
        if big:
            if self._big is None:
                self._big = room.BigCaseLock(self.device)
            self.lock_wait_s[case.id] = self._big.hold(case.id)

    def _remember(self, store: OrderedDict, key, value):
        store[key] = value
        store.move_to_end(key)
        while len(store) > self.keep:
            store.popitem(last=False)

    def _make_room(self, store: OrderedDict, key) -> None:
        """Before building the entry ``key``: drop the least recently used entries so that at
        most keep - 1 others stay (a new problem or truth is never computed while ``keep`` old
        ones are still held: at T = 1M one float64 o is 12 GiB, the fp32 inputs 24 GiB)."""
        while len(store) >= self.keep and key not in store:
            store.popitem(last=False)

    def forget_others(self, case_id) -> None:
        """Drop every cached problem and truth but ``case_id``'s (harness_call's out-of-memory retry)."""
        for store in (self._problems, self._truths):
            for k in [k for k in store if k != case_id]:
                del store[k]

    def has_problem(self, case_id) -> bool:
        """Whether the Problem of ``case_id`` is held (the next ``problem`` call builds nothing)."""
        return case_id in self._problems

    def problem(self, case):
        if case.id in self._problems:
            self._problems.move_to_end(case.id)
            return self._problems[case.id]
        self._enter(case)
        self._make_room(self._problems, case.id)
        t0 = time.perf_counter()
        p = case.build(device=self.device)
        self.build_s[case.id] = time.perf_counter() - t0
        self._remember(self._problems, case.id, p)
        return p

    def prime(self, case, problem, truth, seconds: float) -> None:
        """Install a case computed elsewhere (the isolated child's parent)."""
        self._remember(self._problems, case.id, problem)
        self._remember(self._truths, case.id, (truth, float(seconds)))

    def get(self, case) -> tuple:
        """(problem, truth, oracle seconds, computed_now)."""
        p = self.problem(case)
        if case.id in self._truths:
            self._truths.move_to_end(case.id)
            t, s = self._truths[case.id]
            return p, t, s, False
        self._make_room(self._truths, case.id)
        d0 = time.perf_counter()             # keys, the wait for another process's computation, the load
        key = disk.truth_key(p, case) if disk.enabled() else None
        with disk.computing("truth", key) if key else _no_lock():
            if key:
                t = disk.load("truth", key, self.device)
                self.disk_s += time.perf_counter() - d0
                if t is not None:  # computed by another process with the same problem and oracle code
                    self.loaded[case.id] = self.loaded.get(case.id, 0) + 1
                    self._remember(self._truths, case.id, (t, 0.0))
                    return p, t, 0.0, False
            _sync(self.device)
            t0 = time.perf_counter()
            t = truth_module.truth(p)
            _sync(self.device)
            s = time.perf_counter() - t0
            self.computed[case.id] = self.computed.get(case.id, 0) + 1
            self._remember(self._truths, case.id, (t, s))
            if key:
                d0 = time.perf_counter()
                disk.store("truth", key, t)
                self.disk_s += time.perf_counter() - d0
        return p, t, s, True


# One cell
def repro_command(backend_spec: str, route: str, case, out: str = "DIR", device: Optional[str] = None) -> str:
    parts = ["kda-verify", "run", "--backend", backend_spec, "--route", route, "--suite", case.suite,
             "--case", case.id]
    draw = getattr(case, "suite_opts", None) or {}
    if case.suite == "fuzz" and draw:          # a fuzz id names a case of one draw (n, seed)
        parts += ["--fuzz-n", str(draw["n"]), "--fuzz-seed", str(draw["seed"])]
    parts += ["--out", out]
    if device:
        parts += ["--device", device]
    return " ".join(shlex.quote(p) for p in parts)


def _fresh_state(problem):
    """A Problem whose state tensors (which a kernel may write in place: paged caches,
    donated initial states) are private copies, so the cached Problem stays pristine."""
    changes = {}
    for name in ("initial_state", "state_cache"):
        t = getattr(problem, name)
        if t is not None:
            changes[name] = clone_keep_strides(t)
    return problem.replace(**changes) if changes else problem


def clone_keep_strides(t: torch.Tensor) -> torch.Tensor:
    """A private copy of t with t's exact strides and offset (a padded slot stride, a band of
    a fused buffer): the whole underlying buffer is copied and viewed the same way."""
    base = t._base
    if base is None or t.is_contiguous():
        return t.clone(memory_format=torch.preserve_format) if base is None else t.contiguous().clone()
    copy = base.clone(memory_format=torch.contiguous_format)
    if copy.stride() != base.stride():
        return t.clone()
    return copy.as_strided(t.shape, t.stride(), t.storage_offset() - base.storage_offset())


def _base_record(lb: LoadedBackend, route, case, device) -> Record:
    """A fresh Record (verification.judging.record.new_record) of this cell, not yet judged."""
    return new_record(backend=lb.name, backend_spec=lb.spec, backend_version=lb.version, route=route.name,
                      recipe=getattr(route, "recipe", None), case=case.id, suite=case.suite, seed=case.seed,
                      params=dict(getattr(case, "params", {}) or {}), device=str(device),
                      repro=repro_command(lb.spec, route.name, case, device=None))


def _set_problem(rec: Record, case, problem) -> Record:
    return set_problem(rec, problem, getattr(case, "shape_key", (problem.B, problem.T, problem.H)))


def _error_reason(e: BaseException, where: str) -> tuple[str, str]:
    """(one-line reason naming where and what was raised, the traceback's tail)."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    return f"{where} raised {type(e).__name__}: {msg}"[:500], tb[-STDERR_TAIL_CHARS:]


def _errored(rec: Record, e: BaseException, where: str) -> Record:
    rec.status = "error"
    rec.reason, rec.traceback = _error_reason(e, where)
    return rec


def is_out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is an out-of-memory: torch's OutOfMemoryError (CUDA), a RuntimeError saying
    "out of memory" (CUDA, other allocators) or Python's MemoryError (the CPU)."""
    oom = getattr(torch, "OutOfMemoryError", None)
    if (oom is not None and isinstance(e, oom)) or isinstance(e, MemoryError):
        return True
    return isinstance(e, RuntimeError) and "out of memory" in str(e).lower()


def _free_memory(device) -> None:
    gc.collect()
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _memory_note(device) -> str:
    """The device's free and total memory and what this process holds, for an out-of-memory reason."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return f"on {device}"
    free, total = torch.cuda.mem_get_info(torch.device(device))
    held = torch.cuda.memory_allocated(torch.device(device))
    return (f"{free / 2 ** 30:.1f} GiB free of {total / 2 ** 30:.1f} GiB on {device}, "
            f"{held / 2 ** 30:.1f} GiB held by this process")


def harness_call(fn, device, before_retry=None):
    """``fn()``; if it runs out of memory, ``before_retry()`` (e.g. dropping other cases' cached
    truths) runs, the CUDA cache is emptied and ``fn()`` runs once more (a second out-of-memory
    propagates)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - only an out-of-memory is retried
        if not is_out_of_memory(e):
            raise
    if before_retry is not None:
        before_retry()
    _free_memory(device)
    return fn()


def _resource_errored(rec: Record, e: BaseException, where: str, device) -> Record:
    """A harness out-of-memory (after its retry): its own status, never a kernel failure or a pass."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    rec.status = RESOURCE_ERROR
    rec.reason = (f"harness out of memory in {where} on {device} (retried once with the CUDA cache emptied; "
                     f"not a kernel result): {type(e).__name__}: {msg}")[:500]
    rec.traceback = _error_reason(e, where)[1]
    _free_memory(device)
    return rec


def guards_default(device) -> bool:
    """Memory guards are on by default for CUDA devices (verification/running/guards.py)."""
    return str(device).startswith("cuda")


def _disk_counts(truth_cache, baseline_cache) -> tuple:
    caches = (truth_cache, baseline_cache)
    return (sum(getattr(c, "disk_s", 0.0) for c in caches),
            *(sum((getattr(c, "loaded", None) or {}).values()) for c in caches))


def add_disk_timings(timings: dict, before: tuple, truth_cache, baseline_cache) -> None:
    """Add to a cell's timings what the disk cache did since ``before`` (``_disk_counts``):
    ``cache_s`` (keys, loads, stores), ``truths_loaded``, ``baselines_loaded``."""
    now = _disk_counts(truth_cache, baseline_cache)
    if now == before:
        return
    timings["cache_s"] = timings.get("cache_s", 0.0) + now[0] - before[0]
    for name, i in (("truths_loaded", 1), ("baselines_loaded", 2)):
        if now[i] > before[i]:
            timings[name] = timings.get(name, 0) + now[i] - before[i]


def run_cell(backend, route, case, truth_cache: TruthCache, baseline_cache: BaselineCache, db,
             device: Optional[str] = None, guards: Optional[bool] = None) -> Record:
    """Run one route of one backend on one case and record it; never raises for a kernel's
    sake (a kernel exception is status "error" with the traceback's tail).  The final status
    is verification.judging.verdict.decide's (the verdict, the guards, the contract, the register of
    known failures); this function only runs and records.

    guards: run under verification.running.guards (None: on for CUDA devices); a violated guard makes
    the cell "fail" with reason "guard: ..." and the record holds ``guards`` (what was checked).

    backend: a LoadedBackend (or a spec string / Backend object, loaded here)."""
    backend = as_loaded(backend)
    device = device or truth_cache.device
    rec = _base_record(backend, route, case, device)
    timings = rec.timings
    if not backend.available:
        rec.status, rec.reason = "skipped", f"backend unavailable: {backend.reason or 'no reason given'}"
        return rec
    why = room.no_room(case, device)
    if why is not None:                  # decided from the case's size: nothing of it is built
        rec.status, rec.reason = "skipped", why
        return rec
    # the problem (cheap) decides applicability before any truth is computed
    try:
        built_before = truth_cache.has_problem(case.id)
        problem = harness_call(lambda: truth_cache.problem(case), device)
        timings.update(build_s=truth_cache.build_s.get(case.id, 0.0), build_cached=built_before)
    except Exception as e:  # noqa: BLE001 - a case that cannot build is the harness's error, recorded
        if is_out_of_memory(e):
            return _resource_errored(rec, e, f"case {case.id} build", device)
        return _errored(rec, e, f"case {case.id} build")
    if truth_cache.lock_wait_s.get(case.id):
        timings["lock_wait_s"] = truth_cache.lock_wait_s[case.id]
    _set_problem(rec, case, problem)
    try:
        ok, why = applicable(backend.backend, problem, route)
        # a documented-but-unchecked range the problem violates: the cell runs, never passes or fails
        contract = out_of_contract(backend.backend, problem, route) if ok else None
    except Exception as e:  # noqa: BLE001
        ok, why = False, f"accepts() raised {type(e).__name__}: {e}"
    if not ok:
        why = str(why or "not applicable")
        rec.status, rec.reason = "skipped", why if why.startswith("not applicable") else f"not applicable: {why}"
        return rec
    # truth and baseline, shared (the memory caches, then the disk cache: verification/running/cache.py)
    disk0 = _disk_counts(truth_cache, baseline_cache)
    try:
        problem, truth, oracle_s, fresh = harness_call(lambda: truth_cache.get(case), device,
                                                       before_retry=lambda: truth_cache.forget_others(case.id))
        timings.update(oracle_s=oracle_s, oracle_cached=not fresh)
        recipe = getattr(route, "recipe", None) or DEFAULT_RECIPE
        baseline, base_s, fresh_b = harness_call(lambda: baseline_cache.get(case, recipe, problem, truth), device)
        timings.update(baseline_s=base_s, baseline_cached=not fresh_b)
        rec.baseline = scalar_metrics(baseline)
    except Exception as e:  # noqa: BLE001
        if is_out_of_memory(e):
            return _resource_errored(rec, e, "oracle/baseline", device)
        return _errored(rec, e, "oracle/baseline")
    finally:
        add_disk_timings(timings, disk0, truth_cache, baseline_cache)
    # the kernel (Triton compilation inside the call is measured apart: compile_s)
    clock = compile_clock()
    mark = clock.mark()
    timings["compile_how"] = clock.how

    def kernel_call():
        run_problem = _fresh_state(problem)
        _sync(device)
        t0 = time.perf_counter()
        guard = None
        if guards_default(device) if guards is None else guards:
            outputs, guard = guarded_run(backend.backend, run_problem, route)
        else:
            outputs = backend.backend.run(run_problem, route)
        _sync(device)
        kernel_s = time.perf_counter() - t0
        if guard is not None:          # the call alone; the guards' allocations and checks apart
            timings["guards_s"] = kernel_s - guard.kernel_s
            kernel_s = guard.kernel_s
        return outputs, kernel_s, guard

    def before_kernel_retry():         # a kernel out of memory is retried once, the harness's other cases dropped
        timings["kernel_oom_retried"] = 1
        truth_cache.forget_others(case.id)

    failure = None
    try:
        outputs, kernel_s, guard = harness_call(kernel_call, device, before_retry=before_kernel_retry)
    except Exception as e:  # noqa: BLE001 - the kernel failing is a result, not a harness crash
        failure = e
    timings.update(clock.since(mark))          # whether it ran or raised
    if failure is not None:
        where = f"{backend.name} {route.name} run"
        if is_out_of_memory(failure):   # an error, not a resource-error: it may be the kernel's own demand
            where += (f" (out of memory twice, the second time with the harness's other cases dropped; "
                      f"{_memory_note(device)})")
        rec = _errored(rec, failure, where)
        return mark_out_of_contract(rec, contract) if contract else rec
    timings["kernel_s"] = max(0.0, kernel_s - timings["compile_s"])
    rec.info = jsonable(getattr(outputs, "info", {}) or {})
    # metrics and verdict
    try:
        t0 = time.perf_counter()

        def judging():
            def lift():
                d0 = _disk_counts(truth_cache, baseline_cache)
                try:
                    return recipe_baselines(baseline_cache, case, problem, truth, timings)
                finally:
                    add_disk_timings(timings, d0, truth_cache, baseline_cache)
            v = verdict_mod.judge(backend.name, route, problem, outputs, truth, baseline, db, recipe_baselines=lift)
            return v, getattr(v, "metrics", None) or compare(outputs.tensors(), truth.tensors(), problem)

        verdict, metrics = harness_call(judging, device)
        timings["metrics_s"] = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001
        if is_out_of_memory(e):
            return _resource_errored(rec, e, "judging", device)
        return _errored(rec, e, "judging")
    set_judged(rec, getattr(verdict, "tensors", {}) or {}, metrics)
    if guard is not None:
        rec.guards = jsonable(guard.as_record())
    # the final status: verification.judging.verdict.decide, the one place that decides it
    kf = None if contract else verdict_mod.known_failure_entry(db, rec.backend, rec.route, rec.case, rec.params)
    return verdict_mod.decide(verdict, guard=guard, contract=contract, known_failure=kf, metrics=rec.metrics).apply_to(rec)


@dataclass
class _Said:
    """A status and reason reached without a verdict (a kernel that raised), for ``decide``."""
    status: str
    reason: str


def mark_out_of_contract(rec: Record, contract: str) -> Record:
    """Record a judged (or raised) cell as outside the kernel's documented-but-unchecked range:
    verification.judging.verdict.decide with ``contract``; the verdict it would have had is kept in
    ``contract_verdict``."""
    return verdict_mod.decide(_Said(rec.status, rec.reason), contract=contract, metrics=rec.metrics).apply_to(rec)


def apply_known_failure(rec: Record, db) -> Record:
    """Mark a failing cell that tolerances.yaml lists as a known failure ``known-fail`` (with the
    entry's reason); note on a passing one that the entry may be stale (verification.judging.verdict.decide
    with the register's entry)."""
    kf = verdict_mod.known_failure_entry(db, rec.backend, rec.route, rec.case, rec.params)
    if kf is None:
        return rec
    return verdict_mod.decide(_Said(rec.status, rec.reason), known_failure=kf).apply_to(rec)


SELF_JUDGED = "emulator judged against its own recipe (err = baseline, margin 1): only the cap judges"


def note_self_judged(rec: Record) -> Record:
    """Say so on a cell whose kernel is the emulator (backend ``emulator``): its route's recipe
    is the baseline's, so its error is the baseline's by construction, the margin is 1 and only
    the cap can fail it; such a row verifies the harness, not a kernel."""
    if rec.backend == "emulator" and rec.status in JUDGED and SELF_JUDGED not in (rec.reason or ""):
        rec.reason = f"{SELF_JUDGED}; {rec.reason}" if rec.reason else SELF_JUDGED
        rec.self_judged = True
    return rec


def use_device(device: str) -> None:
    """Make a CUDA device the current one (kernels that launch on the current device, as
    Triton's do, then run where the problem's tensors are)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is not None and torch.cuda.is_available():
        torch.cuda.set_device(dev.index)
