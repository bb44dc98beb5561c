"""The runner: every (backend, route, case) cell of a matrix, judged and recorded.

One cell = one route of one backend on one case.  Its record (``run_cell``) is a
``verification.record.Record``: who ran (backend, route, recipe), on what (case id, suite, seed,
shape), the verdict (status in policy.STATUSES, a one-line reason, per-tensor err /
threshold / margin from ``verification.verdict.judge``), the full metrics, the
baseline's metrics, timings and a repro command.

The truth of a case (``kda_ref.truth.truth``, float64) is computed once per run and
shared by every backend and route (``TruthCache``); the baseline, the emulated
route recipe measured against that truth, once per (case, recipe)
(``BaselineCache``).  Cells run case-major, so only the current case's truth is
held in memory.

``run_matrix`` appends each finished record to ``DIR/results.jsonl`` at once (write,
flush, fsync): an interrupted run loses nothing, and ``resume=True`` skips every
cell whose key is already there.  With ``isolate=True`` each cell runs in a child
process (``python -m verification.runner --child``) that is handed the problem, the
truth and the baseline through a file, so a kernel that kills its process (illegal
memory access, abort, ``os._exit``) is recorded as ``crashed`` with the tail of its
stderr, and the run goes on.
"""
from __future__ import annotations

import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from verification.policy import DEFAULT_RECIPE, FAILING, JUDGED, RESOURCE_ERROR, exit_code
from verification.baselines import BaselineCache, recipe_baselines
from verification.devices import default_device
from verification.record import (RESULTS_FILE, RUN_FILE, Record, append_record, cell_key, new_record, read_records,
                                 read_runs, repair_partial_line, scalar_metrics, set_judged, set_problem)
from verification.record import encode as jsonable

STDERR_TAIL_CHARS = 4000


# ----------------------------------------------------------------------------------------
# Caches shared by every cell of a run
# ----------------------------------------------------------------------------------------
def _sync(device) -> None:
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(device)


def _no_lock():
    from contextlib import nullcontext
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
        self.disk_s = 0.0           # seconds on the disk cache (verification/cache.py): keys, loads, stores
        self.loaded: dict[str, int] = {}          # truths found on disk per case id (not computed)
        self._big = None            # verification.room.BigCaseLock, made on the first large case

    def _enter(self, case) -> None:
        """Before building ``case``: leaving a large case drops it, returns its memory to the
        device and releases the big-case lock; a case over this worker's share of the device
        (verification.room.is_big) first takes that lock (the seconds waited: lock_wait_s)."""
        from verification.room import BigCaseLock, is_big
        leaving = self._big is not None and self._big.held and self._big.case_id != case.id
        big = str(self.device).startswith("cuda") and is_big(case, self.device)
        if leaving or big:                  # the memory of other cases goes back to the device first
            self.forget_others(case.id)
            _free_memory(self.device)
        if leaving:
            self._big.release()
        if big:
            if self._big is None:
                self._big = BigCaseLock(self.device)
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
        from kda_ref.truth import truth as oracle
        from verification import cache as disk
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
            t = oracle(p)
            _sync(self.device)
            s = time.perf_counter() - t0
            self.computed[case.id] = self.computed.get(case.id, 0) + 1
            self._remember(self._truths, case.id, (t, s))
            if key:
                d0 = time.perf_counter()
                disk.store("truth", key, t)
                self.disk_s += time.perf_counter() - d0
        return p, t, s, True


# ----------------------------------------------------------------------------------------
# Backends and routes
# ----------------------------------------------------------------------------------------
@dataclass
class LoadedBackend:
    """A backend object plus the spec it was loaded from (for repro lines and children)."""
    spec: str
    backend: object
    available: bool
    reason: str
    version: str
    from_spec: bool = True          # loadable again from spec (what an isolated child needs)

    @property
    def name(self) -> str:
        return str(getattr(self.backend, "name", self.spec))


