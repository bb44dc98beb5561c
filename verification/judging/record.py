"""The record of one cell and its one JSON codec (what its statuses mean: verification/judging/policy.py).

A cell (one route of one backend on one case) leaves one ``Record``: who ran (backend, route,
recipe), on what (case, suite, seed, params, shape, dtype, device), the verdict (status, reason,
per-tensor ``tensors`` of verification.judging.verdict, the worst ``margin``), the full metrics, the
baseline's scalar metrics, timings and a repro command.  Fields that only some cells have
(guards, info, traceback, known_failure, contract_verdict, ...) travel in ``extra``.

On disk a record is one JSON object per line of ``results*.jsonl`` (``append_record``,
``read_records``), with the field names below, sorted; ``record_version`` says which schema
wrote it (files written before the field existed read as version 0, the same fields).

The codec (``encode``) writes what ``json.dumps(allow_nan=False)`` accepts: tensors as lists or
numbers, tuples as lists, non-finite floats as the strings "NaN", "Infinity", "-Infinity".
``decode_number`` reads those back, and the "nan" / "inf" / "-inf" that ``kda-verify check
--json`` wrote before both used this codec.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

RECORD_VERSION = 1
RESULTS_FILE = "results.jsonl"     # one run's records (pytest -m verify under xdist: results-gwN.jsonl)
RUN_FILE = "run.json"              # its provenance, one entry per invocation

# ---- the codec ---------------------------------------------------------------------------
def encode(x):
    """A copy of x that json.dumps(allow_nan=False) accepts: tensors -> lists / numbers,
    non-finite floats -> "NaN" / "Infinity" / "-Infinity", tuples -> lists, objects with
    ``to_dict`` -> their dict."""
    if isinstance(x, dict):
        return {str(k): encode(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [encode(v) for v in x]
    if _is_tensor(x):
        return encode(x.detach().cpu().tolist()) if x.numel() != 1 else encode(x.item())
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, int):
        return int(x)
    if isinstance(x, float) or hasattr(x, "__float__"):
        try:
            f = float(x)
        except (TypeError, ValueError):
            return str(x)
        if math.isnan(f):
            return "NaN"
        if math.isinf(f):
            return "Infinity" if f > 0 else "-Infinity"
        return f
    if hasattr(x, "to_dict"):
        return encode(x.to_dict())
    return str(x)


def _is_tensor(x) -> bool:
    import sys
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


_NON_FINITE = {"nan": float("nan"), "infinity": float("inf"), "-infinity": float("-inf"),
               "inf": float("inf"), "-inf": float("-inf")}


def decode_number(x) -> float:
    """A number from a record field (accepts the strings ``encode`` writes, and "nan" / "inf");
    NaN if absent or not a number."""
    if x is None:
        return float("nan")
    if isinstance(x, str):
        return _NON_FINITE.get(x.lower(), float("nan"))
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def dumps(x, **kw) -> str:
    """``x`` as JSON through ``encode`` (never NaN / Infinity literals)."""
    return json.dumps(encode(x), allow_nan=False, **kw)


def cell_key(backend: str, route: str, case_id: str) -> str:
    """The identity of a cell in results.jsonl (what --resume skips on)."""
    return f"{backend}|{route}|{case_id}"


# ---- the record --------------------------------------------------------------------------
@dataclass
class Record:
    """One cell's record; ``to_dict`` / ``from_dict`` give the dict form the rest of the harness
    and the results files use (the same field names, in this order, then ``extra``'s)."""
    key: str = ""
    backend: str = ""
    backend_spec: str = ""
    backend_version: str = ""
    route: str = ""
    recipe: Optional[str] = None
    case: str = ""
    suite: str = ""
    seed: Optional[int] = None
    params: dict = field(default_factory=dict)
    device: str = ""
    status: Optional[str] = None        # one of verification.judging.policy.STATUSES; None while running
    reason: str = ""
    shape: Optional[dict] = None
    shape_key: Optional[list] = None
    dtype: Optional[str] = None
    tensors: dict = field(default_factory=dict)     # name -> {err, threshold, margin, metric, baseline_err, ...}
    metrics: dict = field(default_factory=dict)     # name -> metrics of verification.judging.metrics
    baseline: dict = field(default_factory=dict)    # name -> the baseline's scalar metrics
    margin: object = None                           # the worst margin (a number, "NaN" / "Infinity"), None if unjudged
    timings: dict = field(default_factory=dict)
    repro: str = ""
    time_utc: str = ""
    extra: dict = field(default_factory=dict)       # the fields only some cells have (guards, info, ...)
    version: int = RECORD_VERSION

    @classmethod
    def fields(cls) -> tuple:
        """The named fields, in their dict order (without extra and version)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in ("extra", "version"))

    def to_dict(self, version: bool = False) -> dict:
        """The dict form (the names of the results files); with ``version``, ``record_version`` too."""
        d = {name: getattr(self, name) for name in self.fields()}
        d.update(self.extra)
        if version:
            d["record_version"] = self.version
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Record":
        """A Record from a dict of any version (missing fields take their defaults; fields this
        version does not name are kept in ``extra``)."""
        names = set(cls.fields())
        known = {k: v for k, v in d.items() if k in names}
        extra = {k: v for k, v in d.items() if k not in names and k != "record_version"}
        return cls(**known, extra=extra, version=int(d.get("record_version", 0) or 0))

    def to_json(self) -> str:
        """One line of a results file (sorted keys, the codec's non-finite strings)."""
        return dumps(self.to_dict(version=True), sort_keys=True)

    @classmethod
    def from_json(cls, line: str) -> "Record":
        return cls.from_dict(json.loads(line))


def as_record(rec) -> Record:
    return rec if isinstance(rec, Record) else Record.from_dict(rec)


def record_line(rec) -> str:
    """The results-file line of a record (a Record or its dict form): every field the dict holds,
    sorted, plus record_version."""
    d = rec.to_dict() if isinstance(rec, Record) else dict(rec)
    d.setdefault("record_version", RECORD_VERSION)
    return dumps(d, sort_keys=True)


# ---- results files: append + fsync; tolerant reading ---------------------------------------
def append_record(path: Path, record) -> None:
    """Append one record as one JSON line, and make it durable before returning."""
    line = record_line(record) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def repair_partial_line(path: Path) -> bool:
    """Cut a partial last line (a write interrupted mid-line) off the file; True if one was."""
    if not path.exists() or path.stat().st_size == 0:
        return False
    with open(path, "rb+") as f:
        data = f.read()
        if data.endswith(b"\n"):
            return False
        cut = data.rfind(b"\n") + 1
        f.truncate(cut)
        f.flush()
        os.fsync(f.fileno())
    return True


def load_records(path: Path, *, strict: bool = False) -> list[Record]:
    """Every record of a results .jsonl file as a Record (any version); a line that does not
    parse is skipped (or, with strict, raises ValueError naming the file and line)."""
    out = []
    if not Path(path).exists():
        return out
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                if strict:
                    raise ValueError(f"{path}:{n}: expected one JSON record per line, got: {e}") from e
                continue
            if isinstance(rec, dict) and "key" in rec:
                out.append(Record.from_dict(rec))
    return out


def read_records(path: Path, *, strict: bool = False) -> list[dict]:
    """``load_records`` in the dict form (what report, calibrate, check, shrink and the plugin use)."""
    return [r.to_dict() for r in load_records(path, strict=strict)]


def read_runs(out_dir) -> list:
    """The invocations recorded in DIR/run.json (``{"runs": [...]}``, one entry per invocation),
    oldest first; [] when there is no run.json or it is not readable as that."""
    p = Path(out_dir) / RUN_FILE
    if not p.exists():
        return []
    try:
        return json.loads(p.read_text()).get("runs", [])
    except (json.JSONDecodeError, AttributeError):
        return []
