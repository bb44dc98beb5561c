"""``kda-verify isa --backend aiter`` on ROCm/aiter's own Gluon KDA kernels (chunk_kda prepare /
walk / scan, kda decode) for gfx1250 and gfx950.

The variant derivation and the compile need the assembled tree (``$KDA_AITER_UPSTREAM``, default
``.vendor/aiter-upstream``, built by tools/assemble_aiter_upstream.py from files no repository of
this project holds); those tests skip, naming each file missing (repository@commit:path) or whose
sha256 differs from the record, as in CI, which cannot fetch them (docs/backends.md).  The gfx1250 prefill
needs triton >= 3.9; the rows an older Triton gets are checked without the tree.  The compiles run in
a child process without TRITON_INTERPRET (other test modules set it; the interpreter replaces
the kernels this command compiles)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verification.investigating import aiter_isa, aiter_kda_isa

ROOT = Path(__file__).resolve().parents[1]
TREE = Path(os.environ.get("KDA_AITER_UPSTREAM") or ROOT / ".vendor" / "aiter-upstream")
P = "aiter/ops/triton/"
# what compiling one gfx1250 prepare and one walk imports besides the base tree (ROCm/aiter's aiter/):
# the host, the two kernels, their helpers and the host's config reader, and the walk's BV tiers
GFX1250_COMPILE = (P + "attention/chunk_kda.py", P + "_gluon_kernels/gfx1250/attention/chunk_kda/prepare.py",
                   P + "_gluon_kernels/gfx1250/attention/chunk_kda/walk.py", P + "_gluon_kernels/common/utils.py",
                   P + "utils/config_utils.py", P + "configs/gfx1250/gluon/attention/chunk_kda/DEFAULT.json")


def _recorded() -> dict:
    """tools/assemble_aiter_upstream.py's FILES by destination: (repository, commit, path, sha256)."""
    import importlib.util
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        spec = importlib.util.spec_from_file_location("assemble_aiter_upstream",
                                                      ROOT / "tools" / "assemble_aiter_upstream.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return {dest or path: (repo, commit, path, sha) for repo, commit, path, dest, sha, _ in mod.FILES}


def tree_gaps(tree: Path, dests) -> list:
    """What ``tree`` lacks of the files ``dests`` at their recorded commits: one entry per file
    absent or whose sha256 differs from the record, and the base tree when aiter/__init__.py is absent."""
    import hashlib
    rec, gaps = _recorded(), []
    if not (tree / "aiter" / "__init__.py").is_file():
        gaps.append("the base tree aiter/ (ROCm/aiter e4048607a5: git archive e4048607a535ace3a2b51ded31b1c8c2d45c0879 "
                    "aiter)")
    for dest in dests:
        repo, commit, path, sha = rec[dest]
        f = tree / dest
        if not f.is_file():
            gaps.append(f"{repo}@{commit[:10]}:{path}")
        elif hashlib.sha256(f.read_bytes()).hexdigest() != sha:
            gaps.append(f"{dest} (sha256 differs from {repo}@{commit[:10]}'s, recorded {sha[:12]}...)")
    return gaps


def needs_files(dests, what: str):
    """Skip, saying exactly which files are missing and how to provide them, unless TREE holds ``dests``."""
    gaps = tree_gaps(TREE, dests)
    return pytest.mark.skipif(bool(gaps), reason=(
        f"{what} needs ROCm/aiter's files, none of which this repository may hold; {TREE} "
        f"($KDA_AITER_UPSTREAM, default .vendor/aiter-upstream) lacks {len(gaps)}: {'; '.join(gaps)}. "
        "Provide them: python tools/assemble_aiter_upstream.py --base BASE --src SRC builds the tree (SRC "
        "written from a ROCm/aiter git clone by tools/export_aiter_src.py, each file sha256-checked against "
        "tools/assemble_aiter_upstream.py's FILES), or set KDA_AITER_UPSTREAM to a tree that holds them"))


needs_tree = needs_files(tuple(d for d in _recorded() if "kimi_delta_attn" not in d),   # chunk_kda and kda decode
                         "deriving the variants from aiter's host wrappers")
needs_gfx1250 = needs_files(GFX1250_COMPILE, "compiling a gfx1250 chunk_kda prepare and walk")
# a string condition, evaluated when the test runs: importing triton while the tests are collected
# (before the interpreter tests set TRITON_INTERPRET) builds later tests' kernels compiled
needs_39 = pytest.mark.skipif("aiter_kda_isa.triton_too_old('gfx1250', 'chunk_kda') is not None",
                              reason="aiter's gfx1250 chunk_kda kernels need triton >= 3.9")



def test_triton_version_rule(monkeypatch):
    """Only the gfx1250 chunk_kda kernels have a minimum (3.9: tdm.async_load_fused, reinterpret);
    the other families compile, or fail as rows, under any Triton."""
    import triton
    for version, expect in (("3.8.0", "needs triton >= 3.9 (this is 3.8.0)"), ("3.6.0+git1234", "needs triton"),
                            ("3.9.0", None), ("3.10.1", None), ("4.0.0", None)):
        monkeypatch.setattr(triton, "__version__", version)
        got = aiter_kda_isa.triton_too_old("gfx1250", "chunk_kda")
        assert (got is None) if expect is None else got.startswith(expect), (version, got)
        assert aiter_kda_isa.triton_too_old("gfx950", "chunk_kda") is None
        assert aiter_kda_isa.triton_too_old("gfx1250", "kda_decode") is None


def test_older_triton_gets_one_row_for_the_gfx1250_prefill_not_a_crash(monkeypatch):
    """With triton 3.8 the gfx1250 chunk_kda family is one row saying it needs 3.9; the other
    families are still recorded and compiled (stand-ins here: no tree), other archs untouched."""
    import triton
    monkeypatch.setattr(triton, "__version__", "3.8.0")
    monkeypatch.setattr(aiter_isa, "flash_kda_present", lambda: False)
    monkeypatch.setattr(aiter_kda_isa, "kda_modules_present", lambda: True)
    asked = []
    monkeypatch.setattr(aiter_kda_isa, "kda_variants", lambda arch, fams: asked.append((arch, fams)) or ([], []))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rows = aiter_isa.aiter_isa_report(["gfx942", "gfx1250", "gfx950"])
    assert [(r.arch, r.kernel, r.ok, r.error) for r in rows] == [
        ("gfx1250", "chunk_kda (Gluon)", False, "needs triton >= 3.9 (this is 3.8.0)")]
    assert asked == [("gfx1250", ("kda_decode",)), ("gfx950", ("chunk_kda", "kda_decode"))]


def test_a_host_module_that_does_not_import_is_a_row(monkeypatch):
    monkeypatch.setattr(aiter_isa, "flash_kda_present", lambda: False)
    monkeypatch.setattr(aiter_kda_isa, "kda_modules_present", lambda: True)

    def broken(arch, fams):
        raise AttributeError("module 'gl.amd' has no attribute 'gfx1250'")
    monkeypatch.setattr(aiter_kda_isa, "kda_variants", broken)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rows = aiter_isa.aiter_isa_report(["gfx950"])
    assert [(r.kernel, r.ok) for r in rows] == [("(host import)", False)] and "gfx1250" in rows[0].error


def test_no_aiter_tree_is_one_usage_line(monkeypatch):
    monkeypatch.setattr(aiter_isa, "flash_kda_present", lambda: False)
    monkeypatch.setattr(aiter_kda_isa, "kda_modules_present", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(aiter_isa.AiterIsaError, match="expected aiter's aiter/ tree on PYTHONPATH"):
        aiter_isa.aiter_isa_report(["gfx1250"])


def _child(code: str, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(TREE)]), AITER_TRITON_ONLY="1")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout,
                         cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@needs_tree
