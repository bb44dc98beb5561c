"""The long suite: its shapes and gates, every case long (never built on a CPU run), the varlen
pack, and keys whose consecutive cosines are those of the key_cos range."""
import torch

from kda_ref.problems import generate
from verification.running.cases import get_case, get_suite


def test_long_suite_shapes_gates_and_gating():
    cases = get_suite("long")
    assert get_suite("long", long=False) == []                 # a CPU run (--long auto) builds none
    assert all(c.long for c in cases) and len({c.id for c in cases}) == len(cases)
    dense = {(c.params["T"], c.params["H"], c.params["lb"]) for c in cases if "T" in c.params and "key_cos" not in c.params}
    for T, H in ((131072, 12), (262144, 12), (1048576, 12), (131072, 96), (16384, 12)):
        assert {(T, H, -5.0), (T, H, -0.05)} <= dense, (T, H)
    weak = [c for c in cases if c.params["lb"] == -0.05]
    assert weak and all(c.params["state"] == "kv" for c in weak)     # the state persists: start from one
    packs = [c for c in cases if "lens" in c.params]
    assert len(packs) == 2
    lens = packs[0].lens
    assert len(lens) == 65 and lens.count(524288) == 1 and all(1 <= n <= 4096 for n in lens if n != 524288)
    kc = [c for c in cases if "key_cos" in c.params]
    assert {(c.params["T"], c.params["lb"]) for c in kc} == {(131072, -5.0), (131072, -0.05), (1048576, -0.05)}
    assert get_case("long/T1048576-H12-lb-0.05").params["T"] == 1048576


def test_key_cos_keys_have_consecutive_cosines_in_range():
    """A small build of the key-correlation variant's parameters: the cosine between consecutive
    raw keys of each head is within the drawn range, far above independent keys' (about 0)."""
    params = dict(get_case("long/key-cos-0.85-0.97-T131072-H12-lb-5").params)
    params.update(T=2048, H=3, long=False)
    p = generate(params, seed=11)
    k = p.k[0].float()                                                 # [T, H, K]
    cos = torch.nn.functional.cosine_similarity(k[1:], k[:-1], dim=-1).mean(0)
    assert bool(((cos > 0.83) & (cos < 0.98)).all()), cos
    plain = generate(dict(params, key_cos=None), seed=11).k[0].float()
    assert float(torch.nn.functional.cosine_similarity(plain[1:], plain[:-1], dim=-1).mean().abs()) < 0.05
    # in a varlen pack each sequence walks on its own (empty and 1-token sequences included)
    pv = generate(dict(params, lens=[5, 0, 1, 300]), seed=3)
    kv = pv.k[0, 6:].float()
    assert pv.k.shape[1] == 306
    assert float(torch.nn.functional.cosine_similarity(kv[1:], kv[:-1], dim=-1).mean()) > 0.83


def test_run_on_the_cpu_says_how_many_long_cases_it_left_out(tmp_path, capsys):
    from verification.cli import main
    rc = main(["run", "--backend", "emulator", "--suite", "long", "--device", "cpu", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    n = len(list(get_suite("long", long=True)))
    assert rc != 0 and f"{n} long case(s) of suite(s) long left out on cpu (--long yes runs them here)" in err, err
