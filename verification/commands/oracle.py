"""`kda-verify oracle`: write the float64 truth of a problem file."""
from __future__ import annotations

import time

from verification.judging.policy import exit_code
from verification.running.devices import check_device

NAME = "oracle"
HELP = "compute the float64 truth (o, final state or state cache; optionally ws_* and segments) of a problem file"
EXAMPLES = """\
kda-verify oracle --inputs p.safetensors --out truth.safetensors
kda-verify oracle --inputs p.safetensors --out truth.safetensors --workspace
kda-verify oracle --inputs p.safetensors --out truth.safetensors --method segmented --chunks-per-seg 4
"""


def add_arguments(parser):
    parser.add_argument("--inputs", required=True, metavar="PATH", help="problem file (safetensors, see docs/problem-files.md)")
    parser.add_argument("--out", required=True, metavar="PATH", help="truth file to write (safetensors)")
    parser.add_argument("--device", default=None, metavar="DEVICE",
                        help="cpu or cuda[:N] (default: cuda if available, else cpu)")
    parser.add_argument("--workspace", action="store_true",
                        help="also write ws_* (production layout), ws_pivot, ws_cond1 and the segment tensors")
    parser.add_argument("--method", default="chunked", choices=("chunked", "segmented", "recurrence", "fla"),
                        help="which float64 form computes o and the state (default chunked)")
    parser.add_argument("--chunk-size", type=int, default=64, metavar="C",
                        help="chunk size C of the workspace (16, 32, 64; default 64)")
    parser.add_argument("--chunks-per-seg", type=int, default=None, metavar="N",
                        help="chunks per segment for the segment tensors / segmented method (default: one per sequence)")


def run(args) -> int:
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    import torch

    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from kda_ref.truth import truth
    from verification.errors import UsageError
    from verification.reporting.problem_file import load_problem, save_outputs

    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.errors import writable_file
    dev = torch.device(check_device(args.device))
    writable_file(args.out, "--out")
    if args.chunk_size not in (16, 32, 64) or (args.method == "fla" and args.chunk_size not in (32, 64)):
        allowed = "32 or 64 (fla)" if args.method == "fla" else "16, 32 or 64"
        raise UsageError(f"--chunk-size: expected {allowed}, got {args.chunk_size}")
    if args.chunks_per_seg is not None and args.chunks_per_seg < 1:
        raise UsageError(f"--chunks-per-seg: expected an integer >= 1, got {args.chunks_per_seg}")
    p = load_problem(args.inputs).to(dev)
    # the chunked form runs streamed (block by block, the same chunk steps) unless the whole
    # workspace is asked for
    streamed = args.method == "chunked" and not args.workspace
    t0 = time.perf_counter()
    t = truth(p, method="streamed" if streamed else args.method, chunk_size=args.chunk_size,
              chunks_per_seg=args.chunks_per_seg, workspace=args.workspace)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    secs = time.perf_counter() - t0
    tensors = {n: x.detach().cpu() for n, x in t.tensors().items()}
    meta = {"method": args.method, "chunk_size": str(args.chunk_size),
            "chunks_per_seg": "none" if args.chunks_per_seg is None else str(args.chunks_per_seg),
            "streamed": "yes" if streamed else "no", "device": str(dev), "seconds": f"{secs:.3f}", "problem": p.describe(), "inputs": args.inputs,
            "torch": torch.__version__, "dtype": "float64"}
    save_outputs(args.out, tensors, meta)
    print(f"wrote {args.out}: {', '.join(f'{n} {list(x.shape)}' for n, x in tensors.items())} "
          f"({args.method}, {secs:.2f} s on {dev})")
    return exit_code()
