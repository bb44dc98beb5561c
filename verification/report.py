"""The report of a results directory: report.md, report.html, report.json and plots/*.png.

Input: DIR/results.jsonl (and DIR/results-*.jsonl, one per pytest-xdist worker; merged, the
latest record of a key wins: ``load_results``, which also merges several directories) and
DIR/run.json (provenance).  Output:

    report.md      the headline, then SECTIONS in order: failing cells (worst tensor, worst
                   slice, reason, repro), known failures, out-of-contract cells, skipped cells by
                   reason, routes, plots, every cell, repro lines, where the time went, provenance
    report.html    the same sections in the same order, self-contained: CSS inline, plots as
                   base64 PNG, no external asset
    report.json    {"provenance", "summary", "cells"}: strict JSON (non-finite -> "NaN"/"Infinity")
    plots/error_vs_T.png       rel-L2 of o (log) vs T (one slot per distinct T) per route, the
                               route's baseline a grey band under a dashed line
    plots/worst_chunks.png     per-chunk rel-L2 curve of o along T for the worst cells
    plots/margin_heatmap.png   route x case, colour = log10(margin), margin = err / threshold;
                               cells without a margin in their status's HTML colour
    plots/long_context.png     the long suite only: rel-L2 of o and of the final state (log) vs T
                               on a log2 axis, one line per route and gate through its dense
                               cases; the varlen pack and key-cos cases as marker-only points;
                               under it in the report, each line's error at its smallest and
                               largest T and their ratio (growth)

The headline is verification.policy.headline: ``VERIFIED n of N cells: ...`` when n cells were
judged (pass, known-fail, fail, mistrusted), ``NOTHING VERIFIED: ...`` when none was, and
``INTERRUPTED: <k> of <n> selected cells not run; ...`` first when the latest invocation that
wrote the directory was stopped by Ctrl-C (its run.json entry's ``interrupted``).  A
margin above 1 fails; below 1 it says how much headroom the tolerance leaves.
"""
from __future__ import annotations

import base64
import html
import json
import math
import re
import time
from pathlib import Path
from typing import Optional

from .policy import FAILING, JUDGED, STATUSES, UNJUDGED
from .policy import headline as policy_headline
from .record import RESULTS_FILE, RUN_FILE, Record, as_records, read_records, read_runs
from .record import decode_number as as_float
from .record import encode as jsonable

PLOTS = ("error_vs_T", "worst_chunks", "margin_heatmap", "long_context", "serving_drift")
STATUS_COLOURS = {"pass": "#2e7d32", "fail": "#c62828", "mistrusted": "#ef6c00", "crashed": "#6a1b9a",
                  "error": "#4e342e", "skipped": "#757575", "known-fail": "#f9a825", "out-of-contract": "#0277bd",
                  "resource-error": "#455a64", "bad-input": "#8d6e63"}


# ----------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------
# Summaries
# ----------------------------------------------------------------------------------------
def route_label(rec: dict) -> str:
    return f"{rec.backend}:{rec.route}"


def _tensor_err(r: dict, name: str) -> tuple[float, float]:
    """(err, baseline err) of tensor ``name`` of a record: the verdict's, else the metrics' rel-L2
    (NaN where absent)."""
    t = (r.tensors or {}).get(name) or {}
    e = as_float(t["err"]) if "err" in t else as_float(((r.metrics or {}).get(name) or {}).get("rel_l2"))
    b = as_float(t.get("baseline_err"))
    if not _finite_pos(b):
        b = as_float(((r.baseline or {}).get(name) or {}).get("rel_l2"))
    return e, b


def o_err(rec: dict) -> float:
    return _tensor_err(rec, "o")[0]


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


def summarize(records: list[Record], not_run: int = 0) -> dict:
    """Counts per status and per route (with the route's worst margin over its judged cells),
    the failing count, ``verified`` (cells judged: policy.JUDGED), ``not_run`` (selected cells an
    interrupted run left without a record), the ``headline`` and ``ok``: not interrupted, no
    cell failing and at least one verified."""
    records = as_records(records)
    counts = {s: 0 for s in STATUSES}
    per_route: dict[str, dict] = {}
    for r in records:
        st = r.status
        counts[st] = counts.get(st, 0) + 1
        pr = per_route.setdefault(route_label(r), {s: 0 for s in STATUSES} | {"worst_margin": None})
        pr[st] = pr.get(st, 0) + 1
        m = as_float(r.margin)
        if st not in UNJUDGED and r.margin is not None:
            w = pr["worst_margin"]
            pr["worst_margin"] = m if w is None or (math.isnan(m) or m > as_float(w)) else w
    failing = [r for r in records if r.status in FAILING]
    verified = sum(r.status in JUDGED for r in records)
    return {"cells": len(records), "counts": counts, "failing": len(failing), "per_route": per_route,
            "verified": verified, "not_run": not_run, "headline": headline(records, not_run),
            "ok": not failing and verified > 0 and not not_run}


def _worst(records: list[Record], n: int) -> list[Record]:
    """The n cells with the largest margin of o that have a finite per-chunk curve, the worst cell
    of each route first (so one broken route does not fill the plot), NaN margins counted as worst."""
    scored = []
    for r in records:
        curve = (((r.metrics or {}).get("o") or {}).get("chunk_rel_l2")) or []
        if r.status in UNJUDGED or not any(_finite_pos(as_float(x)) for x in curve):
            continue
        scored.append((_o_margin(r), r))
    scored.sort(key=lambda x: -x[0])
    first, rest, seen = [], [], set()
    for _, r in scored:
        (rest if route_label(r) in seen else first).append(r)
        seen.add(route_label(r))
    return (first + rest)[:n]


# ----------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------
def _plt():
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def _finite_pos(x: float) -> bool:
    return math.isfinite(x) and x > 0


def _route_colours(plt, n: int) -> list:
    """n distinguishable colours (tab20 without its greys, which the baselines use, and its reds,
    which mark failing cells)."""
    cmap = plt.get_cmap("tab20")
    pal = [cmap(i) for i in (0, 2, 4, 8, 10, 12, 16, 18, 1, 3, 5, 9, 11, 13, 17, 19)]
    return [pal[i % len(pal)] for i in range(n)]


def _o_margin(r: dict) -> float:
    m = as_float(((r.tensors or {}).get("o") or {}).get("margin"))
    return math.inf if math.isnan(m) else m


def wrap_label(label: str, width: int) -> str:
    """A route label over several lines of at most ``width`` characters, broken after a ':'
    (never inside a field; a field longer than ``width`` keeps its own line)."""
    parts = label.split(":")
    lines, cur = [], ""
    for i, part in enumerate(parts):
        piece = part + (":" if i < len(parts) - 1 else "")
        if cur and len(cur) + len(piece) > width:
            lines.append(cur)
            cur = piece
        else:
            cur += piece
    lines.append(cur)
    return "\n".join(lines)


