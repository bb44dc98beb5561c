"""What every pass's launcher shares: the launch context, buffer allocation, kernel launch,
the state views and the input error.

The launch context (``LaunchContext``) is explicit state, set for a block of code with
``launch_context(...)`` and read with ``current_context()``; nothing assigns module attributes:

    recorder        a list: launches are appended as (kernel, grid, args, kwargs), not run
                    (``kda-verify isa`` records a forward to learn its kernel variants)
    target_is_hip   True / False: launch parameters for an AMD / NVIDIA target; None: this
                    torch's platform
    allocator       allocator(name, shape, dtype, device) -> tensor makes every buffer the
                    forward allocates (guard-banded buffers, verification.running.guards); None: torch.empty

Under Triton's CPU interpreter the first launch applies the interpreter fixes of
``_interpreter_compat`` (once; compiled kernels are untouched).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import _interpreter_compat

D = 128          # K == V == 128


@dataclass(frozen=True)
class LaunchContext:
    recorder: Optional[list] = None
    target_is_hip: Optional[bool] = None
    allocator: Optional[Callable] = None

    @property
    def hip(self) -> bool:
        """Whether the launches are for an AMD target."""
        return torch.version.hip is not None if self.target_is_hip is None else bool(self.target_is_hip)


_CONTEXT: contextvars.ContextVar = contextvars.ContextVar("kda_triton_launch_context", default=LaunchContext())


def current_context() -> LaunchContext:
    return _CONTEXT.get()


@contextlib.contextmanager
def launch_context(**changes):
    """``with launch_context(recorder=[], target_is_hip=True) as ctx:`` runs the block with those
    fields of the current context replaced (the others kept); the previous context comes back on
    exit."""
    ctx = dataclasses.replace(current_context(), **changes)
    token = _CONTEXT.set(ctx)
    try:
        yield ctx
    finally:
        _CONTEXT.reset(token)


def use_allocator(fn):
    """``with use_allocator(fn):`` every buffer the forward allocates comes from ``fn(name, shape,
    dtype, device)`` (``None``: torch.empty); the previous allocator is restored on exit."""
    return launch_context(allocator=fn)


def empty(name: str, shape, dtype, device) -> torch.Tensor:
    """A new buffer named ``name`` (o, final_state, ws_*, A_seg, b_seg, h_in): torch.empty, or the
    context's allocator's."""
    alloc = current_context().allocator
    if alloc is not None:
        return alloc(name, tuple(shape), dtype, device)
    return torch.empty(shape, dtype=dtype, device=device)


def launch(kernel, grid, *args, no_tokens: bool = False, **kwargs):
    """Launch ``kernel[grid](*args, **kwargs)``, or record it when the context has a recorder.
    With ``no_tokens`` (a forward without a single chunk) empty tensors are passed as a 1-element
    stand-in: their storage may be a null pointer, which the launcher rejects, and the kernels
    never touch them."""
    if no_tokens:
        args = tuple(_non_null(a) for a in args)
    ctx = current_context()
    if ctx.recorder is not None:
        ctx.recorder.append((kernel, grid, args, kwargs))
        return
    if _interpreter_compat.is_interpreted(kernel):
        _interpreter_compat.install(force=True)
    kernel[grid](*args, **kwargs)


def _non_null(a):
    if isinstance(a, torch.Tensor) and a.numel() == 0:
        return torch.zeros(1, dtype=a.dtype, device=a.device)
    return a


class FlashKDAError(ValueError):
    """Bad input to the Triton FlashKDA forward; one line naming the argument."""


def fail(msg: str):
    raise FlashKDAError(msg)


@dataclass
class StateRef:
    """A K-first view of a stack of states: element (row, h, k, v) at
    ``row*sn + h*sh + k*sk + v*sv``; paged: row = state_indices[n], read only if has[n]."""
    tensor: torch.Tensor
    strides: tuple
    indices: Optional[torch.Tensor] = None
    has: Optional[torch.Tensor] = None

    @property
    def paged(self) -> bool:
        return self.indices is not None


def dense_state(t: torch.Tensor, layout: str) -> StateRef:
    """[N, H, K, V] (layout "kv") or [N, H, V, K] ("vk") as a K-first StateRef."""
    sn, sh, sa, sb = t.stride()
    return StateRef(t, (sn, sh, sa, sb) if layout == "kv" else (sn, sh, sb, sa))


def paged_state(cache: torch.Tensor, indices: torch.Tensor, has: torch.Tensor) -> StateRef:
    """A V-first cache [slots, H, V, K], sequence n at slot indices[n], read only if has[n]."""
    sn, sh, sv, sk = cache.stride()
    return StateRef(cache, (sn, sh, sk, sv), indices, has)
