"""The disk cache of truths and baselines, shared by every process and run on one machine.

A case's float64 truth (``kda_ref.truth.truth``) and each recipe's baseline metrics
(``verification.judging.baselines.baseline_metrics``) are pure functions of the Problem, the recipe and
the code that computes them; under pytest-xdist each worker, and each run, would compute them
again.  Here they are stored on disk, content-addressed:

    truth key     = sha256(problem key, oracle code version, streamed block budget)
    baseline key  = sha256(truth key, recipe, baseline code version)
    problem key   = sha256(case params, seed and draw; every Problem field: each tensor's dtype,
                    shape, strides and bytes (all of them up to FULL_HASH_BYTES per tensor, else
                    SAMPLED_BYTES of evenly spaced elements plus the first and last ones); the code
                    that builds cases; torch's version; the device kind)
    code version  = sha256 of the source of every module of this repository that the function
                    imports, transitively (``code_version``): an edited oracle, emulator or metric
                    misses.

A hit is the stored value, bit for bit (torch.save / torch.load of the CPU tensors, moved back to
the device).  The key covers everything the value depends on, so a hit never changes a verdict.

Where and how much (each read once per process, from the environment):

    KDA_VERIFY_CACHE       off / 0 / no / false: no disk cache (``kda-verify run --no-cache``,
                           ``pytest --kda-no-cache`` set it)
    KDA_VERIFY_CACHE_DIR   the directory (default $XDG_CACHE_HOME/kda-verify, else ~/.cache/kda-verify)
    KDA_VERIFY_CACHE_GB    the bound on its size (default 16): after a write, the least recently
                           used entries (a hit touches its file) go until the rest fits

Entries are written atomically (a private temporary file in the same directory, then
``os.replace``): concurrent writers of one key leave one complete file, a reader sees a complete
file or none.  An entry that cannot be read is a miss (and is removed).  While one process
computes a value, others that want it wait on its lock (``computing``) and then load it.
"""
from __future__ import annotations

import ast
import dataclasses
import fcntl
import hashlib
import os
import platform
import tempfile
import time
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch

from kda_ref.chunked import default_block_bytes

FORMAT = "1"                      # the entries' layout; a change here misses everything stored before
FULL_HASH_BYTES = 64 * 2 ** 20    # a tensor up to this size is hashed whole
SAMPLED_BYTES = 4 * 2 ** 20       # a larger one: this many bytes of evenly spaced elements, plus its ends
DEFAULT_GB = 16.0
_OFF = ("off", "0", "no", "false")
_ROOT = Path(__file__).resolve().parents[2]         # the repository: kda_ref, kda_kernels, verification
_PACKAGES = ("kda_ref", "kda_kernels", "verification")

TRUTH_ENTRY = ("kda_ref.truth",)
BASELINE_ENTRY = ("verification.judging.baselines", "kda_kernels.emulator", "verification.judging.metrics")
CASE_ENTRY = ("verification.running.cases",)


# ----------------------------------------------------------------------------------------
# Settings
# ----------------------------------------------------------------------------------------
def enabled() -> bool:
    """Whether the disk cache is on (KDA_VERIFY_CACHE not off)."""
    return os.environ.get("KDA_VERIFY_CACHE", "").strip().lower() not in _OFF


def turn_off() -> None:
    """No disk cache in this process and the processes it starts (--no-cache, --kda-no-cache)."""
    os.environ["KDA_VERIFY_CACHE"] = "off"


def cache_dir() -> Path:
    """KDA_VERIFY_CACHE_DIR, else $XDG_CACHE_HOME/kda-verify, else ~/.cache/kda-verify."""
    d = os.environ.get("KDA_VERIFY_CACHE_DIR")
    if d:
        return Path(d)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kda-verify"


def max_bytes() -> int:
    """The size bound of the cache directory (KDA_VERIFY_CACHE_GB, default 16 GiB)."""
    raw = os.environ.get("KDA_VERIFY_CACHE_GB", "")
    try:
        gb = float(raw) if raw.strip() else DEFAULT_GB
    except ValueError:
        gb = DEFAULT_GB
    return int(max(0.0, gb) * 2 ** 30)


