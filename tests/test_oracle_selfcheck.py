"""`kda-verify selfcheck`: passes on the oracle, fails (exit 1) when a form is broken."""
import json

from verification.cli import main


def test_selfcheck_quick_json_passes(capsys):
    rc = main(["selfcheck", "--quick", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["passed"]
    names = {r["check"] for r in out["rows"]}
    for want in ("chunked C=64 vs recurrence", "streamed C=64 (blocks of 1 and 3 chunks) vs recurrence",
                 "streamed C=16 (blocks of 1 and 3 chunks) vs recurrence", "segmented C=16 cps=7 vs recurrence", "fla form BT=32 vs recurrence",
                 "float64 recurrence vs mpmath (40 digits)",
                 "inverse residual ratio, production fp32 (C=32, eps 2^-24)",
                 "non-finite entries in chunked/streamed/segmented/fla (recurrence finite)"):
        assert want in names, want
    assert all(r["problems"] > 0 for r in out["rows"])


def test_selfcheck_fails_when_the_chunk_step_is_wrong(monkeypatch, capsys):
    import kda_ref.chunked as ch
    real = ch.chunk_step

    def off_by_a_little(S, kd, qd, kr, gt, inv, mqk, beta, v, compute_output=True):
        S_new, o, U = real(S, kd, qd, kr, gt, inv, mqk, beta, v, compute_output)
        return S_new * (1 + 1e-10), o, U

    monkeypatch.setattr(ch, "chunk_step", off_by_a_little)
    rc = main(["selfcheck", "--quick"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAIL" in out and "chunked C=16 vs recurrence" in out


def test_selfcheck_fails_when_the_streamed_carry_is_lost(monkeypatch, capsys):
    """A streamed form that starts every block from the initial state fails its own row only."""
    import kda_ref.chunked as ch
    from kda_ref.preprocess import initial_state_kfirst
    real = ch.prepare_tokens

    def forget(p, t0, t1, S0, buffers=None):
        return real(p, t0, t1, initial_state_kfirst(p)[: S0.shape[0]], buffers)

    monkeypatch.setattr(ch, "prepare_tokens", forget)
    rc = main(["selfcheck", "--quick", "--json"])
    rows = {r["check"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rc == 1
    assert not rows["streamed C=16 (blocks of 1 and 3 chunks) vs recurrence"]["passed"]
    assert rows["chunked C=16 vs recurrence"]["passed"]
