"""kda-verify backends: every built-in backend with status, version, routes and reason."""
import json

from kda_kernels.base import BUILTIN_BACKENDS
from verification.cli import main
from verification.commands.backends import NOT_IMPLEMENTED, describe


def test_json_lists_every_builtin_backend_with_its_fields(capsys):
    assert main(["backends", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == list(BUILTIN_BACKENDS)
    for r in rows:
        assert set(r) == {"name", "available", "reason", "version", "routes"}
        assert isinstance(r["available"], bool) and isinstance(r["routes"], list)
        assert r["available"] or r["reason"], f"{r['name']}: unavailable without a reason"
    emu = next(r for r in rows if r["name"] == "emulator")
    assert emu["available"] and {"flashkda", "fla", "moonshot"} <= set(emu["routes"]) and emu["reason"] == ""


def test_a_missing_adapter_module_is_reported_as_not_implemented():
    row = describe("someday", spec="kda_kernels.no_such_adapter:Backend")
    assert row["available"] is False and row["reason"] == NOT_IMPLEMENTED


def test_external_backends_and_unavailable_reasons(capsys):
    assert main(["backends", "--backend", "kda_test_backends:unavailable", "--backend", "kda_test_backends:exact"]) == 0
    out = capsys.readouterr().out
    assert "kda_test_backends:unavailable  unavailable" in out
    assert "reason: this test backend is never available" in out
    assert "routes: r1, r2" in out


def test_triton_without_cuda_says_run_turns_the_interpreter_on(monkeypatch):
    import torch
    from verification.commands.backends import describe
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    row = describe("triton")
    assert not row["available"] and row["reason"].startswith("no CUDA device, and TRITON_INTERPRET is not 1")
    assert "kda-verify run and pytest -m verify turn Triton's CPU interpreter on themselves" in row["reason"]