def probe(backend, spec: str, from_spec: bool) -> LoadedBackend:
    """Ask a Backend object where it stands (available, reason, version); never raises."""
    try:
        ok, why = backend.available()
    except Exception as e:  # noqa: BLE001 - an availability probe that raises means "not here"
        ok, why = False, f"available() raised {type(e).__name__}: {e}"
    try:
        ver = str(backend.version()) if hasattr(backend, "version") else "unknown"
    except Exception as e:  # noqa: BLE001
        ver = f"unknown ({type(e).__name__})"
    return LoadedBackend(spec=spec, backend=backend, available=bool(ok), reason=str(why or ""), version=ver,
                         from_spec=from_spec)


def module_exists(mod_name: str) -> bool:
    """Whether ``mod_name`` can be imported here (found, not imported)."""
    import importlib.util
    try:
        return importlib.util.find_spec(mod_name) is not None
    except (ImportError, ValueError):
        return False


def load(spec: str) -> LoadedBackend:
    """Load a backend by built-in name or package.module:factory and ask where it stands."""
    from kda_kernels.base import load_backend
    return probe(load_backend(spec), spec, from_spec=True)


def as_loaded(backend) -> LoadedBackend:
    """A LoadedBackend from a spec string, a Backend object or a LoadedBackend."""
    if isinstance(backend, LoadedBackend):
        return backend
    if isinstance(backend, str):
        return load(backend)
    return probe(backend, str(getattr(backend, "name", type(backend).__name__)), from_spec=False)


def resolve_routes(lb: LoadedBackend, wanted: Optional[list[str]] = None, strict: bool = True) -> list:
    """The Routes of a backend to run: all of them, or the ones named (--route).  A name
    not among backend.routes() goes to backend.route(name) where the backend parses route
    specs; otherwise it is a UsageError naming --route and the choices (with strict=False
    it is left out: another backend of the run may have it)."""
    from kda_kernels.base import LooksUpRoutes, Route
    from verification.errors import UsageError
    try:
        have = list(lb.backend.routes())
    except Exception as e:  # noqa: BLE001 - an unavailable backend may not list routes
        if lb.available:
            raise
        have = []
        lb.reason = lb.reason or f"routes() raised {type(e).__name__}: {e}"
    if not wanted:
        return have or [Route(name="*", description="backend unavailable: routes unknown")]
    by_name = {r.name: r for r in have}
    out = []
    for name in wanted:
        if name in by_name:
            out.append(by_name[name])
        elif isinstance(lb.backend, LooksUpRoutes):
            try:
                out.append(lb.backend.route(name))
            except (ValueError, KeyError) as e:
                if strict:
                    raise UsageError(f"--route: backend {lb.name!r} cannot parse {name!r}: {e}") from e
        elif not have and not lb.available:
            out.append(Route(name=name))
        elif not strict:
            continue
        else:
            raise UsageError(f"--route: backend {lb.name!r} has no route {name!r}; "
                             f"expected one of: {', '.join(by_name) or '(none)'}")
    return out


