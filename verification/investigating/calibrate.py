"""Calibration: measure a backend's routes on a suite and propose tolerance entries
(``kda-verify calibrate``, verification/commands/calibrate.py, is the command over it).

For every cell that ran (pass or fail alike; skipped, crashed and errored cells measure
nothing) and every output tensor, the ratio kernel / baseline is taken on both judged
metrics (rel_l2 and tail_rel_l2):  ratio = err / baseline_err.  Cells are grouped by the
tolerances.yaml entry that governs them (``db.lookup``), or, where none does, by their
exact (backend, route, dtype, tensor).  Per group the proposal is

    m     = ceil2(headroom * worst ratio)            (headroom 2 by default; at least 1)
    floor = the entry's floor (a new entry: 1e-6)
    cap   = the entry's cap while worst err * headroom fits under it, else ceil2(headroom * worst err)

where ceil2 rounds up to two significant digits.  The proposal is printed as a unified diff
against tolerances.yaml (and written with --out as a schema-valid YAML of the proposed
entries); tolerances.yaml itself is never rewritten.  Loosening an entry needs a written
reason: the diff marks it, and the proposed entry carries a ``note`` to fill in.

Each proposal's ``calibrated_on`` names the device (the GPU, or ``CPU (cpu)``), date and
commit the measurements were made on: this process's, or with --from-results DIR the latest
run recorded in DIR/run.json (the records' own device field where there is no run.json).
"""
from __future__ import annotations

import difflib
import fnmatch
import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from verification.errors import ToleranceError, UsageError
from verification.judging.policy import JUDGED_METRICS
from verification.judging.record import as_records, read_records
from verification.judging.record import decode_number as as_float
from verification.judging.tolerances import Tolerance, ToleranceDB
from verification.judging.verdict import known_failure_entry
from verification.running.cases import get_case
from verification.running.run_matrix import run_matrix


NEW_FLOOR = 1.0e-6


def ceil2(x: float) -> float:
    """x rounded up to two significant digits (0.0123 -> 0.013, 2.26 -> 2.3, 4.0 -> 4.0)."""
    if not (x > 0) or not math.isfinite(x):
        return x
    e = math.floor(math.log10(x)) - 1
    q = 10.0 ** e
    v = math.ceil(round(x / q, 9)) * q
    return float(f"{v:.2g}")


@dataclass
class Group:
    """The cells one tolerance entry governs, and the worst of what they measured."""
    key: tuple                         # (backend, route, dtype, tensor) patterns of the entry (or exact names)
    existing: object = None            # the Tolerance, or None where no entry matched
    cells: int = 0
    worst_ratio: float = 0.0
    worst_ratio_at: str = ""
    worst_err: float = 0.0
    worst_err_at: str = ""
    nonfinite: list = field(default_factory=list)   # cells whose err is NaN / Inf: no tolerance passes them


def collect_groups(records: list, db) -> dict[tuple, Group]:
    """Group every measured (cell, tensor) by the entry of ``db`` governing it."""
    groups: dict[tuple, Group] = {}
    for r in as_records(records):
        if r.status in ("skipped", "crashed", "error", "known-fail"):
            continue          # known failures are explained in tolerances.yaml, not the error level to expect
        if r.status != "pass" and known_failure_entry(db, r.backend, r.route, r.case,
                                                             r.params):
            continue          # a record written before its failure was listed
        for tname, met in (r.metrics or {}).items():
            base = (r.baseline or {}).get(tname) or {}
            try:
                tol = db.lookup(r.backend, r.route, r.dtype, tname)
                key = tuple(tol.key.split("/", 3))
            except ToleranceError:
                tol, key = None, (r.backend, r.route, r.dtype, tname)
            g = groups.setdefault(key, Group(key=key, existing=tol))
            g.cells += 1
            where = f"{r.route} {r.case}"
            for metric in JUDGED_METRICS:
                err, b = as_float(met.get(metric)), as_float(base.get(metric))
                if not math.isfinite(err):
                    g.nonfinite.append(f"{where} {tname}.{metric}={err}")
                    continue
                if err > g.worst_err:
                    g.worst_err, g.worst_err_at = err, f"{where} {tname}.{metric}"
                if b > 0 and math.isfinite(b) and err / b > g.worst_ratio:
                    g.worst_ratio, g.worst_ratio_at = err / b, f"{where} {tname}.{metric}"
    return groups