def _t_slots(Ts: list[int]) -> list[int]:
    """The distinct T of the plot, ascending: each gets one evenly spaced slot on the x axis, so
    every T is labelled however close two are (64 and 67, 96 and 97)."""
    return sorted(set(Ts))


def _t_axis(ax, distinct: list[int], label: bool = True) -> None:
    from matplotlib.ticker import FixedLocator, NullLocator
    ax.xaxis.set_major_locator(FixedLocator(range(len(distinct))))
    ax.xaxis.set_minor_locator(NullLocator())
    step = max(1, math.ceil(len(distinct) / 40))
    labels = [str(t) if i % step == 0 else "" for i, t in enumerate(distinct)]
    rot = 0 if len(distinct) <= 8 and max(len(str(t)) for t in distinct) <= 5 else 60
    ax.set_xticks(range(len(distinct)), labels if label else [""] * len(distinct), rotation=rot,
                  ha="right" if rot else "center", fontsize=7.5)
    ax.set_xlim(-0.5, len(distinct) - 0.5)


FACET_ABOVE = 6       # more routes than this: one panel per route
MAX_PANELS = 24
BASE_BAND = dict(color="0.55", lw=7, alpha=0.35, solid_capstyle="round", zorder=1)


def _error_series(records: list[Record]) -> tuple[dict, dict, dict, set]:
    """{route label: [(T, err, status)]}, {route label: [(T, baseline err)]} of o,
    {route label: recipe} and the route labels whose cells are judged against their own recipe
    (the emulator: err = baseline by construction)."""
    series: dict[str, list] = {}
    base: dict[str, list] = {}
    recipes: dict[str, str] = {}
    self_judged: set = set()
    for r in records:
        shape = r.shape or {}
        T = shape.get("T")
        if not T or r.status in UNJUDGED:
            continue
        e, b = _tensor_err(r, "o")
        if _finite_pos(e):
            series.setdefault(route_label(r), []).append((T, e, r.status))
            recipes[route_label(r)] = r.recipe
            if r.self_judged:
                self_judged.add(route_label(r))
            if _finite_pos(b):
                base.setdefault(route_label(r), []).append((T, b))
    return series, base, recipes, self_judged


def _worst_line(pts) -> tuple[list, list]:
    Ts = sorted({p[0] for p in pts})
    return Ts, [max(p[1] for p in pts if p[0] == T) for T in Ts]


