"""`kda-verify`: one subcommand per module in verification/commands/.

Each command module defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int``, and ``EXAMPLES``: command lines its --help shows, each run as written by
tests/test_help_examples.py.  A line may end in a note after ``  # `` (``example_parts``):
``needs: cuda, fla`` (a CUDA device, then Python modules; the test skips it elsewhere, saying
why) and/or ``exits 1: why`` (an exit code other than 0 that the example ends with), joined by "; ".
Exit codes (verification/judging/policy.py, which decides them): 0 verified, 1 a kernel failure, 2 bad
input, a bad environment or nothing verified (one line, no traceback), 3 an internal error (one
line naming the file that holds the traceback), 130 interrupted.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import re
import sys

from verification.judging.policy import EXIT_CODES_HELP, EXIT_USAGE, exit_code
from verification.running.environment import check_triton
from .errors import Interrupted, KernelFailure, bad_input_errors, save_traceback


def example_parts(line: str) -> tuple[str, tuple, int]:
    """(command line, needs, exit code) of an example line (module docstring): the note after
    "  # " parsed; a note of another form is a ValueError, so a typo cannot skip an example."""
    command, sep, note = line.partition("  # ")
    needs, code = (), 0
    for part in (note.split("; ") if sep else []):
        part = part.strip()
        m = re.fullmatch(r"needs: ([\w.]+(?:, [\w.]+)*)", part) or re.fullmatch(r"exits (\d+)(?:: .+)?", part)
        if m is None:
            raise ValueError(f"example note: expected 'needs: cuda, MODULE' or 'exits N: why', got {part!r} in {line!r}")
        if part.startswith("needs"):
            needs = tuple(m.group(1).split(", "))
        else:
            code = int(m.group(1))
    return command.strip(), needs, code


def _commands():
    # lazy: a command module loads when the parser is built (docs/design.md, Imports)
    from . import commands
    mods = []
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            mods.append(importlib.import_module(f"{commands.__name__}.{info.name}"))
    return mods


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kda-verify", description="numerical verification of KDA forward kernels "
                                     "against a float64 oracle", epilog=EXIT_CODES_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in _commands():
        examples = getattr(mod, "EXAMPLES", "").strip("\n")
        epilog = "Examples:\n" + "\n".join(f"  {ln}" for ln in examples.splitlines()) if examples else None
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP, epilog=epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return EXIT_USAGE
    name = f"kda-verify {args.command}"
    try:
        check_triton()
        return int(args._run(args) or 0)
    except bad_input_errors() as e:
        print(f"{name}: error: {_one_line(e)}", file=sys.stderr)
        return exit_code(error=e)
    except Interrupted as e:
        print(f"{name}: {_one_line(e) or 'interrupted'}", file=sys.stderr)
        return exit_code(error=e)
    except KeyboardInterrupt as e:
        print(f"{name}: interrupted", file=sys.stderr)
        return exit_code(error=e)
    except KernelFailure as e:           # the kernel's, not ours: one line, its traceback kept in a file
        print(f"{name}: kernel failure: {_one_line(e)[:400]} (traceback: {_saved(args, e)})", file=sys.stderr)
        return exit_code(error=e)
    except OSError as e:
        if e.filename is None:           # not about a path: an internal error like any other
            return _internal(name, args, e)
        # a file the environment refused (unwritable, vanished, disk full): the user's to fix
        print(f"{name}: error: {e.filename}: {e.strerror or type(e).__name__}", file=sys.stderr)
        return exit_code(error=e)
    except Exception as e:  # noqa: BLE001 - kda-verify's own bug: one line, the traceback kept in a file
        return _internal(name, args, e)


def _one_line(e: BaseException) -> str:
    """The message of e on one line (a message that spans lines is joined with '; ')."""
    return "; ".join(ln.strip() for ln in str(e).splitlines() if ln.strip())


def _saved(args, e: BaseException) -> str:
    """Where the traceback of ``e`` was kept: the command's results directory, else a temporary file."""
    dirs = getattr(args, "dirs", None) or [None]            # report's DIRs: the first holds it
    out = getattr(args, "out", None) or getattr(args, "dir", None) or dirs[0]
    try:
        return save_traceback(e, args.command, out_dir=out)
    except OSError as e2:
        return f"(not saved: {e2.strerror or type(e2).__name__})"


def _internal(name: str, args, e: Exception) -> int:
    print(f"{name}: internal error: {type(e).__name__}: {_one_line(e)[:300]} (traceback: {_saved(args, e)})",
          file=sys.stderr)
    return exit_code(error=e)


if __name__ == "__main__":
    sys.exit(main())
