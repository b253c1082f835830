"""Every `benchmarks/<name>.py ...` command README (or a docs/*.md page) quotes names a script that exists and gives it
only flags that script takes (test_readme_claims checks a flag is some command's; this checks it
is this one's, so a figure's command still runs as quoted)."""

from __future__ import annotations

import re

import pytest

from tests.unit.benchmarks.loading import ROOT
from tests.unit.benchmarks.test_help import built_parser

pytestmark = pytest.mark.timeout(120)

README = (ROOT / "README.md").read_text()
TEXT = "\n\n".join([README, *(path.read_text() for path in sorted((ROOT / "docs").glob("*.md")))])
_SCRIPT = re.compile(r"benchmarks/(\w+)\.py")
_QUOTED = re.compile(r"\"[^\"]*\"|'[^']*'")  # --launcher-args "...": flags of another command


def code_spans(text: str) -> list[str]:
    """Every line of a fenced or indented code block (continuations joined) and every inline `code` span."""
    spans = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.DOTALL | re.MULTILINE):
        spans += re.sub(r"\\\n\s*", " ", block).splitlines()
    prose = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    spans += re.findall(r"^ {4}(\S.*)$", re.sub(r"\\\n\s*", " ", prose), re.MULTILINE)
    spans += re.findall(r"(?<!`)`([^`]+)`(?!`)", prose)
    return spans


def benchmark_commands(text: str) -> list[tuple[str, list[str]]]:
    """(script name, flags after it) for each benchmark command in `text`'s code."""
    commands = []
    for span in code_spans(text):
        for found in _SCRIPT.finditer(span):
            rest = _QUOTED.sub("", span[found.end():].split("#")[0])
            rest = _SCRIPT.split(rest)[0]  # up to the next script on the line
            commands.append((found.group(1), re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest)))
    return commands


def test_commands_are_found_across_lines():
    text = ("run (`python benchmarks/engine.py --model m\n--vllm-python p`, then\n"
            "```\npython benchmarks/pd_compare.py --pd 1:2 \\\n  --launcher-args \"--engine sim\"  # --x\n```\n"
            "\n    python benchmarks/serving.py --rate 2 \\\n        --tag t\n")
    assert benchmark_commands(text) == [("pd_compare", ["--pd", "--launcher-args"]), ("serving", ["--rate", "--tag"]),
                                        ("engine", ["--model", "--vllm-python"])]


def test_readme_benchmark_commands_use_their_own_flags(monkeypatch):
    commands = benchmark_commands(TEXT)
    assert len(commands) > 20
    missing = sorted({name for name, _ in commands if not (ROOT / "benchmarks" / f"{name}.py").exists()})
    assert not missing, f"README or docs quote benchmarks that do not exist: {missing}"
    flags: dict[str, set[str]] = {}
    for name in sorted({name for name, _ in commands}):
        parser = built_parser(ROOT / "benchmarks" / f"{name}.py", monkeypatch)
        flags[name] = {option for action in parser._actions for option in action.option_strings}
    wrong = sorted({(name, flag) for name, given in commands for flag in given if flag not in flags[name]})
    assert not wrong, f"README or docs give benchmarks flags they do not take: {wrong}"
