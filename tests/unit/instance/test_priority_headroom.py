"""--priority-headroom-blocks from the flag to the load report the manager reads."""

from __future__ import annotations

import pytest

from services.common.config import parse_config
from services.instance.app import engine_spec
from services.instance.config import InstanceConfig
from services.instance.convert import load_to_proto
from services.instance.engine.engine_reports import LoadSnapshot

pytestmark = pytest.mark.timeout(10)


def test_the_flag_reaches_the_engine_spec():
    config = parse_config(InstanceConfig, "instance", ["--model", "m", "--priority-headroom-blocks", "12"], env={})
    assert engine_spec(config, "kv").priority_headroom_blocks == 12
    default = parse_config(InstanceConfig, "instance", ["--model", "m"], env={})
    assert engine_spec(default, "kv").priority_headroom_blocks == 0


def test_the_load_report_carries_the_headroom_and_the_freeness_that_counts_it():
    load = LoadSnapshot(num_running=1, num_waiting=0, num_free_blocks=40, num_total_blocks=64,
                        num_blocks_needed_by_waiting=0, freeness=(40 - 10) / 2, num_headroom_blocks=10)
    report = load_to_proto("i-0", load, num_requests_served=0, timestamp=0.0)
    assert (report.num_headroom_blocks, report.freeness) == (10, 15.0)
