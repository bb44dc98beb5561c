"""Tolerances as data: ``verification/judging/tolerances.yaml``, in the package so every install has it
(docs/tolerances.md).

Schema (version 1)::

    schema: 1
    entries:
      - backend: triton          # glob over backend names
        route: "seg:*"           # glob over route names
        dtype: bf16              # the problem's input dtype (bf16 | fp16 | fp32) or a glob
        tensor: o                # o | final_state | state_cache | ws_inv (a tap), or a glob
        m: 2.0                   # the kernel may be m times worse than its baseline ...
        floor: 2.0e-4            # ... plus this floor ...
        cap: 5.0e-2              # ... and never worse than this cap
        reason: one line: why these numbers
        calibrated_on: where and on what they were measured
        note: optional; required in review when an entry is loosened
    known_failures:              # optional: failures the project knows and explains
      - backend: emulator        # glob
        route: moonshot          # glob
        case: "*/correlated-*"   # glob over case ids
        params: {rho: ">=0.9", lb: [">=-0.3", "<0"]}   # optional: conditions on the case's parameters
        reason: one line: why it fails (a property of the algorithm, a library bug, ...)
        evidence: what was measured, where
        seen_on: optional: the library version or commit it was seen on
        shrink: optional: the kda-verify shrink command that reproduces it (the findings register)
        fixed-in: optional: the library versions or commits where the shrink repro passes (measured)
        still-fails-in: optional: the versions or commits where it still fails (measured)

A cell matches an entry when its backend, route and case id match the globs and, where the entry
has ``params``, every condition holds on the case's parameters (``Case.params``: the named
cases' recipes, and for a fuzz case ``fuzz/fuzz{S}-{i}`` the parameters its draw recorded,
verification.running.cases._fuzz_params), so a fuzz case with the parameters of a known failure is
matched although its id says nothing.  ``params`` maps a numeric case parameter (NUMERIC_PARAMS
of verification.running.cases) to a condition: a number (equal to it), a comparison ``"<op><number>"``
with op one of >=, >, <=, <, ==, or a list of these (all must hold: a range).  A parameter the
case does not set never satisfies a condition (no defaults are filled in), nor does a value
that is not a number.  Conditions may also name a derived parameter (DERIVED_PARAMS), computed
from the case's parameters by ``match_params`` (the one place they are computed), because what
they describe is held in a list or a string that no condition can name:

    empty_seqs_before_last  zero-length sequences with a non-empty sequence after them
                            (``lens``; a case without ``lens`` has none)
    empty_seqs              zero-length sequences, wherever they are
    initial_states          non-empty sequences whose recurrence starts from a given state:
                            every one for state kv / vk (or a converged state), those not in
                            ``paged_new`` for state paged, none for state none

A failing or mistrusted cell that matches a known failure is reported as ``known-fail``
(it does not fail the run, and the report lists it with its reason); a matching cell that
passes is reported as a pass with a note that the entry may be stale (for an entry with
``params``, that the case lies in the entry's region although it passes: a region is where the
failure happens, not a promise that every case in it fails, so the entry is stale only once no
case of it fails).  Only a failure the
project can explain belongs here: it is a record, not a way to go green.

Rule (verification.judging.verdict): err <= m * baseline_err + floor and err <= cap.  An unknown key
or field, a missing field, a wrong type, or two entries with the same key is an error that
names the file, the line and the field.  ``lookup`` takes the most specific matching entry:
a literal backend beats a glob, then a literal route, then the count of literal dtype/tensor
fields, then the longest patterns; ties go to the first entry in the file.
"""
from __future__ import annotations

import fnmatch
import math
import operator
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

import yaml

from verification.errors import ToleranceError
from verification.running.cases import NUMERIC_PARAMS

TOP_KEYS = ("schema", "entries", "known_failures")
KNOWN_FIELDS = ("backend", "route", "case", "reason", "evidence")
KNOWN_OPTIONAL = ("params", "seen_on", "shrink", "fixed-in", "still-fails-in")
PARAM_OPS = (">=", "<=", ">", "<", "==")     # two-character operators first (parsing order)
DERIVED_PARAMS = ("empty_seqs_before_last", "empty_seqs", "initial_states")   # match_params computes them
KEY_FIELDS = ("backend", "route", "dtype", "tensor")
NUM_FIELDS = ("m", "floor", "cap")
TEXT_FIELDS = ("reason", "calibrated_on")
OPTIONAL_FIELDS = ("note", "last_observed_margin")
FIELDS = KEY_FIELDS + NUM_FIELDS + TEXT_FIELDS + OPTIONAL_FIELDS
DTYPES = ("bf16", "fp16", "fp32")
TENSORS = ("o", "final_state", "state_cache", "ws_inv")
DEFAULT_PATH = Path(__file__).resolve().parent / "tolerances.yaml"     # in the package: installed with it


