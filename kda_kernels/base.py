"""The Backend protocol: what every kernel under test implements (docs/backends.md).

A Backend knows its name, whether it can run here (and why not, in words), its
routes, which Problems it accepts, and how to run one Route on a Problem.  A Route
is a named, fully pinned configuration (no autotuning inside a verdict): the flags
it sets and the emulator recipe that is its baseline.
"""
from __future__ import annotations

import copy
import importlib
import os
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, runtime_checkable

import torch

from kda_ref.problem import Problem
from kda_ref.truth import output_tensors


@dataclass(frozen=True)
class Route:
    name: str                                  # e.g. "seg:cps=4", "chunk:safe_gate"
    recipe: str = "flashkda"                   # emulator recipe whose error is this route's baseline
    flags: tuple = ()                          # ((key, value), ...): what the route pins
    description: str = ""

    def flag(self, key, default=None):
        return dict(self.flags).get(key, default)


FUSED_NORM_FLAG = "fused_norm"   # a Route flag: its kernel applies the Problem's fused output norm itself


def applicable(backend, problem: Problem, route: Route) -> tuple[bool, str]:
    """Whether ``route`` of ``backend`` can take ``problem``: the one place that decides that a
    Problem with a fused output norm (``out_gate``) runs only on a route flagged ``fused_norm``
    (its kernel applies the gated RMSNorm; every other route returns the plain o, which the truth
    of such a problem is not), so no backend needs to know of the norm; then the backend's own
    ``accepts``."""
    if problem.fused_norm and not route.flag(FUSED_NORM_FLAG, False):
        return False, ("not applicable: the problem has a fused output norm (out_gate, norm_weight) and this "
                       "route's kernel applies none")
    return backend.accepts(problem, route)


@dataclass
class Outputs:
    """What one run returns, in the Problem's layouts (see kda_ref.truth.Truth)."""
    o: torch.Tensor
    final_state: Optional[torch.Tensor] = None
    state_cache: Optional[torch.Tensor] = None
    taps: dict = field(default_factory=dict)   # workspace intermediates, named as the oracle's functions
    info: dict = field(default_factory=dict)   # e.g. {"route_ran": "..."}: what actually ran

    def tensors(self) -> dict:
        return output_tensors(self.o, self.final_state, self.state_cache)


@runtime_checkable
class Backend(Protocol):
    name: str

    def available(self) -> tuple[bool, str]:
        """(True, "") or (False, reason in words)."""

    def version(self) -> str:
        """Version string of the library or kernel under test."""

    def routes(self) -> list[Route]:
        """Every named, pinned route this backend has here."""

    def accepts(self, problem: Problem, route: Route) -> tuple[bool, str]:
        """(True, "") or (False, "not applicable: reason")."""

    def run(self, problem: Problem, route: Route) -> Outputs:
        """Run one route on one Problem."""


# ----------------------------------------------------------------------------------------
# Optional capabilities: each its own runtime-checkable Protocol, tested with isinstance by
# the harness (never by getattr/hasattr on a backend, and no attribute set from outside).
# ----------------------------------------------------------------------------------------
@runtime_checkable
class RunsPasses(Protocol):
    """Per-pass running (``kda-verify debug``): the passes a route runs and one pass on
    oracle-fed inputs.  Built in: triton, aiter, fla."""

    def debug_plan(self, problem: Problem, route: Route) -> dict:
        """{"form": "flashkda"|"fla", "chunk_size": C, "chunks_per_seg": n, "passes": [...]}."""

    def run_pass(self, problem: Problem, route: Route, pass_name: str, feed: Optional[dict] = None) -> dict:
        """Run one pass on ``feed`` (oracle tensors); the tensors it wrote, by oracle name."""


@runtime_checkable
class TakesBuffers(Protocol):
    """Taking guard buffers (verification.running.guards): with ``accepts_buffers`` true,
    ``run(problem, route, buffers=GuardedBuffers)`` allocates every output and workspace from
    ``buffers.allocate`` and writes the paged cache in place.  Built in: triton."""
    accepts_buffers: bool

    def run(self, problem: Problem, route: Route, *, buffers=None) -> Outputs:
        """As Backend.run, the buffers the caller's."""


@runtime_checkable
class ReturnsTaps(Protocol):
    """Taps: with ``taps`` true every run returns workspace intermediates as ``Outputs.taps``
    (ws_inv at least).  ``with_taps(True)`` is the same backend with taps on (a new object; the
    caller's is unchanged).  Built in: triton, emulator, emulator-bad."""
    taps: bool

    def with_taps(self, taps: bool = True) -> "ReturnsTaps":
        """This backend with taps on (or off)."""


@runtime_checkable
class LooksUpRoutes(Protocol):
    """Route lookup: ``route(name)`` canonicalises a route name that ``routes()`` may not list
    (e.g. "seg:cps=4") or raises ValueError/KeyError in one line.  Built in: triton."""

    def route(self, name: str) -> Route:
        """The Route named ``name``."""


@runtime_checkable
class ChecksContract(Protocol):
    """A documented but unchecked input range (see out_of_contract below).  Built in: moonshot."""

    def out_of_contract(self, problem: Problem, route: Route) -> Optional[str]:
        """None, or one line naming the documented range and the value that violates it."""


