"""Which cells a run holds: backends loaded (or probed) from their specs, the routes asked
for (``resolve_routes``), the case-major cell list (``plan``) and the resume check of an output
directory against the selection recorded there (``check_resume``)."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from kda_kernels.base import LooksUpRoutes, Route, load_backend
from verification.errors import UsageError
from verification.judging.record import RESULTS_FILE, read_records, read_runs


# Backends and routes
@dataclass
class LoadedBackend:
    """A backend object plus the spec it was loaded from (for repro lines and children)."""
    spec: str
    backend: object
    available: bool
    reason: str
    version: str
    from_spec: bool = True          # loadable again from spec (what an isolated child needs)

    @property
    def name(self) -> str:
        return str(getattr(self.backend, "name", self.spec))


def probe(backend, spec: str, from_spec: bool) -> LoadedBackend:
    """Ask a Backend object where it stands (available, reason, version); never raises."""
    try:
        ok, why = backend.available()
    except Exception as e:  # noqa: BLE001 - an availability probe that raises means "not here"
        ok, why = False, f"available() raised {type(e).__name__}: {e}"
    try:
        ver = str(backend.version()) if hasattr(backend, "version") else "unknown"
    except Exception as e:  # noqa: BLE001
        ver = f"unknown ({type(e).__name__})"
    return LoadedBackend(spec=spec, backend=backend, available=bool(ok), reason=str(why or ""), version=ver,
                         from_spec=from_spec)


def module_exists(mod_name: str) -> bool:
    """Whether ``mod_name`` can be imported here (found, not imported)."""
    try:
        return importlib.util.find_spec(mod_name) is not None
    except (ImportError, ValueError):
        return False


def load(spec: str) -> LoadedBackend:
    """Load a backend by built-in name or package.module:factory and ask where it stands."""
    return probe(load_backend(spec), spec, from_spec=True)


def as_loaded(backend) -> LoadedBackend:
    """A LoadedBackend from a spec string, a Backend object or a LoadedBackend."""
    if isinstance(backend, LoadedBackend):
        return backend
    if isinstance(backend, str):
        return load(backend)
    return probe(backend, str(getattr(backend, "name", type(backend).__name__)), from_spec=False)


def resolve_routes(lb: LoadedBackend, wanted: Optional[list[str]] = None, strict: bool = True) -> list:
    """The Routes of a backend to run: all of them, or the ones named (--route).  A name
    not among backend.routes() goes to backend.route(name) where the backend parses route
    specs; otherwise it is a UsageError naming --route and the choices (with strict=False
    it is left out: another backend of the run may have it)."""
    try:
        have = list(lb.backend.routes())
    except Exception as e:  # noqa: BLE001 - an unavailable backend may not list routes
        if lb.available:
            raise
        have = []
        lb.reason = lb.reason or f"routes() raised {type(e).__name__}: {e}"
    if not wanted:
        return have or [Route(name="*", description="backend unavailable: routes unknown")]
    by_name = {r.name: r for r in have}
    out = []
    for name in wanted:
        if name in by_name:
            out.append(by_name[name])
        elif isinstance(lb.backend, LooksUpRoutes):
            try:
                out.append(lb.backend.route(name))
            except (ValueError, KeyError) as e:
                if strict:
                    raise UsageError(f"--route: backend {lb.name!r} cannot parse {name!r}: {e}") from e
        elif not have and not lb.available:
            out.append(Route(name=name))
        elif not strict:
            continue
        else:
            raise UsageError(f"--route: backend {lb.name!r} has no route {name!r}; "
                             f"expected one of: {', '.join(by_name) or '(none)'}")
    return out


def plan(backends: list[LoadedBackend], routes: Optional[list[str]], cases: list) -> list[tuple]:
    """The cells, case-major: [(LoadedBackend, Route, Case), ...]."""
    strict = len(backends) == 1
    per_backend = [(lb, resolve_routes(lb, routes, strict=strict)) for lb in backends]
    if routes and not strict:
        missing = [n for n in routes if not any(resolve_routes(lb, [n], strict=False) for lb in backends)]
        if missing:
            have = "; ".join(f"{lb.name}: {', '.join(r.name for r in resolve_routes(lb)) or '(none)'}"
                             for lb in backends)
            raise UsageError(f"--route: expected routes of the chosen backends, got {', '.join(map(repr, missing))} "
                             f"which none has ({have})")
    return [(lb, r, c) for c in cases for lb, rs in per_backend for r in rs]


def _selection_value(v):
    """A selection option's value compared regardless of order and repetition (None for unset)."""
    if isinstance(v, (list, tuple)):
        return tuple(sorted({str(x) for x in v})) or None
    return None if v is None else str(v)


def _selection_text(selection: dict, options=None) -> str:
    """``--backend a,b --suite smoke ...`` of a selection (``options``: only these; an unset
    one reads ``no --route``)."""
    parts = []
    for opt in (selection if options is None else options):
        v = selection.get(opt)
        shown = ",".join(map(str, v)) if isinstance(v, (list, tuple)) else v
        if shown not in (None, ""):
            parts.append(f"{opt} {shown}")
        elif options is not None:
            parts.append(f"no {opt}")
    return " ".join(parts)


def check_resume(out_dir, resume: bool, selection: Optional[dict] = None, wanted: Optional[set] = None) -> None:
    """Refuse, before anything is written, a run into ``out_dir`` that would mix two runs: results
    there without ``resume``, or a resume whose selection is not the one recorded in DIR/run.json
    (``selection``: {option: value} of what picks the cells, e.g. {"--backend": [...], "--suite":
    [...]}, compared regardless of order).  Where DIR records no selection, a resume whose cells
    (``wanted``, cell keys) leave out a cell already recorded is refused.  Reads only."""
    results = Path(out_dir) / RESULTS_FILE
    if not results.is_file() or results.stat().st_size == 0:
        return
    if not resume:
        raise UsageError(f"--out: {results} already holds {len(read_records(results))} cells; "
                         f"pass --resume to continue that run, or choose an empty directory")
    before = next((r["selection"] for r in reversed(read_runs(out_dir))
                   if isinstance(r, dict) and isinstance(r.get("selection"), dict)), None)
    if selection is not None and before is not None:
        differ = [o for o in dict.fromkeys([*before, *selection])
                  if _selection_value(before.get(o)) != _selection_value(selection.get(o))]
        if differ:
            raise UsageError(f"--resume: expected the selection of the run in {out_dir} ({_selection_text(before)}), "
                             f"got {_selection_text(selection, differ)}; another selection needs another --out")
    elif wanted is not None:
        other = [r.key for r in read_records(results) if r.key not in wanted]
        if other:
            raise UsageError(f"--resume: expected a selection holding the {len(read_records(results))} cells recorded "
                             f"in {out_dir}, got one without {len(other)} of them (e.g. {other[0]}); another "
                             f"selection needs another --out")
