"""Write the wire part of docs/design-additions.md from proto/ferry/v1/*.proto and their comments.

DESIGN.md (shared: not edited here) names a few admin fields; every other field of every message is listed
on the page, under its message, with its number, type and the proto's comment on it, between the page's
`<!-- proto:begin -->` and `<!-- proto:end -->` lines. Run it after changing a .proto:

    .venv/bin/python scripts/gen_design_additions.py           # rewrite that part of the page
    .venv/bin/python scripts/gen_design_additions.py --check   # exit 1 if the page is stale (a deploy test does this)
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import tempfile

from google.protobuf import descriptor_pb2
from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PAGE = ROOT / "docs" / "design-additions.md"
BEGIN, END = "<!-- proto:begin -->", "<!-- proto:end -->"

# The fields DESIGN.md's "Interfaces users and operators rely on" names, by message (tests/deploy checks that
# DESIGN.md does name each of them); the page lists every other field.
DESIGN_NAMED = {
    "ferry.v1.ListInstancesResponse": {"instances"},
    "ferry.v1.InstanceInfo": {"instance_id", "address", "role", "state", "pid", "host", "num_running", "num_waiting",
                              "num_free_blocks", "num_total_blocks", "freeness"},
    "ferry.v1.AdminListRequestsRequest": {"instance_id"},
    "ferry.v1.ListRequestsResponse": {"requests"},
    "ferry.v1.RequestInfo": {"request_id", "instance_id", "num_tokens", "state"},
    "ferry.v1.MigrateRequest": {"request_id", "src_instance_id", "dst_instance_id"},
    "ferry.v1.MigrateResponse": {"request_id", "src_instance_id", "dst_instance_id", "num_blocks", "num_bytes",
                                 "num_stages", "backend", "duration_ms", "downtime_ms"},
    "ferry.v1.DrainRequest": {"instance_id"},
    "ferry.v1.AdminSetRoleRequest": {"instance_id", "role"},
}

_TYPE_NAMES = {number: name.removeprefix("TYPE_").lower()
               for name, number in descriptor_pb2.FieldDescriptorProto.Type.items()}
_MESSAGE_PATH, _FIELD_PATH, _NESTED_PATH, _ENUM_PATH, _SERVICE_PATH, _METHOD_PATH = 4, 2, 3, 5, 6, 2


def descriptor_set() -> descriptor_pb2.FileDescriptorSet:
    """The protos, parsed by protoc with their comments (source info)."""
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "ferry" / "v1").glob("*.proto"))
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "ferry.pb"
        if protoc.main(["protoc", f"-I{PROTO_ROOT}", f"-I{include}", "--include_source_info",
                        f"--descriptor_set_out={out}", *protos]) != 0:
            raise RuntimeError("protoc failed on proto/ferry/v1/*.proto")
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def proto_part(files: descriptor_pb2.FileDescriptorSet) -> str:
    lines = []
    for file in files.file:
        comments = _comments(file)
        lines += ["", f"### {file.name}"]
        for index, service in enumerate(file.service):
            lines += _service_lines(service, (_SERVICE_PATH, index), comments)
        for index, message in enumerate(file.message_type):
            lines += _message_lines(message, f"{file.package}.{message.name}", (_MESSAGE_PATH, index), comments)
        for index, enum in enumerate(file.enum_type):
            lines += _enum_lines(enum, (_ENUM_PATH, index), comments)
    return "\n".join(lines[1:]) + "\n"


def _comments(file: descriptor_pb2.FileDescriptorProto) -> dict[tuple[int, ...], str]:
    """Each element's comment (leading and trailing, on one line), by its source path."""
    found = {}
    for location in file.source_code_info.location:
        text = " ".join(part for part in (location.leading_comments, location.trailing_comments) if part)
        if text.strip():
            found[tuple(location.path)] = re.sub(r"\s+", " ", text).strip()
    return found


def _message_lines(message: descriptor_pb2.DescriptorProto, full_name: str, path: tuple[int, ...],
                   comments: dict[tuple[int, ...], str]) -> list[str]:
    named = DESIGN_NAMED.get(full_name, set())
    short = full_name.removeprefix("ferry.v1.")
    lines = [f"- `{short}`" + (f": {comments[path]}" if path in comments else "")]
    if named:
        lines.append(f"  - named in DESIGN.md: {', '.join(f'`{n}`' for n in sorted(named))}")
    maps = {f".{full_name}.{nested.name}": nested for nested in message.nested_type if nested.options.map_entry}
    for index, field in enumerate(message.field):
        if field.name not in named:
            note = comments.get((*path, _FIELD_PATH, index), "")
            kind = _map_type(maps[field.type_name]) if field.type_name in maps else _type(field)
            lines.append(f"  - `{short}.{field.name}` = {field.number} ({kind})" + (f": {note}" if note else ""))
    if not message.field:
        lines.append("  - (no fields)")
    for index, nested in enumerate(message.nested_type):
        if not nested.options.map_entry:  # a map field's entry type: shown as map<key, value> above
            lines += _message_lines(nested, f"{full_name}.{nested.name}", (*path, _NESTED_PATH, index), comments)
    return lines


def _service_lines(service: descriptor_pb2.ServiceDescriptorProto, path: tuple[int, ...],
                   comments: dict[tuple[int, ...], str]) -> list[str]:
    lines = [f"- service `ferry.v1.{service.name}`" + (f": {comments[path]}" if path in comments else "")]
    for index, method in enumerate(service.method):
        stream_in, stream_out = ("stream " if method.client_streaming else ""), ("stream " if method.server_streaming
                                                                                else "")
        note = comments.get((*path, _METHOD_PATH, index), "")
        lines.append(f"  - `{method.name}({stream_in}{method.input_type.removeprefix('.ferry.v1.')}) returns "
                     f"({stream_out}{method.output_type.removeprefix('.ferry.v1.')})`" + (f": {note}" if note else ""))
    return lines


def _enum_lines(enum: descriptor_pb2.EnumDescriptorProto, path: tuple[int, ...],
                comments: dict[tuple[int, ...], str]) -> list[str]:
    values = ", ".join(f"`{value.name}` = {value.number}" for value in enum.value)
    return [f"- enum `{enum.name}`" + (f" ({comments[path]})" if path in comments else "") + f": {values}"]


def _map_type(entry: descriptor_pb2.DescriptorProto) -> str:
    key, value = entry.field
    return f"map<{_type(key)}, {_type(value)}>"


def _type(field: descriptor_pb2.FieldDescriptorProto) -> str:
    kind = field.type_name.removeprefix(".ferry.v1.") if field.type_name else _TYPE_NAMES[field.type]
    if field.label == descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED:
        return f"repeated {kind}"
    return f"optional {kind}" if field.proto3_optional else kind


def page_with(page: str, part: str) -> str:
    head, begin, rest = page.partition(BEGIN + "\n")
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"{PAGE.relative_to(ROOT)} lacks the {BEGIN} and {END} lines")
    return head + begin + part + end + tail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is not what this would write")
    args = parser.parse_args()
    page = PAGE.read_text()
    new = page_with(page, proto_part(descriptor_set()))
    if args.check:
        if new != page:
            print(f"{PAGE.relative_to(ROOT)} is stale: run python scripts/gen_design_additions.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new)
    print(f"wrote the proto part of {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