@dataclass(frozen=True)
class Tolerance:
    m: float
    floor: float
    cap: float
    reason: str
    calibrated_on: str
    key: str                  # "backend/route/dtype/tensor" of the entry (its patterns)
    line: int = 0
    note: str = ""

    def threshold(self, baseline_err: float) -> float:
        """min(m * baseline_err + floor, cap)."""
        return min(self.m * baseline_err + self.floor, self.cap)


def _is_glob(p: str) -> bool:
    return any(ch in p for ch in "*?[")


_COMPARE = dict(zip(PARAM_OPS, (operator.ge, operator.le, operator.gt, operator.lt, operator.eq)))
_CONDITION = re.compile(r"^\s*(" + "|".join(map(re.escape, PARAM_OPS)) +
                        r")\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")


def match_params(params: Optional[Mapping]) -> Optional[Mapping]:
    """The parameters a known failure's conditions see: the case's own (``Case.params``, a
    record's ``params``) plus the derived ones of DERIVED_PARAMS (module docstring), which
    replace any value of the same name.  Not a mapping: returned as is.  Sequence lengths come
    from ``lens``, else B sequences of T tokens (defaults 1 and 64, as verification.running.cases builds
    the problem); lengths that are not integers >= 0 leave the derived parameters out."""
    if not isinstance(params, Mapping):
        return params
    out = dict(params)
    for name in DERIVED_PARAMS:
        out.pop(name, None)
    if "lens" in params:
        lens = params["lens"]
    else:
        lens = [params.get("T", 64)] * params.get("B", 1) if isinstance(params.get("B", 1), int) else None
    if (not isinstance(lens, (list, tuple))
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in lens)):
        return out
    last = max((i for i, n in enumerate(lens) if n > 0), default=-1)
    out["empty_seqs_before_last"] = sum(1 for i, n in enumerate(lens) if n == 0 and i < last)
    out["empty_seqs"] = sum(1 for n in lens if n == 0)
    state = "kv" if params.get("converged") and params.get("state", "none") == "none" else params.get("state", "none")
    if state in ("kv", "vk"):
        starts = [i for i, n in enumerate(lens) if n > 0]
    elif state == "paged":
        fresh = params.get("paged_new", [])
        fresh = set(fresh) if isinstance(fresh, (list, tuple, set)) else set()
        starts = [i for i, n in enumerate(lens) if n > 0 and i not in fresh]
    else:
        starts = []
    out["initial_states"] = len(starts)
    return out


@dataclass(frozen=True)
class ParamCondition:
    """One condition of a known failure's ``params``: case parameter ``name`` ``op`` ``value``."""
    name: str
    op: str
    value: float

    def holds(self, params: Optional[Mapping]) -> bool:
        """Whether the case's parameters satisfy it (an unset or non-numeric parameter never does)."""
        if not isinstance(params, Mapping) or self.name not in params:
            return False
        got = params[self.name]
        if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isfinite(got):
            return False
        return _COMPARE[self.op](float(got), self.value)

    def __str__(self) -> str:
        return f"{self.name}{self.op}{self.value:g}"


@dataclass(frozen=True)
class KnownFailure:
    backend: str
    route: str
    case: str
    reason: str
    evidence: str
    line: int = 0
    params: tuple = ()       # ParamCondition, all of which must hold; () = no condition on parameters
    seen_on: str = ""        # the library version or commit the failure was seen on
    shrink: str = ""         # the kda-verify shrink command that reproduces it
    fixed_in: str = ""       # versions / commits where the repro passes (yaml ``fixed-in``)
    still_fails_in: str = "" # versions / commits where it still fails (yaml ``still-fails-in``)

    def matches(self, backend: str, route: str, case_id: str, params: Optional[Mapping] = None) -> bool:
        """Backend, route and case id match the globs and every ``params`` condition holds on
        the case's parameters (``params``: the record's ``params``, i.e. ``Case.params``) and
        the parameters derived from them (``match_params``)."""
        if not (fnmatch.fnmatchcase(backend, self.backend) and fnmatch.fnmatchcase(route, self.route)
                and fnmatch.fnmatchcase(case_id, self.case)):
            return False
        if not self.params:
            return True
        seen = match_params(params)
        return all(c.holds(seen) for c in self.params)

    def describe_params(self) -> str:
        """'rho>=0.9, beta_raw>=4, lb>=-0.3' ('' without conditions)."""
        return ", ".join(str(c) for c in self.params)


