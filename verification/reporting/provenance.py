"""Provenance: where and with what a verification run was made.

Every report states the git commit (and whether the tree was dirty), the device
(GPU name, driver, CUDA / HIP runtime), the software (torch, triton, python), the
host, the time (UTC) and the command line, so a number can be traced back to the
code and the machine that produced it.  Nothing here raises: an unknown field is
recorded as "unknown" (with the reason where there is one).
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import numpy
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({type(e).__name__})"
    return out.stdout.strip() if out.returncode == 0 else "unknown (not a git checkout)"


def git_info() -> dict:
    """{"commit": sha, "dirty": bool | None, "branch": name} of the checkout this package runs from."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    dirty = None if status.startswith("unknown") else bool(status)
    return {"commit": commit, "dirty": dirty, "branch": _git("rev-parse", "--abbrev-ref", "HEAD")}


def _nvidia_driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown (no nvidia-smi)"
    line = out.stdout.strip().splitlines()
    return line[0].strip() if out.returncode == 0 and line else "unknown (nvidia-smi failed)"


def device_info(device: str | None = None) -> dict:
    """The accelerator a run used: name, capability, driver, runtime; {"type": "cpu"} on CPU."""

    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    info = {"device": str(dev), "type": dev.type}
    if dev.type == "cuda" and torch.cuda.is_available():
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        info.update({
            "gpu": torch.cuda.get_device_name(idx),
            "gpu_count": torch.cuda.device_count(),
            "capability": ".".join(str(x) for x in torch.cuda.get_device_capability(idx)),
            "memory_gib": round(props.total_memory / 2 ** 30, 1),
            "cuda_runtime": torch.version.cuda or "none",
            "hip_runtime": getattr(torch.version, "hip", None) or "none",
            "driver": _nvidia_driver() if torch.version.cuda else "see hip_runtime",
        })
    else:
        info.update({"gpu": "none", "cpu": platform.processor() or platform.machine(),
                     "cpu_count": os.cpu_count()})
    return info


def software_info() -> dict:
    try:
        # lazy: a probe of what is installed (docs/design.md, Imports)
        import triton
        triton_version = triton.__version__
    except Exception as e:  # noqa: BLE001 - any import failure is worth recording as such
        triton_version = f"unavailable ({type(e).__name__})"
    return {"python": platform.python_version(), "torch": torch.__version__, "triton": triton_version,
            "numpy": numpy.__version__, "platform": platform.platform()}


def collect(device: str | None = None, seeds: dict | None = None, argv: list[str] | None = None) -> dict:
    """Everything a report states about how it was made (see the module docstring)."""
    argv = list(sys.argv) if argv is None else list(argv)
    return {
        "time_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": socket.gethostname(),
        "git": git_info(),
        "device": device_info(device),
        "software": software_info(),
        "command": " ".join(shlex.quote(a) for a in argv),
        "seeds": dict(seeds or {}),
        "env": {k: os.environ[k] for k in sorted(os.environ)
                if k.startswith(("AITER_", "FLA_", "TRITON_INTERPRET", "CHUNK_DELTA_ATTN", "CUDA_VISIBLE"))},
    }
