"""Generate Python code for proto/ferry/v1/*.proto into services/common/gen/.

The generated modules import each other as `ferry.v1.x_pb2`; we rewrite those
imports to `services.common.gen.ferry.v1.x_pb2` so no sys.path tricks are needed.
"""

import argparse
import pathlib
import re
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
OUT = ROOT / "services" / "common" / "gen"
IMPORT = re.compile(r"^from ferry\.v1 import", re.MULTILINE)


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "ferry" / "v1").glob("*.proto"))
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={OUT}", f"--pyi_out={OUT}", f"--grpc_python_out={OUT}", *protos]
    if protoc.main(args) != 0:
        print("protoc failed", file=sys.stderr)
        return 1
    for path in [OUT, OUT / "ferry", OUT / "ferry" / "v1"]:
        (path / "__init__.py").touch()
    for module in (OUT / "ferry" / "v1").glob("*.py*"):
        text = module.read_text()
        module.write_text(IMPORT.sub("from services.common.gen.ferry.v1 import", text))
    print(f"generated {len(protos)} protos into {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    # no options; parsed so that --help shows this text (before, `--help` regenerated the code)
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    sys.exit(main())
