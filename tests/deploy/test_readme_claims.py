"""README's (and docs/*.md's) commands, flags, variables, metrics and Layout stay true to the code: every
`--flag` they name is a flag of some ferry command (or of a named other tool), every
`python -m services.<service> ...` line uses that command's own flags, "the frontend's
`--flag`" is the frontend's, a default quoted right after a flag is its default, every
FERRY_<SERVICE>_<FIELD> is a field of that service's config, every ferry_* metric is
defined, README's Layout block lists the tree, every ferryctl command quoted parses, and every
gRPC method named exists with the grpcurl bodies given for it. The checks read README and the
pages under docs/ that README points to as one text, and name the page and line of what they find."""

from __future__ import annotations

import dataclasses
import importlib
import pathlib
import re
import shlex
import subprocess

import pytest

from tests.deploy.knobs import SERVICE_CONFIGS, config_fields, unknown_variables

pytestmark = pytest.mark.timeout(30)

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DOCS = {path.relative_to(ROOT).as_posix(): path.read_text() for path in sorted((ROOT / "docs").glob("*.md"))}
# README, then each docs page, as one text whose offsets line_of maps back to a file and line.
TEXT = README + "".join(f"\n\n{page}" for page in DOCS.values())
_FLAG = re.compile(r"--[a-z][a-z0-9-]*[a-z0-9]")
_LITERAL_FLAG = re.compile(r"""["'](--[a-z][a-z0-9-]*)["']""")
# Flags of other programs the README quotes: etcd, etcdctl, docker, vLLM.
OTHER_TOOLS = frozenset({"--auto-compaction-mode", "--auto-compaction-retention", "--client-cert-auth",
                         "--prefix", "--endpoints", "--build", "--shm-size", "--trust-request-chat-template"})
SERVICES = ("frontend", "manager", "instance", "transfer")


def config_flags(service: str) -> set[str]:
    return {"--" + name.replace("_", "-") for name in config_fields(service)}


def literal_flags(*patterns: str) -> set[str]:
    return {flag for pattern in patterns for path in ROOT.glob(pattern)
            for flag in _LITERAL_FLAG.findall(path.read_text())}


def command_flags() -> dict[str, set[str]]:
    """Per `python -m services.<name>` command, the flags it takes."""
    flags = {service: config_flags(service) | {"--help"} for service in SERVICES}
    flags["ctl"] = config_flags("ctl") | literal_flags("services/ctl/*.py") | {"--help"}
    flags["cluster up"] = literal_flags("services/cluster/__main__.py") | {"--help"}
    return flags


def every_flag() -> set[str]:
    known = set().union(*command_flags().values())
    return known | literal_flags("services/**/*.py", "benchmarks/*.py", "scripts/*.py") | OTHER_TOOLS


def line_of(offset: int) -> str:
    """`README.md:12` or `docs/x.md:3` for an offset in TEXT."""
    start, name = 0, "README.md"
    for page, body in zip(["README.md", *DOCS], [README, *DOCS.values()]):
        if offset < start + len(body):
            name = page
            break
        start += len(body) + 2
    return f"{name}:{TEXT.count(chr(10), start, offset) + 1}"


def test_docs_pages_are_read():
    assert TEXT.startswith(README) and all(body in TEXT for body in DOCS.values())
    assert line_of(0) == "README.md:1"
    for name, body in DOCS.items():
        assert line_of(TEXT.index(body)) == f"{name}:1"


def test_every_flag_named_is_a_flag_of_something():
    known = every_flag()
    text = re.sub(r"\]\(#[^)]*\)", lambda m: " " * len(m.group()), TEXT)  # a heading's anchor (`#on-a-gpu---device-cuda`)
    unknown = sorted({(flag, line_of(m.start())) for m in _FLAG.finditer(text)
                      if (flag := m.group()) not in known and not text.startswith(("*", "-*"), m.end())})
    assert not unknown, f"README names flags that no ferry command (nor {sorted(OTHER_TOOLS)}) takes: {unknown}"


def command_lines() -> list[tuple[int, str, str]]:
    """(where, command, rest of the line) of each `python -m services.<command>` in README and docs,
    continuation lines of code blocks joined."""
    text = re.sub(r"\\\n\s*", " ", TEXT)
    found = []
    for m in re.finditer(r"python -m services\.(frontend|manager|instance|transfer|ctl|cluster up)(?![.\w])([^`\n#]*)", text):
        found.append((line_of(TEXT.find(m.group(0)[:40])), m.group(1), m.group(2)))
    return found


def test_command_lines_use_their_own_flags():
    flags = command_flags()
    lines = command_lines()
    assert len(lines) > 15
    wrong = [(line, owner, flag) for line, command, rest in lines for owner, words in passed_on(command, rest)
             for flag in _FLAG.findall(words) if flag not in flags[owner]]
    assert not wrong, f"README gives these commands flags they do not take: {wrong}"


_FRONTEND_ARG = re.compile(r"""--frontend-arg(?:=|\s+)('[^']*'|"[^"]*"|\S+)""")