def error_vs_T_figure(records: list[Record]):
    """rel-L2 of o against T (tokens of the forward) per route, one evenly spaced slot per
    distinct T: every cell a dot, a line through the worst cell per T, the route's baseline (its
    emulated recipe, same metric) as a grey band under a dashed black line (visible where the
    route lies on it), failing cells marked by a red x.  Up to FACET_ABOVE routes share one
    panel; more get one panel each (the MAX_PANELS routes with the largest error; the heatmap
    shows every route)."""
    records = as_records(records)
    plt = _plt()
    series, base, recipes, self_judged = _error_series(records)
    if not series:
        return None
    labels = sorted(series)
    distinct = _t_slots([p[0] for pts in series.values() for p in pts])
    slot = {t: i for i, t in enumerate(distinct)}
    dropped = 0
    if len(labels) <= FACET_ABOVE:
        fig, ax = plt.subplots(figsize=(11, 6.0), dpi=110, layout="constrained")
        axes = [ax] * len(labels)
    else:
        if len(labels) > MAX_PANELS:
            labels = sorted(labels, key=lambda lab: -max(p[1] for p in series[lab]))[:MAX_PANELS]
            dropped = len(series) - MAX_PANELS
            labels.sort()
        ncol = 4
        nrow = math.ceil(len(labels) / ncol)
        fig, grid = plt.subplots(nrow, ncol, figsize=(16, 2.9 * nrow + 1.4), dpi=100, sharex=True, sharey=True,
                                 squeeze=False, layout="constrained")
        axes = [grid[i // ncol][i % ncol] for i in range(len(labels))]
        for k in range(len(labels), nrow * ncol):
            grid[k // ncol][k % ncol].axis("off")
    faceted = len(set(map(id, axes))) > 1
    # one panel per route needs no colour to tell routes apart: one strong colour reads best on the band
    colours = ["#1f77b4"] * len(labels) if faceted else _route_colours(plt, len(labels))
    any_bad = any_known = False
    for c, label, ax in zip(colours, labels, axes):
        pts = sorted(series[label])
        Ts, worst = _worst_line(pts)
        own = " (judged against its own recipe)" if label in self_judged else ""
        ax.plot([slot[t] for t in Ts], worst, "-", color=c, lw=1.6, alpha=0.95, zorder=3,
                label=None if faceted else label + own)
        ax.scatter([slot[p[0]] for p in pts], [p[1] for p in pts], s=16 if faceted else 20, color=c, alpha=0.8,
                   zorder=3)
        known = [p for p in pts if p[2] == "known-fail"]
        if known:
            ax.scatter([slot[p[0]] for p in known], [p[1] for p in known], s=70, marker="o", facecolors="none",
                       edgecolors=STATUS_COLOURS["known-fail"], linewidths=1.8, zorder=5,
                       label="known-fail cell" if not faceted and not any_known else None)
            any_known = True
        bad = [p for p in pts if p[2] in FAILING]
        if bad:
            ax.scatter([slot[p[0]] for p in bad], [p[1] for p in bad], s=55, marker="x", color="red",
                       linewidths=1.5, zorder=6, label="failing cell" if not any_bad and not faceted else None)
            any_bad = True
        if label in base and faceted:
            bT, bw = _worst_line(sorted(set(base[label])))
            ax.plot([slot[t] for t in bT], bw, **BASE_BAND)
            ax.plot([slot[t] for t in bT], bw, color="black", lw=0.9, dashes=(4, 3), zorder=4)
        if faceted:
            title = wrap_label(label, 44) + ("\njudged against its own recipe" if own else "")
            ax.set_title(title, fontsize=8)
            ax.grid(True, which="both", alpha=0.25)
    ax0 = axes[0]
    ax0.set_yscale("log")
    if faceted:
        for k, ax in enumerate(axes):
            _t_axis(ax, distinct)
            if k + ncol >= len(labels):           # nothing below it: its own T labels
                ax.xaxis.set_tick_params(labelbottom=True)
        fig.supxlabel("T (tokens per forward; varlen: all sequences), one slot per distinct T", fontsize=10)
        fig.supylabel("rel-L2 of o vs the float64 oracle", fontsize=10)
        extra = f"; {dropped} more routes in the heatmap" if dropped else ""
        fig.suptitle("Output error vs sequence length, one panel per route\n"
                     "line: worst cell per T · dots: every cell · red x: failing cell · amber ring: known-fail · grey band under a dashed "
                     f"line: the route's baseline (its emulated recipe){extra}", fontsize=10)
    else:
        by_recipe: dict[str, list] = {}
        for label in labels:
            by_recipe.setdefault(recipes.get(label) or "?", []).extend(base.get(label, []))
        dashes = [(4, 3), (2, 2), (7, 2, 1, 2), (1, 1)]
        for j, (recipe, pts) in enumerate(sorted(by_recipe.items())):
            if pts:
                bT, bw = _worst_line(sorted(set(pts)))
                ax0.plot([slot[t] for t in bT], bw, **BASE_BAND)
                ax0.plot([slot[t] for t in bT], bw, color="black", lw=0.9, dashes=dashes[j % len(dashes)], zorder=4,
                         label=f"baseline: {recipe} recipe (grey band)")
        _t_axis(ax0, distinct)
        ax0.set_xlabel("T (tokens per forward; varlen: all sequences), one slot per distinct T")
        ax0.set_ylabel("rel-L2 of o vs the float64 oracle")
        ax0.set_title("Output error vs sequence length: a line through the worst cell per T, per route")
        ax0.grid(True, which="both", alpha=0.25)
        fig.legend(loc="outside lower center", fontsize=8, ncol=2, framealpha=0.9)
    return fig


def save_figure(fig, path: Path) -> Optional[Path]:
    """Save a figure to ``path`` and close it; None (nothing written) for no figure."""
    if fig is None:
        return None
    fig.savefig(path)
    _plt().close(fig)
    return path


def plot_error_vs_T(records: list[Record], path: Path) -> Optional[Path]:
    """Save error_vs_T_figure to ``path`` (None, and nothing written, when there is nothing to plot)."""
    return save_figure(error_vs_T_figure(records), path)


def _cell_note(r: dict) -> str:
    """``cell fail (final_state 161)``: the cell's status and its tensors other than o over their
    threshold, with their margins."""
    over = []
    for n, t in (r.tensors or {}).items():
        if n == "o" or not isinstance(t, dict) or t.get("margin") is None:
            continue
        m = as_float(t.get("margin"))
        if math.isnan(m) or m > 1:
            over.append(f"{n} {m:.3g}")
    return f"cell {r.status}" + (f" ({', '.join(over)})" if over else "")


def worst_chunks_figure(records: list[Record], n: int = 6):
    """The per-chunk rel-L2 curve of o along T for the n cells with the largest o margin, each
    with its own marker and dashes (coinciding curves stay visible); each legend entry gives o's
    margin and the cell's status with the tensors over their threshold."""
    records = as_records(records)
    worst = _worst(records, n)
    if not worst:
        return None
    plt = _plt()
    from matplotlib.ticker import MaxNLocator
    fig, ax = plt.subplots(figsize=(11, 5.0 + 0.22 * len(worst)), dpi=110, layout="constrained")
    colours = _route_colours(plt, len(worst))
    for i, r in enumerate(worst):
        curve = [as_float(x) for x in r.metrics["o"]["chunk_rel_l2"]]
        xs = [k for k, v in enumerate(curve) if _finite_pos(v)]
        ys = [curve[k] for k in xs]
        if not xs:
            continue
        # markers and dashes differ per curve, largest first, so curves that coincide stay visible
        ax.plot(xs, ys, marker="osD^vP"[i % 6] if len(xs) < 40 else None, ms=max(3.0, 9.0 - 1.2 * i),
                mfc="none", mew=1.3, ls=("-", "--", "-.", ":", (0, (5, 1)), (0, (1, 2)))[i % 6], lw=1.3, color=colours[i],
                label=f"{route_label(r)}  {r.case}: o margin {_o_margin(r):.3g}, {_cell_note(r)}")
    ax.set_yscale("log")
    ax.set_xlabel("chunk index along T (32 tokens per chunk, all sequences and heads pooled)")
    ax.set_ylabel("rel-L2 of o within the chunk")
    ax.set_title(f"Per-chunk error of o: the {len(worst)} cells with the largest o margin (worst per route first)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, which="both", alpha=0.25)
    fig.legend(loc="outside lower center", fontsize=8, ncol=1, framealpha=0.9)
    return fig


def plot_worst_chunks(records: list[Record], path: Path, n: int = 6) -> Optional[Path]:
    """Save worst_chunks_figure to ``path`` (None, and nothing written, when there is nothing to plot)."""
    return save_figure(worst_chunks_figure(records, n), path)


def _short_case(case_id: str, width: int = 48) -> str:
    return clip(case_id, width)


HEAT_KINDS = {   # status (or a non-finite margin) -> (fill, text, legend); colours as the HTML's badges
    "known-fail": (STATUS_COLOURS["known-fail"], "KF", "known-fail (KF and its margin): listed in tolerances.yaml"),
    "out-of-contract": (STATUS_COLOURS["out-of-contract"], "OOC", "out of contract (OOC): not judged"),
    "skipped": (STATUS_COLOURS["skipped"], "", "skipped: not verified"),
    "crashed": (STATUS_COLOURS["crashed"], "✕", "crashed (✕)"),
    "error": (STATUS_COLOURS["error"], "E", "error (E)"),
    "resource-error": (STATUS_COLOURS["resource-error"], "OOM", "harness out of memory (OOM): not verified"),
    "bad-input": (STATUS_COLOURS["bad-input"], "BI", "bad input (BI): a file check could not read; not verified"),
    "nan": (STATUS_COLOURS["fail"], "NaN", "fail with a NaN error"),
    "inf": (STATUS_COLOURS["fail"], "∞", "fail with an infinite margin"),
}


def margin_heatmap_figure(records: list[Record]):
    """route x case grid; colour = log10(margin) (green: headroom, red: over the tolerance),
    the margin written in the cell; a red frame marks a fail, an orange one mistrusted; cells
    with no margin to colour are filled in the HTML report's colour of their status (HEAT_KINDS,
    known-fail with its margin); "self": the emulator judged against its own recipe (margin 1
    by construction)."""
    records = as_records(records)
    rows = sorted({route_label(r) for r in records})
    cols = list(dict.fromkeys(r.case for r in records))
    if not rows or not cols:
        return None
    import numpy as np
    plt = _plt()
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.patches import Patch

    grid = np.full((len(rows), len(cols)), np.nan)
    kind, framed, selfj, kf_margin = {}, [], set(), {}
    for r in records:
        i, j = rows.index(route_label(r)), cols.index(r.case)
        st = r.status
        m = as_float(r.margin)
        if st in UNJUDGED or st == "known-fail" or r.margin is None:
            kind[(i, j)] = st if st in HEAT_KINDS else "skipped"
            if st == "known-fail":
                kf_margin[(i, j)] = m
        elif math.isnan(m):
            kind[(i, j)] = "nan"
        elif math.isinf(m):
            kind[(i, j)] = "inf"          # the judged error itself is NaN / Inf, or nothing could pass
        elif m <= 0:
            grid[i, j] = -6.0             # exact: no error at all
        else:
            grid[i, j] = math.log10(m)
        if st in ("fail", "mistrusted"):
            framed.append((i, j, "#b71c1c" if st == "fail" else STATUS_COLOURS["mistrusted"]))
        if r.self_judged and st == "pass":
            selfj.add((i, j))
    cw = min(0.6, max(0.3, 14.0 / max(len(cols), 1)))
    label_in = 0.075 * max(len(c) for c in map(_short_case, cols))
    fig_w = min(40.0, 3.6 + cw * len(cols) + 1.6)
    fig_h = min(30.0, 2.8 + 0.42 * len(rows) + label_in)
    fig, ax = plt.subplots(figsize=(max(fig_w, 8.0), fig_h), dpi=100, layout="constrained")
    finite = grid[np.isfinite(grid)]
    lo = min(-0.5, float(finite.min()) if finite.size else -1.0)
    hi = max(0.5, float(finite.max()) if finite.size else 1.0)
    cmap = plt.get_cmap("RdYlGn_r").with_extremes(bad="white")
    im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=TwoSlopeNorm(vcenter=0.0, vmin=lo, vmax=hi),
                   aspect="auto", interpolation="nearest")
    small = len(cols) <= 40 and len(rows) <= 30
    for (i, j), k in kind.items():
        fill, text, _ = HEAT_KINDS[k]
        ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, color=fill))
        if k == "known-fail" and small and math.isfinite(kf_margin.get((i, j), math.nan)):
            text = f"KF {kf_margin[(i, j)]:.2g}" if kf_margin[(i, j)] < 100 else f"KF {kf_margin[(i, j)]:.0f}"
        if text and small:
            ax.text(j, i, text, ha="center", va="center", color="black" if k == "known-fail" else "white",
                    fontsize=6.5)
    for i, j, colour in framed:
        ax.add_patch(plt.Rectangle((j - 0.46, i - 0.46), 0.92, 0.92, fill=False, edgecolor=colour, lw=2.2))
    if small:
        for i in range(len(rows)):
            for j in range(len(cols)):
                v = grid[i, j]
                if np.isfinite(v) and (i, j) not in kind:
                    mv = 10 ** v
                    txt = "self" if (i, j) in selfj else (f"{mv:.0f}" if mv >= 100 else f"{mv:.2g}")
                    ax.text(j, i, txt, ha="center", va="center", fontsize=6.5,
                            color="white" if abs(v) > 0.6 * max(abs(lo), hi) else "black")
    ax.set_xticks(range(len(cols)))
    ax.set_xticklabels([_short_case(c) for c in cols], rotation=60, ha="right", fontsize=7)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(rows, fontsize=8)
    cb = fig.colorbar(im, ax=ax, fraction=0.04, pad=0.02)
    cb.set_label("log10(margin), margin = err / threshold; > 0 fails", fontsize=8)
    ax.set_title("Margin per route and case (err / threshold; > 1 fails)", fontsize=10)
    handles = []
    if any(c == "#b71c1c" for *_, c in framed):
        handles.append(Patch(facecolor="white", edgecolor="#b71c1c", lw=2, label="red frame: fail"))
    if any(c != "#b71c1c" for *_, c in framed):
        handles.append(Patch(facecolor="white", edgecolor=STATUS_COLOURS["mistrusted"], lw=2,
                             label="orange frame: mistrusted"))
    for k in HEAT_KINDS:
        if k in kind.values():
            handles.append(Patch(facecolor=HEAT_KINDS[k][0], label=HEAT_KINDS[k][2]))
    if selfj:
        handles.append(Patch(facecolor="#ffffbf", edgecolor="0.7", label="self: the emulator judged against its own "
                                                                            "recipe (margin 1 by construction)"))
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncol=2 if fig_w < 12 else 3, fontsize=7.5,
                   framealpha=0.9)
    return fig


