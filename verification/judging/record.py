"""The record of one cell and its one JSON codec (what its statuses mean: verification/judging/policy.py).

A cell (one route of one backend on one case) leaves one ``Record``: who ran (backend, route,
recipe), on what (case, suite, seed, params, shape, dtype, device), the verdict (status, reason,
per-tensor ``tensors`` of verification.judging.verdict, the worst ``margin``), the full metrics, the
baseline's scalar metrics, timings and a repro command.  Fields that only some cells have
(guards, info, traceback, known_failure, contract_verdict, ...) travel in ``extra``; the usual
ones have typed accessors (``rec.traceback``, ``rec.guards``, ...: None when absent).  A record
is made in one place (``new_record``), filled by ``set_problem`` and ``set_judged`` and decided
by verification.judging.verdict.decide; it flows as a Record from the runner to the results files, the
report, calibrate and the merge of directories.  New code reads and writes attributes; the dict
form's ``rec["status"]`` / ``rec.get(...)`` / ``rec.update(...)`` still work (a name that is no
field reads and writes ``extra``) for the modules that index records by name.

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
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from verification.judging.metrics import dtype_name

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
def _extra(name: str, doc: str) -> property:
    """A typed accessor of one of ``Record.extra``'s fields (None when the cell has none)."""
    def fget(self):
        return self.extra.get(name)

    def fset(self, value):
        if value is None:
            self.extra.pop(name, None)
        else:
            self.extra[name] = value
    return property(fget, fset, doc=doc)


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

    # ---- the fields only some cells have: properties over ``extra`` (absent -> None) ------
    traceback = _extra("traceback", "an error's traceback tail (status error / resource-error)")
    stderr_tail = _extra("stderr_tail", "a crashed child process's stderr tail (status crashed)")
    info = _extra("info", "what the kernel said about its call (outputs.info)")
    guards = _extra("guards", "what verification.running.guards checked (guards on)")
    known_failure = _extra("known_failure", "the register entry that made the cell known-fail")
    contract_verdict = _extra("contract_verdict", "the verdict an out-of-contract cell would have had")
    self_judged = _extra("self_judged", "True on an emulator cell judged against its own recipe")
    isolated = _extra("isolated", "True when the cell ran in a child process (--isolate)")
    serving = _extra("serving", "a serving-trace cell's pairing, steps, diagnosis, failures and drift")

    # ---- the dict form's reads and writes, for code that still indexes records by name ------
    def __getitem__(self, name: str):
        if name in _FIELD_NAMES:
            return getattr(self, name)
        return self.extra[name]

    def __setitem__(self, name: str, value) -> None:
        if name in _FIELD_NAMES:
            setattr(self, name, value)
        else:
            self.extra[name] = value

    def __contains__(self, name) -> bool:
        return name in _FIELD_NAMES or name in self.extra

    def get(self, name: str, default=None):
        if name in _FIELD_NAMES:
            return getattr(self, name)
        return self.extra.get(name, default)

    def update(self, other=(), **kw) -> None:
        for name, value in dict(other, **kw).items():
            self[name] = value

    def setdefault(self, name: str, default=None):
        if name not in self:
            self[name] = default
        return self[name]

    def pop(self, name: str, *default):
        if name in _FIELD_NAMES:
            raise KeyError(f"{name} is a field of every record; it cannot be removed")
        return self.extra.pop(name, *default)

    def keys(self):
        return self.to_dict().keys()

    def items(self):
        return self.to_dict().items()

    def __iter__(self):
        return iter(self.keys())

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


_FIELD_NAMES = frozenset(Record.fields())


def new_record(*, backend: str, backend_spec: str, backend_version: str, route: str, recipe: Optional[str],
               case: str, suite: str, seed: Optional[int], params: dict, device: str, repro: str,
               extra: Optional[dict] = None) -> Record:
    """The one constructor of a cell's Record, not yet judged (run, the isolated child, check's
    directory form and the serving suite all start here): its key, encoded params and the time."""
    return Record(key=cell_key(backend, route, case), backend=backend, backend_spec=backend_spec,
                  backend_version=backend_version, route=route, recipe=recipe, case=case, suite=suite,
                  seed=seed, params=encode(dict(params or {})), device=str(device), repro=repro,
                  time_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), extra=dict(extra or {}))


def problem_shape(problem) -> dict:
    """A Problem's sizes as a record's ``shape``."""
    return {"B": problem.B, "T": problem.T, "H": problem.H, "HV": problem.HV, "K": problem.K,
            "V": problem.V, "N": problem.N}


def set_problem(rec: Record, problem, shape_key) -> Record:
    """What a record says of its Problem: ``shape``, ``shape_key`` (list) and ``dtype`` (the
    tolerance's key: the input dtype, bf16 / fp16 / fp32)."""
    rec.shape = problem_shape(problem)
    rec.shape_key = list(shape_key)
    rec.dtype = dtype_name(problem.v.dtype)
    return rec


def scalar_metrics(metrics: Optional[dict]) -> dict:
    """The scalar part of per-tensor metrics (baselines: no curves)."""
    out = {}
    for tname, m in (metrics or {}).items():
        if isinstance(m, dict):
            out[tname] = {k: v for k, v in m.items() if not isinstance(v, (list, tuple, dict)) and not _is_tensor(v)}
    return out


def worst_margin(tensors: dict) -> Optional[float]:
    """The largest margin over a verdict's tensors (margin = err / threshold: > 1 fails)."""
    vals = [decode_number(t.get("margin")) for t in (tensors or {}).values() if isinstance(t, dict)]
    if not vals:
        return None
    if any(math.isnan(v) for v in vals):
        return float("nan")
    return max(vals)


def set_judged(rec: Record, tensors: dict, metrics: dict, baseline: Optional[dict] = None) -> Record:
    """What a judged record holds: the verdict's per-tensor ``tensors``, the full ``metrics``, the
    worst ``margin`` over the tensors and (when given) the baseline's scalar metrics."""
    rec.tensors = encode(tensors or {})
    rec.metrics = encode(metrics)
    rec.margin = encode(worst_margin(rec.tensors))
    if baseline is not None:
        rec.baseline = scalar_metrics(baseline)
    return rec


def as_record(rec) -> Record:
    """``rec`` as a Record (a dict form is read as ``from_dict`` reads a results line)."""
    return rec if isinstance(rec, Record) else Record.from_dict(rec)


def as_records(records) -> list[Record]:
    """Every record of ``records`` as a Record (the report's and calibrate's entry points take
    Records, or the dict form a caller built by hand)."""
    return [as_record(r) for r in records]


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


def read_records(path: Path, *, strict: bool = False) -> list[Record]:
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
