"""Stand-in written by kda-verify (not aiter code), placed by tools/assemble_aiter_upstream.py.

Package marker for the renamed gated_delta_net (see chunk_delta_h.py beside it).
"""
