#!/usr/bin/env python3
"""Run aiter's Triton FlashKDA from an aiter tree in Triton's CPU interpreter, through the
``aiter`` adapter, on named cases, and judge each cell as ``pytest -m verify`` would (the
float64 oracle, the flashkda recipe's baseline, tolerances.yaml, its known failures).

For an engineer without a GPU (or without an AMD one): what aiter's Triton route computes, on
small cases, with the project's verdict.  Slow (the interpreter): cases of a few hundred tokens.

    python tools/aiter_interpret.py [--tree DIR] --case ID[,ID...] [--routes R[,R...]] [--json FILE]

DIR holds aiter/ (default .vendor/aiter-newest, built by tools/assemble_aiter.py).  The import
gets what a machine without an AMD GPU lacks: a stand-in ``arch_info`` (gfx942: no Gluon), a
stand-in driver answering the target for the import, ``fast_launch`` as a pass-through wrapper
(the real one needs compiled kernels), 256 CUs for aiter's segment and scan heuristics, and the
project's interpreter fixes (kda_kernels.triton._interpreter_compat).  Exit 0 when every cell
passes or is a known failure, 1 otherwise, 2 on bad input (one line).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLASH_KDA = "aiter.ops.triton._triton_kernels.chunk_delta_attn.flash_kda"
FAST_LAUNCH = "aiter.ops.triton._triton_kernels.chunk_delta_attn.fast_launch"
ARCH_INFO = "aiter.ops.triton.utils._triton.arch_info"


def fail(msg: str):
    print(f"aiter_interpret: {msg}", file=sys.stderr)
    sys.exit(2)


def load(tree: Path):
    os.environ.update(TRITON_INTERPRET="1", AITER_TRITON_ONLY="1")
    if "triton" in sys.modules:
        fail("TRITON_INTERPRET: Triton was imported before the interpreter was switched on; run this as a script")
    sys.path.insert(0, str(ROOT))
    import torch
    from triton.runtime.driver import driver

    from kda_kernels.triton._interpreter_compat import install
    install()
    arch = types.ModuleType(ARCH_INFO)
    arch.get_arch = lambda: "gfx942"
    for name in ("is_gluon_avail", "is_fp4_avail", "is_mx_scale_preshuffling_avail", "is_tdm_avail"):
        setattr(arch, name, lambda: False)
    arch.is_fp8_avail = lambda: True
    arch._LDS_CAP_BYTES = {"gfx942": 65536}

    class PassThrough:
        def __init__(self, kernel):
            self._kernel = kernel

        def __getitem__(self, grid):
            return self._kernel[grid]

    fl = types.ModuleType(FAST_LAUNCH)
    fl.fast_launch = lambda kernel, use_intj=False: PassThrough(kernel)

    class Target:
        def get_current_target(self):
            from triton.backends.compiler import GPUTarget
            return GPUTarget("hip", "gfx942", 64)

        def get_current_device(self):
            return 0

    def no_device(*a, **k):
        raise RuntimeError("no GPU")

    sys.path.insert(0, str(tree))
    sys.modules[ARCH_INFO], sys.modules[FAST_LAUNCH] = arch, fl
    saved = torch.cuda.get_device_properties, driver._active
    torch.cuda.get_device_properties, driver._active = no_device, Target()
    try:
        import importlib
        mod = importlib.import_module(FLASH_KDA)
    finally:
        torch.cuda.get_device_properties, driver._active = saved
    mod.__aiter_layout__ = "chunk_delta_attn"
    if hasattr(mod, "_num_cus"):
        mod._num_cus = lambda device_index=0: 256
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", type=Path, default=ROOT / ".vendor" / "aiter-newest")
    ap.add_argument("--case", required=True, help="comma-separated case ids (kda-verify's suites)")
    ap.add_argument("--routes", default="triton:unseg,triton:seg:cps=1")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the cells as JSON")
    a = ap.parse_args(argv)
    if not (a.tree / "aiter").is_dir():
        fail(f"--tree: expected a directory holding aiter/, got {a.tree}")
    mod = load(a.tree)

    import warnings

    from kda_kernels.aiter import AiterBackend, parse_route
    from kda_kernels.base import Route
    from kda_kernels.emulator import RECIPES
    from kda_ref.truth import truth
    from verification.cases import get_case
    from verification.runner import apply_known_failure
    from verification.tolerances import load_tolerances
    from verification.verdict import baseline_metrics, judge
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
    b = AiterBackend(module=mod)
    print(f"aiter: {b.version()} from {a.tree}", flush=True)
    cells, bad = [], 0
    for case in cases:
        p = case.build("cpu")
        tr = truth(p)
        base = baseline_metrics(p, "flashkda", tr)
        recipes = {"flashkda": base}

        def recipe_baselines():
            for r in RECIPES:
                if r not in recipes:
                    recipes[r] = baseline_metrics(p, r, tr)
            return recipes
        for rname in routes:
            route = Route(rname, recipe="flashkda")
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
                apply_known_failure(rec, db)
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
