"""Planted batch bugs: exact outputs of a bugged forward, judged as a kernel's would be.

Each plant computes the float64 truth of the forward with one batch-level bug (the bugs a
pooled error hides), rounds it as a kernel stores it (o in v's dtype, states fp32), and hands
it to the same judge as ``check`` and ``run`` with the flashkda recipe's baseline.  A plant is
*caught* when the verdict fails; the verdict names the slice.

    leak       sequence n starts from sequence n-1's final state where it has no state of its own
    gate^1.05  one head's decay exp(a) raised to 1.05 on one sequence (a -> 1.05 a)
    gate^1.2   the same with 1.2
    slot swap  the final states of the first two written cache slots exchanged

``python tests/planted.py [--device DEVICE] [CASE ...]`` prints the table row by row (default:
the cases below).  Test code, not shipped: tests/test_slices.py, tests/test_recipe_range.py and
tests/kda_test_backends.py import it, tools/device/verify_job.sh prints the table; the wheel has
no copy (tests/test_wheel.py).  Run as a script it puts its checkout first on sys.path.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__" and str(ROOT) not in sys.path[:1]:   # as a script: this checkout's packages
    sys.path.insert(0, str(ROOT))

from kda_kernels.base import Outputs, Route  # noqa: E402
from kda_kernels.controls import changes_anything, own_initial_state, per_sequence, start_state  # noqa: E402
from kda_ref.preprocess import gate_activation  # noqa: E402
from kda_ref.truth import truth  # noqa: E402

CASES = ("k3-prefill/p02-N7-T1939", "k3-prefill/p09-N8-T7838", "k3-prefill/p16-N6-T282",
         "smoke/paged-lb-5", "smoke/varlen-tail33-lb-5", "default/B2-T2664-H12")
PLANTS = ("leak", "gate^1.05", "gate^1.2", "slot swap")
CONTROL_OF = {"leak": "state_leak", "gate^1.05": "head_gate_scaled", "gate^1.2": "head_gate_scaled",
              "slot swap": "slots_swapped"}


def _exact(n, sub) -> Outputs:
    tr = truth(sub)
    return Outputs(o=tr.o, final_state=tr.final_state)


def gate_plant_target(problem, power: float) -> tuple[int, int]:
    """(sequence, head) of a gate plant: sequence 3 head 0 for ^1.2 (where N > 3), else the
    middle sequence's last head."""
    if power == 1.2 and problem.N > 3:
        return 3, 0
    return problem.N // 2, problem.HV - 1


def plant(problem, name: str) -> Optional[Outputs]:
    """Outputs of ``problem`` with plant ``name``, exact then rounded; None where the plant
    changes nothing."""
    if not changes_anything(CONTROL_OF[name], problem)[0]:
        return None
    if name == "leak":
        own = own_initial_state(problem)
        return per_sequence(problem, _exact, lambda n, prev: start_state(problem, n) if own[n] or prev is None else prev)
    if name.startswith("gate^"):
        power = float(name[5:])
        target, head = gate_plant_target(problem, power)
        if problem.seq_bounds()[target][1] == problem.seq_bounds()[target][0]:
            return None

        def run_one(n, sub):
            if n != target:
                return _exact(n, sub)
            a = gate_activation(sub.g.reshape(-1, sub.HV, sub.K), sub.gate, sub.A_log, sub.dt_bias, sub.lower_bound)
            a[:, head] *= power
            return _exact(n, sub.replace(g=a.reshape(sub.g.shape), gate="pregated", A_log=None, dt_bias=None,
                                         lower_bound=None))
        return per_sequence(problem, run_one, lambda n, prev: start_state(problem, n))
    if name == "slot swap":
        tr = truth(problem)
        a, b = (int(s) for s in problem.state_indices[:2].tolist())
        cache = tr.state_cache.clone()
        cache[a], cache[b] = tr.state_cache[b], tr.state_cache[a]
        return Outputs(o=tr.o.to(problem.v.dtype), state_cache=cache.to(problem.state_cache.dtype))
    raise ValueError(f"plant: expected one of {', '.join(PLANTS)}, got {name!r}")


def judge_plant(problem, outputs: Outputs, tr=None, baselines: Optional[dict] = None):
    """The verdict of planted ``outputs`` as ``check --recipe flashkda`` gives it."""
    from kda_kernels.emulator import RECIPES
    from verification.judging.tolerances import load_tolerances
    from verification.judging.baselines import baseline_metrics
    from verification.judging.verdict import judge
    tr = tr if tr is not None else truth(problem)
    baselines = {} if baselines is None else baselines

    def recipe_baselines():
        for r in RECIPES:
            if r not in baselines:
                baselines[r] = baseline_metrics(problem, r, tr)
        return baselines

    base = baselines.get("flashkda") or recipe_baselines()["flashkda"]
    return judge("external", Route(name="flashkda", recipe="flashkda"), problem, outputs, tr, base,
                 load_tolerances(), recipe_baselines=recipe_baselines)


def pooled_margin(verdict) -> float:
    """The worst whole-tensor margin of a verdict (what it was before slices were judged)."""
    return max((t.get("tensor_margin", t.get("margin", 0.0)) for t in verdict.tensors.values()), default=0.0)


def rows(case_ids=CASES, device: str = "cpu"):
    """The table's rows, one at a time (header first)."""
    from verification.running.cases import get_case
    yield "| case | plant | caught | pooled margin | slice margin | the slice the verdict names |"
    yield "|---|---|---|---|---|---|"
    for cid in case_ids:
        problem = get_case(cid).build(device=device)
        tr = truth(problem)
        baselines: dict = {}
        for name in PLANTS:
            out = plant(problem, name)
            if out is None:
                yield f"| {cid} | {name} | n/a (changes nothing) | | | |"
                continue
            v = judge_plant(problem, out, tr, baselines)
            worst = max(v.tensors.items(), key=lambda kv: kv[1].get("margin", 0.0))
            sl = worst[1].get("slice") or {}
            where = (f"{worst[0]} {sl.get('where', '')}: {sl.get('err', float('nan')):.3g} vs baseline "
                     f"{sl.get('baseline_err', float('nan')):.3g}") if sl else worst[0]
            yield (f"| {cid} | {name} | {'yes' if v.status == 'fail' else 'NO (' + v.status + ')'} | "
                   f"{pooled_margin(v):.3g} | {sl.get('margin', float('nan')):.3g} | {where} |")


def table(case_ids=CASES, device: str = "cpu") -> str:
    return "\n".join(rows(case_ids, device))


if __name__ == "__main__":
    args = sys.argv[1:]
    device = "cpu"
    if args[:1] == ["--device"]:
        device, args = args[1], args[2:]
    for row in rows(tuple(args) or CASES, device):
        print(row, flush=True)