def propose(g: Group, headroom: float, where: str) -> dict:
    """The proposed entry (a dict of tolerances.yaml fields) of one group."""
    m = max(1.0, ceil2(headroom * g.worst_ratio))
    floor = g.existing.floor if g.existing is not None else NEW_FLOOR
    cap = g.existing.cap if g.existing is not None else None
    if cap is None or g.worst_err * headroom > cap:
        cap = ceil2(headroom * g.worst_err) if g.worst_err > 0 else (cap or 5.0e-2)
    entry = {"backend": g.key[0], "route": g.key[1], "dtype": g.key[2], "tensor": g.key[3],
             "m": m, "floor": floor, "cap": cap,
             "reason": (f"{headroom:g}x the worst observed ratio kernel/baseline, {g.worst_ratio:.3g} at "
                        f"{g.worst_ratio_at}, rounded up"),
             "calibrated_on": f"{where}; {g.cells} tensor measurements; worst err {g.worst_err:.3g} at "
                              f"{g.worst_err_at}"}
    if g.existing is not None and (m > g.existing.m or cap > g.existing.cap):
        what = [f"{k} {a:g} -> {b:g}" for k, a, b in (("m", g.existing.m, m), ("cap", g.existing.cap, cap)) if b > a]
        entry["note"] = f"LOOSENS {', '.join(what)}: write the reason here before accepting"
    return entry


def _yaml_scalar(v) -> str:
    """One YAML 1.1 scalar: floats always with a dot (1.0e-6), strings plain where that
    reads back the same, else double-quoted."""
    if isinstance(v, bool) or v is None:
        return json.dumps(v)
    if isinstance(v, (int, float)):
        v = float(v)
        if v == 0 or 1e-3 <= abs(v) < 1e4:
            return repr(v)
        mant, exp = f"{v:.6e}".split("e")          # YAML 1.1 needs the dot: 1.0e-6, not 1e-6
        mant = mant.rstrip("0")
        return f"{mant}0e{int(exp)}" if mant.endswith(".") else f"{mant}e{int(exp)}"
    s = str(v)
    try:
        plain_ok = yaml.safe_load(f"k: {s}") == {"k": s} and "\n" not in s
    except yaml.YAMLError:
        plain_ok = False
    return s if plain_ok else json.dumps(s)


ENTRY_ORDER = ("backend", "route", "dtype", "tensor", "m", "floor", "cap", "reason", "calibrated_on", "note")


def entry_yaml(entry: dict, indent: str = "  ") -> list[str]:
    lines = []
    for i, k in enumerate(k for k in ENTRY_ORDER if k in entry):
        prefix = f"{indent}- " if i == 0 else f"{indent}  "
        lines.append(f"{prefix}{k}: {_yaml_scalar(entry[k])}\n")
    return lines


def _entry_spans(lines: list[str], db) -> dict[str, tuple[int, int]]:
    """Line span [start, end) of every entry of the file, by key (entry start lines come from
    the loader; an entry ends where the next starts, or at the end of the entries list)."""
    starts = sorted((tol.line - 1, tol.key) for _, tol in db.entries)
    spans = {}
    for i, (s, key) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(lines)
        # keep a comment block or blank lines that precede the next entry with it
        while end - 1 > s and (not lines[end - 1].strip() or lines[end - 1].lstrip().startswith("#")):
            end -= 1
        spans[key] = (s, end)
    return spans


def _update_entry(block: list[str], entry: dict) -> list[str]:
    """An entry's lines with only the fields whose value changes rewritten (the others keep
    their text, comments and quoting), and new fields added at its end."""
    field_re = re.compile(r"^(\s*(?:-\s+)?)([A-Za-z_]+):(\s*)(.*)$")
    first = field_re.match(block[0])
    base_indent = len(first.group(1)) if first else 0
    out, seen, i = [], set(), 0
    while i < len(block):
        line = block[i]
        m = field_re.match(line.rstrip("\n"))
        if not m or len(m.group(1)) != base_indent or m.group(2) not in entry:
            out.append(line)
            i += 1
            continue
        j = i + 1                     # continuation lines of a multi-line value
        while j < len(block) and block[j].strip() and not field_re.match(block[j].rstrip("\n")) \
                and len(block[j]) - len(block[j].lstrip()) > base_indent:
            j += 1
        name = m.group(2)
        seen.add(name)
        try:
            old = yaml.safe_load(f"k: {''.join(block[i:j]).split(':', 1)[1]}")["k"]
        except (yaml.YAMLError, TypeError, KeyError, IndexError):
            old = object()
        new = entry[name]
        same = (old == new) if not isinstance(new, float) else (isinstance(old, (int, float)) and float(old) == new)
        out += block[i:j] if same else [f"{m.group(1)}{name}: {_yaml_scalar(new)}\n"]
        i = j
    pad = " " * base_indent
    extra = [f"{pad}{k}: {_yaml_scalar(entry[k])}\n" for k in ENTRY_ORDER if k in entry and k not in seen]
    k = len(out)
    while k > 0 and (not out[k - 1].strip() or out[k - 1].lstrip().startswith("#")):
        k -= 1
    return out[:k] + extra + out[k:]


