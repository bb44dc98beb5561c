"""Reporting: what a run leaves behind for a reader.

report_load, report_summary, report_plots and report_render (report.md / .html / .json and
plots from a results directory: loading, summarising, the figures, rendering), findings (the register of
known failures), bundle (upstream-ready repro bundles), provenance (what ran, where, from which
sources), problem_file (the problem / outputs files of export, capture and check).
"""
