"""Mutation testing (verification/investigating/mutate.py): a mutant is applied to a copy, never to the
shipped kernels; a mutant whose anchor is gone fails loudly; a real slip is killed and the
per-pass debugger names its pass; a survivor makes `kda-verify mutate` exit 1 unless the
catalogue marks it equivalent.

Each mutant runs in a child process through Triton's interpreter (~4 s per mutant here on
one smoke case).  The whole catalogue over smoke + stress:  kda-verify mutate --json-out OUT.
"""
import ast
import hashlib
import json

import pytest

from verification.cli import main as cli_main
from verification.investigating.mutants import CATALOGUE, UNSEG, Mutant, by_name
from verification.investigating.mutate import (ANCHOR_RE, AnchorError, anchor_sites, check_anchors, kernel_dir, materialize,
                                 mutant_file, mutant_files, needs_attention, patched_source, patched_sources,
                                 run_in_child)

def _digest(d):
    h = hashlib.sha256()
    for p in sorted(d.rglob("*.py")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def test_every_catalogue_anchor_is_found_once_and_changes_its_statement():
    texts = {p.name: p.read_text() for p in kernel_dir().glob("*.py")}
    assert len(CATALOGUE) >= 20
    assert len({m.name for m in CATALOGUE}) == len(CATALOGUE)
    check_anchors(CATALOGUE)
    for m in CATALOGUE:
        for anchor, _find, _replace in m.edits:
            assert len(anchor_sites(anchor, texts)) == 1, (m.name, anchor)
        for f, text in patched_sources(m).items():
            assert ast.dump(ast.parse(text)) != ast.dump(ast.parse(texts[f])), m.name
        assert m.pass_name in ("K1", "A", "B", "C") and m.routes, m.name
        if m.pass_name in ("A", "B"):
            assert all(r.startswith("seg") for r in m.routes), m.name   # the pass must run on its routes


def test_every_anchor_in_the_package_is_used():
    texts = {p.name: p.read_text() for p in kernel_dir().glob("*.py")}
    marked = {m.group(1) for t in texts.values() for ln in t.splitlines() if (m := ANCHOR_RE.search(ln))}
    used = {e[0] for m in CATALOGUE for e in m.edits} | {"walk-store-o"}   # walk-store-o: tests/test_invariance_gpu.py
    assert marked == used


def test_anchors_survive_reformatting(tmp_path):
    """A mutant follows the syntax tree, not the text: the package with its anchored statements
    re-spaced, re-wrapped and moved to another file still takes every mutant, to the same trees."""
    import shutil
    moved = tmp_path / "triton"
    shutil.copytree(kernel_dir(), moved, ignore=shutil.ignore_patterns("__pycache__"))
    walk = (moved / "walk.py").read_text()
    a = walk.index("    u = beta[:, None]")
    line = walk[a:walk.index("\n", a)]
    walk = walk.replace(line, "    u = beta[:,None]*(  # mutant-anchor: walk-u\n            v-tl.dot(kd,Sb)  )")
    (moved / "walk.py").write_text(walk)
    m = by_name(["beta_missing_in_u"])[0]
    assert ast.dump(ast.parse(patched_source(m, moved))) == ast.dump(ast.parse(patched_source(m)))
    k1 = (moved / "k1.py").read_text()
    line = next(ln for ln in k1.splitlines() if "mutant-anchor: k1-L" in ln)
    (moved / "k1.py").write_text(k1.replace(line + "\n", ""))
    (moved / "extra.py").write_text("def f(ri, cj, beta, kk):\n    # mutant-anchor: k1-L\n"
                                    "    L = tl.where((ri > cj), (-beta[:, None]) * kk, 0.0)\n    return L\n")
    m = by_name(["wrong_sign_of_L"])[0]
    assert mutant_files(m, moved) == ["extra.py"]
    assert "L = tl.where(ri > cj, beta[:, None] * kk, 0.0)" in patched_source(m, moved)
    check_anchors([x for x in CATALOGUE if all(e[0] != "k1-L" for e in x.edits)] + [m])


def test_missing_anchor_fails_loudly():
    rotten = Mutant(name="rotten", pass_name="K1", edits=(("no-such-anchor", "x", "y"),),
                    what="an anchor that is not there")
    with pytest.raises(AnchorError, match=r"mutant rotten: anchor: expected '# mutant-anchor: no-such-anchor' exactly "
                                          r"once in kda_kernels/triton/, got 0"):
        patched_source(rotten)
    with pytest.raises(AnchorError, match="got 0"):
        run_in_child(rotten, ["smoke"], False, "cpu")
    twice = Mutant(name="twice", pass_name="K1", edits=(("halves-X10", "INV_PREC", "INV_PREC"),), what="ambiguous")
    with pytest.raises(AnchorError, match=r"expected 'INV_PREC' exactly once in the statement .* got 2 occurrence"):
        patched_source(twice)
    noop = Mutant(name="noop", pass_name="K1", edits=(("k1-L", "(ri > cj)", "ri > cj"),), what="no change")
    with pytest.raises(AnchorError, match="changes nothing"):
        patched_source(noop)


def test_cli_unknown_mutant_is_a_one_line_usage_error(capsys):
    assert cli_main(["mutate", "--mutant", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kda-verify mutate: error: --mutant: expected one of ") and err.endswith("got 'nope'")
    assert "\n" not in err


def test_cli_bad_jobs_is_a_one_line_usage_error(capsys):
    assert cli_main(["mutate", "--mutant", "pivot_row_off_by_one", "--jobs", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "kda-verify mutate: error: --jobs: expected a number of processes >= 1, got 0"


@pytest.mark.slow
def test_parallel_jobs_keep_the_catalogue_order(tmp_path, capsys):
    out = tmp_path / "m.json"
    rc = cli_main(["mutate", "--mutant", "tail_beta_not_zeroed,pivot_row_off_by_one", "--suite", "smoke",
                   "--case", "smoke/dense-T64-lb-5", "--jobs", "2", "--json-out", str(out)])
    assert rc == 0, capsys.readouterr().out
    recs = json.loads(out.read_text())["records"]
    assert [r["mutant"] for r in recs] == ["tail_beta_not_zeroed", "pivot_row_off_by_one"]
    assert [r["outcome"] for r in recs] == ["equivalent", "equivalent"]


def _imported_modules(path) -> set:
    """Every module ``path`` imports, at module level or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_the_catalogue_does_not_import_the_runner_of_mutants():
    """mutate.py imports the catalogue (mutants.py); the catalogue imports nothing of mutate.py's,
    not even inside a function, so the two are no import circle."""
    from pathlib import Path

    import verification
    pkg = Path(verification.__file__).parent / "investigating"
    assert "verification.investigating.mutate" not in _imported_modules(pkg / "mutants.py")
    assert "verification.investigating.mutants" in _imported_modules(pkg / "mutate.py")
    top = {n.module for n in ast.parse((pkg / "mutate.py").read_text()).body if isinstance(n, ast.ImportFrom)}
    assert "verification.investigating.mutants" in top                    # at module level


def test_copy_is_patched_and_shipped_package_untouched(tmp_path):
    before = _digest(kernel_dir())
    m = by_name(["wrong_sign_of_L"])[0]
    name = materialize(m, tmp_path)
    copy = tmp_path / name / "triton"
    assert mutant_file(m) == "k1.py"
    assert ast.dump(ast.parse((copy / mutant_file(m)).read_text())) == ast.dump(ast.parse(patched_source(m)))
    for p in kernel_dir().glob("*.py"):                      # every other file copied as it is
        if p.name != mutant_file(m):
            assert (copy / p.name).read_text() == p.read_text(), p.name
    assert _digest(kernel_dir()) == before


@pytest.mark.slow
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
    noop = Mutant(name="commuted", pass_name="K1",
                  edits=(("k1-cumsum", "tl.cumsum(a, 0) * 1.4426950408889634", "1.4426950408889634 * tl.cumsum(a, 0)"),),
                  what="a product commuted (bitwise the same)")
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
    broken = Mutant(name="undefined_name", pass_name="K1",
                    edits=(("k1-cumsum", "1.4426950408889634", "no_such_name"),),
                    what="a kernel that does not compile")
    rec = run_in_child(broken, ["smoke"], False, "cpu", case_globs=["smoke/dense-T64-lb-5"])
    assert rec["outcome"] == "crashed" and rec["killed"] and rec["metric"] == "crash", rec
    assert "raised" in rec["reason"], rec["reason"]
    assert not needs_attention(rec)


@pytest.mark.parametrize("name,case,pass_name,tensor", [
    ("paged_final_written_to_sequence_row", "smoke/paged-lb-5", "C", "final_state"),
    ("inverse_stored_bf16", "smoke/correlated-weak-lb-0.01", "K1", "ws_inv"),
])
@pytest.mark.slow
def test_slips_below_the_row_thresholds_are_localized(name, case, pass_name, tensor):
    """Two slips the verdict killed and the debugger did not name: the paged final-state store
    (the debugger's pass C wrote dense states only; it now stores through the paged path into a
    copy of the cache) and the inverse rounded to bf16 (every row within its 3e-2 threshold; with
    taps, as mutate runs, K1's ws_inv is now held to the verdict's own ws_inv rule as well)."""
    rec = run_in_child(by_name([name])[0], ["smoke"], False, "cpu", case_globs=[case])
    assert rec["killed"] and rec["debug_first_pass"] == pass_name and rec["localized"], rec
    assert rec["debug_where"].startswith(tensor), rec["debug_where"]