def passed_on(command: str, rest: str) -> list[tuple[str, str]]:
    """(whose flags, text) of a command line: `up --frontend-arg` values hold the frontend's flags."""
    if command != "cluster up":
        return [(command, rest)]
    return [(command, _FRONTEND_ARG.sub("--frontend-arg", rest)),
            *(("frontend", value) for value in _FRONTEND_ARG.findall(rest))]


def test_possessive_flags_belong_to_their_service():
    """"the frontend's `--x`", "an instance's `--x`": `--x` is that service's flag."""
    owner = {"frontend": "frontend", "manager": "manager", "instance": "instance", "transfer service": "transfer"}
    wrong = [(line_of(m.start()), m.group(1), m.group(2))
             for m in re.finditer(r"(frontend|manager|instance|transfer service)(?:'s|s') `(--[a-z0-9-]+)`", TEXT)
             if m.group(2) not in config_flags(owner[m.group(1)])]
    assert not wrong, f"README names a service's flag that its config lacks: {wrong}"


def test_every_variable_named_is_a_config_field():
    assert unknown_variables(re.sub(r"FERRY_\w+_\*", "", TEXT)) == {}


def layout() -> list[str]:
    block = README[README.index("## Layout"):]
    block = block[block.index("```\n") + 4:]
    return [line.split()[0] for line in block[:block.index("```")].splitlines() if line.strip()]


def test_layout_lists_the_tree():
    listed = layout()
    missing = [path for path in listed if not (ROOT / path).is_dir()]
    assert not missing, f"README's Layout lists folders that do not exist: {missing}"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=20)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    top = {line.split("/")[0] for line in tracked.stdout.splitlines() if "/" in line}
    wanted = {f"{name}/" for name in top if not name.startswith(".")}
    wanted |= {f"services/{path.name}/" for path in (ROOT / "services").iterdir() if (path / "__init__.py").exists()}
    covered = {path for path in listed} | {path.split("/")[0] + "/" for path in listed}
    absent = sorted(wanted - covered)
    assert not absent, f"README's Layout does not list {absent}"


def test_every_metric_named_is_defined():
    """The reverse of test_metrics_doc: a metric README names anywhere is one a service defines."""
    defined = {m for path in (ROOT / "services").glob("*/metrics.py")
               for m in re.findall(r'"(ferry_[a-z0-9_]+)"', path.read_text())}
    named = set(re.findall(r"\bferry_(?:frontend|manager|instance|transfer)_[a-z0-9_]*[a-z0-9]", TEXT))
    unknown = sorted(name for name in named
                     if not {name, re.sub(r"_(total|bucket|sum|count)$", "", name)} & defined)
    assert not unknown, f"README names metrics no service defines: {unknown}"


def defaults() -> dict[str, set]:
    """Per flag, the defaults it has in the commands that take it (services and `up`)."""
    found: dict[str, set] = {}
    for module_name, class_name in SERVICE_CONFIGS.values():
        config = getattr(importlib.import_module(module_name), class_name)
        for field in dataclasses.fields(config):
            if field.default is not dataclasses.MISSING:
                found.setdefault("--" + field.name.replace("_", "-"), set()).add(field.default)
    from services.cluster.__main__ import parse_args
    for name, value in vars(parse_args(["up"])).items():
        found.setdefault("--" + name.replace("_", "-"), set()).add(value)
    return found


# "`--flag` (5 s", "`--flag` (default 60 s", "`--flag`, default 5 s", "`--flag`, 3 s", "`--flag` 16,": a
# plain or seconds figure right after a flag is its default (one with another unit, "256 MiB", is left out).
_QUOTED_DEFAULT = re.compile(r"`(--[a-z0-9-]+)`(?:,| \(| )\s*(?:default\s+)?(-?\d+(?:\.\d+)?)(?:\s*s\b)?(?=[,;:)]|\s+[^A-Za-z\s])")


def test_quoted_defaults_are_the_defaults():
    known = defaults()
    quoted = [(line_of(m.start()), m.group(1), float(m.group(2))) for m in _QUOTED_DEFAULT.finditer(TEXT)
              if m.group(1) in known and len(known[m.group(1)]) == 1]
    assert len(quoted) > 15
    wrong = [(line, flag, figure, next(iter(known[flag]))) for line, flag, figure in quoted
             if not isinstance(next(iter(known[flag])), (int, float)) or figure != next(iter(known[flag]))]
    assert not wrong, f"README quotes defaults the flags do not have (line, flag, README, code): {wrong}"


def service_default(service: str, flag: str):
    module_name, class_name = SERVICE_CONFIGS[service]
    fields = {f.name: f for f in dataclasses.fields(getattr(importlib.import_module(module_name), class_name))}
    return fields[flag[2:].replace("-", "_")].default