# ----------------------------------------------------------------------------------------
# Keys
# ----------------------------------------------------------------------------------------
def _module_file(name: str) -> Optional[Path]:
    parts = name.split(".")
    if parts[0] not in _PACKAGES:
        return None
    base = _ROOT.joinpath(*parts)
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.is_file():
            return f
    return None


def _imports(path: Path, module: str) -> set:
    """The repository modules ``path`` imports anywhere (function-level imports included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    pkg = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")
                up = up[:len(up) - (node.level - 1)] if node.level > 1 else up
                base = ".".join(up + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)     # from pkg import module
    return {m for m in out if m.split(".")[0] in _PACKAGES}


_VERSIONS: dict = {}


def code_version(*entry: str) -> str:
    """sha256 over the sources of the repository modules ``entry`` imports, transitively (their
    paths and bytes, sorted): the version of the code that computes a cached value."""
    key = tuple(sorted(entry))
    if key in _VERSIONS:
        return _VERSIONS[key]
    seen: dict = {}
    todo = list(entry)
    while todo:
        name = todo.pop()
        f = _module_file(name)
        if f is None or f in seen.values():
            continue
        seen[name] = f
        todo.extend(_imports(f, name) - set(seen))
        parent = name.rpartition(".")[0]              # a package's __init__ runs on import
        if parent:
            todo.append(parent)
    h = hashlib.sha256(FORMAT.encode())
    for f in sorted(set(seen.values())):
        h.update(str(f.relative_to(_ROOT)).encode() + b"\0" + f.read_bytes() + b"\0")
    _VERSIONS[key] = h.hexdigest()
    return _VERSIONS[key]


def device_kind(device) -> str:
    """What a value computed on ``device`` may depend on: the GPU's name and CUDA, or the CPU."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name(dev)}:{torch.version.cuda}"
    return f"{dev.type}:{platform.machine()}"


