"""deploy/systemd: `systemd-analyze verify` prints nothing for every unit, and each unit
keeps the promises of INSTALL.md (restart, sandboxing, dedicated user, etcd ordering).

verify checks that ExecStart's binary exists, so it runs with --root on a throwaway tree:
the host's system units (for multi-user.target and friends), stand-in executables at
/opt/ferry/.venv/bin/{python,etcd}, and the units under test in /etc/systemd/system.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

from services.cluster.launcher import TRANSFER_THREADS
from tests.deploy.knobs import unknown_variables

pytestmark = pytest.mark.timeout(60)

ROOT = pathlib.Path(__file__).resolve().parents[2]
UNIT_DIR = ROOT / "deploy" / "systemd"
UNITS = sorted(p.name for p in UNIT_DIR.iterdir() if p.suffix in (".service", ".target"))
SERVICES = [u for u in UNITS if u.endswith(".service")]
HOST_UNITS = next((p for p in (pathlib.Path("/usr/lib/systemd/system"), pathlib.Path("/lib/systemd/system"))
                   if (p / "multi-user.target").exists()), None)
STAND_INS = ("python", "etcd")


@pytest.fixture(scope="module")
def verify_root(tmp_path_factory) -> pathlib.Path:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed here (Debian/Ubuntu: apt-get install systemd)")
    if HOST_UNITS is None:
        pytest.skip("no system unit directory with multi-user.target to verify against")
    root = tmp_path_factory.mktemp("systemd-root")
    shutil.copytree(HOST_UNITS, root / "usr" / "lib" / "systemd" / "system", symlinks=True)
    bin_dir = root / "opt" / "ferry" / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in STAND_INS:
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    (root / "etc" / "systemd" / "system").mkdir(parents=True)
    for unit in UNITS:
        shutil.copy(UNIT_DIR / unit, root / "etc" / "systemd" / "system" / unit)
    return root


def verify(root: pathlib.Path, unit: str) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", "verify", f"--root={root}", str(root / "etc/systemd/system" / unit)],
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("unit", UNITS)
def test_verify_prints_nothing(verify_root, unit):
    result = verify(verify_root, unit)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_verify_would_catch_a_mistake(verify_root):
    """Guards the check itself: a misspelt key and a missing binary are reported."""
    unit_dir = verify_root / "etc" / "systemd" / "system"
    text = (UNIT_DIR / "ferry-manager.service").read_text()
    (unit_dir / "ferry-broken.service").write_text(
        text.replace("ProtectSystem=", "ProtectSytem=").replace("/bin/python ", "/bin/pythonX "))
    try:
        output = verify(verify_root, "ferry-broken.service")
    finally:
        (unit_dir / "ferry-broken.service").unlink()
    assert "ProtectSytem" in output.stderr and "pythonX" in output.stderr


def directives(unit: str) -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    for line in (UNIT_DIR / unit).read_text().splitlines():
        if "=" in line and not line.startswith(("#", ";")):
            key, value = line.split("=", 1)
            values.setdefault(key.strip(), []).append(value.strip())
    return values


@pytest.mark.parametrize("unit", SERVICES)
def test_service_is_sandboxed_and_restarts(unit):
    d = directives(unit)
    for key, value in {"Restart": "on-failure", "NoNewPrivileges": "yes", "ProtectSystem": "strict",
                       "PrivateTmp": "yes", "User": "ferry", "Group": "ferry", "Type": "notify",
                       "NotifyAccess": "main"}.items():  # started = serving: `systemctl restart` waits for it
        assert d.get(key) == [value], f"{unit}: {key}={d.get(key)}"
    assert d["EnvironmentFile"] and d["ExecStart"][0].startswith("/opt/ferry/.venv/bin/")
    assert d["WantedBy"] == ["ferry.target"]
    if unit != "ferry-etcd.service":
        assert "ferry-etcd.service" in d["After"][0] and "etcd.service" in d["After"][0].split()
        assert "ferry-etcd.service" in d["Wants"][0].split()


def test_instances_are_a_template_with_their_own_env_file():
    d = directives("ferry-instance@.service")
    assert d["EnvironmentFile"] == ["/etc/ferry/instance-%i.env"]
    assert d["ExecStart"] == ["/opt/ferry/.venv/bin/python -m services.instance"]


def test_example_env_files_set_real_knobs():
    for path in [*sorted((UNIT_DIR / "env").glob("*.env")), *(UNIT_DIR / unit for unit in SERVICES)]:
        unknown = unknown_variables(path.read_text())
        assert unknown == {}, f"{path.name} sets variables no config reads: {unknown}"


def env_file(name: str) -> dict[str, str]:
    lines = (UNIT_DIR / "env" / name).read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def test_the_env_files_as_shipped_make_one_host_cluster():
    """INSTALL.md installs them and starts everything on one host: every service finds the
    etcd ferry-etcd.service listens on, and the instance its host's transfer service."""
    etcd_env = dict(pair.split("=", 1) for line in directives("ferry-etcd.service")["Environment"]
                    for pair in line.split())
    etcd = etcd_env["ETCD_ADVERTISE_CLIENT_URLS"].removeprefix("http://")
    for name, service in [("manager.env", "MANAGER"), ("transfer.env", "TRANSFER"), ("instance-0.env", "INSTANCE"),
                          ("frontend.env", "FRONTEND")]:
        assert env_file(name)[f"FERRY_{service}_ETCD_ENDPOINTS"] == etcd, name
    transfer = env_file("transfer.env")
    assert env_file("instance-0.env")["FERRY_INSTANCE_TRANSFER_ADDRESS"] == \
        f"{transfer['FERRY_TRANSFER_ADVERTISE_HOST']}:{transfer['FERRY_TRANSFER_PORT']}"


def test_every_etcd_ferry_starts_compacts_its_history(tmp_path):
    """Migration records are written all day: an etcd that keeps every revision grows until its quota
    refuses every write (the launcher's, compose's and the systemd unit's etcd alike)."""
    from services.common.etcd_launcher import LocalEtcd

    environment = " ".join(directives("ferry-etcd.service")["Environment"])
    assert "ETCD_AUTO_COMPACTION_MODE=periodic" in environment and "ETCD_AUTO_COMPACTION_RETENTION=1h" in environment
    compose = (UNIT_DIR.parent / "docker-compose.yml").read_text()
    assert "--auto-compaction-mode=periodic" in compose and "--auto-compaction-retention=1h" in compose
    command = " ".join(LocalEtcd(data_dir=tmp_path, log_dir=tmp_path)._command())
    assert "--auto-compaction-mode periodic --auto-compaction-retention 1h" in command


def test_install_runs_the_pins_script_with_the_venvs_python():
    """scripts/pins.py reads pyproject.toml with tomllib (Python 3.11+); INSTALL.md makes the venv with
    python3.11 because a host's python3 may be older, where `python3 scripts/pins.py` fails and pip gets
    no requirements."""
    install = (UNIT_DIR / "INSTALL.md").read_text()
    assert "scripts/pins.py" in install and "python3 scripts/pins.py" not in install


def test_the_transfer_service_gets_the_launchers_thread_count():
    """Not torch's default (a thread per core, contending with the instances): as `--transfer-threads`."""
    assert env_file("transfer.env")["FERRY_TRANSFER_NUM_THREADS"] == str(TRANSFER_THREADS)