def plot_margin_heatmap(records: list[Record], path: Path) -> Optional[Path]:
    """Save margin_heatmap_figure to ``path`` (None, and nothing written, when there is nothing to plot)."""
    return save_figure(margin_heatmap_figure(records), path)


# ---- long context ------------------------------------------------------------------------
LONG_PREFIX = "long/"
STATE_TENSORS = ("final_state", "state_cache")       # the first of these a record has is its state
LONG_MARKERS = {"dense": "o", "dense-other-H": "D", "varlen": "s", "key-cos": "^"}
LONG_KIND_NOTE = {"dense": "dense (line)", "dense-other-H": "dense, another H", "varlen": "varlen pack (all tokens)",
                  "key-cos": "key-cos 0.85-0.97"}
GATE_STYLES = ("-", "--", ":", "-.")                 # by gate, strongest (most negative lb) first


def _state_name(r: dict) -> Optional[str]:
    have = set(r.tensors or {}) | set(r.metrics or {})
    return next((n for n in STATE_TENSORS if n in have), None)


def _record_T(r: dict) -> Optional[int]:
    """The problem's T (a varlen pack: all its tokens): shape, else shape_key, else the params."""
    T = (r.shape or {}).get("T")
    if not T and r.shape_key:
        T = r.shape_key[1]
    p = r.params or {}
    if not T:
        T = sum(p["lens"]) if p.get("lens") else p.get("T")
    return int(T) if T else None


def _long_gate(r: dict) -> float:
    p = r.params or {}
    if "lb" in p:
        return as_float(p["lb"])
    m = re.search(r"-lb(-?[0-9.]+)$", str(r.case))
    return float(m.group(1)) if m else -5.0


def _long_points(records: list[Record]) -> list[Record]:
    """One point per judged cell of the long suite: route label, gate, kind (dense / varlen /
    key-cos), H, T and the o and state errors with their baselines."""
    pts = []
    for r in records:
        case = str(r.case or "")
        if not case.startswith(LONG_PREFIX) or r.status in UNJUDGED:
            continue
        T = _record_T(r)
        if not T:
            continue
        p = r.params or {}
        kind = ("varlen" if p.get("lens") or "/varlen" in case else
                "key-cos" if p.get("key_cos") or "/key-cos" in case else "dense")
        state = _state_name(r)
        o, ob = _tensor_err(r, "o")
        s, sb = _tensor_err(r, state) if state else (math.nan, math.nan)
        pts.append({"label": route_label(r), "gate": _long_gate(r), "kind": kind, "H": (r.shape or {}).get("H"),
                    "T": T, "status": r.status, "o": o, "o_base": ob, "state": s, "state_base": sb})
    return pts


