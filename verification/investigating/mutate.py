"""Mutation testing of our Triton FlashKDA: does the harness catch real bugs?

Each mutant of the catalogue (verification/investigating/mutants.py) is a small source patch of
kda_kernels/triton/, anchored on a ``# mutant-anchor: NAME`` marker and applied to the marked
statement's syntax tree.  A mutant runs in a child process of its own (``python -m
verification.investigating.mutate --child SPEC OUT``), on a patched copy of the package imported under
another name (``kda_mutant_<name>.triton``), so the shipped package is never touched, two
mutants never meet, and a mutant that kills its process is recorded as crashed.

In the child, for each of the mutant's routes and each case of the suites (case order of
the suites), one cell is run and judged exactly as ``kda-verify run`` judges it
(``verification.running.run_cell.run_cell`` with tolerances.yaml).  The first failing cell is a kill
only when the shipped kernel passes that same cell (run once to confirm); a kernel that
raises counts as killed (crashed).  On the killing case the per-pass debugger
(``verification.investigating.debug.debug_passes``) runs the mutant's route; the mutant is *localized* when
the first pass over its row thresholds is the pass the mutant patched.

    outcome     killed | crashed | survived | equivalent (survived, marked so in the catalogue)
                | wrongly-equivalent (marked equivalent, but killed)
"""
from __future__ import annotations

import argparse
import ast
import copy
import fnmatch
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback
from pathlib import Path
from typing import Optional

import kda_kernels
from verification.investigating.debug import debug_passes
from verification.investigating.mutants import AFTER, WHOLE, Mutant
from verification.judging.baselines import BaselineCache
from verification.judging.policy import FAILING
from verification.judging.record import encode
from verification.judging.tolerances import load_tolerances
from verification.running.cases import get_suite
from verification.running.run_cell import TruthCache, run_cell
from verification.running.run_select import as_loaded

STDERR_TAIL = 3000
CHILD_TIMEOUT_S = 900


class AnchorError(ValueError):
    """A mutant's anchor is missing from (or not unique in) the package, or its ``find`` is not
    exactly once in the anchored statement: the catalogue has rotted."""


ANCHOR_RE = re.compile(r"#.*?\bmutant-anchor:\s*([A-Za-z0-9_.-]+)")



_PARSE_LOCK = threading.Lock()


def _parse(source: str, mode: str = "exec") -> ast.AST:
    """ast.parse, one thread at a time: ``mutate --jobs N`` prepares mutants in N threads, and
    CPython 3.11's parser is not safe to run in two at once (a CI run raised "SystemError: AST
    constructor recursion depth mismatch" from two concurrent parses)."""
    with _PARSE_LOCK:
        return ast.parse(source, mode=mode)

def kernel_dir() -> Path:
    """kda_kernels/triton/ of the installed (shipped) package, found without importing it."""
    return Path(kda_kernels.__file__).resolve().parent / "triton"


def package_name(mutant: Mutant) -> str:
    return "kda_mutant_" + re.sub(r"[^0-9a-zA-Z_]", "_", mutant.name)


def _sources(src_dir: Path) -> dict:
    return {p.name: p.read_text() for p in sorted(Path(src_dir).glob("*.py"))}


def anchor_sites(name: str, texts: dict) -> list:
    """(file, line) of every ``# mutant-anchor: name`` marker in ``texts`` (file -> source)."""
    return [(f, i) for f, text in texts.items() for i, ln in enumerate(text.splitlines(), 1)
            if (m := ANCHOR_RE.search(ln)) and m.group(1) == name]


def _site(mutant: Mutant, anchor: str, texts: dict) -> tuple:
    sites = anchor_sites(anchor, texts)
    if len(sites) != 1:
        raise AnchorError(f"mutant {mutant.name}: anchor: expected '# mutant-anchor: {anchor}' exactly once in "
                          f"kda_kernels/triton/, got {len(sites)} occurrence(s)")
    return sites[0]


def _statements(body):
    """Every statement of a block, nested blocks included (without walking the expressions)."""
    for n in body:
        yield n
        for field_ in ("body", "orelse", "finalbody", "handlers"):
            sub = getattr(n, field_, None)
            if isinstance(sub, list):
                yield from _statements(sub)


