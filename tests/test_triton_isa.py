"""`kda-verify isa`: our Triton kernels cross-compile for AMD and NVIDIA targets on a CPU machine.
The command runs in a child process without TRITON_INTERPRET (other test modules set it, and
the interpreter replaces the kernels this command compiles).

What these tests require holds on any Triton the install resolves: every variant compiles and
its dots become matrix instructions.  Register spills depend on the compiler's version (a gfx950
kernel spills under one Triton and not another): the command reports them, as a performance
fact, and the test checks that it does, not that there are none."""
import json
import os
import subprocess
import sys

import pytest

from verification.cli import main


def _isa(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "verification", "isa", *args], capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.mark.slow
def test_isa_gfx950_and_sm90_compile_with_matrix_instructions_and_report_spills():
    res = _isa("--arch", "gfx950,sm90", "--routes", "unseg,seg:cps=4:A=fused:B=prefetch", "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    reports = json.loads(res.stdout)
    assert {r["arch"] for r in reports} == {"gfx950", "sm90"}
    kernels = {r["kernel"].split("[")[0] for r in reports}
    assert kernels == {"k1_prepare_kernel", "k1_inverse_kernel", "segment_kernel", "segment_map_kernel", "scan_kernel"}
    for r in reports:
        assert r["ok"], r
        assert r["registers"] and r["registers"] > 0 and r["shared_bytes"] is not None
        # spills are reported per kernel, as counts (zero or not: the compiler's version decides)
        assert isinstance(r["spills"], dict), r
        assert all(v is None or (isinstance(v, int) and v >= 0) for v in r["spills"].values()), r
        m = r["matrix"]
        if r["arch"] == "gfx950":
            assert m["v_mfma"] > 0, r                                    # every kernel's dots became MFMA
        elif r["kernel"].startswith("k1_inverse_kernel") and "INV_PREC=ieee" in r["kernel"]:
            # the IEEE inverse's fp32 products are FMAs on NVIDIA (no fp32 tensor-core product is IEEE)
            assert m["mma (PTX)"] + m["wgmma (PTX)"] == 0, r
        else:
            assert m["mma (PTX)"] + m["wgmma (PTX)"] > 0, r
            assert m["HMMA (SASS)"] + m["HGMMA (SASS)"] > 0, r
    routes = {x for r in reports for x in r["routes"]}
    assert routes == {"unseg:BW=32", "seg:cps=4:A=fused:B=prefetch:BW=32"}
    # the summary line counts the variants that spill (and names the worst) whatever the count is
    spilling = [r for r in reports if any(r["spills"].get(k) for k in SPILL_KEYS)]
    summary = res.stderr.strip().splitlines()[-1]
    assert summary.startswith(f"{len(reports)}/{len(reports)} kernel variants compiled"), summary
    assert summary.endswith("register spills: none") if not spilling else \
        f"register spills: {len(spilling)} variant" in summary, summary


SPILL_KEYS = ("vgpr_spill_count", "sgpr_spill_count", "spill_store_bytes")


def test_isa_table_shows_each_kernels_spills(monkeypatch, capsys):
    """The table's spills column: 'none', or each non-zero count (what a spill under another
    compiler looks like, without compiling)."""
    from kda_kernels.triton.isa import KernelReport
    import verification.commands.isa as isa_cmd
    clean = KernelReport(arch="sm90", kernel="k_clean", routes=["unseg:BW=32"], ok=True, registers=100, shared_bytes=0,
                         spills={"spill_store_bytes": 0, "spill_load_bytes": 0}, matrix={"wgmma (PTX)": 1})
    spill = KernelReport(arch="gfx950", kernel="k_spill", routes=["unseg:BW=32"], ok=True, registers=512, shared_bytes=0,
                         spills={"vgpr_spill_count": 82, "sgpr_spill_count": 0, "scratch_bytes": 332},
                         matrix={"v_mfma": 108})
    isa_cmd._table([clean, spill])
    rows = {ln.split()[-1]: ln for ln in capsys.readouterr().out.splitlines()[2:]}
    assert " none " in rows["k_clean"] and "vgpr_spill=82" in rows["k_spill"] and "sgpr" not in rows["k_spill"]
    assert isa_cmd.spill_summary([clean, spill]) == \
        "register spills: 1 variant (worst: gfx950 k_spill vgpr_spill=82 scratchB=332)"
    assert isa_cmd.spill_summary([clean]) == "register spills: none"


def test_isa_bad_arguments_are_one_line_errors(capsys):
    assert main(["isa", "--arch", "gfx9000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--arch" in err and "gfx9000" in err
    assert main(["isa", "--arch", "sm90", "--routes", "seg:cps=0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--routes" in err and "cps >= 1" in err
