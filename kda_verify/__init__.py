"""kda_verify: kda-verify's verdict as an assertion for a kernel author's own tests.

    import kda_verify
    kda_verify.assert_kda_close((o, final_state), problem)            # raises AssertionError, or passes

``assert_kda_close`` judges one kernel call the way ``kda-verify run`` judges a cell and
``kda-verify check`` judges files (verification.commands.check.judge_files ->
verification.judging.verdict.judge): against the float64 oracle and the baseline recipe's error on the
same problem, every tensor and every slice, with the tolerances.yaml entry, the cap and the
recipe's range.  Under pytest the plugin of this package offers it as the fixture ``kda_close``.
"""
from kda_verify.close import assert_kda_close, save_repro

__all__ = ["assert_kda_close", "save_repro"]
