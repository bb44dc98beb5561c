"""Derived case parameters for known-failure conditions (verification.judging.tolerances.match_params):
a fuzz case's empty sequences and initial states live in lists and strings (``lens``, ``state``,
``paged_new``) that no ``params`` condition can name, so the matcher sees numbers derived from them."""
import pytest

from verification.judging.record import Record
from verification.running.run_cell import apply_known_failure
from verification.errors import ToleranceError
from verification.judging.tolerances import DERIVED_PARAMS, match_params, parse_tolerances

HEAD = """schema: 1
entries:
  - {backend: "*", route: "*", dtype: "*", tensor: "*", m: 2, floor: 0, cap: 0.05, reason: r, calibrated_on: c}
known_failures:
"""


def _derived(**params):
    got = match_params(params)
    return {k: got[k] for k in DERIVED_PARAMS if k in got}


@pytest.mark.parametrize("lens, before_last, empty", [
    ([40, 70], 0, 0),
    ([0, 40, 70], 1, 1),        # empty first: aiter's mis-mapped chunks
    ([40, 0, 70], 1, 1),        # empty in the middle
    ([40, 70, 0], 0, 1),        # empty last: nothing after it to mis-map
    ([0, 5, 0, 129], 2, 2),
    ([0, 77, 126, 0], 1, 2),    # one before the last non-empty sequence, one after it
    ([0, 0, 3], 2, 2),
])
def test_empty_sequences_before_the_last_non_empty_one(lens, before_last, empty):
    d = _derived(lens=lens)
    assert d["empty_seqs_before_last"] == before_last and d["empty_seqs"] == empty


@pytest.mark.parametrize("params, starts", [
    (dict(lens=[3, 0, 5], state="none"), 0),
    (dict(lens=[3, 0, 5]), 0),                                      # no state: none
    (dict(lens=[3, 0, 5], state="kv"), 2),                          # the empty one starts nothing
    (dict(lens=[3, 4], state="vk"), 2),
    (dict(lens=[4, 34, 50, 128], state="paged", paged_new=[1, 3]), 2),
    (dict(lens=[4, 0, 50], state="paged", paged_new=[1]), 2),
    (dict(lens=[4, 34, 50], state="paged", paged_new=[0, 2]), 1),
    (dict(B=1, T=96, converged=True, state_scale=0.1), 1),          # converged: a kv state
    (dict(B=3, T=64, state="kv"), 3),
])
def test_initial_states_count_the_sequences_that_start_from_a_state(params, starts):
    assert _derived(**params)["initial_states"] == starts


def test_a_case_without_lens_has_B_sequences_of_T_tokens():
    assert _derived(B=2, T=64) == {"empty_seqs_before_last": 0, "empty_seqs": 0, "initial_states": 0}
    assert _derived() == {"empty_seqs_before_last": 0, "empty_seqs": 0, "initial_states": 0}
    assert _derived(B=2, T=0)["empty_seqs"] == 2


def test_derived_values_replace_stale_ones_and_the_case_params_stay_untouched():
    params = {"lens": [0, 4], "empty_seqs_before_last": 7, "lb": -5.5}
    got = match_params(params)
    assert got["empty_seqs_before_last"] == 1 and got["lb"] == -5.5
    assert params["empty_seqs_before_last"] == 7            # the caller's dict is not changed
    assert match_params(got) == got                           # idempotent


def test_unreadable_lengths_leave_the_derived_parameters_out():
    assert _derived(lens="0,4") == {} and _derived(lens=[1.5, 2]) == {} and _derived(lens=[-1, 2]) == {}
    assert match_params(None) is None


def test_every_fuzz_case_gets_the_derived_parameters():
    from verification.running.cases import get_suite
    cases = get_suite("fuzz", n=300, seed=0)
    for c in cases:
        d = _derived(**c.params)
        assert set(d) == set(DERIVED_PARAMS), c.id
    assert any(_derived(**c.params)["empty_seqs_before_last"] for c in cases)


def _db(params: str):
    return parse_tolerances(HEAD + "  - {backend: aiter, route: \"triton:*\", case: \"fuzz/*\", params: "
                            + params + ", reason: r, evidence: e}\n")


def _rec(params, status="fail"):
    return Record(backend="aiter", route="triton:unseg", case="fuzz/fuzz0-022", params=params,
                  status=status, reason="o: 66.7% NaN")


def test_a_known_failure_matches_an_empty_sequence_before_the_last():
    db = _db('{empty_seqs_before_last: ">=1"}')
    assert apply_known_failure(_rec({"lens": [0, 96], "H": 2}), db)["status"] == "known-fail"
    assert apply_known_failure(_rec({"lens": [40, 0, 70]}), db)["status"] == "known-fail"
    assert apply_known_failure(_rec({"lens": [40, 70, 0]}), db)["status"] == "fail"    # empty last
    assert apply_known_failure(_rec({"lens": [40, 70]}), db)["status"] == "fail"


def test_derived_and_drawn_parameters_combine():
    db = _db('{initial_states: ">=1", state_scale: ">=10"}')
    hit = {"lens": [4, 34], "state": "paged", "paged_new": [1], "state_scale": 10.0}
    assert apply_known_failure(_rec(hit), db)["status"] == "known-fail"
    assert apply_known_failure(_rec({**hit, "paged_new": [0, 1]}), db)["status"] == "fail"
    assert apply_known_failure(_rec({**hit, "state": "none"}), db)["status"] == "fail"
    assert apply_known_failure(_rec({**hit, "state_scale": 1.0}), db)["status"] == "fail"


def test_the_real_fuzz_case_is_matched_from_its_id_and_draw():
    from verification.running.cases import get_case
    case = get_case("fuzz/fuzz0-022", n=300)          # lens [0, 96]: aiter returns NaN on H200
    assert case.params["lens"][0] == 0
    rec = _rec(dict(case.params))
    rec.case = case.id
    assert apply_known_failure(rec, _db('{empty_seqs_before_last: ">=1"}'))["status"] == "known-fail"


def test_an_unknown_parameter_name_lists_the_derived_ones():
    with pytest.raises(ToleranceError, match="derived ones .*empty_seqs_before_last.*got 'empty_before'"):
        _db('{empty_before: ">=1"}')
