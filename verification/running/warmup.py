"""Compile warm-up shared by the pytest-xdist workers of one ``pytest -m verify`` session.

With ``-n W`` every worker would compile the same Triton variants at the same moment, W times
over on W cores.  Before its first cell each worker instead runs one kernel call for every W-th
of the session's distinct variants (``variants``: one per (backend, route, ``signature`` of the
case), on the smallest case of that signature), so Triton's disk cache (TRITON_CACHE_DIR, the
same directory for every worker) receives each variant once; then it waits for the others
(``barrier``: one file per finished worker in a directory named by xdist's run id, at most
``wait_s()`` seconds) and runs its cells, which load what the others compiled.

The signature approximates what Triton specializes a launch on (the head sizes, the layout of the
state and of the inputs, integer arguments divisible by 16 or equal to 1); a variant it does not
foresee is compiled by the cell that needs it, as without the warm-up.  The warm-up runs kernels
and discards their outputs: it decides nothing about any cell (an exception is ignored; the cell
meets it again and records it).

Opt-in: KDA_VERIFY_WARMUP=on.  Measured on one H200 (triton, fla, aiter x smoke, default, stress,
k3-prefill, -n 16, tools/device/matrix_speed_job.sh, both trees in one call) it made the matrix
slower, 114 s -> 141 s cold and 63 s -> 96 s warm (884 variants: 864 s of warm-up calls against
the compiles it saved), and its calls on cases cut to 512 tokens tripped a device-side index
assert that poisoned the CUDA context of the workers that ran them (816 cells became errors).
So it is never on by default; not done by a single process, for a backend of ``NO_COMPILE``, or
under Triton's interpreter unless asked.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

from verification.running.compile_time import compile_clock
from verification.running.room import no_room
from verification.running.run_cell import _fresh_state, _sync

NO_COMPILE = ("emulator", "emulator-bad", "fla-naive", "transformers", "moonshot")   # no Triton JIT
DEFAULT_WAIT_S = 240.0


def enabled(workers: int) -> bool:
    """Whether a session of ``workers`` xdist workers warms up: only when KDA_VERIFY_WARMUP=on
    (see the module docstring for why it is opt-in), and then with more than one worker."""
    how = os.environ.get("KDA_VERIFY_WARMUP", "").strip().lower()
    return workers > 1 and how == "on"


def wait_s() -> float:
    """How long a worker waits for the others' shares (KDA_VERIFY_WARMUP_WAIT_S, default 240 s)."""
    try:
        return float(os.environ.get("KDA_VERIFY_WARMUP_WAIT_S", DEFAULT_WAIT_S))
    except ValueError:
        return DEFAULT_WAIT_S


def signature(case) -> tuple:
    """What of a case decides which Triton variant a route compiles (an approximation, see the
    module docstring): K, V, HV / H, H divisible by 16 or 1, varlen, the token count divisible by
    16, one sequence, the state's form, fused projections, a padded slot stride, fresh paged slots."""
    p = case.params
    H = int(p.get("H", 2))
    HV = int(p.get("HV", H))
    varlen = "lens" in p
    lens = list(p["lens"]) if varlen else [int(p.get("T", 64))] * int(p.get("B", 1))
    tokens = sum(lens) if varlen else lens[0]          # the T a kernel is given: packed, or per sequence
    return (int(p.get("K", 128)), int(p.get("V", 128)), HV // max(1, H), H % 16 == 0, H == 1, varlen,
            tokens % 16 == 0, len(lens) == 1, str(p.get("state", "kv" if p.get("converged") else "none")),
            bool(p.get("fused_proj")), bool(p.get("slot_pad")), bool(p.get("paged_new")))


SHORT_T = 512


def shortened(case):
    """The case with a dense sequence cut to at most SHORT_T tokens (+ T mod 64, so T's
    divisibility stays): the same signature, a quick build and call."""
    T = case.params.get("T")
    if "lens" in case.params or T is None or int(T) <= SHORT_T:
        return case
    return dataclasses.replace(case, params=dict(case.params, T=SHORT_T + int(T) % 64))


