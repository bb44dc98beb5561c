"""Mutation testing (verification/mutate.py): a mutant is applied to a copy, never to the
shipped kernels; a mutant whose anchor is gone fails loudly; a real slip is killed and the
per-pass debugger names its pass; a survivor makes `kda-verify mutate` exit 1 unless the
catalogue marks it equivalent.

Each mutant runs in a child process through Triton's interpreter (~4 s per mutant here on
one smoke case).  The whole catalogue over smoke + stress:  kda-verify mutate --json-out OUT.
"""
import hashlib
import json

import pytest

from verification.cli import main as cli_main
from verification.mutants import CATALOGUE, UNSEG, Mutant, by_name
from verification.mutate import (AnchorError, check_anchors, kernel_dir, materialize, needs_attention,
                                 patched_source, run_in_child)

def _digest(d):
    h = hashlib.sha256()
    for p in sorted(d.rglob("*.py")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def test_every_catalogue_anchor_applies_and_changes_its_file():
    assert len(CATALOGUE) >= 20
    assert len({m.name for m in CATALOGUE}) == len(CATALOGUE)
    check_anchors(CATALOGUE)
    for m in CATALOGUE:
        assert patched_source(m) != (kernel_dir() / m.file).read_text(), m.name
        assert m.pass_name in ("K1", "A", "B", "C") and m.routes, m.name
        if m.pass_name in ("A", "B"):
            assert all(r.startswith("seg") for r in m.routes), m.name   # the pass must run on its routes


def test_missing_anchor_fails_loudly():
    rotten = Mutant(name="rotten", pass_name="K1", file="kernels.py", edits=(("no such text in the kernel", "x"),),
                    what="an anchor that is not there")
    with pytest.raises(AnchorError, match=r"mutant rotten: anchor: expected 'no such text in the kernel' exactly "
                                          r"once in kda_kernels/triton/kernels.py, got 0"):
        patched_source(rotten)
    with pytest.raises(AnchorError, match="got 0"):
        run_in_child(rotten, ["smoke"], False, "cpu")
    twice = Mutant(name="twice", pass_name="C", file="kernels.py", edits=(("tl.load(", "tl.load("),), what="ambiguous")
    with pytest.raises(AnchorError, match=r"got \d+ occurrence"):
        patched_source(twice)


def test_cli_unknown_mutant_is_a_one_line_usage_error(capsys):
    assert cli_main(["mutate", "--mutant", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kda-verify mutate: error: --mutant: expected one of ") and err.endswith("got 'nope'")
    assert "\n" not in err


def test_cli_bad_jobs_is_a_one_line_usage_error(capsys):
    assert cli_main(["mutate", "--mutant", "pivot_row_off_by_one", "--jobs", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "kda-verify mutate: error: --jobs: expected a number of processes >= 1, got 0"


def test_parallel_jobs_keep_the_catalogue_order(tmp_path, capsys):
    out = tmp_path / "m.json"
    rc = cli_main(["mutate", "--mutant", "tail_beta_not_zeroed,pivot_row_off_by_one", "--suite", "smoke",
                   "--case", "smoke/dense-T64-lb-5", "--jobs", "2", "--json-out", str(out)])
    assert rc == 0, capsys.readouterr().out
    recs = json.loads(out.read_text())["records"]
    assert [r["mutant"] for r in recs] == ["tail_beta_not_zeroed", "pivot_row_off_by_one"]
    assert [r["outcome"] for r in recs] == ["equivalent", "equivalent"]


def test_copy_is_patched_and_shipped_package_untouched(tmp_path):
    before = _digest(kernel_dir())
    m = by_name(["wrong_sign_of_L"])[0]
    name = materialize(m, tmp_path)
    text = (tmp_path / name / "triton" / "kernels.py").read_text()
    assert "L = tl.where(ri > cj, beta[:, None] * kk, 0.0)" in text
    assert "L = tl.where(ri > cj, -beta[:, None] * kk, 0.0)" not in text
    assert _digest(kernel_dir()) == before
    assert "-beta[:, None] * kk" in (kernel_dir() / "kernels.py").read_text()


def test_a_real_slip_is_killed_and_localized():
    """Mqk without its diagonal: o is wrong on the first smoke case, and the debugger's first
    flagged pass is K1 (ws_mqk), the pass the mutant patched."""
    before = _digest(kernel_dir())
    rec = run_in_child(by_name(["mqk_diagonal_dropped"])[0], ["smoke"], False, "cpu",
                       case_globs=["smoke/dense-T64-lb-5"])
    assert rec["outcome"] == "killed", rec
    assert rec["case"] == "smoke/dense-T64-lb-5" and rec["route"] == UNSEG
    assert rec["metric"].startswith("o "), rec["metric"]
    assert rec["confirmed_by_original"] is True
    assert rec["debug_first_pass"] == "K1" and rec["localized"] is True, rec
    assert rec["debug_where"].startswith("ws_mqk"), rec["debug_where"]
    assert _digest(kernel_dir()) == before


def test_a_pass_B_slip_is_localized_to_B():
    """The scan dropping its carry (h <- b_seg): killed on a segmented route of a weak-gate
    case (a strong gate forgets the carry anyway), and the debugger flags pass B first."""
    rec = run_in_child(by_name(["scan_carry_dropped"])[0], ["smoke"], False, "cpu",
                       case_globs=["smoke/weak-gate-lb-0.1-vk"])
    assert rec["killed"] and rec["debug_first_pass"] == "B" and rec["localized"], rec


def test_survivors_decide_the_exit_status(tmp_path, capsys):
    """A patch that changes nothing numerically survives: exit 1 when unmarked, 0 when the
    catalogue marks it equivalent (here the pivot moved by one row, one case)."""
    noop = Mutant(name="comment_only", pass_name="K1", file="kernels.py",
                  edits=(("G = tl.cumsum(a, 0) * 1.4426950408889634", "G = tl.cumsum(a, 0) * 1.4426950408889634  # x"),),
                  what="a comment")
    rec = run_in_child(noop, ["smoke"], False, "cpu", case_globs=["smoke/dense-T64-lb-5"])
    assert rec["outcome"] == "survived" and rec["cells"] == 1 and needs_attention(rec), rec
    out = tmp_path / "m.json"
    rc = cli_main(["mutate", "--mutant", "pivot_row_off_by_one", "--suite", "smoke", "--case", "smoke/dense-T64-lb-5",
                   "--json-out", str(out)])
    assert rc == 0, capsys.readouterr().out
    recs = json.loads(out.read_text())["records"]
    assert [r["outcome"] for r in recs] == ["equivalent"]
    assert "pivot_row_off_by_one" in capsys.readouterr().out


def test_a_mutant_that_breaks_the_kernel_counts_as_crashed():
    broken = Mutant(name="undefined_name", pass_name="K1", file="kernels.py",
                    edits=(("G = tl.cumsum(a, 0) * 1.4426950408889634", "G = tl.cumsum(a, 0) * no_such_name"),),
                    what="a kernel that does not compile")
    rec = run_in_child(broken, ["smoke"], False, "cpu", case_globs=["smoke/dense-T64-lb-5"])
    assert rec["outcome"] == "crashed" and rec["killed"] and rec["metric"] == "crash", rec
    assert "raised" in rec["reason"], rec["reason"]
    assert not needs_attention(rec)


@pytest.mark.parametrize("name,case,pass_name,tensor", [
    ("paged_final_written_to_sequence_row", "smoke/paged-lb-5", "C", "final_state"),
    ("inverse_stored_bf16", "smoke/correlated-weak-lb-0.01", "K1", "ws_inv"),
])
def test_slips_below_the_row_thresholds_are_localized(name, case, pass_name, tensor):
    """Two slips the verdict killed and the debugger did not name: the paged final-state store
    (the debugger's pass C wrote dense states only; it now stores through the paged path into a
    copy of the cache) and the inverse rounded to bf16 (every row within its 3e-2 threshold; with
    taps, as mutate runs, K1's ws_inv is now held to the verdict's own ws_inv rule as well)."""
    rec = run_in_child(by_name([name])[0], ["smoke"], False, "cpu", case_globs=[case])
    assert rec["killed"] and rec["debug_first_pass"] == pass_name and rec["localized"], rec
    assert rec["debug_where"].startswith(tensor), rec["debug_where"]
