"""Errors shared by the library and the `kda-verify` CLI (the exit code each one gives:
verification/judging/policy.py).

``UsageError`` is the bad-input error of the harness, ``ToleranceError`` (a tolerances.yaml that
breaks the schema) one kind of it; kda_ref.problem.ProblemError and kda_kernels.base.BackendError
are the others (``bad_input_errors()``).  ``KernelFailure`` is a kernel that raised while a
command ran it outside a cell (debug, capture); ``Interrupted`` is Ctrl-C with what was kept.  ``writable_dir`` and ``writable_file`` check an output
path before any work is done, so an unwritable ``--out`` is a one-line error and not a traceback
after the run.  verification/running/devices.py holds the one check of ``--device``.
"""
from __future__ import annotations

import os
import tempfile
import time
import traceback
from pathlib import Path

from kda_kernels.base import BackendError
from kda_ref.problem import ProblemError

class UsageError(ValueError):
    """A bad command-line or file argument, or an environment that cannot do what was asked;
    the message names the argument, what was expected and what came."""


class ToleranceError(UsageError):
    """A tolerances.yaml that breaks the schema, or a key no entry matches."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, with the one line to print instead of the bare "interrupted" (what was kept);
    ``summary``: what the interrupted work had done (verification.running.run_matrix.run_matrix: its RunSummary)."""

    def __init__(self, message: str = "interrupted", summary=None):
        super().__init__(message)
        self.summary = summary


class KernelFailure(RuntimeError):
    """A kernel that raised while a command ran it outside a cell (``debug``'s passes, ``capture``):
    a kernel failure, exit 1; the message names the backend, route and what was raised, and the
    kernel's exception is the ``__cause__``."""

    @classmethod
    def of(cls, e: BaseException, what: str) -> "KernelFailure":
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return cls(f"{what} raised {type(e).__name__}: {first}"[:500])


def bad_input_errors() -> tuple:
    """The exception classes that mean bad input or a bad environment (exit 2, one line)."""
    return (ProblemError, UsageError, BackendError)


def _why(e: OSError) -> str:
    return e.strerror or type(e).__name__


def _probe_writable(d: Path, arg: str, shown: str, what: str = "a writable directory") -> None:
    """Create and remove a file in ``d`` (os.access cannot see a read-only mount or a root-owned
    sysfs); a UsageError naming ``arg`` when that fails."""
    try:
        with tempfile.TemporaryFile(dir=d, prefix=".kda-verify-probe-"):
            pass
    except OSError as e:
        raise UsageError(f"{arg}: expected {what}, got {shown!r} ({_why(e)})") from None


def writable_dir(path, arg: str = "--out") -> Path:
    """``path`` as a directory that exists (created with its parents) and can be written; else a
    UsageError naming ``arg``: an existing file, a directory that cannot be created, a read-only one."""
    shown = str(path)
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"{arg}: expected a directory, got {shown!r}, an existing file")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UsageError(f"{arg}: expected a directory, got {shown!r}, whose path runs through a file") from None
    except OSError as e:
        raise UsageError(f"{arg}: expected a directory that can be created, got {shown!r} ({_why(e)})") from None
    _probe_writable(p, arg, shown)
    return p


def writable_file(path, arg: str = "--out") -> Path:
    """``path`` as a file that can be written (its directory created when missing); not a
    directory.  An existing file is overwritten by the caller."""
    shown = str(path)
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{arg}: expected a file path, got {shown!r}, an existing directory")
    parent = p.parent
    if parent.exists() and not parent.is_dir():
        raise UsageError(f"{arg}: expected a file in a directory, got {shown!r} ({str(parent)!r} is a file)")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{arg}: expected a file whose directory can be created, got {shown!r} ({_why(e)})") from None
    if p.exists() and not os.access(p, os.W_OK):
        raise UsageError(f"{arg}: expected a writable file, got {shown!r} (permission denied)")
    _probe_writable(parent, arg, shown, "a file in a writable directory")
    return p


def save_traceback(e: BaseException, command: str, out_dir=None) -> str:
    """Write the traceback of an internal error to a file and return its path: ``out_dir`` /
    kda-verify-traceback.txt when that directory exists and takes it, else a new temporary file."""
    text = (f"kda-verify {command}: internal error at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n"
            + "".join(traceback.format_exception(type(e), e, e.__traceback__)))
    if out_dir is not None:
        try:
            d = Path(out_dir)
            if d.is_dir():
                target = d / "kda-verify-traceback.txt"
                target.write_text(text)
                return str(target)
        except OSError:
            pass
    fd, name = tempfile.mkstemp(prefix=f"kda-verify-{command}-", suffix=".traceback.txt")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return name
