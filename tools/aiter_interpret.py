#!/usr/bin/env python3
"""Run aiter's Triton KDA kernels from an aiter tree in Triton's CPU interpreter, through the
``aiter`` adapter, on named cases, and judge each cell as ``pytest -m verify`` would (the
float64 oracle, the route's recipe baseline, tolerances.yaml, its known failures).

For an engineer without a GPU (or without an AMD one): what aiter's Triton routes compute, on
small cases, with the project's verdict.  Slow (the interpreter): cases of a few hundred tokens.

    python tools/aiter_interpret.py [--tree DIR] --case ID[,ID...] [--routes R[,R...]] [--json FILE]

DIR holds aiter/ (default .vendor/aiter-newest, built by tools/assemble_aiter.py; an upstream
tree with the kimi_delta_attn layout and attention/chunk_kda.py works the same way, and then
the chunk_kda routes run too: chunk_kda:triton is its Triton fallback, which it takes on the
stand-in arch).  The import gets what a machine without an AMD GPU lacks: a stand-in
``arch_info`` (gfx942: no Gluon) and, for the import, a driver answering the target
(verification.investigating.aiter_isa's, the ones ``kda-verify isa --backend aiter`` imports aiter with),
``fast_launch`` as a pass-through wrapper (the real one needs compiled kernels), 256 CUs for
aiter's segment and scan heuristics, and the project's interpreter fixes
(kda_kernels.triton._interpreter_compat).  Exit 0 when every cell passes or is a known failure,
1 otherwise, 2 on bad input (one line).

``loaded`` is also the interpreter tests' loader (tests/test_aiter_passes.py,
tests/test_aiter_newest.py, tests/test_aiter_upstream.py, tests/test_trace_flashkda.py).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_TK = "aiter.ops.triton._triton_kernels."
# layout -> the flash_kda module (the renamed upstream one first, as kda_kernels.aiter tries them)
FLASH_KDA = {"kimi_delta_attn": _TK + "kimi_delta_attn.flash_kda",
             "chunk_delta_attn": _TK + "chunk_delta_attn.flash_kda"}
FAST_LAUNCH = (_TK + "chunk_delta_attn.fast_launch", _TK + "kimi_delta_attn.fast_launch")
STAND_IN_ARCH = "gfx942"


class NotInterpreted(RuntimeError):
    """Triton was imported in this process before TRITON_INTERPRET=1: its own functions are
    compiled ones, so aiter's kernels cannot run in the interpreter here."""


def fail(msg: str):
    print(f"aiter_interpret: {msg}", file=sys.stderr)
    sys.exit(2)


def tree_layout(tree: Path) -> str:
    """'kimi_delta_attn' when the tree has upstream's renamed FlashKDA, else 'chunk_delta_attn'."""
    renamed = tree / "aiter/ops/triton/_triton_kernels/kimi_delta_attn/flash_kda.py"
    return "kimi_delta_attn" if renamed.is_file() else "chunk_delta_attn"


class PassThrough:
    """What fast_launch returns, without compiling: another object (holding the kernel as
    ``_kernel``, as aiter's does) whose [grid] launches the kernel."""

    def __init__(self, kernel):
        self._kernel = kernel

    def __getitem__(self, grid):
        return self._kernel[grid]


def _stand_ins() -> dict:
    """{module name: stand-in}: aiter_isa's arch_info answering STAND_IN_ARCH, and a fast_launch
    module per layout returning PassThrough."""
    from verification.investigating.aiter_isa import ARCH_INFO, arch_stand_in
    mods = {ARCH_INFO: arch_stand_in(STAND_IN_ARCH)}
    for path in FAST_LAUNCH:
        fl = types.ModuleType(path)
        fl.fast_launch = lambda kernel, use_intj=False: PassThrough(kernel)
        mods[path] = fl
    return mods


