"""scripts/device_kit.py and scripts/device_check.sh: the wheels carried to a GPU machine cover every pin
the CUDA checks import, and the checks' time limits fit one device command."""

from __future__ import annotations

import pathlib
import re
import sys
import tomllib

import pytest

pytestmark = pytest.mark.timeout(30)

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import device_kit  # noqa: E402

DEVICE_COMMAND_S = 540  # a device command may run 600 s; the start and the copies back take the rest


def _pins() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    return {pin.split("==", 1)[0].strip() for pin in pins}


def test_every_pin_is_carried_already_on_the_image_or_not_needed():
    # llguidance was pinned after the kit was written: without its wheel, the engine (guided.py) and the
    # frontend failed to import on the GPU machine, and every CUDA test with them.
    kinds = (set(device_kit.PACKAGES), set(device_kit.ON_GPU_IMAGE), set(device_kit.NOT_NEEDED))
    unplaced = sorted(pin for pin in _pins() if not any(pin in kind for kind in kinds))
    assert not unplaced, f"add each to PACKAGES, ON_GPU_IMAGE or NOT_NEEDED in scripts/device_kit.py: {unplaced}"
    assert not set.intersection(*kinds[:2]) and not (kinds[0] | kinds[1]) & kinds[2]


def test_the_device_check_fits_one_device_command():
    script = (ROOT / "scripts" / "device_check.sh").read_text()
    limits = [int(seconds) for seconds in re.findall(r"^timeout (?:-k \d+ )?(\d+) ", script, re.MULTILINE)]
    kills = [int(seconds) for seconds in re.findall(r"^timeout -k (\d+) ", script, re.MULTILINE)]
    assert len(limits) == 2, "the tests and the benchmark each run under `timeout`"
    assert sum(limits) + sum(kills) <= DEVICE_COMMAND_S
