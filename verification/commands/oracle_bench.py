"""`kda-verify oracle-bench`: how fast the float64 oracle runs on a device.

Times, per shape (B, T, H) with K = V = 128: the token recurrence (all T tokens, or
``--recurrence-tokens N`` tokens extrapolated linearly to T, and said so), and the whole
chunked truth: preprocessing + workspace + segments (passes A, B, C) + the unsegmented chunked
forward, phase by phase.  The chunked form's useful float64 FLOPs (matmuls only) are divided by
its time and reported as a fraction of the float64 matmul ceiling (56.5 TFLOP/s on the H200)
and of a torch float64 matmul measured in the same run.
"""
from __future__ import annotations

import json
import time

NAME = "oracle-bench"
HELP = "time the float64 oracle (recurrence and workspace + segments + chunked) on a device"
EXAMPLES = """\
kda-verify oracle-bench --device cuda
kda-verify oracle-bench --shapes 1x2048x4 --device cpu --recurrence-tokens 256 --json
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
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def parse_shapes(text: str):
    from verification.cli import UsageError
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
    """A production-like problem (lower-bound gate at -5, float32 inputs) built on the device."""
    import torch

    from kda_ref.problem import Problem
    g = torch.Generator(device=dev).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device=dev, dtype=torch.float32)  # noqa: E731
    return Problem(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, V), g=r(B, T, H, K), beta=r(B, T, H),
                   A_log=0.5 * r(H).abs(), dt_bias=0.1 * r(H * K), lower_bound=-5.0,
                   initial_state=0.5 * r(B, H, K, V))


def chunked_flops(tiles_heads: int, segs_heads: int, C: int, K: int, V: int) -> float:
    """Matmul FLOPs of workspace + passes A, B, C + the unsegmented chunked forward."""
    ws = 2 * (2 * C * C * K) + C ** 3 / 3                      # KK, QK grams; triangular solve
    step_out = 2 * C * K * V * 3 + 2 * C * C * V * 2             # kd S, qd S, kr^T U; inv u, mqk U
    W = K + V
    step_a = 2 * C * K * W * 2 + 2 * C * C * W                  # pass A on [A | b]: kd X, kr^T U; inv u
    return tiles_heads * (ws + step_a + 2 * step_out) + segs_heads * 2 * K * K * V


def bench_shape(B, T, H, args, dev) -> dict:
    import torch

    from kda_ref.chunked import chunked_from_workspace
    from kda_ref.preprocess import prepare
    from kda_ref.problem import validate
    from kda_ref.recurrence import recurrence_prepared
    from kda_ref.segments import segmented
    from kda_ref.workspace import workspace_prepared

    K, V, C = args.K, args.V, args.chunk_size
    p = validate(make_problem(B, T, H, K, V, dev))
    res = {"shape": [B, T, H], "K": K, "V": V, "C": C, "chunks_per_seg": args.chunks_per_seg, "device": str(dev)}
    best = None
    for _ in range(max(1, args.repeat)):
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        pp, t_pre = _timed(lambda: prepare(p), dev)
        ws, t_ws = _timed(lambda: workspace_prepared(pp, C), dev)
        seg, t_seg = _timed(lambda: segmented(pp, ws, args.chunks_per_seg), dev)
        out, t_ch = _timed(lambda: chunked_from_workspace(pp, ws), dev)
        total = t_pre + t_ws + t_seg + t_ch
        if best is None or total < best["total_s"]:
            best = {"prepare_s": t_pre, "workspace_s": t_ws, "segments_s": t_seg, "chunked_s": t_ch, "total_s": total,
                    "tiles": ws.tiles, "segs": seg.plan.segs}
            if dev.type == "cuda":
                best["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2 ** 30
        agree = float((seg.o - out[0]).norm() / out[0].norm())
        chunked_o, chunked_final = out
        del pp, ws, seg, out
    res.update(best)
    res["segmented_vs_chunked_rel"] = agree
    flops = chunked_flops(best["tiles"] * H, best["segs"] * H, C, K, V)
    res["gflop"] = flops / 1e9
    res["tflops"] = flops / best["total_s"] / 1e12
    if not args.no_recurrence:
        n = T if args.recurrence_tokens is None else min(T, args.recurrence_tokens)
        pr = p if n == T else p.replace(q=p.q[:, :n], k=p.k[:, :n], v=p.v[:, :n], g=p.g[:, :n], beta=p.beta[:, :n])
        pp = prepare(pr)
        rec, t_rec = _timed(lambda: recurrence_prepared(pp), dev)
        res["recurrence_tokens"] = n
        res["recurrence_s"] = t_rec * T / n
        res["recurrence_extrapolated"] = n != T
        if n == T:   # the full recurrence ran: hold the chunked truth to it on this device
            res["chunked_vs_recurrence_rel"] = max(
                float((chunked_o - rec.o).norm() / rec.o.norm()),
                float((chunked_final - rec.final_state).norm() / rec.final_state.norm()))
    return res


def run(args) -> int:
    import torch

    from verification.commands.oracle import check_device
    from verification.cli import UsageError
    if args.chunk_size not in (16, 32, 64):
        raise UsageError(f"--chunk-size: expected 16, 32 or 64, got {args.chunk_size}")
    if args.recurrence_tokens is not None and args.recurrence_tokens < 1:
        raise UsageError(f"--recurrence-tokens: expected a positive integer, got {args.recurrence_tokens}")
    dev = check_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shapes = parse_shapes(args.shapes)
    mm = matmul_tflops(dev)
    report = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "torch": torch.__version__, "fp64_matmul_tflops_measured": mm, "fp64_peak_tflops": args.peak_tflops,
              "results": []}
    for B, T, H in shapes:
        r = bench_shape(B, T, H, args, dev)
        r["fraction_of_peak"] = r["tflops"] / args.peak_tflops
        r["fraction_of_measured_matmul"] = r["tflops"] / mm
        report["results"].append(r)
        if not args.json:
            _print(r)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"float64 matmul measured here: {mm:.2f} TFLOP/s (ceiling used: {args.peak_tflops} TFLOP/s); "
              f"device {report['device']}, torch {report['torch']}")
    return 0


def _print(r):
    B, T, H = r["shape"]
    print(f"({B},{T},{H}) K={r['K']} V={r['V']} C={r['C']} cps={r['chunks_per_seg']} on {r['device']}: "
          f"tiles={r['tiles']} segs={r['segs']}")
    print(f"  truth (prepare + workspace + segments + chunked): {r['total_s']:.3f} s  "
          f"[prepare {r['prepare_s']:.3f}, workspace {r['workspace_s']:.3f}, segments A/B/C {r['segments_s']:.3f}, "
          f"chunked {r['chunked_s']:.3f}]" + (f", peak {r['peak_gib']:.1f} GiB" if "peak_gib" in r else ""))
    print(f"  {r['gflop']:.1f} GFLOP of matmuls -> {r['tflops']:.3f} TFLOP/s = {100 * r['fraction_of_peak']:.2f}% of "
          f"the fp64 ceiling, {100 * r['fraction_of_measured_matmul']:.1f}% of the measured fp64 matmul; "
          f"segmented vs chunked o: {r['segmented_vs_chunked_rel']:.2e}")
    if "recurrence_s" in r:
        how = (f"extrapolated from {r['recurrence_tokens']} tokens" if r["recurrence_extrapolated"]
               else "all tokens")
        print(f"  recurrence: {r['recurrence_s']:.2f} s ({how})"
              + (f"; chunked truth vs recurrence (o, state): {r['chunked_vs_recurrence_rel']:.2e}"
                 if "chunked_vs_recurrence_rel" in r else ""))