def _long_lines(pts: list[Record]) -> dict:
    """{(route label, gate, H): {T: point}} over the dense points (the worst cell per T)."""
    lines: dict = {}
    for p in pts:
        if p["kind"] == "dense":
            cur = lines.setdefault((p["label"], p["gate"], p["H"]), {})
            if p["T"] not in cur or not p["o"] <= cur[p["T"]]["o"]:
                cur[p["T"]] = p
    return lines


def _tokens(T: int) -> str:
    """16384 -> 16K, 1048576 -> 1M, 528384 -> 516K."""
    if T >= 2 ** 20 and T % 2 ** 20 == 0:
        return f"{T >> 20}M"
    return f"{T / 1024:.0f}K" if T >= 1024 else str(T)


def long_context_figure(records: list[Record]):
    """The long suite's errors against T, two panels: rel-L2 of o and of the final state
    (final_state, else state_cache) vs the float64 oracle, y log, x T tokens on a log2 axis
    (ticks at the T of the dense cases).  Per route a colour; per (route, gate, H) a line through
    its dense cases (worst cell per T), solid for the strongest gate (lb -5), dashed for the next
    (lb -0.05), diamonds where H is not the route's smallest (T131072-H96); the route's baseline
    (its emulated recipe) a thin grey line of the same dashes under it.  The varlen pack (at all
    its tokens) and the key-cos cases are marker-only points (square, triangle; filled at the
    strongest gate, open at the others) with the baseline as a grey bar.  Failing cells get a
    red x, known-fail ones an amber ring.  None when no long-suite cell has a finite error of o."""
    records = as_records(records)
    pts = [p for p in _long_points(records) if _finite_pos(p["o"])]
    if not pts:
        return None
    plt = _plt()
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, NullFormatter
    labels = sorted({p["label"] for p in pts})
    colour = dict(zip(labels, _route_colours(plt, len(labels))))
    gates = sorted({p["gate"] for p in pts})
    style = {g: GATE_STYLES[min(i, len(GATE_STYLES) - 1)] for i, g in enumerate(gates)}
    min_H = {lab: min((p["H"] or 0) for p in pts if p["label"] == lab and p["kind"] == "dense") for lab in labels
             if any(p["label"] == lab and p["kind"] == "dense" for p in pts)}
    lines = _long_lines(pts)
    fig, axes = plt.subplots(1, 2, figsize=(14, 6.2), dpi=110, layout="constrained")
    kinds_seen, any_bad, any_known = set(), False, False
    for ax, key, title in ((axes[0], "o", "o"), (axes[1], "state", "final state (final_state or state_cache)")):
        drawn = False
        for (lab, gate, H), by_T in sorted(lines.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0)):
            Ts = [t for t in sorted(by_T) if _finite_pos(by_T[t][key])]
            if not Ts:
                continue
            kind = "dense" if (H or 0) == min_H.get(lab) else "dense-other-H"
            kinds_seen.add(kind)
            ax.plot(Ts, [by_T[t][key] for t in Ts], ls=style[gate], marker=LONG_MARKERS[kind], ms=5,
                    color=colour[lab], lw=1.6, zorder=3)
            bT = [t for t in Ts if _finite_pos(by_T[t][key + "_base"])]
            if bT:
                ax.plot(bT, [by_T[t][key + "_base"] for t in bT], ls=style[gate], color="0.6", lw=0.9, zorder=2,
                        marker="_" if len(bT) == 1 else None, ms=9)
            drawn = True
        for p in pts:
            if p["kind"] == "dense" or not _finite_pos(p[key]):
                continue
            kinds_seen.add(p["kind"])
            c = colour[p["label"]]
            ax.scatter([p["T"]], [p[key]], marker=LONG_MARKERS[p["kind"]], s=42, facecolors=c if p["gate"] == gates[0]
                       else "none", edgecolors=c, linewidths=1.3, zorder=4)
            if _finite_pos(p[key + "_base"]):
                ax.scatter([p["T"]], [p[key + "_base"]], marker="_", s=90, color="0.6", linewidths=1.2, zorder=2)
            drawn = True
        mine = [p for p in pts if _finite_pos(p[key])]
        bad = [p for p in mine if p["status"] in FAILING]
        known = [p for p in mine if p["status"] == "known-fail"]
        if bad:
            ax.scatter([p["T"] for p in bad], [p[key] for p in bad], s=70, marker="x", color="red", linewidths=1.6,
                       zorder=6)
            any_bad = True
        if known:
            ax.scatter([p["T"] for p in known], [p[key] for p in known], s=110, marker="o", facecolors="none",
                       edgecolors=STATUS_COLOURS["known-fail"], linewidths=1.8, zorder=5)
            any_known = True
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = sorted({p["T"] for p in pts if p["kind"] == "dense"} or {p["T"] for p in pts})
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.set_xticks(ticks, [_tokens(t) for t in ticks], fontsize=8)
        ax.xaxis.set_minor_formatter(NullFormatter())
        Tall = [p["T"] for p in pts]
        ax.set_xlim(min(Tall) / 1.4, max(Tall) * 1.4)
        ax.set_xlabel("T (tokens per forward; varlen: all sequences), log2 axis")
        ax.set_ylabel(f"rel-L2 of {key if key == 'o' else 'the final state'} vs the float64 oracle")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.25)
        if not drawn:
            ax.text(0.5, 0.5, "no cell with this tensor", transform=ax.transAxes, ha="center", va="center",
                    color="0.4")
    handles = [Line2D([], [], color=colour[lab], lw=2.2, label=lab) for lab in labels]
    handles += [Line2D([], [], color="black", ls=style[g], lw=1.4, marker="o", mfc="black" if g == gates[0] else "none",
                       label=f"lb {g:g} ({'solid, points filled' if g == gates[0] else 'points open'})") for g in gates]
    handles += [Line2D([], [], color="0.3", ls="none", marker=LONG_MARKERS[k], label=LONG_KIND_NOTE[k])
                for k in LONG_MARKERS if k in kinds_seen]
    handles.append(Line2D([], [], color="0.6", lw=0.9, label="baseline: the route's emulated recipe"))
    if any_bad:
        handles.append(Line2D([], [], color="red", ls="none", marker="x", mew=1.6, label="failing cell"))
    if any_known:
        handles.append(Line2D([], [], ls="none", marker="o", mfc="none", mec=STATUS_COLOURS["known-fail"], mew=1.8,
                              ms=9, label="known-fail cell"))
    fig.suptitle("Long context: error vs T, per route (colour) and gate (line style)", fontsize=11)
    fig.legend(handles=handles, loc="outside lower center", fontsize=8, ncol=min(4, len(handles)), framealpha=0.9)
    return fig


def plot_long_context(records: list[Record], path: Path) -> Optional[Path]:
    """Save long_context_figure to ``path`` (None, and nothing written, when there is nothing to plot)."""
    return save_figure(long_context_figure(records), path)


