"""Stand-in written by kda-verify (not aiter code), placed by tools/assemble_aiter_upstream.py.

Upstream's own _triton_kernels/kimi_delta_attn/gla_output.py (ROCm/aiter 5677775a / 150a57b5) is not
vendored (not needed by the FlashKDA routes), so this re-exports the 2026-08 base tree's chunk_delta_attn/gla_output.py, its predecessor.  Only the default (non-FlashKDA)
pipeline of chunk_delta_attn_fwd calls it; the FlashKDA routes never do.
"""
from aiter.ops.triton._triton_kernels.chunk_delta_attn.gla_output import *  # noqa: F401,F403
