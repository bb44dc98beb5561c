"""`kda-verify oracle-bench`: how fast the float64 oracle runs on a device, and in how much memory.

Per shape (B, T, H) with K = V = 128, the truth as ``kda_ref.truth.truth`` computes it by default
(the chunked form streamed block by block): its time, its peak memory (CUDA: the allocator's
peak; CPU: the process's resident set sampled every 2 ms, during a run of its own before the timed
ones, so that the sampling thread never shares the cores with a timed run) and its rate, the
matmul FLOPs of the chunked form per (chunk, value head)

    4 C^2 K (KK, QK grams) + C^3 / 3 (triangular solve) + 6 C K V (kd S, kr^T U, qd S) + 4 C^2 V (inv u, mqk U)

divided by the time, as a fraction of the float64 matmul ceiling (56.5 TFLOP/s on the H200) and of
a torch float64 matmul measured in the same run (n = 8192 on CUDA, 1024 on the CPU; sampled beside
every timed repetition of the truth, the best rate kept, as the best truth is).  With
``--phases`` also the whole-problem forms (every chunk's workspace at once) phase by phase:
preprocessing, workspace, segments (passes A, B, C), the unsegmented chunked forward.  The token
recurrence (all T tokens, or ``--recurrence-tokens N`` extrapolated linearly to T, and said so)
unless ``--no-recurrence``; when it ran on all tokens the truth is held to it.
"""
from __future__ import annotations

import json
import os
import threading
import time

from verification.judging.policy import exit_code

NAME = "oracle-bench"
HELP = "time the float64 oracle (recurrence and workspace + segments + chunked) on a device"
EXAMPLES = """\
kda-verify oracle-bench --device cuda   # needs: cuda
kda-verify oracle-bench --shapes 1x1024x2 --device cpu --recurrence-tokens 128 --repeat 1 --json
kda-verify oracle-bench --shapes 1x1024x2 --device cpu --no-recurrence --repeat 1 --phases
kda-verify oracle-bench --shapes 1x131072x12,1x262144x12,1x1048576x12,1x131072x96 --device cuda --no-recurrence   # needs: cuda
"""

H200_FP64_TFLOPS = 56.5
DEFAULT_SHAPES = "1x16384x96,1x65536x12"


