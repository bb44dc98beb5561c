"""Stand-in written by kda-verify (not aiter code), placed by tools/assemble_aiter_upstream.py.

The kimi_delta_attn.utils package marker (upstream's own __init__ is not stored at a fitting
commit); its modules are index.py (a fork copy) and the stand-ins cumsum.py / l2norm.py.
"""
