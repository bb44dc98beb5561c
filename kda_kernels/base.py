"""The Backend protocol: what every kernel under test implements (docs/backends.md).

A Backend knows its name, whether it can run here (and why not, in words), its
routes, which Problems it accepts, and how to run one Route on a Problem.  A Route
is a named, fully pinned configuration (no autotuning inside a verdict): the flags
it sets and the emulator recipe that is its baseline.
"""
from __future__ import annotations

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


class BackendError(RuntimeError):
    """A backend could not be loaded or run; the message says why."""


def out_of_contract(backend, problem: Problem, route: Route) -> Optional[str]:
    """The range a kernel documents but does not check, where ``problem`` lies outside it.

    Optional capability of a Backend: a method ``out_of_contract(problem, route) -> Optional[str]``
    returning None (within the documented contract) or one line naming the documented range and
    the value that violates it (e.g. "lower_bound -5.5 outside the documented [-5, 0]").  Such a
    cell still runs; the harness records what the kernel did (raised, or returned what) with the
    status "out-of-contract", never a pass or a failure.  A backend without the method documents
    no such range (None).  Exceptions propagate."""
    fn = getattr(backend, "out_of_contract", None)
    if fn is None:
        return None
    why = fn(problem, route)
    return str(why) if why else None


BUILTIN_BACKENDS: dict[str, str] = {
    "emulator": "kda_kernels.emulator:EmulatorBackend",
    "emulator-bad": "kda_kernels.controls:negative_control",
    "triton": "kda_kernels.triton.backend:TritonBackend",
    "fla": "kda_kernels.fla:FlaBackend",
    "aiter": "kda_kernels.aiter:AiterBackend",
    "moonshot": "kda_kernels.moonshot:MoonshotBackend",
}


def load_backend(spec: str, **kwargs) -> Backend:
    """A backend by built-in name (emulator, triton, fla, aiter, moonshot) or as
    ``package.module:factory`` (any callable returning a Backend)."""
    import importlib

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