LONG_COLS = ("route", "gate", "H", "T small", "T large", "o err small", "o err large", "o growth",
             "state err small", "state err large", "state growth")


def long_growth_rows(records: list[Record]) -> list[list[str]]:
    """One row per line of long_context_figure with at least two T: the o and state errors at its
    smallest and its largest T and their ratio (large / small), "–" where a tensor is absent."""
    records = as_records(records)
    rows = []
    for (lab, gate, H), by_T in sorted(_long_lines([p for p in _long_points(records) if _finite_pos(p["o"])]).items(),
                                       key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0)):
        if len(by_T) < 2:
            continue
        lo, hi = by_T[min(by_T)], by_T[max(by_T)]
        row = [lab, f"lb {gate:g}", str(H if H is not None else "–"), _tokens(lo["T"]), _tokens(hi["T"])]
        for key in ("o", "state"):
            a, b = lo[key], hi[key]
            row += [_g(a) if math.isfinite(a) else "–", _g(b) if math.isfinite(b) else "–",
                    _g(b / a) if _finite_pos(a) and math.isfinite(b) else "–"]
        rows.append(row)
    return rows


def plot_serving_drift(records: list[Record], path: Path) -> Optional[Path]:
    from verification.serving.report import plot_drift      # the serving cells' drift curve
    return plot_drift(records, path)


PLOT_FUNCS = {"error_vs_T": plot_error_vs_T, "worst_chunks": plot_worst_chunks, "margin_heatmap": plot_margin_heatmap,
              "long_context": plot_long_context, "serving_drift": plot_serving_drift}


def make_plots(records: list[Record], plots_dir: Path) -> dict[str, Path]:
    records = as_records(records)
    plots_dir.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in PLOTS:
        p = PLOT_FUNCS[name](records, plots_dir / f"{name}.png")
        if p is not None:
            out[name] = p
        else:
            (plots_dir / f"{name}.png").unlink(missing_ok=True)
    return out


# ----------------------------------------------------------------------------------------
# Rendering: one list of sections, rendered to Markdown and to HTML in the same order
# ----------------------------------------------------------------------------------------
OUT_OF_CONTRACT = "Out of contract (outside the documented range of the kernel or the range of its recipe)"
SECTIONS = ("Failing cells", "Known failures", OUT_OF_CONTRACT, "Skipped (not verified)", "Routes", "Plots",
            "Serving traces", "Cells", "Repro", "Where the time went", "Provenance")
REASON_CHARS = 200


def _g(x, fmt=".3g") -> str:
    if x is None:
        return "–"
    f = as_float(x)
    if math.isnan(f) and isinstance(x, str) and x.lower() != "nan":
        return str(x)
    return format(f, fmt) if math.isfinite(f) else str(x if isinstance(x, str) else f)


def clip(text: str, width: int) -> str:
    """``text`` on one line, at most ``width`` characters plus " …": cut at the last space before
    ``width`` (trailing , ; : dropped) and ended with " …"; a first word longer than ``width`` is
    kept whole (never cut mid-word)."""
    t = " ".join(str(text or "").split())
    if len(t) <= width:
        return t
    cut = t.rfind(" ", 0, width)
    if cut <= 0:
        nxt = t.find(" ", width)
        return t if nxt < 0 else t[:nxt].rstrip(",;:") + " …"
    return t[:cut].rstrip(" ,;:") + " …"


def _repro(rec: dict, out_dir: Path) -> str:
    return re.sub(r"--out DIR\b", f"--out {out_dir}/repro", rec.repro)


def _tensor_margin(t: dict) -> float:
    """The whole-tensor margin of a tensor record (its ``margin`` is the worse of the whole and
    its worst slice, kept apart as ``tensor_margin`` and ``slice``)."""
    m = as_float(t.get("tensor_margin", t.get("margin")))
    return math.inf if math.isnan(m) else m


def worst_tensor(rec: dict) -> tuple[Optional[str], dict]:
    """(name, record) of the tensor of a cell with the largest margin (NaN counted as worst)."""
    best, name = None, None
    for n, t in (rec.tensors or {}).items():
        if not isinstance(t, dict) or t.get("margin") is None:
            continue
        m = as_float(t.get("margin"))
        m = math.inf if math.isnan(m) else m
        if best is None or m > best:
            best, name = m, n
    return name, ((rec.tensors or {}).get(name) or {}) if name else {}


def _dtypes(rec: dict) -> str:
    """``o bf16, final_state fp32``; a dtype other than expected as ``fp32 (expected bf16)``."""
    parts = []
    for n, t in (rec.tensors or {}).items():
        if isinstance(t, dict) and t.get("dtype"):
            d = str(t["dtype"])
            want = t.get("expected_dtype")
            parts.append(f"{n} {d}" + (f" (expected {want})" if want and want != d else ""))
    return ", ".join(parts) or "–"


def cell_rows(records: list[Record]) -> list[Record]:
    """One flat row per cell for the tables."""
    records = as_records(records)
    rows = []
    for r in records:
        t = (r.tensors or {}).get("o") or {}
        m = ((r.metrics or {}).get("o") or {})
        st_t = (r.tensors or {}).get("final_state") or (r.tensors or {}).get("state_cache") or {}
        shape = r.shape or {}
        rows.append({
            "status": r.status, "backend": r.backend, "route": r.route, "case": r.case,
            "shape": f"{shape.get('B')}x{shape.get('T')}x{shape.get('H')}" if shape else "–",
            "o_err": _g(t.get("err", m.get("rel_l2"))), "o_tail": _g(m.get("tail_rel_l2")),
            "o_threshold": _g(t.get("threshold")), "baseline": _g(t.get("baseline_err")),
            "state_err": _g(st_t.get("err")), "margin": _g(r.margin), "dtypes": _dtypes(r),
            "kernel_ms": _g(as_float((r.timings or {}).get("kernel_s")) * 1e3, ".3g")
            if (r.timings or {}).get("kernel_s") is not None else "–",
            "reason": clip(r.reason or "", REASON_CHARS),
        })
    return rows


TABLE_COLS = (("status", "status"), ("backend", "backend"), ("route", "route"), ("case", "case"),
              ("shape", "B×T×H"), ("o_err", "o rel-L2"), ("o_tail", "o tail"), ("baseline", "baseline"),
              ("o_threshold", "threshold"), ("state_err", "state rel-L2"), ("margin", "margin"),
              ("dtypes", "dtypes"), ("kernel_ms", "kernel ms"), ("reason", "reason"))
NUM_COLS = {"o rel-L2", "o tail", "baseline", "threshold", "state rel-L2", "margin", "kernel ms", "err",
            "slice err", "slice baseline", "slice margin", "cells", "worst margin", "seconds", "share",
            "H", "T small", "T large", "o err small", "o err large", "o growth", "state err small",
            "state err large", "state growth"}
