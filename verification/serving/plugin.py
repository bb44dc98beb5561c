"""``pytest -m verify --kda-suite serving``: the serving cells as matrix items
(verification/pytest_plugin.py hands the suite here).

    --kda-backend A          the prefill side (one backend; default: the emulator)
    --kda-route R            prefill trace routes (default: every one of A running prefill calls)
    --kda-decode-backend B   the decode side (default A)
    --kda-decode-route R2    decode trace routes (default: every one of B running decode or spec calls)
    --kda-case ID            serving case ids or globs

Each item is one (case, prefill route, decode route) cell, judged and recorded as ``kda-verify
run --suite serving`` does (verification.serving.cells.run_serving_cell)."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from verification.errors import UsageError
from verification.running.run_select import load
from verification.serving.cells import TraceCache, case_pairs, cell_names, pairings, run_serving_cell
from verification.serving.command import check_serving_args, select_serving_cases

_TRACES = None      # the TraceCache of this process (cells run case-major within a case's xdist group)


@dataclass(frozen=True)
class ServingRoute:
    """The route of a serving matrix item: a (prefill route, decode route) pair and the sides'
    backends; ``run`` makes the cell's record."""
    prefill_lb: object
    decode_lb: object
    rp: object
    rd: object
    serving: bool = True

    @property
    def name(self) -> str:
        return f"{self.rp.name}+{self.rd.name}"

    def run(self, case, db, device: str) -> dict:
        global _TRACES
        if _TRACES is None:
            _TRACES = TraceCache()
        return run_serving_cell(self.prefill_lb, self.decode_lb, self.rp, self.rd, case, db, _TRACES, device=device)


def serving_cells(suites: list, backends: list, routes: list, decode_backends: list, decode_routes: list,
                  patterns: list, long: bool) -> list:
    """[(prefill LoadedBackend, ServingRoute, case)] of the options (module docstring); bad
    options raise UsageError (the plugin's options item reports it)."""

    args = SimpleNamespace(backend=backends or ["emulator"], decode_backend=decode_backends or None,
                           decode_route=decode_routes or None, isolate=False, fuzz_n=None, fuzz_seed=None)
    try:
        check_serving_args(args, suites)
    except UsageError as e:
        raise UsageError(str(e).replace("--", "--kda-", 1)) from None
    spec_a = args.backend[0]
    spec_b = (decode_backends or [spec_a])[0]
    la = load(spec_a)
    lb = la if spec_b == spec_a else load(spec_b)
    pairs = pairings(la, lb, routes or None, decode_routes or None,
                     decode_option="--decode-backend" if lb is not la else "--backend")
    cases = select_serving_cases(patterns, long)
    out = []
    for c in cases:
        for rp, rd in case_pairs(c, pairs, bool(routes)):
            r = ServingRoute(la, lb, rp, rd)
            out.append((SimpleNamespace(name=cell_names(la, lb, rp, rd)[0], available=True, reason="", spec=la.spec),
                        r, c))
    return out