def add_arguments(parser):
    parser.add_argument("--device", default=None, metavar="DEVICE",
                        help="cpu or cuda[:N] (default: cuda if available, else cpu)")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, metavar="SHAPES", help=f"BxTxH,... (default {DEFAULT_SHAPES})")
    parser.add_argument("--K", type=int, default=128, metavar="K", help="key head dimension K (default 128)")
    parser.add_argument("--V", type=int, default=128, metavar="V", help="value head dimension V (default 128)")
    parser.add_argument("--chunk-size", type=int, default=64, metavar="C",
                        help="workspace chunk size (16, 32, 64; default 64)")
    parser.add_argument("--chunks-per-seg", type=int, default=16, metavar="N",
                        help="chunks per segment of passes A/B/C (default 16)")
    parser.add_argument("--recurrence-tokens", type=int, default=None, metavar="N",
                        help="time the recurrence on the first N tokens only and extrapolate to T")
    parser.add_argument("--no-recurrence", action="store_true", help="skip the recurrence")
    parser.add_argument("--repeat", type=int, default=2, metavar="N",
                        help="timed repetitions of the chunked truth, best kept (default 2)")
    parser.add_argument("--peak-tflops", type=float, default=H200_FP64_TFLOPS, metavar="TFLOPS",
                        help="the float64 matmul ceiling to report against (default 56.5, the H200)")
    parser.add_argument("--phases", action="store_true",
                        help="also time the whole-problem forms phase by phase (they hold every chunk at once)")
    parser.add_argument("--block-tokens", type=int, default=None, metavar="N",
                        help="tokens per block of the streamed truth (default: from kda_ref.budget.block_budget, the device's memory shared among its workers)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def parse_shapes(text: str):
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.errors import UsageError
    out = []
    for part in text.split(","):
        bits = part.strip().lower().split("x")
        try:
            B, T, H = (int(b) for b in bits)
        except ValueError:
            raise UsageError(f"--shapes: expected BxTxH[,BxTxH...] like 1x16384x96, got {part.strip()!r}") from None
        if min(B, T, H) < 1:
            raise UsageError(f"--shapes: expected positive B, T, H, got {part.strip()!r}")
        out.append((B, T, H))
    return out


def _sync(dev):
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(fn, dev):
    _sync(dev)
    t0 = time.perf_counter()
    r = fn()
    _sync(dev)
    return r, time.perf_counter() - t0


def matmul_tflops(dev, n: int = 8192, reps: int = 3) -> float:
    """Measured float64 matmul rate (TFLOP/s) of an n x n product on the device."""
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    import torch
    if dev.type == "cpu":
        n = 1024
    a = torch.randn(n, n, dtype=torch.float64, device=dev)
    b = torch.randn(n, n, dtype=torch.float64, device=dev)
    (a @ b)
    best = float("inf")
    for _ in range(reps):
        _, t = _timed(lambda: a @ b, dev)
        best = min(best, t)
    return 2 * n ** 3 / best / 1e12


def make_problem(B, T, H, K, V, dev, seed=0):
    """A production-like problem built on the device: the generator's (kda_ref.problems) fp32
    q, k, v, g = N(0,1) (g_scale 1), lower-bound gate at -5, a kv initial state 0.5 N(0,1), drawn
    by the device's generator."""
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    import torch

    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from kda_ref.problems import ProblemSpec, generate
    return generate(ProblemSpec(B=B, T=T, H=H, K=K, V=V, g_scale=1.0, dtype=torch.float32, state="kv", seed=seed,
                                draw="device"), device=dev)


def chunked_flops(tiles_heads: int, segs_heads: int, C: int, K: int, V: int) -> float:
    """Matmul FLOPs of workspace + passes A, B, C + the unsegmented chunked forward."""
    ws = 2 * (2 * C * C * K) + C ** 3 / 3                      # KK, QK grams; triangular solve
    step_out = 2 * C * K * V * 3 + 2 * C * C * V * 2             # kd S, qd S, kr^T U; inv u, mqk U
    W = K + V
    step_a = 2 * C * K * W * 2 + 2 * C * C * W                  # pass A on [A | b]: kd X, kr^T U; inv u
    return tiles_heads * (ws + step_a + 2 * step_out) + segs_heads * 2 * K * K * V


def truth_flops(tiles_heads: int, C: int, K: int, V: int) -> float:
    """Matmul FLOPs of the chunked truth: workspace grams and solve, then the chunk steps."""
    return tiles_heads * (4 * C * C * K + C ** 3 / 3 + 6 * C * K * V + 4 * C * C * V)


class PeakMemory:
    """Peak memory during a block of code, in bytes: CUDA, the allocator's peak above what was
    allocated at entry; CPU, the largest resident set of this process (sampled every 2 ms) and
    its rise above the resident set at entry."""

    def __init__(self, dev):
        self.dev = dev
        self.peak = self.base = 0

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self):

        # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
        import torch
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.dev)
            self.base = torch.cuda.memory_allocated(self.dev)
            return self
        self.base = self.peak = self.rss()
        self._stop = threading.Event()

        def sample():
            while not self._stop.wait(0.002):
                self.peak = max(self.peak, self.rss())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
        import torch
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
            self.peak = torch.cuda.max_memory_allocated(self.dev)
            return False
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())
        return False