FAIL_COLS = ("status", "backend", "route", "case", "tensor", "err", "threshold", "margin", "worst slice",
             "slice err", "slice baseline", "slice margin")


def failing_row(rec: dict) -> list[str]:
    """The failing-cells table's row of one cell: its worst tensor (whole-tensor err, threshold,
    margin) and that tensor's worst slice (where, err, the baseline's err there, margin)."""
    name, t = worst_tensor(rec)
    sl = t.get("slice") if isinstance(t.get("slice"), dict) else {}
    return [str(rec.status), str(rec.backend), str(rec.route), str(rec.case),
            name or "–", _g(t.get("err")) if t else "–", _g(t.get("threshold")) if t else "–",
            _g(_tensor_margin(t)) if t else "–", str(sl.get("where", "–")), _g(sl.get("err")) if sl else "–",
            _g(sl.get("baseline_err")) if sl else "–", _g(sl.get("margin")) if sl else "–"]


def _skip_groups(records: list[Record]) -> list[tuple[int, str]]:
    groups: dict[str, int] = {}
    for r in records:
        if r.status == "skipped":
            k = clip(r.reason or "no reason given", REASON_CHARS)
            groups[k] = groups.get(k, 0) + 1
    return sorted(((n, k) for k, n in groups.items()), key=lambda x: (-x[0], x[1]))


def _cell_name(r: dict) -> str:
    return f"{r.backend} {r.route} {r.case}"


def _tail(r: dict, n: int) -> tuple[str, str]:
    what = "stderr tail" if r.stderr_tail else "traceback tail"
    text = r.stderr_tail or r.traceback or ""
    return what, "\n".join(text.strip().splitlines()[-n:])


def headline(records: list[Record], not_run: int = 0) -> str:
    """The report's headline, the same line ``kda-verify run`` and ``pytest -m verify`` print
    (verification.policy.headline): ``VERIFIED n of N cells: ...`` when n cells were judged (pass,
    known-fail, fail, mistrusted), else ``NOTHING VERIFIED: ...``, after ``INTERRUPTED: ...`` when
    ``not_run`` selected cells were not run; never ALL PASS over skips."""
    return policy_headline(records, not_run)


def sections(summary: dict, records: list[Record], prov: dict, plots: dict, out_dir: Path,
             breakdown: Optional[dict] = None) -> list[tuple[str, list]]:
    """[(title, blocks)] in SECTIONS order, the sections with nothing to show left out.  A block
    is ("text", str), ("table", headers, rows), ("items", [(status, cell, text, [(label, code)],
    tail)]), ("code", str) or ("images", plots)."""
    records = as_records(records)
    out: list[tuple[str, list]] = []
    failing = [r for r in records if r.status in FAILING]
    if failing:
        items = []
        for r in failing:
            subs = [("repro", _repro(r, out_dir))]
            items.append((r.status, _cell_name(r), r.reason, subs,
                          _tail(r, 12) if (r.stderr_tail or r.traceback) else None))
        out.append(("Failing cells", [
            ("text", "Each cell's worst tensor against its threshold, and that tensor's worst slice (the "
                     "(sequence, head), 16-token block or cache slot whose error is furthest over its "
                     "own threshold) against the baseline's error on the same slice."),
            ("table", list(FAIL_COLS), [failing_row(r) for r in failing]), ("items", items)]))
    known = [r for r in records if r.status == "known-fail"]
    if known:
        out.append(("Known failures", [
            ("text", "Listed in tolerances.yaml with their reason and evidence; they do not fail the run."),
            ("items", [("known-fail", _cell_name(r), r.reason, [], None) for r in known])]))
    ooc = [r for r in records if r.status == "out-of-contract"]
    if ooc:
        out.append((OUT_OF_CONTRACT, [
            ("text", "Cells whose inputs lie outside the range the kernel documents but does not check, or "
                     "outside its precision recipe's range (fp16 storage flushing or overflowing, where the "
                     "recipe itself errs as much as the kernel); each reason says what the kernel did, with "
                     "the numbers. Never counted as a pass or a failure."),
            ("items", [("out-of-contract", _cell_name(r), r.reason, [("repro", _repro(r, out_dir))],
                        None) for r in ooc])]))
    skipped = _skip_groups(records)
    if skipped:
        out.append(("Skipped (not verified)", [("table", ["cells", "reason"], [[str(n), k] for n, k in skipped])]))
    present = [s for s in STATUSES if summary["counts"].get(s)] or ["pass", "fail"]
    present += [s for s in summary["counts"] if s not in STATUSES and summary["counts"][s]]
    out.append(("Routes", [("table", ["route"] + present + ["worst margin"],
                            [[route] + [str(pr.get(s, 0)) for s in present] + [_g(pr["worst_margin"])]
                             for route, pr in sorted(summary["per_route"].items())])]))
    if plots:
        blocks = [("images", plots)]
        growth = long_growth_rows(records) if "long_context" in plots else []
        if growth:
            blocks += [("text", "Long context (long_context.png): each line's error at its smallest and its largest T, "
                                "and their ratio (growth = large / small)."),
                       ("table", list(LONG_COLS), growth)]
        out.append(("Plots", blocks))
    from verification.serving.report import serving_sections    # serving-trace cells: their own table
    out += serving_sections(records)
    rows = cell_rows(records)
    out.append(("Cells", [("table", [h for _, h in TABLE_COLS], [[str(row[k]) for k, _ in TABLE_COLS] for row in rows])]))
    repro = [_repro(r, out_dir) for r in records if r.status != "skipped" and r.repro]
    if repro:
        out.append(("Repro", [("text", "One command per cell (the same --out may be reused with --resume):"),
                              ("code", "\n".join(repro))]))
    if breakdown:
        from .timing import PARTS, part_note
        busy = breakdown["busy_s"] if breakdown["busy_s"] > 0 else 1.0
        out.append(("Where the time went", [
            ("text", f"Wall {breakdown['wall_s']:.1f} s for {breakdown['cells']} cells"
                     + (f" on {breakdown['workers']} xdist workers ({breakdown['busy_s']:.1f} s of worker time; "
                        "shares are of that)" if breakdown.get("workers") else "") + "."),
            ("table", ["part", "seconds", "share", "what"],
             [[p, f"{breakdown.get(f'{p}_s', 0.0):.2f}", f"{100 * breakdown.get(f'{p}_s', 0.0) / busy:.1f}%",
               part_note(breakdown, p)]
              for p in PARTS])]))
    out.append(("Provenance", [("code", json.dumps(jsonable(_prov_public(prov)), indent=1))]))
    assert [t for t, _ in out] == [t for t in SECTIONS if t in {x for x, _ in out}]
    return out


