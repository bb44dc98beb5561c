"""`kda-verify backends`: every built-in backend, whether it can run here and why not.

For each built-in name (kda_kernels.base.BUILTIN_BACKENDS) this reports: available,
reason (in words, empty when available), version, and routes.  An adapter module that
does not exist in this checkout is reported as "adapter not implemented in this version";
an adapter that exists but whose library or device is missing reports its own reason.
"""
from __future__ import annotations

import json

from verification.judging.policy import exit_code

NAME = "backends"
HELP = "list the built-in backends: available here or not (and why), version, routes"
NOT_IMPLEMENTED = "adapter not implemented in this version"
EXAMPLES = """\
kda-verify backends
kda-verify backends --json
kda-verify backends --backend mypkg.kernels:make_backend   # needs: mypkg
"""


def describe(name: str, spec: str | None = None) -> dict:
    """{"name", "available", "reason", "version", "routes"} of one backend; never raises."""
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from kda_kernels.base import BUILTIN_BACKENDS, BackendError, load_backend
    from verification.running.run_select import module_exists

    target = spec or BUILTIN_BACKENDS.get(name, name)
    mod_name = target.partition(":")[0]
    row = {"name": name, "available": False, "reason": "", "version": "", "routes": [], "spec": target}
    if not module_exists(mod_name):
        row["reason"] = NOT_IMPLEMENTED
        return row
    try:
        b = load_backend(name if spec is None else spec)
    except BackendError as e:
        row["reason"] = str(e).removeprefix("--backend: ")
        return row
    except Exception as e:  # noqa: BLE001 - a broken adapter is reported, not fatal
        row["reason"] = f"loading raised {type(e).__name__}: {e}"
        return row
    try:
        ok, why = b.available()
        row["available"], row["reason"] = bool(ok), "" if ok else str(why or "no reason given")
    except Exception as e:  # noqa: BLE001
        row["reason"] = f"available() raised {type(e).__name__}: {e}"
    if name == "triton" and spec is None and not row["available"] and row["reason"].startswith("no CUDA device"):
        row["reason"] += (" (kda-verify run and pytest -m verify turn Triton's CPU interpreter on themselves "
                          "for the triton backend; elsewhere set TRITON_INTERPRET=1 before Triton is imported)")
    try:
        row["version"] = str(b.version())
    except Exception as e:  # noqa: BLE001
        row["version"] = f"unknown ({type(e).__name__})"
    try:
        row["routes"] = [r.name for r in b.routes()]
    except Exception as e:  # noqa: BLE001
        row["routes"] = []
        if row["available"]:
            row["available"], row["reason"] = False, f"routes() raised {type(e).__name__}: {e}"
    return row


def describe_all(extra: list[str] | None = None) -> list[dict]:
    # lazy: a command's machinery loads when it runs, not for --help (docs/design.md, Imports)
    from kda_kernels.base import BUILTIN_BACKENDS
    rows = [describe(n) for n in BUILTIN_BACKENDS]
    for spec in extra or []:
        rows.append(describe(spec, spec=spec))
    return rows


def add_arguments(p):
    p.add_argument("--json", action="store_true", help="print a JSON list of {name, available, reason, version, routes}")
    p.add_argument("--backend", action="append", metavar="MODULE:FACTORY",
                   help="also describe an external backend given as package.module:factory (repeatable)")


def run(args) -> int:
    rows = describe_all(args.backend)
    if args.json:
        print(json.dumps([{k: r[k] for k in ("name", "available", "reason", "version", "routes")} for r in rows],
                         indent=1))
        return exit_code()
    w = max(len(r["name"]) for r in rows)
    for r in rows:
        state = "available" if r["available"] else "unavailable"
        print(f"{r['name']:<{w}}  {state:<11}  {r['version'] or '-'}")
        if r["routes"]:
            print(f"{'':<{w}}  routes: {', '.join(r['routes'])}")
        if r["reason"]:
            print(f"{'':<{w}}  reason: {r['reason']}")
    return exit_code()
