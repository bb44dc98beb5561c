"""Stand-in written by kda-verify (not aiter code), placed by tools/assemble_aiter_upstream.py.

Upstream's flash_kda.py (ROCm/aiter c1397349) imports _triton_kernels/kimi_delta_attn/
chunk_delta_attn_utils.py, which no stored public copy (ROCm/aiter or a fork) has.  This module
re-exports the 2026-08 base tree's chunk_delta_attn/chunk_delta_attn_utils.py (RCP_LN2, exp, exp2,
tensor_cache, autotune_cache_kwargs, CHUNK_DELTA_ATTN_TRITON_AUTOTUNE, ...) and adds the three
names flash_kda.py needs that the base lacks:

  chunk_delta_attn_tuned_config(kernel, fallback, backend="triton")   the base rule (the published
      DEFAULT.json entry for this device, else ``fallback``), with the backend argument passed on
  chunk_delta_attn_tuned_config_shortlist(kernel, fallbacks)          [that config for fallbacks[0]]
  input_guard(skip=(...))   makes tensor arguments contiguous, except the keyword arguments named
      in ``skip`` (flash_kda_fwd exempts the caller-owned ``out`` and the paged ``state_cache``)
"""
import functools

import torch

from aiter.ops.triton._triton_kernels.chunk_delta_attn.chunk_delta_attn_utils import *  # noqa: F401,F403
from aiter.ops.triton._triton_kernels.chunk_delta_attn.chunk_delta_attn_utils import (  # noqa: F401
    CHUNK_DELTA_ATTN_TRITON_AUTOTUNE,
    RCP_LN2,
    autotune_cache_kwargs,
    exp,
    exp2,
    tensor_cache,
)
from aiter.ops.triton.utils.tuned_config_utils import get_tuned_kernel_config


def chunk_delta_attn_tuned_config(kernel_name, fallback, backend="triton"):
    return get_tuned_kernel_config("attention", "CHUNK_DELTA_ATTN", kernel_name, fallback,
                                   backend=backend)


def chunk_delta_attn_tuned_config_shortlist(kernel_name, fallbacks):
    return [chunk_delta_attn_tuned_config(kernel_name, fallbacks[0])]


def input_guard(fn=None, *, skip=()):
    def wrap(f):
        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            args = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
            kwargs = {k: v.contiguous() if isinstance(v, torch.Tensor) and k not in skip else v
                      for k, v in kwargs.items()}
            return f(*args, **kwargs)
        return wrapper
    return wrap(fn) if fn is not None else wrap