class ToleranceDB:
    def __init__(self, entries: list, path: str = "<memory>", known_failures: Optional[list] = None):
        self.entries = list(entries)     # [(patterns tuple, Tolerance)]
        self.path = path
        self.known_failures = list(known_failures or [])

    def known_failure(self, backend: str, route: str, case_id: str,
                      params: Optional[Mapping] = None) -> Optional[KnownFailure]:
        """The first known-failure entry matching this cell (``params``: the case's parameters,
        which entries with ``params`` conditions need to match), or None."""
        for kf in self.known_failures:
            if kf.matches(str(backend), str(route), str(case_id), params):
                return kf
        return None

    def __len__(self):
        return len(self.entries)

    def lookup(self, backend: str, route: str, dtype: str, tensor: str) -> Tolerance:
        """The most specific entry matching (backend, route, dtype, tensor)."""
        want = (backend, route, dtype, tensor)
        best, best_score = None, None
        for pats, tol in self.entries:
            if all(fnmatch.fnmatchcase(str(w), p) for w, p in zip(want, pats)):
                score = (not _is_glob(pats[0]), not _is_glob(pats[1]), sum(not _is_glob(p) for p in pats[2:]),
                         sum(len(p.replace("*", "")) for p in pats))
                if best_score is None or score > best_score:
                    best, best_score = tol, score
        if best is None:
            raise ToleranceError(f"{self.path}: expected an entry matching backend={backend} route={route} "
                                 f"dtype={dtype} tensor={tensor}, got none (add one with a reason)")
        return best


def _err(path, line, msg):
    return ToleranceError(f"{path}:{line}: {msg}")


def _fields(node, allowed: tuple, what: str, path: str) -> dict:
    """{field: (value, line)} of one YAML mapping node; an unknown or repeated field is an error."""

    if not isinstance(node, yaml.MappingNode):
        raise _err(path, node.start_mark.line + 1, f"{what}: expected a mapping of fields")
    fields = {}
    for k, v in node.value:
        if k.value not in allowed:
            raise _err(path, k.start_mark.line + 1, f"unknown field {k.value!r}: expected one of {', '.join(allowed)}")
        if k.value in fields:
            raise _err(path, k.start_mark.line + 1, f"field {k.value!r}: given twice")
        fields[k.value] = (yaml.safe_load(yaml.serialize(v)), k.start_mark.line + 1)
    return fields