@runtime_checkable
class RunsTraces(Protocol):
    """Serving-trace calls (docs/traces.md, "Calls"): the groups of a trace step a route runs
    (kda_kernels.trace_calls: a prefill chunk kernel over a paged cache, a recurrent decode
    kernel, the same with speculative rows).  Each trace route has the flag ("groups", (...))
    naming the groups it runs, a subset of ("prefill", "decode", "spec")."""

    def trace_routes(self) -> list[Route]:
        """The routes that run trace calls (may differ from routes())."""

    def trace_accepts(self, trace, route: Route) -> tuple[bool, str]:
        """(True, "") or (False, "not applicable: reason"), from the trace's cache spec
        (layout, dtype, slot stride, pad convention), shapes and model options."""

    def run_call(self, call, route: Route) -> torch.Tensor:
        """Run one PhaseCall: write the cache in place, return o [1, T, HV, V]."""


CAPABILITIES: dict[str, type] = {
    "runs_passes": RunsPasses,
    "takes_buffers": TakesBuffers,
    "returns_taps": ReturnsTaps,
    "looks_up_routes": LooksUpRoutes,
    "checks_contract": ChecksContract,
    "runs_traces": RunsTraces,
}


def capabilities(backend) -> list[str]:
    """The names (CAPABILITIES' keys) of the optional capabilities ``backend`` has."""
    return [name for name, proto in CAPABILITIES.items() if isinstance(backend, proto)]


def with_taps(backend, taps: bool = True):
    """A copy of ``backend`` with its ``taps`` switch set: the ReturnsTaps.with_taps of a
    built-in backend (the caller's object is unchanged)."""

    other = copy.copy(backend)
    other.taps = bool(taps)
    return other


def copy_with_padding(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with the same strides over a copy of its whole storage (padding kept)."""
    n = t.untyped_storage().nbytes() // t.element_size()
    flat = t.new_empty(0).set_(t.untyped_storage(), 0, (n,), (1,)).clone()
    return flat.as_strided(t.shape, t.stride(), t.storage_offset())


class BackendError(RuntimeError):
    """A backend could not be loaded or run; the message says why."""


def out_of_contract(backend, problem: Problem, route: Route) -> Optional[str]:
    """The range a kernel documents but does not check, where ``problem`` lies outside it.

    Optional capability of a Backend (ChecksContract): a method
    ``out_of_contract(problem, route) -> Optional[str]`` returning None (within the documented
    contract) or one line naming the documented range and the value that violates it (e.g.
    "lower_bound -5.5 outside the documented [-5, 0]").  Such a cell still runs; the harness
    records what the kernel did (raised, or returned what) with the status "out-of-contract",
    never a pass or a failure.  A backend without the method documents no such range (None).
    Exceptions propagate."""
    if not isinstance(backend, ChecksContract):
        return None
    why = backend.out_of_contract(problem, route)
    return str(why) if why else None


BUILTIN_BACKENDS: dict[str, str] = {
    "emulator": "kda_kernels.emulator:EmulatorBackend",
    "emulator-bad": "kda_kernels.controls:negative_control",
    "triton": "kda_kernels.triton.backend:TritonBackend",
    "fla": "kda_kernels.fla:FlaBackend",
    "aiter": "kda_kernels.aiter:AiterBackend",
    "moonshot": "kda_kernels.moonshot:MoonshotBackend",
    "fla-naive": "kda_kernels.references:FlaNaiveBackend",
    "transformers": "kda_kernels.references:TransformersBackend",
    "cudnn": "kda_kernels.cudnn:CudnnBackend",
}


def load_backend(spec: str, **kwargs) -> Backend:
    """A backend by built-in name (emulator, triton, fla, aiter, moonshot) or as
    ``package.module:factory`` (any callable returning a Backend)."""

    target = BUILTIN_BACKENDS.get(spec, spec)
    if ":" not in target:
        raise BackendError(f"--backend: expected a built-in name ({', '.join(BUILTIN_BACKENDS)}) "
                           f"or package.module:factory, got {spec!r}")
    mod_name, _, attr = target.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise BackendError(f"--backend: cannot import {mod_name!r} for {spec!r}: {e}") from e
    factory: Optional[Callable] = getattr(mod, attr, None)
    if factory is None:
        raise BackendError(f"--backend: module {mod_name!r} has no {attr!r} (from {spec!r})")
    backend = factory(**kwargs)
    missing = [m for m in ("name", "available", "routes", "accepts", "run") if not hasattr(backend, m)]
    if missing:
        raise BackendError(f"--backend: {spec!r} made an object without {', '.join(missing)} "
                           f"(the Backend protocol, kda_kernels/base.py)")
    return backend


# ----------------------------------------------------------------------------------------
# The environment switches a kernel library reads when it is imported: the one place they are set
# ----------------------------------------------------------------------------------------
LIBRARY_SWITCHES = {
    # fla: its own Triton kernels, not its FlashKDA dispatch (the routes verify fla's kernels);
    # forced, since a caller's FLA_FLASH_KDA=1 would silently verify another library
    "fla": ("FLA_FLASH_KDA", "0", True),
    # aiter: its Triton modules only (its C++ extensions need a ROCm build); a caller's own value kept
    "aiter": ("AITER_TRITON_ONLY", "1", False),
}


def set_library_switch(library: str) -> None:
    """Set the environment switch of ``library`` (LIBRARY_SWITCHES) before it is imported."""
    name, value, forced = LIBRARY_SWITCHES[library]
    if forced:
        os.environ[name] = value
    else:
        os.environ.setdefault(name, value)
