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
