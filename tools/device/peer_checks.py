"""Hidden-bug controls and invariances of one backend's routes, as JSON lines.

    python3 tools/device/peer_checks.py --backend cudnn --device cuda [--route R] [--what controls,invariances]
        [--out FILE.jsonl]

controls: each in-recipe hidden-bug control of kda_kernels/controls.py (NEGATIVE_CONTROLS: the route's own
recipe with one slip, ``run_in_recipe``) judged as the route on a case the route accepts, and the route's
kernel on the same case: a control is *caught* when its verdict fails; the row also holds the kernel's own
status there (the control shows something only where the kernel passes) and whether the slip changes
anything in that recipe (inv_bf16 changes nothing in a recipe that already stores its inverse bf16).
invariances: verification/investigating/invariance.py's checks on the shapes of tests/test_invariance_gpu.py (paged
left out where the route refuses it), each with its kind (bitwise or tolerance), ok, diff and why.

One line per result: {"backend", "route", "what", "name", ...}; a check that raises is a line with
"error".  Exit 0 when every line was written (whatever the results), 2 on bad input (one line).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# control -> cases to try, first accepted wins (tests/test_references.py's cases, then bf16 / lb -5 ones
# a bf16-only kernel takes)
CONTROL_CASES = {
    "carry_scaled": ("stress/weak-gate-lb-1", "smoke/weak-gate-lb-0.1-vk"),
    "wrong_L_sign": ("stress/weak-gate-lb-1", "smoke/dense-T64-lb-5"),
    "inv_bf16": ("stress/weak-gate-lb-1", "smoke/correlated-weak-lb-0.01"),
    "tail_not_zeroed": ("stress/tail17-lb-1", "smoke/varlen-tail33-lb-5"),
    "state_transposed": ("stress/weak-gate-lb-1", "smoke/initial-state-kv-lb-5"),
    "decay_after_update": ("stress/weak-gate-lb-1", "smoke/weak-gate-lb-0.1-vk"),
    "mqk_no_diag": ("stress/weak-gate-lb-1", "smoke/dense-T64-lb-5"),
}
SHAPES = {      # tests/test_invariance_gpu.py's, and a paged one
    "varlen": dict(lens=[1, 300, 33, 1100], H=4, state="kv"),
    "batch": dict(B=3, T=700, H=4, state="vk"),
    "one": dict(B=1, T=2048, H=8, state="kv"),
    "paged": dict(lens=[40, 300, 77], H=4, paged=True),
}


def controls(b, route, device):
    import torch
    from kda_kernels.controls import NEGATIVE_CONTROLS, run_in_recipe
    from kda_kernels.emulator import emulate
    from kda_ref.truth import truth
    from verification.running.cases import get_case
    from verification.judging.tolerances import load_tolerances
    from verification.judging.baselines import baseline_metrics
    from verification.judging.verdict import judge
    db = load_tolerances()
    for name in NEGATIVE_CONTROLS:
        row = {"what": "control", "name": name}
        t0 = time.time()
        try:
            p = cid = None
            for c in CONTROL_CASES.get(name, ("smoke/dense-T64-lb-5",)):
                q = get_case(c).build(device=device)
                if b.accepts(q, route)[0]:
                    p, cid = q, c
                    break
            if p is None:
                row["status"] = "not applicable: the route accepts none of " + ", ".join(CONTROL_CASES[name])
                yield row
                continue
            tr = truth(p)
            base = baseline_metrics(p, route.recipe, tr)
            bad_out = run_in_recipe(p, name, recipe=route.recipe)
            own = emulate(p, route.recipe)
            same = all(torch.equal(x, y) for x, y in zip(bad_out.tensors().values(), own.tensors().values()))
            bad = judge(b.name, route, p, bad_out, tr, base, db)
            good = judge(b.name, route, p, b.run(p, route), tr, base, db)
            failing = sorted(t for t, rec in bad.tensors.items() if not rec["margin"] <= 1)
            row.update(case=cid, caught=bad.status == "fail", control_status=bad.status, failing=failing,
                       changes_recipe=not same, kernel_status=good.status, kernel_reason=good.reason[:300],
                       control_reason=bad.reason[:300])
        except Exception as e:  # noqa: BLE001 - a row says what raised; the next control still runs
            row["error"] = f"{type(e).__name__}: {e}"[:400]
            row["trace"] = traceback.format_exc()[-1200:]
        row["seconds"] = round(time.time() - t0, 2)
        yield row


def invariances(b, route, device):
    from verification.investigating import invariance as inv
    from verification.running.cases import build_problem
    pr = {n: build_problem(params, seed, device=device) for seed, (n, params) in enumerate(SHAPES.items())}
    C = inv.chunk_size_of(route)
    plan = [("determinism", lambda: inv.determinism(b, route, pr["one"], repeats=3), "one"),
            ("varlen_slice", lambda: inv.varlen_slice(b, route, pr["varlen"]), "varlen"),
            ("batch_slice", lambda: inv.batch_slice(b, route, pr["batch"]), "batch"),
            ("causality varlen", lambda: inv.causality(b, route, pr["varlen"]), "varlen"),
            ("causality batch P=256", lambda: inv.causality(b, route, pr["batch"], prefix=256), "batch"),
            (f"causality one P={C * 23}", lambda: inv.causality(b, route, pr["one"], prefix=C * 23), "one"),
            ("head_permutation batch", lambda: inv.head_permutation(b, route, pr["batch"]), "batch"),
            ("split_carry one P=1024", lambda: inv.split_carry(b, route, pr["one"], split=1024), "one"),
            ("strided_vs_packed varlen", lambda: inv.strided_vs_packed(b, route, pr["varlen"]), "varlen"),
            ("paged_vs_dense", lambda: inv.paged_vs_dense(b, route, pr["paged"]), "paged")]
    for name, fn, shape in plan:
        row = {"what": "invariance", "name": name, "shape": shape}
        t0 = time.time()
        # the variant the check runs, not only its source problem: a backend with no paged cache
        # or no strided inputs says so (on the H200 both raised inside the check instead)
        probe = pr[shape]
        if name.startswith("paged_vs_dense") and not probe.paged:
            probe = inv.to_paged(probe)
        elif name.startswith("strided_vs_packed"):
            probe = inv.fused_projection(probe)
        ok, why = b.accepts(probe, route)
        if not ok:
            row["status"] = why
            yield row
            continue
        try:
            res = fn()
            row.update(ok=bool(res.ok), kind=res.kind, diff=res.diff, tol=res.tol, why=res.why, text=str(res)[:600])
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:400]
            row["trace"] = traceback.format_exc()[-1200:]
        row["seconds"] = round(time.time() - t0, 2)
        yield row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tools/device/peer_checks.py", description=__doc__.splitlines()[0])
    ap.add_argument("--backend", required=True)
    ap.add_argument("--route", action="append", default=None, help="route name (repeatable; default: every route)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--what", default="controls,invariances")
    ap.add_argument("--out", default=None, help="append the JSON lines here too")
    a = ap.parse_args(argv)
    from kda_kernels.base import BackendError, load_backend
    try:
        b = load_backend(a.backend)
    except BackendError as e:
        print(e, file=sys.stderr)
        return 2
    ok, why = b.available()
    routes = b.routes()
    if a.route:
        unknown = [r for r in a.route if r not in {x.name for x in routes}]
        if unknown:
            print(f"--route: expected routes of {a.backend} ({', '.join(x.name for x in routes)}), got {unknown[0]!r}",
                  file=sys.stderr)
            return 2
        routes = [r for r in routes if r.name in a.route]
    what = [w for w in a.what.split(",") if w]
    bad = [w for w in what if w not in ("controls", "invariances")]
    if bad:
        print(f"--what: expected controls and/or invariances, got {bad[0]!r}", file=sys.stderr)
        return 2
    sink = open(a.out, "a") if a.out else None

    def emit(row):
        line = json.dumps(row, default=str)
        print(line, flush=True)
        if sink:
            sink.write(line + "\n")
            sink.flush()

    head = {"backend": b.name, "version": b.version() if hasattr(b, "version") else "", "available": ok}
    if not ok:
        emit({**head, "what": "backend", "status": why})
        return 0
    for r in routes:
        for w in what:
            gen = controls(b, r, a.device) if w == "controls" else invariances(b, r, a.device)
            for row in gen:
                emit({"backend": b.name, "route": r.name, **row})
    return 0


if __name__ == "__main__":
    sys.exit(main())