@contextlib.contextmanager
def loaded(tree: Path):
    """Import aiter's modules from ``tree`` under Triton's interpreter with the stand-ins above;
    yields dict(layout, flash_kda, chunk_kda, chunk_fwd, chunk_kda_why) (chunk_kda None with the
    reason where the tree has none).  Everything is put back afterwards: sys.path, the aiter
    modules, the environment.  Triton must not have been imported before TRITON_INTERPRET=1
    (NotInterpreted, before anything of aiter is imported)."""
    saved_env = {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "AITER_TRITON_ONLY")}
    saved_modules = set(sys.modules)
    os.environ.update(TRITON_INTERPRET="1", AITER_TRITON_ONLY="1")
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(tree))
    try:
        import triton.language as tl
        if type(tl.standard.sum).__name__ != "InterpretedFunction":
            raise NotInterpreted("Triton was imported in this process before TRITON_INTERPRET=1 was set, so its "
                                 "own functions are compiled ones; run this in a fresh process")

        from kda_kernels.triton._interpreter_compat import install
        from verification.investigating.aiter_isa import cpu_import
        install()
        sys.modules.update(_stand_ins())
        layout = tree_layout(tree)
        with cpu_import(STAND_IN_ARCH):
            mod = importlib.import_module(FLASH_KDA[layout])
            ck = fwd = None
            why = "the tree has no aiter/ops/triton/attention/chunk_kda.py"
            if (tree / "aiter/ops/triton/attention/chunk_kda.py").is_file():
                from kda_kernels.aiter import CHUNK_FWD, CHUNK_KDA
                try:
                    ck, why = importlib.import_module(CHUNK_KDA), ""
                except Exception as e:  # noqa: BLE001 - reported as the chunk_kda routes' reason
                    why = f"{CHUNK_KDA}: {type(e).__name__}: {e}"
                try:   # what its Triton fallback imports; without it the fallback route says so
                    importlib.import_module("aiter.ops.triton.kimi_delta_attn")
                    fwd = importlib.import_module(CHUNK_FWD)
                except Exception:  # noqa: BLE001
                    fwd = None
        mod.__aiter_layout__ = layout
        if hasattr(mod, "_num_cus"):
            mod._num_cus = lambda device_index=0: 256
        yield dict(layout=layout, flash_kda=mod, chunk_kda=ck, chunk_fwd=fwd, chunk_kda_why=why)
    finally:
        for p in (str(tree), str(ROOT)):
            if p in sys.path:
                sys.path.remove(p)
        for name in set(sys.modules) - saved_modules:
            if name in ("aiter", "intj") or name.startswith(("aiter.", "intj.")):
                del sys.modules[name]
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def backend_of(mods: dict):
    """The aiter adapter over the modules ``loaded`` yields."""
    from kda_kernels.aiter import AiterBackend
    if mods["chunk_kda"] is None:
        return AiterBackend(module=mods["flash_kda"], chunk_kda_why=mods["chunk_kda_why"])
    return AiterBackend(module=mods["flash_kda"], chunk_kda=mods["chunk_kda"], chunk_fwd=mods["chunk_fwd"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", type=Path, default=ROOT / ".vendor" / "aiter-newest")
    ap.add_argument("--case", required=True, help="comma-separated case ids (kda-verify's suites)")
    ap.add_argument("--routes", default="triton:unseg,triton:seg:cps=1")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the cells as JSON")
    a = ap.parse_args(argv)
    if not (a.tree / "aiter").is_dir():
        fail(f"--tree: expected a directory holding aiter/, got {a.tree}")
    if "triton" in sys.modules:
        fail("TRITON_INTERPRET: Triton was imported before the interpreter was switched on; run this as a script")
    with loaded(a.tree) as mods:
        return _run(a, mods)


def _run(a, mods) -> int:
    import warnings

    from kda_kernels.aiter import parse_route
    from kda_kernels.base import Route
    from kda_kernels.emulator import RECIPES
    from kda_ref.truth import truth
    from verification.running.cases import get_case
    from verification.judging.record import Record
    from verification.running.run_cell import apply_known_failure
    from verification.judging.tolerances import load_tolerances
    from verification.judging.baselines import baseline_metrics
    from verification.judging.verdict import judge
    warnings.filterwarnings("ignore", category=RuntimeWarning)

    routes = [r.strip() for r in a.routes.split(",") if r.strip()]
    for r in routes:
        try:
            parse_route(r)
        except ValueError as e:
            fail(str(e))
    cases = []
    for cid in [c.strip() for c in a.case.split(",") if c.strip()]:
        try:
            cases.append(get_case(cid))
        except Exception as e:  # noqa: BLE001 - the case lookup's own message
            fail(f"--case: {e}")
    try:
        db = load_tolerances(None)
    except Exception as e:  # noqa: BLE001 - the tolerance file's own one-line message
        fail(f"tolerances: {e}")
    b = backend_of(mods)
    by_name = {r.name: r for r in b.routes()}
    print(f"aiter: {b.version()} from {a.tree}", flush=True)
    if mods["chunk_kda_why"]:
        print(f"chunk_kda: {mods['chunk_kda_why']}", flush=True)
    cells, bad = [], 0
    for case in cases:
        p = case.build("cpu")
        tr = truth(p)
        recipes = {}

        def recipe_baselines():
            for r in RECIPES:
                if r not in recipes:
                    recipes[r] = baseline_metrics(p, r, tr)
            return recipes
        for rname in routes:
            route = by_name.get(rname) or Route(rname, recipe="flashkda")   # e.g. seg:cps=N not listed
            if route.recipe not in recipes:
                recipes[route.recipe] = baseline_metrics(p, route.recipe, tr)
            base = recipes[route.recipe]
            t0 = time.perf_counter()
            ok, why = b.accepts(p, route)
            if not ok:
                rec = dict(case=case.id, route=rname, status="not-applicable", reason=why)
            else:
                try:
                    out = b.run(p, route)
                    v = judge("aiter", route, p, out, tr, base, db, recipe_baselines=recipe_baselines)
                    rec = dict(case=case.id, route=rname, status=v.status, reason=v.reason,
                               ran=out.info.get("route_ran"))
                except Exception as e:  # noqa: BLE001 - a raising cell is a failure with its message
                    rec = dict(case=case.id, route=rname, status="error", reason=f"{type(e).__name__}: {e}"[:300])
                rec.update(backend="aiter", params=dict(case.params))
                rec = apply_known_failure(Record.from_dict(rec), db).to_dict()
            rec["seconds"] = round(time.perf_counter() - t0, 1)
            if rec["status"] in ("fail", "error", "mistrusted"):
                bad += 1
            cells.append(rec)
            kf = " (known failure, tolerances.yaml line %d)" % rec["known_failure"]["line"] if rec.get("known_failure") else ""
            print(f"{rec['status']:15} {rname:18} {case.id:40} {rec['reason'][:150]}{kf}", flush=True)
    counts = {}
    for c in cells:
        counts[c["status"]] = counts.get(c["status"], 0) + 1
    print("counts:", ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if a.json:
        Path(a.json).write_text(json.dumps(dict(tree=str(a.tree), version=b.version(), cells=cells), indent=1,
                                           default=str))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
