"""The serving cells in the report (verification/reporting/report_render.py and report_plots.py hand them here).

``serving_sections(records)``: the section "Serving traces": each serving cell's pairing, its
worst (request, step) or slot against its threshold, the first failure and its diagnosis; and the
drift table of the long-decode cells (o and state error in the first and the last tenth of the
decode steps, their growth, the worst (request, step)).  ``plot_drift(records, path)``:
plots/serving_drift.png, o and state rel-L2 (log) against decode step per cell (solid: the
kernel; dotted: the baseline), one panel per cache dtype; None without matplotlib or drift data.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from verification.judging.record import decode_number as num


def serving_records(records: list) -> list:
    return [r for r in records if r.get("suite") == "serving"]


def _drift(r: dict) -> Optional[dict]:
    d = (r.get("serving") or {}).get("drift")
    return d if isinstance(d, dict) and d.get("step") else None


def _g(x) -> str:
    x = num(x)
    return "–" if math.isnan(x) else f"{x:.3g}"


def drift_rows(records: list) -> list:
    rows = []
    for r in serving_records(records):
        d = _drift(r)
        if d is None:
            continue
        o0, o1 = num(d.get("o_err_first_tenth")), num(d.get("o_err_last_tenth"))
        s0, s1 = num(d.get("state_err_first_tenth")), num(d.get("state_err_last_tenth"))
        w = d.get("worst") or {}
        rows.append([f"{r.get('backend')} {r.get('route')} {r.get('case')}", str(d.get("cache_dtype")),
                     str(d.get("decode_steps")), _g(o0), _g(o1), _g(o1 / o0) if o0 > 0 else "–", _g(s0), _g(s1),
                     _g(s1 / s0) if s0 > 0 else "–",
                     f"request {w.get('request')} step {w.get('step')}: {_g(w.get('o_err'))} "
                     f"(baseline {_g(w.get('o_baseline'))})"])
    return rows


DRIFT_COLS = ("cell", "cache", "decode steps", "o err first 10%", "o err last 10%", "o growth",
              "state err first 10%", "state err last 10%", "state growth", "worst o")
CELL_COLS = ("status", "prefill", "decode", "case", "steps", "worst", "err", "threshold", "margin", "diagnosis")


def cell_rows(records: list) -> list:
    rows = []
    for r in serving_records(records):
        s = r.get("serving") or {}
        w = s.get("first_failure") or s.get("worst") or {}
        p, d = s.get("prefill") or {}, s.get("decode") or {}
        rows.append([str(r.get("status")), f"{p.get('backend')}:{p.get('route')}", f"{d.get('backend')}:{d.get('route')}",
                     str(r.get("case")), str(s.get("steps", "–")), str(w.get("where", "–")), _g(w.get("err")),
                     _g(w.get("threshold")), _g(w.get("margin")), str(s.get("diagnosis") or "–")])
    return rows


def serving_sections(records: list) -> list:
    """[("Serving traces", blocks)] when the records hold serving cells, else []."""
    if not serving_records(records):
        return []
    blocks = [("text", "Each serving cell: the prefill side and the decode side, the steps judged, the first "
                       "failing (request, step) or slot (else the worst), its error, threshold and margin, and "
                       "the diagnosis of the first failure (docs/traces.md, Verdicts)."),
              ("table", list(CELL_COLS), cell_rows(records))]
    drift = drift_rows(records)
    if drift:
        blocks += [("text", "Drift (plots/serving_drift.png where matplotlib is installed): the worst decode-step "
                            "error in the first and the last tenth of the decode steps, and their ratio."),
                   ("table", list(DRIFT_COLS), drift)]
    return [("Serving traces", blocks)]


def plot_drift(records: list, path: Path) -> Optional[Path]:
    cells = [(r, _drift(r)) for r in serving_records(records)]
    cells = [(r, d) for r, d in cells if d is not None]
    if not cells:
        return None
    try:
        # lazy: optional dependency (docs/design.md, Imports)
        import matplotlib
        matplotlib.use("Agg", force=True)
        # lazy: optional dependency (docs/design.md, Imports)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    dtypes = sorted({d.get("cache_dtype") for _, d in cells})
    fig, axes = plt.subplots(2, len(dtypes), figsize=(6.5 * len(dtypes), 7), squeeze=False)
    for j, dt in enumerate(dtypes):
        for i, (key, bkey, what) in enumerate((("o_err", "o_baseline", "o"), ("state_err", "state_baseline",
                                                                                "state (written slot)"))):
            ax = axes[i][j]
            for r, d in cells:
                if d.get("cache_dtype") != dt:
                    continue
                xs = d["step"]
                ys = [num(y) for y in d[key]]
                line, = ax.plot(xs, ys, lw=1.2, label=f"{r.get('route')} {r.get('case', '').split('/')[-1]}")
                ax.plot(xs, [num(y) for y in d[bkey]], lw=1, ls=":", color=line.get_color())
            ax.set_yscale("log")
            ax.set_xlabel("decode step")
            ax.set_ylabel(f"{what} rel-L2")
            ax.set_title(f"{what}, {dt} cache (dotted: baseline)", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