def bench_shape(B, T, H, args, dev) -> dict:
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    import torch

    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from kda_ref.chunked import chunked_from_workspace
    from kda_ref.preprocess import prepare
    from kda_ref.problem import validate
    from kda_ref.recurrence import recurrence_prepared
    from kda_ref.segments import segmented
    from kda_ref.truth import truth
    from kda_ref.workspace import workspace_prepared

    K, V, C = args.K, args.V, args.chunk_size
    p = validate(make_problem(B, T, H, K, V, dev))
    tiles = B * -(-T // C)
    res = {"shape": [B, T, H], "K": K, "V": V, "C": C, "device": str(dev), "tiles": tiles,
           "block_tokens": args.block_tokens}
    best = None
    truth_o = truth_final = None
    mm_best = 0.0
    run = lambda: truth(p, chunk_size=C, block_tokens=args.block_tokens)  # noqa: E731
    cpu_peak = None
    if dev.type != "cuda":
        # the CPU's peak is sampled by a thread that would share the cores with a timed truth, so it
        # is taken on a run of its own, before the timed ones
        with PeakMemory(dev) as mem:
            run()
        cpu_peak = (mem.peak, mem.peak - mem.base)
    for _ in range(args.repeat):
        truth_o = truth_final = None            # the previous repetition's truth is not held while this one runs
        # the matmul rate is sampled beside every repetition, so that both bests come from the same
        # stretch of time (on a shared machine the rate drifts from one minute to the next)
        mm_best = max(mm_best, matmul_tflops(dev))
        if cpu_peak is None:
            with PeakMemory(dev) as mem:
                t, secs = _timed(run, dev)
            peak = (mem.peak, mem.peak - mem.base)
        else:
            t, secs = _timed(run, dev)
            peak = cpu_peak
        if best is None or secs < best["truth_s"]:
            best = {"truth_s": secs, "peak_bytes": peak[0], "peak_rise_bytes": peak[1]}
        if args.phases:                         # kept only to compare the whole-problem forms with it
            truth_o, truth_final = t.o.reshape(-1, H, V), t.final_state
        del t
    res.update(best)
    res["fp64_matmul_tflops"] = mm_best
    res["peak_gib"] = best["peak_bytes"] / 2 ** 30
    res["peak_kind"] = "allocated" if dev.type == "cuda" else "resident set"
    flops = truth_flops(tiles * H, C, K, V)
    res["gflop"] = flops / 1e9
    res["tflops"] = flops / best["truth_s"] / 1e12
    if args.phases:
        res["chunks_per_seg"] = args.chunks_per_seg
        ph = None
        for _ in range(args.repeat):
            with PeakMemory(dev) as mem:
                pp, t_pre = _timed(lambda: prepare(p), dev)
                ws, t_ws = _timed(lambda: workspace_prepared(pp, C), dev)
                seg, t_seg = _timed(lambda: segmented(pp, ws, args.chunks_per_seg), dev)
                out, t_ch = _timed(lambda: chunked_from_workspace(pp, ws), dev)
            total = t_pre + t_ws + t_seg + t_ch
            if ph is None or total < ph["total_s"]:
                ph = {"prepare_s": t_pre, "workspace_s": t_ws, "segments_s": t_seg, "chunked_s": t_ch,
                      "total_s": total, "segs": seg.plan.segs, "peak_gib": mem.peak / 2 ** 30}
            ph["segmented_vs_chunked_rel"] = float((seg.o - out[0]).norm() / out[0].norm())
            ph["streamed_vs_chunked_rel"] = max(float((truth_o - out[0]).norm() / out[0].norm()),
                                                float((truth_final - out[1].reshape(truth_final.shape)).norm()
                                                      / out[1].norm()))
            del pp, ws, seg, out
        pflops = chunked_flops(tiles * H, ph["segs"] * H, C, K, V)
        ph["gflop"] = pflops / 1e9
        ph["tflops"] = pflops / ph["total_s"] / 1e12
        res["phases"] = ph
    if not args.no_recurrence:
        n = T if args.recurrence_tokens is None else min(T, args.recurrence_tokens)
        pr = p if n == T else p.replace(q=p.q[:, :n], k=p.k[:, :n], v=p.v[:, :n], g=p.g[:, :n], beta=p.beta[:, :n])
        pp = prepare(pr)
        rec, t_rec = _timed(lambda: recurrence_prepared(pp), dev)
        res["recurrence_tokens"] = n
        res["recurrence_s"] = t_rec * T / n
        res["recurrence_extrapolated"] = n != T
        if n == T:   # the full recurrence ran: hold the truth to it on this device
            res["truth_vs_recurrence_rel"] = max(
                float((truth_o - rec.o).norm() / rec.o.norm()),
                float((truth_final - rec.final_state.reshape(truth_final.shape)).norm() / rec.final_state.norm()))
    return res


def run(args) -> int:
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    import torch

    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.running.devices import check_device
    from verification.errors import UsageError
    if args.chunk_size not in (16, 32, 64):
        raise UsageError(f"--chunk-size: expected 16, 32 or 64, got {args.chunk_size}")
    if args.recurrence_tokens is not None and args.recurrence_tokens < 1:
        raise UsageError(f"--recurrence-tokens: expected a positive integer, got {args.recurrence_tokens}")
    if args.repeat < 1:
        raise UsageError(f"--repeat: expected an integer >= 1, got {args.repeat}")
    if args.chunks_per_seg < 1:
        raise UsageError(f"--chunks-per-seg: expected an integer >= 1, got {args.chunks_per_seg}")
    if not args.peak_tflops > 0:
        raise UsageError(f"--peak-tflops: expected a number > 0, got {args.peak_tflops:g}")
    if args.block_tokens is not None and args.block_tokens < args.chunk_size:
        raise UsageError(f"--block-tokens: expected at least one chunk ({args.chunk_size} tokens), got {args.block_tokens}")
    dev = torch.device(check_device(args.device))
    shapes = parse_shapes(args.shapes)
    mm = matmul_tflops(dev)
    report = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "torch": torch.__version__, "fp64_matmul_tflops_measured": mm, "fp64_peak_tflops": args.peak_tflops,
              "results": []}
    for B, T, H in shapes:
        r = bench_shape(B, T, H, args, dev)
        mm = max(mm, r["fp64_matmul_tflops"])      # the best rate seen so far, this shape's samples included
        report["fp64_matmul_tflops_measured"] = mm
        r["fraction_of_peak"] = r["tflops"] / args.peak_tflops
        r["fraction_of_measured_matmul"] = r["tflops"] / mm
        r["matmul_time_s"] = r["gflop"] / 1e3 / mm
        if "phases" in r:
            r["phases"]["fraction_of_measured_matmul"] = r["phases"]["tflops"] / mm
        report["results"].append(r)
        if not args.json:
            _print(r)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"float64 matmul measured here: {mm:.2f} TFLOP/s (ceiling used: {args.peak_tflops} TFLOP/s); "
              f"device {report['device']}, torch {report['torch']}")
    return exit_code()


