"""Stand-in written by kda-verify (not aiter code), placed by tools/assemble_aiter_upstream.py.

Upstream renamed _triton_kernels/gated_delta_rule to gated_delta_net after the 2026-08 base;
chunk_fwd.py imports chunk_gated_delta_rule_fwd_h from the new name.  This re-exports the base
tree's gated_delta_rule/prefill/chunk_delta_h.py.  Only the default (non-FlashKDA) pipeline
calls it.
"""
from aiter.ops.triton._triton_kernels.gated_delta_rule.prefill.chunk_delta_h import *  # noqa: F401,F403
