"""Stand-in written by kda-verify (not aiter code), placed by tools/assemble_aiter_upstream.py.

Upstream's chunk_bwd.py (the backward, ROCm/aiter 15c56cc4, 69 kB) is not vendored: the
package __init__ and chunk_delta_attn.py import chunk_delta_attn_bwd, and only a call that needs
grad reaches it.  Calling it raises.
"""


def chunk_delta_attn_bwd(*args, **kwargs):
    raise NotImplementedError("the kimi_delta_attn backward (chunk_bwd.py) is not in this assembled "
                              "tree; it is forward-only")