def _md_escape(s) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def render_markdown(summary: dict, records: list[Record], prov: dict, plots: dict, out_dir: Path,
                    breakdown: Optional[dict] = None) -> str:
    records = as_records(records)
    L = ["# kda-verify report", "", f"**{summary['headline']}**"]
    for title, blocks in sections(summary, records, prov, plots, out_dir, breakdown):
        L += ["", f"## {title}", ""]
        for b in blocks:
            if b[0] == "text":
                L += [b[1], ""]
            elif b[0] == "table":
                L.append("| " + " | ".join(b[1]) + " |")
                L.append("|" + "---|" * len(b[1]))
                L += ["| " + " | ".join(_md_escape(c) for c in row) + " |" for row in b[2]]
                L.append("")
            elif b[0] == "items":
                for st, cell, text, subs, tail in b[1]:
                    L.append(f"- **{st}** `{cell}` — {_md_escape(text)}")
                    L += [f"  - {label}: `{code}`" for label, code in subs]
                    if tail:
                        L += [f"  - {tail[0]}:", "", "```", tail[1], "```", ""]
                L.append("")
            elif b[0] == "code":
                L += ["```", b[1], "```", ""]
            elif b[0] == "images":
                for name, p in b[1].items():
                    L += [f"![{name}]({Path(p).relative_to(out_dir).as_posix()})", ""]
    return "\n".join(L).rstrip("\n") + "\n"


def _prov_public(prov: dict) -> dict:
    p = dict(prov)
    seeds = p.get("seeds") or {}
    if len(seeds) > 50:
        p["seeds"] = {"count": len(seeds), "first": dict(list(seeds.items())[:10])}
    p.pop("cases", None)
    p.pop("time_breakdown", None)          # shown in its own section
    return p


_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1500px}
h1{font-size:22px} h2{font-size:17px;border-bottom:1px solid #ddd;padding-bottom:3px;margin-top:28px}
table{border-collapse:collapse;font-size:12px} th,td{border:1px solid #ddd;padding:3px 6px;text-align:left}
th{background:#f3f3f3;position:sticky;top:0} td.num{text-align:right;font-family:monospace}
.st{color:#fff;border-radius:3px;padding:1px 5px;font-size:11px;font-weight:600}
code,pre{font-family:Menlo,Consolas,monospace;font-size:11.5px} pre{background:#f6f8fa;padding:8px;overflow:auto}
img{max-width:100%;border:1px solid #eee;margin:6px 0} .verdict{font-size:16px;font-weight:700}
li{margin-bottom:6px}
"""


def _img_tag(path: Path, alt: str) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def headline_colour(summary: dict) -> str:
    """Red when a cell failed, orange when nothing was verified or the run was interrupted, green
    otherwise."""
    if summary["failing"]:
        return STATUS_COLOURS["fail"]
    return STATUS_COLOURS["pass"] if summary["verified"] and not summary.get("not_run") else STATUS_COLOURS["mistrusted"]


def render_html(summary: dict, records: list[Record], prov: dict, plots: dict, out_dir: Path,
                breakdown: Optional[dict] = None) -> str:
    records = as_records(records)
    e = html.escape

    def badge(st):
        return f'<span class="st" style="background:{STATUS_COLOURS.get(st, "#999")}">{e(str(st))}</span>'

    H = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8"><title>kda-verify report</title>',
         f"<style>{_CSS}</style></head><body>", "<h1>kda-verify report</h1>",
         f'<p class="verdict" style="color:{headline_colour(summary)}">{e(summary["headline"])}</p>']
    for title, blocks in sections(summary, records, prov, plots, out_dir, breakdown):
        H.append(f"<h2>{e(title)}</h2>")
        for b in blocks:
            if b[0] == "text":
                H.append(f"<p>{e(b[1])}</p>")
            elif b[0] == "table":
                heads = b[1]
                H.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in heads) + "</tr>")
                for row in b[2]:
                    cells = []
                    for h, v in zip(heads, row):
                        if h == "status":
                            cells.append(f"<td>{badge(v)}</td>")
                        elif h in NUM_COLS or (heads[0] == "route" and h != "route"):
                            cells.append(f'<td class="num">{e(v)}</td>')
                        else:
                            cells.append(f"<td>{e(v)}</td>")
                    H.append("<tr>" + "".join(cells) + "</tr>")
                H.append("</table>")
            elif b[0] == "items":
                H.append("<ul>")
                for st, cell, text, subs, tail in b[1]:
                    H.append(f"<li>{badge(st)} <code>{e(cell)}</code>: {e(text)}"
                             + "".join(f"<br>{e(label)}: <code>{e(code)}</code>" for label, code in subs))
                    if tail:
                        H.append(f"<br>{e(tail[0])}:<pre>{e(tail[1])}</pre>")
                    H.append("</li>")
                H.append("</ul>")
            elif b[0] == "code":
                H.append(f"<pre>{e(b[1])}</pre>")
            elif b[0] == "images":
                for name, p in b[1].items():
                    H.append(f"<div>{_img_tag(p, name)}</div>")
    H.append("</body></html>")
    return "\n".join(H)


def write_report(out_dir, records: Optional[list[Record]] = None, provenance: Optional[dict] = None,
                 timing: Optional[dict] = None) -> dict:
    """Write report.md, report.html, report.json and plots/ into out_dir; return their paths and
    ``timing``, the run's time breakdown (verification/timing.py), or None.

    timing: {"started": time.perf_counter() at the run's start, "sums": timing.cell_sums(...) of
    the cells this run executed, optionally "workers": [{"wall_s", "sums"}] (pytest-xdist)}; the
    report's own time (loading, plots, up to rendering) is its ``report`` part.  Without it the
    breakdown kept in run.json by ``kda-verify run`` is shown, if any."""
    t_report = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records = load_results(out) if records is None else as_records(records)
    prov = load_provenance(out) if provenance is None else provenance
    summary = summarize(records, not_run_of(prov, records))
    plots = make_plots(records, out / "plots")
    bd = prov.get("time_breakdown") if isinstance(prov, dict) else None
    if timing is not None:
        from . import timing as timing_mod
        now = time.perf_counter()
        bd = timing_mod.breakdown(timing["sums"], wall_s=now - timing["started"], report_s=now - t_report,
                                  workers=timing.get("workers"))
    paths = {"md": out / "report.md", "html": out / "report.html", "json": out / "report.json",
             "plots": plots, "timing": bd, "headline": summary["headline"]}
    paths["md"].write_text(render_markdown(summary, records, prov, plots, out, bd), encoding="utf-8")
    paths["html"].write_text(render_html(summary, records, prov, plots, out, bd), encoding="utf-8")
    paths["json"].write_text(json.dumps(jsonable({"provenance": prov, "summary": summary, "time_breakdown": bd,
                                                  "cells": records}), indent=1, allow_nan=False), encoding="utf-8")
    return paths
