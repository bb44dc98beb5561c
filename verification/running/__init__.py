"""Running: which cells run, and running them.

selection and cases (the suites and what a run selects); run_select (backends, routes, the plan,
resume), run_cell (one cell), run_isolated (a cell in a child process), run_store (results
files), run_progress, run_matrix (the matrix); room
(memory admission), guards (poisoned memory around outputs), devices, timing (where the time
went), cache (truths and baselines on disk), warmup, compile_time, environment (the checks of
the installed stack).
"""
