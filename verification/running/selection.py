"""Which cells a run has: the cases of the chosen suites, the fuzz draw, the options' lists, and
Triton's CPU interpreter where a run of the triton backend needs it.

Shared by ``kda-verify run`` (and calibrate, export, shrink) and the pytest plugin
(``pytest -m verify``); every bad option is a UsageError naming it.
"""
from __future__ import annotations

import fnmatch
import os
import sys
import warnings

import torch

from verification.errors import UsageError
from verification.running.cases import fuzz_options, get_suite


def split_list(values) -> list[str]:
    """Repeatable, comma-separable options: ["a,b", "c"] -> ["a", "b", "c"]."""
    out = []
    for v in values or []:
        out.extend(x.strip() for x in str(v).split(",") if x.strip())
    return out


def fuzz_args(args, suites: list[str], names=("--fuzz-n", "--fuzz-seed")) -> tuple:
    """(n, seed) of the fuzz draw from --fuzz-n / --fuzz-seed (None: not given), checked: an
    integer >= 1 (>= 0 for the seed), and only together with the fuzz suite."""
    n, seed = getattr(args, "fuzz_n", None), getattr(args, "fuzz_seed", None)
    checked = fuzz_options(n, seed, names=names)
    for value, name, got in ((n, names[0], checked[0]), (seed, names[1], checked[1])):
        if value is not None and "fuzz" not in suites:
            raise UsageError(f"{name}: expected together with the fuzz suite, got {name} {got} with suite(s) "
                             f"{', '.join(suites) or '(none)'}")
    return (None if n is None else checked[0]), (None if seed is None else checked[1])


def select_cases(suites: list[str], patterns: list[str] | None, long: bool = True,
                 fuzz_n: int | None = None, fuzz_seed: int | None = None) -> list:
    """The cases of the suites, in suite order, filtered by --case patterns (each must match).
    long=False drops the suites' long cases unless a pattern names them; fuzz_n / fuzz_seed
    size and seed the fuzz suite's draw (None: 20 cases, seed 0)."""

    cases, seen = [], set()
    for s in suites:
        opts = {"n": fuzz_n, "seed": fuzz_seed} if s == "fuzz" else {}
        for c in get_suite(s, long=long or bool(patterns), **opts):
            if c.id not in seen:
                seen.add(c.id)
                cases.append(c)
    def miss(pat):
        sample = ", ".join(c.id for c in cases[:6]) + (", ..." if len(cases) > 6 else "")
        draw = next((c.suite_opts for c in cases if c.suite == "fuzz"), None)
        note = (f" (fuzz ids depend on the draw: this one is --fuzz-n {draw['n']} --fuzz-seed {draw['seed']})"
                if draw and pat.startswith("fuzz") else "")
        return f"--case: expected a case id (or glob) of suite(s) {', '.join(suites)}, got {pat!r}{note}; ids look like: {sample}"
    return match_cases(cases, patterns, miss)


def match_cases(cases: list, patterns: list, miss) -> list:
    """The cases that any of ``patterns`` names (an exact id or a glob), in the order of ``cases``;
    all of them without patterns.  A pattern that names none raises UsageError(miss(pattern))."""
    if not patterns:
        return cases
    chosen = []
    for pat in patterns:
        hit = [c for c in cases if c.id == pat or fnmatch.fnmatchcase(c.id, pat)]
        if not hit:
            raise UsageError(miss(pat))
        chosen.extend(c for c in hit if c not in chosen)
    return [c for c in cases if c in chosen]


def setup_interpreter(backends: list[str], device: str) -> str | None:
    """Turn on Triton's CPU interpreter for a run of the ``triton`` backend on a machine without
    CUDA: TRITON_INTERPRET=1, set before our kernels are first built (the interpreter replaces
    them at import).  Returns the line to print, or None when nothing was changed (CUDA present,
    a non-CPU device, TRITON_INTERPRET already set by the user, or no triton backend)."""

    if "triton" not in backends or torch.cuda.is_available() or not str(device).startswith("cpu"):
        return None
    if "TRITON_INTERPRET" in os.environ:
        return None
    if "kda_kernels.triton.kernels" in sys.modules:     # built compiled already: the backend will say why not
        return None
    os.environ["TRITON_INTERPRET"] = "1"
    # NumPy's overflow / invalid-value warnings from the interpreter's own arithmetic on the padded
    # lanes of a tile are not a verdict: the outputs are judged against the oracle (NaN, Inf included)
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")
    return ("no CUDA device: the triton backend runs in Triton's CPU interpreter (TRITON_INTERPRET=1; "
            "slow, small problems only)")
