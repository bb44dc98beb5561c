"""Where a run's records go: DIR/results.jsonl and DIR/run.json.

Each finished record is appended to ``DIR/results.jsonl`` at once (verification.judging.record.append_record:
write, flush, fsync), so an interrupted run loses nothing, and ``--resume`` skips every cell whose
key is already there (a partial last line, a write cut mid-line, is cut off first).  ``DIR/run.json``
holds the provenance, one entry per invocation (``{"runs": [...]}``, oldest first); an invocation
stopped by Ctrl-C says so in its entry (``note_interrupted``: the report's INTERRUPTED headline).
Which directory a run may write into (a resume of the same selection only) is
verification.running.run_select.check_resume's decision, made before anything here writes.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from verification.judging.record import (RESULTS_FILE, RUN_FILE, Record, append_record, read_records, read_runs,
                                 repair_partial_line)
from verification.judging.record import encode as jsonable


def open_run_dir(out: Path, *, resume: bool, provenance: Optional[dict], selection: Optional[dict],
                 loaded: list, cases: list) -> tuple[Path, list[Record]]:
    """Make ``out``, read the records already in its results.jsonl (a resume; a partial last line
    cut off first) and append this invocation's provenance to run.json (``selection``, the
    backends' specs and versions and the cases' suites and seeds unless ``provenance`` holds
    them; without ``resume`` run.json starts afresh).  Returns (results.jsonl's path, its records)."""
    out.mkdir(parents=True, exist_ok=True)
    results = out / RESULTS_FILE
    previous: list[Record] = []
    if results.exists() and results.stat().st_size > 0:
        repair_partial_line(results)
        previous = read_records(results)
    prov = dict(provenance or {})
    if selection is not None:
        prov["selection"] = selection
    prov.setdefault("backends", {lb.name: {"spec": lb.spec, "version": lb.version, "available": lb.available,
                                           "reason": lb.reason} for lb in loaded})
    prov.setdefault("cases", {c.id: {"suite": c.suite, "seed": c.seed} for c in cases})
    runs = read_runs(out) if resume else []
    runs.append(jsonable(prov))
    (out / RUN_FILE).write_text(json.dumps({"runs": runs}, indent=1, allow_nan=False))
    return results, previous


def store(results: Optional[Path], rec: Record) -> None:
    """Append ``rec`` to results.jsonl, durable before this returns (None: records kept in memory only)."""
    if results is not None:
        append_record(results, rec)


def recorded_keys(results: Path) -> set:
    """The cell keys results.jsonl holds now (a record written as Ctrl-C came counts)."""
    return {r.key for r in read_records(results)}


def note_interrupted(out: Path, selected: int, not_run: int) -> None:
    """Record in DIR/run.json that this invocation was interrupted, and how many of its selected
    cells have no record (the report's INTERRUPTED headline)."""
    runs = read_runs(out)
    if runs:
        runs[-1]["interrupted"] = {"selected": selected, "not_run": not_run}
        (out / RUN_FILE).write_text(json.dumps({"runs": runs}, indent=1, allow_nan=False))
