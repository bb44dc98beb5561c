"""tools/fixed_in.py: the shrink repros of a backend's findings, and their reruns turned into the
register's fixed-in / still-fails-in fields."""
import importlib.util
import json
from pathlib import Path

from verification.running.cases import get_case
from verification.judging.record import Record
from verification.judging.tolerances import load_tolerances, parse_tolerances

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("fixed_in", ROOT / "tools" / "fixed_in.py")
fixed_in = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fixed_in)

NEUMANN, FWDSUB = "flash_kda 0.0.1+1ce47ea.neumann", "flash_kda 0.0.1+1ce47ea.fwdsub7afb9f4"


def test_every_moonshot_finding_has_a_repro_the_job_can_run(capsys):
    assert fixed_in.main(["cases", "--backend", "moonshot"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    mine = [kf for kf in load_tolerances().known_failures if kf.backend == "moonshot"]
    assert len(lines) == len(mine) >= 3
    for ln in lines:
        args = ln.split("\t")[1].split()
        case = args[args.index("--case") + 1]
        assert args[args.index("--suite") + 1] == case.split("/")[0] and args[args.index("--route") + 1]
        get_case(case, n=int(args[args.index("--fuzz-n") + 1]) if "--fuzz-n" in args else None)


def _results(d: Path, version: str, status: str, case="smoke/correlated-weak-lb-0.01"):
    """A results directory of one moonshot cell; a known-fail names the entry that excused it, as
    the runner records it (the first entry of the register that matches)."""
    d.mkdir(parents=True)
    c = get_case(case)
    extra = {}
    if status == "known-fail":
        kf = next(k for k in load_tolerances().known_failures if k.matches("moonshot", "cutlass:state=fp32", case,
                                                                           dict(c.params)))
        extra["known_failure"] = {"line": kf.line}
    rec = Record(key=f"moonshot|cutlass:state=fp32|{case}", backend="moonshot", backend_version=f"{version} (recipe x)",
                 route="cutlass:state=fp32", case=case, params=dict(c.params), status=status, extra=extra)
    with open(d / "results.jsonl", "a") as f:
        f.write(json.dumps(rec.to_dict(version=True)) + "\n")
    return d


def test_a_known_failure_counts_only_for_the_entry_that_excused_it(tmp_path):
    """The collinear-keys case (rho 1, beta_raw 8, g_shift -12) also meets the gate-shift entry's
    parameters; its known-fail, excused by the collinear entry, is no evidence that the gate-shift
    failure persists (on the H200 the fixed build failed the one and passed the other)."""
    db = load_tolerances()
    a = _results(tmp_path / "a", FWDSUB, "known-fail", case="stress/collinear-keys-T16384-gate-12-beta8-lb-5")
    res = fixed_in.verdicts([a], db)
    collinear = next(k for k in db.known_failures if k.backend == "moonshot" and "collinear" in k.case)
    shift = next(k for k in db.known_failures if k.backend == "moonshot" and "g_shift" in k.describe_params())
    assert res[collinear.line] == {"fixed": [], "fails": [FWDSUB]}
    assert shift.line not in res


def test_reruns_become_fixed_in_and_still_fails_in(tmp_path):
    db = load_tolerances()
    a = _results(tmp_path / "a", NEUMANN, "known-fail")
    b = _results(tmp_path / "b", FWDSUB, "pass")
    res = fixed_in.verdicts([a, b], db)
    kf = next(k for k in db.known_failures if k.backend == "moonshot" and k.params
              and "lb" in k.describe_params())
    assert res[kf.line] == {"fixed": [FWDSUB], "fails": [NEUMANN]}
    text = fixed_in.write_fields(fixed_in.TOL.read_text(), kf.line, {"fixed-in": FWDSUB, "still-fails-in": NEUMANN})
    again = parse_tolerances(text)
    kf2 = next(k for k in again.known_failures if k.line == kf.line)
    assert (kf2.fixed_in, kf2.still_fails_in, kf2.reason) == (FWDSUB, NEUMANN, kf.reason)
    assert len(again.known_failures) == len(db.known_failures)
    # rewriting replaces, never duplicates
    text2 = fixed_in.write_fields(text, kf.line, {"fixed-in": "x", "still-fails-in": ""})
    kf3 = next(k for k in parse_tolerances(text2).known_failures if k.line == kf.line)
    assert (kf3.fixed_in, kf3.still_fails_in) == ("x", "")


def test_a_directory_without_results_is_one_line_exit_2(tmp_path, capsys):
    assert fixed_in.main(["verdict", str(tmp_path)]) == 2
    assert "results.jsonl" in capsys.readouterr().err


def test_an_emulator_prediction_is_rerun_with_both_recipes_and_named_in_their_terms():
    """The first emulator moonshot entry (correlated keys, weak gate): its repro fails with the
    Neumann recipe and passes with 7afb9f45's inverse, so the prediction reads fixed in the fwdsub
    recipe, still failing in the Neumann one."""
    db = load_tolerances()
    kf = next(k for k in db.known_failures if k.backend == "emulator" and k.route == "moonshot"
              and "lb" in k.describe_params())
    recs = fixed_in.recipe_cells(kf, ["moonshot", "moonshot-fwdsub"])
    assert recs["moonshot"]["status"] == "known-fail" and recs["moonshot-fwdsub"]["status"] == "pass"
    assert fixed_in.recipe_verdicts(recs) == {"fixed": ["recipe moonshot-fwdsub (7afb9f45's inverse)"],
                                              "fails": ["recipe moonshot (1ce47ea's fp16 Neumann inverse)"]}


def test_recipes_for_a_route_without_emulator_entries_is_one_line_exit_2(capsys):
    assert fixed_in.main(["recipes", "--route", "no-such-recipe"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--route: expected the route of an emulator known failure" in err
