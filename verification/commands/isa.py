"""`kda-verify isa`: compile our Triton FlashKDA kernels for GPUs this machine lacks (cross-compile,
no device needed) and report per kernel: compiled or the compiler's error, matrix instructions,
registers / VGPRs, shared memory / LDS, spills.  Exit status 1 if any kernel failed to compile;
spills are a performance fact of the compiler at hand, reported (table, JSON and the summary
line's count), never a failure."""
from __future__ import annotations

import json
import sys

from verification.judging.policy import exit_code

NAME = "isa"
HELP = "cross-compile the Triton FlashKDA kernels (sm90, gfx950, gfx1250, ...) and report their ISA"
EXAMPLES = """\
kda-verify isa --arch gfx950,sm90 --routes seg --states kv
kda-verify isa --arch gfx1250 --routes unseg:BW=32 --states kv
kda-verify isa --arch sm90 --routes unseg:BW=32 --states kv --json
kda-verify isa --backend aiter --arch gfx1250,gfx950 --kernels chunk_kda_prepare  # needs: aiter
"""


def add_arguments(p):
    p.add_argument("--arch", default="gfx950,gfx1250,sm90", metavar="ARCH",
                   help="comma-separated targets: sm90, sm100, gfx942, gfx950, gfx1250 (default gfx950,gfx1250,sm90)")
    p.add_argument("--routes", default=None, metavar="ROUTES",
                   help="comma-separated route names of the triton backend, or 'all' (default)")
    p.add_argument("--states", default=None, metavar="STATES",
                   help="initial-state configurations whose kernels to compile: none, kv, vk, paged (default kv,paged)")
    p.add_argument("--json", action="store_true", help="print the reports as JSON instead of a table")
    p.add_argument("--backend", default="triton", choices=("triton", "aiter"),
                   help="whose kernels: triton (ours, default) or aiter (the kernels of the aiter tree on "
                        "PYTHONPATH: its FlashKDA, Triton and gfx950 Gluon, with the constexprs its launcher "
                        "passes for H=12, C=32, K=V=128; and on gfx1250 / gfx950 its Gluon chunk_kda prepare / "
                        "walk / scan and kda decode, every variant its host wrappers pick for H=12, K=V=128 "
                        "(the gfx1250 prefill needs triton >= 3.9); --routes and --states do not apply)")
    p.add_argument("--kernels", default=None, metavar="NAMES",
                   help="with --backend aiter: comma-separated parts of kernel names; only the kernels whose name "
                        "contains one are compiled (default: all), e.g. chunk_kda_walk,prepare")
    p.add_argument("--kernel-timeout", type=float, default=None, metavar="SECONDS",
                   help="with --backend aiter: seconds one kernel may compile before its row says it did not "
                        "(default 900)")


def _split(text: str, arg: str) -> list:
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.errors import UsageError
    items = [x.strip() for x in str(text).split(",") if x.strip()]
    if not items:
        raise UsageError(f"{arg}: expected a comma-separated list, got {text!r}")
    return items


# the options of one backend's kernels, and their defaults; given with the other backend they are
# an error, never silently ignored
BACKEND_OPTIONS = {"triton": {"routes": "all", "states": "kv,paged"},
                   "aiter": {"kernels": "", "kernel_timeout": 900.0}}


def _options_of(args, backend: str):
    """Fill in ``backend``'s options left unset; any option of the other backend that was given is a
    UsageError naming it."""
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.errors import UsageError
    for other, options in BACKEND_OPTIONS.items():
        for name, default in options.items():
            if other == backend:
                if getattr(args, name, None) is None:
                    setattr(args, name, default)
            elif getattr(args, name, None) is not None:
                flag = "--" + name.replace("_", "-")
                raise UsageError(f"{flag}: expected only with --backend {other}, got it with --backend {backend}")


