"""Decode drift of an emulator decode recipe over a long trace, per cache dtype.

Generates the ``decode-long`` scenario (one request: an 8-token prompt, then ``--decodes`` decode
steps) at H = HV = ``--heads``, K = V = ``--dim``, runs its decode calls through the emulator trace
route ``--route`` (the prefill chunks take the oracle's states, rounded to the cache's dtype) and
prints, per cache dtype, the worst step's max|o - truth| / max|truth| and that of the slot content,
against ``kda_ref.trace_oracle``.

    python tools/trace_decode_drift.py                      # fla-recurrent, 1000 decodes, H 2, K = V = 128
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from kda_kernels.emulator import EmulatorBackend
from kda_kernels.trace_calls import split_step
from kda_ref.trace_gen import generate
from kda_ref.trace_oracle import trace_oracle

F64 = torch.float64


def drift(route_name: str, cache_dtype: str, decodes: int, heads: int, dim: int) -> tuple[float, float]:
    be = EmulatorBackend()
    route = {r.name: r for r in be.trace_routes()}[route_name]        # main() checked the name
    tr = generate(0, "decode-long", decodes=(decodes, decodes), H=heads, HV=heads, K=dim, V=dim,
                  cache_dtype=cache_dtype, pad="null0" if route_name.startswith("aiter") else "minus1")
    ok, why = be.trace_accepts(tr, route)
    if not ok:
        raise ValueError(f"--route: expected a route that takes a {cache_dtype} decode-long trace, got {route_name} "
                         f"({why})")
    cache = tr.cache.allocate()
    view = tr.cache.view(cache)
    worst_o = worst_s = 0.0
    for s, truth in enumerate(trace_oracle(tr)):
        for c in split_step(tr, s, cache):
            if c.group in route.flag("groups"):
                o = be.run_call(c, route)[0].to(F64)
                ref = truth.o[c.token_index]
                worst_o = max(worst_o, ((o - ref).abs().max() / ref.abs().max()).item())
            else:
                for rp in truth.plan.rows:
                    for _, slot in rp.writes:
                        view[slot] = truth.expected(slot).to(cache.dtype)
        for slot in truth.written:
            ex = truth.expected(slot)
            worst_s = max(worst_s, ((view[slot].to(F64) - ex).abs().max() / ex.abs().max()).item())
    return worst_o, worst_s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--route", default="fla-recurrent", help="an emulator decode route (default fla-recurrent)")
    ap.add_argument("--decodes", type=int, default=1000)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtypes", default="float32,bfloat16", help="cache dtypes, comma-separated")
    a = ap.parse_args(argv)
    decode = [r.name for r in EmulatorBackend().trace_routes() if "prefill" not in r.flag("groups")]
    if a.route not in decode:
        print(f"--route: expected one of {', '.join(decode)}, got {a.route!r}", file=sys.stderr)
        return 2
    for dt in a.dtypes.split(","):
        t = time.time()
        try:
            eo, es = drift(a.route, dt, a.decodes, a.heads, a.dim)
        except ValueError as e:          # a refused trace, or a bad knob (TraceError is a ValueError)
            print(str(e).splitlines()[0], file=sys.stderr)
            return 2
        print(f"{a.route} cache {dt}: {a.decodes} decodes, worst o {eo:.3e}, worst slot {es:.3e} "
              f"({time.time() - t:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
