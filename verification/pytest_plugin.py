"""pytest plugin of kda-verify (registered through the pytest11 entry point).

``pytest -m verify`` runs the verification matrix: one test per (backend, route, case),
with ids such as ``verify[triton-seg:cps=4-stress/weak-gate-lb-0.01]``.  A test module
opts in by importing the matrix marker object (this repository: tests/test_verify_matrix.py)::

    from verification.pytest_plugin import verify  # noqa: F401

Options:
    --kda-backend B    built-in name or package.module:factory; repeatable or comma list
                       (default: every built-in backend available here, but the negative
                       controls of emulator-bad, whose deliberate bugs fail by design)
    --kda-route R      only these routes (default: every route); repeatable or comma list
    --kda-suite S      suites (default: smoke); repeatable or comma list
    --kda-case ID      only cases whose id matches (exact or glob); repeatable
    --kda-fuzz-n N     with --kda-suite fuzz: how many cases to draw (default 20)
    --kda-fuzz-seed S  with --kda-suite fuzz: the seed of the draw (default 0)
    --kda-report DIR   write DIR/results*.jsonl as cells finish and the report at session end
    --kda-device D     torch device (default: cuda:N for xdist worker gwN, N mod device_count;
                       cuda without xdist; cpu without CUDA)
    --kda-tolerances F tolerances file (default: the repository's tolerances.yaml)
    --kda-allow-skips  exit 0 even when every cell was skipped (a CI job that expects it)
    --kda-decode-backend B, --kda-decode-route R
                       with --kda-suite serving: the decode side of the serving cells
                       (verification/serving/plugin.py)
    --kda-no-cache     neither read nor write the disk cache of truths and baselines

The terminal summary's headline says how many cells were judged (``VERIFIED n of N cells:
...``); a session whose matrix judged no cell at all (``NOTHING VERIFIED: N cells skipped
(reason)``) exits 2 with one line saying why, unless --kda-allow-skips.  The session's exit
status is verification.judging.policy.exit_code of the matrix's cells (and of the other tests: one
failing is 1): a cell that failed, was mistrusted or raised 1; the harness out of memory on a
cell with no kernel failure 2; a bad --kda-* option 2 (its ``verify[options]`` item says
why); Ctrl-C 130, with the headline and the report saying ``INTERRUPTED: k of n selected
cells not run; ...`` (n counts the matrix items collected; under xdist, every item the
workers collected).
With ``--kda-backend triton`` on a machine without CUDA the plugin turns on Triton's CPU
interpreter (TRITON_INTERPRET=1) before the kernels are built, as ``kda-verify run`` does.
A cell that cannot run here (backend unavailable, case not applicable) is skipped with the
reason; so is a cell out of the kernel's contract (a documented range it does not check: the
reason says what the kernel did there, never a pass or a failure).  The terminal summary ends with the time breakdown of the cells that ran
(verification/running/timing.py; under xdist summed over the workers, which send theirs through
xdist's workeroutput), and the report carries it too.  Each test records its metrics with
``user_properties`` (what ``record_property`` writes), so ``--junitxml`` carries them.  Under pytest-xdist each worker writes
DIR/results-gwN.jsonl; the controller merges them into the report at the end.  Every cell
of one case carries ``xdist_group(case id)``, so ``--dist loadgroup`` builds each case and
computes its truth once; a serving trace's cells carry none, long traces first (``_scheduled``).  In a run whose ``-m`` expression excludes ``verify`` (the default addopts) the
matrix yields no items at all: no backend is loaded and no truth computed.

The fixture ``kda_close`` is ``kda_verify.assert_kda_close`` (kda_verify/close.py), for a kernel
author's own tests: ``def test_my_kernel(kda_close): kda_close(my_kernel(problem), problem)``.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from verification.judging.record import Record

MARKER = "verify"
_STATE_KEY = "_kda_verify_state"
_T0_KEY = "_kda_verify_t0"
_WORKERS_KEY = "_kda_verify_worker_timing"
_BREAKDOWN_KEY = "_kda_verify_breakdown"
WORKER_OUTPUT = "kda_verify_timing"
CELL_PROPERTY = "kda_cell_status"     # the user property that marks a matrix cell's report, with its status
_CELLS_KEY = "_kda_verify_cells"      # [{status, reason, backend}] of every cell reported (controller)
_NOTHING_KEY = "_kda_verify_nothing"
_INTERRUPTED_KEY = "_kda_verify_interrupted"   # Ctrl-C stopped the session
_SELECTED_KEY = "_kda_verify_selected"         # matrix items collected (after -m / -k / deselection)
_NOT_RUN_KEY = "_kda_verify_not_run"           # of those, interrupted before they reported
_OPTIONS_KEY = "_kda_verify_option_errors"     # the exit codes of verify[options] items (bad options)
OPTIONS_PROPERTY = "kda_options_exit"          # the user property of a verify[options] item: its exit code
NEGATIVE_CONTROLS_MODULE = "kda_kernels.controls"   # emulator-bad: left out of the default backends


def verify():  # pragma: no cover - a marker object: expanded into items by the collection hook
    """The verification matrix (expanded by verification.pytest_plugin into one test per cell)."""


verify._kda_verify_matrix = True


@pytest.fixture
def kda_close():
    """``kda_verify.assert_kda_close``: judge one kernel call with kda-verify's verdict, raising
    AssertionError that names the worst slice (kda_verify/close.py)."""
    # lazy: the pytest plugin loads into every pytest session (docs/design.md, Imports)
    from kda_verify import assert_kda_close
    return assert_kda_close


def pytest_addoption(parser):
    g = parser.getgroup("kda-verify", "kda-verify matrix (pytest -m verify)")
    g.addoption("--kda-backend", action="append", default=[], metavar="BACKEND",
                help="backend: built-in name or package.module:factory (repeatable, comma list; "
                     "default: every available built-in backend but the negative controls, emulator-bad)")
    g.addoption("--kda-route", action="append", default=[], metavar="ROUTE",
                help="route names (repeatable, comma list; default: every route)")
    g.addoption("--kda-suite", action="append", default=[], metavar="SUITE",
                help="case suites (repeatable, comma list; default: smoke)")
    g.addoption("--kda-case", action="append", default=[], metavar="ID",
                help="only case ids matching (exact or glob; repeatable)")
    g.addoption("--kda-decode-backend", action="append", default=[], metavar="BACKEND",
                help="with --kda-suite serving: the backend running decode and spec calls (default: --kda-backend)")
    g.addoption("--kda-decode-route", action="append", default=[], metavar="ROUTE",
                help="with --kda-suite serving: decode trace routes (default: every one of the decode backend)")
    g.addoption("--kda-fuzz-n", default=None, metavar="N",
                help="with --kda-suite fuzz: how many cases to draw (default 20; fuzz ids depend on it)")
    g.addoption("--kda-fuzz-seed", default=None, metavar="SEED",
                help="with --kda-suite fuzz: the seed of the draw (default 0)")
    g.addoption("--kda-report", default=None, metavar="DIR",
                help="write results*.jsonl into DIR as cells finish and the report at session end")
    g.addoption("--kda-device", default=None, metavar="DEVICE",
                help="torch device (default: cuda:N for xdist worker gwN; cuda; cpu without CUDA)")
    g.addoption("--kda-tolerances", default=None, metavar="YAML", help="tolerances file")
    g.addoption("--kda-no-cache", action="store_true", default=False,
                help="no disk cache of truths and baselines (verification/running/cache.py; KDA_VERIFY_CACHE=off)")
    g.addoption("--kda-allow-skips", action="store_true", default=False,
                help="exit 0 even when every cell of the matrix was skipped (without it: exit 2, nothing verified)")


def _worker_id(config) -> str | None:
    wi = getattr(config, "workerinput", None)
    return wi.get("workerid") if wi else None


def pick_device(config) -> str:
    """--kda-device, else cuda:(N mod device_count) on xdist worker gwN, cuda, or cpu."""
    # lazy: the pytest plugin loads into every pytest session (docs/design.md, Imports)
    import torch
    dev = config.getoption("--kda-device")
    if dev:
        return dev
    if not torch.cuda.is_available():
        return "cpu"
    wid = _worker_id(config)
    if wid and wid.startswith("gw") and wid[2:].isdigit():
        return f"cuda:{int(wid[2:]) % torch.cuda.device_count()}"
    return "cuda"


def _results_path(config) -> Path | None:
    out = config.getoption("--kda-report")
    if not out:
        return None
    wid = _worker_id(config)
    return Path(out) / (f"results-{wid}.jsonl" if wid else "results.jsonl")


def pytest_configure(config):
    setattr(config, _T0_KEY, time.perf_counter())
    config.addinivalue_line("markers", "verify: the on-device verification matrix (backend x route x case)")
    config.pluginmanager.register(_CellTally(config), f"kda-verify-cells-{id(config)}")
    if config.getoption("--kda-no-cache", default=False):
        # lazy: the pytest plugin loads into every pytest session (docs/design.md, Imports)
        from verification.running.cache import turn_off
        turn_off()
    out = config.getoption("--kda-report", default=None)
    if out and _worker_id(config) is None:
        # the controller (or a run without xdist) starts the report directory afresh
        from verification.errors import UsageError, writable_dir
        try:
            d = writable_dir(out, "--kda-report")
        except UsageError as e:             # one line and exit 2, as kda-verify run says it; not a traceback
            pytest.exit(f"kda-verify: error: {e}", returncode=2)
        for f in [d / "results.jsonl", *d.glob("results-*.jsonl")]:
            f.unlink(missing_ok=True)
    if _selects_verify(config):
        # lazy: the pytest plugin loads into every pytest session (docs/design.md, Imports)
        from verification.running.environment import check_triton
        from verification.errors import UsageError
        try:
            check_triton()
        except UsageError as e:             # a Triton outside the supported range: one line, exit 2
            pytest.exit(f"kda-verify: error: {e}", returncode=2)
        # --kda-backend triton on a machine without CUDA: Triton's interpreter, as kda-verify run sets it up
        from verification.running.selection import setup_interpreter
        note = setup_interpreter(_split(config.getoption("--kda-backend")), config.getoption("--kda-device") or "cpu")
        if note:
            sys.stderr.write(f"kda-verify: {note}\n")


def _selects_verify(config) -> bool:
    """Whether the -m expression can select an item marked verify (True if unsure)."""
    expr = config.option.markexpr
    if not expr:
        return True
    try:
        # lazy: optional dependency (docs/design.md, Imports)
        from _pytest.mark import MarkMatcher
        from _pytest.mark.expression import Expression
        return bool(Expression.compile(expr).evaluate(MarkMatcher.from_markers([pytest.mark.verify.mark])))
    except Exception:  # noqa: BLE001 - private API changed: generate the items and let -m decide
        return True


def _split(values) -> list[str]:
    out = []
    for v in values or []:
        out.extend(x.strip() for x in str(v).split(",") if x.strip())
    return out


class _State:
    """What every cell of one process shares: backends, truth and baseline caches, tolerances."""

    def __init__(self, config):
        # lazy: the pytest plugin loads into every pytest session (docs/design.md, Imports)
        from verification.judging.baselines import BaselineCache
        from verification.running.run_cell import TruthCache, use_device
        self.config = config
        self.device = pick_device(config)
        use_device(self.device)
        self.truth_cache = TruthCache(device=self.device, keep=2)
        self.baseline_cache = BaselineCache()
        self._db = None
        self.timings: list[dict] = []       # the timings of every cell this process ran
        self.warmup = None                  # verification.running.warmup.warm_up's figures (xdist workers)

    @property
    def db(self):
        if self._db is None:
            # lazy: the pytest plugin loads into every pytest session (docs/design.md, Imports)
            from verification.judging.tolerances import load_tolerances
            self._db = load_tolerances(self.config.getoption("--kda-tolerances"))
        return self._db


def _state(config) -> _State:
    st = getattr(config, _STATE_KEY, None)
    if st is None:
        st = _State(config)
        setattr(config, _STATE_KEY, st)
    return st


def _backends(config) -> list:
    # lazy: the pytest plugin loads into every pytest session (docs/design.md, Imports)
    from kda_kernels.base import BUILTIN_BACKENDS
    from verification.running.run_select import load, module_exists
    specs = _split(config.getoption("--kda-backend"))
    if specs:
        return [load(s) for s in specs]
    loaded = []
    for name, target in BUILTIN_BACKENDS.items():
        if target.startswith(NEGATIVE_CONTROLS_MODULE + ":"):
            continue        # deliberate bugs that fail by design: a matrix has them only when named
        if not module_exists(target.partition(":")[0]):
            continue
        try:
            lb = load(name)
        except Exception:  # noqa: BLE001 - a broken built-in adapter is just not available here
            continue
        if lb.available:
            loaded.append(lb)
    return loaded


def cell_id(backend: str, route: str, case_id: str) -> str:
    return f"{backend}-{route}-{case_id}"


def _cells(config) -> list:

    # lazy: the pytest plugin loads into every pytest session (docs/design.md, Imports)
    from verification.running.selection import fuzz_args, select_cases
    from verification.running.devices import check_device
    from verification.running.run_select import plan
    check_device(config.getoption("--kda-device"))     # a bad device or tolerance file: the options item says so
    _state(config).db
    suites = _split(config.getoption("--kda-suite")) or ["smoke"]
    if "serving" in suites:             # serving traces: pairs of trace routes (verification/serving/plugin.py)
        # lazy: the pytest plugin loads into every pytest session (docs/design.md, Imports)
        from verification.serving.plugin import serving_cells
        return serving_cells(suites, _split(config.getoption("--kda-backend")), _split(config.getoption("--kda-route")),
                             _split(config.getoption("--kda-decode-backend")),
                             _split(config.getoption("--kda-decode-route")), _split(config.getoption("--kda-case")),
                             long=pick_device(config).startswith("cuda"))
    fuzz = SimpleNamespace(fuzz_n=config.getoption("--kda-fuzz-n"), fuzz_seed=config.getoption("--kda-fuzz-seed"))
    fuzz_n, fuzz_seed = fuzz_args(fuzz, suites, names=("--kda-fuzz-n", "--kda-fuzz-seed"))
    long = pick_device(config).startswith("cuda")       # 64k-token and production shapes: on a GPU only
    cases = select_cases(suites, _split(config.getoption("--kda-case")), long=long, fuzz_n=fuzz_n,
                         fuzz_seed=fuzz_seed)
    return plan(_backends(config), _split(config.getoption("--kda-route")) or None, cases)


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector, name, obj):
    try:
        is_matrix = getattr(obj, "_kda_verify_matrix", False) is True
        is_probe = getattr(obj, "_kda_plugin_probe", False) is True
    except Exception:  # noqa: BLE001 - an object whose attribute lookup raises is not ours
        is_matrix = is_probe = False
    if is_probe:
        return []          # the "plugin is not registered" test of a matrix module: the plugin is here
    if not is_matrix:
        return None
    if not _selects_verify(collector.config):
        return []
    try:
        cells = _cells(collector.config)
    except Exception as e:  # noqa: BLE001 - bad options: one failing item that says why
        return [VerifyConfigError.from_parent(collector, name=f"{name}[options]", error=e)]
    items = []
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    for lb, route, case, grouped in _scheduled(cells, workers):
        item = VerifyItem.from_parent(collector, name=f"{name}[{cell_id(lb.name, route.name, case.id)}]",
                                      cell=(lb, route, case))
        item.add_marker(MARKER)
        if grouped:
            item.add_marker(pytest.mark.xdist_group(case.id))
        items.append(item)
    return items


def _scheduled(cells: list, workers: int = 0) -> list:
    """[(backend, route, case, grouped)] in the order xdist hands them out.

    Dense cases: in plan order, every case one xdist group, so ``--dist loadgroup`` keeps a case's
    cells on one worker, which builds the case and holds its truth once.  Measured on an H200
    (16 workers, four backends x four suites, cold): spreading a case's cells over the workers,
    largest case first, built 682 cases instead of 71, loaded 593 truths from the disk cache
    instead of 71, ran out of device memory on 12 cells of the largest cases and took 137.9 s
    instead of 108.4 s.

    Serving traces: no group, the long cases (10^4 decode steps) first, each on a worker of its
    own.  xdist's default ``--dist load`` hands each of ``workers`` workers a first chunk of
    max(2, cells / workers / 4) consecutive items (xdist's LoadScheduling), so the long cells
    stand one such chunk apart; under ``loadgroup`` (each ungrouped item its own unit, one per
    worker to begin with) they are still among the first units.  A worker does not know the
    mode (xdist sets its ``dist`` option to "no"), so the spacing is the same for every mode.
    On the H200 the two long cells of fla + fla, adjacent, went to one worker as its first chunk
    and ran back to back: 69 s of a 90 s run."""
    # lazy: the pytest plugin loads into every pytest session (docs/design.md, Imports)
    from verification.serving.cases import ServingCase
    serving = [c for c in cells if isinstance(c[2], ServingCase)]
    if not serving:
        return [(lb, route, case, True) for lb, route, case in cells]
    long = [c for c in cells if getattr(c[2], "long", False)]
    short = [c for c in cells if not getattr(c[2], "long", False)]
    gap = max(2, len(cells) // workers // 4) if workers > 1 else 1
    out = []
    for c in long:
        out.append(c)
        out.extend(short[:gap - 1])
        del short[:gap - 1]
    out.extend(short)
    return [(lb, route, case, not isinstance(case, ServingCase)) for lb, route, case in out]


class VerifyFailure(AssertionError):
    """A judged cell that did not pass (fail, mistrusted, error)."""

    def __init__(self, record: dict):
        self.record = record
        super().__init__(f"{record.get('status')}: {record.get('reason')}")


class VerifyConfigError(pytest.Item):
    def __init__(self, *, error, **kw):
        super().__init__(**kw)
        self.error = error
        self.add_marker(MARKER)

    def runtest(self):
        # lazy: the pytest plugin loads into every pytest session (docs/design.md, Imports)
        from verification.judging.policy import exit_code
        self.user_properties.append((OPTIONS_PROPERTY, exit_code(error=self.error)))   # 2 for bad input
        raise self.error

    def repr_failure(self, excinfo):
        return f"kda-verify options: {self.error}"

    def reportinfo(self):
        return self.path, None, self.name


def _properties(rec: Record) -> list[tuple[str, str]]:
    # lazy: the pytest plugin loads into every pytest session (docs/design.md, Imports)
    from verification.judging.record import decode_number as as_float
    props = [("status", rec.status), ("reason", rec.reason or ""),
             ("backend", rec.backend), ("route", rec.route), ("case", rec.case),
             ("seed", rec.seed), ("device", rec.device), ("margin", rec.margin)]
    for tname, t in (rec.tensors or {}).items():
        for k in ("err", "threshold", "baseline_err", "margin", "tolerance_key"):
            if k in t:
                props.append((f"{tname}.{k}", t[k]))
    for tname, m in (rec.metrics or {}).items():
        for k in ("rel_l2", "tail_rel_l2", "max_abs", "max_ulp", "nan_frac", "zero_frac"):
            if k in m:
                props.append((f"{tname}.{k}", m[k]))
    for k, v in (rec.timings or {}).items():
        props.append((f"time.{k}", v))
    props.append(("repro", rec.repro))
    out = []
    for k, v in props:
        if isinstance(v, float):
            v = f"{as_float(v):.6g}"
        out.append((k, "" if v is None else str(v)))
    return out


class VerifyItem(pytest.Item):
    """One (backend, route, case) cell."""

    def __init__(self, *, cell, **kw):
        super().__init__(**kw)
        self.cell = cell
        self.record = None

    def runtest(self):
        # lazy: the pytest plugin loads into every pytest session (docs/design.md, Imports)
        from verification.judging.record import append_record
        from verification.running.run_cell import note_self_judged, run_cell
        lb, route, case = self.cell
        st = _state(self.config)
        if not lb.available:
            why = f"backend unavailable: {lb.reason or 'no reason given'}"
            self.user_properties.extend([(CELL_PROPERTY, "skipped"), ("backend", lb.name), ("reason", why)])
            pytest.skip(why)
        if getattr(route, "serving", False):       # a serving-trace cell (verification/serving/plugin.py)
            rec = route.run(case, st.db, st.device)
        else:
            rec = note_self_judged(run_cell(lb, route, case, st.truth_cache, st.baseline_cache, st.db, st.device))
        self.record = rec
        self.user_properties.append((CELL_PROPERTY, str(rec.status)))
        st.timings.append(dict(rec.timings or {}))
        self.user_properties.extend(_properties(rec))
        path = _results_path(self.config)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            append_record(path, rec)
        if rec.status in ("skipped", "out-of-contract"):   # out of contract: never a pass or a failure
            pytest.skip(rec.reason)
        if rec.status == "known-fail":
            pytest.xfail(rec.reason)
        if rec.status != "pass":
            raise VerifyFailure(rec)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, VerifyFailure):
            r = excinfo.value.record
            lines = [f"{r.status.upper()}: {r.reason}"]
            for tname, t in (r.tensors or {}).items():
                lines.append(f"  {tname:<12} err {t.get('err')}  threshold {t.get('threshold')}  "
                             f"baseline {t.get('baseline_err')}  margin {t.get('margin')}  [{t.get('tolerance_key')}]")
            if r.traceback:
                lines += ["  " + ln for ln in r.traceback.strip().splitlines()[-15:]]
            lines.append(f"  repro: {r.repro}")
            return "\n".join(lines)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, self.name


def _own_timing(config) -> dict | None:
    """{"wall_s", "sums"} of the cells this process ran (None if it ran none)."""

    # lazy: the pytest plugin loads into every pytest session (docs/design.md, Imports)
    from verification.running import timing
    st = getattr(config, _STATE_KEY, None)
    if st is None or not (st.timings or st.warmup):
        return None
    return {"wall_s": time.perf_counter() - getattr(config, _T0_KEY),
            "sums": timing.add_warmup(timing.cell_sums(st.timings), st.warmup)}


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """xdist worker: before its first cell, its share of the session's Triton variants compiled
    into the shared cache, then the others awaited (verification/running/warmup.py)."""
    wi = getattr(session.config, "workerinput", None)
    if not wi:
        return
    # lazy: the pytest plugin loads into every pytest session (docs/design.md, Imports)
    from verification.running import warmup
    cells = [i.cell for i in session.items if isinstance(i, VerifyItem)]
    workers = int(wi.get("workercount") or 1)
    if cells and warmup.enabled(workers):
        st = _state(session.config)
        st.warmup = warmup.warm_up(cells, wi.get("workerid"), workers, str(wi.get("testrunuid", "run")), st.device)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist controller: a worker finished; keep the time sums it sent."""
    data = (getattr(node, "workeroutput", None) or {}).get(WORKER_OUTPUT)
    if data:
        store = getattr(node.config, _WORKERS_KEY, None)
        if store is None:
            store = []
            setattr(node.config, _WORKERS_KEY, store)
        store.append(data)


def _timing_input(config) -> dict | None:
    """What write_report / timing.breakdown need: this process's cells, or the xdist workers'."""
    # lazy: the pytest plugin loads into every pytest session (docs/design.md, Imports)
    from verification.running import timing
    workers = getattr(config, _WORKERS_KEY, None)
    if workers:
        return {"started": getattr(config, _T0_KEY), "sums": timing.merge_sums(w["sums"] for w in workers),
                "workers": workers}
    own = _own_timing(config)
    if own is None:
        return None
    return {"started": getattr(config, _T0_KEY), "sums": own["sums"]}


class _CellTally:
    """Keeps the status of every matrix cell reported (registered per config; under xdist the
    controller sees the workers' reports)."""

    def __init__(self, config):
        self.config = config

    def pytest_runtest_logreport(self, report):
        props = dict(getattr(report, "user_properties", None) or [])
        if OPTIONS_PROPERTY in props and report.when == "call":
            codes = getattr(self.config, _OPTIONS_KEY, None)
            if codes is None:
                codes = []
                setattr(self.config, _OPTIONS_KEY, codes)
            codes.append(int(props[OPTIONS_PROPERTY]))
            return
        if CELL_PROPERTY not in props or report.when != "call":
            return
        cells = getattr(self.config, _CELLS_KEY, None)
        if cells is None:
            cells = []
            setattr(self.config, _CELLS_KEY, cells)
        cells.append({"status": props[CELL_PROPERTY], "reason": str(props.get("reason", "")),
                      "backend": str(props.get("backend", ""))})

    def pytest_keyboard_interrupt(self, excinfo):
        if isinstance(excinfo.value, KeyboardInterrupt):       # Ctrl-C, not pytest.exit()
            setattr(self.config, _INTERRUPTED_KEY, True)

    def pytest_collection_finish(self, session):
        setattr(self.config, _SELECTED_KEY, sum(isinstance(i, VerifyItem) for i in session.items))

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids):
        """xdist controller: the workers collect (each the same items); -m verify selects the matrix."""
        n = sum(1 for i in ids if not i.endswith("[options]"))
        setattr(self.config, _SELECTED_KEY, max(n, getattr(self.config, _SELECTED_KEY, 0) or 0))