def run(args) -> int:
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.errors import UsageError
    backend = getattr(args, "backend", "triton")
    _options_of(args, backend)
    if backend == "aiter":
        return _run_aiter(args)
    # lazy: importing kda_kernels.triton builds the kernels, after TRITON_INTERPRET is decided (docs/design.md, Imports)
    from kda_kernels.triton.isa import STATE_CONFIGS, TARGETS, isa_report
    from kda_kernels.triton.routes import RouteError, parse_route, route_names

    archs = _split(args.arch, "--arch")
    bad = [a for a in archs if a not in TARGETS]
    if bad:
        raise UsageError(f"--arch: expected values in {','.join(TARGETS)}, got {bad[0]!r}")
    states = _split(args.states, "--states")
    bad = [s for s in states if s not in STATE_CONFIGS]
    if bad:
        raise UsageError(f"--states: expected values in {','.join(STATE_CONFIGS)}, got {bad[0]!r}")
    routes = route_names() if args.routes == "all" else _split(args.routes, "--routes")
    for r in routes:
        try:
            parse_route(r)
        except RouteError as e:
            raise UsageError(f"--routes: {e}") from None
    # lazy: importing kda_kernels.triton builds the kernels, after TRITON_INTERPRET is decided (docs/design.md, Imports)
    from kda_kernels.triton.isa import IsaError
    try:
        reports = isa_report(archs, routes, tuple(states))
    except IsaError as e:
        raise UsageError(str(e)) from None
    if args.json:
        json.dump([r.as_dict() for r in reports], sys.stdout, indent=1)
        print()
    else:
        _table(reports)
    failed = [r for r in reports if not r.ok]
    print(f"{len(reports) - len(failed)}/{len(reports)} kernel variants compiled "
          f"({', '.join(archs)}; {len(routes)} routes); {spill_summary(reports)}", file=sys.stderr)
    return exit_code(failed=bool(failed))


def _run_aiter(args) -> int:
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from verification.investigating.aiter_isa import AiterIsaError, aiter_isa_report, table_header, table_row
    from verification.errors import UsageError
    archs = _split(args.arch if args.arch != "gfx950,gfx1250,sm90" else "gfx950,gfx1250", "--arch")
    started = []

    def stream(report):          # the table row by row: a compile can take minutes
        if not args.json:
            if not started:
                table_header()
                started.append(1)
            table_row(report)
    try:
        if not args.kernel_timeout > 0:
            raise UsageError(f"--kernel-timeout: expected a positive number of seconds, got {args.kernel_timeout:g}")
        kernels = _split(args.kernels, "--kernels") if str(getattr(args, "kernels", "")).strip() else None
        reports = aiter_isa_report(archs, on_report=stream, timeout_s=args.kernel_timeout, kernels=kernels)
    except AiterIsaError as e:
        raise UsageError(str(e)) from None
    if args.json:
        json.dump([r.as_dict() for r in reports], sys.stdout, indent=1)
        print()
    failed = [r for r in reports if not r.ok]
    print(f"{len(reports) - len(failed)}/{len(reports)} aiter kernel variants compiled ({', '.join(archs)}); "
          f"{spill_summary(reports)}", file=sys.stderr)
    return exit_code(failed=bool(failed))


SPILL_KEYS = ("vgpr_spill_count", "sgpr_spill_count", "spill_store_bytes")


def _spill_text(r) -> str:
    return " ".join(f"{k.replace('_count', '').replace('_bytes', 'B')}={v}" for k, v in r.spills.items() if v)


def spill_summary(reports) -> str:
    """'register spills: N variants (worst: ARCH KERNEL counts)' or 'register spills: none': how
    many compiled variants spill (AMD VGPR / SGPR spills, NVIDIA spill stores), the worst by its
    largest count."""
    spilling = [r for r in reports if r.ok and any(r.spills.get(k) for k in SPILL_KEYS)]
    if not spilling:
        return "register spills: none"
    worst = max(spilling, key=lambda r: max(r.spills.get(k) or 0 for k in SPILL_KEYS))
    n = len(spilling)
    return f"register spills: {n} variant{'s' if n != 1 else ''} (worst: {worst.arch} {worst.kernel} {_spill_text(worst)})"


def _table(reports) -> None:
    head = (f"{'arch':8} {'ok':3} {'regs':>5} {'agpr':>4} {'smem':>7} {'instr':>6} {'spills':22} "
            f"{'matrix instructions':38} kernel")
    print(head)
    print("-" * len(head))
    for r in reports:
        if not r.ok:
            print(f"{r.arch:8} NO  {r.kernel}\n         error: {r.error}")
            continue
        mat = " ".join(f"{k}={v}" for k, v in r.matrix.items())
        sp = _spill_text(r)
        print(f"{r.arch:8} yes {r.registers if r.registers is not None else '-':>5} "
              f"{r.agprs if r.agprs is not None else '-':>4} {r.shared_bytes if r.shared_bytes is not None else '-':>7} "
              f"{r.instructions if r.instructions is not None else '-':>6} {sp or 'none':22} {mat:38} {r.kernel}")
        if r.note:
            print(f"         note: {r.note[:200]}")