def _statement(mutant: Mutant, anchor: str, file: str, text: str, line: int):
    """The statement the marker on ``line`` names: the one starting on that line (the outermost),
    or, for a marker on a comment line of its own, the statement on the next line of code."""
    lines = text.splitlines()
    tree = _parse(text)
    stmts = list(_statements(tree.body))
    target = line
    if lines[line - 1].lstrip().startswith("#"):
        target = next((i for i in range(line + 1, len(lines) + 1)
                       if lines[i - 1].strip() and not lines[i - 1].lstrip().startswith("#")), None)
    here = [n for n in stmts if n.lineno == target]
    if not here:
        raise AnchorError(f"mutant {mutant.name}: anchor: expected '# mutant-anchor: {anchor}' on the first line of "
                          f"a statement or on a comment line above it, got kda_kernels/triton/{file}:{line}")
    return max(here, key=lambda n: n.end_lineno), lines


def _expr(mutant: Mutant, src: str) -> ast.expr:
    try:
        return _parse(src.strip(), mode="eval").body
    except SyntaxError as e:
        raise AnchorError(f"mutant {mutant.name}: edit: expected an expression, got {src!r} ({e.msg})") from None


def _apply_edit(mutant: Mutant, edit: tuple, texts: dict) -> None:
    anchor, find, replace = edit
    file, line = _site(mutant, anchor, texts)
    stmt, lines = _statement(mutant, anchor, file, texts[file], line)
    indent = lines[stmt.lineno - 1][:len(lines[stmt.lineno - 1]) - len(lines[stmt.lineno - 1].lstrip())]
    start, end = stmt.lineno - 1, stmt.end_lineno           # the statement's lines, [start, end)
    keep_marker = [f"{indent}# mutant-anchor: {anchor}"] if start < line <= end else []
    if find == AFTER:
        new = lines[start:end] + [indent + ln for ln in textwrap.dedent(replace).splitlines()]
        keep_marker = []
    elif find is WHOLE:
        new = [indent + ln for ln in textwrap.dedent(replace).splitlines()] or [indent + "pass"]
    else:
        want, repl = ast.dump(_expr(mutant, find)), _expr(mutant, replace)
        hits = [0]

        class Swap(ast.NodeTransformer):
            def visit(self, node):
                if isinstance(node, ast.expr) and ast.dump(node) == want:
                    hits[0] += 1
                    return copy.deepcopy(repl)
                return self.generic_visit(node)

        swapped = Swap().visit(copy.deepcopy(stmt))
        if hits[0] != 1:
            raise AnchorError(f"mutant {mutant.name}: anchor {anchor}: expected {find!r} exactly once in the statement "
                              f"at kda_kernels/triton/{file}:{stmt.lineno}, got {hits[0]} occurrence(s)")
        if ast.dump(swapped) == ast.dump(stmt):
            raise AnchorError(f"mutant {mutant.name}: anchor {anchor}: replacing {find!r} by {replace!r} "
                              f"changes nothing")
        new = [indent + ln for ln in ast.unparse(ast.fix_missing_locations(swapped)).splitlines()]
    texts[file] = "\n".join(lines[:start] + keep_marker + new + lines[end:]) + "\n"


def mutant_files(mutant: Mutant, src_dir: Optional[Path] = None) -> list:
    """The files of kda_kernels/triton/ the mutant's anchors are in (first anchor's first)."""
    texts = _sources(Path(src_dir) if src_dir is not None else kernel_dir())
    return list(dict.fromkeys(_site(mutant, e[0], texts)[0] for e in mutant.edits))


def mutant_file(mutant: Mutant, src_dir: Optional[Path] = None) -> str:
    """The file of kda_kernels/triton/ that holds the mutant's first anchor."""
    return mutant_files(mutant, src_dir)[0]


