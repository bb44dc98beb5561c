"""Every subcommand's --help: an Examples section whose lines parse, one style of metavars and
capitalisation, the same --device default, and --json meaning JSON on stdout."""
import argparse
import re
import shlex

import pytest

from verification.cli import build_parser, example_parts

PARSER = build_parser()
SUB = next(a for a in PARSER._actions if isinstance(a, argparse._SubParsersAction))
COMMANDS = sorted(SUB.choices)
# BACKEND, PATH, SEED; one letter only for a count (N) or a dimension of the problem (K, V, C): never B or b
METAVAR = re.compile(r"^([NKVC]|[A-Z][A-Z0-9]+(?:[_./:=-][A-Z0-9]+)*)$")
CAPITALISED = re.compile(r"^[A-Z][a-z]+\b")      # "Compute ..." (a sentence), not "K1 ...", "BxTxH", "GPU"
DEVICE_DEFAULT = "cuda if available, else cpu"


def _options(name):
    return [a for a in SUB.choices[name]._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def test_every_built_in_command_is_walked():
    assert {"run", "report", "check", "debug", "bench", "mutate", "oracle", "isa", "export", "capture",
            "calibrate", "backends", "selfcheck", "oracle-bench"} <= set(COMMANDS)


@pytest.mark.parametrize("name", COMMANDS)
def test_help_has_examples_that_parse(name):
    text = SUB.choices[name].format_help()
    assert "\nExamples:\n" in text, text
    examples = [example_parts(ln.strip())[0] for ln in text.split("\nExamples:\n", 1)[1].splitlines() if ln.strip()]
    assert examples and all(ln.startswith(f"kda-verify {name}") for ln in examples), examples
    for ln in examples:
        argv = shlex.split(ln)[1:]
        try:
            PARSER.parse_args(argv)
        except SystemExit as e:                 # argparse exits 2 on an argument it does not take
            raise AssertionError(f"the example does not parse: {ln}") from e


@pytest.mark.parametrize("name", COMMANDS)
def test_metavars_and_capitalisation_have_one_style(name):
    sub = SUB.choices[name]
    assert sub.description and sub.description[0].islower() and not sub.description.endswith("."), sub.description
    for a in _options(name):
        assert a.help and not CAPITALISED.match(a.help), (name, a.option_strings, a.help)
        takes_value = a.nargs != 0 and not isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        if takes_value and a.choices is None:
            assert a.metavar is not None and METAVAR.match(a.metavar), (name, a.option_strings, a.metavar)


@pytest.mark.parametrize("name", [n for n in COMMANDS if any("--device" in a.option_strings for a in _options(n))])
def test_device_defaults_to_cuda_if_available(name):
    dev = next(a for a in _options(name) if "--device" in a.option_strings)
    assert dev.default is None and DEVICE_DEFAULT in dev.help, (name, dev.default, dev.help)


@pytest.mark.parametrize("name", COMMANDS)
def test_json_means_json_on_stdout(name):
    """--json is a flag (JSON on stdout); a file of JSON is --json-out PATH."""
    for a in _options(name):
        if "--json" in a.option_strings:
            assert isinstance(a, argparse._StoreTrueAction), (name, a)
        if "--json-out" in a.option_strings:
            assert a.metavar == "PATH", (name, a)


def test_run_help_names_every_backend_and_suite():
    """run --help's lists are the backends and suites that exist (it had left out emulator-bad and long)."""
    from kda_kernels.base import BUILTIN_BACKENDS
    from verification.running.cases import SUITES
    text = " ".join(SUB.choices["run"].format_help().split())
    for name in list(BUILTIN_BACKENDS) + list(SUITES):
        assert f" {name}," in text or f" {name})" in text or f"({name}," in text, name
