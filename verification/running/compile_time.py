"""Triton compile time of this process, measured through Triton's own hooks (no GPU needed).

``compile_clock()`` installs, once per process and once Triton is imported, three hooks of ``triton.knobs`` (Triton 3.6),
each chained to whatever was installed before it:

    knobs.compilation.listener         called by ``triton.compile`` at its end with Triton's own
                                       stage durations (``CompileTimes``) and ``cache_hit``: the
                                       front end, every lowering stage and storing the results, or
                                       on a disk-cache hit its lookup and load.  Fires for JIT
                                       launches and for direct ``triton.compile`` calls
                                       (cross-compilation, as ``kda-verify isa`` does, works on a CPU).
    knobs.runtime.jit_post_compile_hook  a JIT kernel was just compiled for a launch: starts the
                                       clock of its launch preparation ...
    knobs.runtime.kernel_load_end_hook   ... which stops when its binary is loaded: the launcher stub
                                       (C, built with the system compiler on a cold cache) and the
                                       module load happen in between.

``seconds`` is the sum of both.  A kernel already in the JIT's in-memory cache fires nothing.
Under ``TRITON_INTERPRET=1`` nothing is compiled: the hooks never fire and ``how`` says
``interpreted``.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Optional


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter here (TRITON_INTERPRET)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


class CompileClock:
    """Accumulated Triton compile seconds of this process (read a difference around a call)."""

    def __init__(self):
        self.compile_s = 0.0       # inside triton.compile (Triton's CompileTimes)
        self.load_s = 0.0          # launch preparation of a freshly JIT-compiled kernel
        self.compiles = 0          # triton.compile calls that compiled
        self.cache_hits = 0        # ... and that found the kernel in Triton's disk cache
        self.installed = False
        self.error = ""
        self._pending: Optional[float] = None

    @property
    def seconds(self) -> float:
        return self.compile_s + self.load_s

    @property
    def how(self) -> str:
        """interpreted | measured | unavailable (Triton's hooks could not be installed) |
        no triton (not imported in this process: nothing to compile)."""
        if interpreted():
            return "interpreted"
        if self.installed:
            return "measured"
        return "unavailable" if self.error else "no triton"

    def forget_pending(self) -> None:
        """Drop an unfinished launch-preparation interval (a kernel whose load failed)."""
        self._pending = None

    def mark(self) -> tuple:
        """The clock's reading before a call (an unfinished launch interval dropped first), for
        ``since``."""
        self.forget_pending()
        return self.seconds, self.compiles, self.cache_hits

    def since(self, mark: tuple) -> dict:
        """What was compiled since ``mark``: {"compile_s", "compiles", "compile_cache_hits"} (a
        cell's timings)."""
        s0, n0, h0 = mark
        return {"compile_s": self.seconds - s0, "compiles": self.compiles - n0, "compile_cache_hits": self.cache_hits - h0}

    # ---- the hooks' bodies (public so tests can drive them without a GPU)
    def on_compile(self, times, cache_hit: bool) -> None:
        us = int(getattr(times, "ir_initialization", 0) or 0) + int(getattr(times, "store_results", 0) or 0)
        us += sum(int(d) for _, d in (getattr(times, "lowering_stages", None) or []))
        self.compile_s += us / 1e6
        if cache_hit:
            self.cache_hits += 1
        else:
            self.compiles += 1

    def on_post_compile(self, is_warmup: bool) -> None:
        # a warm-up compiles without launching: no load follows now
        self._pending = None if is_warmup else time.perf_counter()

    def on_load_end(self) -> None:
        if self._pending is not None:
            self.load_s += time.perf_counter() - self._pending
            self._pending = None


_CLOCK: Optional[CompileClock] = None


def install(clock: CompileClock) -> CompileClock:
    """Chain the clock's hooks into triton.knobs (Triton >= 3.4 has them)."""
    try:
        # lazy: a probe of what is installed (docs/design.md, Imports)
        import triton
        knobs = triton.knobs
        comp, rt = knobs.compilation, knobs.runtime
        prev_listener = comp.listener
        prev_post = rt.jit_post_compile_hook
        load_end = rt.kernel_load_end_hook
        if not hasattr(load_end, "add"):
            raise AttributeError("triton.knobs.runtime.kernel_load_end_hook is not a hook chain")
    except Exception as e:  # noqa: BLE001 - no Triton or an older one: compile time is not measured
        clock.error = f"{type(e).__name__}: {e}"
        return clock

    def listener(*, src, metadata, metadata_group, times, cache_hit, **kw):
        clock.on_compile(times, cache_hit)
        if prev_listener is not None:
            prev_listener(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                          cache_hit=cache_hit, **kw)

    def post_compile(**kw):
        clock.on_post_compile(bool(kw.get("is_manual_warmup")))
        return prev_post(**kw) if prev_post is not None else None

    def load_done(*args, **kw):
        clock.on_load_end()

    comp.listener = listener
    rt.jit_post_compile_hook = post_compile
    load_end.add(load_done)
    clock.installed = True
    return clock


def compile_clock() -> CompileClock:
    """This process's clock, its hooks installed once Triton is imported (by a backend: loading or
    probing one that uses Triton imports it before its first call; the emulator never does, and
    a process that runs only the emulator never imports Triton for the clock's sake)."""
    global _CLOCK
    if _CLOCK is None:
        _CLOCK = CompileClock()
    if not _CLOCK.installed and not _CLOCK.error and "triton" in sys.modules:
        install(_CLOCK)
    return _CLOCK