def patched_sources(mutant: Mutant, src_dir: Optional[Path] = None) -> dict:
    """{file: patched text} for the files the mutant edits, every edit applied in order;
    AnchorError unless each anchor is found exactly once, each ``find`` occurs exactly once in
    its statement (and changes its syntax tree), and each patched file parses."""
    src_dir = Path(src_dir) if src_dir is not None else kernel_dir()
    original = _sources(src_dir)
    if not original:
        raise AnchorError(f"mutant {mutant.name}: expected the sources of kda_kernels/triton/ in {src_dir}, got none")
    texts = dict(original)
    for edit in mutant.edits:
        _apply_edit(mutant, tuple(edit), texts)
    changed = {f: t for f, t in texts.items() if t != original[f]}
    for f, t in changed.items():
        try:
            _parse(t)
        except SyntaxError as e:
            raise AnchorError(f"mutant {mutant.name}: patched kda_kernels/triton/{f} does not parse: {e.msg} "
                              f"(line {e.lineno})") from None
    if not changed:
        raise AnchorError(f"mutant {mutant.name}: patch changes no file")
    return changed


def patched_source(mutant: Mutant, src_dir: Optional[Path] = None) -> str:
    """The patched text of the mutant's file (its first anchor's)."""
    return patched_sources(mutant, src_dir)[mutant_file(mutant, src_dir)]


def check_anchors(mutants) -> None:
    """Raise AnchorError for the first mutant whose patch cannot be applied."""
    for m in mutants:
        patched_sources(m)


