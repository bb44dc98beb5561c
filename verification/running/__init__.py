"""Running: which cells run, and running them.

selection and cases (the suites and what a run selects), runner (one cell and the matrix), room
(memory admission), guards (poisoned memory around outputs), devices, timing (where the time
went), cache (truths and baselines on disk), warmup, compile_time, environment (the checks of
the installed stack).
"""