def _print(r):
    B, T, H = r["shape"]
    blk = "default blocks" if r["block_tokens"] is None else f"blocks of {r['block_tokens']} tokens"
    print(f"({B},{T},{H}) K={r['K']} V={r['V']} C={r['C']} on {r['device']}: tiles={r['tiles']}")
    print(f"  truth (streamed, {blk}): {r['truth_s']:.3f} s, peak {r['peak_gib']:.2f} GiB {r['peak_kind']}; "
          f"{r['gflop']:.1f} GFLOP of matmuls -> {r['tflops']:.3f} TFLOP/s = {100 * r['fraction_of_peak']:.2f}% of "
          f"the fp64 ceiling, {100 * r['fraction_of_measured_matmul']:.1f}% of the measured fp64 matmul "
          f"(that work as matmuls: {r['matmul_time_s']:.3f} s; truth / matmul {r['truth_s'] / r['matmul_time_s']:.2f}x)")
    if "phases" in r:
        ph = r["phases"]
        print(f"  whole-problem forms (prepare + workspace + segments cps={r['chunks_per_seg']} + chunked): "
              f"{ph['total_s']:.3f} s [prepare {ph['prepare_s']:.3f}, workspace {ph['workspace_s']:.3f}, segments "
              f"A/B/C {ph['segments_s']:.3f}, chunked {ph['chunked_s']:.3f}], peak {ph['peak_gib']:.2f} GiB; "
              f"{ph['gflop']:.1f} GFLOP, {100 * ph['fraction_of_measured_matmul']:.1f}% of the measured fp64 matmul; "
              f"segmented vs chunked o {ph['segmented_vs_chunked_rel']:.2e}, streamed vs chunked "
              f"{ph['streamed_vs_chunked_rel']:.2e}")
    if "recurrence_s" in r:
        how = (f"extrapolated from {r['recurrence_tokens']} tokens" if r["recurrence_extrapolated"]
               else "all tokens")
        print(f"  recurrence: {r['recurrence_s']:.2f} s ({how})"
              + (f"; truth vs recurrence (o, state): {r['truth_vs_recurrence_rel']:.2e}"
                 if "truth_vs_recurrence_rel" in r else ""))