# ----------------------------------------------------------------------------------------
# One cell
# ----------------------------------------------------------------------------------------
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
    """A fresh Record (verification.record.new_record) of this cell, not yet judged."""
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
    import gc
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
    """Memory guards are on by default for CUDA devices (verification/guards.py)."""
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
    is verification.verdict.decide's (the verdict, the guards, the contract, the register of
    known failures); this function only runs and records.

    guards: run under verification.guards (None: on for CUDA devices); a violated guard makes
    the cell "fail" with reason "guard: ..." and the record holds ``guards`` (what was checked).

    backend: a LoadedBackend (or a spec string / Backend object, loaded here)."""
    backend = as_loaded(backend)
    device = device or truth_cache.device
    rec = _base_record(backend, route, case, device)
    timings = rec.timings
    if not backend.available:
        rec.status, rec.reason = "skipped", f"backend unavailable: {backend.reason or 'no reason given'}"
        return rec
    from verification.room import no_room
    why = no_room(case, device)
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
        from kda_kernels.base import applicable
        ok, why = applicable(backend.backend, problem, route)
        # a documented-but-unchecked range the problem violates: the cell runs, never passes or fails
        from kda_kernels.base import out_of_contract
        contract = out_of_contract(backend.backend, problem, route) if ok else None
    except Exception as e:  # noqa: BLE001
        ok, why = False, f"accepts() raised {type(e).__name__}: {e}"
    if not ok:
        why = str(why or "not applicable")
        rec.status, rec.reason = "skipped", why if why.startswith("not applicable") else f"not applicable: {why}"
        return rec
    # truth and baseline, shared (the memory caches, then the disk cache: verification/cache.py)
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
    from verification.compile_time import compile_clock
    clock = compile_clock()
    clock.forget_pending()
    c0, n0, h0 = clock.seconds, clock.compiles, clock.cache_hits
    timings["compile_how"] = clock.how

    def kernel_call():
        run_problem = _fresh_state(problem)
        _sync(device)
        t0 = time.perf_counter()
        guard = None
        if guards_default(device) if guards is None else guards:
            from verification.guards import guarded_run
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
    timings.update(compile_s=clock.seconds - c0, compiles=clock.compiles - n0,   # whether it ran or raised
                   compile_cache_hits=clock.cache_hits - h0)
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
        from verification.metrics import compare
        from verification.verdict import decide, judge, known_failure_entry
        t0 = time.perf_counter()

        def judging():
            def lift():
                d0 = _disk_counts(truth_cache, baseline_cache)
                try:
                    return recipe_baselines(baseline_cache, case, problem, truth, timings)
                finally:
                    add_disk_timings(timings, d0, truth_cache, baseline_cache)
            v = judge(backend.name, route, problem, outputs, truth, baseline, db, recipe_baselines=lift)
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
    # the final status: verification.verdict.decide, the one place that decides it
    kf = None if contract else known_failure_entry(db, rec.backend, rec.route, rec.case, rec.params)
    return decide(verdict, guard=guard, contract=contract, known_failure=kf, metrics=rec.metrics).apply_to(rec)


@dataclass
class _Said:
    """A status and reason reached without a verdict (a kernel that raised), for ``decide``."""
    status: str
    reason: str


def mark_out_of_contract(rec: Record, contract: str) -> Record:
    """Record a judged (or raised) cell as outside the kernel's documented-but-unchecked range:
    verification.verdict.decide with ``contract``; the verdict it would have had is kept in
    ``contract_verdict``."""
    from verification.verdict import decide
    return decide(_Said(rec.status, rec.reason), contract=contract, metrics=rec.metrics).apply_to(rec)


def apply_known_failure(rec: Record, db) -> Record:
    """Mark a failing cell that tolerances.yaml lists as a known failure ``known-fail`` (with the
    entry's reason); note on a passing one that the entry may be stale (verification.verdict.decide
    with the register's entry)."""
    from verification.verdict import decide, known_failure_entry
    kf = known_failure_entry(db, rec.backend, rec.route, rec.case, rec.params)
    if kf is None:
        return rec
    return decide(_Said(rec.status, rec.reason), known_failure=kf).apply_to(rec)


# ----------------------------------------------------------------------------------------
# Isolation: one child process per cell
# ----------------------------------------------------------------------------------------
def _cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: _cpu(v) for k, v in x.items()}
    return x


