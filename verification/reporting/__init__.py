"""Reporting: what a run leaves behind for a reader.

report (report.md / .html / .json and plots from a results directory), findings (the register of
known failures), bundle (upstream-ready repro bundles), provenance (what ran, where, from which
sources), problem_file (the problem / outputs files of export, capture and check).
"""
