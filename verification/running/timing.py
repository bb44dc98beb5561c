"""Where a run's time went: wall time and the sums of the cells' timings.

Parts (seconds):
    build      cases built by this run: their inputs drawn (a cell whose problem came from the cache adds 0)
    oracle     float64 truths computed by this run (a cell whose truth came from the cache adds 0)
    baseline   emulated-recipe baselines computed by this run (cached ones add 0)
    cache      the disk cache of truths and baselines (verification/running/cache.py): keys, loads, stores
    compile    Triton compilation inside the kernel calls (verification/running/compile_time.py)
    kernel     the kernel calls, compile excluded
    guards     the memory guards' allocations and checks
    metrics    metrics and verdicts
    report     writing the report (loading records, plots, rendering)
    other      the rest: start-up, collection, cache lookups, child processes, ...

One process (``kda-verify run``, ``pytest -m verify``): other = wall - the parts.  Under
pytest-xdist each worker sums its own cells and its own wall; the parts add over the workers
and ``busy`` (the workers' walls plus the controller's report) replaces the wall:
other = busy - the parts, the time the workers spent outside cells.
"""
from __future__ import annotations

from typing import Iterable, Optional

from verification.judging.record import as_record

CELL_PARTS = ("build", "oracle", "baseline", "cache", "compile", "kernel", "guards", "metrics")
PARTS = CELL_PARTS + ("report", "other")
NOTES = {"kernel": "the kernel calls, compile excluded", "guards": "memory guards around the calls",
         "metrics": "metrics and verdicts", "other": "start-up, collection, caches, processes"}


def _num(x) -> float:
    """A finite number from a timing value (a number or its string, as pytest properties hold it);
    0 for anything else."""
    try:
        f = float(x)
    except (TypeError, ValueError):
        return 0.0
    return f if f == f and abs(f) != float("inf") else 0.0


def _yes(x) -> bool:
    return x is True or (isinstance(x, str) and x.strip().lower() == "true")


def cell_sums(timings: Iterable[dict]) -> dict:
    """The sums of the cells' ``timings`` dicts (records' or pytest properties' values; strings
    accepted): each part in seconds, ``cells``, fresh ``oracle_runs`` / ``baseline_runs``,
    ``compiles`` and the compile modes seen (``compile_how``)."""
    s = {f"{p}_s": 0.0 for p in CELL_PARTS}
    s.update(cells=0, build_runs=0, oracle_runs=0, baseline_runs=0, compiles=0, compile_cache_hits=0, compile_how=[],
             truths_loaded=0, baselines_loaded=0, warmup_variants=0, warmup_compiles=0, warmup_s=0.0,
             warmup_wait_s=0.0)
    for t in timings:
        t = t or {}
        s["cells"] += 1
        if t.get("build_s") is not None and not _yes(t.get("build_cached")):
            s["build_s"] += _num(t["build_s"])
            s["build_runs"] += 1
        if t.get("oracle_s") is not None and not _yes(t.get("oracle_cached")):
            s["oracle_s"] += _num(t["oracle_s"])
            s["oracle_runs"] += 1
        if t.get("baseline_s") is not None and not _yes(t.get("baseline_cached")):
            s["baseline_s"] += _num(t["baseline_s"])
            s["baseline_runs"] += 1
        for p in ("cache", "compile", "kernel", "guards", "metrics"):
            s[f"{p}_s"] += _num(t.get(f"{p}_s"))
        for k in ("truths_loaded", "baselines_loaded"):
            s[k] += int(_num(t.get(k)))
        s["compiles"] += int(_num(t.get("compiles")))
        s["compile_cache_hits"] += int(_num(t.get("compile_cache_hits")))
        how = t.get("compile_how")
        if how and how not in s["compile_how"]:
            s["compile_how"].append(how)
    return s


def add_warmup(sums: dict, warm: Optional[dict]) -> dict:
    """Add a worker's compile warm-up (verification.running.warmup.warm_up's dict) to its sums: its compile
    seconds and compiles to compile's, its calls and its wait counted apart (they are in other)."""
    if warm:
        sums["compile_s"] += float(warm.get("compile_s", 0.0))
        sums["compiles"] += int(warm.get("compiles", 0))
        sums["warmup_compiles"] += int(warm.get("compiles", 0))
        sums["warmup_variants"] += int(warm.get("mine", 0))
        sums["warmup_s"] += float(warm.get("s", 0.0))
        sums["warmup_wait_s"] += float(warm.get("wait_s", 0.0))
    return sums


def record_sums(records: Iterable) -> dict:
    """``cell_sums`` of records (verification.judging.record.Record or their dict form)."""
    return cell_sums(as_record(r).timings for r in records)


def merge_sums(many: Iterable[dict]) -> dict:
    """One sums dict from several (the xdist workers')."""
    out = cell_sums([])
    for s in many:
        for k, v in s.items():
            if k == "compile_how":
                out[k] += [h for h in v if h not in out[k]]
            elif k in out:
                out[k] += v
    return out


