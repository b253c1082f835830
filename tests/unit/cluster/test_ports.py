"""The launcher refuses to start on a port something already listens on (another cluster's
frontend or manager would otherwise answer its health checks and the banner would lie)."""

from __future__ import annotations

import pathlib
import socket

import pytest

from services.cluster.launcher import ClusterSpec, PortInUse, check_ports_free
from services.common import etcd_launcher
from services.common.etcd_launcher import free_port

pytestmark = pytest.mark.timeout(10)


def spec(http_port: int, admin_port: int, autoscale_max_instances: int = 0) -> ClusterSpec:
    return ClusterSpec(model_dir=pathlib.Path("/models/tiny"), roles=("both", "both"), num_managers=1, engine="torch",
                       transfer_backend="auto", http_port=http_port, admin_port=admin_port, state_dir=None,
                       cluster="ferry", threads_per_instance=1, kv_cache_mib=16, log_format="console",
                       autoscale_max_instances=autoscale_max_instances)


@pytest.mark.parametrize("host, flag", [("127.0.0.1", "--admin-port"), ("0.0.0.0", "--http-port")])
def test_a_port_with_a_listener_is_refused_naming_the_flag(host, flag):
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, 0))
        listener.listen()
        taken, free = listener.getsockname()[1], free_port()
        ports = (taken, free) if flag == "--http-port" else (free, taken)
        with pytest.raises(PortInUse, match=f"{flag} {taken} is already in use"):
            check_ports_free(spec(*ports))
    check_ports_free(spec(free_port(), free_port()))


def test_only_autoscale_makes_the_launcher_follow_scaling():
    assert not spec(1, 2).follows_scaling  # a policy stored in the state dir must not resize it
    assert spec(1, 2, autoscale_max_instances=4).follows_scaling


def test_the_users_ports_are_never_handed_to_a_child(monkeypatch):
    """A launcher once gave etcd its --http-port: the frontend could not bind, and etcd's own /health
    answered the launcher's probe (found by a black-box run)."""
    http_port, admin_port = free_port(), free_port()
    check_ports_free(spec(http_port, admin_port))  # reserves them
    picks = iter([http_port, admin_port, http_port])
    real = etcd_launcher._PORT_PICKER.randrange
    monkeypatch.setattr(etcd_launcher._PORT_PICKER, "randrange", lambda low, high: next(picks, None) or real(low, high))
    assert free_port() not in (http_port, admin_port)


def test_a_port_handed_out_once_is_not_handed_out_again(monkeypatch):
    """Nothing listens on it yet (its child is still starting): it must go to that child only."""
    first = free_port()
    picks = iter([first, first])
    real = etcd_launcher._PORT_PICKER.randrange
    monkeypatch.setattr(etcd_launcher._PORT_PICKER, "randrange", lambda low, high: next(picks, None) or real(low, high))
    assert free_port() != first


def test_ports_are_picked_only_from_ferry_port_range(monkeypatch):
    low = free_port()
    monkeypatch.setenv(etcd_launcher.PORT_RANGE_ENV, f"{low}-{low + 9}")
    assert etcd_launcher.port_range() == (low, low + 9)
    assert all(low <= free_port() <= low + 9 for _ in range(3))


def test_a_full_ferry_port_range_fails_naming_it_instead_of_leaving_it(monkeypatch):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", free_port()))
        taken = listener.getsockname()[1]
        monkeypatch.setenv(etcd_launcher.PORT_RANGE_ENV, f"{taken - 1}-{taken}")
        etcd_launcher.reserve_port(taken - 1)
        with pytest.raises(OSError, match=f"no free port in FERRY_PORT_RANGE={taken - 1}-{taken}"):
            free_port()


@pytest.mark.parametrize("spec", ["20000", "20000-", "x-y", "30000-20000", "80-90", "20000-70000"])
def test_a_malformed_ferry_port_range_is_refused_naming_it(monkeypatch, spec):
    monkeypatch.setenv(etcd_launcher.PORT_RANGE_ENV, spec)
    with pytest.raises(ValueError, match="FERRY_PORT_RANGE=.*expected LOW-HIGH"):
        free_port()
