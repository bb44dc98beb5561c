"""The backend contract (kda_kernels/base.py): each built-in backend's optional capabilities are
what isinstance against the capability Protocols reports, and with_taps leaves the caller's
backend unchanged."""
import pytest

from kda_kernels.base import (BUILTIN_BACKENDS, CAPABILITIES, Backend, ChecksContract, LooksUpRoutes,
                              ReturnsTaps, RunsPasses, TakesBuffers, capabilities, load_backend)

EXPECTED = {
    "emulator": {"returns_taps", "runs_traces"},
    "emulator-bad": {"returns_taps", "runs_traces"},
    "triton": {"runs_passes", "takes_buffers", "returns_taps", "looks_up_routes", "runs_traces"},
    "fla": {"runs_passes", "runs_traces"},
    "aiter": {"runs_passes", "runs_traces"},
    "moonshot": {"checks_contract"},
    "fla-naive": set(),
    "transformers": set(),
    "cudnn": set(),
}


@pytest.mark.parametrize("name", sorted(BUILTIN_BACKENDS))
def test_builtin_capabilities(name):
    b = load_backend(name)
    assert isinstance(b, Backend)
    assert set(capabilities(b)) == EXPECTED[name]
    for cap, proto in CAPABILITIES.items():
        assert isinstance(b, proto) == (cap in EXPECTED[name]), cap


def test_every_builtin_has_an_expectation():
    assert set(EXPECTED) == set(BUILTIN_BACKENDS)


@pytest.mark.parametrize("name", ["triton", "emulator", "emulator-bad"])
def test_with_taps_is_a_new_backend(name):
    b = load_backend(name, taps=False)
    t = b.with_taps(True)
    assert t is not b and type(t) is type(b) and t.taps is True and b.taps is False
    assert isinstance(t, ReturnsTaps) and t.with_taps(False).taps is False


def test_a_plain_object_has_no_capability():
    class Bare:
        name = "bare"

        def available(self):
            return True, ""

        def version(self):
            return "0"

        def routes(self):
            return []

        def accepts(self, problem, route):
            return True, ""

        def run(self, problem, route):
            raise NotImplementedError

    b = Bare()
    assert isinstance(b, Backend) and capabilities(b) == []
    for proto in (RunsPasses, TakesBuffers, ReturnsTaps, LooksUpRoutes, ChecksContract):
        assert not isinstance(b, proto)


def test_shrink_recorder_keeps_the_capabilities():
    """shrink's recorder is a copy of the backend whose class derives from the backend's, so the
    harness's isinstance checks see what the backend can do, also where runtime_checkable Protocols
    look members up statically (Python >= 3.12): every member is found by inspect.getattr_static."""
    import inspect
    from kda_kernels.base import CAPABILITIES
    from verification.investigating.shrink import recording

    for name in sorted(BUILTIN_BACKENDS):
        b = load_backend(name)
        rec = recording(b)
        assert set(capabilities(rec)) == EXPECTED[name], name
        assert rec is not b and type(b) in type(rec).__mro__ and rec.last is None
        for cap in capabilities(b):
            proto = CAPABILITIES[cap]
            for member in [m for m in vars(proto) if not m.startswith("_")] + list(getattr(proto, "__annotations__", {})):
                inspect.getattr_static(rec, member)        # raises AttributeError if only __getattr__ had it


def test_the_library_switches_are_set_in_one_place():
    """FLA_FLASH_KDA and AITER_TRITON_ONLY are set only through kda_kernels.base.set_library_switch
    (fla forced to its own Triton kernels, aiter's default kept if the caller set one)."""
    import os
    import re
    from pathlib import Path

    from kda_kernels.base import LIBRARY_SWITCHES, set_library_switch
    root = Path(__file__).resolve().parents[1]
    setters = re.compile(r"os\.environ(\.setdefault\(|\[)\s*[\"'](FLA_FLASH_KDA|AITER_TRITON_ONLY)[\"']")
    found = [f"{p.relative_to(root)}" for pkg in ("kda_kernels", "verification", "kda_verify")
             for p in (root / pkg).rglob("*.py") if setters.search(p.read_text(encoding="utf-8"))
             and p.name != "base.py" and p.name != "bundle.py"]     # bundle.py: inside a standalone repro script's text
    assert found == []
    old = {k: os.environ.get(k) for k in ("FLA_FLASH_KDA", "AITER_TRITON_ONLY")}
    try:
        os.environ["FLA_FLASH_KDA"] = "1"
        os.environ["AITER_TRITON_ONLY"] = "0"
        set_library_switch("fla")
        set_library_switch("aiter")
        assert os.environ["FLA_FLASH_KDA"] == "0" and os.environ["AITER_TRITON_ONLY"] == "0"
        assert set(LIBRARY_SWITCHES) == {"fla", "aiter"}
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
