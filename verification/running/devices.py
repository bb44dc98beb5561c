"""The device a command runs on: one check, one message, for every ``--device``.

``check_device`` is what every command that takes ``--device`` (and the pytest plugin's
``--kda-device``) calls: cpu, or a CUDA device that is here; anything else is a UsageError
that names the argument, what was expected and what came.
"""
from __future__ import annotations

from typing import Optional

import torch

from verification.errors import UsageError


def default_device() -> str:
    """cuda if torch sees a CUDA device, else cpu."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: Optional[str], arg: str = "--device") -> str:
    """``device`` (None: ``default_device()``) when it is cpu or an available CUDA device
    (cuda, cuda:N with N below the device count); else a UsageError naming ``arg``."""
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise UsageError(f"{arg}: expected cpu or cuda[:N], got {device!r}") from None
    if dev.type == "cpu":
        return str(device)
    if dev.type != "cuda":
        raise UsageError(f"{arg}: expected cpu or cuda[:N], got {device!r}")
    if not torch.cuda.is_available():
        raise UsageError(f"{arg}: expected cpu or an available CUDA device, got {device!r} (no CUDA device here)")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UsageError(f"{arg}: expected a CUDA index below {torch.cuda.device_count()}, got {device!r}")
    return str(device)
