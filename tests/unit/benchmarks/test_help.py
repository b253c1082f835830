"""Every benchmark explains every flag in its --help (as the services do)."""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))

pytestmark = pytest.mark.timeout(60)


class Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def built_parser(script: pathlib.Path, monkeypatch) -> argparse.ArgumentParser:
    """The parser the script builds, caught where it would parse the command line."""
    def catch(parser, *args, **kwargs):
        raise Parsed(parser)

    spec = importlib.util.spec_from_file_location(f"bench_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
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