class IsolatedRunner:
    """Runs cells in child processes.  The parent computes each case's truth and baselines
    once (TruthCache / BaselineCache) and writes them, with the Problem, to one file per
    case under a private temporary directory; each child loads that file, runs the kernel
    and judges it, and writes its record to a file.  A child that dies leaves no record:
    the cell is "crashed", with its exit signal or code and the tail of its stderr."""

    def __init__(self, truth_cache: TruthCache, baseline_cache: BaselineCache,
                 tolerances_path: Optional[str] = None, timeout_s: Optional[float] = None,
                 guards: Optional[bool] = None):
        self.guards = guards
        self.truth_cache = truth_cache
        self.baseline_cache = baseline_cache
        self.tolerances_path = tolerances_path
        self.timeout_s = timeout_s
        self._tmp = tempfile.TemporaryDirectory(prefix="kda-verify-isolate-")
        self._case_files: dict[str, Path] = {}

    def close(self):
        self._tmp.cleanup()

    def _case_file(self, case) -> tuple[Path, float]:
        problem, truth, oracle_s, _ = self.truth_cache.get(case)
        path = self._case_files.get(case.id)
        if path is None:
            for old in self._case_files.values():  # case-major: the previous case is done
                old.unlink(missing_ok=True)
            self._case_files.clear()
            path = Path(self._tmp.name) / f"case-{len(os.listdir(self._tmp.name))}.pt"
            # the Problem is saved as it is (torch.save keeps views, strides and devices)
            torch.save({"problem": problem, "truth": _cpu(truth.tensors()), "oracle_s": oracle_s}, path)
            self._case_files[case.id] = path
        return path, oracle_s

    def run(self, lb: LoadedBackend, route, case, device: str) -> Record:
        from verification.room import no_room
        rec0 = _base_record(lb, route, case, device)
        if not lb.available or no_room(case, device) is not None:
            return run_cell(lb, route, case, self.truth_cache, self.baseline_cache, None, device)
        try:
            problem = self.truth_cache.problem(case)
            from kda_kernels.base import applicable
            ok, why = applicable(lb.backend, problem, route)
        except Exception as e:  # noqa: BLE001
            ok, why = False, f"accepts() raised {type(e).__name__}: {e}"
        if not ok:
            return run_cell(lb, route, case, self.truth_cache, self.baseline_cache, None, device)
        try:
            truths_before = self.truth_cache.computed.get(case.id, 0)
            case_file, oracle_s = harness_call(lambda: self._case_file(case), device)
            oracle_fresh = self.truth_cache.computed.get(case.id, 0) > truths_before
            problem, truth, _, _ = self.truth_cache.get(case)
            recipe = getattr(route, "recipe", None) or DEFAULT_RECIPE
            baseline, base_s, base_fresh = harness_call(
                lambda: self.baseline_cache.get(case, recipe, problem, truth), device)
        except Exception as e:  # noqa: BLE001
            if is_out_of_memory(e):
                return _resource_errored(rec0, e, "oracle/baseline", device)
            return _errored(rec0, e, "oracle/baseline")
        # computed here, in the parent, or not (the child sees both as cached)
        fresh = {"oracle_s": oracle_s, "oracle_cached": not oracle_fresh,
                 "baseline_s": base_s, "baseline_cached": not base_fresh}
        tmp = Path(self._tmp.name)
        spec_path = tmp / "cell.pt"
        out_path = tmp / "record.json"
        out_path.unlink(missing_ok=True)
        torch.save({"backend_spec": lb.spec, "route": route, "case": case, "case_file": str(case_file),
                    "baseline": _cpu(baseline), "baseline_s": base_s, "device": device,
                    "tolerances_path": self.tolerances_path, "guards": self.guards}, spec_path)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        cmd = [sys.executable, "-m", "verification.runner", "--child", str(spec_path), str(out_path)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=self.timeout_s,
                                  errors="replace")
            rc, err = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as e:
            rc = None
            err = (e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or ""))
        wall = time.perf_counter() - t0
        if rc == 0 and out_path.exists():
            rec = Record.from_json(out_path.read_text())
            rec.timings["child_wall_s"] = wall
            rec.timings.update(fresh)
            return rec
        if rc is None:
            how = f"timed out after {self.timeout_s:g} s (killed)"
        elif rc < 0:
            try:
                how = f"killed by signal {signal.Signals(-rc).name}"
            except ValueError:
                how = f"killed by signal {-rc}"
        else:
            how = f"exited with code {rc} without a record"
        tail = (err or "").strip()[-STDERR_TAIL_CHARS:]
        last = next((ln for ln in reversed(tail.splitlines()) if ln.strip()), "")
        rec0.status = "crashed"
        rec0.reason = f"child process {how}" + (f": {last.strip()[:200]}" if last else "")
        rec0.stderr_tail = tail
        _set_problem(rec0, case, problem)
        rec0.baseline = scalar_metrics(baseline)
        rec0.timings = dict(fresh, child_wall_s=wall)
        return rec0


