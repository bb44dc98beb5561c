"""The report of a results directory: report.md, report.html, report.json and plots/*.png.

Input: DIR/results.jsonl (and DIR/results-*.jsonl, one per pytest-xdist worker; merged,
the last record of a key wins) and DIR/run.json (provenance).  Output:

    report.md      summary, per-cell table, failures with their repro lines, provenance
    report.html    the same, self-contained: CSS inline, plots as base64 PNG, no external asset
    report.json    {"provenance", "summary", "cells"}: strict JSON (non-finite -> "NaN"/"Infinity")
    plots/error_vs_T.png       rel-L2 of o vs T per route (log-log), baseline recipes dashed
    plots/worst_chunks.png     per-chunk rel-L2 curve of o along T for the worst cells
    plots/margin_heatmap.png   route x case, colour = log10(margin), margin = err / threshold

A margin above 1 fails; below 1 it says how much headroom the tolerance leaves.
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

from .runner import FAILING, RESULTS_FILE, RUN_FILE, STATUSES, as_float, jsonable, read_records

PLOTS = ("error_vs_T", "worst_chunks", "margin_heatmap")
STATUS_COLOURS = {"pass": "#2e7d32", "fail": "#c62828", "mistrusted": "#ef6c00", "crashed": "#6a1b9a",
                  "error": "#4e342e", "skipped": "#757575", "known-fail": "#f9a825"}


# ----------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------
def results_files(out_dir) -> list[Path]:
    d = Path(out_dir)
    files = [d / RESULTS_FILE] if (d / RESULTS_FILE).exists() else []
    files += sorted(p for p in d.glob("results-*.jsonl"))
    return files


def load_results(out_dir) -> list[dict]:
    """Every cell of a results directory, merged over the per-worker files; one record per key
    (the last written wins), in first-seen order."""
    merged: dict[str, dict] = {}
    for f in results_files(out_dir):
        for rec in read_records(f):
            merged[rec["key"]] = rec
    return list(merged.values())


def load_provenance(out_dir) -> dict:
    """The provenance of the latest run into DIR (run.json holds one entry per invocation)."""
    p = Path(out_dir) / RUN_FILE
    if not p.exists():
        return {}
    try:
        runs = json.loads(p.read_text()).get("runs", [])
    except (json.JSONDecodeError, AttributeError):
        return {}
    if not runs:
        return {}
    prov = dict(runs[-1])
    prov["invocations"] = len(runs)
    return prov


# ----------------------------------------------------------------------------------------
# Summaries
# ----------------------------------------------------------------------------------------
def route_label(rec: dict) -> str:
    return f"{rec.get('backend')}:{rec.get('route')}"


def o_err(rec: dict) -> float:
    t = (rec.get("tensors") or {}).get("o") or {}
    if "err" in t:
        return as_float(t["err"])
    return as_float(((rec.get("metrics") or {}).get("o") or {}).get("rel_l2"))


def summarize(records: list[dict]) -> dict:
    counts = {s: 0 for s in STATUSES}
    per_route: dict[str, dict] = {}
    for r in records:
        st = r.get("status", "?")
        counts[st] = counts.get(st, 0) + 1
        pr = per_route.setdefault(route_label(r), {s: 0 for s in STATUSES} | {"worst_margin": None})
        pr[st] = pr.get(st, 0) + 1
        m = as_float(r.get("margin"))
        if r.get("status") not in ("skipped",) and r.get("margin") is not None:
            w = pr["worst_margin"]
            pr["worst_margin"] = m if w is None or (math.isnan(m) or m > as_float(w)) else w
    failing = [r for r in records if r.get("status") in FAILING]
    return {"cells": len(records), "counts": counts, "failing": len(failing), "per_route": per_route,
            "ok": not failing}


def _worst(records: list[dict], n: int) -> list[dict]:
    """The n cells with the largest margin of o that have a finite per-chunk curve, the worst cell
    of each route first (so one broken route does not fill the plot), NaN margins counted as worst."""
    scored = []
    for r in records:
        curve = (((r.get("metrics") or {}).get("o") or {}).get("chunk_rel_l2")) or []
        if r.get("status") in ("skipped", "crashed", "error") or not any(_finite_pos(as_float(x)) for x in curve):
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
    """n distinguishable colours (tab20 without its greys, which the baselines use)."""
    cmap = plt.get_cmap("tab20")
    pal = [cmap(i) for i in (0, 2, 4, 6, 8, 10, 12, 16, 18, 1, 3, 5, 7, 9, 11, 13, 17, 19)]
    return [pal[i % len(pal)] for i in range(n)]


def _legend_below(fig, ax, n_entries: int, ncol: int = 2) -> None:
    """A legend under the axes (long route / case labels would squeeze a legend at the side)."""
    rows = math.ceil(n_entries / ncol)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=ncol, framealpha=0.9)
    fig.set_size_inches(fig.get_size_inches()[0], 4.6 + 0.2 * rows)


def _o_margin(r: dict) -> float:
    m = as_float(((r.get("tensors") or {}).get("o") or {}).get("margin"))
    return math.inf if math.isnan(m) else m


def _t_axis(ax, Ts: list[int]) -> None:
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator
    lo, hi = min(Ts), max(Ts)
    if hi >= 4 * lo:
        ax.set_xscale("log", base=2)
    distinct = []
    for t in sorted(set(Ts)):                   # labels at least 8% apart, so none overlap
        if not distinct or t >= 1.08 * distinct[-1]:
            distinct.append(t)
    if len(distinct) <= 14:
        ax.xaxis.set_major_locator(FixedLocator(distinct))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(distinct, [str(t) for t in distinct], rotation=45 if len(distinct) > 7 else 0, fontsize=8)


FACET_ABOVE = 6       # more routes than this: one panel per route
MAX_PANELS = 24


def _error_series(records: list[dict]) -> tuple[dict, dict, dict]:
    """{route label: [(T, err, status)]}, {route label: [(T, baseline err)]} of o, and
    {route label: recipe}."""
    series: dict[str, list] = {}
    base: dict[str, list] = {}
    recipes: dict[str, str] = {}
    for r in records:
        shape = r.get("shape") or {}
        T = shape.get("T")
        if not T or r.get("status") in ("skipped", "crashed", "error"):
            continue
        e = o_err(r)
        if _finite_pos(e):
            series.setdefault(route_label(r), []).append((T, e, r.get("status")))
            recipes[route_label(r)] = r.get("recipe")
            b = as_float(((r.get("tensors") or {}).get("o") or {}).get("baseline_err"))
            if not _finite_pos(b):
                b = as_float(((r.get("baseline") or {}).get("o") or {}).get("rel_l2"))
            if _finite_pos(b):
                base.setdefault(route_label(r), []).append((T, b))
    return series, base, recipes


def _worst_line(pts) -> tuple[list, list]:
    Ts = sorted({p[0] for p in pts})
    return Ts, [max(p[1] for p in pts if p[0] == T) for T in Ts]


def plot_error_vs_T(records: list[dict], path: Path) -> Optional[Path]:
    """rel-L2 of o against T (tokens of the forward) per route: every cell a dot, a line through
    the worst cell per T, the route's baseline (its emulated recipe, same metric) dashed black,
    failing cells marked by a red x.  Up to FACET_ABOVE routes share one panel; more get one
    panel each (the MAX_PANELS routes with the largest error; the heatmap shows every route)."""
    plt = _plt()
    series, base, recipes = _error_series(records)
    if not series:
        return None
    labels = sorted(series)
    allT = [p[0] for pts in series.values() for p in pts]
    if len(labels) <= FACET_ABOVE:
        fig, ax = plt.subplots(figsize=(11, 5.4), dpi=110)
        axes = [ax] * len(labels)
    else:
        dropped = 0
        if len(labels) > MAX_PANELS:
            labels = sorted(labels, key=lambda lab: -max(p[1] for p in series[lab]))[:MAX_PANELS]
            dropped = len(series) - MAX_PANELS
            labels.sort()
        ncol = 4
        nrow = math.ceil(len(labels) / ncol)
        fig, grid = plt.subplots(nrow, ncol, figsize=(15, 2.7 * nrow + 1.0), dpi=100, sharex=True, sharey=True,
                                 squeeze=False)
        axes = [grid[i // ncol][i % ncol] for i in range(len(labels))]
        for k in range(len(labels), nrow * ncol):
            grid[k // ncol][k % ncol].axis("off")
    colours = _route_colours(plt, len(labels))
    faceted = len(set(map(id, axes))) > 1
    any_bad = False
    for c, label, ax in zip(colours, labels, axes):
        pts = sorted(series[label])
        Ts, worst = _worst_line(pts)
        ax.plot(Ts, worst, "-", color=c, lw=1.5, alpha=0.9, label=None if faceted else label)
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=16 if faceted else 20, color=c, alpha=0.75, zorder=3)
        bad = [p for p in pts if p[2] in FAILING]
        if bad:
            ax.scatter([p[0] for p in bad], [p[1] for p in bad], s=55, marker="x", color="red", linewidths=1.5,
                       zorder=5, label="failing cell" if not any_bad and not faceted else None)
            any_bad = True
        if label in base and faceted:
            bT, bw = _worst_line(sorted(set(base[label])))
            ax.plot(bT, bw, color="black", lw=1.0, dashes=(5, 2), zorder=4)
        if faceted:
            ax.set_title(label if len(label) <= 44 else label[:43] + "…", fontsize=8)
            ax.grid(True, which="both", alpha=0.25)
            _t_axis(ax, allT)
    ax0 = axes[0]
    ax0.set_yscale("log")
    if faceted:
        fig.supxlabel("T (tokens per forward; varlen: all sequences)", fontsize=10)
        fig.supylabel("rel-L2 of o vs the float64 oracle", fontsize=10)
        extra = f"; {dropped} more routes in the heatmap" if dropped else ""
        fig.suptitle("Output error vs sequence length, one panel per route: worst cell per T (line), every cell "
                     f"(dots), failing (red x), the route's baseline (dashed){extra}", fontsize=10)
    else:
        by_recipe: dict[str, list] = {}
        for label in labels:
            by_recipe.setdefault(recipes.get(label) or "?", []).extend(base.get(label, []))
        dashes = [(5, 2), (2, 2), (7, 2, 1, 2), (1, 1)]
        for j, (recipe, pts) in enumerate(sorted(by_recipe.items())):
            if pts:
                bT, bw = _worst_line(sorted(set(pts)))
                ax0.plot(bT, bw, color="black", lw=1.0, dashes=dashes[j % len(dashes)], zorder=4,
                         label=f"baseline: {recipe} recipe")
        _t_axis(ax0, allT)
        ax0.set_xlabel("T (tokens per forward; varlen: all sequences)")
        ax0.set_ylabel("rel-L2 of o vs the float64 oracle (worse of all / tail)")
        ax0.set_title("Output error vs sequence length: a line through the worst cell per T, per route")
        ax0.grid(True, which="both", alpha=0.25)
        _legend_below(fig, ax0, len(ax0.get_legend_handles_labels()[1]), ncol=3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_worst_chunks(records: list[dict], path: Path, n: int = 6) -> Optional[Path]:
    """The per-chunk rel-L2 curve of o along T for the n cells with the largest margin."""
    worst = _worst(records, n)
    if not worst:
        return None
    plt = _plt()
    from matplotlib.ticker import MaxNLocator
    fig, ax = plt.subplots(figsize=(11, 5.4), dpi=110)
    colours = _route_colours(plt, len(worst))
    for i, r in enumerate(worst):
        curve = [as_float(x) for x in r["metrics"]["o"]["chunk_rel_l2"]]
        xs = [k for k, v in enumerate(curve) if _finite_pos(v)]
        ys = [curve[k] for k in xs]
        if not xs:
            continue
        m = _o_margin(r)
        ax.plot(xs, ys, "-o" if len(xs) < 40 else "-", ms=3, lw=1.3, color=colours[i],
                label=f"{route_label(r)}  {r.get('case')}  ({r.get('status')}, o margin {m:.3g})")
    ax.set_yscale("log")
    ax.set_xlabel("chunk index along T (32 tokens per chunk, all sequences and heads pooled)")
    ax.set_ylabel("rel-L2 of o within the chunk")
    ax.set_title(f"Per-chunk error of o: the {len(worst)} cells with the largest o margin (worst per route first)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, which="both", alpha=0.25)
    _legend_below(fig, ax, len(ax.get_legend_handles_labels()[1]), ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _short_case(case_id: str, width: int = 36) -> str:
    return case_id if len(case_id) <= width else case_id[: width - 1] + "…"


def plot_margin_heatmap(records: list[dict], path: Path) -> Optional[Path]:
    """route x case grid; colour = log10(margin) (green: headroom, red: over the tolerance);
    grey: skipped; black with a cross: crashed or error; purple: a NaN / infinite margin."""
    rows = sorted({route_label(r) for r in records})
    cols = list(dict.fromkeys(r.get("case") for r in records))
    if not rows or not cols:
        return None
    import numpy as np
    plt = _plt()
    from matplotlib.colors import TwoSlopeNorm

    grid = np.full((len(rows), len(cols)), np.nan)
    kind = {}
    failing = []
    for r in records:
        i, j = rows.index(route_label(r)), cols.index(r.get("case"))
        st = r.get("status")
        m = as_float(r.get("margin"))
        if st in ("skipped", "crashed", "error") or r.get("margin") is None:
            kind[(i, j)] = st
        elif math.isnan(m):
            kind[(i, j)] = "nan"
        elif math.isinf(m):
            kind[(i, j)] = "inf"          # the judged error itself is NaN / Inf, or nothing could pass
        elif m <= 0:
            grid[i, j] = -6.0             # exact: no error at all
        else:
            grid[i, j] = math.log10(m)
        if st in ("fail", "mistrusted"):
            failing.append((i, j))
    cw = min(0.55, max(0.28, 14.0 / max(len(cols), 1)))
    fig_w = min(40.0, 3.0 + cw * len(cols) + 1.5)
    fig_h = min(30.0, 2.6 + 0.42 * len(rows) + 0.09 * max(len(c) for c in map(_short_case, cols)))
    fig, ax = plt.subplots(figsize=(fig_w, fig_h), dpi=100)
    finite = grid[np.isfinite(grid)]
    lo = min(-0.5, float(finite.min()) if finite.size else -1.0)
    hi = max(0.5, float(finite.max()) if finite.size else 1.0)
    cmap = plt.get_cmap("RdYlGn_r").with_extremes(bad="#d9d9d9")
    im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=TwoSlopeNorm(vcenter=0.0, vmin=lo, vmax=hi),
                   aspect="auto", interpolation="nearest")
    for (i, j), k in kind.items():
        if k in ("crashed", "error"):
            ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, color="black"))
            ax.text(j, i, "✕" if k == "crashed" else "E", ha="center", va="center", color="white", fontsize=8)
        elif k in ("nan", "inf"):
            ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, color="#6a1b9a"))
            ax.text(j, i, "NaN" if k == "nan" else "∞", ha="center", va="center", color="white", fontsize=7)
    for i, j in failing:
        ax.add_patch(plt.Rectangle((j - 0.46, i - 0.46), 0.92, 0.92, fill=False, edgecolor="#b71c1c", lw=2.2))
    if len(cols) <= 40 and len(rows) <= 30:
        for i in range(len(rows)):
            for j in range(len(cols)):
                v = grid[i, j]
                if np.isfinite(v) and (i, j) not in kind:
                    mv = 10 ** v
                    ax.text(j, i, f"{mv:.0f}" if mv >= 100 else f"{mv:.2g}", ha="center", va="center", fontsize=6.5,
                            color="white" if abs(v) > 0.6 * max(abs(lo), hi) else "black")
    ax.set_xticks(range(len(cols)))
    ax.set_xticklabels([_short_case(c) for c in cols], rotation=60, ha="right", fontsize=7)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(rows, fontsize=8)
    cb = fig.colorbar(im, ax=ax, fraction=0.03, pad=0.02)
    cb.set_label("log10(margin) = log10(err / threshold); > 0 fails", fontsize=8)
    ax.set_title("Margin per route and case (red frame: fail / mistrusted; purple: NaN or Inf error; grey: skipped; "
                 "black: crashed ✕ / error E)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def make_plots(records: list[dict], plots_dir: Path) -> dict[str, Path]:
    plots_dir.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, fn in (("error_vs_T", plot_error_vs_T), ("worst_chunks", plot_worst_chunks),
                     ("margin_heatmap", plot_margin_heatmap)):
        p = fn(records, plots_dir / f"{name}.png")
        if p is not None:
            out[name] = p
        else:
            (plots_dir / f"{name}.png").unlink(missing_ok=True)
    return out


# ----------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------
def _g(x, fmt=".3g") -> str:
    if x is None:
        return "–"
    f = as_float(x)
    if math.isnan(f) and isinstance(x, str) and x.lower() != "nan":
        return str(x)
    return format(f, fmt) if math.isfinite(f) else str(x if isinstance(x, str) else f)


def _repro(rec: dict, out_dir: Path) -> str:
    return re.sub(r"--out DIR\b", f"--out {out_dir}/repro", rec.get("repro", ""))


def cell_rows(records: list[dict]) -> list[dict]:
    """One flat row per cell for the tables."""
    rows = []
    for r in records:
        t = (r.get("tensors") or {}).get("o") or {}
        m = ((r.get("metrics") or {}).get("o") or {})
        st_t = (r.get("tensors") or {}).get("final_state") or (r.get("tensors") or {}).get("state_cache") or {}
        shape = r.get("shape") or {}
        rows.append({
            "status": r.get("status"), "backend": r.get("backend"), "route": r.get("route"), "case": r.get("case"),
            "shape": f"{shape.get('B')}x{shape.get('T')}x{shape.get('H')}" if shape else "–",
            "o_err": _g(t.get("err", m.get("rel_l2"))), "o_tail": _g(m.get("tail_rel_l2")),
            "o_threshold": _g(t.get("threshold")), "baseline": _g(t.get("baseline_err")),
            "state_err": _g(st_t.get("err")), "margin": _g(r.get("margin")),
            "kernel_ms": _g(as_float((r.get("timings") or {}).get("kernel_s")) * 1e3, ".3g")
            if (r.get("timings") or {}).get("kernel_s") is not None else "–",
            "reason": (r.get("reason") or "")[:200],
        })
    return rows


TABLE_COLS = (("status", "status"), ("backend", "backend"), ("route", "route"), ("case", "case"),
              ("shape", "B×T×H"), ("o_err", "o rel-L2"), ("o_tail", "o tail"), ("baseline", "baseline"),
              ("o_threshold", "threshold"), ("state_err", "state rel-L2"), ("margin", "margin"),
              ("kernel_ms", "kernel ms"))


def _md_escape(s) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def render_markdown(summary: dict, records: list[dict], prov: dict, plots: dict, out_dir: Path,
                    breakdown: Optional[dict] = None) -> str:
    L = ["# kda-verify report", ""]
    c = summary["counts"]
    verdict = "ALL PASS" if summary["ok"] else f"{summary['failing']} FAILING"
    L.append(f"**{verdict}** — {summary['cells']} cells: " + ", ".join(f"{v} {k}" for k, v in c.items() if v))
    if breakdown:
        from .timing import markdown as timing_md
        L += ["", "## Where the time went", ""] + timing_md(breakdown)
    L += ["", "## Routes", "", "| route | " + " | ".join(STATUSES) + " | worst margin |",
          "|---" * (len(STATUSES) + 2) + "|"]
    for route, pr in sorted(summary["per_route"].items()):
        L.append(f"| {_md_escape(route)} | " + " | ".join(str(pr[s]) for s in STATUSES)
                 + f" | {_g(pr['worst_margin'])} |")
    known = [r for r in records if r.get("status") == "known-fail"]
    if known:
        L += ["", "## Known failures (listed in tolerances.yaml with their reason; they do not fail the run)", ""]
        for r in known:
            L.append(f"- `{r['backend']} {r['route']} {r['case']}` — {_md_escape(r.get('reason', ''))}")
    failing = [r for r in records if r.get("status") in FAILING]
    if failing:
        L += ["", "## Failing cells", ""]
        for r in failing:
            L.append(f"- **{r['status']}** `{r['backend']} {r['route']} {r['case']}` — {_md_escape(r.get('reason', ''))}")
            L.append(f"  - repro: `{_repro(r, out_dir)}`")
            if r.get("stderr_tail") or r.get("traceback"):
                what = "stderr tail" if r.get("stderr_tail") else "traceback tail"
                tail = "\n".join((r.get("stderr_tail") or r.get("traceback")).strip().splitlines()[-8:])
                L += [f"  - {what}:", "", "```", tail, "```", ""]
    if plots:
        L += ["", "## Plots", ""]
        for name, p in plots.items():
            L.append(f"![{name}]({Path(p).relative_to(out_dir).as_posix()})")
            L.append("")
    L += ["", "## Cells", "", "| " + " | ".join(h for _, h in TABLE_COLS) + " | reason |",
          "|" + "---|" * (len(TABLE_COLS) + 1)]
    for row in cell_rows(records):
        L.append("| " + " | ".join(_md_escape(row[k]) for k, _ in TABLE_COLS) + f" | {_md_escape(row['reason'])} |")
    L += ["", "## Repro", "", "One command per cell (the same `--out` may be reused with `--resume`):", "", "```"]
    L += [_repro(r, out_dir) for r in records if r.get("status") != "skipped"]
    L += ["```", "", "## Provenance", "", "```", json.dumps(jsonable(_prov_public(prov)), indent=1), "```", ""]
    return "\n".join(L)


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
"""


