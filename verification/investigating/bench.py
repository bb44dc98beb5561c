"""Timing of KDA forward routes side by side (``kda-verify bench``).

Method, per (backend, route, shape):
- the timed call is the backend adapter's own ``run`` of the route on a Problem (``route_call``),
  the call a verdict's cell makes: bench imports no kernel library itself, and times what the
  adapter does per call (its argument conversions, fla's pinned autotuners, the launches, its
  output reshapes); loading the adapter, the route lookup and the inputs stay outside;
- inputs: the generator's (kda_ref.problems) named shape BxTxH: bf16 q, k, v, g (g = 0.1 N(0,1)),
  fp32 beta, A_log = 0.5|N|, dt_bias = 0.1 N, lb -5, drawn on the device (``bench_problem``);
  ``rotate`` copies are cycled so no repetition reads a warm copy;
- warm-up calls first (compilation, plan caches), then ``reps`` repetitions, each one preceded by
  a 256 MB buffer write that flushes the L2, timed by CUDA events around the call alone;
- optional CUDA-graph replay (``graph=True``): the call is captured once per input copy and
  the replay is timed, which removes the host's launch cost;
- the median (and p10 / p90) of the repetitions.

Per shape: time, effective bandwidth (q, k, v, g, beta read and o written once, plus the
final state written), TFLOP/s with FLOPs = B·T·H·2·(32·K + 32·V + 2·K·V), and the floor
max(bytes / HBM bandwidth, FLOPs / bf16 peak) for the H200 (4.8 TB/s, 790 TFLOP/s).

Per pass (``pass_times``, ``bench --passes``): each pass of our four-pass Triton FlashKDA (K1,
pass A, pass B = the scan, pass C) also gets its own bandwidth floor, the minimum HBM bytes it
moves in our design (``pass_traffic``: inputs, workspace, A_seg / b_seg / h_in, o and the final
state, each byte once) / 4.8 TB/s.  Their sum, the design floor, exceeds the forward's floor by
the workspace's and the segment states' round trips through HBM (and v read by passes A and C).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch

from kda_kernels.base import LooksUpRoutes, load_backend
from kda_ref.problems import ProblemSpec, generate

# the default suite: the 13 production benchmark shapes (also verification.running.cases.DEFAULT_SHAPES)
DEFAULT_SHAPES = ((1, 256, 12), (1, 512, 12), (1, 1664, 12), (1, 2048, 12), (1, 8192, 12), (1, 16384, 12),
                  (1, 16384, 64), (1, 16384, 96), (1, 8192, 32), (1, 8192, 64), (2, 2664, 12), (4, 4096, 16),
                  (8, 2048, 16))
H200_HBM_BYTES_S = 4.8e12
H200_BF16_FLOPS = 790e12
FLUSH_BYTES = 256 * 1024 * 1024
HOST_BOUND_RATIO = 0.75  # the host's launching (past the flush) spanned this share of the measured time: its pace
K = V = 128
C = 32


@dataclass
class BenchResult:
    backend: str
    route: str
    B: int
    T: int
    H: int
    time_us: float
    p10_us: float
    p90_us: float
    reps: int
    graph: bool
    bytes: int
    flops: int
    bandwidth_gbs: float
    tflops: float
    floor_us: float
    route_ran: str = ""
    error: str = ""
    extra: dict = field(default_factory=dict)
    host_us: float = math.nan      # median host time to issue one call's launches, us
    host_bound: bool = False       # the host's launching, not the GPU, set the measured time (is_host_bound)

    def as_dict(self) -> dict:
        return asdict(self)


def shapes_of_suite(suite: str) -> list:
    """(B, T, H) of every case of a suite (verification.running.cases when present)."""
    try:
        # lazy: a probe of what is installed (docs/design.md, Imports)
        from verification.running.cases import get_suite
    except ImportError:
        get_suite = None
    if suite == "default" and get_suite is None:
        return list(DEFAULT_SHAPES)
    if get_suite is None:
        raise ValueError(f"--suite: only 'default' is known without verification.running.cases, got {suite!r}")
    out = []
    for c in get_suite(suite):
        s = c.spec                    # the generator's recipe of the case (kda_ref.problems.ProblemSpec)
        if s.varlen:
            raise ValueError(f"--suite {suite}: bench times fixed-length shapes; case {c.id} is varlen")
        out.append((s.B, s.T, s.H))
    return out


def traffic(B: int, T: int, H: int) -> tuple[int, int]:
    """(bytes, FLOPs) of one forward: q, k, v, g bf16 read, beta fp32 read, o bf16 written,
    final state fp32 written; FLOPs B·T·H·2·(32·K + 32·V + 2·K·V)."""
    tok = B * T * H
    nbytes = tok * (4 * K * 2 + 4 + V * 2) + B * H * K * V * 4
    flops = tok * 2 * (C * K + C * V + 2 * K * V)
    return nbytes, flops


def floor_us(B: int, T: int, H: int) -> float:
    nbytes, flops = traffic(B, T, H)
    return 1e6 * max(nbytes / H200_HBM_BYTES_S, flops / H200_BF16_FLOPS)


INPUT_BYTES = {"q": 2, "k": 2, "v": 2, "g": 2, "beta": 4}    # element sizes of bench_problem's tensors
PASS_KEYS = ("k1", "A", "B", "C")                           # pass_times' keys of the four passes
PASS_A_WS = ("ws_kd", "ws_kr", "ws_inv", "ws_gt", "ws_beta")  # the workspace buffers pass A reads


def pass_traffic(plan, H: int, spec, in_bytes: Optional[dict] = None) -> dict:
    """Minimum HBM bytes each pass of our Triton FlashKDA moves on ``plan`` (a forward.Plan) with
    ``H`` heads and route ``spec`` (a RouteSpec: its ``pass_a`` and ``scan``): {"k1", "A", "B",
    "C"}, A and B only for a segmented plan.  Each byte is counted once: the column-block programs
    of one (segment, head) re-reading the same workspace tile hit the L2 and are not counted.

    With tok = tokens (the sum of the plan's sequence lengths; B*T for fixed length), Nt =
    plan.total_tiles, S = plan.num_segs, N = plan.N, C = 32, D = K = V = 128, sizes in bytes from
    ``in_bytes`` (q, k, v, g, beta; default INPUT_BYTES: bf16, fp32 beta; o has v's size) and from
    forward.WORKSPACE_DTYPES / A_SEG_DTYPE[spec.scan]:
        W  = ws_kd + ws_qd + ws_kr [C,D] + ws_gt [D] + ws_inv + ws_mqk [C,C] + ws_beta [C]
             (one (tile, head); bf16 / fp32 / fp16 / fp32: 29312 B)
        WA = ws_kd + ws_kr + ws_inv + ws_gt + ws_beta (what pass A reads: 19072 B)
        k1 = tok*H*D*(q + k + g) + tok*H*beta + Nt*H*W                        (read, workspace written)
             [+ 2*Nt*H*C*C*4 with spec.k1 == "tile": ws_L, fp32, written and read between K1's launches]
        A  = Nt*H*WA*(2 if spec.pass_a == "two" else 1) + tok*H*D*v            (read)
             + S*H*K*K*A_seg + S*H*K*V*4                                      (A_seg, b_seg fp32 written)
        B  = S*H*K*K*A_seg + S*H*K*V*4 + S*H*K*V*4                            (A_seg, b_seg read, h_in written)
        C  = Nt*H*W + tok*H*D*v [+ S*H*K*V*4 h_in, segmented]                  (read)
             + tok*H*V*v + N*H*K*V*4                                          (o, final state fp32 written)
    K1's A_log / dt_bias (H and H*K values) and the plan's index tables are left out."""
    # lazy: kda_kernels.triton builds its kernels at import (docs/design.md, Imports)
    from kda_kernels.triton import forward as fw

    sz = dict(INPUT_BYTES, **(in_bytes or {}))
    C_, D = fw.C, fw.D
    per = {n: math.prod(shape) * fw.WORKSPACE_DTYPES[n].itemsize for n, shape in fw.WORKSPACE_TILE_SHAPES.items()}
    ws_all = plan.total_tiles * H * sum(per.values())
    ws_a = plan.total_tiles * H * sum(per[n] for n in PASS_A_WS)
    tok = sum(t1 - t0 for _, t0, t1 in plan.bounds)
    state = H * D * D * 4                                       # one fp32 [K,V] state per head
    v_bytes = tok * H * D * sz["v"]
    out = {"k1": tok * H * D * (sz["q"] + sz["k"] + sz["g"]) + tok * H * sz["beta"] + ws_all}
    if spec.k1 == "tile":
        out["k1"] += 2 * plan.total_tiles * H * C_ * C_ * 4
    if plan.segmented:
        S = plan.num_segs
        a_seg = S * H * D * D * fw.A_SEG_DTYPE[spec.scan].itemsize
        out["A"] = ws_a * (2 if spec.pass_a == "two" else 1) + v_bytes + a_seg + S * state
        out["B"] = a_seg + S * state + S * state
        out["C"] = ws_all + v_bytes + S * state + v_bytes + plan.N * state
    else:
        out["C"] = ws_all + v_bytes + v_bytes + plan.N * state
    return out


def pass_floors(nbytes: dict) -> dict:
    """Each pass's bandwidth floor in us: its bytes (``pass_traffic``) / H200_HBM_BYTES_S."""
    return {k: 1e6 * b / H200_HBM_BYTES_S for k, b in nbytes.items()}


def bench_problem(B: int, T: int, H: int, device, seed: int):
    """The Problem bench times on: kda_ref.problems.generate of the named shape ``BxTxH`` (K = V =
    128, lb -5, bf16 q k v g, fp32 beta, A_log, dt_bias; no initial state), drawn by ``device``'s
    own generator (``draw="device"``: the inputs of a 16384 x 96 shape made where they are timed)."""
    return generate(ProblemSpec(B=B, T=T, H=H, K=K, V=V, seed=seed, draw="device"), device=device)


def kernel_inputs(p) -> dict:
    """The tensors of a bench Problem by name, as the per-pass timing (``pass_times``) launches them."""
    return dict(q=p.q, k=p.k, v=p.v, g=p.g, beta=p.beta, A_log=p.A_log, dt_bias=p.dt_bias, scale=p.scale_value,
                lower_bound=p.lower_bound)


# ----------------------------------------------------------------------------------- the timed call
DEFAULT_ROUTES = {"triton": "seg", "cudnn": "hopper_cuda", "fla": "chunk:safe_gate", "moonshot": "cutlass:state=fp32",
                  "aiter": "triton:seg", "fla-naive": "naive:chunk", "transformers": "torch:chunk"}


def find_route(b, name: str):
    """The Route ``name`` of backend ``b``: one its ``routes()`` lists, else ``b.route(name)`` where
    the adapter parses route names (kda_kernels.base.LooksUpRoutes: triton's "seg:BW=64")."""
    r = next((x for x in b.routes() if x.name == name), None)
    if r is None and isinstance(b, LooksUpRoutes):
        r = b.route(name)
    if r is None:
        raise ValueError(f"--routes for {b.name}: expected one of {', '.join(x.name for x in b.routes())}, got {name!r}")
    return r


def route_call(backend, route: str) -> Callable:
    """The callable bench times: ``p -> backend.run(p, route).o``, the adapter's own run of the
    route on a Problem, the very call a verdict's cell makes (verification.running.run_cell.run_cell).
    ``backend``: a built-in name or package.module:factory (kda_kernels.base.load_backend), or
    a Backend.  The adapter imports its kernel library once (its ``_load``); bench imports none.

    Inside the timed region: everything the adapter does per call, its argument conversions
    (e.g. moonshot's bf16 beta logits and [H, K] dt_bias, cuDNN's THD views, fla's int64
    cu_seqlens copy), its context (fla's autotuners pinned to one config each, as the verdict
    runs fla), the kernel launches and its output reshapes.  Outside: loading the adapter, its
    availability check, the route lookup and the inputs (``bench_problem``), which no adapter
    makes per call.  ``call.info["route_ran"]`` is the adapter's own account of what ran."""
    b = load_backend(backend) if isinstance(backend, str) else backend
    ok, why = b.available()
    if not ok:
        raise RuntimeError(f"{b.name} unavailable: {why}")
    r = find_route(b, route)
    last = {"route_ran": route}

    def call(p):
        out = b.run(p, r)
        last["route_ran"] = str((out.info or {}).get("route_ran", route))
        return out.o

    call.info, call.backend, call.route = last, b, r
    return call


# ----------------------------------------------------------------------------------- timing
def is_host_bound(time_us: float, host_us: float, flush_us: float, graph: bool) -> bool:
    """Whether a timed call was paced by the host.  Each repetition queues the L2 flush, the start
    event, the call and the end event without waiting, so the host issues the call's launches while
    the device runs the flush (``flush_us``).  A call whose launches take the host ``host_us`` ends
    no earlier than ``host_us - flush_us`` after the start event: when that is at least
    HOST_BOUND_RATIO of the measured time, the device was waiting for launches and the time is the
    host's (Python and launch costs), not the kernels'.  Graph replay is one launch: never flagged."""
    if graph or not (time_us > 0) or math.isnan(host_us) or math.isnan(flush_us):
        return False
    return host_us - flush_us >= HOST_BOUND_RATIO * time_us


def graph_replay(fn: Callable, device) -> Callable:
    """fn() captured once in a CUDA graph (after a run on a side stream, so lazy allocations and
    compilations happen outside the capture); returns the graph's replay, run once already."""
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize(device)
    return g.replay


def time_call(fn: Callable, inputs: list, reps: int, warmup: int, graph: bool, device,
              stats: Optional[dict] = None) -> list:
    """Per-repetition device times (us) of fn(inputs[i % len]) with the L2 flushed before each.
    ``stats``, when a dict, receives ``host_us`` (each repetition's host time to issue the call)
    and ``flush_us`` (the flush's own device time, median of 5)."""
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    with torch.inference_mode():
        for i in range(max(1, warmup)):
            fn(inputs[i % len(inputs)])
        torch.cuda.synchronize(device)
        runners = [lambda x=x: fn(x) for x in inputs]
        if graph:
            runners = [graph_replay(r, device) for r in runners]
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        if stats is not None:
            fl = []
            for i in range(5):
                starts[0].record()
                flush.fill_(i)
                ends[0].record()
                torch.cuda.synchronize(device)
                fl.append(1e3 * starts[0].elapsed_time(ends[0]))
            stats["flush_us"], stats["host_us"] = statistics.median(fl), []
        for i in range(reps):
            flush.fill_(i)
            starts[i].record()
            t0 = time.perf_counter()
            runners[i % len(runners)]()
            t1 = time.perf_counter()
            ends[i].record()
            if stats is not None:
                stats["host_us"].append(1e6 * (t1 - t0))
        torch.cuda.synchronize(device)
    return [1e3 * s.elapsed_time(e) for s, e in zip(starts, ends)]


def rotation_count(B: int, T: int, H: int, budget_bytes: int = 2 << 30) -> int:
    one = traffic(B, T, H)[0]
    return int(max(1, min(4, budget_bytes // max(one, 1))))


def bench_one(backend, route: str, shape: tuple, device, reps: int = 50, warmup: int = 5,
              graph: bool = False, seed: int = 0, name: Optional[str] = None) -> BenchResult:
    """One cell: ``route_call(backend, route)`` timed by ``time_call`` on ``rotation_count``
    bench Problems of ``shape`` (B, T, H); a failure anywhere is the cell's ``error``.  ``backend``:
    a name or a loaded Backend (``name``, else its own name, labels the result)."""
    B, T, H = shape
    nbytes, flops = traffic(B, T, H)
    base = dict(backend=name or (backend if isinstance(backend, str) else backend.name), route=route, B=B, T=T, H=H, reps=reps, graph=graph, bytes=nbytes, flops=flops,
                floor_us=floor_us(B, T, H))
    try:
        fn = route_call(backend, route)
        inputs = [bench_problem(B, T, H, device, seed + i) for i in range(rotation_count(B, T, H))]
        ok, why = fn.backend.accepts(inputs[0], fn.route)
        if not ok:
            raise ValueError(why)
        stats: dict = {}
        times = time_call(fn, inputs, reps, warmup, graph, device, stats=stats)
    except Exception as e:  # noqa: BLE001 - one failing cell is a result, not the end of the bench
        msg = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        return BenchResult(**base, time_us=math.nan, p10_us=math.nan, p90_us=math.nan, bandwidth_gbs=math.nan,
                           tflops=math.nan, error=msg)
    finally:
        torch.cuda.empty_cache()
    t = statistics.median(times)
    q = statistics.quantiles(times, n=10) if len(times) >= 2 else [t] * 9
    host_us = statistics.median(stats["host_us"]) if stats.get("host_us") else math.nan
    return BenchResult(**base, time_us=t, p10_us=q[0], p90_us=q[-1], bandwidth_gbs=nbytes / (t * 1e-6) / 1e9,
                       tflops=flops / (t * 1e-6) / 1e12, route_ran=fn.info.get("route_ran", route),
                       host_us=host_us, host_bound=is_host_bound(t, host_us, stats.get("flush_us", math.nan), graph))


def pass_times(route: str, shape: tuple, device, reps: int = 20, warmup: int = 3, seed: int = 0,
               graph: bool = False) -> dict:
    """Median time (us) of each pass of our Triton FlashKDA on one shape, each pass launched alone
    on the workspace of the same inputs: ``k1``, ``A``, ``B``, ``C`` (segmented routes; ``C``
    only when the plan is unsegmented) and ``total`` (the whole forward), plus ``cps`` and
    ``segments`` of the plan that ran; ``bytes`` and ``floors`` (us), per pass, its minimum HBM
    traffic and bandwidth floor (``pass_traffic``, ``pass_floors``), ``design_floor`` (the sum
    of the passes' floors) and ``floor`` (the forward's, ``floor_us``).  CUDA: ``time_call``, as
    for the whole forward (events around the pass, the L2 flushed before each repetition); with
    ``graph`` each pass is captured in a CUDA graph and its replay timed, so the host's launch
    cost (Python, argument packing) is left out;
    CPU (Triton's interpreter, for tests): wall time (``graph`` ignored)."""
    # lazy: kda_kernels.triton builds its kernels at import (docs/design.md, Imports)
    from kda_kernels.triton import forward as fw
    from kda_kernels.triton.routes import parse_route

    B, T, H = shape
    p = bench_problem(B, T, H, device, seed)
    x = kernel_inputs(p)
    spec = parse_route(route)
    plan = fw.resolve_plan(spec, B, T, H, None, device)
    ws = fw.alloc_workspace(H, plan.total_tiles, device)
    cuda = torch.device(device).type == "cuda"

    def med(fn):
        if cuda:        # the same timing loop as the whole forward's (time_call)
            return statistics.median(time_call(lambda _x: fn(), [None], reps, warmup, graph, device))
        for _ in range(max(1, warmup)):
            fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(1e6 * (time.perf_counter() - t0))
        return statistics.median(ts)

    k1 = lambda: fw.run_k1(x["q"], x["k"], x["g"], x["beta"], x["A_log"], x["dt_bias"], x["scale"],  # noqa: E731
                           x["lower_bound"], plan, ws, inv=spec.inv, k1=spec.k1)
    nbytes = pass_traffic(plan, H, spec, {n: x[n].element_size() for n in INPUT_BYTES})
    floors = pass_floors(nbytes)
    out = {"cps": plan.cps, "segments": plan.num_segs, "bytes": nbytes, "floors": floors,
           "design_floor": sum(floors.values()), "floor": floor_us(B, T, H), "k1": med(k1)}
    o = torch.empty_like(x["v"])
    final = fw.dense_state(torch.empty(plan.N, H, K, V, device=device), "kv")
    with torch.inference_mode():
        if plan.segmented:
            a_args = (ws, x["v"], plan, H, spec.pass_a, spec.bw, spec.warps, spec.scan)
            A_seg, b_seg = fw.run_pass_a(*a_args)
            out["A"] = med(lambda: fw.run_pass_a(*a_args))
            b_args = (A_seg, b_seg, plan, H, None, spec.pass_b == "prefetch", fw.SCAN_BW, spec.warps, spec.scan)
            h_in = fw.run_pass_b(*b_args)
            out["B"] = med(lambda: fw.run_pass_b(*b_args))
            out["C"] = med(lambda: fw.run_pass_c(ws, x["v"], o, plan, H, h_in=h_in, final=final, bw=spec.bw,
                                                 warps=spec.warps))
        else:
            out["C"] = med(lambda: fw.run_pass_c(ws, x["v"], o, plan, H, final=final, bw=spec.bw, warps=spec.warps))
        call = route_call("triton", route)
        out["total"] = med(lambda: call(p))
    return out


def geomean(xs) -> float:
    xs = [x for x in xs if x and math.isfinite(x) and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def side_by_side(results: list) -> tuple[list, dict]:
    """The side-by-side table of one run: (columns, rows).  columns: every (backend, route) in the
    order first seen; rows: {(B, T, H): {"floor_us": f, (backend, route): BenchResult}}."""
    cols, rows = [], {}
    for r in results:
        key = (r.backend, r.route)
        if key not in cols:
            cols.append(key)
        row = rows.setdefault((r.B, r.T, r.H), {"floor_us": r.floor_us})
        row[key] = r
    return cols, rows


def speedups(results: list, baseline_backend: str = "fla") -> dict:
    """{(backend, route): {"per_shape": {shape: speedup}, "geomean": g}} against the baseline's
    best route per shape."""
    base = {}
    for r in results:
        if r.backend == baseline_backend and math.isfinite(r.time_us):
            key = (r.B, r.T, r.H)
            base[key] = min(base.get(key, math.inf), r.time_us)
    out = {}
    for r in results:
        if r.backend == baseline_backend or not math.isfinite(r.time_us):
            continue
        key = (r.B, r.T, r.H)
        if key in base:
            d = out.setdefault((r.backend, r.route), {"per_shape": {}})
            d["per_shape"][key] = base[key] / r.time_us
    for d in out.values():
        d["geomean"] = geomean(d["per_shape"].values())
    return out
