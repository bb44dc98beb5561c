"""`kda-verify bench`: time routes side by side on a CUDA device (see verification/investigating/bench.py for
the method: each backend's adapter's own run of the route timed, device events, median of many
repetitions, L2 flushed, inputs rotated, optional CUDA-graph replay)."""
from __future__ import annotations

import json
import sys

from verification.judging.policy import exit_code

NAME = "bench"
HELP = "time KDA forward routes side by side (CUDA events, median, L2 flushed between repetitions)"
EXAMPLES = """\
kda-verify bench --backend triton,fla --suite default   # needs: cuda, fla
kda-verify bench --shapes '1x16384x12;8x2048x16' --routes seg --graph --passes   # needs: cuda
kda-verify bench --suite default --json-out bench.json   # needs: cuda
"""


def add_arguments(p):
    p.add_argument("--backend", default="triton,fla", metavar="BACKENDS",
                   help="comma-separated backends (built-in names or package.module:factory), each timed through "
                        "its adapter's run of the route, the call the verdict makes (fla with its autotuners "
                        "pinned, as the verdict runs it); default triton,fla")
    p.add_argument("--suite", default="default", metavar="SUITE", help="case suite whose (B,T,H) shapes to time (default: default)")
    p.add_argument("--shapes", metavar="SHAPES", help="instead of a suite: semicolon-separated BxTxH, e.g. '1x16384x12;8x2048x16'")
    p.add_argument("--routes", default="seg,unseg", metavar="ROUTES",
                   help="comma-separated triton routes (default seg,unseg); fla runs chunk:safe_gate, moonshot "
                        "cutlass:state=fp32, aiter triton:seg")
    p.add_argument("--reps", type=int, default=50, metavar="N", help="timed repetitions per cell (default 50)")
    p.add_argument("--warmup", type=int, default=5, metavar="N", help="untimed calls first (default 5)")
    p.add_argument("--graph", action="store_true", help="replay CUDA graphs (no host launch cost)")
    p.add_argument("--passes", action="store_true",
                   help="also time each pass of our Triton routes alone (K1, A, B, C) per shape, against its "
                        "own bandwidth floor (with --graph: each pass as a CUDA-graph replay)")
    p.add_argument("--device", default=None, metavar="DEVICE",
                   help="a CUDA device, cuda[:N] (default: cuda if available, else cpu, which bench refuses: it "
                        "times with device events)")
    p.add_argument("--json-out", metavar="PATH", help="also write the results as JSON to PATH")


def _shapes(args):
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.investigating.bench import shapes_of_suite
    from verification.errors import UsageError
    if args.shapes:
        out = []
        for item in args.shapes.split(";"):
            parts = item.strip().lower().split("x")
            if len(parts) != 3 or not all(x.isdigit() and int(x) > 0 for x in parts):
                raise UsageError(f"--shapes: expected BxTxH with positive integers, got {item.strip()!r}")
            out.append(tuple(int(x) for x in parts))
        return out
    try:
        return shapes_of_suite(args.suite)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _us(x: float) -> str:
    """A floor in us, three significant digits (no exponent from 100 up)."""
    return f"{x:.0f}" if x >= 99.5 else f"{x:.3g}"


def _vs_floor(t: float, floor: float, width: int) -> str:
    """``t`` us and its ratio to ``floor``, e.g. ' 402.0 (5.8x)', right-aligned in ``width``."""
    r = t / floor if floor > 0 else float("nan")
    x = f"{r:.1f}" if r < 99.95 else f"{r:.0f}" if r < 1e5 else f"{r:.0e}"
    return f"{t:.1f} ({x}x)".rjust(width)


def _print_side_by_side(results) -> None:
    """One row per shape: its bandwidth floor, then every timed (backend, route) of this run as
    'us (x floor)', host-bound cells marked 'hb', and the fastest."""
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.investigating import bench
    cols, rows = bench.side_by_side(results)
    names = [f"{b} {r}" for b, r in cols]
    w = max(16, *(len(n) for n in names))
    print(f"\nside by side (us, median; x the shape's floor; hb: host-bound):")
    print(f"{'shape':>12} {'floor us':>8} " + " ".join(n.rjust(w) for n in names) + "  fastest")
    for shape, row in rows.items():
        cells, best = [], None
        for key in cols:
            r = row.get(key)
            if r is None or r.error or not r.time_us == r.time_us:
                cells.append(("error" if r is not None else "-").rjust(w))
                continue
            cells.append((_vs_floor(r.time_us, row["floor_us"], 0).strip() + (" hb" if r.host_bound else "")).rjust(w))
            if best is None or r.time_us < best[1]:
                best = (f"{key[0]} {key[1]}", r.time_us)
        print(f"{'x'.join(map(str, shape)):>12} {_us(row['floor_us']):>8} " + " ".join(cells)
              + f"  {best[0] if best else '-'}")


