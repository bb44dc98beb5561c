"""`kda-verify isa`: our Triton kernels cross-compile for AMD and NVIDIA targets on a CPU machine.
The command runs in a child process without TRITON_INTERPRET (other test modules set it, and
the interpreter replaces the kernels this command compiles)."""
import json
import os
import subprocess
import sys

from verification.cli import main


def _isa(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "verification", "isa", *args], capture_output=True, text=True,
                          env=env, timeout=600)


def test_isa_gfx950_and_sm90_compile_with_matrix_instructions_and_no_spills():
    res = _isa("--arch", "gfx950,sm90", "--routes", "unseg,seg:cps=4:A=fused:B=prefetch", "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    reports = json.loads(res.stdout)
    assert {r["arch"] for r in reports} == {"gfx950", "sm90"}
    kernels = {r["kernel"].split("[")[0] for r in reports}
    assert kernels == {"k1_prepare_kernel", "k1_inverse_kernel", "segment_kernel", "segment_map_kernel", "scan_kernel"}
    for r in reports:
        assert r["ok"], r
        assert r["registers"] and r["registers"] > 0 and r["shared_bytes"] is not None
        assert not any(r["spills"].values()), r                          # nothing spills on either target
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


def test_isa_bad_arguments_are_one_line_errors(capsys):
    assert main(["isa", "--arch", "gfx9000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--arch" in err and "gfx9000" in err
    assert main(["isa", "--arch", "sm90", "--routes", "seg:cps=0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--routes" in err and "cps >= 1" in err
