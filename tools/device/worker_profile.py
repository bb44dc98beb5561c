"""A pytest plugin for device jobs: where each pytest-xdist worker's time goes, start-up included.

    PYTHONPATH=tools/device:... python -m pytest -p worker_profile ... -n 16
    KDA_PROFILE_OUT=DIR          where to write (required; nothing happens without it)
    KDA_PROFILE_WORKERS=gw0,gw9  the workers run under cProfile (default none)

Every worker (and the controller, as "main") writes DIR/phases-NAME.json: the wall-clock times of
its process start (from /proc), this plugin's import (the plugins before it and the interpreter's
start), the end of collection, its first and last test, and the session's end; the count of tests
it ran.  A profiled worker also writes DIR/prof-NAME.out (cProfile, from this plugin's import to
the session's end) and DIR/prof-NAME.txt (the 40 heaviest functions by own and by cumulative
time).  ``python tools/device/worker_profile.py DIR`` prints the phases summed over the workers.
"""
from __future__ import annotations

import json
import os
import sys
import time

_OUT = os.environ.get("KDA_PROFILE_OUT")
_NAME = os.environ.get("PYTEST_XDIST_WORKER", "main")
_T = {"imported": time.time()}
_PROF = None
_TESTS = 0


def _process_start() -> float:
    """The wall-clock time this process started (Linux /proc); NaN elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            up = float(f.read().split()[0])
        return time.time() - (up - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return float("nan")


_T["process_start"] = _process_start()
if _OUT and _NAME in os.environ.get("KDA_PROFILE_WORKERS", "").split(","):
    import cProfile
    _PROF = cProfile.Profile()
    _PROF.enable()


def pytest_collection_finish(session):
    _T["collected"] = time.time()


def pytest_runtest_logstart(nodeid, location):
    global _TESTS
    _T.setdefault("first_test", time.time())
    _TESTS += 1


def pytest_runtest_logfinish(nodeid, location):
    _T["last_test"] = time.time()


def pytest_sessionfinish(session):
    _T["session_end"] = time.time()
    if not _OUT:
        return
    os.makedirs(_OUT, exist_ok=True)
    with open(os.path.join(_OUT, f"phases-{_NAME}.json"), "w") as f:
        json.dump(dict(_T, tests=_TESTS, name=_NAME), f)
    if _PROF is not None:
        import pstats
        _PROF.disable()
        _PROF.dump_stats(os.path.join(_OUT, f"prof-{_NAME}.out"))
        with open(os.path.join(_OUT, f"prof-{_NAME}.txt"), "w") as f:
            st = pstats.Stats(_PROF, stream=f)
            st.sort_stats("tottime").print_stats(40)
            st.sort_stats("cumulative").print_stats(40)


def summary(d: str) -> None:
    """Print each worker's phases (seconds) and their sums."""
    rows = []
    for fn in sorted(os.listdir(d)):
        if fn.startswith("phases-") and fn.endswith(".json"):
            with open(os.path.join(d, fn)) as f:
                rows.append(json.load(f))
    if not rows:
        print(f"{d}: no phases-*.json")
        return
    t0 = min(r["process_start"] for r in rows if r["process_start"] == r["process_start"])
    keys = ("process_start", "imported", "collected", "first_test", "last_test", "session_end")
    print("name   " + "".join(f"{k:>14}" for k in keys) + "   tests   (seconds from the first process's start)")
    spans = {"start->import": 0.0, "import->collected": 0.0, "collected->first": 0.0, "first->last": 0.0,
             "last->end": 0.0}
    for r in sorted(rows, key=lambda r: r["name"]):
        print(f"{r['name']:<7}" + "".join(f"{r.get(k, float('nan')) - t0:14.1f}" for k in keys) + f"{r['tests']:8d}")
        if r["name"] == "main":
            continue
        for (a, b), k in zip(zip(keys[:-1], keys[1:]), spans):
            if a in r and b in r:
                spans[k] += r[b] - r[a]
    print("summed over the workers: " + ", ".join(f"{k} {v:.1f} s" for k, v in spans.items()))


if __name__ == "__main__":
    summary(sys.argv[1] if len(sys.argv) > 1 else ".")