def proposed_file(text: str, db, proposals: list[dict]) -> str:
    """tolerances.yaml's text with every proposed entry in place (same key) or appended."""
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    spans = _entry_spans(lines, db)
    indent = "  "
    if db.entries:
        first = lines[min(s for s, _ in spans.values())]
        indent = first[: len(first) - len(first.lstrip())]
    replace, append = {}, []
    for e in proposals:
        key = "/".join(str(e[k]) for k in ("backend", "route", "dtype", "tensor"))
        if key in spans:
            s, end = spans[key]
            replace[spans[key]] = _update_entry(lines[s:end], e)
        else:
            append.append(e)
    out, i = [], 0
    for (s, end), new in sorted(replace.items()):
        out += lines[i:s] + new
        i = end
    out += lines[i:]
    if append:
        out.append(f"{indent}# ---------------------------------------------------------------- proposed by kda-verify calibrate\n")
        for e in append:
            out += entry_yaml(e, indent)
    return "".join(out)


def proposal_yaml(proposals: list[dict], header: str) -> str:
    lines = [f"# {ln}\n" for ln in header.splitlines()] + ["schema: 1\n", "entries:\n"]
    for e in proposals:
        lines += entry_yaml(e)
    return "".join(lines)


def earlier_records(out_dir: str, backend: str, routes: list, cases: list) -> list:
    """The records of an earlier run's directory, of one backend (optionally some routes / cases)."""
    d = Path(out_dir)
    files = sorted(d.glob("results*.jsonl")) if d.is_dir() else []
    if not files:
        raise UsageError(f"--from-results: expected a directory with results.jsonl, got {out_dir!r}")
    recs = [r for f in files for r in read_records(f)]
    recs = [r for r in recs if r.backend == backend
            and (not routes or r.route in routes)
            and (not cases or any(fnmatch.fnmatchcase(r.case, c) for c in cases))]
    if not recs:
        raise UsageError(f"--from-results: expected records of backend {backend!r} in {out_dir}, got none")
    return recs


def is_long(case_id: str) -> bool:
    """Whether a recorded case id names one of the long cases (False when it is unknown here)."""
    try:
        return False if case_id.startswith("fuzz/") else bool(get_case(case_id).long)     # fuzz cases are short
    except Exception:  # noqa: BLE001 - an id from another version of the suites
        return False


def earlier_provenance(out_dir: str):
    """The provenance of the latest run recorded in DIR/run.json (``{"runs": [...]}``, one entry
    per invocation, or a single provenance object), or None when there is no readable run.json."""
    p = Path(out_dir) / "run.json"
    try:
        prov = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(prov, dict):
        return None
    runs = prov.get("runs") if "runs" in prov else [prov]
    if not isinstance(runs, list) or not runs or not isinstance(runs[-1], dict):
        return None
    return runs[-1]


def device_description(device: dict) -> str:
    """One phrase for the device of a provenance record: the GPU's name, or ``CPU (cpu)`` where
    the run had none (provenance records ``"gpu": "none"`` on a CPU)."""
    device = device if isinstance(device, dict) else {}
    gpu = device.get("gpu")
    if gpu not in (None, "", "none"):
        return str(gpu)
    return f"CPU ({device.get('device') or device.get('type') or 'cpu'})"


def measured_where(prov: dict, earlier, records: list[dict], out_dir) -> tuple[str, str, str]:
    """(device, date, commit) the measurements were made on: this process's ``prov`` when
    calibrate measured them itself (``out_dir`` None); with --from-results the earlier run's
    run.json (``earlier``), else the records' own device field with a note that run.json is
    missing."""
    if out_dir is None:
        return device_description(prov.get("device")), prov["time_utc"][:10], str(prov["git"]["commit"])[:10]
    if earlier is not None:
        return (device_description(earlier.get("device")), str(earlier.get("time_utc", "?"))[:10],
                str((earlier.get("git") or {}).get("commit", "?"))[:10])
    devs = sorted({str(r.device) for r in records if r.device})
    what = f"the records' device {'/'.join(devs)}" if devs else "an unknown device"
    return f"{what} (no run.json beside them)", "date unknown", "unknown"


def measure(backend: str, cases: list, routes: Optional[list], device: str) -> list:
    """The records of every cell of ``backend`` on ``cases``, judged against a catch-all entry:
    calibration needs every cell's numbers, whatever tolerances.yaml says."""
    measure_db = ToleranceDB([(("*", "*", "*", "*"), Tolerance(m=math.inf, floor=math.inf, cap=math.inf,
                              reason="calibration: measure only", calibrated_on="-", key="*/*/*/*"))],
                             "<calibrate>")
    return run_matrix([backend], cases, None, routes=routes or None, device=device, db=measure_db).records


def proposal_diff(text: str, new_text: str, path) -> str:
    """The unified diff of tolerances.yaml's text against the proposed text ("" when equal)."""
    out = io.StringIO()
    out.writelines(difflib.unified_diff(text.splitlines(keepends=True), new_text.splitlines(keepends=True),
                                        fromfile=str(path), tofile=f"{path} (proposed)"))
    return out.getvalue()
