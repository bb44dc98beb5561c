"""Room on the device for one case: whether it fits at all, and which cases run one at a time.

A cell holds, at its peak, the case's inputs, its float64 truth (o), the kernel's outputs and
workspace, the emulated baseline's outputs and one streamed block of each; all of it grows with
the tokens x value heads x (K + V) of the case.  ``cell_bytes`` estimates that peak:

    cell_bytes = CELL_BYTES_PER_ELEMENT x tokens x HV x (K + V)

CELL_BYTES_PER_ELEMENT is the largest peak per worker measured over the long suite, rounded up
(docs/long-context.md).

Two decisions use it, both before anything of the case is built:

- ``no_room(case, device)``: a case whose estimate exceeds the device's total memory cannot run
  there; the cell is skipped with that reason (``verification.running.run_cell.run_cell``).
- ``BigCaseLock``: with several workers on one device (``kda_ref.budget.sharing_workers``), a case
  whose estimate exceeds the device's total / workers is run under an exclusive per-device file
  lock, held from the case's first cell until the worker moves on to another case (the
  ``TruthCache`` then drops the case and returns the freed memory to the device).  At most one
  such case is resident on a device at a time; smaller cases run beside it within their share.

The lock is ``fcntl.flock`` on ``<lock dir>/kda-verify-<uid>-<device>.lock`` (lock dir:
KDA_VERIFY_LOCK_DIR, else the system's temporary directory), so it spans every process of the
machine that uses the same directory, and a process that dies releases it.  Without ``fcntl``
(not a POSIX system) nothing is locked.
"""
from __future__ import annotations

import fcntl
import os
import sys
import tempfile
import time
from typing import Optional

import torch

from kda_ref.budget import device_total_bytes, sharing_workers

CELL_BYTES_PER_ELEMENT = 25
LOCK_DIR_ENV = "KDA_VERIFY_LOCK_DIR"
GIB = 2 ** 30


def case_size(case) -> tuple:
    """(tokens, HV, K, V) of a case from its parameters, without building it."""
    p = case.params
    tokens = sum(p["lens"]) if "lens" in p else int(p.get("B", 1)) * int(p.get("T", 64))
    H = int(p.get("H", 2))
    return tokens, int(p.get("HV", H)), int(p.get("K", 128)), int(p.get("V", 128))


def cell_bytes(case) -> int:
    """The estimated peak device memory of one cell of ``case`` (module docstring)."""
    tokens, HV, K, V = case_size(case)
    return CELL_BYTES_PER_ELEMENT * tokens * HV * (K + V)


def _total(device) -> int:
    return device_total_bytes(device)


def no_room(case, device) -> Optional[str]:
    """None when ``case`` fits on ``device``; else why not, in one line."""
    need, total = cell_bytes(case), _total(device)
    if need <= total:
        return None
    return (f"device too small: one cell of this case needs about {need / GIB:.0f} GiB "
            f"({CELL_BYTES_PER_ELEMENT} B x tokens x HV x (K+V)), {device} has {total / GIB:.0f} GiB")


def is_big(case, device, workers: Optional[int] = None) -> bool:
    """Whether ``case`` needs more than its worker's share of the device (total / workers), with
    more than one worker sharing it."""
    w = sharing_workers() if workers is None else max(1, int(workers))
    return w > 1 and cell_bytes(case) > _total(device) // w


def lock_path(device) -> str:
    d = os.environ.get(LOCK_DIR_ENV) or tempfile.gettempdir()
    uid = os.getuid() if hasattr(os, "getuid") else 0
    name = str(torch.device(device)).replace(":", "")
    return os.path.join(d, f"kda-verify-{uid}-{name}.lock")


class BigCaseLock:
    """The exclusive per-device lock of the cases that exceed a worker's share (module docstring).
    ``hold(case_id)`` blocks until this process holds it for that case (a no-op when it already
    does) and returns the seconds it waited; ``release()`` lets it go."""

    def __init__(self, device):
        self.device = str(device)
        self.case_id: Optional[str] = None
        self._fd: Optional[int] = None

    def hold(self, case_id: str) -> float:
        if self._fd is not None:
            self.case_id = case_id
            return 0.0
        try:
            # lazy: a probe of what is installed (docs/design.md, Imports)
            import fcntl
        except ImportError:           # not POSIX: nothing to lock with
            self.case_id = case_id
            return 0.0
        fd = os.open(lock_path(self.device), os.O_RDWR | os.O_CREAT, 0o600)
        t0 = time.perf_counter()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            print(f"kda-verify: case {case_id} exceeds this worker's share of {self.device}: waiting for "
                  f"the device's other large case to finish", file=sys.stderr)
            fcntl.flock(fd, fcntl.LOCK_EX)
        self._fd, self.case_id = fd, case_id
        return time.perf_counter() - t0

    @property
    def held(self) -> bool:
        return self.case_id is not None

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
        self._fd, self.case_id = None, None