def _child_main(spec_path: str, out_path: str) -> int:
    """The isolated cell: load what the parent prepared, run, judge, write the record."""
    spec = torch.load(spec_path, weights_only=False)
    device = spec["device"]
    use_device(device)
    data = torch.load(spec["case_file"], weights_only=False, map_location=device)
    from kda_ref.truth import Truth
    from verification.tolerances import load_tolerances

    problem = data["problem"]
    truth = Truth(**{k: v.to(device) for k, v in data["truth"].items()
                     if k in ("o", "final_state", "state_cache")})
    extras = {k: v.to(device) for k, v in data["truth"].items() if k not in ("o", "final_state", "state_cache")}
    truth.extras.update(extras)
    case = spec["case"]
    tc = TruthCache(device=device)
    tc.prime(case, problem, truth, data["oracle_s"])
    bc = BaselineCache()
    bc.prime(case.id, getattr(spec["route"], "recipe", None) or DEFAULT_RECIPE, spec["baseline"], spec["baseline_s"])
    lb = load(spec["backend_spec"])
    db = load_tolerances(spec["tolerances_path"])
    rec = run_cell(lb, spec["route"], case, tc, bc, db, device, guards=spec.get("guards"))
    rec.isolated = True
    Path(out_path).write_text(rec.to_json())
    return 0


# ----------------------------------------------------------------------------------------
# Progress
# ----------------------------------------------------------------------------------------
def _fmt_s(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else (f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s")


def clip_words(text: str, n: int) -> str:
    """``text`` cut to at most ``n`` characters at a word boundary, with "…" where it was cut
    (never mid-word; a single word longer than n is cut at n - 1)."""
    text = str(text)
    if len(text) <= n:
        return text
    cut = text[:n - 1]
    space = cut.rfind(" ")
    if space > n // 2:
        cut = cut[:space]
    return cut.rstrip(" ,;:") + "…"


class Progress:
    """A progress bar with ETA on a stream (stderr): redrawn in place on a tty, one plain
    line per cell otherwise (logs, CI); a long reason is cut at a word boundary ("…")."""

    def __init__(self, total: int, stream=None, tty: Optional[bool] = None, width: int = 24):
        self.total, self.done, self.width = int(total), 0, width
        self.stream = sys.stderr if stream is None else stream
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)()) if tty is None else tty
        self.t0 = time.perf_counter()
        self.counts: dict[str, int] = {}

    def eta(self) -> float:
        if self.done == 0:
            return float("nan")
        return (time.perf_counter() - self.t0) / self.done * (self.total - self.done)

    def step(self, rec: Record) -> None:
        self.done += 1
        st = rec.status or "?"
        self.counts[st] = self.counts.get(st, 0) + 1
        label = f"{rec.backend} {rec.route} {rec.case}"
        frac = self.done / self.total if self.total else 1.0
        eta = _fmt_s(self.eta())
        if self.tty:
            fill = int(round(frac * self.width))
            bar = "#" * fill + "." * (self.width - fill)
            tally = " ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
            line = f"\r[{bar}] {self.done}/{self.total} {frac:4.0%} ETA {eta} | {tally} | {st}: {label}"
            self.stream.write(clip_words(line, 200).ljust(120))
            if self.done == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(f"[{self.done}/{self.total} {frac:4.0%} ETA {eta}] {st:<10} {label}"
                              f"{(' - ' + clip_words(rec.reason, 240)) if st != 'pass' and rec.reason else ''}\n")
        self.stream.flush()