@pytest.mark.slow
def test_variants_come_from_the_host_wrappers_config_selection():
    """Recorded, not compiled: the gfx1250 walk at every BV tier of its DEFAULT.json (the rule picks
    by sequences x heads against the CU count), paged and not, with and without the fused norm;
    gfx950's pass-0 tiers, its grouped walk (PASS 1, scan, PASS 2) on a long sequence; the decode
    buckets of each arch."""
    got = _child("""
import json
from verification.investigating.aiter_kda_isa import kda_variants
out = {}
for arch in ("gfx1250", "gfx950"):
    vs, refused = kda_variants(arch)
    out[arch] = dict(refused=refused, v=[dict(k=v.jit.__name__, c={n: repr(x) for n, x in v.signature[1].items()},
                                               o={n: repr(x) for n, x in v.opts.items()}) for v in vs])
print(json.dumps(out))
""")
    for arch in ("gfx1250", "gfx950"):
        assert got[arch]["refused"] == [], got[arch]["refused"]
    walks = [v["c"] for v in got["gfx1250"]["v"] if v["k"] == "chunk_kda_walk_kernel"]
    assert {w["BV"] for w in walks} == {"16", "32", "64", "128"}
    assert {(w["BV"], w["NUM_WARPS"], w["NUM_STAGES"]) for w in walks} >= {("16", "1", "2"), ("32", "2", "2"),
                                                                           ("64", "4", "2"), ("128", "4", "2")}
    assert {w["IS_PAGED"] for w in walks} == {"True", "False"} and {w["FUSE_NORM"] for w in walks} == {"True", "False"}
    assert all(w["BV"] == "128" for w in walks if w["FUSE_NORM"] == "True")
    assert [v["c"]["NC"] for v in got["gfx1250"]["v"] if v["k"] == "chunk_kda_prepare_kernel"] == ["32"]
    w950 = [v["c"] for v in got["gfx950"]["v"] if v["k"] == "chunk_kda_walk_kernel"]
    assert {w["PASS"] for w in w950} == {"0", "1", "2"}
    assert {(w["BV"], w["KS"]) for w in w950 if w["PASS"] == "0" and w["FUSE_NORM"] == "False"} == \
        {("16", "2"), ("32", "2"), ("64", "2")}
    assert any(v["k"] == "chunk_kda_scan_kernel" for v in got["gfx950"]["v"])
    dec = [v for v in got["gfx1250"]["v"] if v["k"] == "fused_recurrent_kda_packed_decode_kernel"]
    assert {(v["c"]["BV"], v["c"]["SK"]) for v in dec} >= {("32", "32"), ("16", "32"), ("32", "8"), ("32", "16"),
                                                          ("128", "16")}
    fused = [v for v in dec if v["c"]["USE_CONV"] == "True"]
    assert len(fused) == 1 and fused[0]["o"]["llvm_fn_attrs"] == repr("amdgpu-sched-strategy=max-ilp")


