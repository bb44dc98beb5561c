#!/usr/bin/env python3
"""Where a step of a long serving case goes: one pairing of the ``decode-long`` cases' scenario
(one request, a 64-token prompt, then ``--steps`` decode steps; H = HV = 2, K = V = 128, bf16
inputs, the NULL block at 0), run and judged as a serving cell runs it (``run_pairing`` with the
emulator's baseline of the routes' recipes), under cProfile.

    python tools/serving_step_profile.py                                     # emulator fla + fla-recurrent, CPU
    python tools/serving_step_profile.py --backend triton --route seg --decode-backend fla \\
        --decode-route recurrent --device cuda --steps 2000

Prints the wall and CPU time per step and, per step, the cumulative time of the parts: the
kernel's step (``TraceRun.step``: split, calls, cache copies), the baseline's step when it runs,
the oracle, ``measure`` and ``judge_step``; then cProfile's top functions by own time.  On a
GPU the device work shows where the host waits for it (``.cpu()``, ``bool``, ``float``).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PARTS = (("execute.py", "step", "the runs' steps (kernel, and baseline when it runs)"),
         ("emulator.py", "run_decode_call", "  of which the emulator's decode calls"),
         ("trace_calls.py", "split_step", "  of which split_step"),
         ("trace_oracle.py", "_trace_steps", "the oracle"),
         ("judge.py", "measure", "measure (kernel and baseline)"),
         ("judge.py", "judge_step", "judge_step"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="emulator", help="the prefill side's backend (default emulator)")
    ap.add_argument("--route", default="fla", help="its trace route running prefill calls (default fla)")
    ap.add_argument("--decode-backend", default=None, help="the decode side's backend (default --backend)")
    ap.add_argument("--decode-route", default="fla-recurrent", help="its trace route (default fla-recurrent)")
    ap.add_argument("--steps", type=int, default=1000, help="decode steps (default 1000; the long cases: 10000)")
    ap.add_argument("--cache-dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--top", type=int, default=25, help="cProfile rows to print (default 25)")
    a = ap.parse_args(argv)
    if a.steps < 1:
        print(f"--steps: expected an integer >= 1, got {a.steps}", file=sys.stderr)
        return 2
    import torch

    from kda_ref.trace_gen import generate
    from verification.running.run_select import load
    from verification.serving.cells import baseline_pairing, tolerances_for
    from verification.serving.execute import Pairing, Side, run_pairing
    from verification.judging.tolerances import load_tolerances
    la = load(a.backend)
    lb = la if not a.decode_backend or a.decode_backend == a.backend else load(a.decode_backend)
    for lx in (la, lb):
        if not lx.available:
            print(f"--backend {lx.spec}: not available here: {lx.reason}", file=sys.stderr)
            return 2
    routes = {x.name: x for x in la.backend.trace_routes()}
    droutes = {x.name: x for x in lb.backend.trace_routes()}
    for opt, name, have in (("--route", a.route, routes), ("--decode-route", a.decode_route, droutes)):
        if name not in have:
            print(f"{opt}: expected one of {', '.join(have)}, got {name!r}", file=sys.stderr)
            return 2
    rp, rd = routes[a.route], droutes[a.decode_route]
    tr = generate(3, None, requests=1, max_batch=1, prompt=(64, 64), decodes=(a.steps, a.steps),
                  cache_dtype=a.cache_dtype, dtype="bfloat16", pad="null0", H=2, HV=2, K=128, V=128)
    pairing = Pairing(Side(la.backend, rp), Side(lb.backend, rd))
    base, why = baseline_pairing(rp, rd)
    if base is None:
        print(f"no baseline: {why}", file=sys.stderr)
        return 2
    tols = tolerances_for(load_tolerances(None), pairing, "bf16")
    pr = cProfile.Profile()
    t0, c0 = time.perf_counter(), time.process_time()
    pr.enable()
    res = run_pairing(tr, pairing, tols, baseline=base, device=a.device)
    if a.device.startswith("cuda"):
        torch.cuda.synchronize()
    pr.disable()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    n = tr.steps
    print(f"{pairing.describe()} on {a.device}: {res.status}; {n} steps in {wall:.2f} s wall = "
          f"{1e3 * wall / n:.3f} ms per step, {1e3 * cpu / n:.3f} ms of CPU (torch threads now "
          f"{torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f})")
    st = pstats.Stats(pr)
    for fname, func, label in PARTS:
        tot = sum(v[3] for (f, _, fn), v in st.stats.items() if f.endswith(fname) and fn == func)
        print(f"  {label:52s} {1e3 * tot / n:8.3f} ms per step")
    st.sort_stats("tottime").print_stats(a.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
