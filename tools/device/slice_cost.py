"""Time the per-slice metrics against the rest of tensor_metrics, side by side in one process.

    python tools/device/slice_cost.py [--device DEVICE] [--shapes "BxTxH;..."] [--reps N]

For each shape (K = V = 128, lb -5, the exact truth rounded to bf16 as the output) it times
``tensor_metrics`` of o and of the final state with the slices and with ``_slices_pending`` (where
``tensor_metrics`` queues them) stubbed out, alternating the two, and prints the medians and the
slices' share.  A stub that no longer removes the slices (the metrics reorganised) is an error,
never a share of 0."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import verification.judging.metrics as metrics
from kda_ref.truth import truth
from verification.running.cases import build_problem


def _sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default="1x2048x12;1x16384x12;1x16384x96;8x2048x16")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    real = metrics._slices_pending
    off = (lambda *args, **kw: None)
    print(f"{'shape':>12} {'with slices ms':>15} {'without ms':>11} {'slices share':>13}")
    for shape in a.shapes.split(";"):
        B, T, H = (int(x) for x in shape.split("x"))
        p = build_problem({"B": B, "T": T, "H": H, "lb": -5.0}, seed=1, device=a.device)
        tr = truth(p)
        o, fs = tr.o.to(torch.bfloat16), tr.final_state.float()
        times = {True: [], False: []}
        try:
            for _ in range(a.reps):
                for with_slices in (True, False):
                    metrics._slices_pending = real if with_slices else off
                    _sync(a.device)
                    t0 = time.perf_counter()
                    got = [metrics.tensor_metrics(o, tr.o, dtype=o.dtype, problem=p, tensor="o"),
                           metrics.tensor_metrics(fs, tr.final_state, dtype=fs.dtype, problem=p, tensor="final_state")]
                    _sync(a.device)
                    times[with_slices].append(time.perf_counter() - t0)
                    if any(("slices" in m) != with_slices for m in got):
                        raise SystemExit(f"slice_cost: stubbing metrics._slices_pending did not {'keep' if with_slices else 'remove'} "
                                         "the slices; tensor_metrics no longer queues them there")
        finally:
            metrics._slices_pending = real
        w, wo = statistics.median(times[True]) * 1e3, statistics.median(times[False]) * 1e3
        print(f"{shape:>12} {w:>15.2f} {wo:>11.2f} {100 * (w - wo) / w:>12.1f}%", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
