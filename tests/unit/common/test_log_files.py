"""Child logs are rotated before a (re)start once past the cap."""

from __future__ import annotations

from services.common.log_files import rotate_log


def test_a_log_past_the_cap_becomes_dot_1_and_a_small_one_stays(tmp_path):
    log = tmp_path / "instance-0.log"
    log.write_bytes(b"x" * 10)
    rotate_log(log, max_bytes=100)
    assert log.read_bytes() == b"x" * 10 and not (tmp_path / "instance-0.log.1").exists()
    log.write_bytes(b"y" * 101)
    (tmp_path / "instance-0.log.1").write_bytes(b"older")
    rotate_log(log, max_bytes=100)
    assert not log.exists() and (tmp_path / "instance-0.log.1").read_bytes() == b"y" * 101
    rotate_log(tmp_path / "missing.log", max_bytes=100)  # nothing to rotate: no error
