"""What a report says of its records, before any rendering: counts per status and per route with
each route's worst margin (``summarize``), the headline (verification.judging.policy.headline), the worst
cells, the long suite's points and growth table, and the rows of the cell tables.

The headline is ``VERIFIED n of N cells: ...`` when n cells were judged (pass, known-fail, fail,
mistrusted), ``NOTHING VERIFIED: ...`` when none was, and ``INTERRUPTED: <k> of <n> selected cells
not run; ...`` first when the latest invocation that wrote the directory was stopped by Ctrl-C (its
run.json entry's ``interrupted``).  A margin above 1 fails; below 1 it says how much headroom the
tolerance leaves.
"""
from __future__ import annotations

import math
import re
from typing import Optional

from verification.judging.policy import FAILING, JUDGED, STATUSES, UNJUDGED
from verification.judging.policy import headline as policy_headline
from verification.judging.record import Record, as_records
from verification.judging.record import decode_number as as_float


def route_label(rec: Record) -> str:
    return f"{rec.backend}:{rec.route}"


def tensor_err(r: Record, name: str) -> tuple[float, float]:
    """(err, baseline err) of tensor ``name`` of a record: the verdict's, else the metrics' rel-L2
    (NaN where absent)."""
    t = (r.tensors or {}).get(name) or {}
    e = as_float(t["err"]) if "err" in t else as_float(((r.metrics or {}).get(name) or {}).get("rel_l2"))
    b = as_float(t.get("baseline_err"))
    if not finite_pos(b):
        b = as_float(((r.baseline or {}).get(name) or {}).get("rel_l2"))
    return e, b


def o_err(rec: Record) -> float:
    return tensor_err(rec, "o")[0]


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


def worst_cells(records: list[Record], n: int) -> list[Record]:
    """The n cells with the largest margin of o that have a finite per-chunk curve, the worst cell
    of each route first (so one broken route does not fill the plot), NaN margins counted as worst."""
    scored = []
    for r in records:
        curve = (((r.metrics or {}).get("o") or {}).get("chunk_rel_l2")) or []
        if r.status in UNJUDGED or not any(finite_pos(as_float(x)) for x in curve):
            continue
        scored.append((o_margin(r), r))
    scored.sort(key=lambda x: -x[0])
    first, rest, seen = [], [], set()
    for _, r in scored:
        (rest if route_label(r) in seen else first).append(r)
        seen.add(route_label(r))
    return (first + rest)[:n]


def finite_pos(x: float) -> bool:
    return math.isfinite(x) and x > 0


def o_margin(r: Record) -> float:
    m = as_float(((r.tensors or {}).get("o") or {}).get("margin"))
    return math.inf if math.isnan(m) else m


# ---- long context ------------------------------------------------------------------------
LONG_PREFIX = "long/"


STATE_TENSORS = ("final_state", "state_cache")       # the first of these a record has is its state


def _state_name(r: Record) -> Optional[str]:
    have = set(r.tensors or {}) | set(r.metrics or {})
    return next((n for n in STATE_TENSORS if n in have), None)


def _record_T(r: Record) -> Optional[int]:
    """The problem's T (a varlen pack: all its tokens): shape, else shape_key, else the params."""
    T = (r.shape or {}).get("T")
    if not T and r.shape_key:
        T = r.shape_key[1]
    p = r.params or {}
    if not T:
        T = sum(p["lens"]) if p.get("lens") else p.get("T")
    return int(T) if T else None


def _long_gate(r: Record) -> float:
    p = r.params or {}
    if "lb" in p:
        return as_float(p["lb"])
    m = re.search(r"-lb(-?[0-9.]+)$", str(r.case))
    return float(m.group(1)) if m else -5.0


def long_points(records: list[Record]) -> list[dict]:
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
        o, ob = tensor_err(r, "o")
        s, sb = tensor_err(r, state) if state else (math.nan, math.nan)
        pts.append({"label": route_label(r), "gate": _long_gate(r), "kind": kind, "H": (r.shape or {}).get("H"),
                    "T": T, "status": r.status, "o": o, "o_base": ob, "state": s, "state_base": sb})
    return pts


def long_lines(pts: list[dict]) -> dict:
    """{(route label, gate, H): {T: point}} over the dense points (the worst cell per T)."""
    lines: dict = {}
    for p in pts:
        if p["kind"] == "dense":
            cur = lines.setdefault((p["label"], p["gate"], p["H"]), {})
            if p["T"] not in cur or not p["o"] <= cur[p["T"]]["o"]:
                cur[p["T"]] = p
    return lines


def tokens_text(T: int) -> str:
    """16384 -> 16K, 1048576 -> 1M, 528384 -> 516K."""
    if T >= 2 ** 20 and T % 2 ** 20 == 0:
        return f"{T >> 20}M"
    return f"{T / 1024:.0f}K" if T >= 1024 else str(T)