def parse_tolerances(text: str, path: str = "<string>") -> ToleranceDB:
    """Validate and load the YAML text of a tolerance file."""

    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark else 0
        raise _err(path, line, f"expected valid YAML, got {getattr(e, 'problem', e)}") from None
    if root is None or not isinstance(root, yaml.MappingNode):
        raise _err(path, 1, "expected a mapping with keys schema, entries, got "
                   f"{'nothing' if root is None else type(root).__name__}")
    top = {}
    for k, v in root.value:
        if k.value not in TOP_KEYS:
            raise _err(path, k.start_mark.line + 1, f"unknown key {k.value!r}: expected one of {', '.join(TOP_KEYS)}")
        top[k.value] = (k, v)
    if "schema" not in top or yaml.safe_load(yaml.serialize(top["schema"][1])) != 1:
        line = top["schema"][0].start_mark.line + 1 if "schema" in top else 1
        raise _err(path, line, "schema: expected 1")
    if "entries" not in top or not isinstance(top["entries"][1], yaml.SequenceNode):
        raise _err(path, top.get("entries", (root,))[0].start_mark.line + 1, "entries: expected a list of entries")
    entries, seen = [], {}
    for node in top["entries"][1].value:
        line = node.start_mark.line + 1
        fields = _fields(node, FIELDS, "entry", path)
        for f in KEY_FIELDS + NUM_FIELDS + TEXT_FIELDS:
            if f not in fields:
                raise _err(path, line, f"entry: missing field {f!r}")
        for f in KEY_FIELDS + TEXT_FIELDS + ("note",):
            if f in fields:
                val, ln = fields[f]
                if not isinstance(val, str) or not val.strip():
                    raise _err(path, ln, f"{f}: expected a non-empty string, got {val!r}")
        for f in NUM_FIELDS + ("last_observed_margin",):
            if f in fields:
                val, ln = fields[f]
                if isinstance(val, bool) or not isinstance(val, (int, float)) or not val >= 0:
                    raise _err(path, ln, f"{f}: expected a number >= 0, got {val!r}")
        if fields["cap"][0] <= 0:
            raise _err(path, fields["cap"][1], f"cap: expected a number > 0, got {fields['cap'][0]!r}")
        dt, ln = fields["dtype"]
        if not _is_glob(dt) and dt not in DTYPES:
            raise _err(path, ln, f"dtype: expected one of {', '.join(DTYPES)} or a glob, got {dt!r}")
        tn, ln = fields["tensor"]
        if not _is_glob(tn) and tn not in TENSORS:
            raise _err(path, ln, f"tensor: expected one of {', '.join(TENSORS)} or a glob, got {tn!r}")
        pats = tuple(fields[f][0] for f in KEY_FIELDS)
        if pats in seen:
            raise _err(path, line, f"entry {'/'.join(pats)}: same key as the entry at line {seen[pats]}")
        seen[pats] = line
        tol = Tolerance(m=float(fields["m"][0]), floor=float(fields["floor"][0]), cap=float(fields["cap"][0]),
                        reason=fields["reason"][0].strip(), calibrated_on=fields["calibrated_on"][0].strip(),
                        key="/".join(pats), line=line, note=fields.get("note", ("", 0))[0])
        entries.append((pats, tol))
    known = []
    if "known_failures" in top:
        node_list = top["known_failures"][1]
        if not isinstance(node_list, yaml.SequenceNode):
            raise _err(path, top["known_failures"][0].start_mark.line + 1, "known_failures: expected a list")
        for node in node_list.value:
            line = node.start_mark.line + 1
            fields = _fields(node, KNOWN_FIELDS + KNOWN_OPTIONAL, "known failure", path)
            for f in KNOWN_FIELDS:
                if f not in fields:
                    raise _err(path, line, f"known failure: missing field {f!r}")
                val, ln = fields[f]
                if not isinstance(val, str) or not val.strip():
                    raise _err(path, ln, f"{f}: expected a non-empty string, got {val!r}")
            text = {f: fields[f][0].strip() for f in KNOWN_FIELDS}
            conditions = ()
            if "params" in fields:
                entry = f"known failure {text['backend']}/{text['route']}/{text['case']}"
                conditions = _param_conditions(*fields["params"], entry=entry, path=path)
            for f in ("seen_on", "shrink", "fixed-in", "still-fails-in"):   # optional text: register columns
                if f in fields:
                    val, ln = fields[f]
                    if not isinstance(val, str) or not val.strip():
                        raise _err(path, ln, f"{f}: expected a non-empty string, got {val!r}")
                    text[f.replace("-", "_")] = val.strip()
            known.append(KnownFailure(line=line, params=conditions, **text))
    return ToleranceDB(entries, path, known)


def _param_conditions(value, line: int, entry: str, path: str) -> tuple:
    """The ParamConditions of a known failure's ``params`` field (module docstring), or a
    ToleranceError naming the file and line, the entry, the field, what was expected and what came."""

    form = f"a number or a comparison '<op><number>' with op one of {', '.join(PARAM_OPS)}"
    if not isinstance(value, dict) or not value:
        raise _err(path, line, f"{entry}: params: expected a mapping of case parameter to condition "
                               f"(e.g. {{rho: \">=0.9\"}}), got {value!r}")
    out = []
    for name, cond in value.items():
        if name not in NUMERIC_PARAMS + DERIVED_PARAMS:
            raise _err(path, line, f"{entry}: params: expected numeric case parameters "
                                   f"({', '.join(NUMERIC_PARAMS)}) or derived ones "
                                   f"({', '.join(DERIVED_PARAMS)}), got {name!r}")
        field = f"params.{name}"
        items = cond if isinstance(cond, list) else [cond]
        if not items:
            raise _err(path, line, f"{entry}: {field}: expected {form}, or a non-empty list of them, got []")
        for item in items:
            if isinstance(item, (int, float)) and not isinstance(item, bool) and math.isfinite(item):
                out.append(ParamCondition(name, "==", float(item)))
                continue
            m = _CONDITION.match(item) if isinstance(item, str) else None
            if m is None:
                raise _err(path, line, f"{entry}: {field}: expected {form}, or a list of them, got {item!r}")
            out.append(ParamCondition(name, m.group(1), float(m.group(2))))
    return tuple(out)


def load_tolerances(path: Optional[str] = None) -> ToleranceDB:
    """Load ``path`` (default: $KDA_TOLERANCES, else DEFAULT_PATH, the package's tolerances.yaml)."""
    path = path or os.environ.get("KDA_TOLERANCES") or str(DEFAULT_PATH)
    p = Path(path)
    if not p.is_file():
        raise ToleranceError(f"--tolerances: expected a YAML file, got {str(path)!r} (not found)")
    return parse_tolerances(p.read_text(), str(p))
