"""Judging: what a kernel's output is measured by and what the measurement means.

metrics (errors against the oracle, per slice), baselines (a recipe's error on the same case),
tolerances (+ tolerances.yaml: the allowed ratio to the baseline, each with its measured basis),
verdict (a cell's pass / fail from those), record (the one record of a cell and its JSON codec),
policy (statuses, what counts as judged, exit codes, the long-case and results-file rules, the
default recipe, the environment switches).
"""
