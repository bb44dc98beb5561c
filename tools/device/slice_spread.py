"""How far a kernel's error on one (sequence, head) slice of o strays from its recipe's on the
same slice, by the sequence's length: the measured basis of ``verdict.slice_allowance``.

For packs of many short sequences (and a long one), every backend route here that accepts
them runs beside its recipe's baseline; each o slice (sequence n, head h) gives
ratio = kernel slice error / max(baseline slice error, baseline error of the whole o), the
quantity the slice rule multiplies by m x a.  Writes one CSV row per slice and prints, per
length bucket, the count, the largest ratio and the 99.9th percentile.

    python tools/device/slice_spread.py OUT.csv [--device cuda] [--draws 4] [--heads 12] [--short 192] [--backends triton,fla,aiter,moonshot]
"""
from __future__ import annotations

import argparse
import csv
import math
import sys

import torch


ROUTES = {"triton": ["seg", "unseg:BW=32"], "fla": ["chunk:safe_gate"],
          "aiter": ["triton:seg", "triton:unseg"], "moonshot": ["cutlass:state=fp32"]}


def packs(draws: int, H: int = 12, n_short: int = 192, long: int = 4096):
    """Varlen packs: ``n_short`` sequences of 1-256 tokens (log-uniform) around one of ``long``,
    at lb -5 without a state and at the weak lb -0.05 with one; ``draws`` seeds each."""
    from verification.running.cases import _case
    for d in range(draws):
        gen = torch.Generator().manual_seed(1000 + d)
        short = [max(1, int(2 ** (8 * float(torch.rand(1, generator=gen))))) for _ in range(n_short)]
        lens = short[:n_short // 2] + [long] + short[n_short // 2:]
        for lb, state in ((-5.0, "none"), (-0.05, "kv")):
            yield _case("spread", f"pack{d}-lb{lb:g}", lens=lens, H=H, lb=lb, state=state)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--draws", type=int, default=4)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--short", type=int, default=192, help="short sequences per pack")
    ap.add_argument("--backends", default=",".join(ROUTES))
    a = ap.parse_args(argv)
    from kda_ref.truth import truth
    from verification.judging.baselines import _tensors, baseline_metrics
    from verification.judging.metrics import compare
    from verification.running.run_select import load, resolve_routes
    from verification.judging.verdict import slice_errors
    loaded = {}
    for name in a.backends.split(","):
        routes = ROUTES[name]
        lb = load(name)
        if not lb.available:
            print(f"{name}: not available ({lb.reason})")
            continue
        loaded[name] = (lb, resolve_routes(lb, routes, strict=False))
    rows = []
    for case in packs(a.draws, a.heads, a.short):
        p = case.build(device=a.device)
        t = truth(p)
        refs = _tensors(t)
        base = {}
        for name, (lb, routes) in loaded.items():
            for r in routes:
                ok, why = lb.backend.accepts(p, r)
                if not ok:
                    print(f"{name} {r.name} {case.name}: not accepted ({why})")
                    continue
                if r.recipe not in base:
                    base[r.recipe] = baseline_metrics(p, r.recipe, t)["o"]
                b = base[r.recipe]
                m = compare(lb.backend.run(p, r).tensors(), refs, p)["o"]
                e, be = slice_errors(m["slices"]["seq_head"]), slice_errors(b["slices"]["seq_head"])
                whole = float(b["rel_l2"])
                for (n, h), c, x, y in zip(m["slices"]["seq_head"]["labels"], m["slices"]["seq_head"]["count"], e, be):
                    rows.append((name, r.name, case.name, n, h, c // p.V, x, y, whole, x / max(y, whole)))
        print(f"{case.name}: {len(rows)} slices so far", flush=True)
    with open(a.out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["backend", "route", "case", "seq", "head", "tokens", "err", "baseline_err", "whole", "ratio"])
        w.writerows(rows)
    summarize(rows)
    return 0


def summarize(rows) -> None:
    edges = [1, 2, 4, 8, 16, 32, 64, 128, 256, 4096]
    for lo, hi in zip(edges, edges[1:] + [math.inf]):
        v = sorted((r[-1] for r in rows if lo <= r[5] < hi), reverse=True)
        if v:
            print(f"tokens {lo:5d}-{hi:<5}: {len(v):6d} slices, max ratio {v[0]:.3f}, "
                  f"99.9% {v[len(v) // 1000]:.3f}, 1+1/sqrt(lo) {1 + 1 / math.sqrt(lo):.3f}")


if __name__ == "__main__":
    sys.exit(main())