def _img_tag(path: Path, alt: str) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def render_html(summary: dict, records: list[dict], prov: dict, plots: dict, out_dir: Path,
                breakdown: Optional[dict] = None) -> str:
    e = html.escape

    def badge(st):
        return f'<span class="st" style="background:{STATUS_COLOURS.get(st, "#999")}">{e(str(st))}</span>'

    H = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8"><title>kda-verify report</title>',
         f"<style>{_CSS}</style></head><body>", "<h1>kda-verify report</h1>"]
    c = summary["counts"]
    verdict = "ALL PASS" if summary["ok"] else f"{summary['failing']} FAILING"
    colour = "#2e7d32" if summary["ok"] else "#c62828"
    H.append(f'<p class="verdict" style="color:{colour}">{verdict}</p><p>{summary["cells"]} cells: '
             + ", ".join(f"{badge(k)} {v}" for k, v in c.items() if v) + "</p>")
    H.append("<h2>Routes</h2><table><tr><th>route</th>" + "".join(f"<th>{s}</th>" for s in STATUSES)
             + "<th>worst margin</th></tr>")
    for route, pr in sorted(summary["per_route"].items()):
        H.append(f"<tr><td>{e(route)}</td>" + "".join(f'<td class="num">{pr[s]}</td>' for s in STATUSES)
                 + f'<td class="num">{e(_g(pr["worst_margin"]))}</td></tr>')
    H.append("</table>")
    if breakdown:
        from .timing import PARTS, part_note
        busy = breakdown["busy_s"] if breakdown["busy_s"] > 0 else 1.0
        H.append(f"<h2>Where the time went</h2><p>Wall {breakdown['wall_s']:.1f} s for {breakdown['cells']} cells"
                 + (f" on {breakdown['workers']} xdist workers ({breakdown['busy_s']:.1f} s of worker time)"
                    if breakdown.get("workers") else "") + "</p>")
        H.append("<table><tr><th>part</th><th>seconds</th><th>share</th><th>what</th></tr>")
        for p in PARTS:
            sec = breakdown[f"{p}_s"]
            H.append(f'<tr><td>{p}</td><td class="num">{sec:.2f}</td><td class="num">{100 * sec / busy:.1f}%</td>'
                     f"<td>{e(part_note(breakdown, p))}</td></tr>")
        H.append("</table>")
    failing = [r for r in records if r.get("status") in FAILING]
    if failing:
        H.append("<h2>Failing cells</h2><ul>")
        for r in failing:
            H.append(f"<li>{badge(r['status'])} <code>{e(r['backend'])} {e(r['route'])} {e(r['case'])}</code>: "
                     f"{e(r.get('reason', ''))}<br>repro: <code>{e(_repro(r, out_dir))}</code>")
            tail = r.get("stderr_tail") or r.get("traceback")
            if tail:
                H.append("<pre>" + e("\n".join(tail.strip().splitlines()[-12:])) + "</pre>")
            H.append("</li>")
        H.append("</ul>")
    if plots:
        H.append("<h2>Plots</h2>")
        for name, p in plots.items():
            H.append(f"<div>{_img_tag(p, name)}</div>")
    H.append("<h2>Cells</h2><table><tr>" + "".join(f"<th>{e(h)}</th>" for _, h in TABLE_COLS)
             + "<th>reason</th><th>repro</th></tr>")
    for r, row in zip(records, cell_rows(records)):
        cells = []
        for k, _ in TABLE_COLS:
            v = row[k]
            if k == "status":
                cells.append(f"<td>{badge(v)}</td>")
            else:
                cls = ' class="num"' if k in ("o_err", "o_tail", "baseline", "o_threshold", "state_err",
                                               "margin", "kernel_ms") else ""
                cells.append(f"<td{cls}>{e(str(v))}</td>")
        H.append("<tr>" + "".join(cells) + f"<td>{e(row['reason'])}</td>"
                 f"<td><code>{e(_repro(r, out_dir)) if r.get('status') != 'skipped' else ''}</code></td></tr>")
    H.append("</table>")
    H.append("<h2>Provenance</h2><pre>" + e(json.dumps(jsonable(_prov_public(prov)), indent=1)) + "</pre>")
    H.append("</body></html>")
    return "\n".join(H)


def write_report(out_dir, records: Optional[list[dict]] = None, provenance: Optional[dict] = None,
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
    records = load_results(out) if records is None else records
    prov = load_provenance(out) if provenance is None else provenance
    summary = summarize(records)
    plots = make_plots(records, out / "plots")
    bd = prov.get("time_breakdown") if isinstance(prov, dict) else None
    if timing is not None:
        from . import timing as timing_mod
        now = time.perf_counter()
        bd = timing_mod.breakdown(timing["sums"], wall_s=now - timing["started"], report_s=now - t_report,
                                  workers=timing.get("workers"))
    paths = {"md": out / "report.md", "html": out / "report.html", "json": out / "report.json",
             "plots": plots, "timing": bd}
    paths["md"].write_text(render_markdown(summary, records, prov, plots, out, bd), encoding="utf-8")
    paths["html"].write_text(render_html(summary, records, prov, plots, out, bd), encoding="utf-8")
    paths["json"].write_text(json.dumps(jsonable({"provenance": prov, "summary": summary, "time_breakdown": bd,
                                                  "cells": records}), indent=1, allow_nan=False), encoding="utf-8")
    return paths
