"""scale_hooks' choices without etcd: which index to start, and a failed stop tried again."""

from __future__ import annotations

import pytest

from services.cluster.scale_hooks import HookFollower, lowest_free_index, parse_args
from services.common.scaling_target import ScalingTarget

pytestmark = pytest.mark.timeout(10)


def test_the_next_index_fills_the_gap_a_retirement_left():
    assert lowest_free_index([]) == 0
    assert lowest_free_index(["host-0", "host-1"]) == 2
    assert lowest_free_index(["host-0", "host-2", "host-3"]) == 1  # before: 4, a unit with no env file


def test_a_failed_stop_command_is_run_again_on_the_next_tick(tmp_path):
    marker = tmp_path / "stopped"
    follower = HookFollower("true", f"sh -c 'test -e {marker}.ok && touch {marker}'", 5.0, 60.0)
    target = ScalingTarget(1, stoppable=["host-1"], manager_id="m")
    follower.step(target, ["host-0", "host-1"])  # the stop command fails
    assert not marker.exists() and not follower.stop_requested
    (tmp_path / "stopped.ok").touch()
    follower.step(target, ["host-0", "host-1"])
    assert marker.exists() and follower.stop_requested == {"host-1"}


@pytest.mark.parametrize(("flag", "value", "named"), [
    ("--cluster", "", "--cluster is empty"),
    ("--cluster", "a/b", "--cluster 'a/b'"),
    ("--etcd-endpoints", "http://etcd:2379", "--etcd-endpoints 'http://etcd:2379'"),
    ("--interval-s", "nan", "--interval-s must be a positive"),
    ("--command-timeout-s", "0", "--command-timeout-s must be a positive"),
    ("--add-timeout-s", "-1", "--add-timeout-s must be a positive"),
])
def test_a_bad_flag_is_a_one_line_usage_error_naming_it(flag, value, named, capsys):
    argv = ["--etcd-endpoints", "127.0.0.1:2379", "--add-command", "true", "--stop-command", "true", flag, value]
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert named in error and error.count("\n") == 1
