"""`kda-verify capture`: run one backend route on a problem file and save its outputs.

    kda-verify capture --backend B [--route R] --inputs P --out O [--device D] [--taps]

The outputs file holds ``o`` and ``final_state`` (or ``state_cache``), and with ``--taps``
the stored inverse ``ws_inv`` when the backend returns it, so ``kda-verify check`` can judge
them on any machine.  Exit 0 when saved, 2 on bad input or a backend that cannot run.
"""
from __future__ import annotations

NAME = "capture"
HELP = "run a backend route on a problem file and save its outputs (for kda-verify check)"
EXAMPLES = """\
kda-verify capture --backend triton --route seg --inputs p.safetensors --out o.safetensors
kda-verify capture --backend triton --route unseg --inputs p.safetensors --out o.safetensors --taps
"""


def add_arguments(p):
    p.add_argument("--backend", required=True, metavar="BACKEND", help="built-in name or package.module:factory")
    p.add_argument("--route", default=None, metavar="ROUTE", help="route name (default: the backend's first route)")
    p.add_argument("--inputs", required=True, metavar="PATH", help="problem file (kda-verify-problem/1)")
    p.add_argument("--out", required=True, metavar="PATH", help="output file to write (kda-verify-outputs/1)")
    p.add_argument("--device", default=None, metavar="DEVICE", help="device to run on (default: cuda if available, else cpu)")
    p.add_argument("--taps", action="store_true", help="also save the ws_inv tap when the backend returns one")


def run(args) -> int:
    import inspect

    import torch

    from kda_kernels.base import BackendError, load_backend
    from kda_ref.problem import validate
    from verification.cli import UsageError
    from verification.problem_file import load_problem, save_outputs

    from verification.errors import writable_file

    writable_file(args.out, "--out")
    backend = load_backend(args.backend)
    ok, why = backend.available()
    if not ok:
        raise BackendError(f"--backend: {backend.name} cannot run here: {why}")
    routes = backend.routes()
    if not routes:
        raise BackendError(f"--backend: {backend.name} has no routes here")
    if args.route is None:
        route = routes[0]
    else:
        match = [r for r in routes if r.name == args.route]
        if not match:
            raise UsageError(f"--route: expected one of {', '.join(r.name for r in routes)}, got {args.route!r}")
        route = match[0]
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    problem = validate(load_problem(args.inputs).to(device))
    ok, why = backend.accepts(problem, route)
    if not ok:
        raise BackendError(f"--route: {backend.name}/{route.name} does not accept {args.inputs}: {why}")
    kwargs = {}
    if args.taps and "taps" in inspect.signature(backend.run).parameters:
        kwargs["taps"] = True
    elif args.taps and hasattr(backend, "taps"):
        backend.taps = True
    out = backend.run(problem, route, **kwargs)
    tensors = {k: v.detach().cpu().contiguous() for k, v in out.tensors().items()}
    if args.taps and "ws_inv" in (out.taps or {}):
        tensors["ws_inv"] = out.taps["ws_inv"].detach().cpu().contiguous()
    meta = {"backend": backend.name, "route": route.name, "recipe": route.recipe, "device": str(device),
            "version": str(getattr(backend, "version", lambda: "")())}
    save_outputs(args.out, tensors, meta)
    print(f"saved {', '.join(sorted(tensors))} of {backend.name}/{route.name} on {device} to {args.out}")
    return 0