def materialize(mutant: Mutant, root: Path, src_dir: Optional[Path] = None) -> str:
    """Write the patched copy as package ``kda_mutant_<name>`` (with ``.triton`` inside) under
    ``root``; its ``base`` module is kda_kernels.base itself.  Returns the package name."""
    src_dir = Path(src_dir) if src_dir is not None else kernel_dir()
    texts = patched_sources(mutant, src_dir)
    pkg = Path(root) / package_name(mutant)
    shutil.copytree(src_dir, pkg / "triton", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for f, text in texts.items():
        (pkg / "triton" / f).write_text(text)
    (pkg / "__init__.py").write_text('"""A mutant of kda_kernels (kda-verify mutate)."""\n')
    (pkg / "base.py").write_text("import sys\n\nimport kda_kernels.base as _base\n\nsys.modules[__name__] = _base\n")
    return pkg.name


def load_mutant_backend(mutant: Mutant, root: Path, taps: bool = True):
    """Materialize the mutant under ``root``, import it, and return its TritonBackend."""
    name = materialize(mutant, root)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    mod = importlib.import_module(f"{name}.triton.backend")
    if not Path(mod.__file__).resolve().is_relative_to(Path(root).resolve()):
        raise RuntimeError(f"mutant {mutant.name}: imported {mod.__file__}, not the patched copy under {root}")
    return mod.TritonBackend(taps=taps)


# ------------------------------------------------------------------------------------ child
def _cases(suites, long: bool, case_globs=None):
    out = []
    for s in suites:
        out.extend(get_suite(s, long=long))
    if case_globs:
        out = [c for c in out if any(fnmatch.fnmatchcase(c.id, g) for g in case_globs)]
    return out


def _failing_tensor(rec: dict) -> str:
    """'o tail_rel_l2 (margin 12.3)' for the worst tensor of a failing record."""
    worst = None
    for name, t in (rec.get("tensors") or {}).items():
        if not isinstance(t, dict):
            continue
        m = t.get("margin")
        try:
            m = float(m)
        except (TypeError, ValueError):
            m = float("nan")
        key = float("inf") if m != m else m
        if worst is None or key > worst[0]:
            worst = (key, name, t.get("metric"), m)
    if worst is None:
        return ""
    return f"{worst[1]} {worst[2]} (margin {worst[3]:.3g})"


def run_mutant(mutant: Mutant, suites=("smoke", "stress"), long: bool = False, device: str = "cpu",
               case_globs=None, taps: bool = True, workdir: Optional[Path] = None) -> dict:
    """Run one mutant over the suites (in this process; the interpreter, on the CPU, must be
    on before this is called).  Returns its record (see the module docstring)."""
    # lazy: kda_kernels.triton builds its kernels at import (docs/design.md, Imports)
    from kda_kernels.triton.backend import TritonBackend

    t_start = time.perf_counter()
    rec = dict(mutant=mutant.name, pass_name=mutant.pass_name, file=mutant_file(mutant), what=mutant.what,
               equivalent=mutant.equivalent, gap=mutant.gap, routes=list(mutant.routes), outcome=None, killed=False,
               crashed=False, route=None, case=None, status=None, reason="", metric="", cells=0,
               confirmed_by_original=None, original_failed=[], localized=None, debug_first_pass=None,
               debug_where=None, debug_control_flagged=None, debug_error=None)
    db = load_tolerances()
    truths, baselines = TruthCache(device=device), BaselineCache()
    own = Path(workdir or tempfile.mkdtemp(prefix="kda-mutant-"))
    mut = as_loaded(load_mutant_backend(mutant, own, taps=taps))
    orig = as_loaded(TritonBackend(taps=taps))
    cases = _cases(suites, long, case_globs)
    kill = None
    for case in cases:                       # case-major: each truth computed once
        for rname in mutant.routes:
            route = mut.backend.route(rname)
            r = run_cell(mut, route, case, truths, baselines, db, device=device)
            rec["cells"] += 1
            if r["status"] not in FAILING:
                continue
            o = run_cell(orig, orig.backend.route(rname), case, truths, baselines, db, device=device)
            if o["status"] != "pass":
                rec["original_failed"].append(f"{rname} {case.id}: {o['status']}")
                continue
            kill = (route, case, r)
            break
        if kill:
            break
    if kill is not None:
        route, case, r = kill
        crashed = r["status"] in ("error", "crashed")
        rec.update(killed=True, crashed=crashed, route=route.name, case=case.id, status=r["status"],
                   reason=r["reason"][:400], metric="crash" if crashed else _failing_tensor(r),
                   confirmed_by_original=True)
        try:
            problem = truths.problem(case)
            reports = debug_passes(mut.backend, problem, route)
            flagged = [p for p in reports if not p.skipped and not p.ok]
            if flagged:
                first = flagged[0]
                rec["debug_first_pass"] = first.name
                bad = [t for t in first.tensors if not t.ok]
                if bad:
                    t = bad[0]
                    rec["debug_where"] = f"{t.name} {t.first_over or t.rule_failed}"
            rec["localized"] = rec["debug_first_pass"] == mutant.pass_name
            if not rec["localized"]:    # what the debugger says of the shipped kernel on the same cell
                control = debug_passes(orig.backend, problem, orig.backend.route(route.name))
                rec["debug_control_flagged"] = [p.name for p in control if not p.skipped and not p.ok]
        except Exception as e:  # noqa: BLE001 - a mutant that breaks the debugger is recorded, not fatal
            rec["debug_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            rec["localized"] = False
    rec["outcome"] = outcome_of(rec)
    rec["seconds"] = round(time.perf_counter() - t_start, 2)
    return rec


def outcome_of(rec: dict) -> str:
    if rec.get("killed"):
        if rec.get("equivalent"):
            return "wrongly-equivalent"
        return "crashed" if rec.get("crashed") else "killed"
    return "equivalent" if rec.get("equivalent") else "survived"


def _child_main(spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    mutant = Mutant.from_dict(spec["mutant"])
    rec = run_mutant(mutant, suites=spec["suites"], long=spec["long"], device=spec["device"],
                     case_globs=spec.get("cases"), taps=spec.get("taps", True), workdir=Path(spec["workdir"]))
    Path(out_path).write_text(json.dumps(encode(rec), allow_nan=False))
    return 0


# ------------------------------------------------------------------------------------ parent
def run_in_child(mutant: Mutant, suites, long: bool, device: str, case_globs=None, taps: bool = True,
                 timeout_s: float = CHILD_TIMEOUT_S) -> dict:
    """Run one mutant in a child process (TRITON_INTERPRET=1 on the CPU); a child that dies or
    times out is recorded as killed (crashed) with its stderr tail, without a debugger run."""
    patched_source(mutant)               # fail loudly here, before a child is started
    with tempfile.TemporaryDirectory(prefix="kda-mutant-") as tmp:
        tmp = Path(tmp)
        spec = dict(mutant=mutant.to_dict(), suites=list(suites), long=bool(long), device=device,
                    cases=list(case_globs or []), taps=bool(taps), workdir=str(tmp / "pkg"))
        (tmp / "pkg").mkdir()
        (tmp / "spec.json").write_text(json.dumps(spec))
        out = tmp / "record.json"
        env = dict(os.environ)
        if device == "cpu":
            env["TRITON_INTERPRET"] = "1"
        else:
            env.pop("TRITON_INTERPRET", None)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-m", "verification.investigating.mutate", "--child", str(tmp / "spec.json"),
                                   str(out)], env=env, capture_output=True, text=True, timeout=timeout_s)
            rc, err = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, err = None, (e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or ""))
        if rc == 0 and out.is_file():
            return json.loads(out.read_text())
        if rc is not None and "AnchorError" in (err or ""):
            raise AnchorError(err.strip().splitlines()[-1])
        why = f"timed out after {timeout_s:.0f} s" if rc is None else f"child exited with status {rc}"
        rec = dict(mutant=mutant.name, pass_name=mutant.pass_name, file=mutant_file(mutant), what=mutant.what,
                   equivalent=mutant.equivalent, gap=mutant.gap, routes=list(mutant.routes), killed=True, crashed=True,
                   route=None, case=None, status="crashed", reason=why, metric="crash", cells=None,
                   localized=False, debug_first_pass=None, debug_where=None,
                   debug_error="not run: the mutant's process died", stderr_tail=(err or "")[-STDERR_TAIL:],
                   seconds=round(time.perf_counter() - t0, 2))
        rec["outcome"] = outcome_of(rec)
        return rec