def _tensor_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().reshape(-1)
    n = flat.numel()
    size = n * flat.element_size()
    if size > FULL_HASH_BYTES:
        per = max(1, SAMPLED_BYTES // flat.element_size())
        ends = max(1, per // 8)
        # evenly spaced in exact integer arithmetic: a float32 linspace rounds n - 1 up to n once
        # n > 2**24, and that index out of bounds is a device-side assert on a GPU
        spaced = torch.arange(per, dtype=torch.int64) * (n - 1) // max(1, per - 1)
        idx = torch.cat([torch.arange(0, min(n, ends)), spaced, torch.arange(max(0, n - ends), n)])
        flat = flat[idx.to(flat.device)]
    return flat.contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _feed(h, name: str, v) -> None:
    if isinstance(v, torch.Tensor):
        h.update(f"{name}:tensor:{v.dtype}:{tuple(v.shape)}:{tuple(v.stride())}:".encode())
        h.update(_tensor_bytes(v))
    else:
        h.update(f"{name}:{v!r}".encode())
    h.update(b"\0")


_PROBLEM_KEYS: dict = {}          # id(problem) -> (weak reference, key): the last few problems hashed


def problem_key(problem, case=None) -> str:
    """The content key of a Problem (and the case that built it); see the module docstring.
    Remembered for the last few Problem objects (a case's cells share one)."""
    hit = _PROBLEM_KEYS.get(id(problem))
    if hit is not None and hit[0]() is problem:
        return hit[1]
    h = hashlib.sha256(f"problem {FORMAT} torch {torch.__version__}\0".encode())
    h.update(code_version(*CASE_ENTRY).encode())
    if case is not None:
        h.update(repr((case.id, case.seed, sorted(case.params.items()), sorted(case.suite_opts.items()))).encode())
    dev = None
    for f in dataclasses.fields(problem):
        v = getattr(problem, f.name)
        if f.name == "meta":
            v = sorted((str(k), repr(x)) for k, x in (v or {}).items())
        if isinstance(v, torch.Tensor) and dev is None:
            dev = v.device
        _feed(h, f.name, v)
    h.update(device_kind(dev or "cpu").encode())
    key = h.hexdigest()
    _PROBLEM_KEYS[id(problem)] = (weakref.ref(problem), key)      # never what keeps a Problem alive
    while len(_PROBLEM_KEYS) > 4:
        del _PROBLEM_KEYS[next(iter(_PROBLEM_KEYS))]
    return key


def truth_key(problem, case=None) -> str:
    """The key of the problem's default truth (streamed, C = 64) with this oracle code."""
    dev = problem.q.device
    parts = ["truth", problem_key(problem, case), code_version(*TRUTH_ENTRY), str(default_block_bytes(dev))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def baseline_key(problem, recipe: str, case=None) -> str:
    """The key of ``recipe``'s baseline metrics on the problem: the truth's key (the metrics are
    measured against that truth), the recipe and the emulator's and metrics' code."""
    parts = ["baseline", truth_key(problem, case), str(recipe), code_version(*BASELINE_ENTRY)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


# ----------------------------------------------------------------------------------------
# Store
# ----------------------------------------------------------------------------------------
def _path(kind: str, key: str) -> Path:
    return cache_dir() / f"v{FORMAT}" / kind / key[:2] / f"{key}.pt"


def _cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: _cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_cpu(v) for v in x)
    return x


def load(kind: str, key: str, device="cpu"):
    """The value stored under (kind, key), its tensors on ``device``; None on a miss (cache off,
    no entry, an entry that cannot be read: removed)."""
    if not enabled():
        return None
    p = _path(kind, key)
    try:
        data = torch.load(p, map_location=device, weights_only=False)
    except FileNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - a truncated or foreign file is a miss, and goes
        p.unlink(missing_ok=True)
        return None
    if not isinstance(data, dict) or data.get("key") != key:
        return None
    try:
        os.utime(p)                # least recently used goes first
    except OSError:
        pass
    return data["value"]


def store(kind: str, key: str, value) -> bool:
    """Write ``value`` (tensors moved to the CPU) under (kind, key) atomically, then keep the
    directory within its bound.  Never raises: a cache that cannot be written is no cache."""
    if not enabled():
        return False
    p = _path(kind, key)
    tmp = None
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=p.parent)
        with os.fdopen(fd, "wb") as f:
            torch.save({"key": key, "value": _cpu(value)}, f)
        os.replace(tmp, p)
        tmp = None
    except Exception:  # noqa: BLE001 - a full disk or a read-only directory: run without the cache
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        return False
    evict()
    return True


LOCK_WAIT_S = 600.0


@contextmanager
def computing(kind: str, key: str, timeout_s: float = LOCK_WAIT_S):
    """Hold the lock of (kind, key) while its value is computed: a process that wants the same
    value meanwhile waits here, then finds it stored (workers that meet one case at once compute
    its truth once).  A lock that cannot be made, or is held past ``timeout_s``, is not waited
    for (the value is computed again, as without the cache); released when the block ends."""
    fd = None
    if enabled():
        path = cache_dir() / f"v{FORMAT}" / "locks" / f"{kind}-{key}.lock"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
            t0 = time.monotonic()
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() - t0 > timeout_s:
                        break
                    time.sleep(0.02)
        except OSError:
            pass
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)              # releases the lock


def evict(limit: Optional[int] = None) -> int:
    """Remove the least recently used entries until the cache fits ``limit`` bytes (default
    ``max_bytes()``); temporary files older than an hour (a writer that died) go too.  Returns
    how many files were removed."""
    limit = max_bytes() if limit is None else int(limit)
    root = cache_dir() / f"v{FORMAT}"
    entries, total, removed = [], 0, 0
    now = time.time()
    for f in root.rglob("*"):
        try:
            st = f.stat()
        except OSError:
            continue
        if not f.is_file():
            continue
        if f.name.endswith((".tmp", ".lock")):      # a writer's file, or a lock: gone after an hour
            if now - st.st_mtime > 3600:
                f.unlink(missing_ok=True)
                removed += 1
            continue
        entries.append((st.st_mtime, st.st_size, f))
        total += st.st_size
    for _, size, f in sorted(entries, key=lambda e: e[0]):
        if total <= limit:
            break
        try:
            f.unlink()
            removed += 1
        except OSError:
            pass
        total -= size
    return removed
