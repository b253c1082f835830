"""docs/design-additions.md stays true to the code: its wire part is what scripts/gen_design_additions.py writes
from the protos, every proto field is on it or among the fields DESIGN.md names, and every gRPC metadata key,
etcd record field, launcher flag and environment variable the services use is named on it. README links it."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

from services.common.gen.ferry.v1 import common_pb2, instance_pb2, manager_pb2, transfer_pb2

pytestmark = pytest.mark.timeout(60)

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "design-additions.md").read_text()
# DESIGN.md is shared: beside the repository (/work/shared next to /work/main), or in a checkout's shared/.
DESIGN_PLACES = (ROOT / "shared" / "DESIGN.md", ROOT.parent / "shared" / "DESIGN.md")


def _generator():
    spec = importlib.util.spec_from_file_location("gen_design_additions", ROOT / "scripts" / "gen_design_additions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GENERATOR = _generator()


def _messages():
    """Every message of the protos (nested ones too), map entries aside."""
    pending = [m for module in (common_pb2, instance_pb2, manager_pb2, transfer_pb2)
               for m in module.DESCRIPTOR.message_types_by_name.values()]
    while pending:
        message = pending.pop()
        if not message.GetOptions().map_entry:
            yield message
            pending += message.nested_types


def _source(path: str) -> str:
    return (ROOT / path).read_text()


def test_the_wire_part_is_what_the_generator_writes():
    expected = GENERATOR.page_with(PAGE, GENERATOR.proto_part(GENERATOR.descriptor_set()))
    assert PAGE == expected, "docs/design-additions.md is stale: run .venv/bin/python scripts/gen_design_additions.py"


def test_every_proto_field_is_on_the_page_or_named_by_design():
    missing = []
    for message in _messages():
        named = GENERATOR.DESIGN_NAMED.get(message.full_name, set())
        short = message.full_name.removeprefix("ferry.v1.")
        missing += [f"{short}.{field.name}" for field in message.fields
                    if field.name not in named and f"`{short}.{field.name}`" not in PAGE]
    assert not missing, f"proto fields neither on docs/design-additions.md nor named in DESIGN.md: {missing}"


def test_the_fields_counted_as_named_by_design_are_named_there():
    design = next((place.read_text() for place in DESIGN_PLACES if place.exists()), None)
    if design is None:
        pytest.skip(f"no DESIGN.md at {' or '.join(map(str, DESIGN_PLACES))}")
    interfaces = design.split("## Interfaces users and operators rely on", 1)[1]
    absent = sorted(f"{message}.{field}" for message, fields in GENERATOR.DESIGN_NAMED.items() for field in fields
                    if not re.search(rf"\b{field}\b", interfaces))
    assert not absent, f"gen_design_additions.DESIGN_NAMED claims DESIGN.md names these; it does not: {absent}"


def test_every_metadata_key_is_on_the_page():
    keys = {key for path in (ROOT / "services").rglob("*.py") if "gen" not in path.parts
            for key in re.findall(r'"(x-ferry-[a-z0-9-]+)"', path.read_text())}
    keys |= {"ferry-cluster-token", "x-request-id", "authorization"}
    assert {"x-ferry-answered", "x-ferry-source-busy", "x-ferry-migration-id"} <= keys
    assert not sorted(k for k in keys if f"`{k}`" not in PAGE)


def _record_keys(path: str, function: str) -> set[str]:
    """The string keys of the dict literal(s) that `function` in `path` returns."""
    text = _source(path)
    body = text.split(f"def {function}(", 1)[1].split("\ndef ", 1)[0]
    return set(re.findall(r'"([a-z_]+)":', body))


@pytest.mark.parametrize(("path", "function"), [("services/instance/app.py", "instance_record"),
                                                ("services/transfer/app.py", "_record"),
                                                ("services/cluster/launcher.py", "state"),
                                                ("services/cluster/security.py", "state"),
                                                ("services/common/scaling_target.py", "to_json")])
def test_every_etcd_record_and_cluster_json_field_is_on_the_page(path, function):
    keys = _record_keys(path, function)
    assert len(keys) >= 5
    assert not sorted(k for k in keys if f"`{k}`" not in PAGE and k not in ("name", "address", "pid", "processes",
                                                                             "frontend_url", "admin_address",
                                                                             "etcd_endpoint"))


def test_every_launcher_flag_is_on_the_page_or_in_design():
    result = subprocess.run([sys.executable, "-m", "services.cluster", "up", "--help"], capture_output=True, text=True,
                            timeout=60, cwd=ROOT, check=True)
    flags = set(re.findall(r"^ {2}(--[a-z][a-z-]*)", result.stdout, re.MULTILINE)) - {"--help"}
    design_flags = {"--model", "--instances", "--prefill-instances", "--decode-instances", "--engine",
                    "--transfer-backend", "--http-port", "--admin-port", "--state-dir"}
    assert len(flags) > 20
    assert not sorted(f for f in flags - design_flags if f"`{f}`" not in PAGE and f"`{f} " not in PAGE)


def test_every_environment_variable_the_services_read_is_on_the_page():
    names = {name for path in (ROOT / "services").rglob("*.py") if "gen" not in path.parts
             for name in re.findall(r'"(FERRY_[A-Z_]+|NOTIFY_SOCKET)"', path.read_text())}
    names |= set(re.findall(r"^([A-Z_]+) \?=", _source("Makefile"), re.MULTILINE)) & {"PYTEST_WORKERS"}
    assert {"FERRY_PORT_RANGE", "PYTEST_WORKERS"} <= names
    assert not sorted(n for n in names if f"`{n}`" not in PAGE)


def test_readme_links_the_page_from_its_contents_and_deploy_section():
    readme = _source("README.md")
    contents = readme.split("\n## ", 1)[0]
    deploy = re.search(r"^## Deploy and operate\n(.*?)(?=^## |\Z)", readme, re.MULTILINE | re.DOTALL).group(1)
    assert "(docs/design-additions.md)" in contents and "(docs/design-additions.md)" in deploy
