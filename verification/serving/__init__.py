"""Serving traces run on backends and judged (docs/traces.md, "Running traces"): execute (a
pairing's run, step by step), judge (verdicts of one step), diagnose (the first failure named),
cases (the serving suite), cells (records of the report), command (``run --suite serving``)."""
