"""Every benchmark explains every flag in its --help (as the services do)."""

from __future__ import annotations

import argparse
import pathlib
import re

import pytest

from tests.unit.benchmarks.loading import SCRIPTS, load_benchmark

pytestmark = pytest.mark.timeout(60)


class Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def built_parser(script: pathlib.Path, monkeypatch) -> argparse.ArgumentParser:
    """The parser the script builds, caught where it would parse the command line."""
    def catch(parser, *args, **kwargs):
        raise Parsed(parser)

    module = load_benchmark(script, monkeypatch)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    with pytest.raises(Parsed) as caught:
        (getattr(module, "parse_args", None) or module.main)()
    return caught.value.parser


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_every_flag_has_help(script, monkeypatch):
    parser = built_parser(script, monkeypatch)
    unexplained = [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help]
    assert unexplained == [], f"{script.name}: no help for {unexplained}"
    assert parser.description
    if len(parser._actions) > 1:  # flags besides --help: their defaults are shown (benchmarks/flags.HelpFormatter)
        assert issubclass(parser.formatter_class, argparse.ArgumentDefaultsHelpFormatter), script.name
    # A command continued with a lone backslash in a docstring is one line with a gap in --help.
    assert not re.search(r"\S {4,}--", parser.description), f"{script.name}: a joined command line in its --help"