LONG_COLS = ("route", "gate", "H", "T small", "T large", "o err small", "o err large", "o growth",
             "state err small", "state err large", "state growth")


def long_growth_rows(records: list[Record]) -> list[list[str]]:
    """One row per line of long_context_figure with at least two T: the o and state errors at its
    smallest and its largest T and their ratio (large / small), "–" where a tensor is absent."""
    records = as_records(records)
    rows = []
    for (lab, gate, H), by_T in sorted(long_lines([p for p in long_points(records) if finite_pos(p["o"])]).items(),
                                       key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0)):
        if len(by_T) < 2:
            continue
        lo, hi = by_T[min(by_T)], by_T[max(by_T)]
        row = [lab, f"lb {gate:g}", str(H if H is not None else "–"), tokens_text(lo["T"]), tokens_text(hi["T"])]
        for key in ("o", "state"):
            a, b = lo[key], hi[key]
            row += [fmt_g(a) if math.isfinite(a) else "–", fmt_g(b) if math.isfinite(b) else "–",
                    fmt_g(b / a) if finite_pos(a) and math.isfinite(b) else "–"]
        rows.append(row)
    return rows


REASON_CHARS = 200


def fmt_g(x, fmt=".3g") -> str:
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


def _tensor_margin(t: dict) -> float:
    """The whole-tensor margin of a tensor record (its ``margin`` is the worse of the whole and
    its worst slice, kept apart as ``tensor_margin`` and ``slice``)."""
    m = as_float(t.get("tensor_margin", t.get("margin")))
    return math.inf if math.isnan(m) else m


def worst_tensor(rec: Record) -> tuple[Optional[str], dict]:
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


def _dtypes(rec: Record) -> str:
    """``o bf16, final_state fp32``; a dtype other than expected as ``fp32 (expected bf16)``."""
    parts = []
    for n, t in (rec.tensors or {}).items():
        if isinstance(t, dict) and t.get("dtype"):
            d = str(t["dtype"])
            want = t.get("expected_dtype")
            parts.append(f"{n} {d}" + (f" (expected {want})" if want and want != d else ""))
    return ", ".join(parts) or "–"


def cell_rows(records: list[Record]) -> list[dict]:
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
            "o_err": fmt_g(t.get("err", m.get("rel_l2"))), "o_tail": fmt_g(m.get("tail_rel_l2")),
            "o_threshold": fmt_g(t.get("threshold")), "baseline": fmt_g(t.get("baseline_err")),
            "state_err": fmt_g(st_t.get("err")), "margin": fmt_g(r.margin), "dtypes": _dtypes(r),
            "kernel_ms": fmt_g(as_float((r.timings or {}).get("kernel_s")) * 1e3, ".3g")
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


def failing_row(rec: Record) -> list[str]:
    """The failing-cells table's row of one cell: its worst tensor (whole-tensor err, threshold,
    margin) and that tensor's worst slice (where, err, the baseline's err there, margin)."""
    name, t = worst_tensor(rec)
    sl = t.get("slice") if isinstance(t.get("slice"), dict) else {}
    return [str(rec.status), str(rec.backend), str(rec.route), str(rec.case),
            name or "–", fmt_g(t.get("err")) if t else "–", fmt_g(t.get("threshold")) if t else "–",
            fmt_g(_tensor_margin(t)) if t else "–", str(sl.get("where", "–")), fmt_g(sl.get("err")) if sl else "–",
            fmt_g(sl.get("baseline_err")) if sl else "–", fmt_g(sl.get("margin")) if sl else "–"]


def skip_groups(records: list[Record]) -> list[tuple[int, str]]:
    groups: dict[str, int] = {}
    for r in records:
        if r.status == "skipped":
            k = clip(r.reason or "no reason given", REASON_CHARS)
            groups[k] = groups.get(k, 0) + 1
    return sorted(((n, k) for k, n in groups.items()), key=lambda x: (-x[0], x[1]))


def cell_name(r: Record) -> str:
    return f"{r.backend} {r.route} {r.case}"


def reason_tail(r: Record, n: int) -> tuple[str, str]:
    what = "stderr tail" if r.stderr_tail else "traceback tail"
    text = r.stderr_tail or r.traceback or ""
    return what, "\n".join(text.strip().splitlines()[-n:])


def headline(records: list[Record], not_run: int = 0) -> str:
    """The report's headline, the same line ``kda-verify run`` and ``pytest -m verify`` print
    (verification.judging.policy.headline): ``VERIFIED n of N cells: ...`` when n cells were judged (pass,
    known-fail, fail, mistrusted), else ``NOTHING VERIFIED: ...``, after ``INTERRUPTED: ...`` when
    ``not_run`` selected cells were not run; never ALL PASS over skips."""
    return policy_headline(records, not_run)
