"""TruthCache never computes a new truth while `keep` old ones are held, and the out-of-memory
retry of the oracle drops the other cases' cached problems and truths first."""
import verification.running.run_cell as run_cell
from verification.running.cases import get_suite


def test_room_is_made_before_a_new_truth_is_computed(monkeypatch):
    cases = list(get_suite("smoke"))[:3]
    tc = run_cell.TruthCache(device="cpu", keep=2)
    held = []
    import sys
    kt = sys.modules["kda_ref.truth"]
    real = kt.truth

    def spy(p, *a, **k):
        held.append(len(tc._truths))
        return real(p, *a, **k)
    monkeypatch.setattr(kt, "truth", spy)
    for c in cases:
        tc.get(c)
    assert held == [0, 1, 1] and list(tc._truths) == [c.id for c in cases[1:]]
    tc.get(cases[1])                                   # a cached one: nothing dropped, nothing computed
    assert held == [0, 1, 1] and len(tc._truths) == 2
    tc.forget_others(cases[2].id)
    assert list(tc._truths) == [cases[2].id] and list(tc._problems) == [cases[2].id]


def test_the_oracle_retry_drops_the_other_cases_first():
    calls = []

    def fn():
        calls.append("fn")
        if len(calls) == 1:
            raise RuntimeError("CUDA out of memory. Tried to allocate 12.00 GiB")
        return 7
    assert run_cell.harness_call(fn, "cpu", before_retry=lambda: calls.append("drop")) == 7
    assert calls == ["fn", "drop", "fn"]
