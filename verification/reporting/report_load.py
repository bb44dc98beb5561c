"""The input of a report: the records of one or more results directories and their provenance.

DIR/results.jsonl (and DIR/results-*.jsonl, one per pytest-xdist worker) are merged, the latest
record of a key winning (``load_results``, which also merges several directories, as
``kda-verify report DIR1 DIR2 --out OUT`` does); DIR/run.json holds one entry per invocation
(``load_provenance``: the latest; ``merge_provenance``: every invocation of several directories).
"""
from __future__ import annotations

import json
from pathlib import Path

from verification.judging.record import RESULTS_FILE, RUN_FILE, Record, read_records, read_runs


def results_files(out_dir) -> list[Path]:
    d = Path(out_dir)
    files = [d / RESULTS_FILE] if (d / RESULTS_FILE).exists() else []
    files += sorted(p for p in d.glob("results-*.jsonl"))
    return files


def load_results(*dirs) -> list[Record]:
    """Every cell of one or more results directories, merged over their per-worker files; one
    record per key, the latest by its ``time_utc`` (of two written in the same second, or without
    one, the last read: directories in the order given, each directory's files in
    ``results_files`` order), in first-seen order."""
    merged: dict[str, Record] = {}
    for d in dirs:
        for f in results_files(d):
            for rec in read_records(f):
                old = merged.get(rec.key)
                if old is None or str(rec.time_utc or "") >= str(old.time_utc or ""):
                    merged[rec.key] = rec
    return list(merged.values())


def merge_provenance(dirs, out_dir) -> None:
    """OUT/run.json holding every invocation of ``dirs``' run.json files, in the order given."""
    runs = [run for d in dirs for run in read_runs(d)]
    (Path(out_dir) / RUN_FILE).write_text(json.dumps({"runs": runs}, indent=1, allow_nan=False))


def load_provenance(out_dir) -> dict:
    """The provenance of the latest run into DIR (run.json holds one entry per invocation)."""
    runs = read_runs(out_dir)
    if not runs:
        return {}
    prov = dict(runs[-1])
    prov["invocations"] = len(runs)
    return prov


def not_run_of(prov: dict, records: list) -> int:
    """How many selected cells the interrupted invocation of ``prov`` (run.json's latest entry)
    left without a record among ``records`` (its ``selected`` count less the records: the report
    counts what the results files hold); 0 when it was not interrupted."""
    stop = prov.get("interrupted") if isinstance(prov, dict) else None
    if not isinstance(stop, dict):
        return 0
    if isinstance(stop.get("selected"), int):
        return max(0, stop["selected"] - len(records))
    return int(stop.get("not_run") or 0)
