"""``kda-verify run --suite serving``: every (serving case, prefill route, decode route) cell,
recorded as it goes, then the report (the run command's behaviour, verification/commands/run.py:
results.jsonl appended and fsynced per cell, --resume, the report, the exit policy of
verification/judging/policy.py, Ctrl-C exits 130 with the report headed INTERRUPTED).

    --backend A            the prefill side (and the decode side unless --decode-backend)
    --route R              prefill routes (default: every trace route of A running prefill calls)
    --decode-backend B     the decode side (default A)
    --decode-route R2      decode routes (default: every trace route of B running decode or spec calls)

Refused in one line, exit 2, before --out is made: a backend without RunsTraces, a route that is
not a trace route of its backend or does not run its side's groups, --suite serving beside other
suites, more than one --backend, --decode-* without --suite serving, --isolate.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from verification.commands.run import finish
from verification.errors import UsageError, writable_dir
from verification.judging.record import (RESULTS_FILE, RUN_FILE, append_record, cell_key, encode as jsonable,
                                         read_records, read_runs, repair_partial_line)
from verification.judging.tolerances import load_tolerances
from verification.reporting import provenance
from verification.running.devices import check_device
from verification.running.run_progress import Progress, RunSummary
from verification.running.run_select import check_resume, load
from verification.running.run_store import note_interrupted as _note_interrupted
from verification.running.selection import match_cases, split_list
from verification.serving.cases import get_serving_suite
from verification.serving.cells import TraceCache, case_pairs, cell_names, pairings, run_serving_cell

SUITE = "serving"


def check_serving_args(args, suites: list) -> None:
    """The refusals of the module docstring that need no backend loaded."""
    if SUITE not in suites:
        for opt, val in (("--decode-backend", getattr(args, "decode_backend", None)),
                         ("--decode-route", getattr(args, "decode_route", None))):
            if val:
                raise UsageError(f"{opt}: expected together with --suite serving, got {opt} "
                                 f"{','.join(split_list(val))} with suite(s) {', '.join(suites)}")
        return
    if len(suites) > 1:
        raise UsageError(f"--suite: expected serving alone (its cells pair trace routes, not routes), got "
                         f"{', '.join(suites)}")
    backends = split_list(args.backend)
    if len(backends) != 1:
        raise UsageError(f"--backend: expected one backend with --suite serving (the decode side is "
                         f"--decode-backend), got {', '.join(backends)}")
    if len(split_list(getattr(args, "decode_backend", None))) > 1:
        raise UsageError(f"--decode-backend: expected one backend, got {', '.join(split_list(args.decode_backend))}")
    if getattr(args, "isolate", False):
        raise UsageError("--isolate: expected without --suite serving (a serving cell runs in this process), got it")
    if getattr(args, "fuzz_n", None) is not None or getattr(args, "fuzz_seed", None) is not None:
        raise UsageError("--fuzz-n: expected together with the fuzz suite, got it with --suite serving")


def select_serving_cases(patterns: list, long: bool) -> list:
    """The serving cases, filtered by --case patterns (exact id or glob; each must match)."""

    cases = get_serving_suite(long=long or bool(patterns))
    return match_cases(cases, patterns, lambda pat: f"--case: expected a case id (or glob) of suite serving, got "
                                                    f"{pat!r}; ids look like: {', '.join(c.id for c in cases[:5])}, ...")


def plan_cells(args, device: str):
    """(prefill LoadedBackend, decode LoadedBackend, [(rp, rd)], cases, selection)."""
    spec_a = split_list(args.backend)[0]
    spec_b = (split_list(getattr(args, "decode_backend", None)) or [spec_a])[0]
    la = load(spec_a)
    lb = la if spec_b == spec_a else load(spec_b)
    pairs = pairings(la, lb, split_list(args.route) or None, split_list(getattr(args, "decode_route", None)) or None,
                     decode_option="--decode-backend" if lb is not la else "--backend")
    long = args.long == "yes" or (args.long == "auto" and device.startswith("cuda"))
    cases = select_serving_cases(split_list(args.case), long)
    if not long and not split_list(args.case):
        left = len(get_serving_suite(long=True)) - len(cases)
        if left:
            print(f"kda-verify run: {left} long case(s) of suite serving left out on {device} (--long yes runs them "
                  f"here)", file=sys.stderr)
    selection = {"--backend": [spec_a], "--decode-backend": [spec_b], "--route": split_list(args.route) or None,
                 "--decode-route": split_list(getattr(args, "decode_route", None)) or None, "--suite": [SUITE],
                 "--case": split_list(args.case)}
    return la, lb, pairs, cases, selection


def run_serving(args) -> int:
    """The serving suite's ``run`` (module docstring)."""


    started = time.perf_counter()
    check_serving_args(args, split_list(args.suite))
    if args.max_cells is not None and args.max_cells < 1:
        raise UsageError(f"--max-cells: expected an integer >= 1, got {args.max_cells}")
    device = check_device(args.device)
    la, lb, pairs, cases, selection = plan_cells(args, device)
    if args.tolerances:
        db = load_tolerances(args.tolerances)
    else:
        db = load_tolerances(None)
    cells = [(rp, rd, c) for c in cases for rp, rd in case_pairs(c, pairs, bool(split_list(args.route)))]
    keys = [cell_key(*cell_names(la, lb, rp, rd)[:2], c.id) for rp, rd, c in cells]
    wanted = set(keys)
    check_resume(args.out, args.resume, selection, wanted)
    writable_dir(args.out, "--out")
    out = Path(args.out)
    results = out / RESULTS_FILE
    summary = RunSummary(out_dir=out, selected=len(cells))
    done = set()
    if results.exists() and results.stat().st_size > 0:
        repair_partial_line(results)
        prev = read_records(results)
        done = {r["key"] for r in prev}
        summary.records.extend(r for r in prev if r["key"] in wanted)
    prov = provenance.collect(device=device, seeds={c.id: c.seed for c in cases})
    prov["selection"] = selection
    prov["backends"] = {x.name: {"spec": x.spec, "version": x.version, "available": x.available, "reason": x.reason}
                        for x in {id(la): la, id(lb): lb}.values()}
    prov["cases"] = {c.id: {"suite": c.suite, "seed": c.seed} for c in cases}
    runs = read_runs(out) if args.resume else []
    runs.append(jsonable(prov))
    (out / RUN_FILE).write_text(json.dumps({"runs": runs}, indent=1, allow_nan=False))
    todo = [(cell, k) for cell, k in zip(cells, keys) if k not in done]
    summary.resumed = len(cells) - len(todo)
    if args.max_cells is not None and len(todo) > args.max_cells:
        todo, summary.stopped_early = todo[:args.max_cells], True
    progress = Progress(len(todo))
    cache = TraceCache()
    try:
        for (rp, rd, case), _ in todo:
            rec = run_serving_cell(la, lb, rp, rd, case, db, cache, device=device, progress=sys.stderr)
            append_record(results, rec)
            summary.records.append(rec)
            summary.fresh.append(rec)
            summary.ran += 1
            progress.step(rec)
    except KeyboardInterrupt:
        summary.not_run = len(cells) - len({r["key"] for r in read_records(results)} & wanted)
        _note_interrupted(out, len(cells), summary.not_run)
    return finish(args, summary, started, reason_chars=400, breakdown_line=False)