# ----------------------------------------------------------------------------------------
# The matrix
# ----------------------------------------------------------------------------------------
@dataclass
class RunSummary:
    out_dir: Optional[Path]
    records: list[Record] = field(default_factory=list)  # every record of the run (resumed ones included)
    fresh: list[Record] = field(default_factory=list)    # the records of cells run by this invocation
    ran: int = 0                                      # cells executed by this invocation
    resumed: int = 0                                  # cells found finished and skipped
    stopped_early: bool = False                       # --max-cells reached
    selected: int = 0                                 # cells of the run's selection (resumed ones included)
    not_run: Optional[int] = None                     # interrupted (Ctrl-C): selected cells without a record
    oracle_runs: dict = field(default_factory=dict)  # case id -> truth evaluations (1 each)
    baseline_runs: dict = field(default_factory=dict)  # (case id, recipe) -> baseline evaluations

    def counts(self) -> dict:
        c: dict[str, int] = {}
        for r in self.records:
            c[r.status or "?"] = c.get(r.status or "?", 0) + 1
        return c

    @property
    def failed(self) -> list[Record]:
        return [r for r in self.records if r.status in FAILING]

    @property
    def exit_code(self) -> int:
        """verification.policy.exit_code of the run's cells: 130 when interrupted, 1 when a cell
        failed, was mistrusted, crashed or errored, 2 when the harness ran out of memory on a
        cell or no cell was judged, else 0."""
        return exit_code([r.status for r in self.records], interrupted=self.not_run is not None)

    @property
    def verified(self) -> int:
        """How many cells reached a verdict (pass, known-fail, fail, mistrusted)."""
        return sum(r.status in JUDGED for r in self.records)


SELF_JUDGED = "emulator judged against its own recipe (err = baseline, margin 1): only the cap judges"


def note_self_judged(rec: Record) -> Record:
    """Say so on a cell whose kernel is the emulator (backend ``emulator``): its route's recipe
    is the baseline's, so its error is the baseline's by construction, the margin is 1 and only
    the cap can fail it; such a row verifies the harness, not a kernel."""
    if rec.backend == "emulator" and rec.status in JUDGED and SELF_JUDGED not in (rec.reason or ""):
        rec.reason = f"{SELF_JUDGED}; {rec.reason}" if rec.reason else SELF_JUDGED
        rec.self_judged = True
    return rec


def plan(backends: list[LoadedBackend], routes: Optional[list[str]], cases: list) -> list[tuple]:
    """The cells, case-major: [(LoadedBackend, Route, Case), ...]."""
    from verification.errors import UsageError
    strict = len(backends) == 1
    per_backend = [(lb, resolve_routes(lb, routes, strict=strict)) for lb in backends]
    if routes and not strict:
        missing = [n for n in routes if not any(resolve_routes(lb, [n], strict=False) for lb in backends)]
        if missing:
            have = "; ".join(f"{lb.name}: {', '.join(r.name for r in resolve_routes(lb)) or '(none)'}"
                             for lb in backends)
            raise UsageError(f"--route: expected routes of the chosen backends, got {', '.join(map(repr, missing))} "
                             f"which none has ({have})")
    return [(lb, r, c) for c in cases for lb, rs in per_backend for r in rs]


def _selection_value(v):
    """A selection option's value compared regardless of order and repetition (None for unset)."""
    if isinstance(v, (list, tuple)):
        return tuple(sorted({str(x) for x in v})) or None
    return None if v is None else str(v)


def _selection_text(selection: dict, options=None) -> str:
    """``--backend a,b --suite smoke ...`` of a selection (``options``: only these; an unset
    one reads ``no --route``)."""
    parts = []
    for opt in (selection if options is None else options):
        v = selection.get(opt)
        shown = ",".join(map(str, v)) if isinstance(v, (list, tuple)) else v
        if shown not in (None, ""):
            parts.append(f"{opt} {shown}")
        elif options is not None:
            parts.append(f"no {opt}")
    return " ".join(parts)