def _exit_status(session) -> None:
    """The session's exit status from verification.judging.policy.exit_code (the controller decides; xdist
    workers report to it): Ctrl-C 130 (and how many selected cells did not run); a bad option
    its item's code; else the matrix's cells, with the other tests' failures, 0, 1 or 2 (a matrix
    whose cells were all skipped verified nothing: 2 with one line in the summary, unless
    --kda-allow-skips).  pytest's own usage, internal and no-tests codes are kept."""
    # lazy: the pytest plugin loads into every pytest session (docs/design.md, Imports)
    from verification.judging.policy import FAILING, RESOURCE_ERROR, exit_code, nothing_verified_reason
    config = session.config
    if _worker_id(config) is not None:
        return
    cells = getattr(config, _CELLS_KEY, None) or []
    if getattr(config, _INTERRUPTED_KEY, False):
        selected = getattr(config, _SELECTED_KEY, None)
        if selected is not None:
            setattr(config, _NOT_RUN_KEY, max(0, selected - len(cells)))
        session.exitstatus = exit_code(interrupted=True)
        return
    options = getattr(config, _OPTIONS_KEY, None)
    if options:
        session.exitstatus = max(options)
        return
    if not cells:
        return
    why = nothing_verified_reason(cells)
    if why is not None:
        setattr(config, _NOTHING_KEY, why)
    if session.exitstatus not in (0, 1):
        return
    matrix_failed = sum(c["status"] in FAILING or c["status"] == RESOURCE_ERROR for c in cells)
    session.exitstatus = exit_code([c["status"] for c in cells], failed=session.testsfailed > matrix_failed,
                                   allow_nothing_verified=config.getoption("--kda-allow-skips"))


