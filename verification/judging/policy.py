"""The policy: what a cell's status means, what counts as judged, the headline and the exit code.

README.md's "Headline and exit codes" is this module in words.  Every ``kda-verify`` command
(verification/cli.py maps the exception that ends one; verification/commands/*.py what one
finished with) and ``pytest -m verify`` (verification/pytest_plugin.py) take their exit code from
``exit_code``; the runner, the report, calibration and check take the status sets from here.

Statuses of a cell (a record's ``status``):

    pass, known-fail, fail, mistrusted   JUDGED: a verdict was reached, the cell was verified
    skipped, out-of-contract             not judged: not applicable here, or outside the kernel's
                                         documented range (never a pass or a failure)
    error, crashed                       not judged: the kernel raised, or killed its process
    resource-error                       not judged: the harness ran out of memory on the cell

FAILING (fail, mistrusted, crashed, error) are the kernel failures: any one exits 1.
The judged metrics (JUDGED_METRICS) are the error measures the verdict holds to a threshold.
"""
from __future__ import annotations

from typing import Iterable, Optional

from verification.errors import KernelFailure, bad_input_errors

# ---- exit codes ------------------------------------------------------------------------------
EXIT_OK = 0            # verified: every judged cell passed (or is a listed known failure), one at least
EXIT_FAIL = 1          # a kernel failure: a cell failed, was mistrusted, crashed or raised
EXIT_USAGE = 2         # bad input or a bad environment, nothing verified, or a resource-error alone
EXIT_INTERNAL = 3      # an internal error of kda-verify (one line naming the file with the traceback)
EXIT_INTERRUPTED = 130  # Ctrl-C
EXIT_CODES = (EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED)

EXIT_CODES_HELP = """\
Exit codes:
  0    verified: every judged cell passed (or is a listed known failure), at least one was judged
  1    a kernel failure: a cell failed, was mistrusted, crashed or raised
  2    bad input or a bad environment (one line names the argument, what was expected, what
       came), nothing verified (every cell skipped: backend unavailable, case not applicable),
       or the harness out of memory on a cell (resource-error) with no kernel failure
  3    an internal error of kda-verify: one line names the file that holds the traceback
  130  interrupted (Ctrl-C): one line; the report says INTERRUPTED and how many selected cells
       did not run (run --resume continues)
"""

# ---- statuses --------------------------------------------------------------------------------
RESOURCE_ERROR = "resource-error"      # the harness ran out of memory (case build, oracle, baseline, judging)
NOT_APPLICABLE = "not-applicable"      # judge's: no sound baseline; the cell is recorded "skipped", never a pass
OUT_OF_CONTRACT = "out-of-contract"    # outside the kernel's documented range, or its recipe's (judge's); never a pass
BAD_INPUT = "bad-input"                # check: a problem or outputs file that cannot be read, or a missing dump
STATUSES = ("pass", "fail", "mistrusted", "crashed", "skipped", "error", "known-fail", "out-of-contract",
            RESOURCE_ERROR, BAD_INPUT)
JUDGED = ("pass", "known-fail", "fail", "mistrusted")     # a verdict was reached: the cell was verified
UNJUDGED = tuple(s for s in STATUSES if s not in JUDGED)  # no verdict, so no margin of these means anything
FAILING = ("fail", "mistrusted", "crashed", "error")      # a kernel failure: exit 1
HEADLINE_ORDER = ("pass", "known-fail", "fail", "mistrusted", "error", "crashed", "out-of-contract", "skipped",
                  RESOURCE_ERROR, BAD_INPUT)
JUDGED_METRICS = ("rel_l2", "tail_rel_l2")                # err of the verdict: each <= its threshold
DEFAULT_RECIPE = "flashkda"   # the baseline's recipe when none is named (a route without one, check, assert_kda_close)


