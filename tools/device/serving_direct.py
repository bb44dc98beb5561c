#!/usr/bin/env python3
"""Serving traces through the kernel adapters, step by step, without the CLI: every pairing of a
prefill route and a decode route on generated traces, each step split by
kda_kernels.trace_calls.split_step and run by the routes' ``run_call``, measured against
kda_ref.trace_oracle by tests/trace_check.py (live outputs and written slots as
max|got - ref| / max|ref|, worst per group with its step; every other element of the buffer bit for
bit, listed as 'slot N' or 'guard/padding' where it changed).  A group whose route cannot take the
trace (trace_accepts) is recorded with the reason and the pairing skipped.

    python tools/device/serving_direct.py --out DIR [--pairs P:ROUTE/D:ROUTE,...] [--scenarios ...]
        [--device cuda] [--budget SECONDS]

Writes DIR/serving_direct.jsonl (one line per pairing and trace) and DIR/serving_direct.txt (a
table).  Pairings run in order until --budget seconds have passed (the rest are listed as not run).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

# prefill backend:route x decode backend:route (the decode route runs the decode and spec groups)
PREFILL = ("triton:unseg:BW=32", "triton:seg:A=fused:B=prefetch:BW=32", "aiter:chunk_kda:triton", "aiter:triton:seg",
           "fla:chunk:safe_gate")
DECODE = ("fla:fused_recurrent", "aiter:kda:gluon")
# FlashKDA needs K = V = 128 and H = HV; one slot of guard rows before slot 0 keeps a kernel that
# writes slot -1 inside the buffer (where it shows as 'guard/padding')
KNOBS = dict(H=4, HV=4, K=128, V=128, dtype="bfloat16", lower_bound=-5.0, guard_rows=4 * 128)
SCENARIOS = ("mixed", "chunked-prefill", "spec", "graph-padded", "null-block", "slot-reuse")


def backend(name: str):
    from kda_kernels.base import load_backend
    cache = backend.__dict__.setdefault("cache", {})
    if name not in cache:
        cache[name] = load_backend(name)
    return cache[name]


def route_of(spec: str):
    name, _, route = spec.partition(":")
    b = backend(name)
    by = {r.name: r for r in b.trace_routes()}
    if route not in by:
        raise SystemExit(f"--pairs: {name} has no trace route {route!r} (it has {', '.join(by)})")
    return b, by[route]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--pairs", default=",".join(f"{p}/{d}" for d in DECODE for p in PREFILL))
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", type=float, default=240.0)
    ap.add_argument("--knobs", default="{}", help="JSON trace knobs over KNOBS (e.g. a smaller H for a rehearsal)")
    a = ap.parse_args(argv)
    import torch

    from kda_ref.trace_gen import generate
    from trace_check import run_trace
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    rows = []
    knobs = dict(KNOBS, **json.loads(a.knobs))
    traces = {s: generate(a.seed, s, **knobs) for s in a.scenarios.split(",")}
    with open(a.out / "serving_direct.jsonl", "w") as f:
        for pair in a.pairs.split(","):
            pre, _, dec = pair.partition("/")
            for scen, tr in traces.items():
                rec = dict(pair=pair, scenario=scen, trace=tr.describe())
                if time.time() - t0 > a.budget:
                    rec.update(status="not run", reason=f"budget {a.budget:.0f} s spent")
                else:
                    try:
                        runners, why = {}, []
                        for spec, groups in ((pre, ("prefill",)), (dec, ("decode", "spec"))):
                            b, r = route_of(spec)
                            ok, reason = b.trace_accepts(tr, r)
                            if not ok:
                                why.append(f"{spec}: {reason}")
                            runners.update({g: (b, r) for g in groups})
                        if why:
                            rec.update(status="not applicable", reason=" | ".join(why))
                        else:
                            t = time.time()
                            res = run_trace(tr, runners, device=a.device, seed=a.seed)
                            if a.device.startswith("cuda"):
                                torch.cuda.synchronize()
                            rec.update(status="ran", seconds=round(time.time() - t, 1), **res)
                    except Exception as e:  # noqa: BLE001 - recorded with its traceback, the next pair runs
                        rec.update(status="error", reason=f"{type(e).__name__}: {e}",
                                   traceback=traceback.format_exc()[-3000:])
                rows.append(rec)
                f.write(json.dumps(rec) + "\n")
                f.flush()
                print(_line(rec), flush=True)
    text = "\n".join(_line(r) for r in rows)
    (a.out / "serving_direct.txt").write_text(text + "\n")
    return 0


def _line(r: dict) -> str:
    head = f"{r['pair']:<62} {r['scenario']:<16} {r['status']:<14}"
    if r["status"] != "ran":
        return head + " " + r.get("reason", "")[:300]
    g = " ".join(f"{k}: o {v['o']:.2e}@{v['o_step']} state {v['state']:.2e}@{v['state_step']}"
                 for k, v in r["by_group"].items())
    regions = sorted({x for _, x in r["unexpected"]})
    return head + f" {r['seconds']}s {g}" + (f" | written outside the step's slots: {regions} "
                                             f"({len(r['unexpected'])} steps)" if regions else "")


if __name__ == "__main__":
    sys.exit(main())
