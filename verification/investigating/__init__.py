"""Investigating: tools for a cell that drifted, or for the harness itself.

debug (one pass against the oracle), shrink (the smallest failing problem), mutate and mutants
(mutation testing of our Triton kernels), invariance (properties a correct kernel keeps), bench,
calibrate (proposing tolerances), aiter_isa and aiter_kda_isa (cross-compiling aiter's kernels),
selfcheck (the oracle's own check).
"""