def test_a_services_quoted_default_is_that_services():
    """"the frontend's `--shutdown-grace-s` (5 s)": checked against the frontend's default, also where other
    services' flag of that name has another (the manager's is 2 s), which test_quoted_defaults_are_the_defaults
    leaves out."""
    owner = {"frontend": "frontend", "manager": "manager", "instance": "instance", "transfer service": "transfer"}
    quoted = [(line_of(m.start()), owner[m.group(1)], m.group(2), float(m.group(3)))
              for m in re.finditer(r"(frontend|manager|instance|transfer service)(?:'s|s')\s+" + _QUOTED_DEFAULT.pattern,
                                   TEXT)
              if m.group(2)[2:].replace("-", "_") in config_fields(owner[m.group(1)])]
    assert quoted
    wrong = [(line, service, flag, figure, service_default(service, flag)) for line, service, flag, figure in quoted
             if figure != service_default(service, flag)]
    assert not wrong, f"README quotes a service's default its flag does not have (line, service, flag, README, code): {wrong}"


def _code_text() -> list[str]:
    """README's and docs' code: each fenced block's lines (continuations joined, `# comments` cut) and each
    inline span."""
    spans = []
    for block in re.findall(r"^ *```[^\n]*\n(.*?)^ *```", TEXT, re.DOTALL | re.MULTILINE):
        spans += [line.split(" #")[0] for line in re.sub(r"\\\n\s*", " ", block).splitlines()]
    prose = re.sub(r"^ *```.*?^ *```", "", TEXT, flags=re.DOTALL | re.MULTILINE)
    spans += re.findall(r"^ {4}(\S.*)$", prose, re.MULTILINE)
    spans += [re.sub(r"\s+", " ", span) for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", prose)]
    return spans


def ferryctl_invocations() -> list[str]:
    """The arguments of each `ferryctl ...` / `python -m services.ctl ...` README quotes."""
    found = []
    for span in _code_text():
        for m in re.finditer(r"(?:\bferryctl|python -m services\.ctl(?![.\w]))((?: +[^\s`]+)*)", span):
            found.append(m.group(1).strip())
    return found


def test_ferryctl_commands_parse():
    """Every ferryctl command README quotes names a subcommand that exists, with flags and arguments it takes
    (test_command_lines_use_their_own_flags checks flags against all of ferryctl's, not the subcommand's)."""
    from services.ctl.__main__ import build_parser
    invocations = [args for args in ferryctl_invocations() if args]
    assert len(invocations) > 15
    wrong = []
    for args in invocations:
        try:
            build_parser().parse_args(shlex.split(args.replace("...", "x")))
        except SystemExit:
            wrong.append(args)
    assert not wrong, f"README quotes ferryctl commands ferryctl refuses: {wrong}"


def test_grpcurl_calls_name_real_methods():
    """Every `ferry.v1.Service/Method` README names is a method of the protos, and every grpcurl `-d` body
    README gives parses as that method's request (field and enum names included)."""
    from google.protobuf import json_format
    from google.protobuf.message_factory import GetMessageClass

    from services.common.gen.ferry.v1 import instance_pb2, manager_pb2, transfer_pb2
    services = {name: service for module in (instance_pb2, manager_pb2, transfer_pb2)
                for name, service in module.DESCRIPTOR.services_by_name.items()}
    text = re.sub(r"\s+", " ", TEXT)
    named = set(re.findall(r"ferry\.v1\.(\w+)/(\w+)", text))
    assert len(named) >= 3
    unknown = sorted(f"{service}/{method}" for service, method in named
                     if service not in services or method not in services[service].methods_by_name)
    assert not unknown, f"README names gRPC methods the protos lack: {unknown}"
    bodies = re.findall(r"grpcurl [^`]*?-d '(\{[^']*\})'[^`]*?ferry\.v1\.(\w+)/(\w+)", text)
    assert bodies
    for body, service, method in bodies:
        request = GetMessageClass(services[service].methods_by_name[method].input_type)()
        json_format.Parse(body, request)


def heading_anchors(page: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation but `-` and `_` dropped, spaces `-`."""
    headings = re.findall(r"^#{1,6} +(.+?) *$", re.sub(r"^ *```.*?^ *```", "", page, flags=re.DOTALL | re.MULTILINE),
                          re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_links_reach_their_pages_and_headings():
    """Every relative link of README and docs/*.md names a file that exists (relative to the page, as GitHub
    reads it) and, with `#anchor`, a heading of that page."""
    pages = {"README.md": README, **DOCS}
    broken = []
    for name, body in pages.items():
        for target in re.findall(r"\]\(([^)\s]+)\)", body):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (ROOT / name).parent / path if path else ROOT / name
            if not resolved.exists():
                broken.append((name, target))
            elif anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved.read_text()):
                broken.append((name, target))
    assert not broken, f"links to files or headings that do not exist (page, link): {broken}"


def test_contents_lists_every_section():
    contents = README[README.index("**Contents**"):README.index("\n## ")]
    listed = set(re.findall(r"\]\(#([^)]+)\)", contents))
    sections = {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
                for heading in re.findall(r"^## +(.+?) *$", README, re.MULTILINE)}
    assert sections - listed == set(), f"README's Contents leaves out {sorted(sections - listed)}"


def test_make_targets_named_exist():
    targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE))
    named = {m.group(1) for span in _code_text() for m in re.finditer(r"\bmake ([a-z][a-z-]*)", span)}
    assert len(named) >= 5
    assert named <= targets, f"README names make targets the Makefile lacks: {sorted(named - targets)}"
