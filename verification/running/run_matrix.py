"""The matrix: every (backend, route, case) cell of a run, judged and recorded (``run_matrix``).

The cells are picked by verification.running.run_select (``plan``: case-major, so only the current case's
truth is held in memory), run by verification.running.run_cell (or verification.running.run_isolated, one child
process per cell), stored by verification.running.run_store as each finishes (an interrupted run loses
nothing; ``resume=True`` skips every cell already recorded) and counted by
verification.running.run_progress (the progress line and the RunSummary).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Optional

from verification.errors import Interrupted, UsageError
from verification.judging.baselines import BaselineCache
from verification.judging.record import Record, cell_key
from verification.judging.tolerances import load_tolerances
from verification.running.devices import default_device
from verification.running.run_cell import TruthCache, note_self_judged, run_cell, use_device
from verification.running.run_isolated import IsolatedRunner
from verification.running.run_progress import Progress, RunSummary
from verification.running.run_select import as_loaded, check_resume, plan
from verification.running.run_store import note_interrupted, open_run_dir, recorded_keys, store


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
    guards: memory guards per cell (verification/running/guards.py); None: on for CUDA devices.
    selection: the options that picked the cells, recorded in run.json (check_resume).

    Ctrl-C (KeyboardInterrupt) during the cells raises errors.Interrupted carrying the summary,
    whose ``not_run`` counts the selected cells without a record; run.json's entry of this
    invocation says ``interrupted`` too."""
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
        db = load_tolerances(tolerances_path)
    summary = RunSummary(out_dir=Path(out_dir) if out_dir is not None else None, selected=len(cells))
    done_keys: set = set()
    results = None
    if out_dir is not None:
        out = Path(out_dir)
        check_resume(out, resume, selection, wanted)       # before anything is written
        results, previous = open_run_dir(out, resume=resume, provenance=provenance, selection=selection,
                                         loaded=loaded, cases=cases)
        done_keys = {r.key for r in previous}
        summary.records.extend(r for r in previous if r.key in wanted)
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
            store(results, rec)
            summary.records.append(rec)
            summary.fresh.append(rec)
            summary.ran += 1
            progress.step(rec)
            if on_record is not None:
                on_record(rec)
    except KeyboardInterrupt:
        summary.not_run = len(cells) - len(summary.records)
        if results is not None:            # what the file holds: a record written as Ctrl-C came counts
            summary.not_run = len(cells) - len(recorded_keys(results) & wanted)
            note_interrupted(out, len(cells), summary.not_run)
        raise Interrupted(f"interrupted: {summary.not_run} of {len(cells)} selected cells not run",
                          summary=summary) from None
    finally:
        if iso is not None:
            iso.close()
        summary.oracle_runs = dict(truth_cache.computed)
        summary.baseline_runs = dict(baseline_cache.computed)
    return summary