def _size(case) -> int:
    p = case.params
    tokens = sum(p["lens"]) if "lens" in p else int(p.get("T", 64)) * int(p.get("B", 1))
    return tokens * int(p.get("HV", p.get("H", 2)))


def variants(cells: Iterable[tuple]) -> list[tuple]:
    """The distinct variants of (LoadedBackend, Route, Case) cells: one (backend, route, case) per
    (backend name, route name, signature), the smallest case of it; in a fixed order (by key), so
    every worker computes the same list.  Cells of unavailable backends, of ``NO_COMPILE`` and of
    long cases are left out."""
    best: dict = {}
    for lb, route, case in cells:
        if not getattr(lb, "available", True) or lb.name in NO_COMPILE or getattr(case, "long", False):
            continue
        key = (lb.name, route.name, signature(case))
        if key not in best or (_size(case), case.id) < (_size(best[key][2]), best[key][2].id):
            best[key] = (lb, route, case)
    return [best[k] for k in sorted(best, key=repr)]


def share(items: list, index: int, count: int) -> list:
    """Worker ``index`` of ``count``'s part: every count-th item from its index (disjoint, and
    together all of them)."""
    return items[index::max(1, count)]


def worker_index(worker_id: Optional[str]) -> Optional[int]:
    """N of xdist's ``gwN``, else None."""
    if worker_id and worker_id.startswith("gw") and worker_id[2:].isdigit():
        return int(worker_id[2:])
    return None


def barrier(directory: Path, me: str, count: int, timeout_s: float, poll_s: float = 0.05) -> float:
    """Say that ``me`` is done (a file in ``directory``) and wait until ``count`` workers are, or
    ``timeout_s`` passed; returns the seconds waited."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"done-{me}").touch()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if len(list(directory.glob("done-*"))) >= count:
            break
        time.sleep(poll_s)
    return time.perf_counter() - t0


def run_share(todo: list, call: Callable[[object, object, object], None]) -> int:
    """``call(backend, route, case)`` for each of ``todo``; an exception is ignored (the cell
    records it).  Returns how many calls returned."""
    done = 0
    for lb, route, case in todo:
        try:
            call(lb, route, case)
            done += 1
        except Exception:  # noqa: BLE001 - the warm-up decides nothing; the cell meets it again
            pass
    return done


def kernel_call(device: str) -> Callable:
    """One kernel call of a route on a case's Problem, its outputs discarded (what compiles it)."""
    def call(lb, route, case):
        if no_room(case, device) is not None:
            return
        problem = shortened(case).build(device=device)
        ok, _ = lb.backend.accepts(problem, route)
        if ok:
            lb.backend.run(_fresh_state(problem), route)
            _sync(device)
    return call


def warm_up(cells: list, worker_id: str, workers: int, run_id: str, device: str,
            call: Optional[Callable] = None, root: Optional[Path] = None) -> Optional[dict]:
    """This worker's share of the session's variants, then the barrier.  Returns {"variants": all,
    "mine": this worker's, "s": seconds in its calls, "wait_s", "compiles", "compile_s"} (None when
    there is nothing to do)."""

    index = worker_index(worker_id)
    every = variants(cells)
    if index is None or not every:
        return None
    mine = share(every, index, workers)
    clock = compile_clock()
    c0, n0 = clock.seconds, clock.compiles
    t0 = time.perf_counter()
    run_share(mine, call or kernel_call(device))
    s = time.perf_counter() - t0
    clock = compile_clock()                   # installed now if the calls imported Triton
    d = (root or Path(tempfile.gettempdir())) / f"kda-verify-warmup-{run_id}"
    waited = barrier(d, worker_id, workers, wait_s())
    return {"variants": len(every), "mine": len(mine), "s": s, "wait_s": waited,
            "compiles": clock.compiles - n0, "compile_s": clock.seconds - c0}