def needs_attention(rec: dict) -> bool:
    """A survivor not marked equivalent, or a mutant marked equivalent that was killed."""
    return rec["outcome"] in ("survived", "wrongly-equivalent")


def format_table(records: list) -> str:
    head = f"{'mutant':<38} {'pass':<4} {'outcome':<18} {'by (metric, route, case)':<70} {'localized':<34} {'s':>6}"
    lines = [head, "-" * len(head)]
    for r in records:
        if r.get("killed"):
            by = f"{r.get('metric') or '-'}; {r.get('route') or '-'}; {r.get('case') or '-'}"
            shipped = r.get("debug_control_flagged")
            loc = ("yes" if r.get("localized") else
                   f"no ({r.get('debug_first_pass') or r.get('debug_error') or 'none flagged'}"
                   + (f"; shipped: {','.join(shipped) or 'clean'}" if shipped is not None else "") + ")")
        else:
            by = f"no failing cell in {r.get('cells')} cells"
            loc = "-"
        lines.append(f"{r['mutant']:<38} {r['pass_name']:<4} {r['outcome']:<18} {by[:70]:<70} {loc[:34]:<34} "
                     f"{r.get('seconds', 0):>6.1f}")
    n = len(records)
    killed = sum(r.get("killed", False) for r in records)
    loc = sum(bool(r.get("localized")) for r in records)
    eq = sum(r["outcome"] == "equivalent" for r in records)
    surv = [r["mutant"] for r in records if r["outcome"] == "survived"]
    wrong = [r["mutant"] for r in records if r["outcome"] == "wrongly-equivalent"]
    lines.append(f"{killed}/{n} killed ({loc} localized), {eq} equivalent (expected survivors), "
                 f"{len(surv)} survived" + (f": {', '.join(surv)}" if surv else "")
                 + (f"; marked equivalent but killed: {', '.join(wrong)}" if wrong else ""))
    for r in records:
        if r["outcome"] in ("survived", "equivalent") and (r.get("gap") or r.get("equivalent")):
            why = f"gap: {r['gap']}" if r["outcome"] == "survived" and r.get("gap") else f"equivalent: {r['equivalent']}"
            lines.append(f"  {r['mutant']}: {why}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m verification.investigating.mutate")
    ap.add_argument("--child", nargs=2, metavar=("SPEC", "OUT"), required=True)
    args = ap.parse_args(argv)
    return _child_main(*args.child)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # noqa: BLE001 - the parent reads the traceback from stderr
        traceback.print_exc()
        sys.exit(3)
