"""The Triton versions kda-verify supports, and the one check of the installed one.

Our Triton FlashKDA, Triton's CPU interpreter fixes (kda_kernels/triton/_interpreter_compat.py), the
cross-compilers of ``isa`` and the third-party Triton kernels the adapters launch are tested on every
Triton in ``TRITON_RANGE`` (the bounds pyproject.toml gives pip); the gfx1250 Gluon kernels of aiter
need its top end (3.9).  Outside the range every ``kda-verify`` command and a ``pytest -m verify``
session stop with one line and exit 2 before doing anything, since a Triton of another version
can fail in the kernels (or, worse, in the interpreter's arithmetic) in ways no verdict should be
read from.  ``KDA_VERIFY_ANY_TRITON=1`` lets a kernel engineer try a Triton outside the range anyway
(a nightly, a vendor build); the check then says nothing.
"""
from __future__ import annotations

import os
import re
from importlib import metadata
from typing import Optional

from verification.errors import UsageError

TRITON_RANGE = ((3, 6), (3, 10))      # >= 3.6, < 3.10: as pyproject.toml's "triton>=3.6,<3.10"
OVERRIDE = "KDA_VERIFY_ANY_TRITON"
# the distributions that install the module ``triton``: PyPI's, ROCm's and PyTorch's own builds
_DISTRIBUTIONS = ("triton", "pytorch-triton-rocm", "pytorch-triton")


def range_text() -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = TRITON_RANGE
    return f">={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"


def installed_triton() -> Optional[str]:
    """The version string of the installed ``triton`` module, or None when there is none.  Read
    from the package metadata (importing triton costs a third of a second), else from the module."""
    for dist in _DISTRIBUTIONS:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    try:
        # lazy: a probe of what is installed (docs/design.md, Imports)
        import triton
    except ImportError:
        return None
    return str(getattr(triton, "__version__", "unknown"))


def triton_problem(version: Optional[str]) -> Optional[str]:
    """One line saying why ``version`` is outside TRITON_RANGE, or None when it is inside (or
    unreadable: a build whose version names no major.minor is let through)."""
    if version is None:
        return (f"triton is not installed; kda-verify needs triton {range_text()} "
                f"(pip install 'triton{range_text()}')")
    m = re.match(r"(\d+)\.(\d+)", version)
    if not m:
        return None
    got = (int(m.group(1)), int(m.group(2)))
    lo, hi = TRITON_RANGE
    if lo <= got < hi:
        return None
    return (f"triton {version} is installed; kda-verify supports triton {range_text()} "
            f"(pip install 'triton{range_text()}', or {OVERRIDE}=1 to try this one anyway)")


def check_triton() -> None:
    """Raise UsageError (one line, exit 2) when the installed Triton is outside TRITON_RANGE,
    unless KDA_VERIFY_ANY_TRITON=1."""
    if os.environ.get(OVERRIDE, "") in ("1", "true", "True"):
        return
    problem = triton_problem(installed_triton())
    if problem:
        raise UsageError(problem)