def breakdown(sums: dict, wall_s: float, report_s: float = 0.0, workers: Optional[list] = None) -> dict:
    """The breakdown (JSON-able): ``wall_s``, ``busy_s`` (= wall with one process; the workers'
    walls + report with xdist), every part's seconds, ``other_s`` = busy - parts, and counts.
    workers: [{"wall_s", "sums"}] of the xdist workers (then ``sums`` is their merge)."""
    bd = {"wall_s": float(wall_s)}
    for p in CELL_PARTS:
        bd[f"{p}_s"] = float(sums.get(f"{p}_s", 0.0))
    bd["report_s"] = float(report_s)
    if workers:
        bd["workers"] = len(workers)
        bd["busy_s"] = sum(float(w["wall_s"]) for w in workers) + float(report_s)
    else:
        bd["workers"] = 0
        bd["busy_s"] = float(wall_s)
    bd["other_s"] = bd["busy_s"] - sum(bd[f"{p}_s"] for p in CELL_PARTS + ("report",))
    for k in ("cells", "build_runs", "oracle_runs", "baseline_runs", "compiles", "compile_cache_hits",
              "truths_loaded", "baselines_loaded", "warmup_variants", "warmup_compiles"):
        bd[k] = int(sums.get(k, 0))
    hows = list(sums.get("compile_how") or [])
    bd["warmup_s"] = float(sums.get("warmup_s", 0.0))
    bd["warmup_wait_s"] = float(sums.get("warmup_wait_s", 0.0))
    bd["compile_how"] = ("measured" if "measured" in hows else "interpreted" if "interpreted" in hows else
                         "unavailable" if "unavailable" in hows else "no triton" if hows else "no kernel ran")
    return bd


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def part_note(bd: dict, part: str) -> str:
    if part == "build":
        return _count(bd.get("build_runs", 0), "case") + " built"
    if part == "oracle":
        return _count(bd["oracle_runs"], "truth") + " computed"
    if part == "baseline":
        return _count(bd["baseline_runs"], "baseline") + " computed"
    if part == "cache":
        t, b = bd.get("truths_loaded", 0), bd.get("baselines_loaded", 0)
        return (f"{_count(t, 'truth')}, {_count(b, 'baseline')} loaded from kda-verify's disk cache" if t or b else
                "kda-verify's disk cache: nothing loaded" if bd.get("cache_s", 0) > 0 else "kda-verify's disk cache unused")
    if part == "compile":
        how = bd.get("compile_how")
        warm = (f"; warm-up: {bd['warmup_variants']} variants, {bd.get('warmup_compiles', 0)} compiles, "
                f"{bd.get('warmup_s', 0.0):.1f} s of calls, {bd.get('warmup_wait_s', 0.0):.1f} s waiting"
                if bd.get("warmup_variants") else "")
        if how == "interpreted":
            return "interpreted (TRITON_INTERPRET=1): nothing compiled" + warm
        if how == "unavailable":
            return "not measured (Triton's compile hooks unavailable)" + warm
        if how == "no triton":
            return "Triton not used" + warm
        if how != "measured":
            return how + warm
        hits = bd.get("compile_cache_hits", 0)
        return _count(bd["compiles"], "Triton compile") + (f", {hits} loaded from Triton's cache" if hits else "") + warm
    if part == "report":
        return "loading, plots, rendering" if bd["report_s"] > 0 else "no report written"
    return NOTES.get(part, "")


def format_lines(bd: dict) -> list[str]:
    """A short table: one header line and one line per part (seconds, share, what)."""
    head = f"wall {bd['wall_s']:.1f} s, {bd['cells']} cells"
    if bd.get("workers"):
        head += (f" on {bd['workers']} xdist workers: {bd['busy_s']:.1f} s of worker time (each from its start-up; "
                 f"shares are of that)")
    lines = [head]
    busy = bd["busy_s"] if bd["busy_s"] > 0 else 1.0
    for p in PARTS:
        sec = bd.get(f"{p}_s", 0.0)
        lines.append(f"  {p:<9}{sec:9.2f} s {100 * sec / busy:5.1f}%  {part_note(bd, p)}")
    return lines


def markdown(bd: dict) -> list[str]:
    L = [f"Wall {bd['wall_s']:.1f} s for {bd['cells']} cells"
         + (f" on {bd['workers']} xdist workers ({bd['busy_s']:.1f} s of worker time; shares are of that)"
            if bd.get("workers") else "") + ".", "",
         "| part | seconds | share | what |", "|---|---|---|---|"]
    busy = bd["busy_s"] if bd["busy_s"] > 0 else 1.0
    for p in PARTS:
        sec = bd.get(f"{p}_s", 0.0)
        L.append(f"| {p} | {sec:.2f} | {100 * sec / busy:.1f}% | {part_note(bd, p)} |")
    return L