def check_resume(out_dir, resume: bool, selection: Optional[dict] = None, wanted: Optional[set] = None) -> None:
    """Refuse, before anything is written, a run into ``out_dir`` that would mix two runs: results
    there without ``resume``, or a resume whose selection is not the one recorded in DIR/run.json
    (``selection``: {option: value} of what picks the cells, e.g. {"--backend": [...], "--suite":
    [...]}, compared regardless of order).  Where DIR records no selection, a resume whose cells
    (``wanted``, cell keys) leave out a cell already recorded is refused.  Reads only."""
    from verification.errors import UsageError
    results = Path(out_dir) / RESULTS_FILE
    if not results.is_file() or results.stat().st_size == 0:
        return
    if not resume:
        raise UsageError(f"--out: {results} already holds {len(read_records(results))} cells; "
                         f"pass --resume to continue that run, or choose an empty directory")
    before = next((r["selection"] for r in reversed(read_runs(out_dir))
                   if isinstance(r, dict) and isinstance(r.get("selection"), dict)), None)
    if selection is not None and before is not None:
        differ = [o for o in dict.fromkeys([*before, *selection])
                  if _selection_value(before.get(o)) != _selection_value(selection.get(o))]
        if differ:
            raise UsageError(f"--resume: expected the selection of the run in {out_dir} ({_selection_text(before)}), "
                             f"got {_selection_text(selection, differ)}; another selection needs another --out")
    elif wanted is not None:
        other = [r.key for r in read_records(results) if r.key not in wanted]
        if other:
            raise UsageError(f"--resume: expected a selection holding the {len(read_records(results))} cells recorded "
                             f"in {out_dir}, got one without {len(other)} of them (e.g. {other[0]}); another "
                             f"selection needs another --out")


def _note_interrupted(out: Path, selected: int, not_run: int) -> None:
    """Record in DIR/run.json that this invocation was interrupted, and how many of its selected
    cells have no record (the report's INTERRUPTED headline)."""
    runs = read_runs(out)
    if runs:
        runs[-1]["interrupted"] = {"selected": selected, "not_run": not_run}
        (out / RUN_FILE).write_text(json.dumps({"runs": runs}, indent=1, allow_nan=False))


