"""`kda-verify`: one subcommand per module in verification/commands/.

Each command module defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int``.  Bad input (ProblemError, UsageError, BackendError, ...) prints a
one-line error and exits 2, with no traceback.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from kda_ref.problem import ProblemError


class UsageError(ValueError):
    """A bad command-line or file argument; the message names it."""


def _commands():
    from . import commands
    mods = []
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            mods.append(importlib.import_module(f"{commands.__name__}.{info.name}"))
    return mods


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kda-verify", description="Numerical verification of KDA forward kernels "
                                     "against a float64 oracle.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in _commands():
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    from kda_kernels.base import BackendError
    try:
        return int(args._run(args) or 0)
    except (ProblemError, UsageError, BackendError) as e:
        print(f"kda-verify {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kda-verify {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