def pytest_sessionfinish(session, exitstatus):
    _exit_status(session)
    config = session.config
    if _worker_id(config) is not None:
        own = _own_timing(config)
        if own is not None and hasattr(config, "workeroutput"):
            config.workeroutput[WORKER_OUTPUT] = own
    out = config.getoption("--kda-report", default=None)
    if not out or _worker_id(config) is not None:
        return
    # lazy: the pytest plugin loads into every pytest session (docs/design.md, Imports)
    from verification.reporting import provenance
    from verification.reporting.report_load import load_results
    from verification.reporting.report_render import write_report
    d = Path(out)
    if not load_results(d):
        return
    prov = provenance.collect(device=pick_device(config))
    prov["runner"] = "pytest -m verify"
    not_run = getattr(config, _NOT_RUN_KEY, None)
    if not_run is not None:
        prov["interrupted"] = {"selected": getattr(config, _SELECTED_KEY, None), "not_run": not_run}
    (d / "run.json").write_text(json.dumps({"runs": [prov]}, indent=1, default=str))
    paths = write_report(d, timing=_timing_input(config))
    if paths.get("timing"):
        setattr(config, _BREAKDOWN_KEY, paths["timing"])
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.ensure_newline()
        tr.write_line(f"kda-verify report: {paths['md']} {paths['html']}")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The time breakdown of the matrix (the report's, when one was written)."""

    # lazy: the pytest plugin loads into every pytest session (docs/design.md, Imports)
    from verification.running import timing
    if _worker_id(config) is not None:
        return
    cells = getattr(config, _CELLS_KEY, None)
    if cells:
        # lazy: the pytest plugin loads into every pytest session (docs/design.md, Imports)
        from verification.judging.policy import headline
        terminalreporter.write_sep("-", "kda-verify")
        terminalreporter.write_line(headline(cells, getattr(config, _NOT_RUN_KEY, None) or 0))
        why = getattr(config, _NOTHING_KEY, None)
        if why is not None:
            allowed = config.getoption("--kda-allow-skips")
            terminalreporter.write_line(f"kda-verify: nothing verified: {why}" +
                                        ("; exit 0 (--kda-allow-skips)" if allowed else "; exit 2"))
    bd = getattr(config, _BREAKDOWN_KEY, None)
    if bd is None:
        ti = _timing_input(config)
        if ti is None:
            return
        bd = timing.breakdown(ti["sums"], wall_s=time.perf_counter() - ti["started"], workers=ti.get("workers"))
    terminalreporter.write_sep("-", "kda-verify time breakdown")
    for line in timing.format_lines(bd):
        terminalreporter.write_line(line)
