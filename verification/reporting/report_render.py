"""The report of a results directory: report.md, report.html and report.json (``write_report``).

    report.md      the headline, then SECTIONS in order: failing cells (worst tensor, worst slice,
                   reason, repro), known failures, out-of-contract cells, skipped cells by reason,
                   routes, plots, every cell, repro lines, where the time went, provenance
    report.html    the same sections in the same order, self-contained: CSS inline, plots as
                   base64 PNG, no external asset
    report.json    {"provenance", "summary", "cells"}: strict JSON (non-finite -> "NaN"/"Infinity")

The records come from verification.reporting.report_load, what is said of them from
verification.reporting.report_summary, the plots from verification.reporting.report_plots; under the long-context
plot, each line's error at its smallest and largest T and their ratio (growth).
"""
from __future__ import annotations

import base64
import html
import json
import re
import time
from pathlib import Path
from typing import Optional

from verification.judging.policy import FAILING, STATUSES
from verification.judging.record import Record, as_records
from verification.judging.record import encode as jsonable
from verification.reporting.report_load import load_provenance, load_results, not_run_of
from verification.reporting.report_plots import STATUS_COLOURS, make_plots
from verification.reporting.report_summary import (FAIL_COLS, LONG_COLS, NUM_COLS, TABLE_COLS, cell_name, cell_rows, failing_row,
                                         fmt_g, long_growth_rows, reason_tail, skip_groups, summarize)
from verification.running import timing as timing_mod
from verification.running.timing import PARTS, part_note
from verification.serving.report import serving_sections


OUT_OF_CONTRACT = "Out of contract (outside the documented range of the kernel or the range of its recipe)"


SECTIONS = ("Failing cells", "Known failures", OUT_OF_CONTRACT, "Skipped (not verified)", "Routes", "Plots",
            "Serving traces", "Cells", "Repro", "Where the time went", "Provenance")


def _repro(rec: Record, out_dir: Path) -> str:
    return re.sub(r"--out DIR\b", f"--out {out_dir}/repro", rec.repro)


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
            items.append((r.status, cell_name(r), r.reason, subs,
                          reason_tail(r, 12) if (r.stderr_tail or r.traceback) else None))
        out.append(("Failing cells", [
            ("text", "Each cell's worst tensor against its threshold, and that tensor's worst slice (the "
                     "(sequence, head), 16-token block or cache slot whose error is furthest over its "
                     "own threshold) against the baseline's error on the same slice."),
            ("table", list(FAIL_COLS), [failing_row(r) for r in failing]), ("items", items)]))
    known = [r for r in records if r.status == "known-fail"]
    if known:
        out.append(("Known failures", [
            ("text", "Listed in tolerances.yaml with their reason and evidence; they do not fail the run."),
            ("items", [("known-fail", cell_name(r), r.reason, [], None) for r in known])]))
    ooc = [r for r in records if r.status == "out-of-contract"]
    if ooc:
        out.append((OUT_OF_CONTRACT, [
            ("text", "Cells whose inputs lie outside the range the kernel documents but does not check, or "
                     "outside its precision recipe's range (fp16 storage flushing or overflowing, where the "
                     "recipe itself errs as much as the kernel); each reason says what the kernel did, with "
                     "the numbers. Never counted as a pass or a failure."),
            ("items", [("out-of-contract", cell_name(r), r.reason, [("repro", _repro(r, out_dir))],
                        None) for r in ooc])]))
    skipped = skip_groups(records)
    if skipped:
        out.append(("Skipped (not verified)", [("table", ["cells", "reason"], [[str(n), k] for n, k in skipped])]))
    present = [s for s in STATUSES if summary["counts"].get(s)] or ["pass", "fail"]
    present += [s for s in summary["counts"] if s not in STATUSES and summary["counts"][s]]
    out.append(("Routes", [("table", ["route"] + present + ["worst margin"],
                            [[route] + [str(pr.get(s, 0)) for s in present] + [fmt_g(pr["worst_margin"])]
                             for route, pr in sorted(summary["per_route"].items())])]))
    if plots:
        blocks = [("images", plots)]
        growth = long_growth_rows(records) if "long_context" in plots else []
        if growth:
            blocks += [("text", "Long context (long_context.png): each line's error at its smallest and its largest T, "
                                "and their ratio (growth = large / small)."),
                       ("table", list(LONG_COLS), growth)]
        out.append(("Plots", blocks))
    out += serving_sections(records)    # serving-trace cells: their own table
    rows = cell_rows(records)
    out.append(("Cells", [("table", [h for _, h in TABLE_COLS], [[str(row[k]) for k, _ in TABLE_COLS] for row in rows])]))
    repro = [_repro(r, out_dir) for r in records if r.status != "skipped" and r.repro]
    if repro:
        out.append(("Repro", [("text", "One command per cell (the same --out may be reused with --resume):"),
                              ("code", "\n".join(repro))]))
    if breakdown:
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
    ``timing``, the run's time breakdown (verification/running/timing.py), or None.

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