# ---- the exit code ---------------------------------------------------------------------------
def exit_code(statuses: Optional[Iterable[str]] = None, *, error: Optional[BaseException] = None,
              failed: bool = False, interrupted: bool = False, allow_nothing_verified: bool = False) -> int:
    """The exit code of a command or a ``pytest -m verify`` session from what happened.

    error: the exception that ended it, if one did: Ctrl-C (KeyboardInterrupt, errors.Interrupted)
        130; bad input or a bad environment (errors.bad_input_errors(), an OSError on a path) 2;
        a kernel that raised while the command ran it (errors.KernelFailure) 1; anything else is
        kda-verify's own bug, 3.
    statuses: the status of every cell it judged (run, check, pytest -m verify); None for a
        command without cells.
    failed: a kernel failure found otherwise (a debug pass over its threshold, a selfcheck, isa,
        bench or mutate failure, a capture whose kernel raised).
    interrupted: Ctrl-C stopped it after it kept what it had (130).
    allow_nothing_verified: cells, none judged, and that is expected (--allow-nothing-verified,
        --kda-allow-skips): 0 instead of 2.

    Order: error, interrupted, then any failing cell or ``failed`` 1, then a resource-error or a
    bad-input cell (a file ``check`` could not read: the user's input, not the kernel) 2,
    then cells of which none was judged 2, else 0."""
    if error is not None:
        if isinstance(error, KeyboardInterrupt):
            return EXIT_INTERRUPTED
        if isinstance(error, bad_input_errors()):
            return EXIT_USAGE
        if isinstance(error, KernelFailure):
            return EXIT_FAIL
        if isinstance(error, OSError) and error.filename is not None:   # a path the environment refused
            return EXIT_USAGE
        return EXIT_INTERNAL
    if interrupted:
        return EXIT_INTERRUPTED
    sts = None if statuses is None else list(statuses)
    if failed or any(s in FAILING for s in sts or ()):
        return EXIT_FAIL
    if RESOURCE_ERROR in (sts or ()) or BAD_INPUT in (sts or ()):
        return EXIT_USAGE
    if sts is not None and not any(s in JUDGED for s in sts) and not allow_nothing_verified:
        return EXIT_USAGE
    return EXIT_OK


# ---- the headline ----------------------------------------------------------------------------
def _skip_reason(rec: dict) -> str:
    """A skipped cell's reason, naming the backend when it is the backend that is unavailable."""
    why = str(rec.get("reason") or "no reason given")
    prefix = "backend unavailable: "
    if why.startswith(prefix):
        return f"backend {rec.get('backend')} unavailable: {why[len(prefix):]}"
    return why


def _common_reason(records: list) -> str:
    """The most frequent reason of the unjudged cells of ``records``, and how many had another."""
    reasons: dict[str, int] = {}
    for r in records:
        if r.get("status") not in JUDGED:
            k = _skip_reason(r) if r.get("status") == "skipped" else f"{r.get('status')}: {r.get('reason') or ''}"
            reasons[k] = reasons.get(k, 0) + 1
    if not reasons:
        return "every cell was judged"
    top, n = max(reasons.items(), key=lambda kv: kv[1])
    rest = sum(reasons.values()) - n
    return top + (f"; {rest} more cell{'s' if rest != 1 else ''} for other reasons" if rest else "")


def headline(records: list, not_run: int = 0) -> str:
    """The headline of a run, its report and ``pytest -m verify``: ``VERIFIED <n> of <N> cells: 16
    pass, 1 known-fail, 1 skipped`` when n cells reached a verdict, ``NOTHING VERIFIED: <N> cells
    skipped (<reason>)`` when none did; an interrupted run (``not_run`` selected cells without a
    record) starts with ``INTERRUPTED: <not_run> of <selected> selected cells not run; ``."""
    counts: dict[str, int] = {}
    for r in records:
        counts[r.get("status", "?")] = counts.get(r.get("status", "?"), 0) + 1
    order = list(HEADLINE_ORDER) + sorted(k for k in counts if k not in HEADLINE_ORDER)
    tally = ", ".join(f"{counts[k]} {k}" for k in order if counts.get(k))
    n = sum(counts.get(k, 0) for k in JUDGED)
    total = len(records)
    if n:
        line = f"VERIFIED {n} of {total} cells: {tally}"
    elif total and counts.get("skipped", 0) == total:
        line = f"NOTHING VERIFIED: {total} cells skipped ({_common_reason(records)})"
    else:
        line = f"NOTHING VERIFIED: {total} cells: {tally or 'none'}" + (f" ({_common_reason(records)})" if total else "")
    if not_run:
        line = f"INTERRUPTED: {not_run} of {total + not_run} selected cells not run; {line}"
    return line


def nothing_verified_reason(records: list) -> Optional[str]:
    """None when some cell reached a verdict; else why none did, on one line (the reason most
    cells share, e.g. ``backend fla unavailable: ...``; "no cells" for an empty matrix)."""
    if any(r.get("status") in JUDGED for r in records):
        return None
    if not records:
        return "no cells"
    return _common_reason(records)
