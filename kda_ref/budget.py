"""The memory budget of one block of float64 work that grows with the sequence length.

Everything the harness does in float64 over the tokens of a long problem (the streamed truth,
the metrics of an output against it) walks the tokens in blocks; ``block_budget(device)`` is the
one place that decides how many bytes one such block may hold:

    budget = device total memory x BLOCK_SHARE / workers sharing the device, capped per device kind

It depends on the device's *total* memory, never on what is free at the moment: with several
pytest-xdist workers on one GPU, "free memory" is whatever the others have not taken yet, so a
worker that starts first would size its blocks from memory its neighbours need.  A fixed share of
the total divided by the number of workers keeps every worker inside its part whatever the order.

Workers sharing the device: ``KDA_VERIFY_WORKERS_PER_DEVICE`` when set (an integer >= 1: e.g.
two separate pytest runs on one GPU, or xdist workers spread over several GPUs), else
pytest-xdist's ``PYTEST_XDIST_WORKER_COUNT`` (set in every worker), else 1.

BLOCK_SHARE = 1/64: on a 140 GiB H200 with one worker a block may hold 2.2 GiB; the streamed
truth's working set is about its estimate, so truth((1, 1048576, 12)) peaks at the inputs + o
(float64, 12 GiB) + about 2.2 GiB, and runs no slower than with 8 GiB blocks.
Caps: 8 GiB on CUDA; 32 MiB on the CPU (about a last-level cache: the workspace's elementwise
passes then run from cache, which is faster there than larger blocks).
"""
from __future__ import annotations

import os

import torch

WORKERS_ENV = "KDA_VERIFY_WORKERS_PER_DEVICE"
BLOCK_SHARE = 1 / 64
CUDA_BLOCK_CAP = 8 * 2 ** 30
CPU_BLOCK_CAP = 32 * 2 ** 20
CPU_FALLBACK_TOTAL = 4 * 2 ** 30   # the CPU's memory when neither /proc/meminfo nor sysconf answers


def sharing_workers() -> int:
    """How many processes share one device: KDA_VERIFY_WORKERS_PER_DEVICE, else pytest-xdist's
    PYTEST_XDIST_WORKER_COUNT, else 1 (a value that is not an integer >= 1 is ignored)."""
    for name in (WORKERS_ENV, "PYTEST_XDIST_WORKER_COUNT"):
        raw = os.environ.get(name)
        if raw is None:
            continue
        try:
            n = int(raw)
        except ValueError:
            continue
        if n >= 1:
            return n
    return 1


def _cgroup_limit() -> int | None:
    """The cgroup (v2, else v1) memory limit of this process in bytes, None when unlimited."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < 2 ** 60:
            return int(raw)
    return None


def device_total_bytes(device) -> int:
    """The total memory of ``device``: CUDA, the GPU's total memory; CPU, the machine's memory
    (MemTotal) or the cgroup's limit when that is smaller."""
    dev = torch.device(device)
    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        return int(torch.cuda.get_device_properties(idx).total_memory)
    total = None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    if not total or total <= 0:
        total = CPU_FALLBACK_TOTAL
    lim = _cgroup_limit()
    return int(min(total, lim) if lim else total)


def block_budget(device, workers: int | None = None) -> int:
    """Bytes one block of float64 work may hold on ``device``: total memory x BLOCK_SHARE /
    workers sharing the device (``sharing_workers`` unless given), at most CUDA_BLOCK_CAP
    (CUDA) or CPU_BLOCK_CAP (elsewhere), at least 1."""
    dev = torch.device(device)
    w = sharing_workers() if workers is None else max(1, int(workers))
    cap = CUDA_BLOCK_CAP if dev.type == "cuda" else CPU_BLOCK_CAP
    return max(1, min(cap, int(device_total_bytes(dev) * BLOCK_SHARE) // w))