def run(args) -> int:
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    import torch

    # lazy: importing kda_kernels.triton builds the kernels, after TRITON_INTERPRET is decided (docs/design.md, Imports)
    from kda_kernels.triton.routes import RouteError, parse_route
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.investigating import bench
    from kda_kernels.base import BUILTIN_BACKENDS, BackendError, load_backend
    from verification.errors import UsageError

    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    bad = [b for b in backends if b not in BUILTIN_BACKENDS and ":" not in b]
    if bad or not backends:
        raise UsageError(f"--backend: expected a comma-separated list of {', '.join(BUILTIN_BACKENDS)} "
                         f"(or package.module:factory), got {args.backend!r}")
    routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    for r in routes:
        try:
            parse_route(r)
        except RouteError as e:
            raise UsageError(f"--routes: {e}") from None
    if args.reps < 3 or args.warmup < 1:
        raise UsageError(f"--reps/--warmup: expected reps >= 3 and warmup >= 1, got {args.reps}/{args.warmup}")
    if args.json_out:
        # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
        from verification.errors import writable_file
        writable_file(args.json_out, "--json-out")
    shapes = _shapes(args)
    if not torch.cuda.is_available():
        raise UsageError("--device: bench needs a CUDA device (device-event timing); none is visible here")
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.running.devices import check_device
    device = torch.device(check_device(args.device or "cuda"))
    cells = []                   # (name, route, adapter): each adapter loaded once, its kernel library imported once
    for b in backends:
        try:
            adapter = load_backend(b)
            ok, why = adapter.available()
        except BackendError as e:
            raise UsageError(str(e)) from None
        if not ok:
            print(f"kda-verify bench: skipping {b} ({why})", file=sys.stderr)
        elif b == "triton":
            cells += [(b, r, adapter) for r in routes]
        else:
            cells.append((b, bench.DEFAULT_ROUTES.get(b) or adapter.routes()[0].name, adapter))
    results = []
    print(f"{'backend':7} {'route':44} {'shape':>12} {'time us':>9} {'p10':>8} {'p90':>8} {'GB/s':>7} "
          f"{'TFLOP/s':>8} {'floor us':>8} {'x floor':>7}  ran")
    for shape in shapes:
        for backend, route, adapter in cells:
            r = bench.bench_one(adapter, route, shape, device, reps=args.reps, warmup=args.warmup, graph=args.graph,
                                name=backend)
            results.append(r)
            sh = "x".join(str(x) for x in shape)
            if r.error:
                print(f"{backend:7} {route:44} {sh:>12}  error: {r.error}")
            else:
                mark = f"  [host-bound: {r.host_us:.0f} us to launch]" if r.host_bound else ""
                print(f"{backend:7} {route:44} {sh:>12} {r.time_us:9.1f} {r.p10_us:8.1f} {r.p90_us:8.1f} "
                      f"{r.bandwidth_gbs:7.0f} {r.tflops:8.1f} {r.floor_us:8.1f} {r.time_us / r.floor_us:7.2f}  "
                      f"{r.route_ran}{mark}", flush=True)
    passes = []
    if getattr(args, "passes", False) and "triton" in backends:
        designs = []
        print(f"\n{'route':44} {'shape':>12} {'cps':>4} {'segs':>5} {'K1 us (x floor)':>16} {'A us (x floor)':>16} "
              f"{'B us (x floor)':>16} {'C us (x floor)':>16} {'total us (x fwd floor)':>22}")
        for shape in shapes:
            for route in routes:
                sh = "x".join(str(x) for x in shape)
                try:
                    t = bench.pass_times(route, shape, device, reps=max(3, min(args.reps, 20)), warmup=args.warmup,
                                         graph=args.graph)
                except Exception as e:  # noqa: BLE001 - one failing cell is a result
                    print(f"{route:44} {sh:>12}  error: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                    continue
                passes.append(dict(route=route, shape=sh, **t))
                cells = [_vs_floor(t[k], t["floors"][k], 16) if k in t else f"{'-':>16}" for k in bench.PASS_KEYS]
                print(f"{route:44} {sh:>12} {str(t['cps'] or '-'):>4} {t['segments']:5d} {' '.join(cells)} "
                      f"{_vs_floor(t['total'], t['floor'], 22)}", flush=True)
                fl = t["floors"]
                terms = " + ".join(f"{name} {_us(fl[k])}" for k, name in zip(bench.PASS_KEYS, ("K1", "A", "B", "C"))
                                   if k in fl)
                designs.append(f"design floor {sh} {route}: {terms} = {_us(t['design_floor'])} us = "
                               f"{t['design_floor'] / t['floor']:.1f}x the forward's floor of {_us(t['floor'])} us")
        for line in designs:
            print(line)
    if len(cells) > 1 and results:
        _print_side_by_side(results)
    if any(r.host_bound for r in results):
        print("host-bound: the device waited for the host to launch the call, so that time is the host's "
              "(Python and launch costs), not the kernels'; --graph times the GPU alone")
    sp = bench.speedups(results)
    for (b, r), d in sp.items():
        worst = min(d["per_shape"].items(), key=lambda kv: kv[1]) if d["per_shape"] else None
        print(f"speedup vs fla {b} {r}: geomean {d['geomean']:.2f}x over {len(d['per_shape'])} shapes"
              + (f", worst {worst[1]:.2f}x at {'x'.join(map(str, worst[0]))}" if worst else ""))
    if args.json_out:
        payload = {"graph": args.graph, "reps": args.reps, "device": torch.cuda.get_device_name(device),
                   "results": [r.as_dict() for r in results], "passes": passes,
                   "speedup_vs_fla": {f"{b}|{r}": {"geomean": d["geomean"],
                                                   "per_shape": {"x".join(map(str, k)): v
                                                                 for k, v in d["per_shape"].items()}}
                                      for (b, r), d in sp.items()}}
        with open(args.json_out, "w") as f:
            json.dump(payload, f, indent=1)
    return exit_code(failed=any(r.error for r in results))