def use_device(device: str) -> None:
    """Make a CUDA device the current one (kernels that launch on the current device, as
    Triton's do, then run where the problem's tensors are)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is not None and torch.cuda.is_available():
        torch.cuda.set_device(dev.index)


def run_matrix(backends: Iterable, cases: list, out_dir=None, *, routes: Optional[list[str]] = None,
               resume: bool = False, isolate: bool = False, device: Optional[str] = None,
               max_cells: Optional[int] = None, db=None, tolerances_path: Optional[str] = None,
               progress_stream=None, tty: Optional[bool] = None, timeout_s: Optional[float] = None,
               on_record: Optional[Callable[[Record], None]] = None, provenance: Optional[dict] = None,
               guards: Optional[bool] = None, selection: Optional[dict] = None) -> RunSummary:
    """Run every (backend, route, case) cell; see the module docstring.

    backends: specs (built-in names or package.module:factory) or LoadedBackends.
    out_dir: where results.jsonl (and run.json, the provenance) go; None keeps records in memory.
    resume: skip cells already in out_dir/results.jsonl (without it, a non-empty file is an error;
        a resume of another ``selection`` too: check_resume, before anything is written).
    max_cells: stop after running this many cells (resumed cells do not count).
    guards: memory guards per cell (verification/guards.py); None: on for CUDA devices.
    selection: the options that picked the cells, recorded in run.json (check_resume).

    Ctrl-C (KeyboardInterrupt) during the cells raises errors.Interrupted carrying the summary,
    whose ``not_run`` counts the selected cells without a record; run.json's entry of this
    invocation says ``interrupted`` too."""
    from verification.errors import Interrupted, UsageError

    device = device or default_device()
    use_device(device)
    loaded = [as_loaded(b) for b in backends]
    if isolate:
        bad = [lb.name for lb in loaded if not lb.from_spec]
        if bad:
            raise UsageError(f"--isolate: expected backends given by name or package.module:factory (a child "
                             f"process loads them again), got Backend objects {', '.join(bad)}")
    cells = plan(loaded, routes, cases)
    wanted = {cell_key(lb.name, r.name, c.id) for lb, r, c in cells}
    if db is None:
        from verification.tolerances import load_tolerances
        db = load_tolerances(tolerances_path)
    summary = RunSummary(out_dir=Path(out_dir) if out_dir is not None else None, selected=len(cells))
    done_keys: set = set()
    results = None
    if out_dir is not None:
        out = Path(out_dir)
        check_resume(out, resume, selection, wanted)       # before anything is written
        out.mkdir(parents=True, exist_ok=True)
        results = out / RESULTS_FILE
        if results.exists() and results.stat().st_size > 0:
            repair_partial_line(results)
            previous = read_records(results)
            done_keys = {r.key for r in previous}
            summary.records.extend(r for r in previous if r.key in wanted)
        prov = dict(provenance or {})
        if selection is not None:
            prov["selection"] = selection
        prov.setdefault("backends", {lb.name: {"spec": lb.spec, "version": lb.version, "available": lb.available,
                                               "reason": lb.reason} for lb in loaded})
        prov.setdefault("cases", {c.id: {"suite": c.suite, "seed": c.seed} for c in cases})
        runs = read_runs(out) if resume else []
        runs.append(jsonable(prov))
        (out / RUN_FILE).write_text(json.dumps({"runs": runs}, indent=1, allow_nan=False))
    todo = [(lb, r, c) for lb, r, c in cells if cell_key(lb.name, r.name, c.id) not in done_keys]
    summary.resumed = len(cells) - len(todo)
    if max_cells is not None and len(todo) > max_cells:
        todo, summary.stopped_early = todo[:max_cells], True
    truth_cache = TruthCache(device=device)
    baseline_cache = BaselineCache()
    iso = IsolatedRunner(truth_cache, baseline_cache, tolerances_path, timeout_s, guards) if isolate else None
    progress = Progress(len(todo), stream=progress_stream, tty=tty)
    current_case = None
    try:
        for lb, route, case in todo:
            if current_case is not None and case.id != current_case:
                baseline_cache.forget_case(current_case)
            current_case = case.id
            if iso is not None:
                rec = iso.run(lb, route, case, device)
            else:
                rec = run_cell(lb, route, case, truth_cache, baseline_cache, db, device, guards=guards)
            note_self_judged(rec)
            if results is not None:
                append_record(results, rec)
            summary.records.append(rec)
            summary.fresh.append(rec)
            summary.ran += 1
            progress.step(rec)
            if on_record is not None:
                on_record(rec)
    except KeyboardInterrupt:
        summary.not_run = len(cells) - len(summary.records)
        if results is not None:            # what the file holds: a record written as Ctrl-C came counts
            summary.not_run = len(cells) - len({r.key for r in read_records(results)} & wanted)
            _note_interrupted(out, len(cells), summary.not_run)
        raise Interrupted(f"interrupted: {summary.not_run} of {len(cells)} selected cells not run",
                          summary=summary) from None
    finally:
        if iso is not None:
            iso.close()
        summary.oracle_runs = dict(truth_cache.computed)
        summary.baseline_runs = dict(baseline_cache.computed)
    return summary


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        sys.exit(_child_main(sys.argv[2], sys.argv[3]))
    print("usage: python -m verification.runner --child SPEC.pt RECORD.json (used by kda-verify run --isolate)",
          file=sys.stderr)
    sys.exit(2)