@needs_gfx1250
@needs_39
@pytest.mark.slow
def test_gfx1250_prepare_and_walk_compile_with_wmma_and_register_figures():
    """One prepare and one walk (BV 64, paged) compiled for gfx1250: they compile, their products
    are v_wmma, and the row carries VGPRs, LDS (dynamic: Triton's metadata.shared), occupancy,
    spills and the compile seconds."""
    rows = _child("""
import json
from verification.investigating.aiter_kda_isa import kda_variants
from verification.investigating.aiter_isa import compile_bounded
vs, _ = kda_variants("gfx1250", families=("chunk_kda",))
prep = next(v for v in vs if v.jit.__name__ == "chunk_kda_prepare_kernel")
walk = next(v for v in vs if v.jit.__name__ == "chunk_kda_walk_kernel" and v.signature[1]["BV"] == 64
            and v.signature[1]["IS_PAGED"])
print(json.dumps([compile_bounded(v, "gfx1250", 600).as_dict() for v in (prep, walk)]))
""", timeout=900)
    for r in rows:
        assert r["ok"], r
        assert r["matrix"]["v_wmma"] > 0 and r["matrix"]["v_mfma"] == 0, r
        assert r["vgprs"] > 0 and r["lds_bytes"] > 0 and r["occupancy"] >= 1 and r["compile_s"] > 0, r
        assert isinstance(r["spills"], dict), r
    assert "IS_PAGED=1" in rows[1]["kernel"] and "BV=64" in rows[1]["kernel"]


@needs_tree
@needs_39
@pytest.mark.slow
def test_a_kernel_that_does_not_compile_is_a_row_with_its_reason():
    """gfx950's decode kernel static-asserts speculative decoding away; aiter's host still picks it
    for a paged spec-decode call: a row with the compiler's reason, not a traceback."""
    row = _child("""
import json
from verification.investigating.aiter_kda_isa import kda_variants
from verification.investigating.aiter_isa import compile_bounded
vs, _ = kda_variants("gfx950", families=("kda_decode",))
spec = next(v for v in vs if v.signature[1]["IS_SPEC_DECODING"])
print(json.dumps(compile_bounded(spec, "gfx950", 600).as_dict()))
""")
    assert not row["ok"] and "not supported on gfx950" in row["error"], row


def test_a_compile_error_row_carries_the_message_after_the_source_marker():
    """A Triton CompilationError reads 'at L:C:', the source, a '^' line, then the reason (a
    static_assert's text): the row keeps the reason, not only 'at 87:4:'; an LLVM 'error:' line
    is kept as before."""
    from kda_kernels.triton.isa import _last_line

    class CompileTimeAssertionFailure(Exception):
        pass
    e = CompileTimeAssertionFailure('at 87:4:\n    gl.static_assert(\n        not (IS_SPEC_DECODING),\n    ^\n'
                                    'not supported on gfx950')
    assert _last_line(e) == "CompileTimeAssertionFailure: at 87:4: ... not supported on gfx950"
    llvm = RuntimeError("PassManager::run failed\nfoo\nerror: ran out of registers")
    assert _last_line(llvm) == "RuntimeError: PassManager::run failed ... error: ran out of registers"


def test_table_row_shows_compile_seconds_and_shortens_long_plan_lists(capsys):
    r = aiter_isa.AiterKernelReport(arch="gfx1250", kernel="chunk_kda_prepare_kernel[NUM_WARPS=4](num_warps=4)",
                                    routes=[f"N={n}:paged" for n in range(10)], ok=True, vgprs=454, sgprs=107,
                                    spills={"sgpr_spill_count": 29}, lds_bytes=103344, occupancy=2,
                                    matrix={"v_mfma": 0, "v_wmma": 124}, instructions=5707, compile_s=16.14)
    aiter_isa.table_header()
    aiter_isa.table_row(r)
    head, _rule, row = capsys.readouterr().out.splitlines()
    assert "secs" in head and " 16.1 chunk_kda_prepare_kernel" in row, row
    assert row.endswith("[N=0:paged, N=1:paged, N=2:paged, +7 more]"), row
