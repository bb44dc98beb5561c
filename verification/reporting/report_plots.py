"""The report's figures (matplotlib, written to DIR/plots/*.png by ``make_plots``):

    error_vs_T.png       rel-L2 of o (log) vs T (one slot per distinct T) per route, the route's
                         baseline a grey band under a dashed line
    worst_chunks.png     per-chunk rel-L2 curve of o along T for the worst cells
    margin_heatmap.png   route x case, colour = log10(margin), margin = err / threshold; cells
                         without a margin in their status's HTML colour
    long_context.png     the long suite only: rel-L2 of o and of the final state (log) vs T on a
                         log2 axis, one line per route and gate through its dense cases; the varlen
                         pack and key-cos cases as marker-only points
    serving_drift.png    the serving cells' drift curve (verification/serving/report.py)
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import numpy as np

from verification.judging.policy import FAILING, UNJUDGED
from verification.judging.record import Record, as_records
from verification.judging.record import decode_number as as_float
from verification.reporting.report_summary import (clip, finite_pos, long_lines, long_points, o_margin, route_label, tensor_err,
                                         tokens_text, worst_cells)
from verification.serving.report import plot_drift


PLOTS = ("error_vs_T", "worst_chunks", "margin_heatmap", "long_context", "serving_drift")


STATUS_COLOURS = {"pass": "#2e7d32", "fail": "#c62828", "mistrusted": "#ef6c00", "crashed": "#6a1b9a",
                  "error": "#4e342e", "skipped": "#757575", "known-fail": "#f9a825", "out-of-contract": "#0277bd",
                  "resource-error": "#455a64", "bad-input": "#8d6e63"}


def _plt():
    # lazy: optional dependency (docs/design.md, Imports)
    import matplotlib
    matplotlib.use("Agg", force=True)
    # lazy: optional dependency (docs/design.md, Imports)
    import matplotlib.pyplot as plt
    return plt


def _route_colours(plt, n: int) -> list:
    """n distinguishable colours (tab20 without its greys, which the baselines use, and its reds,
    which mark failing cells)."""
    cmap = plt.get_cmap("tab20")
    pal = [cmap(i) for i in (0, 2, 4, 8, 10, 12, 16, 18, 1, 3, 5, 9, 11, 13, 17, 19)]
    return [pal[i % len(pal)] for i in range(n)]


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
    # lazy: optional dependency (docs/design.md, Imports)
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
        e, b = tensor_err(r, "o")
        if finite_pos(e):
            series.setdefault(route_label(r), []).append((T, e, r.status))
            recipes[route_label(r)] = r.recipe
            if r.self_judged:
                self_judged.add(route_label(r))
            if finite_pos(b):
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


def _cell_note(r: Record) -> str:
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
    worst = worst_cells(records, n)
    if not worst:
        return None
    plt = _plt()
    # lazy: optional dependency (docs/design.md, Imports)
    from matplotlib.ticker import MaxNLocator
    fig, ax = plt.subplots(figsize=(11, 5.0 + 0.22 * len(worst)), dpi=110, layout="constrained")
    colours = _route_colours(plt, len(worst))
    for i, r in enumerate(worst):
        curve = [as_float(x) for x in r.metrics["o"]["chunk_rel_l2"]]
        xs = [k for k, v in enumerate(curve) if finite_pos(v)]
        ys = [curve[k] for k in xs]
        if not xs:
            continue
        # markers and dashes differ per curve, largest first, so curves that coincide stay visible
        ax.plot(xs, ys, marker="osD^vP"[i % 6] if len(xs) < 40 else None, ms=max(3.0, 9.0 - 1.2 * i),
                mfc="none", mew=1.3, ls=("-", "--", "-.", ":", (0, (5, 1)), (0, (1, 2)))[i % 6], lw=1.3, color=colours[i],
                label=f"{route_label(r)}  {r.case}: o margin {o_margin(r):.3g}, {_cell_note(r)}")
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
    plt = _plt()
    # lazy: optional dependency (docs/design.md, Imports)
    from matplotlib.colors import TwoSlopeNorm
    # lazy: optional dependency (docs/design.md, Imports)
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


LONG_MARKERS = {"dense": "o", "dense-other-H": "D", "varlen": "s", "key-cos": "^"}


LONG_KIND_NOTE = {"dense": "dense (line)", "dense-other-H": "dense, another H", "varlen": "varlen pack (all tokens)",
                  "key-cos": "key-cos 0.85-0.97"}


GATE_STYLES = ("-", "--", ":", "-.")                 # by gate, strongest (most negative lb) first


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
    pts = [p for p in long_points(records) if finite_pos(p["o"])]
    if not pts:
        return None
    plt = _plt()
    # lazy: optional dependency (docs/design.md, Imports)
    from matplotlib.lines import Line2D
    # lazy: optional dependency (docs/design.md, Imports)
    from matplotlib.ticker import FixedLocator, NullFormatter
    labels = sorted({p["label"] for p in pts})
    colour = dict(zip(labels, _route_colours(plt, len(labels))))
    gates = sorted({p["gate"] for p in pts})
    style = {g: GATE_STYLES[min(i, len(GATE_STYLES) - 1)] for i, g in enumerate(gates)}
    min_H = {lab: min((p["H"] or 0) for p in pts if p["label"] == lab and p["kind"] == "dense") for lab in labels
             if any(p["label"] == lab and p["kind"] == "dense" for p in pts)}
    lines = long_lines(pts)
    fig, axes = plt.subplots(1, 2, figsize=(14, 6.2), dpi=110, layout="constrained")
    kinds_seen, any_bad, any_known = set(), False, False
    for ax, key, title in ((axes[0], "o", "o"), (axes[1], "state", "final state (final_state or state_cache)")):
        drawn = False
        for (lab, gate, H), by_T in sorted(lines.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0)):
            Ts = [t for t in sorted(by_T) if finite_pos(by_T[t][key])]
            if not Ts:
                continue
            kind = "dense" if (H or 0) == min_H.get(lab) else "dense-other-H"
            kinds_seen.add(kind)
            ax.plot(Ts, [by_T[t][key] for t in Ts], ls=style[gate], marker=LONG_MARKERS[kind], ms=5,
                    color=colour[lab], lw=1.6, zorder=3)
            bT = [t for t in Ts if finite_pos(by_T[t][key + "_base"])]
            if bT:
                ax.plot(bT, [by_T[t][key + "_base"] for t in bT], ls=style[gate], color="0.6", lw=0.9, zorder=2,
                        marker="_" if len(bT) == 1 else None, ms=9)
            drawn = True
        for p in pts:
            if p["kind"] == "dense" or not finite_pos(p[key]):
                continue
            kinds_seen.add(p["kind"])
            c = colour[p["label"]]
            ax.scatter([p["T"]], [p[key]], marker=LONG_MARKERS[p["kind"]], s=42, facecolors=c if p["gate"] == gates[0]
                       else "none", edgecolors=c, linewidths=1.3, zorder=4)
            if finite_pos(p[key + "_base"]):
                ax.scatter([p["T"]], [p[key + "_base"]], marker="_", s=90, color="0.6", linewidths=1.2, zorder=2)
            drawn = True
        mine = [p for p in pts if finite_pos(p[key])]
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
        ax.set_xticks(ticks, [tokens_text(t) for t in ticks], fontsize=8)
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


def plot_serving_drift(records: list[Record], path: Path) -> Optional[Path]:
    return plot_drift(records, path)      # the serving cells' drift curve


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
