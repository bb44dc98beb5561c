#!/usr/bin/env python3
"""Time the serving-trace oracle (kda_ref.trace_oracle) on a long decode trace.

    python tools/trace_oracle_bench.py                      # 10^5 decode steps, H = 8, K = V = 128
    python tools/trace_oracle_bench.py --steps 2000 --threads 2

One request: an 8-token prefill, then ``--steps`` decode steps (the ``decode-long`` scenario of
kda_ref.trace_gen), bfloat16 inputs.  Prints the time to generate the trace (its consistency
plan included), the oracle's time over every step (its own plan included) and per step, and the
float64 matmul rate measured in the same process before and after (n = 1024, best of 3, as
``kda-verify oracle-bench`` measures it on the CPU), since the machine may be shared.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from kda_ref.trace_gen import generate  # noqa: E402
from kda_ref.trace_oracle import trace_oracle  # noqa: E402
from verification.commands.oracle_bench import matmul_tflops  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100_000, help="decode steps (default 100000)")
    ap.add_argument("--heads", type=int, default=8, help="H = HV (default 8)")
    ap.add_argument("--dim", type=int, default=128, help="K = V (default 128)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads while a step is computed (trace_oracle's threads; default 1; 0: torch's own)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.steps < 1 or a.heads < 1 or a.dim < 1:
        print(f"--steps/--heads/--dim: expected integers >= 1, got {a.steps}/{a.heads}/{a.dim}", file=sys.stderr)
        return 2
    dev = torch.device("cpu")
    mm0 = matmul_tflops(dev)
    t0 = time.perf_counter()
    tr = generate(a.seed, "decode-long", decodes=(a.steps, a.steps), H=a.heads, HV=a.heads, K=a.dim, V=a.dim,
                  dtype="bfloat16")
    t_gen = time.perf_counter() - t0
    t0, c0 = time.perf_counter(), time.process_time()
    n = 0
    for _ in trace_oracle(tr, threads=a.threads or None):
        n += 1
    t_or, c_or = time.perf_counter() - t0, time.process_time() - c0
    mm1 = matmul_tflops(dev)
    mm = max(mm0, mm1)
    print(f"trace: {tr.describe()}")
    print(f"generate (with its plan): {t_gen:.2f} s")
    print(f"oracle: {n} steps in {t_or:.2f} s wall = {1e6 * t_or / n:.1f} us per step; {c_or:.2f} s of this "
          f"process's CPU time (torch threads {a.threads or torch.get_num_threads()}, of {os.cpu_count()} cores; "
          f"load average {os.getloadavg()[0]:.1f})")
    print(f"float64 matmul measured here: {1e3 * mm0:.1f} GFLOP/s before, {1e3 * mm1:.1f} after "
          f"(n = 1024, best of 3); the oracle's {n} steps at that rate would be "
          f"{n * 7 * a.heads * a.dim * a.dim / (mm * 1e12):.2f} s of matmul work (7 HV K V flops per token)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
